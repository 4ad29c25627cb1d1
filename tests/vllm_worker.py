"""Run under `python -m torch.distributed.run --nproc_per_node N tests/vllm_worker.py OUT` (or plainly for N=1) with
the stand-in `vllm` on PYTHONPATH: a GRPOTrainer run with use_vllm in $VLLM_MODE, 'server' (against the stand-in
server at $STANDIN_URL, which tests/test_vllm_server.py starts) or 'colocate' (vllm_tensor_parallel_size = N: one
engine spans every process). 8 rows per round over all processes, then an evaluation of 5 prompts in batches of 2
(with 2 processes: 2 batches on one, 1 on the other), then an evaluation whose reward function fails on the last
process only; in colocate mode an evaluation whose engine fails on the last prompt (with 2 processes in a round only
process 0 has prompts for), a fresh trainer resumed from the run's checkpoint-1 (saved in colocate mode only) and a
one-step run that evaluates before training; then one step with a tool whose rollouts take 2 turns for one prompt
and 1 for the other (`scripted_replies`: with 2 processes one process runs more turns than the other), then an
evaluation with the tool of 3 prompts in batches of 1. Writes result_<rank>.json (the logged losses and rewards, the
rows this process trained on, the evaluation's metrics, the failed evaluation's error, the tool step's metrics and
the tool evaluation's, and in colocate mode the number of prompts of each engine call, whether the resumed
trainer ended with the straight run's weights and the evaluating run trained) and, from rank 0,
weights.safetensors."""

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from groupwise import GRPOConfig, GRPOTrainer
from groupwise.tasks import toy


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def scripted_replies(tok):
    """prompt ids -> the tool step's scripted turns (a call then an answer, or an answer at once), None elsewhere."""
    from tests.agents_support import call

    def script(prompt_ids):
        text = tok.decode(prompt_ids)
        if "call the tool" not in text and "answer directly" not in text:
            return None
        reply = "done<|im_end|>" if "<|im_start|>tool" in text or "answer directly" in text else \
            call("multiply", a=3, b=4) + "<|im_end|>"
        return tok(reply, add_special_tokens=False)["input_ids"]

    return script


def build_tool_model(folder: Path):
    """A tool-calling tokenizer and a tiny model saved to `folder` (the runs load it by path, as vLLM does)."""
    tok = toy.build_tool_tokenizer()
    toy.build_model(tok, seed=0, hidden_size=32, max_positions=1024).save_pretrained(folder)
    tok.save_pretrained(folder)
    return tok


def launch(out: Path, nproc: int, env: dict[str, str]) -> list[dict]:
    """Run this worker on `nproc` gloo processes (plain python for 1) with `env` added; every process's result."""
    from tests.launcher import torchrun

    standin = str(Path(__file__).with_name("vllm_standin"))
    env = {**env, "PYTHONPATH": os.pathsep.join([standin, os.environ.get("PYTHONPATH", "")])}
    # the launcher drops RANK, WORLD_SIZE, MASTER_* left by an earlier engine in the test process and sets its own
    proc = torchrun(__file__, out, nproc=nproc, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((out / f"result_{r}.json").read_text()) for r in range(nproc)]


def check_two_train_as_one(results: dict[int, list[dict]], out: Path, base_dir: Path) -> None:
    """What 2 processes against the same engine (same seed, same requests) share with 1 process: results[n] are the
    n-process run's results, written under out / str(n)."""
    import pytest
    import torch
    from safetensors.torch import load_file

    one, two = results[1][0], results[2]
    # each process scored its own half of every round's rows; together they are the one-process run's rows
    assert len(two[0]["completions"]) == len(two[1]["completions"]) == 8
    halves = [two[r]["completions"][i * 4:(i + 1) * 4] for i in range(2) for r in range(2)]
    assert [c for half in halves for c in half] == one["completions"]
    for a, b in zip(one["lines"], two[0]["lines"], strict=True):
        assert a["reward"] == b["reward"] and a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    w1, w2 = (load_file(str(out / n / "weights.safetensors")) for n in ("1", "2"))
    # to float rounding (2 processes average their gradients); an optimizer step moves weights by about 1e-2
    assert all(torch.allclose(w1[k], w2[k], atol=1e-5) for k in w1), max((w1[k] - w2[k]).abs().max().item() for k in w1)
    assert not all(torch.equal(w1[k], p) for k, p in load_file(str(base_dir / "model.safetensors")).items()
                   if k in w1)  # the runs trained
    # greedy evaluation of the same 5 prompts by the same trained weights: the same metrics
    for key in ("eval_reward", "eval_completions/mean_length"):
        assert two[0]["eval"][key] == two[1]["eval"][key] == pytest.approx(one["eval"][key], abs=1e-6)
    # a reward function failing in evaluation on the last process (with 2, the one with fewer batches, which stops
    # while the other still generates): its error, on every process (not a timeout)
    assert one["failure"].startswith("RewardFunctionError") and "failed on process 0" in one["failure"]
    assert two[1]["failure"].startswith("RewardFunctionError")
    assert two[0]["failure"].startswith("ProcessFailed") and "failed on process 1" in two[0]["failure"]
    # the tool step: 4 of the 8 rollouts called the tool once (on one process only, with 2), and both processes
    # finished it
    assert [r["tools"]["tools/call_frequency"] for r in (one, *two)] == [0.5, 0.5, 0.5]
    # evaluation with tools (a tool loop within an evaluation, processes with 2 and 1 batches): 2 of 3 prompts call
    assert [r["tool_eval"]["eval_tools/call_frequency"] for r in (one, *two)] == [2 / 3] * 3


