"""LoRA through PEFT (TRL's peft_config / use_peft): only the adapter trains, every generation backend works, the
reference policy is the base model with the adapters off (no copy), resume is bitwise exact, the saved adapter
loads with PeftModel.from_pretrained and `groupwise export --merge` writes a model that generates the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
from peft import LoraConfig, PeftModel  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from groupwise import GRPOConfig, GRPOTrainer  # noqa: E402
from groupwise.adapters import is_peft_model  # noqa: E402
from groupwise.cli import main  # noqa: E402
from groupwise.config_base import ConfigError  # noqa: E402
from groupwise.modeling import batched_logps  # noqa: E402
from groupwise.tasks import toy  # noqa: E402
from tests.conftest import small_args  # noqa: E402


def _lora(**kw):
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, **kw)


def _length(completions, **_):
    return [float(len(c)) for c in completions]  # varied rewards: every step moves the adapter


def _trainer(tmp_path, base_dir, peft_config="default", out="run", **kw):
    args = small_args(tmp_path, output_dir=str(tmp_path / out), **kw)
    return GRPOTrainer(base_dir, [_length], args=args, train_dataset=toy.dataset(12),
                       peft_config=_lora() if peft_config == "default" else peft_config)


def _base_weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


def _adapter_weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("backend", ["fast", "transformers"])
def test_only_the_adapter_trains_with_every_backend(tmp_path, base_dir, backend):
    t = _trainer(tmp_path, base_dir, generation_backend=backend, max_steps=2)
    assert is_peft_model(t.unwrapped)
    base, adapter = _base_weights(t.unwrapped), _adapter_weights(t.unwrapped)
    trainable = {n for n, p in t.unwrapped.named_parameters() if p.requires_grad}
    assert trainable == set(adapter) and adapter
    t.train()
    assert all(torch.equal(base[n].cpu(), p.cpu()) for n, p in t.unwrapped.named_parameters() if n in base)
    assert any(not torch.equal(adapter[n].cpu(), p.cpu()) for n, p in t.unwrapped.named_parameters() if n in adapter)


def test_a_lora_run_samples_the_full_runs_first_completions(tmp_path, base_dir):
    """Every process reseeds once the models are built (TRL: set_seed(seed, device_specific=True)), so the adapters'
    random initialisation does not change what is sampled: a LoRA run (B = 0, the same policy at first) draws the
    full-parameter run's first completions."""
    seen = {}

    def recording(name):
        def reward(completions, **_):
            seen.setdefault(name, list(completions))
            return [float(len(c)) for c in completions]
        return reward

    for name, peft_config in (("full", None), ("lora", _lora())):
        args = small_args(tmp_path, output_dir=str(tmp_path / name), max_steps=1)
        GRPOTrainer(base_dir, [recording(name)], args=args, train_dataset=toy.dataset(12),
                    peft_config=peft_config).train()
    assert len(set(seen["full"])) > 1 and seen["full"] == seen["lora"]


def test_reference_is_the_base_model_with_adapters_off_and_no_copy(tmp_path, base_dir):
    t = _trainer(tmp_path, base_dir, beta=0.1, max_steps=1)
    assert t.reference is not None and t.reference.copy is None  # no second model
    t.train()  # the adapter has moved away from zero: policy ≠ reference
    rollout = t._collect()
    batch = rollout.batch
    fresh = AutoModelForCausalLM.from_pretrained(base_dir)  # the untouched base, loaded on its own
    fresh = fresh.to(batch.input_ids.device)
    expected = batched_logps(fresh, batch.input_ids, batch.attention_mask, batch.completion_mask.size(1),
                             temperature=1.0, batch_size=8)
    assert torch.allclose(batch.ref_logps.cpu(), expected.cpu(), atol=1e-6)
    policy = batched_logps(t.unwrapped, batch.input_ids, batch.attention_mask, batch.completion_mask.size(1),
                           temperature=1.0, batch_size=8)
    assert not torch.allclose(policy.cpu(), expected.cpu(), atol=1e-6)  # the adapters were back on afterwards


