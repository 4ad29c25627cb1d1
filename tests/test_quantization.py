"""QLoRA: TRL's GRPOTrainer(quantization_config=BitsAndBytesConfig(…)) and the script fields load_in_4bit /
load_in_8bit / bnb_*: the base loads in 4 bits (real bitsandbytes, its CPU backend) and stays frozen, the LoRA
adapters train, the reference is the quantized base with the adapters off, resume is bitwise exact; what cannot work
is refused before the weights load."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")
from peft import LoraConfig  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402

from groupwise import GRPOTrainer  # noqa: E402
from groupwise.cli import build_run  # noqa: E402
from groupwise.config_base import ConfigError  # noqa: E402
from groupwise.modeling import PolicyForLogps, completion_logps  # noqa: E402
from groupwise.quantization import is_quantized  # noqa: E402
from groupwise.tasks import toy  # noqa: E402
from tests.conftest import small_args  # noqa: E402

FOUR_BIT = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)


def _lora():
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def _length(completions, **_):
    return [float(len(c)) for c in completions]  # varied rewards: every step moves the adapter


def _trainer(tmp_path, base_dir, out="run", quantization_config=FOUR_BIT, peft_config="lora", **kw):
    args = small_args(tmp_path, output_dir=str(tmp_path / out), **kw)
    return GRPOTrainer(base_dir, [_length], args=args, train_dataset=toy.dataset(12),
                       quantization_config=quantization_config, peft_config=_lora() if peft_config == "lora" else None)


def test_a_4bit_base_trains_its_adapters_and_resumes_exactly(tmp_path, base_dir):
    straight = _trainer(tmp_path, base_dir, out="a", beta=0.05, max_steps=2, save_steps=1)
    model = straight.unwrapped
    assert is_quantized(model)
    layer = model.base_model.model.model.layers[0]
    assert isinstance(layer.mlp.up_proj, bnb.nn.Linear4bit)  # the base's linear layers hold 4-bit weights
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert straight.reference.copy is None  # π_ref: the quantized base with the adapters off, no second model
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    straight.train()
    assert all(torch.equal(frozen[n], p) for n, p in model.named_parameters() if n in frozen)
    assert any(not torch.equal(adapters[n], p) for n, p in model.named_parameters() if n in adapters)
    ckpt = tmp_path / "a" / "checkpoint-2"
    assert (ckpt / "adapter_model.safetensors").exists() and not (ckpt / "model.safetensors").exists()
    # a resume reloads the base quantized from its path and continues bit for bit
    resumed = _trainer(tmp_path, base_dir, out="b", beta=0.05, max_steps=2, save_steps=1)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-1"))
    for (name, a), b in zip(model.named_parameters(), resumed.unwrapped.parameters()):
        assert torch.equal(a, b), name


def test_a_quantized_head_is_never_read_as_a_plain_matrix(base_dir):
    """bitsandbytes' Linear4bit subclasses nn.Linear but keeps its weight packed: a quantized output head takes the
    full-logits path, whose log-probs are the model's own."""
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32, llm_int8_skip_modules=[])
    model = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=config)
    assert isinstance(model.get_output_embeddings(), bnb.nn.Linear4bit)
    wrapped = PolicyForLogps(model)
    assert not wrapped.chunked
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    mask = torch.ones_like(ids)
    got, _ = wrapped(ids, mask, 3)
    expected, _ = completion_logps(model, ids, mask, 3)
    assert torch.equal(got, expected) and got.isfinite().all()


def test_what_cannot_work_is_refused_before_the_weights_load(tmp_path, base_dir, tiny_model, monkeypatch):
    with pytest.raises(ConfigError, match=r"quantized weights cannot be trained; train adapters on them \(QLoRA\)"):
        _trainer(tmp_path, base_dir, peft_config=None)
    with pytest.raises(ConfigError, match="quantization_config applies when the model is loaded from a path"):
        GRPOTrainer(tiny_model, [_length], args=small_args(tmp_path), train_dataset=toy.dataset(4),
                    processing_class=toy.build_tokenizer(), quantization_config=FOUR_BIT, peft_config=_lora())
    with pytest.raises(ConfigError, match="both as a GRPOTrainer argument and in model_init_kwargs"):
        _trainer(tmp_path, base_dir, model_init_kwargs={"quantization_config": FOUR_BIT})
    with pytest.raises(ConfigError, match="with generation_dtype is not supported yet"):
        _trainer(tmp_path, base_dir, generation_dtype="bfloat16")
    from groupwise.quantization import check_quantization

    for config in (BitsAndBytesConfig(load_in_8bit=True), {"load_in_8bit": True}):  # 4 bits: tests/test_fsdp.py
        with pytest.raises(ConfigError, match=r"^quantization_config with fsdp is supported in 4 bits only .*load the "
                                              r"base with load_in_4bit, or drop fsdp"):
            check_quantization(small_args(tmp_path), "path", config, lora=True, sharded=True)
        check_quantization(small_args(tmp_path), "path", config, lora=True, sharded=False)
    check_quantization(small_args(tmp_path), "path", FOUR_BIT, lora=True, sharded=True)
    with pytest.raises(ConfigError, match="quant_method 'gptq' is not supported"):  # another quantizer, any fsdp
        check_quantization(small_args(tmp_path), "path", {"quant_method": "gptq", "bits": 4}, lora=True, sharded=True)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(ConfigError, match=r"quantization_config loads the model with bitsandbytes, which is not "
                                          r"installed: `pip install bitsandbytes`"):
        _trainer(tmp_path, base_dir)


