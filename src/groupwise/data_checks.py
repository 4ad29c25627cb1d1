"""Checks of prompt datasets beyond their rows' own form (groupwise.data): what a chat template renders of each
role, and that every process holds the same rows."""

from __future__ import annotations

from typing import Any

from groupwise.config_base import ConfigError
from groupwise.text import is_conversational

CHAT_ROLES = ("system", "user", "assistant", "tool")  # what chat templates render (some also 'developer', …)


def check_rendered(name: str, i: int, prompt: Any, tokenizer, chat_template_kwargs: dict | None,
                   seen: set) -> None:
    """A chat template renders the roles it knows and may drop others (Qwen's renders system / user / assistant /
    tool only: a 'human' message vanishes, and the policy is prompted with an empty turn). Row i is rendered when it
    has a role no earlier row had (`seen`, updated): each message's text must appear in what it renders, or, when
    the template transforms it (Llama's tojson, Qwen3's cut of earlier <think> parts), a marker put in its place
    (which no template escapes or cuts; a template that refuses the marker where it took the text passes)."""
    if not is_conversational(prompt):
        return
    roles = {m.get("role") for m in prompt if isinstance(m, dict)}
    if roles <= seen:
        return
    seen |= roles
    kwargs = dict(add_generation_prompt=True, tokenize=False, **(chat_template_kwargs or {}))
    text = tokenizer.apply_chat_template(prompt, **kwargs)
    missing = [k for k, m in enumerate(prompt) if isinstance(m, dict) and isinstance(m.get("content"), str)
               and m["content"].strip() and m["content"].strip() not in text]
    if not missing:
        return
    marked = [dict(m, content=f"gwmark{k}x") if k in missing else m for k, m in enumerate(prompt)]
    try:
        text = tokenizer.apply_chat_template(marked, **kwargs)
    except Exception:  # noqa: BLE001 — the template checks the text's form: the real row rendered, so it passes
        return
    for k in missing:
        message = prompt[k]
        if f"gwmark{k}x" not in text:
            role = message.get("role")
            fix = ("rename the role (human → user, gpt → assistant) or fix the template" if role not in CHAT_ROLES
                   else "fix the template, or leave the message out")
            raise ConfigError(f"{name} row {i} message {k} (role {role!r}): the tokenizer's chat template leaves "
                              f"this message out of the prompt (templates render the roles they know, e.g. "
                              f"{' / '.join(CHAT_ROLES)}): {fix}")


def check_same_everywhere(dist, datasets: dict) -> None:
    """Every process must hold the same rows in the same order: the sampler draws the same prompt indices on each,
    and a prompt's G completions may be split between processes (their group statistics gathered), so a dataset
    that differs between processes (shuffled on one, another file) would normalize rewards over completions of
    different prompts with nothing said. Compares each dataset's length and fingerprint (a stream: its presence
    only: its fingerprint is None, its rows not read ahead) across processes, raising the same ConfigError on every
    process. `datasets`: {name: PromptData | StreamData | None}."""
    from groupwise.distributed import shared

    if dist.world_size == 1:
        return

    def summary(data):
        digest = data.fingerprint()
        return ("stream", None) if digest is None else (len(data), digest)

    mine = {name: None if data is None else summary(data) for name, data in datasets.items()}
    every = dist.gather_object([mine])
    for name in dict.fromkeys(n for one in every for n in one):
        seen = [one.get(name) for one in every]
        if all(s == seen[0] for s in seen):
            continue
        k = next(r for r, s in enumerate(seen) if s != seen[0])

        def told(s):
            return "none" if s is None else "a stream" if s[0] == "stream" else f"{s[0]} rows, digest {s[1]}"
        raise shared(ConfigError(
            f"{name} differs between processes (process 0: {told(seen[0])}; process {k}: {told(seen[k])}): every "
            "process must load the same rows in the same order (each draws the same prompts, and a group's "
            "completions may be split between processes). Load it the same way on each, shuffling with a fixed seed "
            "(Dataset.shuffle(seed=...)), or leave shuffling to the trainer (shuffle_dataset, data_seed)"))
