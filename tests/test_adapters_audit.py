"""LoRA, accelerate state and FSDP launch settings, from an audit: the reference of a passed-in adapter is that
adapter as it started (TRL's frozen "ref" copy), `lora_target_modules: [all-linear]` is peft's shortcut (TRL),
targets that match nothing name the field, merging for a sampler leaves the frozen base bit for bit, a frozen
PeftModel, prompt learning and adapters added by transformers are refused by name, trainers of different bf16
settings follow each other in one process, and accelerate FSDP settings groupwise does not apply are refused."""

from __future__ import annotations

import copy
import importlib.metadata

import pytest
import torch

pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

from groupwise import GRPOTrainer  # noqa: E402
from groupwise.adapters import Reference, check_passed_model, merged  # noqa: E402
from groupwise.config_base import ConfigError  # noqa: E402
from groupwise.modeling import batched_logps  # noqa: E402
from groupwise.tasks import toy  # noqa: E402
from tests.conftest import small_args  # noqa: E402


def _length(completions, **_):
    return [float(len(c)) for c in completions]  # varied rewards: every step moves the adapter


def _trained_adapter(tokenizer, dtype=torch.float32):
    """A PeftModel whose adapter is not at its zero start (as after SFT): policy ≠ base model."""
    model = get_peft_model(toy.build_model(tokenizer, seed=0, hidden_size=32).to(dtype),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    return model


def test_all_linear_in_a_list_is_peft_s_shortcut(tmp_path, base_dir):
    # a config file's `lora_target_modules: [all-linear]` (TRL's ModelConfig unwraps a one-element list)
    t = GRPOTrainer(base_dir, [_length], args=small_args(tmp_path, use_peft=True, lora_target_modules=["all-linear"]),
                    train_dataset=toy.dataset(8))
    adapted = {n.rsplit(".", 1)[-1] for n in t.unwrapped.peft_config["default"].target_modules}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_targets_that_match_nothing_name_the_field(tmp_path, base_dir):
    with pytest.raises(ConfigError, match=r"match no module of LlamaForCausalLM: set lora_target_modules .*'q_proj'"):
        GRPOTrainer(base_dir, [_length], args=small_args(tmp_path, use_peft=True, lora_target_modules="q_proj"),
                    train_dataset=toy.dataset(8))
    with pytest.raises(TypeError, match="peft_config must be a peft.PeftConfig .*got dict"):  # TRL's check
        GRPOTrainer(base_dir, [_length], args=small_args(tmp_path), train_dataset=toy.dataset(8),
                    peft_config={"r": 4, "target_modules": ["q_proj"]})


def test_a_passed_in_adapter_is_its_own_reference(tmp_path, tokenizer):
    """TRL: a PeftModel given to the trainer keeps a frozen copy of its adapter as π_ref (the initial policy,
    DeepSeekMath Alg. 1), not the base model under it; the trained adapter is back after the reference pass."""
    policy = _trained_adapter(tokenizer)
    initial = copy.deepcopy(policy)
    t = GRPOTrainer(policy, [_length], args=small_args(tmp_path, beta=0.1, max_steps=1),
                    train_dataset=toy.dataset(12), processing_class=tokenizer)
    t.train()  # the adapter moves away from where it started
    trained = {n: p.detach().clone() for n, p in t.unwrapped.named_parameters()}
    batch = t._collect().batch
    T = batch.completion_mask.size(1)
    expected = batched_logps(initial, batch.input_ids, batch.attention_mask, T, temperature=1.0, batch_size=8)
    assert torch.allclose(batch.ref_logps, expected, atol=1e-6)
    with initial.disable_adapter():
        base = batched_logps(initial, batch.input_ids, batch.attention_mask, T, temperature=1.0, batch_size=8)
    assert not torch.allclose(batch.ref_logps, base, atol=1e-3)  # the base model is not this run's π_ref
    assert all(torch.equal(trained[n], p) for n, p in t.unwrapped.named_parameters())
    assert any(not torch.equal(trained[n], p) for n, p in initial.named_parameters() if "lora_" in n)


def test_an_adapter_groupwise_creates_is_disabled_for_the_reference(tmp_path, base_dir):
    t = GRPOTrainer(base_dir, [_length], args=small_args(tmp_path, beta=0.1, max_steps=1),
                    train_dataset=toy.dataset(8), peft_config=LoraConfig(r=4, target_modules=["q_proj"]))
    assert t.reference.adapters_off and t.reference.initial is None and t.reference.copy is None
    assert Reference.of(_trained_adapter(t.tokenizer), "cpu").initial  # a passed-in one keeps its start


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merging_for_a_sampler_leaves_the_base_bit_for_bit(tokenizer, dtype):
    model = _trained_adapter(tokenizer, dtype)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    for _ in range(5):  # one merge per optimizer step
        with merged(model):
            got = {n.removeprefix("base_model.model.").replace(".base_layer", ""): p
                   for n, p in model.named_parameters() if "lora_" not in n}
            assert all(torch.equal(got[n], want[n]) for n in want)
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)
    if dtype == torch.bfloat16:  # peft's merge then unmerge alone moves the frozen base (why `merged` restores it)
        model.merge_adapter()
        model.unmerge_adapter()
        assert any(not torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)


