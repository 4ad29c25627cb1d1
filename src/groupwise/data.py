"""Prompt datasets, checked whole before any model loads (the order in which a run visits them: groupwise.order)."""

from __future__ import annotations

import copy
import hashlib
import json
import sys
import warnings
from typing import Any

from tqdm.auto import tqdm

from groupwise.config_base import ConfigError
from groupwise.data_checks import check_rendered
from groupwise.text import is_conversational, prompt_token_ids


NON_TEXT = ("a content block of type {!r}: groupwise trains text-only causal models (images and other non-text "
            "inputs are not supported yet, and the chat template would render the text alone)")


def non_text_block(content: Any) -> str | None:
    """The type of the first content block that is not text ({"type": "image", …}; "(none)" for an item without a
    type) in a message's content, or None (a string, or text blocks only)."""
    if not isinstance(content, list):
        return None
    return next((str(b.get("type")) if isinstance(b, dict) and "type" in b else "(none)"
                 for b in content if not (isinstance(b, dict) and b.get("type") == "text")), None)


def prompt_problem(prompt: Any) -> str | None:
    """Why a prompt is unusable, or None: it must be a non-empty string or a non-empty list of chat messages, each
    a dict with a string 'role' and a 'content' the chat template renders: a string, a list of content blocks
    ({"type": "text", "text": …}), or None (an assistant turn that only calls tools), as TRL passes them on."""
    if isinstance(prompt, str):
        return None if prompt.strip() else "an empty prompt"
    if isinstance(prompt, list):
        if not prompt:
            return "an empty message list"
        for j, m in enumerate(prompt):
            content = m.get("content") if isinstance(m, dict) else None
            blocks = isinstance(content, list) and all(isinstance(b, dict) and "type" in b for b in content)
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and (isinstance(content, str) or blocks or (content is None and m.get("role") == "assistant"))):
                return (f"message {j} that is not a {{'role': str, 'content': str | content blocks}} dict (content "
                        f"None only for an assistant turn): {m!r:.80}")
            other = non_text_block(content) if blocks else None
            if other is not None:  # the chat template would render the text alone: refused, not ignored
                return f"message {j} with {NON_TEXT.format(other)}; give text blocks only"
        return None
    if prompt is None:
        return "no prompt (None)"
    return f"a prompt of type {type(prompt).__name__}, not a string or a list of chat messages"


def refuse_images(columns, where: str) -> None:
    """An `image` / `images` column (TRL feeds it to a vision-language model's processor): refused, not ignored."""
    images = sorted({"image", "images"} & set(columns))
    if images:
        raise ConfigError(f"{where} has an {images[0]!r} column: groupwise trains text-only causal language models "
                          "(vision-language models and image inputs are not supported yet), so the images would be "
                          f"ignored; drop the column (dataset.remove_columns({images[0]!r})) to train on the text "
                          "alone")


def own_copy(row: dict[str, Any]) -> dict[str, Any]:
    """A row whose values are copies of their own (deep), so that a reward function editing them in place changes
    neither the dataset nor the group's other rows; a value that cannot be copied (a lock, a client object) is
    shared as given."""
    out = {}
    for key, value in row.items():
        try:
            out[key] = copy.deepcopy(value)
        except (TypeError, copy.Error):
            out[key] = value
    return out


def mixed_formats(name: str, row: int, first_is_text: bool) -> ConfigError:
    """Row `row` is not in row 0's format: completions follow the first prompt's (text or conversational, TRL's two
    formats), so a reward function would get chat prompts with text completions or the reverse."""
    kinds = ("a string", "a list of chat messages")
    return ConfigError(f"{name} row {row} has {kinds[first_is_text]} as its prompt, row 0 {kinds[not first_is_text]}: "
                       "give every prompt in one format (all strings, or all lists of {'role', 'content'} messages)")


