"""use_vllm=True, vllm_mode="colocate" against the in-repo vLLM stand-in (tests/vllm_standin: the parts of vLLM's
Python API groupwise calls, backed by a transformers model). vLLM itself cannot run here (no GPU): this checks the
contract — engine arguments, prompts in, tokens and log-probs out, weights pushed after every step — not vLLM."""

from __future__ import annotations

import copy
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from groupwise import GRPOConfig, GRPOTrainer
from groupwise.config_base import ConfigError
from groupwise.tasks import toy
from groupwise.text import encode_prompts
from tests.conftest import small_args

STANDIN = str(Path(__file__).with_name("vllm_standin"))


LAUNCHER = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def vllm(monkeypatch):
    for name in LAUNCHER:  # a plain `python train.py` (no torchrun); whatever the engine sets is undone after
        monkeypatch.delenv(name, raising=False)
    monkeypatch.syspath_prepend(STANDIN)
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    import vllm as standin

    standin.ENGINES.clear()
    yield standin
    sys.modules.pop("vllm", None)


def _engine_matches(engine, model) -> bool:
    ours = model.state_dict()
    return all(torch.equal(p, ours[n].cpu()) for n, p in engine.hf.named_parameters())


def _length(completions, **_):
    return [float(len(c)) for c in completions]  # varied: every step moves the weights


def test_colocate_trains_and_pushes_weights_every_step(tmp_path, base_dir, vllm):
    args = small_args(tmp_path, use_vllm=True, max_steps=2, max_completion_length=8)
    assert args.generation_backend == "vllm" and args.corrects_sampling
    t = GRPOTrainer(base_dir, [_length], args=args, train_dataset=toy.dataset(12))
    before = {n: p.detach().clone() for n, p in t.unwrapped.named_parameters()}
    pushed = []
    original = t.rollout_ctx.generator._load  # every load into the engine: before its first generation, then
    # after each step
    t.rollout_ctx.generator._load = lambda m: (original(m), pushed.append(_engine_matches(
        vllm.ENGINES[0], t.unwrapped)))
    metrics = t.train()
    (engine,) = vllm.ENGINES
    assert engine.kwargs["distributed_executor_backend"] == "external_launcher"
    assert engine.kwargs["logprobs_mode"] == "processed_logprobs" and engine.kwargs["gpu_memory_utilization"] == 0.3
    assert engine.calls == 2  # one generation per round
    # before its first generation, then after each optimizer step, the engine holds the policy's current weights
    assert pushed == [True, True, True]
    assert any(not torch.equal(before[n].cpu(), p) for n, p in engine.hf.named_parameters())  # and they did change
    assert engine.prefix_cache_resets == 3  # after each load
    # the engine samples with the policy's numerics: the importance weights are 1 up to float32 rounding
    assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-4)
    assert abs(metrics["sampling/sampling_logp_difference/max"]) < 1e-4


def test_colocate_builds_the_engine_as_trl_does(tmp_path, base_dir, vllm):
    """TRL 1.16's LLM(...) arguments, and the launcher variables vLLM's external_launcher backend reads (RANK and
    LOCAL_RANK unconditionally, MASTER_ADDR / MASTER_PORT for its env:// rendezvous): TRL sets them before building
    the engine; without them a run not started by torchrun failed with KeyError: 'RANK' inside vLLM."""
    args = small_args(tmp_path, use_vllm=True, max_completion_length=4, gradient_accumulation_steps=2)
    t = GRPOTrainer(base_dir, [_length], args=args, train_dataset=toy.dataset(8))
    t.rollout_ctx.generator(t.unwrapped, torch.tensor([[3, 4]]), torch.ones(1, 2, dtype=torch.long))
    (engine,) = vllm.ENGINES
    # max_num_seqs = per_device_train_batch_size · tensor_parallel_size · steps_per_generation = 8 · 1 · 2
    assert engine.kwargs == dict(tensor_parallel_size=1, gpu_memory_utilization=0.3, max_model_len=None,
                                 max_num_seqs=16, enable_sleep_mode=False, model_impl="vllm",
                                 distributed_executor_backend="external_launcher", seed=0,
                                 max_num_batched_tokens=4096, logprobs_mode="processed_logprobs",
                                 trust_remote_code=False)
    assert (engine.rank, engine.local_rank) == (0, 0) and os.environ["WORLD_SIZE"] == "1"
    assert os.environ["MASTER_ADDR"] == "localhost" and int(os.environ["MASTER_PORT"]) > 0