@pytest.mark.parametrize("init", [False, "pissa", "olora"])
def test_an_adapter_that_does_not_start_as_the_identity_keeps_pi_ref_the_initial_policy(tmp_path, base_dir, init):
    """init_lora_weights=False (random B), PiSSA and OLoRA (which rewrite the base weights): the base model without
    the adapters is not π_θ0 (|Δ log π| 0.24 / 0.05 / 0.10 before any step), so π_ref is the adapter at its initial
    values, as for an adapter passed in. Before any step π_ref = π_θ exactly; a resume with another init is refused."""
    from groupwise.config_base import ConfigError as Error

    t = _trainer(tmp_path, base_dir, _lora(init_lora_weights=init), beta=0.1, max_steps=1, save_steps=1)
    torch.manual_seed(3)
    ids = torch.randint(3, 20, (4, 12))
    mask = torch.ones_like(ids)
    policy = batched_logps(t.unwrapped, ids, mask, 6, temperature=1.0, batch_size=4)
    with t.reference.context():
        ref = batched_logps(t.reference.logps_model, ids, mask, 6, temperature=1.0, batch_size=4)
    assert torch.equal(policy, ref)
    t.train()
    with pytest.raises(Error, match=r"the adapter's init_lora_weights is .* in .*checkpoint-1 but True now"):
        _trainer(tmp_path, base_dir, _lora(), beta=0.1, max_steps=2).train(
            resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-1"))


@pytest.mark.slow
def test_resume_is_bitwise_exact_and_the_adapter_loads_with_peft(tmp_path, base_dir):
    straight = _trainer(tmp_path, base_dir, beta=0.05, max_steps=4, save_steps=2, out="a")
    straight.train()
    resumed = _trainer(tmp_path, base_dir, beta=0.05, max_steps=4, save_steps=2, out="b")
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    for (name, a), b in zip(straight.unwrapped.named_parameters(), resumed.unwrapped.parameters()):
        assert torch.equal(a.cpu(), b.cpu()), name
    ckpt = tmp_path / "a" / "checkpoint-4"
    assert (ckpt / "adapter_model.safetensors").exists() and not (ckpt / "model.safetensors").exists()
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(ckpt))
    ours = dict(straight.unwrapped.named_parameters())
    for name, p in loaded.named_parameters():
        if "lora_" in name:
            assert torch.equal(p, ours[name].cpu()), name


@pytest.mark.slow
def test_export_merge_generates_the_same_greedy_tokens(tmp_path, base_dir, capsys):
    t = _trainer(tmp_path, base_dir, max_steps=2, learning_rate=5e-2, save_steps=2)
    t.train()
    out = tmp_path / "merged"
    assert main(["export", str(tmp_path / "run" / "checkpoint-2"), "--merge", str(out)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out)
    # into the adapter's base, the run's folder, or the same export again: refused, nothing written (the base was
    # replaced by the merged weights, and the adapter then applied twice on its recorded base)
    before = {p.name: p.stat().st_mtime_ns for p in Path(base_dir).iterdir()}
    for target in (base_dir, tmp_path / "run", out):
        assert main(["export", str(tmp_path / "run" / "checkpoint-2"), "--merge", str(target)]) == 2
    assert "--merge " + base_dir + " is not an empty folder: give a new one" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in Path(base_dir).iterdir()} == before
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir),
                                        str(tmp_path / "run" / "checkpoint-2"))
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    tok = t.tokenizer
    enc = tok(["repeat a:", "repeat c:"], return_tensors="pt", padding=True, padding_side="left")
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    a, m, b = (model.generate(**enc, **kw) for model in (adapter, merged, base))
    assert torch.equal(a, m)
    # the adapter changed something (else the equality above would hold for the untrained base too)
    assert not torch.equal(
        adapter(**enc).logits, base(**enc).logits)


def test_use_peft_fields_build_trl_lora_config(tmp_path, base_dir):
    t = _trainer(tmp_path, base_dir, peft_config=None, use_peft=True, lora_r=2, lora_alpha=4, lora_dropout=0.0,
                 lora_target_modules=["q_proj"], max_steps=1)
    cfg = t.unwrapped.peft_config["default"]
    assert (cfg.r, cfg.lora_alpha, set(cfg.target_modules)) == (2, 4, {"q_proj"})
    t.train()