def token_ids(name: str, first: int, prompts: list, tokenizer, chat_template_kwargs: dict | None) -> list[list[int]]:
    """prompt_token_ids of rows first, first + 1, …; a conversation the tokenizer cannot template (no chat template,
    or a template that refuses it, e.g. a system message) is a ConfigError naming the row."""
    try:
        return prompt_token_ids(prompts, tokenizer, chat_template_kwargs)
    except Exception as e:  # noqa: BLE001 — the chat template's errors (ValueError, jinja2 TemplateError, …)
        for k, prompt in enumerate(prompts):
            if not is_conversational(prompt):
                continue
            if getattr(tokenizer, "chat_template", None) is None and "chat_template" not in (chat_template_kwargs or {}):
                raise ConfigError(f"{name} row {first + k} is a conversation (a list of messages) but the tokenizer has "
                                  "no chat template: use a chat model's tokenizer, set tokenizer.chat_template, or give "
                                  "the prompts as strings") from None
            try:
                prompt_token_ids([prompt], tokenizer, chat_template_kwargs)
            except Exception as row_error:  # noqa: BLE001
                raise ConfigError(f"{name} row {first + k}: the tokenizer's chat template fails on it "
                                  f"({type(row_error).__name__}: {' '.join(str(row_error).split())[:200]})") from e
        raise


def _tokens_kept(n: int, max_prompt_length: int | None) -> tuple[int, bool]:
    """Prompt tokens left after truncation, and whether the prompt was over max_prompt_length."""
    over = max_prompt_length is not None and n > max_prompt_length
    return (max_prompt_length if over else n), over


def _too_long(name: str, i: int, n: int, max_completion_length: int, max_positions: int | str,
              how_many: str = "") -> ConfigError:
    """max_positions: the model's (a number), or the setting that limits the sampler's context (a 'field=value')."""
    limit, fix = ((f"the model's {max_positions} positions", "") if isinstance(max_positions, int) else
                  (max_positions, f", or raise {max_positions.split('=')[0]}"))
    return ConfigError(f"{name} row {i}: {n} prompt tokens + max_completion_length={max_completion_length} exceed "
                       f"{limit}{how_many}; lower max_completion_length or max_prompt_length{fix}")


def _position_limit(max_positions: int | None, sampler_limit: tuple[int, str] | None) -> tuple[int | None, Any]:
    """The tokens a prompt and its completion may fill, and how _too_long names it: the model's positions, or the
    sampler's limit (tokens, 'field=value') when lower."""
    if sampler_limit is not None and (max_positions is None or sampler_limit[0] < max_positions):
        return sampler_limit
    return max_positions, max_positions


def _over(name: str, i: int, n: int, max_prompt_length: int, how_many: str = "") -> ConfigError:
    return ConfigError(f"{name} row {i} has {n} prompt tokens > max_prompt_length={max_prompt_length}{how_many}; "
                       "raise max_prompt_length, shorten the prompts, or set truncate_prompt='left' to keep their "
                       "last tokens")


def _cut_warning(name: str, first: int, n: int, max_prompt_length: int, how_many: str = "") -> None:
    warnings.warn(f"{name}: {how_many}prompts longer than max_prompt_length={max_prompt_length} tokens are cut from "
                  f"the left (first: row {first}, {n} tokens)", stacklevel=3)


def named_datasets(data: Any, name: str = "eval_dataset") -> bool:
    """An eval_dataset given as {name: dataset} (transformers; a DatasetDict too): a dict whose values are all
    datasets or lists of rows (dicts), not a dict of columns (a 'prompt' one, or lists of values). A dict whose
    values are all lists of dicts without a 'prompt' key reads both ways (named lists of an environment's rows, or
    columns whose values are dicts): an error asks for datasets.Dataset objects, which say which it is."""
    def dataset_like(value) -> bool:
        return hasattr(value, "column_names") or (isinstance(value, (list, tuple))
                                                  and all(isinstance(row, dict) for row in value))

    if not isinstance(data, dict) or "prompt" in data or not all(map(dataset_like, data.values())):
        return False
    values = data.values()
    if not data or any(hasattr(v, "column_names") for v in values) or all("prompt" in r for v in values for r in v):
        return True
    keys = ", ".join(map(repr, data))
    raise ConfigError(f"{name} is a dict whose values (under {keys}) are all lists of dicts without a 'prompt' key:"
                      " it reads as {name: rows} (one evaluation set per key) and as columns whose "
                      "values are dicts. Pass datasets.Dataset objects: {key: Dataset.from_list(rows), …} for named "
                      "sets, or Dataset.from_dict(columns) for one set")


