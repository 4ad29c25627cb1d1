"""Build the calculator task's base policy: a tiny Llama trained from scratch (supervised, seeded, CPU) on worked
tool-calling transcripts of groupwise.tasks.calculator (user problem → calculate call → result → … → answer call →
"ok" → closing turn), stopped as soon as its held-out greedy accuracy — through groupwise's tool loop with
CalculatorEnv — reaches --target: it writes well-formed tool calls, often the wrong ones (room for RL). Writes
safetensors + config + tokenizer (chat template, response template) + provenance.json into --out.

    .venv/bin/python scripts/make_calculator_policy.py     # regenerates src/groupwise/tasks/data/calculator_policy

Each training sequence is built exactly as a rollout sees it: the prompt rendered with the tools
(Agent.render_prompt), each assistant turn tokenized on its own and ended by the EOS, and the tool results' tokens
from the chat template (Agent.tool_suffix_ids). The loss is on the assistant turns only (the loop:
groupwise.tasks.warmstart).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from groupwise.tasks import calculator as C
from groupwise.tasks.warmstart import Example, arguments, save_policy, tiny_llama, train_until

DEFAULT_OUT = Path(__file__).parents[1] / "src" / "groupwise" / "tasks" / "data" / "calculator_policy"
_SUFFIXES: dict[str, list[int]] = {}


def encode(tokenizer, toolbox, agent, problem: str) -> Example:
    """(ids, loss mask): prompt, then each assistant turn (mask 1) and the tool tokens after it (mask 0)."""
    ids = agent.render_prompt(C.prompt_of(problem), toolbox.schemas[None])
    mask = [0] * len(ids)
    messages = C.transcript(problem)
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            text = m["content"]
            for call in m.get("tool_calls") or []:
                f = call["function"]
                text += (C.call_text(f["arguments"]["expression"]) if f["name"] == "calculate"
                         else C.answer_text(f["arguments"]["value"]))
            turn = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            ids, mask = ids + turn, mask + [1] * len(turn)
        elif k == 0 or messages[k - 1]["role"] != "tool":  # the tool messages after one turn, rendered together
            tools = [m]
            for nxt in messages[k + 1:]:
                if nxt["role"] != "tool":
                    break
                tools.append(nxt)
            key = json.dumps(tools, sort_keys=True)
            if key not in _SUFFIXES:  # the chat template is slow next to everything else; results repeat
                _SUFFIXES[key] = agent.tool_suffix_ids(tools)
            suffix = _SUFFIXES[key]
            ids, mask = ids + suffix, mask + [0] * len(suffix)
    return ids, mask


def main() -> None:
    ap = arguments(__doc__.split("\n")[0], DEFAULT_OUT)
    ap.add_argument("--num_train", type=int, default=50_000)
    args = ap.parse_args()
    torch.set_num_threads(2)
    tok = C.build_tokenizer()
    toolbox, agent = C.tool_loop(tok)
    model = tiny_llama(tok, seed=args.seed, max_positions=512)
    train = [encode(tok, toolbox, agent, p) for p in C.problems(args.num_train, split="train", seed=10_000 + args.seed)]
    test = C.problems(200, split="test")
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters; {len(train)} transcripts, "
          f"{sum(len(s) for s, _ in train) / len(train):.0f} tokens on average", flush=True)
    step, stats = train_until(model, tok, train, lambda: C.evaluate_policy(model, tok, test), args)
    save_policy(args.out, model, tok, {
        "script": "scripts/make_calculator_policy.py", "seed": args.seed, "steps": step, "target": args.target,
        "held_out_greedy": {k: round(v, 4) for k, v in stats.items()}, "lr": args.lr, "batch_size": args.batch_size,
        "num_train": args.num_train})


if __name__ == "__main__":
    main()