def test_lora_errors_name_the_fix(tmp_path, base_dir, tokenizer):
    with pytest.raises(ConfigError, match="peft_config and use_peft=True both ask for adapters"):
        _trainer(tmp_path, base_dir, use_peft=True)
    with pytest.raises(ConfigError, match="sync_ref_model=True with LoRA"):
        _trainer(tmp_path, base_dir, beta=0.1, sync_ref_model=True)
    from peft import get_peft_model

    wrapped = get_peft_model(toy.build_model(tokenizer, hidden_size=32), _lora())
    with pytest.raises(ConfigError, match="already a PeftModel"):
        GRPOTrainer(wrapped, [toy.letter_reward], args=small_args(tmp_path), train_dataset=toy.dataset(4),
                    processing_class=tokenizer, peft_config=_lora())
    # PEFT saves an adapter not named "default" in a subfolder, which resume did not find
    named = get_peft_model(toy.build_model(tokenizer, hidden_size=32), _lora(), adapter_name="policy")
    with pytest.raises(ConfigError, match=r"adapters \['policy'\]: groupwise trains, checkpoints and resumes one "
                                          r"adapter named 'default'"):
        GRPOTrainer(named, [toy.letter_reward], args=small_args(tmp_path), train_dataset=toy.dataset(4),
                    processing_class=tokenizer)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_gradient_checkpointing_with_lora_still_trains(tmp_path, base_dir):
    t = _trainer(tmp_path, base_dir, gradient_checkpointing=True, max_steps=2)
    adapter = _adapter_weights(t.unwrapped)
    t.train()
    assert any(not torch.equal(adapter[n].cpu(), p.cpu()) for n, p in t.unwrapped.named_parameters() if n in adapter)


def test_a_peft_wrapped_model_passed_in_trains_and_resumes(tmp_path, tokenizer):
    """TRL users also pass get_peft_model(model, config) directly: same path, no peft_config."""
    from peft import get_peft_model

    def build():
        return get_peft_model(toy.build_model(tokenizer, seed=0, hidden_size=32), _lora())

    args = dict(max_steps=2, save_steps=1)
    a = GRPOTrainer(build(), [toy.letter_reward], args=small_args(tmp_path, output_dir=str(tmp_path / "a"), **args),
                    train_dataset=toy.dataset(12), processing_class=tokenizer)
    a.train()
    b = GRPOTrainer(build(), [toy.letter_reward], args=small_args(tmp_path, output_dir=str(tmp_path / "b"), **args),
                    train_dataset=toy.dataset(12), processing_class=tokenizer)
    b.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-1"))
    for (name, x), y in zip(a.unwrapped.named_parameters(), b.unwrapped.parameters()):
        assert torch.equal(x.cpu(), y.cpu()), name
    assert GRPOConfig().use_peft is False


def test_disable_dropout_reaches_the_adapters(tmp_path, base_dir):
    t = _trainer(tmp_path, base_dir, peft_config=_lora_with_dropout(), max_steps=1)
    drops = [m for n, m in t.unwrapped.named_modules() if isinstance(m, torch.nn.Dropout) and "lora_dropout" in n]
    assert drops and all(m.p == 0.0 for m in drops)


def _lora_with_dropout():
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.3)


@pytest.mark.parametrize("adapter", [dict(target_modules=["q_proj", "lm_head"]),
                                     dict(target_modules=["q_proj"], modules_to_save=["lm_head"]),
                                     dict(target_modules=["q_proj"], modules_to_save=["embed_tokens"])])
