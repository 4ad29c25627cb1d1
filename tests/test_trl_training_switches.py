"""TRL's training fields and GRPOTrainer arguments, each doing what it does in TRL: save_only_model,
remove_unused_columns, pad_to_multiple_of, cast_lm_head_to_fp32, generation_dtype and the smaller switches (logging,
completions tables, DDP fields, gradient checkpointing, TRL's config dumps, export); tests/test_trl_training_fields.py
has optimizers, schedules, datasets, strategies, evaluation and the hub."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import warnings
from pathlib import Path

import pytest
import torch

from groupwise import GRPOConfig, GRPOTrainer
from groupwise.checkpoint import CheckpointError
from groupwise.config_base import ConfigError
from groupwise.tasks import toy
from tests.conftest import small_args
from tests.training_fields_support import _trainer


# ---- checkpoints, columns, padding, precision ---------------------------------------------------------------------
def test_save_only_model_checkpoints_load_but_do_not_resume(tmp_path, tokenizer):
    t = _trainer(tmp_path, tokenizer, max_steps=1, save_only_model=True)
    t.train()
    ckpt = tmp_path / "run" / "checkpoint-1"
    names = {p.name for p in ckpt.iterdir()}
    assert "model.safetensors" in names and not any(n.startswith(("optimizer", "rng_state", "scheduler")) for n in names)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ckpt)
    with pytest.raises(CheckpointError, match="save_only_model=True: it holds the model only"):
        _trainer(tmp_path, tokenizer, max_steps=2).train(resume_from_checkpoint=str(ckpt))


def test_remove_unused_columns_passes_the_prompt_only(tmp_path, tokenizer):
    seen = []

    def record(completions, **kwargs):
        seen.append(set(kwargs) - {"trainer_state", "log_metric", "log_extra"})
        return [0.0] * len(completions)

    _trainer(tmp_path, tokenizer, funcs=(record,), max_steps=1, output_dir=str(tmp_path / "a")).train()
    _trainer(tmp_path, tokenizer, funcs=(record,), max_steps=1, output_dir=str(tmp_path / "b"),
             remove_unused_columns=True).train()
    assert "letter" in seen[0] and "letter" not in seen[1] and "prompts" in seen[1]
    # a dataset's own completion / completion_ids columns never reach the rewards (TRL): they would collide with
    # the generated ones
    data = [{**row, "completion": "reference", "completion_ids": [1, 2]} for row in toy.dataset(12)]
    _trainer(tmp_path, tokenizer, funcs=(record,), data=data, max_steps=1, output_dir=str(tmp_path / "c")).train()
    assert "letter" in seen[2] and "completion" not in seen[2] and seen[2] >= {"completion_ids", "prompts"}


@pytest.mark.slow
def test_pad_to_multiple_of_pads_tensors_and_leaves_training_unchanged(tmp_path, tokenizer):
    runs = {}
    for k in (None, 8):
        # SGD: Adam's g/√v would blow float32 rounding in near-zero gradients up to lr-sized differences
        t = _trainer(tmp_path, tokenizer, max_steps=2, pad_to_multiple_of=k, output_dir=str(tmp_path / f"p{k}"),
                     optim="sgd", learning_rate=0.5)
        rollout = t._collect()
        runs[k] = (t, rollout)
    padded = runs[8][1].batch
    assert padded.completion_mask.size(1) % 8 == 0 and padded.input_ids.size(1) % 8 == 0
    plain = runs[None][1].batch
    assert torch.equal(padded.completion_mask.sum(1), plain.completion_mask.sum(1))  # same completions
    assert torch.allclose(padded.advantages, plain.advantages)
    for k in (None, 8):
        t, rollout = runs[k]
        from groupwise.update import optimizer_step

        for window in t._windows(rollout):
            optimizer_step(t.update_ctx, window)
    for (name, a), b in zip(runs[None][0].unwrapped.named_parameters(), runs[8][0].unwrapped.parameters()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_pad_to_multiple_of_accepts_trl_spellings():
    assert GRPOConfig(pad_to_multiple_of="auto").pad_to_multiple_of is None
    assert GRPOConfig(pad_to_multiple_of="64").pad_to_multiple_of == 64
    with pytest.raises(ConfigError, match="pad_to_multiple_of='x' must be a positive integer"):
        GRPOConfig(pad_to_multiple_of="x")


def test_pad_to_multiple_of_with_process_supervision(tmp_path, tokenizer):
    def steps(prompts, steps, **_):
        return [[float(len(s)) for s in row] for row in steps]

    t = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [],
                    args=small_args(tmp_path, supervision="process", step_split="delimiter", step_delimiter="a",
                                    max_completion_length=10, pad_to_multiple_of=8, max_steps=1),
                    train_dataset=toy.dataset(12), processing_class=tokenizer, process_reward_funcs=[steps])
    batch = t._collect().batch
    assert batch.advantages.shape == batch.completion_mask.shape and batch.completion_mask.size(1) % 8 == 0
    assert torch.all(batch.advantages[:, 10:] == 0)  # the padding columns past max_completion_length


def test_cast_lm_head_to_fp32(tmp_path, tokenizer):
    model = toy.build_model(tokenizer, seed=0, hidden_size=32).to(torch.bfloat16)
    t = _trainer(tmp_path, tokenizer, model=model, max_steps=1, cast_lm_head_to_fp32=True)
    head = t.unwrapped.get_output_embeddings()
    assert head.weight.dtype == torch.float32 and t.unwrapped.model.embed_tokens.weight.dtype == torch.bfloat16
    hidden = torch.randn(2, 32, dtype=torch.bfloat16, device=head.weight.device)
    assert head(hidden).dtype == torch.float32  # the matmul itself runs in float32
    metrics = t.train()
    assert math.isfinite(metrics["loss"])
    # the generation_dtype sampler keeps the float32 head too (as TRL's low-precision sampler), refreshed each step
    t = _trainer(tmp_path, tokenizer, model=toy.build_model(tokenizer, seed=0, hidden_size=32), max_steps=1,
                 cast_lm_head_to_fp32=True, generation_dtype="bfloat16", output_dir=str(tmp_path / "sampled"))
    sampler_head = t._replica.get_output_embeddings()
    assert sampler_head.weight.dtype == torch.float32 and t._replica.model.embed_tokens.weight.dtype == torch.bfloat16
    t.train()
    assert torch.equal(sampler_head.weight, t.unwrapped.get_output_embeddings().weight)
    tied = toy.build_model(tokenizer, seed=0, hidden_size=32)
    tied.lm_head.weight = tied.model.embed_tokens.weight
    with pytest.raises(ConfigError, match="cast_lm_head_to_fp32=True needs an output head that is not tied"):
        _trainer(tmp_path, tokenizer, model=tied, cast_lm_head_to_fp32=True)
    # adapters on the head: PEFT wraps the float32 head, whose own matmul stays float32 (the trained copy of
    # modules_to_save is a Float32Head too); under fsdp the wrapper cannot be the float32 unit: refused
    from peft import LoraConfig, get_peft_model

    from groupwise.loading import cast_head_to_fp32, check_head_cast

    for lora in (dict(modules_to_save=["lm_head"], target_modules=["q_proj"]), dict(target_modules=["lm_head"])):
        model = toy.build_model(tokenizer, seed=0, hidden_size=32)
        cast_head_to_fp32(model)
        wrapped = get_peft_model(model, LoraConfig(r=2, **lora))
        hidden = torch.randn(2, 5, 32, dtype=torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert wrapped.get_output_embeddings()(hidden).dtype == torch.float32
        with pytest.raises(ConfigError, match=r"^cast_lm_head_to_fp32=True with fsdp and adapters on the output head "
                                              r"\(it is a (ModulesToSaveWrapper|Linear)"):
            check_head_cast(wrapped)
    check_head_cast(t.unwrapped)  # no adapters: the float32 head itself


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sampling_in_another_dtype_is_importance_corrected(tmp_path, tokenizer, dtype):
    """generation_dtype: the sampler is a cast copy of the policy. float32 = the trainer's numerics: every weight is 1
    (up to the float32 rounding of an incremental KV-cache decode against a full forward); bfloat16: the weights
    stay near 1 and TRL's sampling/* metrics are logged."""
    t = _trainer(tmp_path, tokenizer, generation_dtype=dtype, max_steps=2, max_completion_length=12)
    assert next(t.sampling_model.parameters()).dtype == getattr(torch, dtype)
    metrics = t.train()
    ratio = [metrics[f"sampling/importance_sampling_ratio/{k}"] for k in ("min", "mean", "max")]
    if dtype == "float32":
        assert ratio == [pytest.approx(1.0, abs=1e-5)] * 3 and metrics["sampling/sampling_logp_difference/max"] < 1e-5
    else:
        assert 0.95 < ratio[0] <= ratio[1] <= ratio[2] < 1.05 and ratio[0] < ratio[2]
        assert 0 < metrics["sampling/sampling_logp_difference/mean"] < 0.05
    # the sampler follows the policy: after training, the copy holds the policy's weights (cast)
    for a, b in zip(t.unwrapped.parameters(), t.sampling_model.parameters()):
        assert torch.equal(a.detach().to(b.dtype).cpu(), b.cpu())
    off = _trainer(tmp_path, tokenizer, generation_dtype=dtype, vllm_importance_sampling_correction=False,
                   max_steps=1, output_dir=str(tmp_path / "off"))
    assert "sampling/importance_sampling_ratio/mean" not in off.train()


