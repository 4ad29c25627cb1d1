"""Neural process reward models (PRMs), usable wherever a process reward function is: each is a callable
`prm(prompts=…, completions=…, steps=…) -> [[score per step] per completion]`.

Every kind reads one input built by `build_prm_input`: the text prompt + prompt_separator + step 1 + separator +
step 2 + separator … tokenized at once (as PRMs are trained); each step is judged at one token of its separator
(found by offsets). prompt_separator keeps the question's last characters and step 1's first apart (else a BPE
merge across them shows the PRM text it never saw): " " for a step-tag PRM (Math-Shepherd's f"{question} {output}"),
"\n" for the other kinds, "" for a PRM `groupwise prm train` saved before the option existed (trained without).
chat_template=True renders prompt and steps with the PRM tokenizer's chat template instead (the steps as the
assistant's turn). tokenization="per_step" reads a PRM as TRL's PRMTrainer trained it, the prompt and each step
tokenized apart (`build_prm_input_per_step`).

TokenClassificationPRM   AutoModelForTokenClassification; score = P(positive_label) at the separator's last token
                         (what `groupwise prm train` produces); with one label, that label's logit. A remote-code
                         PRM whose auto_map names only AutoModel (Qwen2.5-Math-PRM) loads with AutoModel and is
                         read alike, with chat_template=True and its separator token.
StepTagPRM               AutoModelForCausalLM with a step tag (Math-Shepherd: separator " ки\\n", labels "+"/"-");
                         score = P(good) / (P(good) + P(bad)) of the next token predicted at the tag.
PrefixClassificationPRM  AutoModelForSequenceClassification applied to each prefix (prompt + steps 1..j; with
                         chat_template=True each prefix is its own finished conversation);
                         score = logits[0] for one label, else P(positive_label).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from groupwise.config_base import ConfigError
from groupwise.model_files import holds_tokenizer
from groupwise.text import ensure_pad_token, pad_rows

PRM_CONFIG = "groupwise_prm.json"  # written by `groupwise prm train`: kind, separator, positive label, max_length


def _content_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
    return "" if content is None else str(content)


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):  # chat messages: the conversation's text (text blocks of block contents)
        return "\n".join(_content_text(m.get("content")) for m in prompt if isinstance(m, dict))
    raise TypeError(f"a prompt must be a string or chat messages, got {type(prompt).__name__}")


def _chat_text(tokenizer, prompt: Any, content: str, system_prompt: str | None) -> tuple[str, int]:
    """The conversation prompt + an assistant turn holding `content`, rendered by the PRM tokenizer's chat template
    (as Qwen2.5-Math-PRM is read: system, user question, the steps as the assistant's answer), and where `content`
    starts in it."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("the PRM tokenizer has no chat template, so chat_template=True cannot render the prompt "
                          "and steps as a conversation: drop chat_template, or give a tokenizer that has one")
    messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                else [dict(m, content=_content_text(m.get("content"))) for m in prompt])
    if system_prompt is not None and not any(m.get("role") == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})

    def render(answer: str) -> str:
        return tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": answer}], tokenize=False)

    # where the answer goes: found by a placeholder (a search for the steps' text could match inside the prompt),
    # then the real rendering must be that text with the steps in the placeholder's place, unchanged
    mark = "\ue000GROUPWISE-STEPS\ue000"  # private-use characters: not whitespace, so a template's trim keeps them
    marked, text = render(mark), render(content)
    start = marked.find(mark)
    if start < 0 or text != marked[:start] + content + marked[start + len(mark):]:
        raise ValueError("the PRM tokenizer's chat template changes the assistant turn's text (it strips or rewrites "
                         "it), so the step separators cannot be found in the rendered conversation: use "
                         "chat_template=False, or a separator the template keeps (one that does not end the turn "
                         "with whitespace, e.g. Qwen2.5-Math-PRM's <extra_0>)")
    return text, start


