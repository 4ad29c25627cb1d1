"""Text formats and token layouts shared by generation, rewards, process reward models and the rollout.

Bottom-level: imports torch only (a tokenizer is passed in, never imported).
    is_conversational                TRL's two prompt formats: a string, or a list of {"role", "content"} messages
    prompt_token_ids                 prompts → token ids (special tokens as TRL adds them)
    encode_prompts                   prompts → left-padded (N, P) ids and mask
    pad_rows                         ragged token lists → (N, L) ids and mask, padded on either side
    completion_masks, trim_to_mask   where a completion ends (its first EOS, included)
    ensure_pad_token                 the pad token every batch needs
    pad_to_multiple                  widen (N, L) ids and mask to a multiple of k columns (pad_to_multiple_of)
"""

from __future__ import annotations

from typing import Any

import torch


def is_conversational(prompt: Any) -> bool:
    """A chat prompt is a list of {"role", "content"} messages (TRL's conversational format)."""
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


def prompt_token_ids(prompts: list[Any], tokenizer, chat_template_kwargs: dict | None = None) -> list[list[int]]:
    """Each prompt's token ids, as TRL builds them: chat messages through the chat template, whose text carries its
    own special tokens (none are added); a string with the tokenizer's special tokens (a BOS, for tokenizers that
    add one). The one place prompts become ids: the rollout and the dataset's length checks agree."""
    chat = [is_conversational(p) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    where = [i for i, c in enumerate(chat) if c]
    if where:  # rendered and tokenized in one call, as TRL (options such as sanitize_control_tokens need it)
        encoded = tokenizer.apply_chat_template([prompts[i] for i in where], add_generation_prompt=True,
                                                tokenize=True, return_dict=True, **(chat_template_kwargs or {}))
        for i, ids in zip(where, encoded["input_ids"]):
            out[i] = list(ids)
    where = [i for i, c in enumerate(chat) if not c]
    for i in where:
        if not isinstance(prompts[i], str):
            raise TypeError(f"a prompt must be a string or a list of chat messages, got {type(prompts[i]).__name__}: "
                            f"{prompts[i]!r:.80}")
    if where:
        encoded = tokenizer([prompts[i] for i in where])["input_ids"]
        for i, ids in zip(where, encoded):
            out[i] = list(ids)
    return out


def pad_rows(rows: list[list[int]], pad_id: int | float, *, side: str = "right", width: int | None = None,
             dtype: torch.dtype = torch.long) -> tuple[torch.Tensor, torch.Tensor]:  # (N, L) values, (N, L) mask
    """Stack ragged lists (token ids, or per-token values with a float dtype) into one (N, L) tensor filled with
    pad_id and its 0/1 long mask; L = the longest row (or `width`)."""
    if side not in ("left", "right"):
        raise ValueError(f"side={side!r} is not 'left' or 'right'")
    L = max((len(r) for r in rows), default=0) if width is None else width
    ids = torch.full((len(rows), L), pad_id, dtype=dtype)
    mask = torch.zeros((len(rows), L), dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(L - len(row), L) if side == "left" else slice(0, len(row))
        ids[i, span] = torch.as_tensor(row, dtype=dtype)
        mask[i, span] = 1
    return ids, mask


def encode_prompts(
    prompts: list[Any], tokenizer, max_prompt_length: int | None, chat_template_kwargs: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:  # (N, P) ids, (N, P) mask, both left-padded
    """Tokenize prompts (chat template applied to conversational ones), keep the last max_prompt_length tokens,
    left-pad so every prompt ends at the same column and generation continues from there."""
    encoded = prompt_token_ids(prompts, tokenizer, chat_template_kwargs)
    if max_prompt_length is not None:
        encoded = [ids[-max_prompt_length:] for ids in encoded]
    if any(len(ids) == 0 for ids in encoded):
        bad = next(i for i, ids in enumerate(encoded) if len(ids) == 0)
        raise ValueError(f"prompt {bad} encodes to zero tokens: {prompts[bad]!r}")
    return pad_rows(encoded, tokenizer.pad_token_id, side="left")


def trim_to_mask(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:  # (N, T), (N, T) → (N)[len]
    """Each row's tokens up to the end of its mask (its EOS included): what reward functions and decoding see."""
    return [row[:n] for row, n in zip(ids.tolist(), mask.sum(-1).tolist())]


def completion_masks(
    completion_ids: torch.Tensor,  # (N, T)
    eos_token_ids: list[int],
    max_completion_length: int,
    lengths: torch.Tensor | None = None,  # (N,) tokens each row generated (Generated.lengths)
) -> tuple[torch.Tensor, torch.Tensor]:  # (N, T) long mask, (N,) bool truncated
    """A completion ends at its first EOS, and that EOS is part of it — also when pad == eos (TRL #4970);
    tokens after it are padding. A row with no EOS is truncated (TRL: its last token is not an EOS): cut at
    max_completion_length, or, with `lengths`, ended by the backend (a stop string) after that many tokens."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))  # (N, T)
    T = completion_ids.size(1)
    positions = torch.arange(T, device=completion_ids.device).unsqueeze(0)  # (1, T)
    real = None if lengths is None else positions < lengths.to(completion_ids.device).unsqueeze(-1)
    if real is not None:
        is_eos = is_eos & real  # a pad token that is also an EOS ends nothing
    has_eos = is_eos.any(-1)  # (N,)
    first = torch.where(has_eos, is_eos.float().argmax(-1), torch.full_like(has_eos, T, dtype=torch.long))
    mask = positions <= first.unsqueeze(-1)  # through the EOS, or every token when none
    return (mask if real is None else mask & real).long(), ~has_eos


def ensure_pad_token(tokenizer, owner: str = "the tokenizer") -> None:
    """Batches need a pad token: use EOS when there is none; neither is an error naming `owner`."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.pad_token is None:
        raise ValueError(f"{owner} has neither a pad token nor an EOS token; set tokenizer.pad_token")


def pad_to_multiple(ids: torch.Tensor, mask: torch.Tensor, multiple: int | None, pad_id: int, *, side: str
                    ) -> tuple[torch.Tensor, torch.Tensor]:  # (N, L) → (N, L') with L' = ⌈L / multiple⌉ · multiple
    """Add padding columns (mask 0) on `side` so the width is a multiple of `multiple` (None: unchanged)."""
    if not multiple or ids.size(1) % multiple == 0:
        return ids, mask
    extra = multiple - ids.size(1) % multiple
    pad_ids = torch.full((ids.size(0), extra), pad_id, dtype=ids.dtype, device=ids.device)
    pad_mask = torch.zeros((mask.size(0), extra), dtype=mask.dtype, device=mask.device)
    if side == "left":
        return torch.cat([pad_ids, ids], 1), torch.cat([pad_mask, mask], 1)
    return torch.cat([ids, pad_ids], 1), torch.cat([mask, pad_mask], 1)
