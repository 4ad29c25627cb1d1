"""Split a completion into reasoning steps and find the token where each step ends (DeepSeekMath §4.1.3 index(j)).

Boundaries are found in the decoded text (a delimiter such as "\\n", a regex, or a step tag such as Math-Shepherd's
"ки"), then mapped to token indices through the tokenizer's own decoding of token prefixes, so a token that spans
a delimiter, a multi-byte character split over byte-level tokens and BPE merges all land on the right index:
a step ends at the first token whose decoded prefix covers the step's last character (its delimiter included).
Blank steps are dropped. The last step of a completion that ends with EOS ends at that EOS, so the decision to stop
shares the last step's advantage, whether or not a delimiter (and blank text) came before the EOS. A final step
without a trailing delimiter counts; when the completion was cut by max_completion_length, it ends at the last
token and is marked `truncated_last`.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from groupwise.config_base import ConfigError


@dataclass(frozen=True)
class Steps:
    texts: tuple[str, ...]  # (K) step texts, delimiter / tag and surrounding whitespace removed
    ends: tuple[int, ...]  # (K) 0-based token index of each step's last token, ascending
    truncated_last: bool = False  # the last step was cut by max_completion_length (no delimiter, no EOS)

    def __len__(self) -> int:
        return len(self.texts)

    def drop_last(self) -> "Steps":
        return Steps(self.texts[:-1], self.ends[:-1], False)


@dataclass(frozen=True)
class SplitMode:
    """A way to find step boundaries (GRPOConfig.step_split): the option it reads and how it becomes a regex, or
    (turns=True) the assistant turns of a multi-turn rollout, which need tools or an environment."""

    name: str
    reads: str | None  # the GRPOConfig field the mode needs
    to_regex: Callable[[str], "re.Pattern[str]"] | None
    turns: bool = False

    def check(self, **options) -> "re.Pattern[str] | None":
        """The boundary regex from the GRPOConfig fields given as keywords; a ConfigError naming the field when it
        is missing or invalid, or when another mode's field is set away from its default (it would be ignored).
        None for the turn mode (no regex)."""
        for field, value in options.items():
            if field != self.reads and value != SPLIT_FIELD_DEFAULTS.get(field):
                users = [m.name for m in SPLIT_MODES.values() if m.reads == field]
                raise ConfigError(f"{field}={value!r} is read when step_split={users[0]!r}, but step_split="
                                  f"{self.name!r}: set step_split={users[0]!r}, or drop {field}")
        if self.turns:
            return None
        value = options.get(self.reads)
        if self.reads in ("step_delimiter", "step_tag") and _escaped_control(value):
            warnings.warn(f"{self.reads}={value!r} holds a backslash escape as two characters (a shell passes '\\n' "
                          "as written), not the character it names: in YAML write it in double quotes (\"\\n\"), "
                          "in bash $'\\n'; if the backslash is meant, ignore this", UserWarning, stacklevel=3)
        if not value:
            raise ConfigError(f"step_split={self.name!r} needs {self.reads} (a non-empty string)")
        try:
            return self.to_regex(value)
        except re.error as e:
            raise ConfigError(f"{self.reads}={value!r} is not a valid regex: {e}") from None


def _step_regex(pattern: str) -> "re.Pattern[str]":
    """step_pattern compiled; refused when every match is empty (its longest match is 0 characters: a lookahead or
    anchor alone), since an empty match cannot end a step and the completion would silently be one step."""
    compiled = re.compile(pattern)
    try:  # the regex engine's own parser (Python >= 3.11), whose getwidth() is the (min, max) match length
        import re._parser as parser
    except ImportError:  # a Python that moved it: the check is skipped, not the run
        return compiled
    if parser.parse(pattern).getwidth()[1] == 0:
        raise ConfigError(f"step_pattern={pattern!r} only matches empty text, so it ends no step: a match ends a "
                          r"step, so match the delimiter itself, e.g. r'\n(?=Step \d)'")
    return compiled


def _escaped_control(value: str | None) -> bool:
    """A backslash and n / t / r written out, with no newline, tab or carriage return in the text."""
    return bool(value) and re.search(r"\\[ntr]", value) is not None and not any(c in value for c in "\n\t\r")


SPLIT_FIELD_DEFAULTS = {"step_delimiter": "\n", "step_pattern": None, "step_tag": None}  # GRPOConfig's defaults
SPLIT_MODES: dict[str, SplitMode] = {
    "delimiter": SplitMode("delimiter", "step_delimiter", lambda d: re.compile(re.escape(d))),  # default "\n"
    "regex": SplitMode("regex", "step_pattern", _step_regex),  # each match of step_pattern ends a step
    "tag": SplitMode("tag", "step_tag", lambda t: re.compile(re.escape(t))),  # a step tag after each step
    "turn": SplitMode("turn", None, None, turns=True),  # each assistant turn (multi-turn rollouts with tools)
}
# a text split over a multi-turn rollout would make tool / environment text scored steps; refused before any model
# loads (groupwise.loading.check_inputs) and at scoring (tool tokens from a rollout_func's env_mask)
TOOL_TEXT_STEPS = ("step_split={!r} splits the completion's text into steps, but multi-turn rollouts put tool / "
                   "environment tokens in it (they would become scored steps): set step_split='turn'")


class StepSplitter:
    """mode "delimiter" (default "\\n"), "regex" (each match ends a step), "tag" (a step tag after each step), or
    "turn" (each assistant turn is a step: split_turns)."""

    def __init__(self, mode: str = "delimiter", *, delimiter: str = "\n", pattern: str | None = None,
                 step_tag: str | None = None):
        if mode not in SPLIT_MODES:
            raise ConfigError(f"step_split={mode!r} is not one of {list(SPLIT_MODES)}")
        self.regex = SPLIT_MODES[mode].check(step_delimiter=delimiter, step_pattern=pattern, step_tag=step_tag)
        self.mode, self.step_tag = mode, step_tag
        # the literal text that ends a step, kept in the decoded text even when it is a special token
        self.marker = step_tag if mode == "tag" else delimiter if mode == "delimiter" else None
        self._kept: dict[tuple[int, int], frozenset[int]] = {}  # _kept_special's, per tokenizer

    @classmethod
    def from_config(cls, args) -> "StepSplitter":
        return cls(args.step_split, delimiter=args.step_delimiter, pattern=args.step_pattern, step_tag=args.step_tag)

    def split_text(self, text: str) -> list[tuple[str, int]]:
        """[(step text without its delimiter, character index just past the step's delimiter)], blanks dropped.
        The final piece without a trailing delimiter gets end -1."""
        out, start = [], 0
        for m in self.regex.finditer(text):
            if m.end() == m.start():  # an empty match cannot end a step
                continue
            out.append((text[start:m.start()], m.end()))
            start = m.end()
        out.append((text[start:], -1))
        return [(t, e) for t, e in out if t.strip()]

    @property
    def turns(self) -> bool:
        return SPLIT_MODES[self.mode].turns

    def check_tokenizer(self, tokenizer) -> None:
        """The step delimiter or tag must be text the policy's tokenizer can write: one it encodes to its unknown
        token (a tag missing from the vocabulary) never appears in a completion, so no step would ever end (a
        ConfigError, before any model loads). A regex is not checked."""
        if self.marker is None:
            return
        check_writable(tokenizer, self.marker, "step_tag" if self.mode == "tag" else "step_delimiter",
                       "the policy's tokenizer", "no completion would ever end a step")


    def split_turns(self, token_ids: list[int], tool_mask: list[int], turn_ends: list[int], tokenizer, *,
                    truncated: bool) -> Steps:
        """Steps of one multi-turn completion: step k is assistant turn k, its text the turn's own tokens decoded
        (from the first model token after turn k − 1's end to turn_ends[k]; tool / environment tokens in between
        belong to no step), ending at turn_ends[k]. When the rollout was cut by max_completion_length inside the
        last turn (its end is the last token), that turn is marked truncated_last."""
        texts, start = [], 0
        for end in turn_ends:
            while start < end and not tool_mask[start]:  # skip the tool suffix before this turn
                start += 1
            texts.append(tokenizer.decode(token_ids[start:end + 1], skip_special_tokens=True,
                                          clean_up_tokenization_spaces=False).strip())
            start = end + 1
        # a rollout cut inside the tool / environment suffix after a finished turn has no truncated turn: the last
        # turn was cut only when its end is the completion's last token
        cut_last = truncated and bool(turn_ends) and turn_ends[-1] == len(token_ids) - 1
        return Steps(tuple(texts), tuple(turn_ends), truncated_last=cut_last)

    def split(self, token_ids: list[int], tokenizer, *, ends_with_eos: bool, truncated: bool) -> Steps:
        """Steps of one completion. `token_ids` excludes padding; its last token is the EOS when ends_with_eos."""
        text_ids = token_ids[:-1] if ends_with_eos else token_ids
        dropped = self._dropped_ids(text_ids, tokenizer) if self._keeps_special_marker(tokenizer) else None
        decode = _PrefixDecoder(text_ids, tokenizer, dropped)
        pieces = self.split_text(decode.text)
        if not pieces:
            return Steps((), ())
        texts, ends = [], []
        last_token = len(token_ids) - 1
        for text, char_end in pieces:
            texts.append(text.strip())
            ends.append(last_token if char_end == -1 else decode.token_covering(char_end))
        if ends_with_eos:  # only blank text lies between the last step's delimiter and the EOS
            ends[-1] = last_token
        final_open = pieces[-1][1] == -1
        return Steps(tuple(texts), tuple(ends), truncated_last=final_open and truncated)

    def _keeps_special_marker(self, tokenizer) -> bool:
        """Tag mode always; delimiter mode when the delimiter is (or holds) a special token, such as "<extra_0>",
        and regex mode when the pattern matches a special token's text: decoding with skip_special_tokens=True would
        drop it, leaving one step per completion."""
        return self.mode == "tag" or bool(self._kept_special(tokenizer))

    def _kept_special(self, tokenizer) -> frozenset[int]:
        """The token ids that must stay in the decoded text, once per tokenizer (and vocabulary): the step tag's; the
        delimiter's when one of them is special; in regex mode the special tokens whose text the pattern matches."""
        key = (id(tokenizer), len(tokenizer))
        if key not in self._kept:
            if self.mode in ("tag", "delimiter"):
                ids = set(tokenizer(self.marker, add_special_tokens=False)["input_ids"])
                special = bool(ids & set(tokenizer.all_special_ids)) or any(_dropped(tokenizer, i) for i in ids)
                kept = ids if self.mode == "tag" or special else set()
            elif self.mode == "regex":
                kept = {i for i in _special_ids(tokenizer) if _dropped(tokenizer, i)
                        and self.regex.search(tokenizer.decode([i], skip_special_tokens=False))}
            else:
                kept = set()
            self._kept[key] = frozenset(kept)
        return self._kept[key]

    def _dropped_ids(self, ids: list[int], tokenizer) -> frozenset[int]:
        """The special tokens among `ids` that decoding with skip_special_tokens=True drops, except the ones the
        splitter reads (_kept_special: e.g. a step tag "<extra_0>"), which must stay in the text."""
        return frozenset(i for i in (set(ids) & _special_ids(tokenizer)) - self._kept_special(tokenizer)
                         if _dropped(tokenizer, i))


def check_writable(tokenizer, text: str, field: str, whose: str, consequence: str) -> None:
    """A ConfigError naming `field` when `tokenizer` cannot write `text`: it encodes to the unknown token, or does
    not decode back to it."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    unk = getattr(tokenizer, "unk_token_id", None)
    decoded = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if (unk is not None and unk in ids) or (text.strip() or text) not in decoded:
        raise ConfigError(f"{field}={text!r} is not text {whose} can write (it encodes to {ids}, which decodes to "
                          f"{decoded!r}), so {consequence}: add it to the tokenizer (tokenizer.add_tokens) or choose "
                          "one in its vocabulary")


def _special_ids(tokenizer) -> set[int]:
    """The tokenizer's special and added tokens."""
    return set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", None) or {})


def _dropped(tokenizer, i: int) -> bool:
    """Does decoding with skip_special_tokens=True drop token `i`?"""
    return tokenizer.decode([i], skip_special_tokens=True) != tokenizer.decode([i], skip_special_tokens=False)


class _PrefixDecoder:
    """len(decode(ids[:i+1])) for any i, memoised; decoding prefixes keeps the tokenizer's own handling of
    byte-level pieces, merges and leading spaces. With `dropped` (tag mode) those ids are left out and the rest
    decoded with the special tokens kept, so a step tag that is a special token stays in the text; the same as
    skip_special_tokens=True otherwise, since that drops exactly the special tokens, one by one."""

    def __init__(self, ids: list[int], tokenizer, dropped: frozenset[int] | None = None):
        self.ids, self.tok, self.dropped = ids, tokenizer, dropped
        self.cache: dict[int, int] = {}
        if dropped is not None:
            self.kept, self.kept_before = [], [0]  # kept_before[n]: kept ids among ids[:n]
            for i in ids:
                if i not in dropped:
                    self.kept.append(i)
                self.kept_before.append(len(self.kept))
        self.text = self._decode(len(ids))

    def _decode(self, n: int) -> str:
        if self.dropped is None:
            return self.tok.decode(self.ids[:n], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return self.tok.decode(self.kept[:self.kept_before[n]], skip_special_tokens=False,
                               clean_up_tokenization_spaces=False)

    def length(self, i: int) -> int:  # characters fully covered by tokens 0..i
        if i not in self.cache:
            # a prefix ending inside a multi-byte character decodes to a trailing U+FFFD: not covered yet
            self.cache[i] = len(self._decode(i + 1).rstrip("\ufffd"))
        return self.cache[i]

    def token_covering(self, char_end: int) -> int:
        """Smallest token index i whose prefix decodes to ≥ char_end characters (binary search)."""
        lo, hi = 0, len(self.ids) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if self.length(mid) >= char_end:
                hi = mid
            else:
                lo = mid + 1
        return lo