def test_vllm_weight_sync_leaves_the_base_bit_for_bit(tokenizer):
    from groupwise.generation.vllm import vllm_named_weights

    model = _trained_adapter(tokenizer, torch.bfloat16)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    for _ in range(5):
        with vllm_named_weights(model):
            pass
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)


def test_a_frozen_peft_model_is_named(tmp_path, tokenizer):
    _trained_adapter(tokenizer).save_pretrained(tmp_path / "sft")
    frozen = PeftModel.from_pretrained(toy.build_model(tokenizer, seed=0, hidden_size=32), str(tmp_path / "sft"))
    with pytest.raises(ConfigError, match=r"no trainable parameters .*is_trainable=True"):
        check_passed_model(frozen)
    check_passed_model(PeftModel.from_pretrained(toy.build_model(tokenizer, seed=0, hidden_size=32),
                                              str(tmp_path / "sft"), is_trainable=True))


@pytest.fixture
def fresh_accelerator_state():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_each_trainer_gets_its_own_bf16_setting_in_one_process(tmp_path, tokenizer, fresh_accelerator_state):
    """accelerate refused a second setting ("restart your runtime"), or kept bf16 for a trainer that asked for
    none; transformers resets its state per TrainingArguments."""
    for i, bf16 in enumerate((False, True, False)):
        t = GRPOTrainer(toy.build_model(tokenizer, hidden_size=32), [_length], processing_class=tokenizer,
                        args=small_args(tmp_path, output_dir=str(tmp_path / str(i)), bf16=bf16),
                        train_dataset=toy.dataset(8))
        assert t.dist.accelerator.mixed_precision == ("bf16" if bf16 else "no")


def test_accelerate_fsdp_settings_groupwise_does_not_apply_are_refused_and_offload_is_applied(monkeypatch):
    from groupwise.sharding import resolve

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    key = "fsdp_activation_checkpointing"
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    with pytest.raises(ConfigError, match=f"sets {key}: true.*set {key}: false in the accelerate config"):
        resolve(None)
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "false")  # accelerate launch exports the defaults as "false"
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "false")
    assert resolve(None).reshard_after_forward is True and resolve(None).offload is False
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")  # fsdp_offload_params: true
    assert resolve(None).offload is True


def test_prompt_learning_adapters_are_refused_by_name(tmp_path, tokenizer):
    """Their virtual tokens are added by PeftModel.forward, which the log-prob pass does not run: the first
    backward failed with "element 0 of tensors does not require grad", after a whole generation round."""
    from peft import PrefixTuningConfig, PromptTuningConfig

    for config in (PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
                   PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)):
        with pytest.raises(ConfigError, match=f"peft_config is a {type(config).__name__}, a prompt-learning method"):
            GRPOTrainer(toy.build_model(tokenizer, hidden_size=32), [_length], args=small_args(tmp_path),
                        train_dataset=toy.dataset(8), processing_class=tokenizer, peft_config=config)
    passed = get_peft_model(toy.build_model(tokenizer, hidden_size=32),
                            PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ConfigError, match="the PeftModel's adapter is a PromptTuningConfig"):
        check_passed_model(passed)


@pytest.mark.slow
def test_a_passed_in_adapter_resumes_exactly_against_its_initial_reference(tmp_path, tokenizer):
    """Resume passes the same starting PeftModel: its initial adapter is π_ref again (not the checkpoint's)."""
    kw = dict(beta=0.1, max_steps=2, save_steps=1)
    a = GRPOTrainer(_trained_adapter(tokenizer), [_length], processing_class=tokenizer, train_dataset=toy.dataset(12),
                    args=small_args(tmp_path, output_dir=str(tmp_path / "a"), **kw))
    a.train()
    b = GRPOTrainer(_trained_adapter(tokenizer), [_length], processing_class=tokenizer, train_dataset=toy.dataset(12),
                    args=small_args(tmp_path, output_dir=str(tmp_path / "b"), **kw))
    b.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-1"))
    for (name, x), y in zip(a.unwrapped.named_parameters(), b.unwrapped.parameters()):
        assert torch.equal(x, y), name