def main(out: Path) -> None:
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    mode = os.environ["VLLM_MODE"]
    where = dict(vllm_server_base_url=os.environ["STANDIN_URL"], vllm_group_port=int(os.environ["STANDIN_GROUP_PORT"]),
                 vllm_server_timeout=10.0) if mode == "server" else dict(vllm_tensor_parallel_size=world)
    args = GRPOConfig(output_dir=str(out), use_vllm=True, vllm_mode=mode, **where,
                      num_generations=4, per_device_train_batch_size=8 // world, max_completion_length=6, max_steps=2,
                      learning_rate=1e-2, logging_steps=1, save_steps=int(mode == "colocate"),
                      lr_scheduler_type="constant", seed=0,
                      per_device_eval_batch_size=2, ddp_timeout=60.0)
    seen, failing = [], []

    def length(completions, **_):  # varied rewards: every step moves the weights
        if failing and rank == world - 1:  # with 2 processes, the one with fewer evaluation batches
            raise ValueError(f"a reward function failed on process {rank}")
        seen.extend(completions)
        return [float(len(c)) for c in completions]

    t = GRPOTrainer(os.environ["BASE_DIR"], [length], args=args, train_dataset=toy.dataset(16),
                    eval_dataset=toy.dataset(5, seed=1))
    t.train()
    trained = list(seen)
    evaluation = t.evaluate()
    failing.append(True)
    try:
        t.evaluate()
        failure = None
    except Exception as e:  # noqa: BLE001 — the test reads which error each process raised
        failure = f"{type(e).__name__}: {e}"
    failing.clear()
    engine_failure = None
    if mode == "colocate":  # the engine fails on the last prompt, in a round that process 1 only joins (2 processes)
        import vllm
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(os.environ["BASE_DIR"])

        def fail_on_the_last(prompt_ids):
            if "repeat h:" in tok.decode(prompt_ids):
                raise RuntimeError("the stand-in engine failed")

        vllm.LLM.reply = staticmethod(fail_on_the_last)
        try:
            t.evaluate()
        except Exception as e:  # noqa: BLE001 — the test reads which error each process raised
            engine_failure = f"{type(e).__name__}: {e}"
        vllm.LLM.reply = None
    if mode == "server":
        t.rollout_ctx.generator.close()
    lines = [{k: h[k] for k in ("loss", "reward") if k in h} for h in t.state.log_history if "loss" in h]
    resumed = evaluated_first = None
    if mode == "colocate":  # a fresh trainer resumed from checkpoint-1 trains step 2 as the straight run did
        import vllm

        built = len(vllm.ENGINES)
        r = GRPOTrainer(os.environ["BASE_DIR"], [length], args=args, train_dataset=toy.dataset(16))
        r.train(resume_from_checkpoint=str(out / "checkpoint-1"))
        theirs = r.unwrapped.state_dict()
        resumed = all(torch.equal(p, theirs[k]) for k, p in t.unwrapped.state_dict().items())
        # an evaluation before training (it keeps the random streams as they were): the stand-in raises if the
        # group's processes sample from different streams
        e = GRPOTrainer(os.environ["BASE_DIR"], [length], args=dataclasses.replace(
            args, output_dir=str(out / "eval-first"), eval_on_start=True, max_steps=1, save_steps=0),
            train_dataset=toy.dataset(16), eval_dataset=toy.dataset(5, seed=1))
        e.train()
        evaluated_first = [h["step"] for h in e.state.log_history if "eval_reward" in h] == [0] and \
            e.state.global_step == 1
        del vllm.ENGINES[built:]  # their engines are not among the calls the test counts
    if t.dist.is_main:
        save_file({k: v.detach().clone() for k, v in t.unwrapped.state_dict().items()}, str(out / "weights.safetensors"))
    tools = dataclasses.replace(args, output_dir=str(out / "tools"), max_steps=1, max_completion_length=200,
                                max_tool_calling_iterations=2, per_device_eval_batch_size=1)
    if mode == "server":
        tools = dataclasses.replace(tools, vllm_group_port=args.vllm_group_port + 1)
    else:  # the server's script, played by the colocated engines
        import vllm
        from transformers import AutoTokenizer

        vllm.LLM.reply = staticmethod(scripted_replies(AutoTokenizer.from_pretrained(os.environ["BASE_DIR"])))
    chat = [{"prompt": [{"role": "user", "content": text}]} for text in ("call the tool", "answer directly")]
    t = GRPOTrainer(os.environ["BASE_DIR"], [length], args=tools, train_dataset=chat, tools=[multiply])
    t.train()
    # an evaluation with tools: 3 prompts in batches of 1 (2 + 1 on two processes), each batch a tool loop
    tool_eval = t.evaluate(eval_dataset=chat + chat[:1])
    if mode == "server":
        t.rollout_ctx.generator.close()
    tool_line = next(h for h in t.state.log_history if "loss" in h)
    engines = {}
    if mode == "colocate":
        import vllm

        engines = {"sizes": [engine.sizes for engine in vllm.ENGINES],
                   "kwargs": {k: vllm.ENGINES[0].kwargs[k] for k in ("tensor_parallel_size", "seed", "max_num_seqs")}}
    (out / f"result_{t.dist.rank}.json").write_text(json.dumps({
        "lines": lines, "completions": trained, "eval": evaluation, "failure": failure, "engine_failure": engine_failure,
        "resumed": resumed, "evaluated_first": evaluated_first,
        "tools": tool_line,
        "tool_eval": tool_eval,
        "engines": engines}))


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    main(out)
