"""FSDP2 (fully_shard) on 2 CPU processes (gloo): the same training as DDP, exact resume from its sharded
checkpoints, and a consolidated model that from_pretrained loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import training_lines
from tests.fsdp_support import TR_DPO, launch, returned, runs
from tests.fsdp_support import run as _run


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "weights.safetensors"))


def _like_ddp_and_resumed(tmp_path: Path, common: dict, fsdp: str, crash_after: int) -> tuple[Path, Path, Path]:
    """`common` under DDP, under FSDP2 (`fsdp`), and under FSDP2 dying right after checkpoint `crash_after`, then
    resumed from it in fresh processes: checks that FSDP2's final weights are DDP's (1e-6) and the resumed run's
    FSDP2's bit for bit; returns the three folders (ddp, fsdp, crashed)."""
    ddp, sharded, crashed = tmp_path / "ddp", tmp_path / "fsdp", tmp_path / "crashed"
    runs(dict(out=ddp, **common), dict(out=sharded, fsdp=fsdp, **common),
         dict(out=crashed, fsdp=fsdp, crash_after=crash_after, **common))
    _run(crashed, resume=str(crashed / f"checkpoint-{crash_after}"), fsdp=fsdp, **common)
    want, got, resumed = _weights(ddp), _weights(sharded), _weights(crashed)
    assert want.keys() == got.keys() == resumed.keys()
    for name in want:
        assert torch.allclose(want[name].float(), got[name].float(), atol=1e-6), name
        assert torch.equal(got[name], resumed[name]), name
    return ddp, sharded, crashed