def build_prm_input(tokenizer, prompt: Any, steps: list[str], separator: str, *, judge_char: int = -1,
                    max_length: int | None = None, prompt_separator: str = "", chat_template: bool = False,
                    system_prompt: str | None = None, refuse_merged: bool = False) -> tuple[list[int], list[int]]:
    """Token ids of the text prompt + prompt_separator (when the prompt has text) + Σ (step + separator), tokenized
    at once as a PRM is trained on it (Math-Shepherd
    style: tokenizing the pieces apart would give SentencePiece steps a leading '▁' and break byte-level merges
    across step boundaries), and for each step the position that judges it: the token covering the character
    `judge_char` of that step's separator (−1: its last character, so the separator's last token). Positions come
    from the tokenizer's offset mapping, so a fast tokenizer is needed. Steps past max_length are cut (positions
    stop early). With `chat_template`, the text is the PRM tokenizer's chat template over the prompt's messages (a
    string prompt: one user message; `system_prompt` first when the prompt has no system message) and an assistant
    turn of Σ (step + separator), tokenized without adding special tokens (the template writes them), as
    Qwen2.5-Math-PRM reads a solution; prompt_separator is not used then. `refuse_merged` (training data): a
    ValueError when a step's judging token runs on into the next step's text (a byte-level BPE merging '\n' with the
    letters after it): its label would be learnt from a token that already shows the next step."""
    if not tokenizer(separator, add_special_tokens=False)["input_ids"]:
        raise ValueError(f"the PRM tokenizer encodes the separator {separator!r} to no tokens")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"the PRM tokenizer ({type(tokenizer).__name__}) is a slow tokenizer: it has no offset "
                         "mapping to find each step's separator in the jointly tokenized text; load the fast one "
                         "(AutoTokenizer.from_pretrained(..., use_fast=True))")
    content, judged = "", []  # each step's separator: where it starts and the character judging the step
    for step in steps:
        content += step + separator
        judged.append((len(content) - len(separator), len(content) - len(separator) + judge_char % len(separator)))
    if chat_template:
        text, start = _chat_text(tokenizer, prompt, content, system_prompt)
    else:
        head = _prompt_text(prompt)
        head += prompt_separator if head else ""
        text, start = head + content, len(head)
    judged = [(a + start, c + start) for a, c in judged]
    enc = tokenizer(text, add_special_tokens=not chat_template, return_offsets_mapping=True)
    ids, spans = list(enc["input_ids"]), [tuple(s) for s in enc["offset_mapping"]]
    real = [i for i, (a, b) in enumerate(spans) if a < b]  # special tokens have empty spans
    positions, k = [], 0
    for sep_start, c in judged:  # the last token starting at or before c: the one covering it
        while k < len(real) and spans[real[k]][0] <= c:
            k += 1
        if k == 0 or spans[real[k - 1]][1] <= sep_start:
            raise ValueError(f"the PRM tokenizer leaves the separator {separator!r} out of the text's tokens: no "
                             "token to judge a step at")
        if refuse_merged and len(positions) < len(steps) - 1 and spans[real[k - 1]][1] > sep_start + len(separator):
            a, b = spans[real[k - 1]]
            raise ValueError(f"the PRM tokenizer merges the separator {separator!r} with the next step's text (the "
                             f"token {text[a:b]!r} judges step {len(positions)}): its label would be learnt from a "
                             "token that shows the next step; choose a separator the tokenizer keeps apart from "
                             "the text after it")
        positions.append(real[k - 1])
    if max_length is not None and len(ids) > max_length:
        ids = ids[:max_length]
        positions = [p for p in positions if p < max_length]
    return ids, positions


