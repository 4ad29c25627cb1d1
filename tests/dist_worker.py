"""Run under `python -m torch.distributed.run --nproc_per_node N tests/dist_worker.py MODE OUT` (or plainly for N=1).

same:  fixed completions of 3 prompts × 4; rewards, advantages, loss and one SGD step (lr 1) on this process's
       slice. Writes result_<rank>.json and weights_<loss_type>.safetensors (rank 0) for comparison across N.
train: a short GRPOTrainer run; writes result_<rank>.json with a checksum of the final weights.
"""

import copy
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from groupwise import GRPOConfig
from groupwise import rollout as R
from groupwise.distributed import Distributed
from groupwise.core.advantages import outcome_advantages, process_advantages
from groupwise.text import completion_masks, encode_prompts
from groupwise.modeling import PolicyForLogps
from groupwise.tasks import toy
from groupwise.types import Completions, Round
from groupwise.update import UpdateContext, optimizer_step

PROMPTS = ["repeat a:"] * 4 + ["repeat b:"] * 4 + ["repeat c:"] * 4
# row i belongs to group i // 4; with 2 processes of 6 rows, group 1 (rows 4-7) spans both processes
TEXTS = ["a\naa", "ab\nb", "b", "aa\naa", "bb\n", "a\nb\nb", "bbb", "b\na", "c", "c\nc", "ca\nc", "a\nbc"]


def step_has_letter(prompts, steps, **_):
    """Process reward: 1 for a step containing the prompt's letter, else 0."""
    return [[float(p[7] in s) for s in row] for p, row in zip(prompts, steps)]


def length_reward(completions, **_):
    """A reward that varies within every group (the completions' lengths): every step has a signal."""
    return [float(len(c)) for c in completions]


def same(out: Path) -> None:
    dist = Distributed()
    tok = toy.build_tokenizer()
    n = len(PROMPTS) // dist.world_size
    lo, hi = dist.rank * n, (dist.rank + 1) * n
    pids, pmask = encode_prompts(PROMPTS[lo:hi], tok, None)
    T = 8
    cids = torch.full((n, T), tok.pad_token_id)
    for i, text in enumerate(TEXTS[lo:hi]):
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        cids[i, : len(ids)] = torch.tensor(ids)
    cmask, trunc = completion_masks(cids, [tok.eos_token_id], T)
    comp = Completions(pids, pmask, cids, cmask, trunc, PROMPTS[lo:hi], TEXTS[lo:hi],
                       {"letter": [p[7] for p in PROMPTS[lo:hi]]})
    result = {}
    from groupwise.rewards import load_reward_sources
    from groupwise.rewards.steps import StepSplitter

    # "entropy": the top-entropy threshold is over the micro-batch of every process (gathered, of unequal lengths)
    for case, loss_type, supervision, extra in (("dapo", "dapo", "outcome", {}), ("grpo", "grpo", "outcome", {}),
                                                ("process", "dapo", "both", {}),
                                                ("entropy", "dapo", "outcome", {"top_entropy_quantile": 0.5}),
                                                ("fp16", "dapo", "outcome", {"fp16": True})):
        if extra.get("fp16"):  # float16 autocast + loss scale (last: the Distributed it replaces is not used again)
            dist = Distributed(fp16=True)
        args = GRPOConfig(num_generations=4, per_device_train_batch_size=n, max_completion_length=T,
                          loss_type=loss_type, learning_rate=1.0, max_grad_norm=0.0, output_dir=str(out),
                          supervision=supervision, **extra)
        sources = load_reward_sources([toy.letter_reward])
        ctx = R.RolloutContext(args=args, tokenizer=tok, generator=None, dist=dist, eos_token_ids=[tok.eos_token_id],
                               reward_sources=sources, process_sources=load_reward_sources([step_has_letter]),
                               splitter=StepSplitter())
        scores = R.score(ctx, comp)
        step_scores = R.score_steps(ctx, comp) if supervision != "outcome" else None
        advantages = R.advantages(ctx, comp, scores, step_scores)
        model = toy.build_model(tok, seed=0, hidden_size=32)
        batch = R.build_batch(ctx, Round(comp, advantages, dist.shard(scores.rewards.flatten()), None, None, None), model)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        model, opt = dist.prepare(PolicyForLogps(model), opt)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        metrics = optimizer_step(UpdateContext(args, dist, model, opt, sched), [batch])
        opts = args.estimator_options()
        global_adv = outcome_advantages(scores.rewards, **opts) if step_scores is None else \
            process_advantages(step_scores.rewards, step_scores.ends, T, **opts)
        result[case] = {"advantages": global_adv.tolist(), "local": batch.advantages.tolist(),
                        "loss": metrics["loss"]}
        if dist.is_main:
            save_file({k: v.contiguous() for k, v in dist.unwrap(model).model.state_dict().items()},
                      str(out / f"weights_{case}.safetensors"))
    (out / f"result_{dist.rank}.json").write_text(json.dumps(result))


