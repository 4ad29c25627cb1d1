"""Greedy accuracy of a policy on arithmetic problems (the demo's before/after number)."""

from __future__ import annotations

import torch

from groupwise.modeling import eval_mode
from groupwise.tasks import arithmetic as A
from groupwise.text import completion_masks, encode_prompts, trim_to_mask


@torch.no_grad()
def greedy_accuracy(model, tokenizer, problems: list[str], *, batch_size: int = 100, max_new_tokens: int = 64) -> float:
    correct = 0
    with eval_mode(model):
        for lo in range(0, len(problems), batch_size):
            chunk = problems[lo:lo + batch_size]
            ids, mask = encode_prompts([A.prompt_of(p) for p in chunk], tokenizer, None)
            ids, mask = ids.to(model.device), mask.to(model.device)
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            comp = out[:, ids.size(1):]
            cmask, _ = completion_masks(comp, [tokenizer.eos_token_id], max_new_tokens)
            texts = tokenizer.batch_decode(trim_to_mask(comp, cmask), skip_special_tokens=True)
            correct += int(sum(A.accuracy(texts, chunk)))
    return correct / len(problems)