def build_prm_input_per_step(tokenizer, prompt: Any, steps: list[str], separator: str, *, judge_char: int = -1,
                             max_length: int | None = None, prompt_separator: str = "") -> tuple[list[int], list[int]]:
    """The input as TRL's PRMTrainer built it for training (`tokenize_row`): [bos] + tokens(prompt +
    prompt_separator) + Σ (tokens(step) + tokens(separator)), each piece tokenized apart without special tokens, the
    tokenizer's BOS first when it has one; each step judged at the token of its separator that covers the character
    `judge_char` of the separator (−1: its last token, where TRL puts the step's label). Steps past max_length are
    cut (positions stop early), as TRL cuts input_ids[:max_length]."""
    sep_ids = list(tokenizer(separator, add_special_tokens=False)["input_ids"])
    if not sep_ids:
        raise ValueError(f"the PRM tokenizer encodes the separator {separator!r} to no tokens")
    judge = len(sep_ids) - 1  # the separator's last token; another character: the token covering it (offsets)
    if judge_char % len(separator) != len(separator) - 1:
        spans = tokenizer(separator, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        c = judge_char % len(separator)
        judge = max((i for i, (a, b) in enumerate(spans) if a <= c and a < b), default=judge)
    head = _prompt_text(prompt)
    head += prompt_separator if head else ""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    ids, positions = bos + list(tokenizer(head, add_special_tokens=False)["input_ids"]), []
    for step in steps:
        step_ids = list(tokenizer(step, add_special_tokens=False)["input_ids"])
        positions.append(len(ids) + len(step_ids) + judge)
        ids += step_ids + sep_ids
    if max_length is not None and len(ids) > max_length:
        ids = ids[:max_length]
        positions = [p for p in positions if p < max_length]
    return ids, positions


TOKENIZATIONS = ("joint", "per_step")  # how a PRM's input is tokenized: build_prm_input, build_prm_input_per_step


def position_limit(model, tokenizer=None) -> int | None:
    """The most tokens `model` takes: the smaller of config.max_position_embeddings (GPT-2's n_positions maps to it)
    and the tokenizer's model_max_length when that is a real limit (transformers writes a huge sentinel when
    unknown). Both count: RoBERTa-like models declare 514 positions but number them from padding_idx + 1, so 512
    tokens fit, which their tokenizers say."""
    limits = [getattr(getattr(model, "config", None), "max_position_embeddings", None),
              getattr(tokenizer, "model_max_length", None)]
    limits = [n for n in limits if isinstance(n, int) and 0 < n < 10**7]
    return min(limits) if limits else None


class _PRM:
    kind = ""
    prompt_separator = "\n"  # between the prompt and step 1, unless given

    def __init__(self, model, tokenizer, *, separator: str = "\n", batch_size: int = 8, max_length: int | None = None,
                 name: str | None = None, prompt_separator: str | None = None, chat_template: bool = False,
                 system_prompt: str | None = None, tokenization: str = "joint"):
        if not isinstance(chat_template, bool):
            raise ConfigError(f"PRM chat_template={chat_template!r} must be true or false")
        if tokenization not in TOKENIZATIONS:
            raise ConfigError(f"PRM tokenization={tokenization!r} is not one of {list(TOKENIZATIONS)}: 'joint' reads "
                              "the text tokenized at once, 'per_step' the prompt and each step tokenized apart, as "
                              "TRL's PRMTrainer trained")
        if tokenization == "per_step" and chat_template:
            raise ConfigError("PRM tokenization='per_step' reads plain text, as TRL's PRMTrainer trained; "
                              "chat_template=True renders a conversation: drop one of them")
        self.tokenization = tokenization
        if tokenization == "per_step":
            self.prompt_separator = ""  # TRL's PRMTrainer: prompt ids, then step 1's, nothing between
        if chat_template and prompt_separator is not None:
            raise ConfigError(f"PRM prompt_separator={prompt_separator!r} is not read with chat_template=True (the "
                              "chat template places the prompt and the steps): drop one of them")
        if system_prompt is not None and (not chat_template or not isinstance(system_prompt, str)):
            raise ConfigError(f"PRM system_prompt={system_prompt!r} needs chat_template=True and a string (the "
                              "system message put before a prompt that has none)")
        self.chat_template, self.system_prompt = chat_template, system_prompt
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        ensure_pad_token(tokenizer, "the PRM's tokenizer")
        # no max_length: the PRM's own position limit, so a long prompt + steps leaves its last steps unscored
        # instead of indexing past the position table (an IndexError, a device-side assert on GPU)
        self.separator, self.batch_size = separator, batch_size
        if prompt_separator is not None:
            if not isinstance(prompt_separator, str):
                raise ConfigError(f"prompt_separator={prompt_separator!r} must be a string (the text between the "
                                  "prompt and the first step)")
            self.prompt_separator = prompt_separator
        limit = position_limit(model, tokenizer)
        if max_length is not None and limit is not None and max_length > limit:  # would index past the positions
            raise ConfigError(f"PRM max_length={max_length} is more than the {limit} positions the model takes: set "
                              f"max_length ≤ {limit}, or leave it unset to use the model's limit")
        self.max_length = limit if max_length is None else max_length
        self.__name__ = name or f"prm_{self.kind}"
        if chat_template:  # a template that cannot render the conversation (Gemma's refuses a system turn): now
            from jinja2.exceptions import TemplateError

            try:
                build_prm_input(tokenizer, "?", ["."], separator, chat_template=True, system_prompt=system_prompt)
            except (ValueError, TemplateError) as e:
                raise ConfigError(f"PRM {self.__name__!r} with chat_template=True: {e}") from None

    def to(self, device) -> "_PRM":
        self.model.to(device)
        return self

    @property
    def device(self):
        return next(self.model.parameters()).device

    def __call__(self, prompts, completions, steps, **_) -> list[list[float]]:
        out: list[list[float]] = []
        with torch.inference_mode():
            for lo in range(0, len(prompts), self.batch_size):
                out += self._score(prompts[lo:lo + self.batch_size], steps[lo:lo + self.batch_size])
        if any(v is None for row in out for v in row):  # visible, not a silent advantage of 0 (rollout turns
            # None into NaN, left out of the statistics); one text per PRM, so Python shows it once, not every round
            warnings.warn(f"PRM {self.__name__!r}: steps past max_length={self.max_length} tokens (prompt + steps) "
                          "are unscored (left out of the step statistics, advantage 0 from them); raise max_length "
                          "up to the PRM's context, or shorten the prompts", RuntimeWarning, stacklevel=2)
        return out

    def _build(self, prompts, steps, judge_char=-1) -> list[tuple[list[int], list[int]]]:
        if self.tokenization == "per_step":
            return [build_prm_input_per_step(self.tokenizer, p, s, self.separator, judge_char=judge_char,
                                             max_length=self.max_length, prompt_separator=self.prompt_separator)
                    for p, s in zip(prompts, steps)]
        return [build_prm_input(self.tokenizer, p, s, self.separator, judge_char=judge_char,
                                max_length=self.max_length, prompt_separator=self.prompt_separator,
                                chat_template=self.chat_template, system_prompt=self.system_prompt)
                for p, s in zip(prompts, steps)]

    def _inputs(self, prompts, steps, judge_char=-1):
        built = self._build(prompts, steps, judge_char)
        ids, mask = (t.to(self.device) for t in pad_rows([b[0] for b in built], self.tokenizer.pad_token_id))
        return ids, mask, [b[1] for b in built]

    @staticmethod
    def _per_step(values: torch.Tensor, positions: list[list[int]], steps) -> list[list[float | None]]:
        # a step cut by max_length has no position: None (unscored) rather than a guess
        return [[float(values[i, p]) for p in pos] + [None] * (len(s) - len(pos))
                for i, (pos, s) in enumerate(zip(positions, steps))]


def _check_positive_label(positive_label: int, n: int) -> int:
    if isinstance(positive_label, bool) or not isinstance(positive_label, int) or not 0 <= positive_label < n:
        raise ConfigError(f"positive_label={positive_label!r} but the PRM has {n} labels: give the index of the "
                          f"good-step label, 0 to {n - 1}")
    return positive_label


class TokenClassificationPRM(_PRM):
    kind = "token_classification"

    def __init__(self, model, tokenizer, *, positive_label: int = 1, **kw):
        super().__init__(model, tokenizer, **kw)
        n = model.config.num_labels  # one label: the score is that logit (a softmax over one label is always 1)
        self.positive_label = _check_positive_label(positive_label, n) if n > 1 else positive_label
        self.num_labels = n

    def _score(self, prompts, steps):
        ids, mask, positions = self._inputs(prompts, steps)
        out = self.model(input_ids=ids, attention_mask=mask)
        logits = (out.logits if hasattr(out, "logits") else out[0]).float()  # (n, L, num_labels)
        if logits.dim() != 3 or logits.size(-1) != self.num_labels:  # e.g. a base model's hidden states
            raise ValueError(f"PRM {self.__name__!r} returned {tuple(logits.shape)} where a token-classification PRM "
                             f"gives (batch, tokens, {self.num_labels}) label logits: load a model with its "
                             "classification head")
        scores = logits[..., 0] if logits.size(-1) == 1 else torch.softmax(logits, -1)[..., self.positive_label]
        return self._per_step(scores, positions, steps)


class StepTagPRM(_PRM):
    kind = "step_tag"
    prompt_separator = " "  # Math-Shepherd: f"{question} {output}"

    def __init__(self, model, tokenizer, *, step_tag: str = "ки", good_token: str = "+", bad_token: str = "-",
                 separator: str | None = None, **kw):
        separator = f" {step_tag}\n" if separator is None else separator
        super().__init__(model, tokenizer, separator=separator, **kw)
        tag_ids = tokenizer(step_tag, add_special_tokens=False)["input_ids"]
        if len(tag_ids) != 1:
            raise ValueError(f"the PRM tokenizer does not have the step tag {step_tag!r} as one token "
                             f"(it encodes to {tag_ids}); add it or pick the tag the PRM was trained with")
        if step_tag not in separator:
            raise ValueError(f"separator {separator!r} does not contain the step tag {step_tag!r}")
        self.judge_char = separator.index(step_tag) + len(step_tag) - 1  # judged at the token covering the tag
        self.label_ids = []
        for label in (good_token, bad_token):
            ids = tokenizer(label, add_special_tokens=False)["input_ids"]
            if len(ids) != 1:
                raise ValueError(f"label token {label!r} is not a single token of the PRM tokenizer (it encodes "
                                 f"to {ids})")
            self.label_ids.append(ids[0])

    def _score(self, prompts, steps):
        ids, mask, positions = self._inputs(prompts, steps, judge_char=self.judge_char)
        logits = self.model(input_ids=ids, attention_mask=mask).logits[..., self.label_ids].float()  # (n, L, 2)
        return self._per_step(torch.softmax(logits, -1)[..., 0], positions, steps)  # P(good)/(P(good)+P(bad))


class PrefixClassificationPRM(_PRM):
    kind = "prefix_classification"

    def __init__(self, model, tokenizer, *, positive_label: int = 1, **kw):
        super().__init__(model, tokenizer, **kw)
        n = model.config.num_labels  # one label: the score is logits[0] and positive_label is not read
        self.positive_label = _check_positive_label(positive_label, n) if n > 1 else positive_label
        # HF pools at the last token that is not config.pad_token_id: pad with that id (setting it when unset), or
        # a config pad id other than the tokenizer's would pool on padding and scores would depend on batch size
        if not isinstance(model.config.pad_token_id, int) or model.config.pad_token_id < 0:
            model.config.pad_token_id = tokenizer.pad_token_id
        self.pad_id = model.config.pad_token_id

    def _prefixes(self, prompts, steps) -> tuple[list[tuple[int, int]], list[list[int]]]:
        """(completion, step) pairs and the token ids each is judged on. Prefix j = prompt + steps 1..j with their
        separators = the tokens up to step j's judged position (its separator's last token); with chat_template,
        the conversation whose assistant turn is steps 1..j with their separators, finished as the template
        finishes a turn. A step past max_length: no prefix (None, no forward pass)."""
        if not self.chat_template:
            built = self._build(prompts, steps)
            prefixes = [(i, j) for i, (_, pos) in enumerate(built) for j in range(len(pos))]
            return prefixes, [built[i][0][:built[i][1][j] + 1] for i, j in prefixes]
        prefixes, texts = [], []
        for i, (prompt, own) in enumerate(zip(prompts, steps)):
            for j in range(len(own)):
                ids, _ = build_prm_input(self.tokenizer, prompt, own[:j + 1], self.separator, chat_template=True,
                                         system_prompt=self.system_prompt)
                if self.max_length is not None and len(ids) > self.max_length:
                    break  # the longer prefixes are longer still
                prefixes.append((i, j))
                texts.append(ids)
        return prefixes, texts

    def _score(self, prompts, steps):
        prefixes, texts = self._prefixes(prompts, steps)
        scores: list[float] = []
        config = self.model.config.get_text_config()
        for lo in range(0, len(texts), self.batch_size):
            chunk = texts[lo:lo + self.batch_size]
            # HF pools at the rightmost token that is not config.pad_token_id: a judged token equal to that id (a
            # separator that is the pad token) would pool one token early. Pad this batch with an id no prefix ends
            # with, named in the config for the forward (right padding: the pad id changes no real position)
            ends = {int(t[-1]) for t in chunk}
            pad = self.pad_id if self.pad_id not in ends else next(i for i in range(len(ends) + 1) if i not in ends)
            ids, mask = (t.to(self.device) for t in pad_rows(chunk, pad))
            saved, config.pad_token_id = config.pad_token_id, pad
            try:
                logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
            finally:
                config.pad_token_id = saved
            if logits.size(-1) == 1:
                scores += logits[:, 0].tolist()
            else:
                scores += torch.softmax(logits, -1)[:, self.positive_label].tolist()
        out: list[list[float | None]] = [[None] * len(s) for s in steps]
        for (i, j), v in zip(prefixes, scores):
            out[i][j] = v
        return out


PRM_KINDS = {cls.kind: cls for cls in (TokenClassificationPRM, StepTagPRM, PrefixClassificationPRM)}
_AUTO = {"token_classification": "AutoModelForTokenClassification", "step_tag": "AutoModelForCausalLM",
         "prefix_classification": "AutoModelForSequenceClassification"}


def read_prm_record(path: str, where: str | None = None, kind: str | None = None) -> dict:
    """The options `groupwise prm train` recorded in a PRM folder's groupwise_prm.json ({} without one): a JSON
    object whose kind, when it has one, is a PRM kind (it must have one unless `kind`, the spec's, is given), else a
    ConfigError naming the file (`where`: the spec's field)."""
    cfg = Path(os.path.expanduser(str(path))) / PRM_CONFIG
    if not cfg.is_file():
        return {}
    named = f"{where}: {cfg}" if where else str(cfg)
    try:
        recorded = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{named} cannot be read ({type(e).__name__}: {e}): it is written by `groupwise prm train`; "
                          "train the PRM again, or restore the file from its checkpoint-N/ folder") from None
    if not isinstance(recorded, dict) or recorded.get("kind") not in PRM_KINDS and (
            "kind" in recorded or kind is None):
        got = recorded.get("kind") if isinstance(recorded, dict) else type(recorded).__name__
        raise ConfigError(f"{named} is not a PRM record (a JSON object with kind one of {sorted(PRM_KINDS)}; got "
                          f"{got!r}): train the PRM again, or restore the file from its checkpoint-N/ folder")
    return recorded