def train(out: Path) -> None:
    from groupwise import GRPOTrainer

    tok = toy.build_tokenizer()
    args = GRPOConfig(output_dir=str(out), num_generations=4, per_device_train_batch_size=4, max_completion_length=6,
                      max_steps=2, save_steps=2, learning_rate=1e-2, logging_steps=1)
    t = GRPOTrainer(toy.build_model(tok, seed=0, hidden_size=32), [toy.letter_reward], args=args,
                    train_dataset=toy.dataset(16), processing_class=tok)
    t.train()
    checksum = sum(float(p.double().sum()) for p in t.unwrapped.parameters())
    (out / f"result_{t.dist.rank}.json").write_text(json.dumps({"checksum": checksum, "world": t.dist.world_size}))


def fault(out: Path, kind: str) -> None:
    """A run in which rank 1 misbehaves: its reward function raises ('raises'), the process dies ('dies'), or a
    callback raises in on_step_end, outside any shared step, with ddp_timeout 30 min ('callback'), or its
    train_dataset is shuffled ('shuffled') or its evaluate() dataset is ('shuffled_eval'), or its reward function
    sleeps 18 s, past ddp_timeout 10 s ('stuck'), or calls sys.exit ('sysexit'); 'raises_slow_close': as 'raises',
    rank 0 taking 6 s to close its trackers (then writing rank0_closed); 'callback_caught': as 'callback', the script
    catching the error and calling sys.exit(1)."""
    import os

    from transformers import TrainerCallback

    from groupwise import GRPOTrainer

    class Raises(TrainerCallback):
        def on_step_end(self, args, state, control, **_):
            if int(os.environ.get("RANK", "0")) == 1:
                raise RuntimeError("callback raised only on rank 1")

    tok = toy.build_tokenizer()
    if kind == "raises_slow_close" and int(os.environ.get("RANK", "0")) == 0:  # rank 0 closes its trackers slowly
        import time

        from groupwise.logging import MetricsLogger

        close = MetricsLogger.close

        def slow_close(self, failed=False):
            time.sleep(6)
            close(self, failed)
            (out / "rank0_closed").touch()

        MetricsLogger.close = slow_close

    def reward(completions, **_):
        if int(os.environ.get("RANK", "0")) == 1:
            if kind in ("raises", "raises_slow_close"):
                raise KeyError("only on rank 1")
            if kind == "dies":
                os._exit(9)  # the process vanishes without a word
            if kind == "sysexit":  # a reward function leaving the process
                sys.exit(3)
            if kind == "stuck":  # no reward_timeout: rank 0 waits in the rewards' gather until ddp_timeout
                import time

                time.sleep(18)
        return [float(len(c)) for c in completions]

    args = GRPOConfig(output_dir=str(out), num_generations=4, per_device_train_batch_size=4, max_completion_length=6,
                      max_steps=3, learning_rate=1e-2, ddp_timeout={"callback": 1800, "callback_caught": 1800, "stuck": 10}.get(kind, 20),
                      save_steps=0)
    rank1 = int(os.environ.get("RANK", "0")) == 1
    rows = toy.dataset(16)
    trainer = GRPOTrainer(toy.build_model(tok, seed=0, hidden_size=32), [reward], args=args,
                          train_dataset=rows[::-1] if kind == "shuffled" and rank1 else rows, processing_class=tok,
                          callbacks=[Raises()] if kind in ("callback", "callback_caught") else None)
    if kind == "shuffled_eval":  # the train set agrees; the evaluation set does not
        trainer.evaluate(rows[:8][::-1] if rank1 else rows[:8])
    if kind == "callback_caught":  # a script's own handling: the error never reaches the interpreter
        try:
            trainer.train()
        except RuntimeError as e:
            print(f"caught: {e}", flush=True)
            sys.exit(1)
    trainer.train()