def test_colocate_keeps_the_launcher_s_variables(monkeypatch, vllm):
    from groupwise.generation.vllm import launcher_environment

    for name, value in dict(RANK="3", LOCAL_RANK="1", WORLD_SIZE="4", MASTER_ADDR="node0", MASTER_PORT="29511").items():
        monkeypatch.setenv(name, value)
    assert launcher_environment() == 3
    assert [os.environ[n] for n in LAUNCHER] == ["3", "1", "4", "node0", "29511"]


def test_a_hub_id_without_an_owner_reaches_vllm(tmp_path, base_dir, vllm):
    """vLLM loads the policy from its name: a hub id such as "gpt2" has no "/" and is no local path, and was
    refused as "a model built in memory"; only a model with no name at all is."""
    from groupwise.generation.vllm import VLLMColocateGenerator

    class Built(Exception):
        pass

    def llm(model, **kw):  # no download: the name reaching vLLM is the point
        raise Built(model)

    gen = VLLMColocateGenerator(small_args(tmp_path, use_vllm=True), pad_token_id=0)
    model = toy.build_model(toy.build_tokenizer(), seed=0, hidden_size=32)
    model.config._name_or_path = "gpt2"
    vllm.LLM, real = llm, vllm.LLM
    try:
        with pytest.raises(Built, match="^gpt2$"):
            gen._engine(model)
    finally:
        vllm.LLM = real
    model.config._name_or_path = ""
    with pytest.raises(ConfigError, match="not as a model built in memory"):
        gen._engine(model)


def test_the_engine_s_log_probs_reach_the_importance_correction(tmp_path, base_dir, vllm):
    """The log-prob vLLM gives each sampled token (logprobs=0, processed: after the temperature) is what the
    correction compares with the trainer's: were they lost (NaN), the weights would be 1 and the logged
    difference 0 whatever the sampler did."""
    args = small_args(tmp_path, use_vllm=True, max_completion_length=6, temperature=0.7)
    t = GRPOTrainer(base_dir, [_length], args=args, train_dataset=toy.dataset(8))
    comp = t._collect().round.completions
    (engine,) = vllm.ENGINES
    for row, mask, sampled in zip(comp.sampling_logps, comp.completion_mask.bool(), engine.sampled_logprobs,
                                  strict=True):
        assert torch.allclose(row[mask], torch.tensor(sampled)), (row, sampled)


def test_colocate_with_lora_pushes_merged_weights(tmp_path, base_dir, vllm):
    pytest.importorskip("peft")
    from peft import LoraConfig

    args = small_args(tmp_path, use_vllm=True, max_steps=2, max_completion_length=6, learning_rate=5e-2)
    # modules_to_save: the trained copy of lm_head is what the engine must get (not PEFT's original_module)
    t = GRPOTrainer(base_dir, [toy.letter_reward], args=args, train_dataset=toy.dataset(12),
                    peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                           modules_to_save=["lm_head"]))
    head = toy.build_model(t.tokenizer, seed=0, hidden_size=32).lm_head.weight
    t.train()
    merged = copy.deepcopy(t.unwrapped).merge_and_unload()
    assert not torch.equal(merged.lm_head.weight.cpu(), head)  # the saved copy trained
    engine = vllm.ENGINES[0]
    for name, p in engine.hf.named_parameters():
        assert torch.allclose(p, merged.state_dict()[name].cpu(), atol=1e-6), name
    assert not any("lora" in n or "original_module" in n or "modules_to_save" in n for n in engine.loads)
    base = toy.build_model(t.tokenizer, seed=0, hidden_size=32)  # the adapters moved the engine off the base
    assert any(not torch.equal(p, q) for p, q in zip(engine.hf.parameters(), base.parameters()))


