"""Build the demo's base policy: a tiny Llama trained from scratch (supervised, seeded) on the arithmetic task's
worked solutions, stopped as soon as its held-out greedy accuracy reaches --target (well-formed solutions, often
wrong: room for RL). Writes safetensors + config + tokenizer + provenance.json into --out.

    .venv/bin/python scripts/make_demo_policy.py            # regenerates src/groupwise/tasks/data/arithmetic_policy
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from groupwise.tasks import arithmetic as A
from groupwise.tasks.evaluation import greedy_accuracy

DEFAULT_OUT = Path(__file__).parents[1] / "src" / "groupwise" / "tasks" / "data" / "arithmetic_policy"


def build_model(tokenizer, seed: int):
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=96,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def encode(tokenizer, problem: str) -> tuple[list[int], int]:
    prompt = tokenizer(A.prompt_of(problem), add_special_tokens=False)["input_ids"]
    answer = tokenizer("\n".join(A.solution_lines(problem)), add_special_tokens=False)["input_ids"]
    return prompt + answer + [tokenizer.eos_token_id], len(prompt)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=float, default=0.4, help="stop at this held-out greedy accuracy")
    ap.add_argument("--max_steps", type=int, default=3000)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval_every", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(2)
    tok = A.build_tokenizer()
    model = build_model(tok, args.seed)
    train = [encode(tok, p) for p in A.problems(50_000, split="train", seed=10_000 + args.seed)]
    test = A.problems(200, split="test")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    start, acc, step = time.time(), 0.0, 0
    for step in range(1, args.max_steps + 1):
        idx = torch.randint(len(train), (args.batch_size,), generator=gen).tolist()
        width = max(len(train[i][0]) for i in idx)
        ids = torch.full((len(idx), width), tok.pad_token_id)
        labels = torch.full((len(idx), width), -100)
        for r, i in enumerate(idx):
            seq, n_prompt = train[i]
            ids[r, :len(seq)] = torch.tensor(seq)
            labels[r, n_prompt:len(seq)] = torch.tensor(seq[n_prompt:])  # loss on the solution only
        loss = model(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long(), labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % args.eval_every == 0:
            acc = greedy_accuracy(model, tok, test)
            print(f"step {step:5d}  loss {loss.item():.4f}  held-out greedy accuracy {acc:.3f}  "
                  f"({time.time() - start:.0f}s)", flush=True)
            if acc >= args.target:
                break
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "provenance.json").write_text(json.dumps({
        "script": "scripts/make_demo_policy.py", "seed": args.seed, "steps": step, "target": args.target,
        "held_out_greedy_accuracy": acc, "lr": args.lr, "batch_size": args.batch_size,
        "torch": torch.__version__}, indent=2))
    print(f"saved to {out}: {step} steps, held-out greedy accuracy {acc:.3f}")


if __name__ == "__main__":
    main()
