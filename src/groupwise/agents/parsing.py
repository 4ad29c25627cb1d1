"""The model's output as a chat message, and the checks a tokenizer must pass before tools can be used.

`parse_response` is TRL 1.16's (`trl.chat_template_utils.parse_response`): transformers' `tokenizer.parse_response(ids,
prefix=…, tools=…)` reads the assistant message out of the generated tokens with the tokenizer's `response_template`
(`prefix` is the rendered context before them, so a template that opens the turn with e.g. `<think>` is parsed
right; `tools` types the arguments by each tool's JSON schema: "3" becomes 3 for an integer parameter). A trailing
EOS is removed from the content, a missing content becomes "", the tool calls are validated, and anything malformed
(bad JSON, a call without a name, …) falls back to the plain decoded text — a message without tool calls, which ends
the conversation.

`prepare_tokenizer` runs once, before any model loads: the chat template must render a whole tool exchange, the
tokenizer must know how to parse responses (`response_template`), and the template must be prefix-preserving (what
the token-level concatenation of tool results relies on, groupwise.agents.turns). Where TRL patches a known template
(`add_response_schema`, `get_training_chat_template`) groupwise asks TRL to do the same when it is installed;
otherwise the error names the fix.
"""

from __future__ import annotations

import inspect
from typing import Any

from groupwise.config_base import ConfigError

# TRL's qwen3_template (trl/chat_template_utils.py), in transformers' response-template format: the
# `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>` format of Qwen2.5 / Qwen3 (and their `<think>` block).
# `tokenizer.response_template = QWEN3_RESPONSE_TEMPLATE` lets a Qwen-format tokenizer parse tool calls without TRL.
QWEN3_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


def validate_tool_calls(tool_calls: Any) -> None:
    """TRL's `_validate_tool_calls`: each call a dict whose function (nested `{"function": {...}}` or flat) has a
    string name; missing or None arguments become {}. Anything else is a ValueError (→ the plain-text fallback)."""
    if tool_calls is None:
        return
    if not isinstance(tool_calls, list):
        raise ValueError("tool_calls must be a list or None.")
    for idx, call in enumerate(tool_calls):
        if not isinstance(call, dict):
            raise ValueError(f"tool_calls[{idx}] must be a dict.")
        func = call.get("function", call)
        if not isinstance(func, dict):
            raise ValueError(f"tool_calls[{idx}]['function'] must be a dict.")
        if not isinstance(func.get("name"), str):
            raise ValueError(f"tool_calls[{idx}] has no string 'name'.")
        if func.get("arguments") is None:
            func["arguments"] = {}


def encodable(value: Any) -> Any:
    """`value` with every string (dict keys included) made encodable as UTF-8: a lone surrogate, which a JSON escape
    such as "\\ud800" in the model's tool call decodes to, becomes that escape as text. The tokenizer cannot encode
    such a string, so it would stop the run when a tool message that repeats it is rendered."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode("utf-8")
        return value
    if isinstance(value, dict):
        return {encodable(k): encodable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [encodable(v) for v in value]
    return value


def parse_response(tokenizer, ids: list[int], prefix: list[int], tools: list | None = None) -> dict[str, Any]:
    """One assistant message from the generated `ids` (see the module docstring); never raises on bad output. No
    tokens (a turn cut to nothing) is an empty message; JSON nested too deep to parse (RecursionError) is text.
    Strings the JSON escapes made unencodable (lone surrogates) are kept as their escapes (`encodable`)."""
    if not ids:
        return {"role": "assistant", "content": ""}
    kwargs: dict[str, Any] = {"prefix": prefix}
    if tools is not None and _takes(tokenizer.parse_response, "tools"):  # transformers ≥ 5.15 (TRL passes it then)
        kwargs["tools"] = tools
    try:
        parsed = tokenizer.parse_response(ids, **kwargs)
        if parsed is None:  # so truncated that even the content is lost
            raise ValueError("parse_response returned None")
        if isinstance(parsed.get("content"), str):
            parsed["content"] = parsed["content"].removesuffix(tokenizer.eos_token)
        if not parsed.get("content"):
            parsed["content"] = ""
        if "tool_calls" in parsed:
            validate_tool_calls(parsed["tool_calls"])
            parsed = encodable(parsed)
    except (ValueError, TypeError, RecursionError):
        parsed = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    return parsed


def assistant_message(tokenizer, ids: list[int], prefix: list[int], tools: list | None = None) -> dict[str, Any]:
    """One model turn as TRL's `_generate` gives it to reward functions: parsed (reasoning, tool calls) when the
    tokenizer has a response_template, else {"role": "assistant", "content": its text}."""
    if getattr(tokenizer, "response_template", None) is not None and hasattr(tokenizer, "parse_response"):
        return parse_response(tokenizer, ids, prefix, tools)
    return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}


def as_completions(tokenizer, completion_ids: list[list[int]], prompt_ids: list[list[int]],
                   conversational: bool) -> list[Any]:
    """What reward functions get as `completions` for single-turn rows: the text for plain prompts; for chat prompts
    one assistant message per row (`assistant_message`)."""
    if not conversational:
        return tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return [[assistant_message(tokenizer, ids, prefix)] for ids, prefix in zip(completion_ids, prompt_ids)]


def _takes(method, name: str) -> bool:
    try:
        return name in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


def supports_tool_calling(tokenizer) -> bool:
    """TRL's check: user → assistant with a tool call → tool renders, and the call's name, argument key and
    value and the tool's content all appear in the text."""
    from jinja2 import TemplateError

    if tokenizer.chat_template is None:
        return False
    name, key = "tool_name_a8f3e2b1", "tool_arg_key_b9d4f5c2"  # TRL's sentinels
    value, content = "tool_arg_val_d6e7a9f3", "tool_content_c4f9a8e2"
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {key: value}}}]},
                {"role": "tool", "name": name, "content": content}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except (TemplateError, TypeError):
        return False
    return all(s in text for s in (name, key, value, content))