def test_sleep_mode_generates_from_the_policy_s_current_weights(tmp_path, base_dir, vllm):
    """vllm_enable_sleep_mode: the engine sleeps at level 2 after each generation, which discards its weights (the
    stand-in turns them to NaN and refuses to generate from them); before each generation they are loaded again,
    the policy's as they are then."""
    args = small_args(tmp_path, use_vllm=True, max_steps=3, max_completion_length=6, vllm_enable_sleep_mode=True)
    t = GRPOTrainer(base_dir, [_length], args=args, train_dataset=toy.dataset(12))
    assert vllm.ENGINES[0].sleeping  # started with the trainer, asleep at once (TRL): its memory given back
    seen = []
    original = vllm.LLM.generate

    def generate(engine, *a, **kw):
        seen.append(_engine_matches(engine, t.unwrapped))
        return original(engine, *a, **kw)

    vllm.LLM.generate = generate
    try:
        t.train()
    finally:
        vllm.LLM.generate = original
    (engine,) = vllm.ENGINES
    assert seen == [True, True, True] and engine.sleeping  # asleep between generations, awake for each
    assert engine.prefix_cache_resets == engine.calls == 3  # one load per generation, none while asleep
    assert engine.kwargs["enable_sleep_mode"] is True


def test_generation_kwargs_override_the_sampling_fields_as_in_trl(tmp_path, base_dir, vllm):
    """TRL updates its sampling fields with generation_kwargs (they override); evaluation's greedy calls stay
    greedy; a key that would change the completions' shape names the field to set instead."""
    from groupwise.generation.vllm import sampling_fields

    args = small_args(tmp_path, use_vllm=True, generation_kwargs={"top_k": 5, "temperature": 0.7, "seed": 3})
    assert sampling_fields(args, greedy=False) == dict(temperature=0.7, top_p=1.0, top_k=5, min_p=0.0,
                                                       repetition_penalty=1.0, max_tokens=args.max_completion_length,
                                                       seed=3)
    assert sampling_fields(args, greedy=True)["temperature"] == 0.0 and sampling_fields(args, True)["top_k"] == 0
    t = GRPOTrainer(base_dir, [_length], args=args, train_dataset=toy.dataset(4))
    t.rollout_ctx.generator(t.unwrapped, torch.tensor([[3, 4]]), torch.ones(1, 2, dtype=torch.long))  # no TypeError
    # a later tool turn's limit becomes the request's max_tokens, and a min_tokens above it comes down to it (vLLM
    # refuses min_tokens > max_tokens)
    args = small_args(tmp_path, use_vllm=True, generation_kwargs={"min_tokens": 3})
    t = GRPOTrainer(base_dir, [_length], args=args, train_dataset=toy.dataset(4))
    t.rollout_ctx.generator(t.unwrapped, torch.tensor([[3, 4]]), torch.ones(1, 2, dtype=torch.long), max_new_tokens=2)
    assert vllm.ENGINES[-1].last_params.max_tokens == 2 and vllm.ENGINES[-1].last_params.min_tokens == 2
    with pytest.raises(ConfigError, match=r"generation_kwargs\['max_tokens'\] would change the shape of the "
                                          r"completions: set max_completion_length instead"):
        small_args(tmp_path, use_vllm=True, generation_kwargs={"max_tokens": 4})
    # logprobs: TRL's generation_kwargs win here too (was: SamplingParams got logprobs twice, a TypeError); the
    # sampled token's log-prob is still among the top 2 vLLM returns. None would return none: refused
    args = small_args(tmp_path, use_vllm=True, generation_kwargs={"logprobs": 2})
    t = GRPOTrainer(base_dir, [_length], args=args, train_dataset=toy.dataset(4))
    out = t.rollout_ctx.generator(t.unwrapped, torch.tensor([[3, 4]]), torch.ones(1, 2, dtype=torch.long),
                                  logprobs=True)
    assert torch.isfinite(out.logprobs[0, :int(out.lengths[0])]).all()
    for bad in (None, -2, 1.5, True):
        with pytest.raises(ConfigError, match=r"generation_kwargs\['logprobs'\]=.*the sampled token's log-prob"):
            small_args(tmp_path, use_vllm=True, generation_kwargs={"logprobs": bad})


