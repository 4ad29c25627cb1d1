"""Vision-language training (TRL 1.16 trains LLaVA-style models on image datasets) is not supported yet: each way a
TRL user asks for it is refused by name before the weights load, instead of a raw transformers error, an
AttributeError, or a run that silently drops the images."""

from __future__ import annotations

import pytest
from transformers import CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaProcessor

from groupwise import ConfigError, GRPOTrainer
from groupwise.tasks import toy
from tests.conftest import small_args


def test_a_vision_language_model_path_a_processor_and_image_columns_are_refused_by_name(tmp_path, tokenizer,
                                                                                        tiny_model):
    tok = toy.build_tool_tokenizer()
    vlm = tmp_path / "tiny-vlm"  # a LLaVA config and its tokenizer: the refusal comes before any weight loads
    LlavaConfig(vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, image_size=28, patch_size=14),
                text_config=LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=1, num_attention_heads=4)).save_pretrained(vlm)
    tok.save_pretrained(vlm)
    rows = [{"prompt": "describe it", "letter": "a", "image": None}] * 8
    text_rows = [{"prompt": "describe it", "letter": "a"}] * 8
    with pytest.raises(ConfigError, match="is a LlavaConfig, which AutoModelForCausalLM cannot load: groupwise "
                                          "trains causal language models"):
        GRPOTrainer(str(vlm), [toy.letter_reward], args=small_args(tmp_path), train_dataset=text_rows)
    processor = LlavaProcessor(image_processor=CLIPImageProcessor(), tokenizer=tok)
    with pytest.raises(ConfigError, match="processing_class is a LlavaProcessor, a multimodal processor.*"
                                          r"processing_class=processor.tokenizer"):
        GRPOTrainer(tiny_model, [toy.letter_reward], args=small_args(tmp_path), train_dataset=text_rows,
                    processing_class=processor)
    # a text model with an image column: TRL fails on the missing pixel_values; here the column is named
    with pytest.raises(ConfigError, match=r"train_dataset has an 'image' column: .*remove_columns\('image'\)"):
        GRPOTrainer(tiny_model, [toy.letter_reward], args=small_args(tmp_path), train_dataset=rows,
                    processing_class=tokenizer)
    with pytest.raises(ConfigError, match="eval_dataset has an 'images' column"):
        GRPOTrainer(tiny_model, [toy.letter_reward], args=small_args(tmp_path), train_dataset=text_rows,
                    eval_dataset=[{"prompt": "x", "letter": "a", "images": []}] * 2, processing_class=tokenizer)
    trainer = GRPOTrainer(tiny_model, [toy.letter_reward], args=small_args(tmp_path), train_dataset=text_rows,
                          processing_class=tokenizer)
    with pytest.raises(ConfigError, match="eval_dataset has an 'image' column"):  # evaluate()'s own dataset too
        trainer.evaluate(eval_dataset=rows)