def each_dataset(data) -> tuple:
    """The datasets of an eval_dataset as the trainer keeps it: none, one, or each of {name: dataset}."""
    return () if data is None else tuple(data.values()) if isinstance(data, dict) else (data,)


def _rows_of_columns(data: dict, name: str) -> list[dict[str, Any]]:
    """A dict of columns ({'prompt': [...], 'answer': [...]}, what datasets.Dataset.from_dict takes) as its rows."""
    lengths = {}
    for key, values in data.items():
        if not isinstance(values, (list, tuple)):
            raise ConfigError(f"{name} is a dict, read as columns, but column {key!r} is a {type(values).__name__}, "
                              "not a list: give each column as a list of values, one per row")
        lengths[key] = len(values)
    if len(set(lengths.values())) > 1:
        raise ConfigError(f"{name}: its columns have different lengths ({lengths}): give every column one value per "
                          "row")
    return [dict(zip(data, values)) for values in zip(*data.values())]


def _check_same_keys(rows, name: str, default_prompt: bool) -> None:
    """Every row has the first row's columns (reward functions get one value per completion of each column); under
    an environment the prompt may be absent from any row. `rows`: (row number, row) pairs."""
    first = None
    for i, row in rows:
        keys = set(row) - ({"prompt"} if default_prompt else set())
        if first is None:
            first = keys
        elif keys != first:
            extra, lacks = sorted(keys - first), sorted(first - keys)
            what = f"lacks the column {lacks[0]!r}" if lacks else f"has the column {extra[0]!r}"
            raise ConfigError(f"{name} row {i} {what}, unlike row 0 (columns: {sorted(first)}): give every row the "
                              "same columns (datasets.Dataset.from_list fills missing ones with None)")


class EmptyPrompt(list):
    """The prompt of a row that has none when an environment owns the data (TRL 1.16): an empty user turn, which the
    environment's reset() completes. Unlike a prompt of the dataset, it is not passed to reset()."""

    def __init__(self):
        super().__init__([{"role": "user", "content": ""}])


class EnvironmentPrompts:
    """A dataset given with an environment_factory (groupwise.agents.tools.default_train_dataset): its rows may lack
    a `prompt` (TRL 1.16), which PromptData / StreamData then give an EmptyPrompt."""

    def __init__(self, data: Any, stream: bool):
        self.data, self.stream = data, stream