def test_an_adapter_on_tied_embeddings_is_refused_with_vllm_and_export(tmp_path, tokenizer, adapter):
    """Tied input embeddings and head (Qwen2.5-0.5B's layout) with an adapter on either: merged for vLLM (or by
    `export --merge`) one tensor cannot hold both (the policy's logits and those of the pushed weights' tied head
    differed by up to 13.8). Refused, naming the fix; the fast backend samples the PeftModel itself and trains."""
    from peft import get_peft_model

    from groupwise.adapters import adapted_tied_embeddings
    from groupwise.export import export_merged

    model = toy.build_model(tokenizer, seed=0, hidden_size=32)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    wrapped = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **adapter))
    assert adapted_tied_embeddings(wrapped) in ("input embeddings", "output head")
    assert adapted_tied_embeddings(get_peft_model(toy.build_model(tokenizer, seed=0, hidden_size=32), _lora())) is None

    def tied_peft(**kw):
        m = toy.build_model(tokenizer, seed=0, hidden_size=32)
        m.config.tie_word_embeddings = True
        m.lm_head.weight = m.model.embed_tokens.weight
        return get_peft_model(m, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, ensure_weight_tying=True, **kw))

    # ensure_weight_tying keeps modules_to_save copies one tensor (merges right); LoRA on both tied modules merges
    # its update into the shared tensor twice (measured 2.0 × the update): still refused
    assert adapted_tied_embeddings(tied_peft(target_modules=["q_proj"], modules_to_save=["lm_head"])) is None
    assert adapted_tied_embeddings(tied_peft(target_modules=["q_proj", "lm_head"])) is not None
    wrapped.save_pretrained(tmp_path / "adapter")
    tokenizer.save_pretrained(tmp_path / "adapter")
    base = toy.build_model(tokenizer, seed=0, hidden_size=32)
    base.config.tie_word_embeddings = True
    base.lm_head.weight = base.model.embed_tokens.weight
    base.save_pretrained(tmp_path / "base")
    with pytest.raises(ConfigError, match=r"export: .*adapter changes the (input embeddings|output head) of a model "
                                          r"whose input embeddings and output head are one tensor"):
        export_merged(str(tmp_path / "adapter"), str(tmp_path / "out"), base=str(tmp_path / "base"))


def test_lora_fields_without_use_peft_warn_that_they_have_no_effect():
    """lora_r=64, use_dora=True without use_peft trained the full model with no word (TRL ignores them too)."""
    import warnings

    with pytest.warns(UserWarning, match=r"lora_r=64, use_dora=True: no effect without use_peft=True"):
        GRPOConfig(lora_r=64, use_dora=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GRPOConfig(use_peft=True, lora_r=64, use_dora=True)
        GRPOConfig()


def test_a_full_run_over_a_lora_runs_folder_loads_as_the_new_model(tmp_path, base_dir):
    """overwrite_output_dir: the LoRA run's adapter files stayed beside the full run's weights, and
    from_pretrained(output_dir) applied the old adapter to the new model."""
    lora = _trainer(tmp_path, base_dir, max_steps=1)
    lora.train()
    lora.save_model()  # as TRL's script and groupwise train end
    assert (tmp_path / "run" / "adapter_config.json").exists()
    full = _trainer(tmp_path, base_dir, peft_config=None, max_steps=1, overwrite_output_dir=True)
    full.train()
    full.save_model()
    assert not (tmp_path / "run" / "adapter_config.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "run"))
    ids = torch.tensor([[3, 4, 5, 6]])
    assert torch.equal(loaded(ids).logits, full.unwrapped.eval()(ids).logits)


def test_an_adapter_whose_base_does_not_load_is_one_line_naming_it(tmp_path, base_dir, tokenizer, capsys,
                                                                    monkeypatch):
    """A run started with a relative model path records it as the adapter's base; from another folder `export` and
    `eval` failed with a hub lookup's 90-line traceback. Now one line naming the adapter, the base and the fix.
    Offline with an empty cache: no hub retries (fast, network-free)."""
    import json

    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))

    from peft import get_peft_model

    from groupwise.adapters import load_adapter_checkpoint

    adapter = tmp_path / "adapter"
    get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), _lora()).save_pretrained(adapter)
    tokenizer.save_pretrained(adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "tiny-base"}))
    assert main(["export", str(adapter), "--merge", str(tmp_path / "merged")]) == 2
    err = capsys.readouterr().err
    assert f"{adapter}'s adapter's base model 'tiny-base' (if it is a folder's relative path, it is read from the " \
           "current folder, not from the one the run trained in) does not load (model 'tiny-base': cannot load its " \
           "config" in err
    assert err.rstrip().endswith("give it with --base PATH") and "Traceback" not in err
    assert main(["export", str(adapter), "--merge", str(tmp_path / "merged"), "--base", "nope-base"]) == 2
    err = capsys.readouterr().err  # the user's --base, named as such
    assert "configuration error: --base 'nope-base' does not load (model 'nope-base'" in err
    assert err.rstrip().endswith("check --base") and "adapter's base model" not in err
    assert main(["export", str(adapter), "--merge", str(tmp_path / "merged"), "--base", base_dir]) == 0
    with pytest.raises(ConfigError, match=r"base model 'tiny-base' .* merge it with `groupwise export "):
        load_adapter_checkpoint(str(adapter), small_args(tmp_path))