def is_prefix_preserving(tokenizer, chat_template: str | None = None) -> bool:
    """TRL's `is_chat_template_prefix_preserving`: user + assistant(tool call) renders to a token prefix of the same
    conversation followed by a tool message and the next generation prompt."""
    calls = [{"type": "function", "function": {"name": "dummy", "arguments": {}}}]
    head = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    short = tokenizer.apply_chat_template(head, tokenize=True, return_dict=False, chat_template=chat_template)
    full = tokenizer.apply_chat_template(head + [{"role": "tool", "name": "dummy", "content": "dummy"}], tokenize=True,
                                         return_dict=False, add_generation_prompt=True, chat_template=chat_template)
    return full[:len(short)] == short


def _trl_helper(name: str):
    """A function of trl.chat_template_utils, or None when TRL is not installed."""
    try:
        import trl.chat_template_utils as utils
    except ImportError:
        return None
    return getattr(utils, name, None)


def prepare_tokenizer(tokenizer) -> str | None:
    """Check (and, through TRL when it is installed, complete) a tokenizer for tool calling, as TRL's GRPOTrainer does
    at init. Returns the chat template to render with: None for the tokenizer's own, or TRL's training version of a
    template that is not prefix-preserving. Errors are ConfigErrors naming the fix."""
    method = getattr(tokenizer, "parse_response", None)
    if method is None or not _takes(method, "prefix"):  # the response_template format of transformers 5.13
        import transformers

        raise ConfigError(f"tools: parsing the model's tool calls needs transformers ≥ 5.13 (tokenizer.parse_response "
                          f"with prefix=), found {transformers.__version__}: pip install -U transformers")
    if not supports_tool_calling(tokenizer):
        raise ConfigError("tools: the tokenizer's chat template cannot render a tool-calling conversation (user → "
                          "assistant with tool_calls → tool, name, arguments and result all shown); use a "
                          "tool-capable chat template (e.g. the model's own from a tool-calling fine-tune)")
    if getattr(tokenizer, "response_template", None) is None:
        add = _trl_helper("add_response_schema")
        try:
            if add is None:
                raise ValueError("trl is not installed")
            add(tokenizer)  # TRL's table of known chat templates (exact match); sets tokenizer.response_template
        except ValueError as e:
            raise ConfigError(f"tools: the tokenizer has no response_template, so tool calls cannot be parsed from "
                              f"the model's output ({e}); set tokenizer.response_template (transformers' format; "
                              "groupwise.agents.parsing.QWEN3_RESPONSE_TEMPLATE for Qwen's <tool_call> JSON), or "
                              "install trl, whose add_response_schema recognises common chat templates") from None
        if getattr(tokenizer, "response_template", None) is None:
            raise ConfigError("tools: TRL found only a legacy response_schema for this chat template; set "
                              "tokenizer.response_template (transformers ≥ 5.13 format)")
    if is_prefix_preserving(tokenizer):
        return None
    patch = _trl_helper("get_training_chat_template")
    try:
        if patch is None:
            raise ValueError("trl is not installed")
        template = patch(tokenizer)
    except ValueError as e:
        raise ConfigError(f"tools: the chat template is not prefix-preserving (an earlier turn renders differently "
                          f"once a tool result follows), so tool results cannot be appended token by token ({e}); "
                          "give the tokenizer a template that renders every turn the same whatever follows, or "
                          "install trl, which has patched training templates for common models") from None
    if not is_prefix_preserving(tokenizer, template):
        raise ConfigError("tools: the chat template is not prefix-preserving, and TRL's training template for it is "
                          "not either; give the tokenizer a template that renders every turn the same whatever follows")
    return template