def test_a_backend_without_sampling_log_probs_under_the_correction_says_what_to_do(tmp_path, tokenizer):
    from groupwise.generation import Generated

    t = _trainer(tmp_path, tokenizer, generation_dtype="bfloat16", max_steps=1)
    sample = t.rollout_ctx.generator

    class NoLogprobs:  # a backend that returns no log-probs
        def update_weights(self, model):
            sample.update_weights(model)

        def __call__(self, *a, **kw):
            return Generated(sample(*a, **kw).completion_ids)

    t.rollout_ctx = dataclasses.replace(t.rollout_ctx, generator=NoLogprobs())
    with pytest.raises(ValueError, match="generation_backend='fast' returned no sampling log-probs, which the "
                                         "importance-sampling correction needs.*vllm_importance_sampling_correction"):
        t.train()


# ---- smaller switches -----------------------------------------------------------------------------------------------
def test_logging_nan_inf_filter():
    from groupwise.logging import window_mean as _mean

    assert _mean([1.0, math.inf, 3.0, math.nan], "finite") == 2.0  # filter on: non-finite losses left out
    assert _mean([1.0, math.inf], "all") == math.inf  # filter off: they show
    assert _mean([1.0, math.nan, 3.0], "measured") == 2.0  # other metrics: NaN = not measured