def test_lora_target_parameters_train_and_peft_refusals_are_one_line(tmp_path, base_dir):
    """lora_target_parameters with the default lora_dropout (0.05) failed inside PEFT after the model loaded
    ("ParamWrapper does not work with lora_dropout != 0"), though disable_dropout (on by default) zeroes it anyway:
    it is passed as 0 then, and refused before loading when disable_dropout is off. PEFT's other refusals of a
    config are one line too."""
    t = _trainer(tmp_path, base_dir, peft_config=None, use_peft=True, lora_target_parameters=["mlp.down_proj.weight"],
                 lora_target_modules=["q_proj"], max_steps=1)
    assert t.unwrapped.peft_config["default"].lora_dropout == 0.0
    t.train()
    assert t.state.global_step == 1
    with pytest.raises(ConfigError, match=r"lora_target_parameters with lora_dropout=0.05: PEFT adapts parameters "
                                          r"without dropout; set lora_dropout: 0"):
        _trainer(tmp_path, base_dir, peft_config=None, use_peft=True, disable_dropout=False,
                 lora_target_parameters=["mlp.down_proj.weight"])
    with pytest.raises(ConfigError, match=r"PEFT cannot apply this LoRA config \(peft_config, or use_peft's lora_\* "
                                          r"fields\): "):
        _trainer(tmp_path, base_dir, peft_config=LoraConfig(r=2, target_modules=["q_proj"], use_dora=True,
                                                            target_parameters=["mlp.down_proj.weight"]))


def test_a_misspelled_target_among_others_is_warned_about(tmp_path, base_dir):
    """PEFT adapts the targets that match and passes over the others: [q_proj, vproj] trained q_proj alone."""
    with pytest.warns(UserWarning, match=r"LoRA target modules \['vproj'\] match no module of LlamaForCausalLM: they "
                                         r"get no adapter"):
        _trainer(tmp_path, base_dir, peft_config=None, use_peft=True, lora_target_modules=["q_proj", "vproj"])
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="LoRA target modules")
        _trainer(tmp_path, base_dir, peft_config=None, use_peft=True, lora_target_modules=["q_proj", "v_proj"])


def test_a_sharded_lora_checkpoint_resumed_without_fsdp_says_so(tmp_path, tokenizer):
    """An fsdp LoRA run's checkpoint (per-process shards of the adapter and its optimizer state) resumed without
    fsdp: the adapter file loaded, then the unsharded optimizer state was missing: "run stopped: no such file
    optimizer.json (a file the run uses went missing)". It is the full model's one line now."""
    from peft import get_peft_model
    from safetensors.torch import save_file

    from groupwise.checkpoint import CheckpointError
    from groupwise.checkpoint_load import load_model_from
    from groupwise.tasks import toy

    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    for rank in (0, 1):
        save_file({"x": torch.zeros(1)}, str(folder / f"model_shard_{rank}.safetensors"))
    model = get_peft_model(toy.build_model(tokenizer, seed=0, hidden_size=32),
                           LoraConfig(r=2, target_modules=["q_proj"]))
    dist = type("Dist", (), {"rank": 0, "world_size": 1})()
    with pytest.raises(CheckpointError, match=r"was saved by a sharded run \(fsdp\): resume it with fsdp and 2 "
                                              "processes"):
        load_model_from(str(folder), dist=dist, model=model)