def run(out: Path) -> None:
    """A GRPOTrainer run described by RUN_SPEC (JSON: config fields, plus "resume", "crash_after", "tie",
    "poison_step" (_poison_row_0 at that global step), "trained_adapter" (_trained_adapter), "probe_head"
    (_probe_head, written to head_probe_<rank>.json), "load_in_bits" (4 or 8: QLoRA, with model_path), "model_path" (the model loaded from there; with use_vllm
    in colocate mode the stand-in engine's loads are checked, engine_<rank>.json) and "reward" ("letter", toy.letter_reward, or
    "length")); each
    process writes its state.log_history to log_history_<rank>.json and rank 0 the final weights (full, unsharded) to
    weights.safetensors. RUN_SPEC a list: its runs one after another
    in these processes (a fresh model and trainer each; the process group stays), each in its spec's "out" folder,
    where each process writes returned_<rank> when the run returned (a crash_after run too)."""
    import os

    spec = json.loads(os.environ["RUN_SPEC"])
    if not isinstance(spec, list):
        return run_one(out, spec)
    for one in spec:
        one = dict(one)
        dest = Path(one.pop("out"))
        dest.mkdir(parents=True, exist_ok=True)
        run_one(dest, one)
        (dest / f"returned_{os.environ.get('RANK', '0')}").touch()