def test_log_completions_prints_a_sample_and_writes_trl_s_completions_tables(tmp_path, tokenizer, capsys, monkeypatch):
    """As TRL: num_completions_to_print rows drawn at random are printed (not the first ones; the run's random state
    is not moved); output_dir/completions/completions_<step>.parquet holds every row (step, prompt, completion, one
    column per reward function, log_extra columns, advantage); wandb gets the `completions` table, one row per
    prompt under log_unique_prompts."""
    import random
    import sys
    import types

    import pandas as pd

    tables = []
    fake = types.SimpleNamespace(run=None, init=lambda **kw: types.SimpleNamespace(log=lambda m: tables.append(m.get(
        "completions")), summary={}, finish=lambda exit_code=None: None), Table=lambda dataframe: dataframe)
    monkeypatch.setitem(sys.modules, "wandb", fake)

    def tagged(completions, log_extra, **_):
        log_extra("tag", [f"row{i}" for i in range(len(completions))])
        return [float(len(c)) for c in completions]

    t = _trainer(tmp_path, tokenizer, funcs=(tagged,), max_steps=2, log_completions=True, num_completions_to_print=3,
                 log_unique_prompts=True, report_to=["wandb"])
    before = random.getstate()
    t.train()
    assert random.getstate() == before
    out = capsys.readouterr().out
    assert out.count("prompt: ") == 6  # 3 of the 8 rows at each of the 2 steps
    frame = pd.read_parquet(tmp_path / "run" / "completions" / "completions_00002.parquet")
    assert list(frame.columns) == ["step", "prompt", "completion", "tagged", "tag", "advantage"]
    assert len(frame) == 8 and set(frame["step"]) == {2} and list(frame["tag"]) == [f"row{i}" for i in range(8)]
    rows = [json.loads(x) for x in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()][8:]
    assert list(frame["completion"]) == [r["completion"] for r in rows]
    assert list(frame["advantage"]) == pytest.approx([r["advantage"] for r in rows])
    assert [len(x) for x in tables if x is not None] == [2, 2]  # 2 prompts × G = 4: one row per prompt
    # the printed sample is drawn from its own generator: the same rows every time, the global state untouched
    printed = [line for line in out.splitlines() if line.startswith("completion: ")]
    assert printed[3:] == [f"completion: {r['completion']}" for r in random.Random(2).sample(rows, 3)]
    assert printed[3:] != [f"completion: {r['completion']}" for r in rows[:3]]