def _bf16_base_and_adapter(tmp_path, tokenizer, delta):
    """A bfloat16 base whose q_proj[0, 0] is 1.0 and an adapter (r=1, α=1: scaling 1) whose update is `delta` there
    and 0 elsewhere: B[0, 0] · A[0, 0] = delta · 1."""
    from peft import get_peft_model

    base = toy.build_model(tokenizer, seed=0, hidden_size=32).to(torch.bfloat16)
    q = base.model.layers[0].self_attn.q_proj.weight
    with torch.no_grad():
        q[0, 0] = 1.0
    base.save_pretrained(tmp_path / "base16")
    tokenizer.save_pretrained(tmp_path / "base16")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base16", dtype=torch.float32),
                           LoraConfig(r=1, lora_alpha=1, target_modules=["q_proj"], lora_dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_" in name:
            with torch.no_grad():
                p.zero_()
                if "layers.0." in name:
                    p[0, 0] = 1.0 if "lora_A" in name else delta
    model.save_pretrained(tmp_path / "adapter16")
    tokenizer.save_pretrained(tmp_path / "adapter16")
    return model


def test_rounding_loss_of_a_merge_into_bfloat16_is_worked_by_hand(tmp_path, tokenizer):
    """bfloat16 has 8 significant bits: around 1.0 its spacing is 2⁻⁷ = 0.0078125. 1.0 + 0.001 rounds to 1.0 (the
    whole update lost: ratio 1); 1.0 + 0.005 rounds to 1.0078125, off by 0.0028125 = 0.5625 of the update. (W + ΔW is
    itself a float32 sum, 1.0 + 0.001 = 1.00100005 with float32's spacing 2⁻²³ at 1.0: ratios within 1e-4.)"""
    from groupwise.export import rounding_loss

    _bf16_base_and_adapter(tmp_path, tokenizer, 0.001)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base16")
    assert base.dtype == torch.bfloat16  # from_pretrained keeps the stored dtype
    assert rounding_loss(PeftModel.from_pretrained(base, str(tmp_path / "adapter16"))) == pytest.approx(1.0, rel=1e-4)
    _bf16_base_and_adapter(tmp_path / "b", tokenizer, 0.005)
    bf16 = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "b" / "base16"),
                                     str(tmp_path / "b" / "adapter16"))
    assert rounding_loss(bf16) == pytest.approx(0.0028125 / 0.005, rel=1e-4)
    fp32 = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "b" / "base16",
                                                                          dtype=torch.float32),
                                     str(tmp_path / "b" / "adapter16"))
    assert rounding_loss(fp32) == 0.0  # float32 weights: nothing checked, nothing rounded at this scale


def test_export_into_a_bfloat16_base_warns_of_the_lost_update_and_dtype_float32_keeps_it(tmp_path, tokenizer):
    """A LoRA run trains over a float32 copy of a bfloat16 base (dtype float32 by default, TRL's), the adapter
    applied apart: its update 0.001 on q_proj[0, 0] = 1.0 counts. Merged in the base's stored bfloat16 (`auto`, as
    PEFT's merge_and_unload), 1.001 rounds to 1.0: the export warns, naming --dtype float32, which writes 1.001."""
    _bf16_base_and_adapter(tmp_path, tokenizer, 0.001)
    adapter = str(tmp_path / "adapter16")
    with pytest.warns(UserWarning, match=r"merged into bfloat16 weights, which round away 100% of the adapter's "
                                         r"update .*--dtype float32 keeps it"):
        assert main(["export", adapter, "--merge", str(tmp_path / "auto")]) == 0
    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "auto")
    assert auto.dtype == torch.bfloat16 and auto.model.layers[0].self_attn.q_proj.weight[0, 0].item() == 1.0
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["export", adapter, "--merge", str(tmp_path / "fp32"), "--dtype", "float32"]) == 0
    assert not [w for w in caught if "round away" in str(w.message)]  # nothing lost: no warning
    fp32 = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32")
    assert fp32.dtype == torch.float32
    assert fp32.model.layers[0].self_attn.q_proj.weight[0, 0].item() == (torch.tensor(1.0) + torch.tensor(0.001)).item()


