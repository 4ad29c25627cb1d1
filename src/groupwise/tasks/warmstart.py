"""Supervised warm start of a built-in task's shipped policy (scripts/make_demo_policy.py,
scripts/make_calculator_policy.py): a tiny Llama trained from scratch on worked solutions, the loss on the tokens
the policy writes, evaluated every `eval_every` steps and stopped at the first evaluation whose held-out greedy
accuracy reaches `target` (well-formed solutions, often wrong: room for RL). Seeded and single-threaded-per-core,
so a re-run reproduces the same losses on the same torch build (provenance.json records it)."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

# (token ids, loss mask): 1 where the policy writes the token (the loss), 0 for the prompt and tool results
Example = tuple[list[int], list[int]]


def tiny_llama(tokenizer, *, seed: int, max_positions: int):
    """The shipped policies' architecture: a 4-layer Llama, hidden 128, random weights (seeded)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=max_positions,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=bos, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def arguments(description: str, default_out: Path) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", default=str(default_out))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=float, default=0.4, help="stop at this held-out greedy accuracy")
    ap.add_argument("--max_steps", type=int, default=3000)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval_every", type=int, default=50)
    return ap


def train_until(model, tokenizer, train: list[Example], evaluate: Callable[[], dict[str, float]],
                args: argparse.Namespace) -> tuple[int, dict[str, float]]:
    """AdamW (weight decay 0.01, gradients clipped at 1) on random batches of `train` (right-padded, loss where the
    mask is 1) until evaluate()["accuracy"] >= args.target or args.max_steps; returns (steps, last evaluation)."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    start, stats, step = time.time(), {}, 0
    for step in range(1, args.max_steps + 1):
        idx = torch.randint(len(train), (args.batch_size,), generator=gen).tolist()
        width = max(len(train[i][0]) for i in idx)
        ids = torch.full((len(idx), width), tokenizer.pad_token_id)
        labels = torch.full((len(idx), width), -100)
        for r, i in enumerate(idx):
            seq, mask = train[i]
            ids[r, :len(seq)] = torch.tensor(seq)
            labels[r, :len(seq)] = torch.where(torch.tensor(mask) == 1, torch.tensor(seq), -100)
        loss = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long(), labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % args.eval_every == 0:
            stats = evaluate()
            extra = "".join(f"  {k} {v:.3f}" for k, v in stats.items() if k != "accuracy")
            print(f"step {step:5d}  loss {loss.item():.4f}  held-out greedy accuracy {stats['accuracy']:.3f}{extra}  "
                  f"({time.time() - start:.0f}s)", flush=True)
            if stats["accuracy"] >= args.target:
                break
    return step, stats


def save_policy(out: str | Path, model, tokenizer, provenance: dict) -> None:
    """safetensors + config + tokenizer + provenance.json (with the torch build, which the numbers depend on)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "provenance.json").write_text(json.dumps({**provenance, "torch": torch.__version__}, indent=2) + "\n")
    print(f"saved to {out}: {provenance}")