def test_ddp_fields_reach_accelerate_and_switches_apply(tmp_path, tokenizer, monkeypatch):
    import transformers

    called = []
    monkeypatch.setattr("groupwise.trainer.empty_cache", lambda device: called.append(device))
    t = _trainer(tmp_path, tokenizer, max_steps=4, ddp_find_unused_parameters=True, ddp_bucket_cap_mb=10,
                 tf32=False, log_level="error", torch_empty_cache_steps=2)
    handler = t.dist.accelerator.ddp_handler
    assert handler.find_unused_parameters is True and handler.bucket_cap_mb == 10
    assert torch.backends.cuda.matmul.allow_tf32 is False
    assert transformers.logging.get_verbosity() == 40
    transformers.logging.set_verbosity_warning()
    t.train()
    assert len(called) == 2  # steps 2 and 4


def test_train_result_and_reporting_helpers_as_trl_scripts_use_them(tmp_path, tokenizer):
    t = _trainer(tmp_path, tokenizer, max_steps=2, save_steps=1)
    result = t.train()
    assert result.global_step == 2 and result["loss"] == result["loss"]  # still the metrics dict
    assert result.metrics["train_loss"] == pytest.approx(result.training_loss) and result.metrics["train_runtime"] > 0
    t.log_metrics("train", result.metrics)
    t.save_metrics("train", result.metrics)
    t.save_state()
    out = tmp_path / "run"
    assert json.loads((out / "all_results.json").read_text())["train_loss"] == pytest.approx(result.training_loss)
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 2
    assert t.model is t.unwrapped  # trainer.model is the Hugging Face model, as in TRL
    again = _trainer(tmp_path, tokenizer, max_steps=3)
    again.train(resume_from_checkpoint=True)  # the newest checkpoint in output_dir, checkpoint-2
    assert again.global_step == 3


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_gradient_checkpointing_kwargs_reach_the_model(tmp_path, tokenizer):
    t = _trainer(tmp_path, tokenizer, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    funcs = [m._gradient_checkpointing_func for m in t.unwrapped.modules() if hasattr(m, "_gradient_checkpointing_func")]
    assert funcs and all(f.keywords == {"use_reentrant": False} for f in funcs)


def test_a_config_dumped_by_trl_loads(tmp_path):
    """TRL 1.16's GRPOConfig(output_dir='trl-out', bf16=False).to_dict(), as a user would save it (kept in
    tests/data): it loads, with TRL's meanings, and the token placeholder in it is not taken for a token."""
    dump = json.loads((Path(__file__).parent / "data" / "trl_1_16_grpo_config_dump.json").read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = GRPOConfig(**dump)
    assert cfg.output_dir == "trl-out" and cfg.gradient_checkpointing is True and cfg.activation_checkpointing is True
    assert cfg.layout(1).generation_batch_size == dump["generation_batch_size"]
    from groupwise.hub import PLACEHOLDERS

    assert cfg.hub_token in PLACEHOLDERS


def test_activation_checkpointing_is_transformers_5s_name_for_gradient_checkpointing():
    cfg = GRPOConfig(activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": False})
    assert cfg.gradient_checkpointing is True and cfg.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert GRPOConfig(gradient_checkpointing=True).activation_checkpointing is True


def test_feature_combinations_that_do_not_work_together_are_refused_by_name(tiny_model):
    """groupwise.loading.check_combinations runs before any model loads (fsdp needs 2+ processes to be active, so the
    checks are exercised directly)."""
    from groupwise.loading import check_combinations

    cases = [
        (dict(sharded=True, optimizers=(object(), None)), {}, r"fsdp with optimizers=\(…\)"),
        (dict(peft_config=object()), dict(use_peft=True), "peft_config and use_peft=True both ask for adapters"),
        (dict(peft_config=object()), dict(beta=0.1, sync_ref_model=True), "sync_ref_model=True with LoRA"),
    ]
    for given, fields, message in cases:
        kw = {"model": tiny_model, "sharded": False, "peft_config": None, "optimizers": (None, None), **given}
        with pytest.raises(ConfigError, match=message):
            check_combinations(GRPOConfig(**fields), **kw)
    check_combinations(GRPOConfig(), model=tiny_model, sharded=True, peft_config=None, optimizers=(None, None))
    # the head its own float32 unit under bf16 (test_fsdp.py)
    check_combinations(GRPOConfig(cast_lm_head_to_fp32=True, bf16=True), model=tiny_model, sharded=True,
                       peft_config=None, optimizers=(None, None))
    # LoRA under fsdp: adapters groupwise creates (peft_config / use_peft) and a PeftModel passed in, with the KL
    # term (test_fsdp.py trains both)
    check_combinations(GRPOConfig(beta=0.04), model=tiny_model, sharded=True, peft_config=object(),
                       optimizers=(None, None))
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(tiny_model), LoraConfig(r=2, target_modules=["q_proj"]))
    for beta in (0.0, 0.04):
        check_combinations(GRPOConfig(beta=beta), model=peft_model, sharded=True, peft_config=None,
                           optimizers=(None, None))


def test_export_names_what_is_wrong(tmp_path, capsys):
    from groupwise.cli import main

    assert main(["export", str(tmp_path / "nope"), "--merge", str(tmp_path / "out")]) == 2  # a configuration error
    assert f"export: '{tmp_path / 'nope'}' is not a checkpoint folder" in capsys.readouterr().err
    # a folder without config.json: one line, exit 2 (was transformers' "Unrecognized model" traceback, exit 1)
    (tmp_path / "empty").mkdir()
    assert main(["export", str(tmp_path / "empty"), "--merge", str(tmp_path / "out")]) == 2
    assert "export CHECKPOINT=" in capsys.readouterr().err
    # --base with a full model (no adapter): refused, not silently ignored
    from groupwise.tasks import toy

    full = tmp_path / "full"
    toy.build_model(toy.build_tokenizer(), seed=0, hidden_size=32).save_pretrained(full)
    assert main(["export", str(full), "--merge", str(tmp_path / "out"), "--base", str(tmp_path / "nope")]) == 2
    assert "holds a full model, not an adapter: --base has nothing to merge into; drop --base" in \
        capsys.readouterr().err


def test_a_completions_table_pyarrow_cannot_write_is_written_with_json_text_and_a_warning(tmp_path):
    """Prompts of mixed kinds in one step (a string, a conversation) are no parquet column: the table is still
    written, its prompt / completion columns as JSON text, with a warning naming the step."""
    import pandas as pd

    from groupwise.logging import MetricsLogger

    logger = MetricsLogger(str(tmp_path), [], enabled=True, config={})
    rows = [{"prompt": "plain", "completion": "a", "reward": 1.0, "advantage": 0.5, "rewards": {"f": 1.0}},
            {"prompt": [{"role": "user", "content": "chat"}], "completion": "b", "reward": 0.0, "advantage": -0.5,
             "rewards": {"f": 0.0}}]
    with pytest.warns(RuntimeWarning, match="completions table of step 3: .*written as JSON text"):
        logger.log_table(3, rows, unique_prompts=False)
    frame = pd.read_parquet(tmp_path / "completions" / "completions_00003.parquet")
    assert list(frame["prompt"]) == ["plain", '[{"role": "user", "content": "chat"}]']
    assert list(frame["f"]) == [1.0, 0.0] and list(frame["advantage"]) == [0.5, -0.5]