def check_prm_folder(path: str, where: str, kind: str | None = None) -> None:
    """A local PRM folder, before any model loads: a saved model (config.json), its weights and tokenizer, and a
    readable groupwise_prm.json when it has one; each missing or bad file named in one line. A hub id: unchecked."""
    from groupwise.config_base import check_model_location

    folder = os.path.expanduser(str(path))
    if check_model_location(str(path), where) != "local" or not os.path.isdir(folder):
        return
    names = set(os.listdir(folder))  # (its weights: check_model_location)
    if not holds_tokenizer(names):
        raise ConfigError(f"{where}={path!r} holds no tokenizer (tokenizer.json / tokenizer_config.json): save it there "
                          "with tokenizer.save_pretrained(folder)")
    read_prm_record(folder, where, kind)


def load_prm(path: str, kind: str | None = None, *, trust_remote_code: bool = False, dtype: str | None = None,
             **options) -> _PRM:
    """Load a PRM from a local folder or the hub. `kind` defaults to the one recorded by `groupwise prm train`;
    `dtype` ("bfloat16", "float16", "float32", "auto": the saved one; default float32, whatever the saved
    dtype) is the weights' dtype, scores are computed
    from float32 logits whatever it is."""
    import transformers

    dtype = "float32" if dtype is None else dtype  # as documented; from_pretrained would keep the saved dtype
    if dtype != "auto":
        if not isinstance(getattr(torch, str(dtype).replace("torch.", ""), None), torch.dtype):
            raise ConfigError(f"PRM dtype={dtype!r} is not a torch dtype (bfloat16, float16, float32 or auto)")
        dtype = getattr(torch, str(dtype).replace("torch.", ""))

    recorded = read_prm_record(path, kind=kind)
    if recorded:
        recorded.setdefault("prompt_separator", "")  # saved before the option: trained with nothing there
    saved = recorded.pop("kind", None)
    if (kind or saved) not in PRM_KINDS:
        raise ValueError(f"PRM kind {kind or saved!r} is not one of {sorted(PRM_KINDS)} (set `kind` for {path})")
    if kind is not None and saved is not None and kind != saved:  # its recorded options are the saved kind's
        raise ConfigError(f"{path} was trained by `groupwise prm train` as a {saved} PRM ({PRM_CONFIG}); kind="
                          f"{kind!r} cannot read it: drop kind, or give a PRM of that kind")
    kind = kind or saved
    if options.get("chat_template") and saved is not None:
        raise ConfigError(f"{path} was trained by `groupwise prm train` on plain text, without a chat template "
                          f"({PRM_CONFIG}): drop chat_template to read it as trained")
    if options.get("tokenization", "joint") != "joint" and saved is not None:
        raise ConfigError(f"{path} was trained by `groupwise prm train` on text tokenized at once ({PRM_CONFIG}): "
                          f"drop tokenization={options['tokenization']!r} to read it as trained")
    auto = _AUTO[kind]
    try:
        config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise ConfigError(f"PRM {path} runs its own code (config.json's auto_map): set trust_remote_code: true in "
                          "its spec (or the run's trust_remote_code) if you trust that code") from None
    auto_map = getattr(config, "auto_map", None) or {}
    named = getattr(config, "architectures", None) or []  # none named: the auto_map's class is the model's
    own_class = not named or any(not hasattr(transformers, a) for a in named)
    if kind == "token_classification" and auto not in auto_map and "AutoModel" in auto_map and own_class:
        # a remote-code PRM naming only AutoModel (Qwen2.5-Math-PRM): logits per token, read alike. Without
        # trust_remote_code transformers would load its architecture's plain base model (no score head); a
        # transformers class in `architectures` (an inherited auto_map) loads as any token classifier
        if not trust_remote_code:
            raise ConfigError(f"PRM {path} runs its own code (config.json's auto_map names {auto_map['AutoModel']}): "
                              "set trust_remote_code: true in its spec (or the run's trust_remote_code) if you trust "
                              "that code")
        auto = "AutoModel"
    model, info = getattr(transformers, auto).from_pretrained(path, trust_remote_code=trust_remote_code, dtype=dtype,
                                                              output_loading_info=True)
    if info["missing_keys"]:  # newly initialised weights would score at random (transformers only logs them)
        missing = sorted(info["missing_keys"])
        raise ConfigError(f"PRM {path}: its checkpoint has no weights for {', '.join(missing[:4])}"
                          f"{' …' if len(missing) > 4 else ''}, which a {kind} PRM ({_AUTO[kind]}) reads: they would "
                          "be initialised at random and score noise. Give a PRM trained as that kind (`groupwise prm "
                          "train` writes token_classification ones), or the kind this checkpoint was trained as")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    name = options.pop("name", None) or Path(path).name or kind
    return PRM_KINDS[kind](model, tokenizer, name=name, **{**recorded, **options})