class PromptData:
    """A `datasets.Dataset`, a list of dicts (every row with the same keys) or a dict of columns, with a `prompt`
    column; other columns reach reward functions. Given as EnvironmentPrompts, rows may lack the prompt (an
    EmptyPrompt)."""

    def __init__(self, data: Any, name: str):
        self.default_prompt = isinstance(data, EnvironmentPrompts)
        if self.default_prompt:
            data = data.data
        if data is None:
            raise ConfigError(f"{name} is required")
        if isinstance(data, dict) and hasattr(data, "column_names"):  # a DatasetDict / IterableDatasetDict
            raise ConfigError(f"{name} is a {type(data).__name__} with the splits {sorted(data)}: pass one split, "
                              f"e.g. {name}=dataset[{next(iter(data), 'train')!r}]")
        if isinstance(data, dict) and not hasattr(data, "column_names"):
            data = _rows_of_columns(data, name)
        columns = getattr(data, "column_names", None)
        kind = (getattr(data, "format", None) or {}).get("type") if hasattr(data, "with_format") else None
        if kind == "custom" and "prompt" not in (columns or []):  # a transform that makes the prompt column
            raise ConfigError(f"{name} has a transform (with_transform / set_transform) and no stored 'prompt' "
                              "column; groupwise checks the columns before training: apply the transform with "
                              "dataset.map(transform, batched=True) instead")
        if kind not in (None, "python", "custom"):  # rows as DataFrames, arrays or arrow scalars: read as Python
            data = data.with_format(None)  # values instead (a view; the caller's dataset keeps its format)
        if columns is None:
            if not isinstance(data, (list, tuple)) or not all(isinstance(r, dict) for r in data):
                fix = "datasets.Dataset.from_pandas(frame)" if hasattr(data, "to_dict") and hasattr(data, "iloc") \
                    else "datasets.Dataset.from_list(rows)"
                raise TypeError(f"{name} must be a datasets.Dataset, a list of dicts or a dict of columns, got "
                                f"{type(data).__name__}: pass {fix}")
            missing = [i for i, r in enumerate(data) if "prompt" not in r]
            if missing and not self.default_prompt:
                raise ConfigError(f"{name} row {missing[0]} has no 'prompt' column (keys: {sorted(data[missing[0]])})")
            _check_same_keys(enumerate(data), name, self.default_prompt)
        elif "prompt" not in columns and not self.default_prompt:
            raise ConfigError(f"{name} has no 'prompt' column (columns: {columns}); rename the column holding the "
                             "prompts to 'prompt'")
        if len(data) == 0:
            raise ConfigError(f"{name} is empty: give a dataset with at least one row")
        self.data, self.name = data, name
        bad = [(i, why) for i, row in enumerate(self._prompts()) if (why := prompt_problem(row)) is not None]
        if bad:
            i, why = bad[0]
            raise ConfigError(f"{name} row {i} has {why}; {len(bad)} of {len(data)} rows are unusable (each prompt "
                              "must be a non-empty string or a list of {'role', 'content'} messages)")
        if columns is None:  # a datasets.Dataset column has one type: only rows given as dicts can mix formats
            first = None
            for i, prompt in enumerate(self._prompts()):
                first = isinstance(prompt, str) if first is None else first
                if isinstance(prompt, str) != first:
                    raise mixed_formats(name, i, first)

    def columns(self) -> list[str]:
        """The dataset's columns (a list of dicts: the first row's keys, as the rollout reads them)."""
        return list(getattr(self.data, "column_names", None) or self.data[0])

    def _prompts(self):
        """Every prompt, one at a time (a datasets.Dataset is read column-wise in batches, not all at once)."""
        if hasattr(self.data, "column_names"):
            for lo in range(0, len(self.data), 1000):
                if "prompt" in self.data.column_names:
                    yield from self.data[lo:lo + 1000]["prompt"]
                else:  # only as EnvironmentPrompts
                    yield from (EmptyPrompt() for _ in range(min(1000, len(self.data) - lo)))
        else:
            for row in self.data:
                yield row["prompt"] if "prompt" in row else EmptyPrompt()

    def check_lengths(self, tokenizer, *, max_prompt_length: int | None, max_completion_length: int,
                      truncate_prompt: str, max_positions: int | None, chat_template_kwargs: dict | None = None,
                      sampler_limit: tuple[int, str] | None = None):
        """Tokenize every prompt as the rollout will. Prompts over max_prompt_length are cut from the left with a
        warning (truncate_prompt='left', TRL's behaviour) or are an error ('error'); a prompt that, kept or cut,
        leaves no room for max_completion_length tokens within the model's max positions is an error, as within
        `sampler_limit` (tokens, 'field=value': a vLLM engine's vllm_max_model_length, which would stop the
        completion short) when it is lower."""
        max_positions, limit_name = _position_limit(max_positions, sampler_limit)
        over, too_long, total, roles = [], [], len(self), set()
        longest = (0, 0)  # (tokens kept, −row) of the first longest prompt
        prompts = self._prompts()
        with tqdm(total=total, desc=f"checking {self.name}", disable=total < 10_000, leave=False) as bar:
            for lo in range(0, total, 512):
                chunk = [p for _, p in zip(range(512), prompts)]
                for k, ids in enumerate(token_ids(self.name, lo, chunk, tokenizer, chat_template_kwargs)):
                    n = len(ids)
                    if n == 0:
                        raise ConfigError(f"{self.name} row {lo + k} encodes to zero tokens: {chunk[k]!r:.80}")
                    check_rendered(self.name, lo + k, chunk[k], tokenizer, chat_template_kwargs, roles)
                    kept, cut = _tokens_kept(n, max_prompt_length)
                    longest = max(longest, (kept, -(lo + k)))
                    if cut:
                        over.append((lo + k, n))
                    if max_positions is not None and kept + max_completion_length > max_positions:
                        too_long.append((lo + k, kept))
                bar.update(len(chunk))
        self.longest = (longest[0], -longest[1])  # (tokens, row): check_room, once a server's context is known
        if too_long:
            raise _too_long(self.name, *too_long[0], max_completion_length, limit_name,
                            f" ({len(too_long)} of {total} rows)")
        if over and truncate_prompt == "error":
            raise _over(self.name, *over[0], max_prompt_length, f" ({len(over)} of {total} rows)")
        if over:
            _cut_warning(self.name, *over[0], max_prompt_length, f"{len(over)} of {total} ")

    def fingerprint(self) -> str:
        """A digest of the length and of up to 64 rows spread over the dataset: a resume compares it with the
        checkpoint's (groupwise.checkpoint_load.check_resume) to notice another dataset of the same size."""
        n = len(self)
        digest = hashlib.sha256(str(n).encode())
        for i in sorted({k * n // 64 for k in range(64)} if n else ()):
            digest.update(json.dumps(self[i], sort_keys=True, default=lambda v: type(v).__name__).encode())
        return digest.hexdigest()[:16]

    def check_room(self, max_completion_length: int, sampler_limit: tuple[int, str]) -> None:
        """The longest prompt (check_lengths) + max_completion_length within a context known only later (a vLLM
        server's max_model_len)."""
        kept, row = getattr(self, "longest", (0, 0))
        if kept + max_completion_length > sampler_limit[0]:
            raise _too_long(self.name, row, kept, max_completion_length, sampler_limit[1])

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, Any]:
        # a copy of its own (as a datasets.Dataset decodes one for every read, and TRL's DataLoader hands out): a
        # reward function that edits its prompts in place must not change the dataset, nor the group's other rows
        row = own_copy(self.data[int(i)])
        if self.default_prompt and "prompt" not in row:
            row["prompt"] = EmptyPrompt()
        return row


def _is_iterable_dataset(data: Any) -> bool:
    # an IterableDataset exists only once `datasets` is imported: not importing it here saves a run given plain rows
    # its ~1 s import (datasets, pyarrow, pandas)
    datasets = sys.modules.get("datasets")
    return datasets is not None and isinstance(data, getattr(datasets, "IterableDataset", ()))


def is_stream(data: Any) -> bool:
    """A dataset read by iteration only (`datasets.IterableDataset`, or any iterable without len / indexing)."""
    if isinstance(data, EnvironmentPrompts):
        return data.stream
    if _is_iterable_dataset(data):
        return True
    return not isinstance(data, (list, tuple)) and not hasattr(data, "__getitem__") and hasattr(data, "__iter__")


class StreamData:
    """An iterable prompt dataset (TRL accepts `datasets.IterableDataset` with max_steps), read in order, row r of
    the run being the r-th row yielded; after the last row it starts again (the next epoch). Rows are checked
    when read (a bad row is a ConfigError naming its number); prompt lengths are checked as the rollout encodes
    them. Only recent rows are kept in memory."""

    KEEP = 65_536  # rows kept for lookups behind the read position (a round asks for its rows in order)

    def __init__(self, data: Any, name: str, shuffle_seed: int | None = None):
        """shuffle_seed: a `datasets.IterableDataset` is read through its buffered shuffle with that seed (TRL's
        `dataset.shuffle(seed=…)` when shuffle_dataset; reshuffled each epoch by set_epoch); None: in order."""
        self.default_prompt = isinstance(data, EnvironmentPrompts)  # rows may lack the prompt (an EmptyPrompt)
        self.data, self.name = (data.data if self.default_prompt else data), name
        if shuffle_seed is not None and _is_iterable_dataset(self.data):
            self.data = self.data.shuffle(seed=shuffle_seed)
        self._keys: set[str] | None = None  # the first row's columns: every row must have them
        self._text: bool | None = None  # the first row's prompt format (a string): every row must have it
        self.length: int | None = None  # rows per epoch, known once the stream has ended once
        self._iter = None
        self._next = 0  # run row number of the next row the iterator yields
        self._epoch_start = 0
        self._rows: dict[int, dict[str, Any]] = {}
        self._lengths: dict[str, Any] | None = None  # check_lengths' arguments: each row is checked as it is read
        self._warned = False
        self._roles: set = set()  # chat roles whose rendering was checked (check_rendered)

    def fingerprint(self) -> None:
        """No digest: a stream's rows are not read ahead (a resume continues the stream where the checkpoint left it)."""
        return None

    def columns(self) -> list[str] | None:
        """The stream's columns where it declares them (an IterableDataset's column_names may be None)."""
        names = getattr(self.data, "column_names", None)
        return list(names) if names else None

    def _pull(self) -> dict[str, Any]:
        if self._iter is None:
            self._iter = iter(self.data)
        try:
            row = next(self._iter)
        except StopIteration:
            if self._next == self._epoch_start:
                raise ConfigError(f"{self.name} is empty: give a dataset with at least one row") from None
            self.length = self._next - self._epoch_start
            self._epoch_start = self._next
            if hasattr(self.data, "set_epoch"):  # a shuffled IterableDataset reshuffles per epoch
                self.data.set_epoch(self._next // self.length)
            self._iter = iter(self.data)
            try:
                row = next(self._iter)
            except StopIteration:
                raise ConfigError(f"{self.name} ended after {self.length} rows and gives none when read again (a "
                                  "generator or iterator is read only once): pass a datasets.IterableDataset "
                                  "(IterableDataset.from_generator) or a list, or a max_steps that one pass of the "
                                  "data covers") from None
        if self.default_prompt and isinstance(row, dict) and "prompt" not in row:
            row = {**row, "prompt": EmptyPrompt()}
        if not isinstance(row, dict) or "prompt" not in row:
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ConfigError(f"{self.name} row {self._next} has no 'prompt' column ({keys})")
        why = prompt_problem(row["prompt"])
        if why is not None:
            raise ConfigError(f"{self.name} row {self._next} has {why} (each prompt must be a non-empty string or a "
                              "list of {'role', 'content'} messages)")
        refuse_images(row, f"{self.name} row {self._next}")  # a stream that declares no columns: read per row
        if self._text is None:
            self._text = isinstance(row["prompt"], str)
        elif isinstance(row["prompt"], str) != self._text:
            raise mixed_formats(self.name, self._next, self._text)
        if self._lengths is not None:
            self._check_length(self._next, row["prompt"], **self._lengths)
        if self._keys is None:
            self._keys = set(row)
        elif set(row) != self._keys:
            _check_same_keys([(0, dict.fromkeys(self._keys)), (self._next, row)], self.name, False)
        return dict(row)

    def check_lengths(self, tokenizer, **limits) -> None:
        """PromptData.check_lengths' rules, applied to each row when it is read (a stream cannot be read ahead)."""
        self._lengths = {"tokenizer": tokenizer, **limits}

    def check_room(self, max_completion_length: int, sampler_limit: tuple[int, str]) -> None:
        """A context known only later (a vLLM server's max_model_len): checked on each row read from now on."""
        if self._lengths is not None:
            self._lengths["sampler_limit"] = sampler_limit

    def _check_length(self, i: int, prompt, *, tokenizer, max_prompt_length, max_completion_length, truncate_prompt,
                      max_positions, chat_template_kwargs=None, sampler_limit=None) -> None:
        max_positions, limit_name = _position_limit(max_positions, sampler_limit)
        n = len(token_ids(self.name, i, [prompt], tokenizer, chat_template_kwargs)[0])
        if n == 0:
            raise ConfigError(f"{self.name} row {i} encodes to zero tokens: {prompt!r:.80}")
        check_rendered(self.name, i, prompt, tokenizer, chat_template_kwargs, self._roles)
        kept, cut = _tokens_kept(n, max_prompt_length)
        if cut and truncate_prompt == "error":
            raise _over(self.name, i, n, max_prompt_length)
        if cut and not self._warned:
            _cut_warning(self.name, i, n, max_prompt_length)
            self._warned = True
        if max_positions is not None and kept + max_completion_length > max_positions:
            raise _too_long(self.name, i, kept, max_completion_length, limit_name)

    def __getitem__(self, i: int) -> dict[str, Any]:
        i = int(i)
        while self._next <= i:
            self._rows[self._next] = self._pull()
            self._next += 1
            if len(self._rows) > self.KEEP:
                self._rows.pop(next(iter(self._rows)))
        if i not in self._rows:
            raise IndexError(f"{self.name}: row {i} is no longer in memory (rows are read in order)")
        return own_copy(self._rows[i])  # a copy of its own, as PromptData's

    def seek(self, position: int) -> None:
        """Read up to run row `position` (resume): the rows before it are read and dropped, as they were used."""
        while self._next < position:
            self._pull()
            self._next += 1

