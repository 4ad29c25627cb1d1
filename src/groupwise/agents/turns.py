"""Multi-turn rollouts with tools: TRL 1.16's tool loop (`_generate` → `_tool_call_loop`), batched.

For N rows (one rollout each, a group's rows contiguous):

1. Environments (if any) are taken from the pool and reset with their rows; a returned string is appended to the last
   user message. Each prompt is rendered with its tools' schemas (`tools=` of the chat template, None when there are
   none) and keeps its last max_prompt_length tokens.
2. Turn 1: one generator call for all N prompts. Each completion is cut after its first EOS and parsed into an
   assistant message (groupwise.agents.parsing).
3. While some rows' last message has tool calls and fewer than `max_tool_calling_iterations` tool rounds ran: each
   such row's calls run (groupwise.agents.execution) and their tool messages are appended; the tokens those messages
   add — the tool-result block and the next assistant header, from the chat template (`tool_suffix_ids`, TRL's
   EOS-trimmed dummy-prefix method) — are appended to the row's tokens as they are (no re-tokenization of the
   history). A row whose completion would then exceed max_completion_length (or the model's positions) drops these
   tool messages and leaves the loop ("overlong rollback"; its calls still count). All remaining rows are generated
   by one generator call (left-padded, each row its own prompt) that asks for at most the largest turn any of them
   may still take — what is left of max_completion_length, and never past a row's positions (a model with learned
   position embeddings has no position beyond them: TRL asks every turn for max_completion_length tokens and
   overruns them); a row whose positions end sooner than other rows' budgets goes in a call of its own with the
   smaller limit. Each new turn is cut to what is left of max_completion_length (possibly to nothing), parsed, and
   appended.

The loop ends at a turn without tool calls, at the iteration limit (a tool call in the last turn is left unexecuted),
or when max_completion_length is used up. Per row it returns: completion_ids = model turn 1 + tool suffix 1 + model
turn 2 + …; tool_mask = 1 on model tokens, 0 on suffix tokens; the sampler's log-probs (0.0 on suffix tokens); the
messages (TRL's completions: assistant, tool…, assistant, …); turn_ends (the index of each model turn's last token);
and the tool-call, failure and timeout counts. An environment's optional `start_turn()` is called once per model turn
that has a turn end, in order, before that turn's calls run (with a copy of the turn's parsed tool calls when it takes
an argument: Toolbox.start_turn).

Multi-process: each process runs the loop on its own rows, inside generation.independently() (rollout.generate).
The generator backends run locally (fast / transformers sample from an unsharded module — with fsdp its full
replica —, vLLM colocate has one engine per process) or each process on its own (vLLM server mode sends each
process's requests), so a process whose rows finished earlier makes no further generator call and no collective is
left unmatched; a tensor-parallel vLLM engine, collective over its group, has a finished process join the group's
remaining calls when it leaves independently().
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from groupwise.agents.execution import run_tool_calls
from groupwise.agents.parsing import assistant_message, parse_response, prepare_tokenizer
from groupwise.agents.tools import Toolbox, with_observation
from groupwise.config_base import ConfigError, warn_user
from groupwise.data import PromptData
from groupwise.text import is_conversational, pad_rows

# generate(prompt_ids (n, P) left-padded, prompt_mask (n, P), max_new_tokens=None) -> groupwise.generation.Generated
Sample = Callable[..., Any]


@dataclass
class Turns:
    """The multi-turn rollouts of N rows, ragged (see the module docstring)."""

    prompts: list[list[dict]]  # (N) chat prompts as generated from (reset observations appended)
    prompt_ids: list[list[int]]  # (N) the rendered prompts, tools listed
    completion_ids: list[list[int]]  # (N) model and tool tokens interleaved
    tool_mask: list[list[int]]  # (N) 1 model token, 0 tool / environment token
    logprobs: list[list[float]] | None  # (N) the sampler's log-probs, 0.0 on tool tokens (when asked for)
    completions: list[list[dict]]  # (N) messages: assistant, tool…, assistant, …
    turn_ends: list[list[int]]  # (N)[K] index in completion_ids of each model turn's last token
    truncated: list[bool]  # (N) the completion does not end with an EOS
    environments: list[Any] | None  # (N) the rollouts' environment instances
    tool_calls: list[int]  # (N) tool calls made
    tool_failures: list[int]  # (N) of which failed (exception, unknown tool, unsupported call, timeout)
    tool_timeouts: list[int]  # (N) of which timed out


class Agent:
    """The tool loop for one run: a Toolbox, the policy's tokenizer, and the GRPOConfig fields it reads."""

    def __init__(self, toolbox: Toolbox, tokenizer, *, max_completion_length: int,
                 max_prompt_length: int | None = None, max_tool_calling_iterations: int | None = None,
                 tool_timeout: float | None = 30.0, chat_template: str | None = None,
                 chat_template_kwargs: dict | None = None, max_model_len: int | None = None,
                 truncate_prompt: str = "left"):
        self.toolbox, self.tokenizer = toolbox, tokenizer
        self.truncate_prompt, self._cut_warned = truncate_prompt, False
        self._longest_token: int | None = None  # the longest token's text, in characters (_cannot_fit)
        self.max_completion_length, self.max_prompt_length = max_completion_length, max_prompt_length
        self.max_iterations = sys.maxsize if max_tool_calling_iterations is None else max_tool_calling_iterations
        self.tool_timeout = tool_timeout
        self.chat_template, self.chat_template_kwargs = chat_template, dict(chat_template_kwargs or {})
        self.max_model_len = max_model_len  # vLLM's max_model_len when set; else the model's positions

    @classmethod
    def from_config(cls, toolbox: Toolbox, tokenizer, args) -> "Agent":
        """Checks the tokenizer (groupwise.agents.parsing.prepare_tokenizer) and that a tool result's tokens can be
        cut out of the chat template, before any model loads. Environments without tool methods (reset /
        get_reward only) run one turn and ask neither of the tokenizer (TRL 1.16 asks a tool-capable template of every
        environment_factory)."""
        tools = toolbox.has_tools
        agent = cls(toolbox, tokenizer, max_completion_length=args.max_completion_length,
                    max_prompt_length=args.max_prompt_length,
                    max_tool_calling_iterations=args.max_tool_calling_iterations, tool_timeout=args.tool_timeout,
                    chat_template=prepare_tokenizer(tokenizer) if tools else None,
                    chat_template_kwargs=args.chat_template_kwargs,
                    # the colocated engine's context (TRL; a server's is its own: max_position_embeddings, as TRL)
                    max_model_len=args.vllm_max_model_length if args.use_vllm and args.vllm_mode == "colocate"
                    else None, truncate_prompt=args.truncate_prompt)
        if not tools:
            return agent
        agent.check_room_for_tools()
        try:
            agent.tool_suffix_ids([{"role": "tool", "name": "dummy", "content": "dummy"}])
        except ValueError as e:
            raise ConfigError(f"tools: {e} The chat template must end each turn with tokenizer.eos_token "
                              f"({tokenizer.eos_token!r}) and render earlier turns the same whatever follows") from None
        return agent

    # ---- rendering --------------------------------------------------------------------------------------------------
    def _template(self, messages: list[dict], **kwargs) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                                  chat_template=self.chat_template, **kwargs,
                                                  **self.chat_template_kwargs)

    def render_prompt(self, prompt: list[dict], schemas: list[dict]) -> list[int]:
        """The prompt rendered with its tools' schemas, its last max_prompt_length tokens kept. The dataset's check
        (truncate_prompt) measures prompts without the schemas, which the chat template writes first: a cut here
        loses the tool descriptions, so it is an error under truncate_prompt='error' and a warning (once) under
        'left'."""
        ids = self._template(prompt, tools=schemas or None, add_generation_prompt=True)  # None: not [] (TRL)
        limit = self.max_prompt_length
        if limit is not None and len(ids) > limit:
            where = (f"a prompt rendered with its tools' schemas is {len(ids)} tokens, over max_prompt_length={limit}"
                     f" ({prompt!r:.80})")
            if self.truncate_prompt == "error":
                raise ConfigError(f"{where}: truncate_prompt='error'. Raise max_prompt_length (the schemas count), "
                                  "or set it to None")
            if not self._cut_warned:
                self._cut_warned = True
                warn_user(f"{where}: its first {len(ids) - limit} tokens are cut, where the chat template writes the "
                          "tools' descriptions. Raise max_prompt_length (the schemas count), or set it to None")
            ids = ids[-limit:]
        if not ids:
            raise ValueError(f"a prompt encodes to zero tokens: {prompt!r:.200}")
        return list(ids)

    def _cannot_fit(self, messages: list[dict], room: int) -> bool:
        """Do these tool messages' contents hold more characters than `room` tokens can: room × the longest token's
        text (every token, special ones included, covers at most that many characters)? Then the row is overlong
        whatever the chat template adds, and the messages need not be rendered and tokenized."""
        if self._longest_token is None:
            tok = self.tokenizer
            words = tok.convert_ids_to_tokens(list(range(len(tok))))
            self._longest_token = max([len(w) for w in words if w] + [len(t) for t in tok.all_special_tokens] + [1])
        chars = 0
        for message in messages:
            content = message.get("content")
            blocks = content if isinstance(content, list) else [content]
            chars += sum(len(b.get("text") or "") if isinstance(b, dict) else len(str(b)) for b in blocks)
        return chars > max(room, 0) * self._longest_token

    def check_room_for_tools(self) -> None:
        """Before training: the tools' schemas with an empty user message must fit max_prompt_length, else every
        prompt would lose (part of) them."""
        if self.max_prompt_length is None:
            return
        for name, schemas in self.toolbox.schemas.items():
            if not schemas:
                continue
            n = len(self._template([{"role": "user", "content": ""}], tools=schemas, add_generation_prompt=True))
            if n >= self.max_prompt_length:
                whose = f"environment {name!r}'s tool schemas" if name is not None else "the tools' schemas"
                raise ConfigError(f"max_prompt_length={self.max_prompt_length} leaves no room for a prompt: the chat "
                                  f"template writes {whose} in {n} tokens before it, and every prompt would "
                                  f"lose them. Raise max_prompt_length above {n}, or set it to None")

    def tool_suffix_ids(self, tool_messages: list[dict]) -> list[int]:
        """The tokens the chat template puts after an assistant turn for these tool messages, up to and including the
        next assistant header (TRL's `_get_tool_suffix_ids`): rendered after a dummy tool-calling exchange, whose
        rendering (trimmed after its last EOS) must be a token prefix."""
        calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
        dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
        prefix = list(self._template(dummy, add_generation_prompt=False))
        full = list(self._template(dummy + tool_messages, add_generation_prompt=True))
        ends = [i for i, t in enumerate(prefix) if t == self.tokenizer.eos_token_id]
        if ends:
            prefix = prefix[:ends[-1] + 1]
        if full[:len(prefix)] != prefix:
            raise ValueError("Unexpected tokenization: the EOS-trimmed prefix IDs are not a prefix of the full IDs.")
        return full[len(prefix):]

    # ---- the loop ---------------------------------------------------------------------------------------------------
    def _sample(self, sample: Sample, prompts: list[list[int]], eos: set[int], limit: int | None = None
                ) -> tuple[list[list[int]], list[list[float]] | None]:
        """One generator call for these prompts (left-padded): each completion up to and including its first EOS,
        at most `limit` (default max_completion_length) tokens, with its log-probs when the sampler returned them."""
        ids, mask = pad_rows(prompts, self.tokenizer.pad_token_id, side="left")
        out = sample(ids, mask) if limit is None else sample(ids, mask, max_new_tokens=limit)
        limit = self.max_completion_length if limit is None else limit
        rows = out.completion_ids.tolist()
        lps = out.logprobs.float().tolist() if out.logprobs is not None else None
        lengths = out.lengths.tolist() if out.lengths is not None else [len(row) for row in rows]
        cut_ids, cut_lps = [], []
        for i, row in enumerate(rows):
            row = row[:lengths[i]]  # a row the backend ended early (a stop string) is padded past its length
            n = next((t + 1 for t, token in enumerate(row) if token in eos), len(row))
            n = min(n, limit)
            cut_ids.append(row[:n])
            cut_lps.append(lps[i][:n] if lps is not None else None)
        return cut_ids, (cut_lps if lps is not None else None)

    def _next_turns(self, sample: Sample, extended: dict[int, list[int]], prompt_ids: list[list[int]],
                    positions: int | None, eos: set[int]) -> dict[int, tuple[list[int], list[float] | None]]:
        """The next turn of each row going on ({row: its ids so far}): row i may take cap_i = min(its budget left of
        max_completion_length, its positions left) tokens. One call serves every row whose cap fits under the
        tightest positions left (the usual case: all rows, limited to the largest cap); rows whose caps do not fit
        go in further calls. No row runs past its positions, none is cut below its cap. {row: (ids, log-probs)};
        rows without budget are left out (their turn is empty)."""
        caps, rooms = {}, {}
        for i, ids in extended.items():
            budget = self.max_completion_length - (len(ids) - len(prompt_ids[i]))
            rooms[i] = budget if positions is None else positions - len(ids)
            caps[i] = min(budget, rooms[i])
        pending, out = [i for i in extended if caps[i] > 0], {}
        while pending:
            floor = min(rooms[i] for i in pending)  # no row of the call may run past its positions
            group = [i for i in pending if caps[i] <= floor]  # holds the row of the tightest room
            ids, lps = self._sample(sample, [extended[i] for i in group], eos, max(caps[i] for i in group))
            out.update({i: (ids[k], None if lps is None else lps[k]) for k, i in enumerate(group)})
            pending = [i for i in pending if i not in out]
        return out

    def _positions(self, model) -> int | None:
        if self.max_model_len is not None:
            return self.max_model_len
        config = getattr(model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return getattr(text, "max_position_embeddings", None)

    def rollout(self, model, rows: list[dict[str, Any]], sample: Sample, eos_token_ids: list[int]) -> Turns:
        """Run the loop on N rows (see the module docstring); `sample` is the generator on the policy; a turn ends
        at its first token in `eos_token_ids`."""
        tok, N, eos = self.tokenizer, len(rows), set(eos_token_ids)
        for i, row in enumerate(rows):
            if not is_conversational(row["prompt"]):
                raise ConfigError(f"tools need conversational prompts (lists of {{'role', 'content'}} messages); row "
                                  f"{i} has {row['prompt']!r:.80}: wrap it as [{{'role': 'user', 'content': …}}]")
        threaded = self.tool_timeout is not None  # each instance's reset, tools, … on its own thread
        envs, names, observations = self.toolbox.start(rows, threaded=threaded)
        prompts = [with_observation(r["prompt"], obs) for r, obs in zip(rows, observations)]
        schemas = [self.toolbox.schemas[name] for name in names]
        tools = [self.toolbox.tools_of(env) for env in envs] if envs is not None else [self.toolbox.tools_of(None)] * N
        threads = [self.toolbox.threads_of(env) for env in (envs if envs is not None else [None] * N)] \
            if threaded else [None] * N
        rendered: dict[str, list[int]] = {}  # a group's G rows share one prompt: render it once
        prompt_ids = []
        for p, s, name in zip(prompts, schemas, names):
            key = json.dumps([name, p], default=str, sort_keys=True)
            if key not in rendered:
                rendered[key] = self.render_prompt(p, s)
            prompt_ids.append(rendered[key])
        completion_ids, logprobs = self._sample(sample, prompt_ids, eos)
        tool_mask = [[1] * len(ids) for ids in completion_ids]
        completions = [[assistant_message(tok, ids, prompt_ids[i], schemas[i] or None)]
                       for i, ids in enumerate(completion_ids)]
        turn_ends = [[len(ids) - 1] if ids else [] for ids in completion_ids]
        for i, ids in enumerate(completion_ids):
            if ids and envs is not None:  # the environment's turn 1 (a step: it has a turn end)
                self.toolbox.start_turn(envs[i], completions[i][-1])
        calls, failures, timeouts = [0] * N, [0] * N, [0] * N
        positions = self._positions(model)
        active = [i for i in range(N) if completions[i][-1].get("tool_calls")] if self.toolbox.has_tools else []
        iteration = 0
        while active and iteration < self.max_iterations:
            extended: dict[int, list[int]] = {}  # row → prompt + completion + tool suffix, for the rows that go on
            for i in active:
                done = run_tool_calls(completions[i][-1]["tool_calls"], tools[i], self.tool_timeout, threads[i])
                calls[i] += done.calls
                failures[i] += done.failures
                timeouts[i] += done.timeouts
                if envs is not None and any(getattr(fn, "__self__", None) is envs[i] for fn in done.timed_out):
                    self.toolbox.timed_out.add(id(envs[i]))  # one of its own methods: its rewards are left unscored
                if self._cannot_fit(done.messages, self.max_completion_length - len(completion_ids[i])):
                    continue  # overlong, known without rendering it (a 10 MB result took 12 s and 2 GB to render)
                ids = prompt_ids[i] + completion_ids[i] + self.tool_suffix_ids(done.messages)
                if (len(ids) - len(prompt_ids[i]) > self.max_completion_length
                        or (positions is not None and len(ids) >= positions)):
                    continue  # overlong: the tool results are dropped and the row leaves the loop (TRL)
                completions[i].extend(done.messages)
                extended[i] = ids
            if not extended:
                break
            turns = self._next_turns(sample, extended, prompt_ids, positions, eos)
            active = []
            for i in extended:
                ids, P = extended[i], len(prompt_ids[i])
                new, new_lps = turns.get(i, ([], []))
                post = new[:max(0, self.max_completion_length - (len(ids) - P))]  # the budget left
                suffix = len(ids) - P - len(completion_ids[i])
                tool_mask[i] += [0] * suffix + [1] * len(post)
                if logprobs is not None:
                    logprobs[i] += [0.0] * suffix + new_lps[:len(post)]
                completion_ids[i] = ids[P:] + post
                if post:  # a turn cut to nothing adds no message (TRL)
                    message = parse_response(tok, post, ids, schemas[i] or None)
                    completions[i].append(message)
                    turn_ends[i].append(len(completion_ids[i]) - 1)
                    if envs is not None:  # before this turn's calls run, in the next round
                        self.toolbox.start_turn(envs[i], message)
                    if message.get("tool_calls"):
                        active.append(i)
            iteration += 1
        truncated = [not ids or ids[-1] not in eos for ids in completion_ids]
        return Turns(prompts, prompt_ids, completion_ids, tool_mask, logprobs, completions, turn_ends, truncated,
                     envs, calls, failures, timeouts)


def build_agent(toolbox: Toolbox | None, tokenizer, args, datasets=()) -> Agent | None:
    """The run's Agent (None without tools or environments), checked before any model loads: the tokenizer
    (Agent.from_config) and the first prompt of each dataset given (tools need conversational prompts; rows of a
    stream are checked as they are read)."""
    if toolbox is None:
        return None
    for data in datasets:
        if isinstance(data, PromptData):  # a StreamData is checked row by row, in rollout()
            first = data[0]["prompt"]
            if not is_conversational(first):
                raise ConfigError(f"tools need conversational prompts (lists of {{'role', 'content'}} messages); "
                                  f"{data.name} row 0 has {first!r:.80}: wrap each prompt as "
                                  "[{'role': 'user', 'content': prompt}]")
    return Agent.from_config(toolbox, tokenizer, args)
