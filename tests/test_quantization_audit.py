"""QLoRA / LoRA setup against TRL 1.16's own steps on the same tiny model (real bitsandbytes, its CPU backend): the
policy groupwise builds from a path + quantization_config + use_peft is the one TRL's create_model_from_path +
get_peft_config + get_peft_model builds (dtypes of the unquantized parts, what trains, no
prepare_model_for_kbit_training casting: TRL's GRPOTrainer does not call it), π_ref is the quantized base with the
adapters off, the saved adapter loads back onto a 4-bit base, the script fields read as TRL reads them."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")
trl = pytest.importorskip("trl")
from peft import PeftModel, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402
from trl.trainer.utils import create_model_from_path, get_peft_config, get_quantization_config  # noqa: E402

from groupwise import GRPOConfig, GRPOTrainer  # noqa: E402
from groupwise.adapters import peft_config_from_args  # noqa: E402
from groupwise.cli import build_run  # noqa: E402
from groupwise.config_base import ConfigError  # noqa: E402
from groupwise.loading import load_policy  # noqa: E402
from groupwise.tasks import toy  # noqa: E402
from tests.conftest import small_args  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])


def _length(completions, **_):
    return [float(len(c)) for c in completions]


def _layout(model) -> dict[str, tuple]:
    return {n: (p.dtype, p.requires_grad, type(p).__name__) for n, p in model.named_parameters()}


@pytest.mark.parametrize("quant, extra", [
    (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16), {"lora_modules_to_save": ["lm_head"]}),
    (BitsAndBytesConfig(load_in_8bit=True), {}),
])
def test_the_quantized_policy_is_the_one_trl_builds(tmp_path, base_dir, quant, extra):
    """dtype bfloat16 + use_peft (TRL's defaults: r 16, α 32, PEFT's targets for Llama, q_proj / v_proj): the same
    parameters, dtypes and trainable set as TRL's steps. Norms, embeddings and the head stay bfloat16 (TRL's GRPO does
    not run prepare_model_for_kbit_training, which would make them float32); the adapters are float32 in both before
    TRL's own cast of them to bfloat16 (docs/trl_compat.md: groupwise keeps them float32)."""
    args = small_args(tmp_path, use_peft=True, model_init_kwargs={"dtype": "bfloat16"}, **extra)
    ours = GRPOTrainer(base_dir, [_length], args=args, train_dataset=toy.dataset(8), quantization_config=quant).unwrapped
    model_args = trl.ModelConfig(model_name_or_path=base_dir, use_peft=True, **extra)
    theirs = get_peft_model(create_model_from_path(base_dir, dtype="bfloat16", quantization_config=quant),
                            get_peft_config(model_args))
    assert _layout(ours) == _layout(theirs)
    assert ours.peft_config["default"].target_modules == theirs.peft_config["default"].target_modules == {"q_proj", "v_proj"}
    base = ours.get_base_model()
    layer = base.model.layers[0]
    assert isinstance(layer.mlp.up_proj, bnb.nn.Linear4bit if quant.load_in_4bit else bnb.nn.Linear8bitLt)
    for p in (base.model.norm.weight, layer.input_layernorm.weight, base.model.embed_tokens.weight):
        assert p.dtype == torch.bfloat16 and not p.requires_grad
    if quant.load_in_4bit:
        assert layer.mlp.up_proj.compute_dtype == torch.bfloat16  # the BitsAndBytesConfig's, as given
        # modules_to_save: the head (kept out of quantization by transformers) trains as a full copy
        trained_head = {n for n, p in ours.named_parameters() if p.requires_grad and "lm_head" in n}
        assert trained_head == {"base_model.model.lm_head.modules_to_save.default.weight"}
    trainable = [p for p in ours.parameters() if p.requires_grad]
    # r = 16 on q_proj (32 → 32) and v_proj (32 → 16, 2 KV heads of 8) in 2 layers: A 16×32 each, B 32×16 and 16×16
    lora = 2 * (16 * 32 + 32 * 16 + 16 * 32 + 16 * 16)
    head = ours.get_base_model().lm_head.modules_to_save["default"].weight.numel() if extra else 0
    assert sum(p.numel() for p in trainable) == lora + head


def test_reference_is_the_4bit_base_and_the_saved_adapter_loads_back(tmp_path, base_dir):
    """β > 0 with gradient checkpointing: the embeddings' output requires grad (TRL's enable_input_require_grads),
    so layer 0's adapter learns; π_ref (adapters off) is a freshly loaded 4-bit base bit for bit after training;
    save_model writes the adapter only (safetensors), which PeftModel.from_pretrained puts back onto a 4-bit base
    giving the trained policy's logits bit for bit."""
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    args = small_args(tmp_path, use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, beta=0.05,
                      gradient_checkpointing=True, max_steps=2)
    t = GRPOTrainer(base_dir, [_length], args=args, train_dataset=toy.dataset(12), quantization_config=quant)
    model = t.unwrapped
    assert model.get_input_embeddings()(IDS).requires_grad
    first_b = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"
    before = model.get_parameter(first_b).detach().clone()
    assert not before.any()  # LoRA's B starts at 0: the initial policy is the base
    t.train()
    assert model.get_parameter(first_b).detach().abs().sum() > 0
    model.eval()
    fresh = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=quant).eval()
    with torch.no_grad():
        with t.reference.context():
            ref = t.reference.logps_model(input_ids=IDS).logits
        policy = model(input_ids=IDS).logits
        base = fresh(input_ids=IDS).logits
    assert t.reference.copy is None and torch.equal(ref, base) and not torch.equal(policy, base)

    out = tmp_path / "final"
    t.save_model(str(out))
    assert (out / "adapter_model.safetensors").exists() and (out / "adapter_config.json").exists()
    assert not (out / "model.safetensors").exists()
    loaded = PeftModel.from_pretrained(fresh, str(out)).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=IDS).logits, policy)