def run_one(out: Path, spec: dict) -> None:
    from groupwise import GRPOTrainer

    resume, crash_after = spec.pop("resume", None), spec.pop("crash_after", None)
    tie, poison = spec.pop("tie", False), spec.pop("poison_step", None)
    adapter = spec.pop("trained_adapter", None)  # a PeftModel passed in, its adapter trained before (lora_B ≠ 0)
    probe = spec.pop("probe_head", False)  # after training: the head's log-probs against float32 (cast_lm_head_to_fp32)
    path = spec.pop("model_path", None)  # the model saved there (vLLM loads the policy from a path)
    reward = {"letter": toy.letter_reward, "length": length_reward}[spec.pop("reward", "letter")]
    bits = spec.pop("load_in_bits", None)  # QLoRA: the model at model_path loaded in 4 (or 8) bits
    dtype = spec.pop("model_dtype", None)  # the policy passed in this dtype ("bfloat16": loaded in 16 bits)
    main_saves = spec.pop("save_model_main_only", False)  # after training, save_model() on rank 0 alone
    tok = toy.build_tokenizer()
    args = GRPOConfig(**{"output_dir": str(out), "num_generations": 4, "per_device_train_batch_size": 4,
                         "max_completion_length": 6, "learning_rate": 1e-2, "logging_steps": 1,
                         "lr_scheduler_type": "constant", **spec})

    class Crash(Exception):
        pass

    class CrashAfter:  # a process dying right after checkpoint `crash_after` was written
        def on_save(self, args, state, control, **kw):
            if crash_after is not None and state.global_step == crash_after:
                raise Crash

    model = toy.build_model(tok, seed=0, hidden_size=32)
    if tie:  # embeddings and output head share one tensor (Qwen2.5-0.5B's layout)
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    if poison is not None:
        _poison_row_0(model, lambda: t.state.global_step == poison)
    if adapter is not None:
        model = _trained_adapter(model, adapter)
    quantization = None
    if bits is not None:
        from transformers import BitsAndBytesConfig

        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32) if bits == 4 \
            else BitsAndBytesConfig(load_in_8bit=True)
    t = GRPOTrainer(path or model, [reward], args=args, quantization_config=quantization, train_dataset=toy.dataset(16),
                    processing_class=tok, callbacks=[CrashAfter()])
    colocate = args.use_vllm and args.vllm_mode == "colocate"
    if colocate:  # the stand-in engine (tests/vllm_standin on PYTHONPATH)
        pushes = _record_pushes(t)
    try:
        t.train(resume_from_checkpoint=resume)
    except Crash:
        return
    if main_saves:
        if t.dist.is_main:
            t.save_model(str(out / "final"))
        return
    (out / f"log_history_{t.dist.rank}.json").write_text(json.dumps(t.state.log_history))
    if t.dist.sharding is not None:  # each FSDP2 unit's offload policy, the policy's and the reference's
        from torch.distributed.fsdp import FSDPModule

        roots = [t.trained] + ([t.reference.logps_model] if t.reference is not None else [])
        policies = sorted({type(m._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
                           for root in roots for m in root.modules() if isinstance(m, FSDPModule)})
        (out / f"units_{t.dist.rank}.json").write_text(json.dumps(policies))
        state = [v for st in t.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
        (out / f"master_dtypes_{t.dist.rank}.json").write_text(json.dumps(  # the trained shards and their state
            {"params": sorted({str(p.dtype) for p in t.unwrapped.parameters()}),
             "optimizer": sorted({str(v.dtype) for v in state})}))
    if probe:
        (out / f"head_probe_{t.dist.rank}.json").write_text(json.dumps(_probe_head(t)))
    if colocate:
        (out / f"engine_{t.dist.rank}.json").write_text(json.dumps(pushes))
    if bits is not None:  # the packed weights the sampling replica uses: the policy's own objects, or copies
        packed = [(n, p) for n, p in t.unwrapped.named_parameters() if type(p).__name__ in ("Params4bit", "Int8Params")]
        replica = dict(t.sampling_model.named_parameters())
        (out / f"packed_{t.dist.rank}.json").write_text(json.dumps(
            {"count": len(packed), "shared": sum(replica[n] is p for n, p in packed)}))
    if t.dist.is_main:
        save_file({k: v.clone() for k, v in t.sampling_model.state_dict().items()}, str(out / "weights.safetensors"))


def _trained_adapter(model: torch.nn.Module, target_modules: list[str]) -> torch.nn.Module:
    """`model` in a PeftModel whose LoRA adapter is not at its start (B ≠ 0, as after SFT): the policy differs from
    the base model, so π_ref (the adapter's initial values) differs from the adapters-off model. The same values on
    every process (seeded)."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=target_modules))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return peft_model


def _record_pushes(t) -> list[float]:
    """Every load of weights into the (stand-in) vLLM engine — before its first generation, then after each
    optimizer step: the largest difference between the engine's weights after the load and the policy's (the weights
    the trainer optimizes: the sharded ones gathered, a LoRA policy merged) at that moment."""
    from groupwise.generation.vllm import vllm_named_weights
    from groupwise.sharding import full_state_dict

    generator, pushes = t.rollout_ctx.generator, []
    load = generator._load

    def recorded(model):
        load(model)
        policy = t.unwrapped
        state = full_state_dict(policy) if t.dist.sharding is not None else policy.state_dict()
        reference = copy.deepcopy(t.sampling_model)  # the replica's layout, the policy's current values
        loaded = reference.load_state_dict(state, strict=False)
        assert not loaded.unexpected_keys and len(state) > 0, loaded  # every tensor gathered reached the copy
        with vllm_named_weights(reference) as named:  # vLLM's names (tests/test_vllm.py checks them), merged
            want = {n: p.detach().clone() for n, p in named}
        pushes.append(max((p - want[n]).abs().max().item() for n, p in generator.llm.hf.named_parameters()))

    generator._load = recorded
    return pushes


def _probe_head(t) -> dict:
    """One log-prob forward of the trained model (sharded or not, in its precision) with a hook on the output head
    taking its input hidden states, targets and log-probs; the same log-probs recomputed from those hidden states
    with the full head weight in float32, and in bfloat16: the largest differences to each."""
    head = t.unwrapped.get_output_embeddings()
    weight = head.weight.full_tensor() if hasattr(head.weight, "full_tensor") else head.weight.detach()
    seen = []
    handle = head.register_forward_hook(lambda module, args, output: seen.append((args, output)))
    gen = torch.Generator().manual_seed(3 + t.dist.rank)
    ids = torch.randint(3, t.unwrapped.config.vocab_size, (4, 10), generator=gen)
    with torch.no_grad(), t.dist.autocast():
        t.trained(ids, torch.ones_like(ids), 6)
    handle.remove()
    (hidden, targets), (logps, _) = seen[0]

    def recomputed(w):
        logits = hidden.float() @ w.float().T
        return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    return {"weight_dtype": str(weight.dtype), "hidden_dtype": str(hidden.dtype),
            "to_float32": (logps - recomputed(weight)).abs().max().item(),
            "to_bfloat16": (logps - recomputed(weight.bfloat16())).abs().max().item()}


def _poison_row_0(model: torch.nn.Module, when) -> None:
    """On rank 1, while when(): the gradient of row 0 of lm_head.weight this process computes becomes inf before it
    is reduced. Under FSDP2 row 0 is in rank 0's shard, so only rank 0's shard overflows; with DDP every process's
    gradient does. The hook goes on the weight the forward uses (FSDP2 gathers it into another Parameter), found
    when the final norm runs (the log-probs read lm_head.weight without calling lm_head)."""
    import os

    if os.environ.get("RANK") != "1":
        return
    hooked: list[torch.Tensor] = []  # the objects themselves: FSDP2 may gather into a new one, at a freed one's id

    def poison(grad):
        if not when():
            return grad
        grad = grad.clone()
        grad[0] = float("inf")
        return grad

    def pre_forward(*_):
        weight = model.lm_head.weight
        if weight.requires_grad and not any(w is weight for w in hooked):
            hooked.append(weight)
            weight.register_hook(poison)

    model.model.norm.register_forward_pre_hook(pre_forward)


def replica(out: Path) -> None:
    """LoRA with generation_dtype: each process's sampling replica against the policy it trains (DDP broadcasts
    rank 0's weights; every process builds its own adapter), when the first optimizer step begins."""
    from groupwise import GRPOTrainer

    tok = toy.build_tokenizer()
    args = GRPOConfig(output_dir=str(out), num_generations=4, per_device_train_batch_size=4, max_completion_length=6,
                      max_steps=1, save_steps=0, learning_rate=1e-2, use_peft=True, lora_target_modules=["q_proj"],
                      generation_dtype="float32")
    seen = {}

    class Compare:
        def on_step_begin(self, args, state, control, **kw):
            policy = dict(t.unwrapped.named_parameters())
            seen["same"] = all(torch.equal(p, policy[n]) for n, p in t.sampling_model.named_parameters())

    t = GRPOTrainer(toy.build_model(tok, seed=0, hidden_size=32), [toy.letter_reward], args=args,
                    train_dataset=toy.dataset(16), processing_class=tok, callbacks=[Compare()])
    t.train()
    rank = t.dist.rank
    t.end()  # transformers' Trainer.end(), TRL's scripts' last call: the process group is gone
    seen["group_left"] = not torch.distributed.is_initialized()
    (out / f"result_{rank}.json").write_text(json.dumps(seen))


def one_rank(out: Path) -> None:
    """Callbacks and calls made on the main process alone, as users write them: a stop asked for in on_epoch_begin
    (every process stops at the same step), then save_model under `if trainer.is_world_process_zero()` (no
    collective under DDP, as transformers). ddp_timeout=20: a process left waiting fails the run."""
    from groupwise import GRPOTrainer

    class StopOnMain:
        def on_epoch_begin(self, args, state, control, **kw):
            if state.is_world_process_zero and state.global_step > 0:
                control.should_training_stop = True

    tok = toy.build_tokenizer()
    args = GRPOConfig(output_dir=str(out), num_generations=4, per_device_train_batch_size=4, max_completion_length=4,
                      max_steps=6, save_steps=0, ddp_timeout=20, logging_steps=1)
    t = GRPOTrainer(toy.build_model(tok, seed=0, hidden_size=32), [toy.letter_reward], args=args,
                    train_dataset=toy.dataset(4), processing_class=tok, callbacks=[StopOnMain()])
    t.train()
    if t.is_world_process_zero():
        t.save_model(str(out / "final"))
    (out / f"result_{t.dist.rank}.json").write_text(json.dumps({"step": t.state.global_step}))


def inflight(out: Path) -> None:
    """Rank 1 starts a collective rank 0 never joins, then raises: its exit must not wait for that collective (the
    group's timeout, 120 s here) to destroy its process group. Each rank writes left_<rank> with its seconds."""
    import time

    import torch.distributed as torch_dist

    dist = Distributed(timeout=120)
    start = time.perf_counter()
    import atexit

    atexit.register(lambda: (out / f"left_{dist.rank}").write_text(f"{time.perf_counter() - start:.1f}"))
    if dist.rank == 1:
        torch_dist.all_reduce(torch.ones(1), async_op=True)
        raise RuntimeError("rank 1 leaves with a collective in flight")
    time.sleep(3)


def groups(out: Path) -> None:
    """Distributed.subgroup(2): each process's group (its members' ranks, gathered within it)."""
    dist = Distributed()
    group = dist.subgroup(2)
    (out / f"result_{dist.rank}.json").write_text(json.dumps(dist.gather_object_in(group, dist.rank)))


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    if mode.startswith("fault_"):
        fault(out, mode.removeprefix("fault_"))
    else:
        {"same": same, "train": train, "run": run, "replica": replica, "groups": groups, "inflight": inflight,
         "one_rank": one_rank}[mode](out)