def test_a_seed_counts_a_group_s_rows_across_processes(tmp_path, base_dir, vllm, tokenizer):
    """G = 4, 6 rows per process: rank 1 holds rows 6-11 of the round, [B, B, C, C, C, C], groups split over the
    processes. Its rows are rows 2, 3 of B's group and 0-3 of C's: seeds s + [2, 3, 0, 1, 2, 3], as vLLM seeds the
    samples of the n = 4 requests server mode sends (was: s for every row, so B's and C's rows repeated one
    completion)."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from groupwise.generation.vllm import VLLMColocateGenerator

    args = small_args(tmp_path, use_vllm=True, generation_kwargs={"seed": 11}, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=4)  # (the rows below are a 6-row slice)
    gen = VLLMColocateGenerator(args, pad_token_id=tokenizer.pad_token_id, dist=SimpleNamespace(rank=1))
    ids, mask = encode_prompts(["repeat b:"] * 2 + ["repeat c:"] * 4, tokenizer, None)
    gen(AutoModelForCausalLM.from_pretrained(base_dir), ids, mask)
    assert [p.seed for p in vllm.ENGINES[-1].last_params_per_prompt] == [13, 14, 11, 12, 13, 14]


def test_a_completion_vllm_ends_without_eos_is_masked_to_its_length(tmp_path, base_dir, vllm):
    """A stop token (or string, or vLLM's max_model_len) ends a row early without an EOS: it comes back padded to
    the longest row, and only its own tokens are completion tokens (TRL: a mask of each row's length); with no EOS
    it counts as truncated (TRL: its last token is not an EOS)."""
    args = small_args(tmp_path, use_vllm=True, max_completion_length=8, generation_kwargs={"stop_token_ids": STOP})
    t = GRPOTrainer(base_dir, [_length], args=args, train_dataset=toy.dataset(8))
    comp = t._collect().round.completions
    (engine,) = vllm.ENGINES
    check_masked_to_lengths(comp, engine.outputs, t.tokenizer.eos_token_id)


STOP = toy.build_tokenizer().convert_tokens_to_ids(list("abcdefghijklm"))  # tokens the random policy draws often


def check_masked_to_lengths(comp, outputs, eos):
    """Each row's mask covers exactly the tokens the engine sampled for it; truncated = it did not end with EOS;
    and some rows did end at a stop token before the longest row (padding was there to be left out)."""
    for row, mask, truncated, sampled in zip(comp.completion_ids.tolist(), comp.completion_mask.tolist(),
                                             comp.truncated.tolist(), outputs, strict=True):
        assert mask == [1] * len(sampled) + [0] * (len(row) - len(sampled))
        assert row[:len(sampled)] == sampled and truncated == (sampled[-1] != eos)
    assert any(s[-1] in STOP and len(s) < comp.completion_ids.size(1) for s in outputs)


def test_use_vllm_without_vllm_says_what_to_install(tmp_path, base_dir, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError, match=r"use_vllm=True needs vLLM: `pip install vllm`"):
        GRPOTrainer(base_dir, [toy.letter_reward], args=small_args(tmp_path, use_vllm=True),
                    train_dataset=toy.dataset(4))


def test_trl_vllm_configs_are_accepted_or_refused_with_the_reason(monkeypatch):
    GRPOConfig(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.5, vllm_enable_sleep_mode=True)
    GRPOConfig(use_vllm=True, vllm_mode="server")  # tests/test_vllm_server.py
    # a tensor-parallel engine spans tp processes: their number must be a multiple of it (checked before loading)
    with pytest.raises(ConfigError, match=r"vllm_tensor_parallel_size=2 must divide the number of training "
                                          r"processes \(1\): each colocated engine spans 2 of them"):
        GRPOConfig(use_vllm=True, vllm_tensor_parallel_size=2)
    monkeypatch.setenv("WORLD_SIZE", "4")  # as torchrun sets it
    GRPOConfig(use_vllm=True, vllm_tensor_parallel_size=2)  # two engines of 2 processes
    with pytest.raises(ConfigError, match=r"vllm_tensor_parallel_size=3 must divide .* processes \(4\)"):
        GRPOConfig(use_vllm=True, vllm_tensor_parallel_size=3)


@pytest.mark.slow
def test_a_tensor_parallel_engine_spans_two_processes_that_train_as_one(tmp_path):
    """vllm_tensor_parallel_size=2 on 2 gloo processes (TRL's layout): one engine spans both, seeded rank // 2 = 0;
    each call gathers both processes' prompts (rank order), the engine generates them together, and each process
    takes its own rows, so the two train as 1 process with one engine does. Evaluation and the tool loop, whose
    processes make different numbers of calls, stay matched: a process that has finished joins the others' calls
    with no prompts (the stand-in checks every process of the group calls generate() with the same requests; without
    the join the other process waits for ever), and a process that fails stops its group with its error."""
    from tests.vllm_worker import build_tool_model, check_two_train_as_one, launch

    base_dir = tmp_path / "tool-model"
    build_tool_model(base_dir)
    results = {n: launch(tmp_path / str(n), n, {"VLLM_MODE": "colocate", "BASE_DIR": str(base_dir)}) for n in (1, 2)}
    check_two_train_as_one(results, tmp_path, base_dir)
    one, two = results[1][0], results[2]
    # every engine call, on both processes: training 4 + 4 prompts a round; evaluation 2 + 2, then 1 + none; the
    # failing evaluation 2 + 2 (then process 1 fails and process 0's next call stops); the evaluation whose engine
    # fails 2 + 2, then 1 + none (it fails). In the tool step's trainer (a second engine): 4 + 4, then the 4 rows
    # whose turn called the tool + none; its evaluation ("call", "answer", "call" in batches of 1: process 0 holds
    # both "call" prompts) 1 + 1, then 1 (process 0's tool turn) + none, then process 0's second prompt, 2 turns,
    # + none. One process: 8, 8; 2, 2, 1; 2; 2, 2, 1; then 8, 4; 1, 1, 1, 1, 1
    assert two[0]["engines"] == two[1]["engines"] == {
        "sizes": [[8, 8, 4, 1, 4, 4, 1], [8, 4, 2, 1, 1, 1]],
        "kwargs": {"tensor_parallel_size": 2, "seed": 0, "max_num_seqs": 4 * 2}}
    assert one["engines"] == {"sizes": [[8, 8, 2, 2, 1, 2, 2, 2, 1], [8, 4, 1, 1, 1, 1, 1]],
                              "kwargs": {"tensor_parallel_size": 1, "seed": 0, "max_num_seqs": 8 * 1}}
    # process 0 learnt of process 1's failure from the group's exchange, within the evaluation's generation
    assert "generation failed on another process of the vLLM tensor-parallel group" in two[0]["failure"]
    # the engine failing in a round process 1 only joined (it had finished its batches): the engine's error on both
    # processes, as on one (process 1 raised it within the join and told the group; it did not wait nor hang)
    assert one["engine_failure"] == two[0]["engine_failure"] == two[1]["engine_failure"] == \
        "RuntimeError: the stand-in engine failed"
    # a fresh trainer resumed from checkpoint-1 ends with the straight run's weights: the checkpoint's random
    # streams were restored after its engine started (the same on both processes: the stand-in checks that the group
    # samples alike); and a run that evaluates before training trains (its engine started with the trainer)
    assert one["resumed"] is two[0]["resumed"] is two[1]["resumed"] is True
    assert one["evaluated_first"] is two[0]["evaluated_first"] is two[1]["evaluated_first"] is True


def test_structured_outputs_constrain_every_completion(tmp_path, base_dir, vllm, tokenizer):
    """vllm_structured_outputs_regex (TRL): vLLM samples only completions matching the pattern (the stand-in masks
    the tokens that would leave it, as vLLM's token bitmask), in training and in greedy evaluation; it wins over
    generation_kwargs["structured_outputs"] with TRL's warning; without use_vllm it has no effect (a warning)."""
    import regex

    args = small_args(tmp_path, use_vllm=True, vllm_structured_outputs_regex="[ab]+", max_steps=1,
                      vllm_importance_sampling_correction=False)
    seen = []

    def record(completions, **_):
        seen.extend(completions)
        return [float(len(c)) for c in completions]

    t = GRPOTrainer(base_dir, [record], args=args, train_dataset=toy.dataset(4), eval_dataset=toy.dataset(2))
    t.train()
    t.evaluate()
    assert len(seen) == 8 + 2 and all(regex.fullmatch("[ab]+", c, partial=True) for c in seen)
    assert any(len(c) > 1 for c in seen)  # not empty: the constraint left the model its choice of a / b
    from vllm.sampling_params import StructuredOutputsParams

    constraint = vllm.ENGINES[-1].last_params.structured_outputs  # the engine got vLLM's StructuredOutputsParams
    assert isinstance(constraint, StructuredOutputsParams) and constraint.regex == "[ab]+"
    from groupwise.generation.vllm import structured_outputs

    both = small_args(tmp_path, use_vllm=True, vllm_structured_outputs_regex="a+",
                      vllm_importance_sampling_correction=False)
    with pytest.warns(UserWarning, match="`structured_outputs_regex` takes precedence"):
        assert structured_outputs(both, {"choice": ["x"]}) == {"regex": "a+"}
    assert structured_outputs(small_args(tmp_path, use_vllm=True), {"choice": ["x"]}) == {"choice": ["x"]}
    with pytest.warns(UserWarning, match="vllm_structured_outputs_regex='a' has no effect without use_vllm=True"):
        small_args(tmp_path, vllm_structured_outputs_regex="a")


def test_structured_outputs_with_the_sampler_s_log_probs_are_refused(tmp_path):
    """vLLM's log-probs under a constraint are the constrained distribution's (its token bitmask is applied before
    the sampler computes them): with the importance correction each completion's weight π_θold / π_vLLM ≤ 1 would
    shrink its loss by the probability the constraint removed (the stand-in measured ratios of 0.002), with the
    off-policy mask it would be masked. TRL 1.16 trains so, silently; groupwise refuses and names the fix."""
    for constraint in ({"vllm_structured_outputs_regex": "[ab]+"},
                       {"generation_kwargs": {"structured_outputs": {"choice": ["a", "b"]}}}):
        name = "vllm_structured_outputs_regex" if "vllm_structured_outputs_regex" in constraint else \
            r"generation_kwargs\['structured_outputs'\]"
        with pytest.raises(ConfigError, match=rf"{name} with vllm_importance_sampling_correction=True: vLLM's "
                                              r"log-probs are those of the constrained distribution.*set "
                                              r"vllm_importance_sampling_correction: false"):
            small_args(tmp_path, use_vllm=True, **constraint)  # the correction is on by default, as in TRL
        with pytest.raises(ConfigError, match=rf"{name} with off_policy_mask_threshold=0.5"):
            small_args(tmp_path, use_vllm=True, vllm_importance_sampling_correction=False,
                       off_policy_mask_threshold=0.5, **constraint)
        small_args(tmp_path, use_vllm=True, vllm_importance_sampling_correction=False, **constraint)  # accepted


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_weights_pushed_are_in_the_checkpoint_layout_vllm_loads(tmp_path, lora):
    """vLLM loads a checkpoint's names and layout. transformers 5 holds a MoE's experts fused (Qwen3-MoE:
    `mlp.experts.gate_up_proj` (E, 2I, H), `mlp.experts.down_proj`), where its checkpoints — the files vLLM reads —
    have `mlp.experts.<i>.gate_proj.weight` …: the push converts back as save_pretrained does, so the names and
    tensors pushed are exactly those of the model's saved safetensors (LoRA: merged into the base first). Before,
    the fused names went out, which vLLM's MoE loaders do not know."""
    from safetensors.torch import load_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from groupwise.generation.vllm import vllm_named_weights

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2))
    assert any(n.endswith("mlp.experts.gate_up_proj") for n, _ in model.named_parameters())  # fused in memory
    policy = model
    if lora:
        from peft import LoraConfig, get_peft_model

        policy = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    with vllm_named_weights(policy) as named:
        pushed = {n: t.clone() for n, t in named}
    # the checkpoint of the (merged) policy
    (copy.deepcopy(policy).merge_and_unload() if lora else model).save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in pushed
    assert pushed.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(pushed[name], tensor), name


def test_an_adapter_on_tied_embeddings_is_refused_with_vllm(tmp_path, tokenizer, vllm):
    """vLLM receives merged weights: with tie_word_embeddings one tensor cannot hold both an adapted head and the
    input embeddings (groupwise.adapters.adapted_tied_embeddings); refused when the trainer is built, naming the fix."""
    from peft import LoraConfig

    from groupwise.config_base import ConfigError

    model = toy.build_model(tokenizer, seed=0, hidden_size=32)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    folder = tmp_path / "tied"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj"], modules_to_save=["lm_head"])
    with pytest.raises(ConfigError, match=r"use_vllm with an adapter on the output head of a model whose input "
                                          r"embeddings and output head are one tensor"):
        GRPOTrainer(str(folder), [_length], args=small_args(tmp_path, use_vllm=True), train_dataset=toy.dataset(12),
                    peft_config=lora)


def _resumable_run(tmp_path, base_dir, out, crash_on_round=None, resume=None):
    from groupwise.rewards import RewardFunctionError

    calls = []

    def reward(completions, **_):
        calls.append(len(completions))
        if len(calls) == crash_on_round:
            raise RuntimeError("the machine went away")
        # python's, numpy's and torch's streams, which a reward function may draw from
        noise = torch.rand(len(completions)) * 0.1 + random.random() * 0.01 + float(np.random.rand()) * 0.01
        return [float(len(c)) + float(e) for c, e in zip(completions, noise)]

    args = small_args(tmp_path, output_dir=str(tmp_path / out), use_vllm=True, max_steps=4, save_steps=2,
                      max_completion_length=6)
    t = GRPOTrainer(base_dir, [reward], args=args, train_dataset=toy.dataset(12))
    if crash_on_round is None:
        t.train(resume_from_checkpoint=resume)
    else:
        with pytest.raises(RewardFunctionError, match="the machine went away"):
            t.train()
    return t


def test_a_resumed_colocate_run_samples_what_the_straight_run_sampled(tmp_path, base_dir, vllm):
    """vLLM's in-process worker seeds python's, numpy's and torch's random streams with its `seed` when it starts,
    then samples from torch's. The engine starts with the trainer (as TRL's), so the resume restores the
    checkpoint's streams after it; an engine built at the resumed run's first generation reseeded them, and the run
    sampled other completions than the run it continued."""
    straight = _resumable_run(tmp_path, base_dir, "straight")
    (engine,) = vllm.ENGINES
    straight_outputs = engine.outputs  # the last round's completions
    _resumable_run(tmp_path, base_dir, "crashed", crash_on_round=3)
    vllm.ENGINES.clear()
    resumed = _resumable_run(tmp_path, base_dir, "crashed", resume=str(tmp_path / "crashed" / "checkpoint-2"))
    (engine,) = vllm.ENGINES
    assert engine.calls == 2 and engine.outputs == straight_outputs
    for (n, a), (_, b) in zip(straight.unwrapped.named_parameters(), resumed.unwrapped.named_parameters()):
        assert torch.equal(a, b), f"{n} differs after resume"


def test_the_engine_starts_with_the_trainer_and_its_seed_is_the_run_s_streams_as_in_trl(tmp_path, base_dir, vllm):
    """TRL seeds each process with seed + rank, then builds the engine, whose in-process worker reseeds python's,
    numpy's and torch's streams with rank // tp. groupwise starts it at the same point, so an evaluation before
    training (eval_on_start, or evaluate() first), which keeps the streams as they were, does not build it with
    the streams it set aside: the engines of a tensor-parallel group would then sample from different streams."""
    args = small_args(tmp_path, use_vllm=True, max_completion_length=4, seed=7)
    t = GRPOTrainer(base_dir, [_length], args=args, train_dataset=toy.dataset(8), eval_dataset=toy.dataset(2))
    (engine,) = vllm.ENGINES
    assert torch.initial_seed() == 0 and engine.calls == 0
    with torch.no_grad():  # weights other than the path's, which the engine loaded as it started
        for p in t.unwrapped.parameters():
            p.add_(0.01)
    assert not _engine_matches(engine, t.unwrapped)
    t.evaluate()
    assert engine.calls == 1 and _engine_matches(engine, t.unwrapped)  # loaded before its first generation


def test_a_prompt_with_no_room_in_vllm_max_model_length_is_refused_before_the_model_loads(tmp_path, base_dir, vllm):
    """The colocated engine holds vllm_max_model_length tokens, prompt and completion together: a completion there
    stops short of max_completion_length (TRL's engine cuts it with nothing said). toy prompts are 'repeat x:', 9
    tokens (one per character): 9 + max_completion_length 8 = 17 > 16, and = 17 fits. The model's positions (1024)
    are not the limit. (Server mode: the server's own context applies, not this field.)"""
    args = small_args(tmp_path, use_vllm=True, max_completion_length=8, vllm_max_model_length=16)
    with pytest.raises(ConfigError, match=r"^train_dataset row 0: 9 prompt tokens \+ max_completion_length=8 exceed "
                                          r"vllm_max_model_length=16 \(12 of 12 rows\); lower max_completion_length "
                                          r"or max_prompt_length, or raise vllm_max_model_length$"):
        GRPOTrainer(base_dir, [_length], args=args, train_dataset=toy.dataset(12))
    assert vllm.ENGINES == []  # refused before the engine (and the model) loaded
    args = small_args(tmp_path, use_vllm=True, max_completion_length=8, vllm_max_model_length=17)
    GRPOTrainer(base_dir, [_length], args=args, train_dataset=toy.dataset(12))  # 9 + 8 = 17: built
    assert len(vllm.ENGINES) == 1
