"""Vision-language training (TRL 1.16 trains LLaVA-style models on image datasets) is not supported yet: each way a
TRL user asks for it is refused by name before the weights load, instead of a raw transformers error, an
AttributeError, or a run that silently drops the images."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
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
    save_file({"placeholder": torch.zeros(1)}, str(vlm / "model.safetensors"))  # a model folder holds weights
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


def test_image_content_blocks_and_a_stream_s_image_column_are_refused_not_dropped(tmp_path, tokenizer, tiny_model):
    """Two ways images reached a text model unrefused: a content block {"type": "image"} in a conversational prompt
    (the chat template rendered the text blocks alone; reward functions still got the image), and an `images` key in
    the rows of a stream that declares no columns (read only as rows arrive). Both trained on the text silently."""
    import datasets

    chat = toy.build_tool_tokenizer()
    model = toy.build_model(chat, seed=0, hidden_size=32)
    block = [{"role": "user", "content": [{"type": "image", "image": None}, {"type": "text", "text": "what?"}]}]
    with pytest.raises(ConfigError, match=r"train_dataset row 0 has message 0 with a content block of type 'image': "
                                          r"groupwise trains text-only"):
        GRPOTrainer(model, [toy.letter_reward], args=small_args(tmp_path), processing_class=chat,
                    train_dataset=[{"prompt": block, "letter": "a"}] * 8)
    text = [{"role": "user", "content": [{"type": "text", "text": "what?"}]}]  # text blocks: accepted
    GRPOTrainer(model, [toy.letter_reward], args=small_args(tmp_path), processing_class=chat,
                train_dataset=[{"prompt": text, "letter": "a"}] * 8)

    def rows():
        for _ in range(8):
            yield {"prompt": "describe it", "letter": "a", "images": [[0]]}

    stream = datasets.IterableDataset.from_generator(rows)
    assert stream.column_names is None  # nothing to check before the rows are read
    trainer = GRPOTrainer(tiny_model, [toy.letter_reward], args=small_args(tmp_path, max_steps=1),
                          processing_class=tokenizer, train_dataset=stream)
    with pytest.raises(ConfigError, match=r"train_dataset row 0 has an 'images' column: groupwise trains text-only"):
        trainer.train()