@pytest.mark.slow
def test_fsdp2_trains_like_ddp(tmp_path):
    runs(dict(out=tmp_path / "ddp", max_steps=3, save_steps=0),  # one launch: the runs are independent
         dict(out=tmp_path / "fsdp", max_steps=3, save_steps=0, fsdp="full_shard"),
         # transformers 5's form: fsdp true, tuned by fsdp_config (the layer classes named, shard_grad_op)
         dict(out=tmp_path / "fsdp_config", max_steps=3, save_steps=0, fsdp=True,
              fsdp_config={"fsdp_transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                           "reshard_after_forward": False, "state_dict_type": "SHARDED_STATE_DICT"}))
    ddp, fsdp = _weights(tmp_path / "ddp"), _weights(tmp_path / "fsdp")
    configured = _weights(tmp_path / "fsdp_config")
    assert ddp.keys() == fsdp.keys() == configured.keys()
    for name in ddp:
        assert torch.allclose(ddp[name], configured[name], atol=1e-5), name
    moved = load_file(str(tmp_path / "ddp" / "checkpoint-3" / "model.safetensors"))
    assert moved.keys() <= ddp.keys()
    for name in ddp:
        assert torch.allclose(ddp[name], fsdp[name], atol=1e-5), name
    # the sharded checkpoint: each process's shards + the consolidated model, which from_pretrained loads
    ckpt = tmp_path / "fsdp" / "checkpoint-3"
    assert {p.name for p in ckpt.glob("model_shard_*.safetensors")} == {"model_shard_0.safetensors",
                                                                       "model_shard_1.safetensors"}
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(ckpt)
    for name, p in loaded.state_dict().items():
        assert torch.equal(p, fsdp[name]), name


@pytest.mark.slow
def test_fsdp2_crash_and_resume_is_bitwise_exact(tmp_path, tr_dpo_fsdp_runs):
    """With a sharded reference that TR-DPO moves every step (its shards are in the checkpoint) and the KL term.
    The straight and crashed runs are shared with test_fsdp_ref_audit.py; the resume is in fresh processes."""
    straight, crashed = tr_dpo_fsdp_runs
    crashed = Path(shutil.copytree(crashed, tmp_path / "crashed"))  # the copy is resumed
    assert (crashed / "checkpoint-2").is_dir() and not (crashed / "weights.safetensors").exists()
    assert (crashed / "checkpoint-2" / "ref_model_shard_1.safetensors").exists()
    _run(crashed, resume=str(crashed / "checkpoint-2"), **TR_DPO)
    a, b = _weights(straight), _weights(crashed)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    kl = [[json.loads(x)["kl"] for x in training_lines(run / "metrics.jsonl")][-2:] for run in (straight, crashed)]
    assert kl[0] == kl[1] and kl[0][1] > 0  # the resumed reference is the straight run's (steps 1-2: no signal)
    # every process's state.log_history: steps 1-2 read back from the checkpoint (on process 1 too), 3-4 trained
    keys = ("step", "epoch", "loss", "reward", "kl", "grad_norm", "learning_rate")
    history = {(run.name, r): [{k: line[k] for k in keys if k in line}
                               for line in json.loads((run / f"log_history_{r}.json").read_text()) if "loss" in line]
               for run in (straight, crashed) for r in (0, 1)}
    assert [line["step"] for line in history["straight", 0]] == [1, 2, 3, 4]
    assert history["straight", 0] == history["straight", 1] == history["crashed", 0] == history["crashed", 1]


@pytest.mark.slow
def test_fsdp2_fp16_trains_like_ddp_fp16_and_an_overflow_in_one_shard_skips_the_step_everywhere(tmp_path):
    """fp16 under FSDP2: float32 shards, the forward under float16 autocast, the loss scaled. At step 2 process 1's
    gradient of lm_head row 0 is made inf before the reduction: under FSDP2 that row is in process 0's shard, so
    process 1's own shards are finite; the overflow check is reduced over the processes (DTensor), so both skip
    the step and halve the scale (65536 → 32768), as DDP, whose all-reduce spreads the inf to every process."""
    common = dict(max_steps=3, save_steps=0, fp16=True, poison_step=1)
    runs(dict(out=tmp_path / "ddp", **common), dict(out=tmp_path / "fsdp", fsdp="full_shard", **common))
    keys = ("step", "train/loss_scale", "train/overflow", "train/skipped")
    for run in ("ddp", "fsdp"):
        history = [[{k: line[k] for k in keys} for line in
                    json.loads((tmp_path / run / f"log_history_{r}.json").read_text()) if "loss" in line]
                   for r in (0, 1)]
        assert history[0] == history[1] == [
            {"step": 1, "train/loss_scale": 65536.0, "train/overflow": 0.0, "train/skipped": 0.0},
            {"step": 2, "train/loss_scale": 65536.0, "train/overflow": 1.0, "train/skipped": 1.0},
            {"step": 3, "train/loss_scale": 32768.0, "train/overflow": 0.0, "train/skipped": 0.0}], run
    ddp, fsdp = _weights(tmp_path / "ddp"), _weights(tmp_path / "fsdp")
    assert ddp.keys() == fsdp.keys()
    for name in ddp:
        assert fsdp[name].dtype == torch.float32 and torch.allclose(ddp[name], fsdp[name], atol=1e-5), name


@pytest.mark.slow
def test_fsdp2_lora_trains_like_ddp_lora_keeps_adapter_sized_shards_and_resumes_exactly(tmp_path):
    """LoRA under FSDP2: the decoder layers sharded with their frozen base and trainable adapters together; π_ref
    is the sharded policy with its adapters off (β > 0); the sampling replica receives the gathered adapters after
    every step. Same training as DDP; the per-process shards of a checkpoint hold the adapters only (the base is the
    model the run loads); a run resumed from step 2 in fresh processes ends bitwise equal to the straight one.
    shard_grad_op with 2 micro-batches: the units stay gathered after the no-grad reference pass, where PEFT's
    disable_adapter() used to leave the sharded adapters frozen (grad_norm 0, or "does not require grad" at the
    second micro-batch); full_shard LoRA is run by the tests below."""
    common = dict(max_steps=4, save_steps=2, use_peft=True, lora_target_modules=["q_proj", "v_proj"],
                  learning_rate=0.05, beta=0.04, gradient_accumulation_steps=2)
    ddp, fsdp, _ = _like_ddp_and_resumed(tmp_path, common, "shard_grad_op", crash_after=2)
    want, got = _weights(ddp), _weights(fsdp)
    kl = [[json.loads(x)["kl"] for x in training_lines(run / "metrics.jsonl")] for run in (ddp, fsdp)]
    assert kl[0][0] == kl[1][0] == 0.0 and kl[1][1] > 0 and kl[1] == pytest.approx(kl[0], abs=1e-7)
    ckpt = fsdp / "checkpoint-4"
    shards = [load_file(str(ckpt / f"model_shard_{r}.safetensors")) for r in (0, 1)]
    adapters = {n for n in want if "lora_" in n}
    assert set(shards[0]) == set(shards[1]) == adapters  # 8 tensors, half of each on each process
    assert all(shards[0][n].shape[0] * 2 == want[n].shape[0] for n in adapters)
    from peft import PeftModel

    from groupwise.tasks import toy

    tok = toy.build_tokenizer()
    loaded = PeftModel.from_pretrained(toy.build_model(tok, seed=0, hidden_size=32), str(ckpt))
    for name, p in loaded.state_dict().items():
        assert torch.equal(p, got[name]), name  # the adapter file and the frozen base: the run's final weights


@pytest.mark.slow
def test_fsdp2_with_a_peft_model_passed_in_keeps_its_initial_adapter_as_the_reference(tmp_path):
    """A PeftModel passed in whose adapter was trained before (lora_B ≠ 0): π_ref is the policy with the adapter's
    initial values (TRL's frozen "ref" copy of it), not the adapters-off base model. Under FSDP2 those values are
    put back into this process's shards for the reference pass, with every unit resharded around it (shard_grad_op
    leaves units gathered after a no-grad forward). KL at step 1 is exactly 0 (the adapters-off model would differ:
    lora_B is far from 0); the training equals DDP's; a resume from step 6 (after the first steps with a reward
    signal, 5-6) in fresh processes is bitwise exact, its π_ref the adapter's initial values, not the checkpoint's."""
    common = dict(max_steps=8, save_steps=6, trained_adapter=["q_proj", "v_proj"], learning_rate=0.05, beta=0.04,
                  num_iterations=2)  # π_θold's no-grad pass first: shard_grad_op leaves its units gathered
    ddp, fsdp, crashed = _like_ddp_and_resumed(tmp_path, common, "shard_grad_op", crash_after=6)
    kl = [[json.loads(x)["kl"] for x in training_lines(run / "metrics.jsonl")] for run in (ddp, fsdp, crashed)]
    assert kl[0][0] == kl[1][0] == 0.0 and min(kl[1][5:]) > 0  # steps 1-4: no reward signal, nothing moves
    assert kl[1] == pytest.approx(kl[0], abs=1e-7) and kl[2] == kl[1]  # the resumed run's π_ref: the initial adapter


@pytest.mark.slow
def test_fsdp2_bf16_with_cast_lm_head_to_fp32_gathers_the_head_in_float32(tmp_path):
    """cast_lm_head_to_fp32 under FSDP2's bf16 mixed precision: the output head is an FSDP unit of its own whose
    weights are gathered (and gradients reduced) in float32, the rest of the model in bfloat16. After 3 steps
    (β > 0: the sharded reference has the same head unit) a log-prob forward's head output equals the float32
    recomputation from its bfloat16 hidden states (measured ≤ 5e-7), and not the bfloat16-weight one (measured
    3e-4 to 6e-4 away): the head inside the root unit was gathered in bfloat16 (measured 6e-4 from float32, 0 from
    bfloat16). DDP's bf16 autocast path (CPU autocast leaves the final norm's output float32), the same probe."""
    common = dict(max_steps=3, save_steps=0, bf16=True, cast_lm_head_to_fp32=True, beta=0.04, probe_head=True)
    runs(dict(out=tmp_path / "ddp", **common), dict(out=tmp_path / "fsdp", fsdp="full_shard", **common))
    for run in ("ddp", "fsdp"):
        for r in (0, 1):
            probe = json.loads((tmp_path / run / f"head_probe_{r}.json").read_text())
            assert probe["weight_dtype"] == "torch.float32", (run, probe)
            assert probe["hidden_dtype"] == ("torch.bfloat16" if run == "fsdp" else "torch.float32"), (run, probe)
            assert probe["to_float32"] < 2e-6 and probe["to_bfloat16"] > 1e-4, (run, r, probe)
        lines = training_lines(tmp_path / run / "metrics.jsonl")
        assert len(lines) == 3 and all(torch.isfinite(torch.tensor(json.loads(x)["loss"])) for x in lines)
    weights = _weights(tmp_path / "fsdp")
    assert weights["lm_head.weight"].dtype == torch.float32


@pytest.mark.slow
def test_fsdp2_with_vllm_colocate_trains_like_ddp_and_the_engine_gets_the_gathered_weights(tmp_path):
    """use_vllm (colocate, the in-repo stand-in engine: one per process) under FSDP2, full and LoRA: the engine is
    loaded from the unsharded replica, which holds the gathered shards (LoRA: the gathered adapters, merged for the
    push) after every optimizer step. Every load — at the start, then after each of the 3 steps — leaves the engine
    with exactly the policy's current weights; the training equals DDP's with the same engines; the importance
    weights are 1 (the engine samples with the policy's numerics)."""
    from groupwise.tasks import toy

    base = tmp_path / "base"  # the workers' model (toy.build_model, seed 0), saved: vLLM loads a path
    toy.build_model(toy.build_tokenizer(), seed=0, hidden_size=32).save_pretrained(base)
    common = dict(max_steps=3, save_steps=0, use_vllm=True, vllm_mode="colocate", learning_rate=0.05,
                  model_path=str(base))
    lora = dict(use_peft=True, lora_target_modules=["q_proj", "v_proj"])
    names = ("ddp", "fsdp", "ddp_lora", "fsdp_lora")
    runs(*[dict(out=tmp_path / name, **common, **(lora if "lora" in name else {}),
                **({"fsdp": "full_shard"} if "fsdp" in name else {})) for name in names])
    for name in names:
        for r in (0, 1):
            pushes = json.loads((tmp_path / name / f"engine_{r}.json").read_text())
            assert len(pushes) == 4 and max(pushes) < 1e-6, (name, r, pushes)
        lines = [json.loads(x) for x in training_lines(tmp_path / name / "metrics.jsonl")]
        assert [line["sampling/importance_sampling_ratio/mean"] for line in lines] == pytest.approx([1.0] * 3, abs=1e-4)
    for kind in ("", "_lora"):
        want, got = _weights(tmp_path / f"ddp{kind}"), _weights(tmp_path / f"fsdp{kind}")
        assert want.keys() == got.keys()
        start = load_file(str(base / "model.safetensors"))
        assert any(not torch.equal(want[n], start[n]) for n in start if n in want) or kind  # full: it trained
        assert any(not torch.equal(want[n], torch.zeros_like(want[n])) for n in want if "lora_B" in n) or not kind
        for name in want:
            assert torch.allclose(want[name], got[name], atol=1e-5), (kind, name)


@pytest.mark.slow
def test_fsdp2_samples_from_a_generation_dtype_replica_and_saves_the_float32_weights(tmp_path):
    """generation_dtype under FSDP2: the unsharded replica generation runs on is the bfloat16 copy, refreshed from
    the gathered shards after every step (for LoRA the gathered adapters). The training equals DDP's with the same
    bfloat16 sampler (the same importance-sampling ratios), and checkpoint-2's consolidated model — and adapter —
    are the float32 trained weights, as DDP writes them, not the bfloat16 replica."""
    common = dict(max_steps=2, save_steps=2, generation_dtype="bfloat16", learning_rate=0.05)
    lora = dict(use_peft=True, lora_target_modules=["q_proj", "v_proj"])
    names = ("ddp", "fsdp", "ddp_lora", "fsdp_lora")
    runs(*[dict(out=tmp_path / name, **common, **(lora if "lora" in name else {}),
                **(dict(fsdp="full_shard") if "fsdp" in name else {})) for name in names])
    for kind, saved in (("", "model.safetensors"), ("_lora", "adapter_model.safetensors")):
        ddp, fsdp = tmp_path / f"ddp{kind}", tmp_path / f"fsdp{kind}"
        sampled = _weights(fsdp)  # the replica generation ran on
        assert {w.dtype for w in sampled.values()} == {torch.bfloat16}
        lines = [[json.loads(x) for x in training_lines(run / "metrics.jsonl")] for run in (ddp, fsdp)]
        ratio = "sampling/importance_sampling_ratio/mean"
        assert all(x[ratio] != 1.0 for x in lines[1])  # a bfloat16 sampler: corrected
        assert [x[ratio] for x in lines[1]] == pytest.approx([x[ratio] for x in lines[0]], abs=1e-6)
        want, got = (load_file(str(run / "checkpoint-2" / saved)) for run in (ddp, fsdp))
        assert want.keys() == got.keys() and len(want) > 0
        for name in want:
            assert got[name].dtype == torch.float32 and torch.allclose(want[name], got[name], atol=1e-6), name


@pytest.mark.slow
def test_fsdp2_with_gradient_checkpointing_and_the_everyday_switches_trains_like_ddp(tmp_path):
    """What a run of a large model under FSDP2 turns on, together: gradient_checkpointing (transformers' activation
    checkpointing inside each sharded layer: the backward re-gathers a layer's weights to recompute it),
    top_entropy_quantile (the entropy threshold of the micro-batch over both processes), gradient accumulation over
    2 micro-batches, num_iterations 2 (π_θold's no-grad forward, then two optimizer steps per generation), β > 0;
    full and LoRA (a frozen base: the checkpointed blocks need input gradients). Same training as DDP's."""
    common = dict(max_steps=4, save_steps=0, gradient_checkpointing=True, top_entropy_quantile=0.5,
                  gradient_accumulation_steps=2, per_device_train_batch_size=2, num_iterations=2, beta=0.04,
                  learning_rate=0.05, reward="length")
    lora = dict(use_peft=True, lora_target_modules=["q_proj", "v_proj"])
    names = ("ddp", "fsdp", "ddp_lora", "fsdp_lora")
    runs(*[dict(out=tmp_path / name, **common, **(lora if "lora" in name else {}),
                **({"fsdp": "full_shard"} if "fsdp" in name else {})) for name in names])
    for kind in ("", "_lora"):
        want, got = _weights(tmp_path / f"ddp{kind}"), _weights(tmp_path / f"fsdp{kind}")
        assert want.keys() == got.keys()
        for name in want:
            assert torch.allclose(want[name], got[name], atol=1e-5), (kind, name)
        lines = [[json.loads(x) for x in training_lines(tmp_path / f"{run}{kind}" / "metrics.jsonl")]
                 for run in ("ddp", "fsdp")]
        assert len(lines[0]) == 4 and max(line["grad_norm"] for line in lines[0]) > 0  # it trained
        for a, b in zip(*lines, strict=True):
            assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["kl"] == pytest.approx(b["kl"], abs=1e-7)


@pytest.mark.slow
def test_fsdp2_with_torch_compile_trains_like_ddp_with_it(tmp_path):
    """torch_compile (the decoder under torch.compile, inductor) with the decoder layers sharded: FSDP2's hooks run
    around the compiled layers. Same training as DDP with torch_compile (measured 4e-6 apart after 3 steps; the
    compilation is most of this test's minute)."""
    common = dict(max_steps=2, save_steps=0, beta=0.04, learning_rate=0.05, reward="length", torch_compile=True)
    runs(dict(out=tmp_path / "ddp", **common), dict(out=tmp_path / "fsdp", fsdp="full_shard", **common))
    want, got = _weights(tmp_path / "ddp"), _weights(tmp_path / "fsdp")
    assert want.keys() == got.keys()
    for name in want:
        assert torch.allclose(want[name], got[name], atol=1e-5), name
    kl = [[json.loads(x)["kl"] for x in training_lines(tmp_path / run / "metrics.jsonl")] for run in ("ddp", "fsdp")]
    assert kl[1][-1] > 0 and kl[1] == pytest.approx(kl[0], abs=1e-6)


@pytest.mark.slow
def test_fsdp2_qlora_keeps_the_4bit_base_whole_trains_like_ddp_and_resumes_exactly(tmp_path):
    """QLoRA under FSDP2 (bitsandbytes 4-bit, its CPU backend): the packed base weights are left out of the sharding
    (fully_shard's ignored_params: FSDP2 would gather a Params4bit back as a plain tensor, without its quantization
    state) and stay whole on every process, frozen; the adapters and the float weights are sharded. The training
    equals DDP's QLoRA (the packed weights too: untouched); checkpoint shards hold the adapters only; a resume from
    step 2 in fresh processes is bitwise exact."""
    pytest.importorskip("bitsandbytes")
    from groupwise.tasks import toy

    base = tmp_path / "base"
    toy.build_model(toy.build_tokenizer(), seed=0, hidden_size=32).save_pretrained(base)
    common = dict(max_steps=4, save_steps=2, use_peft=True, lora_target_modules=["q_proj", "v_proj"], beta=0.04,
                  learning_rate=0.05, reward="length", model_path=str(base), load_in_bits=4)
    ddp, fsdp, _ = _like_ddp_and_resumed(tmp_path, common, "full_shard", crash_after=2)
    want = _weights(ddp)
    assert any(want[n].dtype == torch.uint8 for n in want)  # the packed 4-bit weights (compared too)
    assert any(not torch.equal(want[n], torch.zeros_like(want[n])) for n in want if "lora_B" in n)  # it trained
    kl = [[json.loads(x)["kl"] for x in training_lines(run / "metrics.jsonl")] for run in (ddp, fsdp)]
    assert kl[0][0] == kl[1][0] == 0.0 and kl[1][-1] > 0 and kl[1] == pytest.approx(kl[0], abs=1e-7)
    shards = [load_file(str(fsdp / "checkpoint-4" / f"model_shard_{r}.safetensors")) for r in (0, 1)]
    assert set(shards[0]) == set(shards[1]) == {n for n in want if "lora_" in n}
    # the sampling replica shares the packed base with the policy (one copy per process, not two); with DDP the
    # policy samples itself
    for r in (0, 1):
        assert json.loads((fsdp / f"packed_{r}.json").read_text()) == {"count": 14, "shared": 14}


@pytest.mark.slow
def test_fsdp2_cpu_offload_trains_like_fsdp2_and_resumes_exactly(tmp_path):
    """fsdp: "full_shard offload" (transformers' word; fsdp_config cpu_offload, accelerate's fsdp_offload_params):
    FSDP2's CPUOffloadPolicy on every unit, the policy's and the TR-DPO reference's (which is mixed on the CPU).
    Here the device is the CPU too, so this checks the wiring (the same training as without offload, the shards'
    checkpoint and an exact resume), not the memory saved on a GPU."""
    offload = dict(TR_DPO, fsdp="full_shard offload")
    plain, offloaded, crashed = tmp_path / "plain", tmp_path / "offloaded", tmp_path / "crashed"
    runs(dict(out=plain, **TR_DPO), dict(out=offloaded, **offload), dict(out=crashed, crash_after=2, **offload))
    _run(crashed, resume=str(crashed / "checkpoint-2"), **offload)
    want, got, resumed = _weights(plain), _weights(offloaded), _weights(crashed)
    assert want.keys() == got.keys() == resumed.keys()
    for name in want:
        assert torch.allclose(want[name], got[name], atol=1e-6), name
        assert torch.equal(got[name], resumed[name]), name
    kl = [[json.loads(x)["kl"] for x in training_lines(run / "metrics.jsonl")] for run in (plain, offloaded)]
    assert kl[1][-1] > 0 and kl[1] == pytest.approx(kl[0], abs=1e-7)
    for run, policy in ((plain, "OffloadPolicy"), (offloaded, "CPUOffloadPolicy"), (crashed, "CPUOffloadPolicy")):
        assert json.loads((run / "units_1.json").read_text()) == [policy], run  # every unit, policy and reference


def test_sharding_is_asked_for_by_the_field_or_by_an_accelerate_fsdp2_launch(monkeypatch):
    from groupwise.config_base import ConfigError
    from groupwise.sharding import resolve

    assert resolve(None) is None
    assert resolve("full_shard auto_wrap").reshard_after_forward is True
    assert resolve("shard_grad_op").reshard_after_forward is False
    with pytest.raises(ConfigError, match=r"fsdp='hybrid_shard offload': \['hybrid_shard'\] not supported"):
        resolve("hybrid_shard offload")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    assert resolve(None).reshard_after_forward is False
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ConfigError, match="set fsdp_version: 2"):
        resolve(None)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ConfigError, match="asks for DeepSpeed.*shard with FSDP2"):
        resolve(None)


def test_bad_fsdp_value_fails_before_anything_loads():
    from groupwise import GRPOConfig
    from groupwise.config_base import ConfigError

    with pytest.raises(ConfigError, match="fsdp='hybrid_shard'"):
        GRPOConfig(fsdp="hybrid_shard")


@pytest.mark.slow
def test_fsdp2_bf16_trains_finite(tmp_path):
    """A policy loaded in bfloat16 gets float32 master weights (its trainable parameters upcast before sharding).
    With β > 0 the reference is sharded as the policy is, with the same mixed precision: at step 1 π_ref = π_θ
    in value and in numerics, KL exactly 0 (an unsharded float32 copy under autocast gave 1.6e-7). shard_grad_op
    with TR-DPO: the reference reshards after its forward (it never runs a backward), so mixing it into the policy
    finds shards on both sides (it crashed: "mixed torch.Tensor and DTensor")."""
    common = dict(max_steps=2, save_steps=0, bf16=True, beta=0.04)
    runs(dict(out=tmp_path / "bf16", fsdp="shard_grad_op", sync_ref_model=True, ref_model_sync_steps=1, **common),
         dict(out=tmp_path / "loaded16", fsdp="full_shard", model_dtype="bfloat16", **common),
         # LoRA: the first forward is the reference pass, inside PEFT's disable_adapter(), which freezes the adapters;
         # FSDP2, initialised there, recorded no trainable parameter and the first backward failed ("a gradient with
         # dtype BFloat16 to a tensor with grad_dtype Float")
         dict(out=tmp_path / "lora16", fsdp="full_shard", use_peft=True, lora_target_modules=["q_proj", "v_proj"],
              learning_rate=0.05, reward="length", **common))
    lora = [json.loads(x) for x in training_lines(tmp_path / "lora16" / "metrics.jsonl")]
    assert len(lora) == 2 and lora[0]["kl"] == 0.0 and lora[1]["kl"] > 0 and all(x["grad_norm"] > 0 for x in lora), [
        (x["loss"], x["kl"], x["grad_norm"]) for x in lora]
    for run in ("bf16", "loaded16"):
        lines = [json.loads(x) for x in training_lines(tmp_path / run / "metrics.jsonl")]
        assert all(x["loss"] == x["loss"] and abs(x["grad_norm"]) < float("inf") for x in lines)
        assert lines[0]["kl"] == 0.0
        for r in (0, 1):  # float32 master weights and optimizer state, as accelerate's FSDP2 upcast (they stayed
            # bfloat16 for a policy loaded in 16 bits)
            masters = json.loads((tmp_path / run / f"master_dtypes_{r}.json").read_text())
            assert masters == {"params": ["torch.float32"], "optimizer": ["torch.float32"]}, (run, masters)
    weights = _weights(tmp_path / "bf16")
    assert all(w.dtype == torch.float32 and torch.isfinite(w).all() for w in weights.values())


@pytest.mark.slow
def test_fsdp2_with_tied_embeddings_checkpoints_and_a_sharded_checkpoint_needs_fsdp(tmp_path):
    # one launch: the sharded run, then (when both processes came back from it) a plain one resuming its checkpoint
    tied, plain = tmp_path / "tied", tmp_path / "plain"
    proc = launch(tied, [dict(out=str(tied), max_steps=2, save_steps=2, fsdp="full_shard", tie=True),
                         dict(out=str(plain), max_steps=3, save_steps=2, tie=True, resume=str(tied / "checkpoint-2"))])
    assert returned(tied) and (tied / "weights.safetensors").exists(), proc.stderr[-5000:]
    assert (tied / "checkpoint-2" / "model_shard_1.safetensors").exists()
    assert proc.returncode != 0 and "was saved by a sharded run (fsdp): resume it with fsdp and 2 processes" in proc.stderr


@pytest.mark.slow
def test_fsdp_offload_on_one_process_shards_over_it_alone_to_offload(tmp_path):
    """With 'offload', one process is worth sharding: FSDP2 over a one-process group (gloo on CPU; NCCL with gloo
    next to it on a GPU) keeps the weights, gradients and optimizer state in host memory. The same training as
    without fsdp (β > 0: the reference offloaded too), every unit offloaded, a checkpoint with the process's shards,
    a resume bitwise exact (in a fresh process)."""
    common = dict(max_steps=4, save_steps=2, beta=0.04, learning_rate=0.05, reward="length")
    offload = dict(common, fsdp="full_shard offload")
    plain, offloaded, crashed = tmp_path / "plain", tmp_path / "offloaded", tmp_path / "crashed"
    runs(dict(out=plain, **common), dict(out=offloaded, **offload), dict(out=crashed, crash_after=2, **offload),
         nproc=1)
    _run(crashed, nproc=1, resume=str(crashed / "checkpoint-2"), **offload)
    want, got, resumed = _weights(plain), _weights(offloaded), _weights(crashed)
    assert want.keys() == got.keys() == resumed.keys()
    for name in want:
        assert torch.allclose(want[name], got[name], atol=1e-6), name
        assert torch.equal(got[name], resumed[name]), name
    assert json.loads((offloaded / "units_0.json").read_text()) == ["CPUOffloadPolicy"]
    assert (offloaded / "checkpoint-4" / "model_shard_0.safetensors").exists()
    lines = [json.loads(x) for x in training_lines(offloaded / "metrics.jsonl")]
    assert max(line["grad_norm"] for line in lines) > 0 and lines[-1]["kl"] > 0  # it trained, away from π_ref


@pytest.mark.slow
def test_fsdp_offload_on_one_process_with_a_passed_in_adapter_and_a_float32_head(tmp_path):
    """The FSDP2 paths that copy into offloaded shards or add a unit, on one process (so that a one-GPU machine runs
    them too: scripts/gpu_session.sh): a PeftModel passed in with β > 0 (its initial adapter swapped into the shards
    for every reference pass) trains as without fsdp; cast_lm_head_to_fp32 under bf16 gathers the head in float32."""
    adapter = dict(max_steps=8, save_steps=0, trained_adapter=["q_proj", "v_proj"], beta=0.04, learning_rate=0.05,
                   num_iterations=2, reward="length")
    head = dict(max_steps=2, save_steps=0, bf16=True, cast_lm_head_to_fp32=True, beta=0.04, probe_head=True,
                fsdp="full_shard offload")
    plain, offloaded = tmp_path / "plain", tmp_path / "offloaded"
    runs(dict(out=plain, **adapter), dict(out=offloaded, fsdp="shard_grad_op offload", **adapter),
         dict(out=tmp_path / "head", **head), nproc=1)
    want, got = _weights(plain), _weights(offloaded)
    for name in want:
        assert torch.allclose(want[name], got[name], atol=1e-6), name
    kl = [[json.loads(x)["kl"] for x in training_lines(run / "metrics.jsonl")] for run in (plain, offloaded)]
    assert kl[1][0] == 0.0 and kl[1][-1] > 0 and kl[1] == pytest.approx(kl[0], abs=1e-7)
    probe = json.loads((tmp_path / "head" / "head_probe_0.json").read_text())
    assert probe["to_float32"] < 2e-6 and probe["to_bfloat16"] > 1e-4, probe
    assert json.loads((tmp_path / "head" / "units_0.json").read_text()) == ["CPUOffloadPolicy"]


def test_fsdp_on_one_process_trains_unsharded_and_says_so(tmp_path, tokenizer):
    """One process has nothing to shard: the run goes on as without fsdp (no FSDP2 wrapping), with a warning that
    names the fix, instead of dropping the field silently."""
    from groupwise import GRPOTrainer
    from groupwise.tasks import toy
    from tests.conftest import small_args

    with pytest.warns(UserWarning, match=r"fsdp is set but this run has one process: nothing to shard"):
        t = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [toy.letter_reward],
                        args=small_args(tmp_path, fsdp="full_shard", max_steps=1), train_dataset=toy.dataset(8),
                        processing_class=tokenizer)
    assert t.dist.sharding is None