def test_a_model_loaded_in_4bit_and_passed_in_needs_adapters(tmp_path, base_dir, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=FOUR_BIT)
    with pytest.raises(ConfigError, match="a model loaded in 4 / 8 bits: quantized weights cannot be trained"):
        GRPOTrainer(model, [_length], args=small_args(tmp_path), train_dataset=toy.dataset(4),
                    processing_class=tokenizer)


@pytest.mark.parametrize("fields", [
    {"load_in_4bit": True, "dtype": "bfloat16", "bnb_4bit_quant_type": "fp4", "use_bnb_nested_quant": True},
    {"load_in_4bit": True, "bnb_4bit_quant_storage": "bfloat16"},
    {"load_in_8bit": True},
    {},
])
def test_script_fields_build_trls_quantization_config(fields):
    """`groupwise train`'s fields give the BitsAndBytesConfig TRL's get_quantization_config builds from ModelConfig."""
    trl = pytest.importorskip("trl")
    from trl.trainer.utils import get_quantization_config

    run, _ = build_run({"model_name_or_path": "m", **fields})
    expected = get_quantization_config(trl.ModelConfig(model_name_or_path="m", **fields))
    assert (run["quantization_config"] is None) == (expected is None)
    if expected is not None:
        assert run["quantization_config"].to_dict() == expected.to_dict()


def test_4bit_options_without_load_in_4bit_are_an_error():
    with pytest.raises(ConfigError, match="bnb_4bit_quant_type='fp4' has no effect without load_in_4bit=True"):
        build_run({"model_name_or_path": "m", "bnb_4bit_quant_type": "fp4"})


def test_quantization_config_in_model_init_kwargs_is_checked_alike(tmp_path, base_dir):
    """TRL also takes it in model_init_kwargs: the same checks (here: adapters needed) before the weights load."""
    with pytest.raises(ConfigError, match="quantized weights cannot be trained"):
        GRPOTrainer(base_dir, [_length], args=small_args(tmp_path, model_init_kwargs={"quantization_config": FOUR_BIT}),
                    train_dataset=toy.dataset(4))
    with pytest.raises(ConfigError, match="bnb_4bit_quant_type='fp4' has no effect without load_in_4bit=True"):
        build_run({"model_name_or_path": "m", "load_in_8bit": True, "bnb_4bit_quant_type": "fp4"})


def test_a_checkpoint_saved_in_4bit_is_checked_and_its_adapter_exports(tmp_path, base_dir, monkeypatch):
    """A folder saved quantized (config.json holds its quantization_config; the hub's *-bnb-4bit models) loads in 4
    bits without being asked. It skipped every check: without adapters the norms, embeddings and head trained and
    the first save crashed (transformers cannot write 4-bit weights back); with generation_dtype a raw load error.
    Now it is checked as quantization_config is, and `export --merge` of its adapter (which crashed writing the
    merged model) merges into the dequantized base: the merged model computes what the adapter over the 4-bit base
    computes."""
    saved = tmp_path / "base-4bit"
    AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=FOUR_BIT).save_pretrained(saved)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(base_dir).save_pretrained(saved)
    with pytest.raises(ConfigError, match=r"saved quantized \(its config.json's quantization_config\): quantized "
                                          r"weights cannot be trained; train adapters on them"):
        _trainer(tmp_path, str(saved), quantization_config=None, peft_config=None)
    with pytest.raises(ConfigError, match="saved quantized .* with generation_dtype is not supported yet"):
        _trainer(tmp_path, str(saved), quantization_config=None, generation_dtype="bfloat16")
    t = _trainer(tmp_path, str(saved), quantization_config=None, max_steps=2)
    assert is_quantized(t.unwrapped)
    t.train()
    t.save_model(str(tmp_path / "adapter"))

    from peft import PeftModel

    from groupwise.cli import main

    assert main(["export", str(tmp_path / "adapter"), "--merge", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not is_quantized(merged) and "quantization_config" not in merged.config.to_dict()
    over_4bit = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(saved), str(tmp_path / "adapter")).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    with torch.no_grad():  # the 4-bit matmul dequantizes the same blocks: equal up to float32 rounding
        torch.testing.assert_close(merged(input_ids=ids).logits, over_4bit(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


def test_non_bitsandbytes_quantization_is_refused_naming_the_method(tmp_path, base_dir):
    import json
    import shutil

    folder = tmp_path / "gptq"
    shutil.copytree(base_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"quant_method 'gptq' is not supported; groupwise trains adapters on "
                                          "bitsandbytes"):
        _trainer(tmp_path, str(folder), quantization_config=None)


def test_configs_that_dequantize_as_they_load_train_as_any_model(tmp_path):
    """transformers' advice for training gpt-oss (and TRL's recipe): quantization_config=Mxfp4Config(dequantize=True)
    loads full-precision weights, as a GGUF file does; the non-bitsandbytes refusal took them for quantized bases.
    (Mxfp4Config.to_dict() leaves `dequantize` out: it is read from the object.)"""
    import types

    from transformers import FineGrainedFP8Config, Mxfp4Config

    from groupwise.quantization import check_quantization

    args = small_args(tmp_path)
    for config in (Mxfp4Config(dequantize=True), FineGrainedFP8Config(dequantize=True)):
        check_quantization(args, "path", config, lora=False, sharded=True)
    with pytest.raises(ConfigError, match=r"quant_method 'mxfp4' is not supported; .* dequantize=True"):
        check_quantization(args, "path", Mxfp4Config(), lora=True, sharded=False)
    gguf = types.SimpleNamespace(hf_quantizer=types.SimpleNamespace(quantization_config={"quant_method": "gguf"}))
    fp8 = types.SimpleNamespace(hf_quantizer=types.SimpleNamespace(quantization_config={"quant_method": "fp8"}))
    assert not is_quantized(gguf) and is_quantized(fp8)