def test_a_quantized_policy_goes_to_the_local_process_device(tmp_path, monkeypatch):
    """TRL's get_kbit_device_map ({"": local process's device}) on a GPU; on CPU no device_map (TRL: None); a
    device_map in model_init_kwargs wins. (from_pretrained stubbed: no GPU here.)"""
    seen = []

    class Stub(torch.nn.Linear):
        config = type("C", (), {})()

    def fake(path, **kwargs):
        seen.append(kwargs)
        return Stub(2, 2)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fake)
    monkeypatch.setattr("groupwise.loading.unapplied_generation_config", lambda *a: {})
    quant = BitsAndBytesConfig(load_in_4bit=True)
    args = GRPOConfig(output_dir=str(tmp_path))
    load_policy("m", args, quant, torch.device("cuda", 1))
    load_policy("m", args, quant, torch.device("cpu"))
    load_policy("m", args, None, torch.device("cuda", 1))
    load_policy("m", GRPOConfig(output_dir=str(tmp_path), model_init_kwargs={"device_map": "auto"}), quant,
                torch.device("cuda", 0))
    assert seen[0]["device_map"] == {"": torch.device("cuda", 1)} and seen[0]["quantization_config"] is quant
    assert "device_map" not in seen[1] and "device_map" not in seen[2]
    assert seen[3]["device_map"] == "auto"
    assert all(k["dtype"] is torch.float32 for k in seen)  # TRL's create_model_from_path default


@pytest.mark.parametrize("targets, expected", [
    ([r".*\.q_proj"], {"q_proj"}),  # TRL: a list of one is that string, a regular expression
    ([r".*(q|v)_proj"], {"q_proj", "v_proj"}),
    (["all-linear"], {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
    (["q_proj", "v_proj"], {"q_proj", "v_proj"}),
    (None, {"q_proj", "v_proj"}),  # PEFT's default for Llama
])
def test_lora_target_modules_read_as_trl_reads_them(tmp_path, tokenizer, targets, expected):
    def adapted(config):
        wrapped = get_peft_model(toy.build_model(tokenizer, hidden_size=32), config)
        return {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in wrapped.named_parameters() if "lora_A" in n}

    ours = peft_config_from_args(GRPOConfig(output_dir=str(tmp_path), use_peft=True, lora_target_modules=targets))
    theirs = get_peft_config(trl.ModelConfig(model_name_or_path="m", use_peft=True, lora_target_modules=targets))
    assert adapted(ours) == adapted(theirs) == expected


def test_a_list_of_one_plain_name_targets_that_name(tmp_path, tokenizer):
    """TRL turns [q_proj] into the regular expression 'q_proj', which matches no full module name (an error there);
    groupwise targets the modules named q_proj (listed in docs/trl_compat.md)."""
    theirs = get_peft_config(trl.ModelConfig(model_name_or_path="m", use_peft=True, lora_target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="not found in the base model"):
        get_peft_model(toy.build_model(tokenizer, hidden_size=32), theirs)
    ours = peft_config_from_args(GRPOConfig(output_dir=str(tmp_path), use_peft=True, lora_target_modules=["q_proj"]))
    wrapped = get_peft_model(toy.build_model(tokenizer, hidden_size=32), ours)
    assert sum("lora_A" in n for n, _ in wrapped.named_parameters()) == 2  # q_proj of the 2 layers


@pytest.mark.parametrize("rslora, scaling", [(False, 2.0), (True, 8.0)])
def test_lora_scaling_is_trls(tmp_path, tokenizer, rslora, scaling):
    """TRL's defaults r = 16, α = 32: α / r = 2; use_rslora: α / √r = 32 / 4 = 8."""
    ours = peft_config_from_args(GRPOConfig(output_dir=str(tmp_path), use_peft=True, use_rslora=rslora))
    theirs = get_peft_config(trl.ModelConfig(model_name_or_path="m", use_peft=True, use_rslora=rslora))
    assert ours.to_dict() == theirs.to_dict()
    wrapped = get_peft_model(toy.build_model(tokenizer, hidden_size=32), ours)
    assert wrapped.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"] == scaling


def test_load_in_4bit_with_dtype_auto_is_one_line_naming_the_fix():
    """TRL passes dtype 'auto' on as the compute dtype and BitsAndBytesConfig fails (getattr(torch, 'auto'));
    groupwise said nothing and computed in float32. Now: an error before loading, naming the fields."""
    with pytest.raises(AttributeError, match="auto"):
        get_quantization_config(trl.ModelConfig(model_name_or_path="m", load_in_4bit=True, dtype="auto"))
    with pytest.raises(ConfigError) as e:
        build_run({"model_name_or_path": "m", "load_in_4bit": True, "dtype": "auto"})
    assert "\n" not in str(e.value)
    assert "load_in_4bit=True with dtype='auto'" in str(e.value) and "set dtype to 'bfloat16'" in str(e.value)
    # 8 bits has no compute dtype: 'auto' is fine, as in TRL
    run, args = build_run({"model_name_or_path": "m", "load_in_8bit": True, "dtype": "auto"})
    expected = get_quantization_config(trl.ModelConfig(model_name_or_path="m", load_in_8bit=True, dtype="auto"))
    assert run["quantization_config"].to_dict() == expected.to_dict() and args.model_init_kwargs["dtype"] == "auto"