def test_adapters_added_by_transformers_are_refused(tokenizer, monkeypatch):
    """model.add_adapter (transformers' PEFT integration): save_pretrained writes the adapter alone, so a checkpoint
    of what groupwise took for a full fine-tune could not be resumed ("no model*.safetensors weights")."""
    import transformers.integrations.peft as integration
    from packaging.version import Version

    if Version(importlib.metadata.version("peft")) < Version(integration.MIN_PEFT_VERSION):
        # transformers 5.24 asks for peft >= 0.22, not yet released: its add_adapter runs as it is, gate left out
        monkeypatch.setattr(integration, "check_peft_version", lambda **_: None)
    model = toy.build_model(tokenizer, hidden_size=32)
    model.add_adapter(LoraConfig(r=4, target_modules=["q_proj"]))
    assert any("lora_A" in name for name, _ in model.named_parameters())  # the adapter is in the model
    with pytest.raises(ConfigError, match=r"adapters added by transformers .*peft_config=LoraConfig"):
        check_passed_model(model)
    check_passed_model(toy.build_model(tokenizer, hidden_size=32))  # a plain model passes


@pytest.mark.slow
def test_resume_refuses_another_lora_configuration_by_field(tmp_path, base_dir):
    """Same shapes, other scale: lora_alpha 16 instead of 32 loaded the adapter and trained on, silently changed;
    another rank failed with torch's many-line size-mismatch list."""
    def trainer(out, **kw):
        lora = {"lora_r": 4, "lora_alpha": 8, **kw}
        return GRPOTrainer(base_dir, [_length], train_dataset=toy.dataset(8), args=small_args(
            tmp_path, output_dir=str(tmp_path / out), use_peft=True, lora_target_modules=["all-linear"], max_steps=2,
            save_steps=1, **lora))

    trainer("a").train()
    ckpt = str(tmp_path / "a" / "checkpoint-1")
    for field, value, saved in (("lora_alpha", 16, 8), ("lora_r", 2, 4), ("use_rslora", True, False)):
        with pytest.raises(ConfigError, match=rf"the adapter's \w+ is {saved!r} in .* but {value!r} now; resume "
                                              "with the same LoRA configuration"):
            trainer("b", **{field: value}).train(resume_from_checkpoint=ckpt)
    trainer("c").train(resume_from_checkpoint=ckpt)  # the same configuration ('all-linear' resolved alike) resumes


def test_the_trainer_refuses_a_frozen_peft_model_before_training(tmp_path, tokenizer):
    _trained_adapter(tokenizer).save_pretrained(tmp_path / "sft")
    frozen = PeftModel.from_pretrained(toy.build_model(tokenizer, seed=0, hidden_size=32), str(tmp_path / "sft"))
    with pytest.raises(ConfigError, match="is_trainable=True"):  # was: torch's "optimizer got an empty parameter list"
        GRPOTrainer(frozen, [_length], args=small_args(tmp_path), train_dataset=toy.dataset(8),
                    processing_class=tokenizer)


@pytest.mark.slow
def test_a_lora_checkpoint_resumed_without_lora_names_the_fix(tmp_path, base_dir):
    def trainer(out, **kw):
        return GRPOTrainer(base_dir, [_length], train_dataset=toy.dataset(8), args=small_args(
            tmp_path, output_dir=str(tmp_path / out), max_steps=2, save_steps=1, **kw))

    trainer("a", use_peft=True, lora_target_modules=["q_proj"]).train()
    with pytest.raises(ConfigError, match="holds a LoRA adapter.*peft_config / use_peft"):
        trainer("b").train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-1"))


def test_an_adapter_folder_given_as_the_model_names_the_fix(tmp_path, tokenizer, base_dir):
    """An SFT run's output folder holds only the adapter; transformers cannot read it as a model ("Unrecognized
    model", in TRL too). The error names the base (from adapter_config.json) and both ways on, and the first one
    it names trains."""
    adapter_dir = tmp_path / "sft_adapter"
    model = get_peft_model(toy.build_model(tokenizer, seed=0, hidden_size=32),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    model.peft_config["default"].base_model_name_or_path = base_dir
    model.save_pretrained(adapter_dir)
    with pytest.raises(ConfigError, match=rf"model='{adapter_dir}' holds a PEFT adapter \(adapter_config.json\), not a "
                                          rf"model: .*PeftModel.from_pretrained\(AutoModelForCausalLM.from_pretrained"
                                          rf"\('{base_dir}'\), '{adapter_dir}', is_trainable=True\)"):
        GRPOTrainer(str(adapter_dir), [_length], args=small_args(tmp_path), train_dataset=toy.dataset(8),
                    processing_class=tokenizer)
    from transformers import AutoModelForCausalLM

    policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(adapter_dir),
                                       is_trainable=True)
    t = GRPOTrainer(policy, [_length], args=small_args(tmp_path, max_steps=1), train_dataset=toy.dataset(8),
                    processing_class=tokenizer)
    assert t.train().global_step == 1
