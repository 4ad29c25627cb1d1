"""Build the demo's base policy: a tiny Llama trained from scratch (supervised, seeded) on the arithmetic task's
worked solutions, stopped as soon as its held-out greedy accuracy reaches --target (well-formed solutions, often
wrong: room for RL). Writes safetensors + config + tokenizer + provenance.json into --out
(groupwise.tasks.warmstart).

    .venv/bin/python scripts/make_demo_policy.py            # regenerates src/groupwise/tasks/data/arithmetic_policy
"""

from __future__ import annotations

from pathlib import Path

import torch

from groupwise.tasks import arithmetic as A
from groupwise.tasks.evaluation import greedy_accuracy
from groupwise.tasks.warmstart import Example, arguments, save_policy, tiny_llama, train_until

DEFAULT_OUT = Path(__file__).parents[1] / "src" / "groupwise" / "tasks" / "data" / "arithmetic_policy"


def encode(tokenizer, problem: str) -> Example:
    """The prompt (no loss), then the solution lines and the EOS (loss)."""
    prompt = tokenizer(A.prompt_of(problem), add_special_tokens=False)["input_ids"]
    answer = tokenizer("\n".join(A.solution_lines(problem)), add_special_tokens=False)["input_ids"]
    answer += [tokenizer.eos_token_id]
    return prompt + answer, [0] * len(prompt) + [1] * len(answer)


def main() -> None:
    args = arguments(__doc__.split("\n")[0], DEFAULT_OUT).parse_args()
    torch.set_num_threads(2)
    tok = A.build_tokenizer()
    model = tiny_llama(tok, seed=args.seed, max_positions=96)
    train = [encode(tok, p) for p in A.problems(50_000, split="train", seed=10_000 + args.seed)]
    test = A.problems(200, split="test")
    step, stats = train_until(model, tok, train, lambda: {"accuracy": greedy_accuracy(model, tok, test)}, args)
    save_policy(args.out, model, tok, {
        "script": "scripts/make_demo_policy.py", "seed": args.seed, "steps": step, "target": args.target,
        "held_out_greedy_accuracy": stats["accuracy"], "lr": args.lr, "batch_size": args.batch_size})


if __name__ == "__main__":
    main()