@pytest.mark.parametrize("variant", [dict(), dict(use_dora=True)])
def test_rounding_loss_equals_the_merge_done_in_bfloat16_against_float32(tokenizer, variant):
    """The estimate, layer by layer on float32 copies, against the truth: the whole model merged in bfloat16 and in
    float32, ‖merged16 − merged32‖ / ‖merged32 − base‖. DoRA rescales the rows (its magnitude ×1.1 here), which
    W + ΔW alone missed (it read ~100 % lost where 0.2 % was)."""
    import copy

    from peft import get_peft_model

    from groupwise.export import rounding_loss

    base16 = toy.build_model(tokenizer, seed=0, hidden_size=32).to(torch.bfloat16)
    model = get_peft_model(copy.deepcopy(base16), LoraConfig(
        **{"r": 2, "target_modules": ["q_proj"], "init_lora_weights": False, "lora_dropout": 0.0, **variant}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "magnitude" in name:
                p.mul_(1.1)
            elif "lora_" in name:
                p.mul_(0.05)
    full = copy.deepcopy(model).float().merge_and_unload()
    half = copy.deepcopy(model).merge_and_unload()
    start = dict(base16.float().named_parameters())
    lost = sum((h.float() - f).square().sum() for (_, h), (_, f) in zip(half.named_parameters(),
                                                                       full.named_parameters()))
    update = sum((f - start[n]).square().sum() for n, f in full.named_parameters())
    assert rounding_loss(model) == pytest.approx(float((lost / update) ** 0.5), rel=0.05)


@pytest.mark.parametrize("kind", ["modules_to_save", "trainable_tokens"])
def test_rounding_loss_counts_what_loading_into_bfloat16_already_rounded(tmp_path, tokenizer, kind):
    """modules_to_save copies and trainable tokens' rows are saved whole, as trained (float32 over a float32 copy of
    the base); PeftModel.from_pretrained over the bfloat16 base rounds them as it loads, so rounding_loss reads them
    from the adapter file. The only update: 1.0 → 1.001 at one weight (lm_head[0, 0], or embedding row 1's [0]),
    which bfloat16 (spacing 2⁻⁷ at 1.0) rounds back to 1.0: ratio 1. Without the file: nothing measured (0)."""
    from peft import get_peft_model

    from groupwise.export import rounding_loss, saved_adapter_tensors

    base = toy.build_model(tokenizer, seed=0, hidden_size=32).to(torch.bfloat16)
    head, embedding = base.lm_head.weight, base.model.embed_tokens.weight
    with torch.no_grad():
        head[0, 0] = embedding[1, 0] = 1.0
    base.save_pretrained(tmp_path / "base16")
    tokenizer.save_pretrained(tmp_path / "base16")
    extra = {"modules_to_save": ["lm_head"]} if kind == "modules_to_save" else \
        {"trainable_token_indices": {"embed_tokens": [1]}}
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base16", dtype=torch.float32),
                           LoraConfig(r=1, target_modules=["q_proj"], lora_dropout=0.0, **extra))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.zero_()  # LoRA's own update 0: only the saved copy moves
            elif "modules_to_save.default.weight" in name:
                p[0, 0] = 1.001
            elif "trainable_tokens_delta.default" in name:
                p.copy_(embedding[1:2].float())
                p[0, 0] = 1.001
    model.save_pretrained(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base16"),
                                       str(tmp_path / "adapter"))
    assert rounding_loss(loaded) == 0.0  # what loading rounded is invisible in the model
    assert rounding_loss(loaded, saved_adapter_tensors(tmp_path / "adapter")) == pytest.approx(1.0, rel=1e-4)


def test_rounding_sums_in_row_blocks_equal_a_plain_loop_over_every_weight():
    """rounding_sums reads a weight in blocks of whole rows (bounded memory); the sums equal a loop over every element:
    Σ (round(w′) − w′)², Σ (w′ − w)², w′ rounded to bfloat16. A worked element: w = 1, w′ = 1.001 rounds to 1.0
    (bfloat16's spacing 2⁻⁷ at 1.0), adding 0.001² to both sums."""
    from groupwise.export import rounding_sums

    generator = torch.Generator().manual_seed(0)
    original = torch.randn(7, 5, generator=generator).to(torch.bfloat16)
    trained = original.float() + 0.01 * torch.randn(7, 5, generator=generator)
    trained[0, 0], original[0, 0] = 1.001, 1.0
    lost = update = 0.0
    for new, old in zip(trained.flatten().tolist(), original.float().flatten().tolist()):
        rounded = torch.tensor(new).to(torch.bfloat16).float().item()
        lost += (rounded - torch.tensor(new).item()) ** 2
        update += (new - old) ** 2
    for chunk in (1, 5, 11, 35, 1 << 24):  # a row at a time, 2 rows, 7 rows, the whole weight at once
        got = rounding_sums(trained, original, chunk=chunk)
        assert got == pytest.approx((lost, update), rel=1e-6)
    one = rounding_sums(torch.tensor([[1.001]]), torch.tensor([[1.0]], dtype=torch.bfloat16))
    assert one == pytest.approx(((1.001 - 1.0) ** 2, (1.001 - 1.0) ** 2), rel=1e-4)


def test_rounding_loss_reads_an_adapter_saved_as_bin(tmp_path, tokenizer):
    """An adapter saved with safe_serialization=False (adapter_model.bin) is read like a safetensors one: its
    modules_to_save copy's update 1.0 → 1.001 rounds away in bfloat16 (ratio 1, as in the safetensors test)."""
    from peft import get_peft_model

    from groupwise.export import rounding_loss, saved_adapter_tensors

    base = toy.build_model(tokenizer, seed=0, hidden_size=32).to(torch.bfloat16)
    with torch.no_grad():
        base.lm_head.weight[0, 0] = 1.0
    base.save_pretrained(tmp_path / "base16")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base16", dtype=torch.float32),
                           LoraConfig(r=1, target_modules=["q_proj"], lora_dropout=0.0, modules_to_save=["lm_head"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.zero_()
            elif "modules_to_save.default.weight" in name:
                p[0, 0] = 1.001
    model.save_pretrained(tmp_path / "adapter", safe_serialization=False)
    assert (tmp_path / "adapter" / "adapter_model.bin").exists()
    assert not (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base16"),
                                       str(tmp_path / "adapter"))
    assert rounding_loss(loaded, saved_adapter_tensors(tmp_path / "adapter")) == pytest.approx(1.0, rel=1e-4)
    assert saved_adapter_tensors(tmp_path) == {}  # no adapter file: nothing read


def test_lm_head_in_modules_to_save_keeps_the_chunked_head_and_its_numbers(tokenizer):
    """lora_modules_to_save=['lm_head'] (common when tokens are added) wraps the head in PEFT's ModulesToSaveWrapper,
    which is not an nn.Linear: log-probs fell back to the full (N, T, V) logits with only a log line. The chunked
    head now reads the module the wrapper routes to: the trained copy, or the original with adapters off (the
    reference). Both give the full-logits log-probs and gradients; lm_head as a LoRA target still takes the full
    logits, with a warning."""
    from peft import get_peft_model

    from groupwise.modeling import PolicyForLogps, completion_logps

    model = get_peft_model(toy.build_model(tokenizer, seed=0, hidden_size=32), _lora(modules_to_save=["lm_head"]))
    trained = model.base_model.model.lm_head.modules_to_save["default"]
    with torch.no_grad():
        trained.weight.add_(torch.randn_like(trained.weight) * 0.5)  # the copy differs from the original head
    wrapped = PolicyForLogps(model, chunk_tokens=3)
    assert wrapped.chunked
    ids = torch.randint(1, len(tokenizer), (2, 9))
    mask = torch.ones_like(ids)
    seen = []
    for adapters in (True, False):
        model.base_model.enable_adapter_layers() if adapters else model.base_model.disable_adapter_layers()
        got, _ = wrapped(ids, mask, 4)
        seen.append(got.detach())
        full, _ = completion_logps(model, ids, mask, 4)
        torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)
        if adapters:  # the gradient reaches the trained copy as through the full logits
            grad, = torch.autograd.grad(got.sum(), trained.weight)
            want, = torch.autograd.grad(full.sum(), trained.weight)
            torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(*seen)  # the copy's numbers with adapters on, the original head's with them off
    model.base_model.enable_adapter_layers()

    targeted = get_peft_model(toy.build_model(tokenizer, seed=0, hidden_size=32),
                              LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], lora_dropout=0.0))
    with pytest.warns(RuntimeWarning, match=r"its output head \(peft\.tuners\.lora\.layer\.Linear\) cannot be "
                                            r"applied in chunks \(a LoRA-adapted lm_head: lm_head in "
                                            r"lora_target_modules.*logprob_chunk_tokens has no effect"):
        assert not PolicyForLogps(targeted).chunked
