"""Tools and environments as TRL 1.16 discovers them (`GRPOTrainer(tools=…, environment_factory=…)`).

- `tools`: plain functions (sync or `async def`) with type hints and a Google-style docstring; the model sees their
  JSON schema (transformers' `get_json_schema`, called here once per tool so a missing hint or docstring is an error
  at init, naming the tool).
- `environment_factory`: a callable returning an environment (one instance per rollout), or a dict {name: factory}
  whose dataset rows pick theirs by an `environment` column. An environment has `reset(**row) -> str | None` (the row
  of the rollout, `prompt` included; a train_dataset row may lack it, as in TRL: its prompt is then an empty user
  turn, not passed to reset; a returned string is appended to the last user message), optionally
  `get_reward() -> float` (then a reward source named after its class, weight 1), optionally
  `get_step_rewards() -> list[float]`, one reward per assistant turn in order (a groupwise addition: then a process
  reward source named `<class>.get_step_rewards`, weight 1, read with step_split="turn"), optionally `start_turn()`
  (a groupwise addition: called once per assistant turn, in order, before that turn's tool calls run — so an
  environment knows which turn a call belongs to, and that a turn happened whose calls never reached it), and every
  other public method
  (plain functions on the class, sorted by name; `_`-prefixed ones skipped) is a tool bound to that rollout's
  instance. Each factory is called once at init (the probe: checks `reset`, lists the methods, seeds the pool);
  instances are pooled and reset, not re-created, from one generation batch to the next. Reward sources are one per
  environment class (by type); a class whose name another one already has gets a suffix (`Env_2`).

With a tool timeout, each instance has a thread of its own (groupwise.agents.execution.ToolThread) on which its
reset(), its tools, start_turn, get_reward and get_step_rewards all run, so thread-bound resources made in reset()
(a sqlite3 connection, …) work; the standalone tools share one such thread. Without one (tool_timeout=None), all of
them run on the caller's thread.

A row's tools: the standalone tools first, then its environment's methods (TRL's order; the prompt lists their
schemas in that order; by name, the last of two tools sharing a name wins).
"""

from __future__ import annotations

import copy
import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

from groupwise.agents.execution import ToolThread
from groupwise.config_base import ConfigError
from groupwise.data import NON_TEXT, EmptyPrompt, EnvironmentPrompts, is_stream, non_text_block
from groupwise.rewards.calls import run_async
from groupwise.rewards.sources import RewardSource

RESERVED = ("reset", "get_reward", "get_step_rewards", "start_turn")


def tool_schema(fn: Callable, where: str) -> dict:
    """The JSON schema the chat template shows the model (transformers.utils.get_json_schema); a ConfigError naming
    the tool when it cannot be described."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # DocstringParsingException, TypeHintParsingException, …
        raise ConfigError(f"{where}: cannot be described to the model ({type(e).__name__}: {e}); give it a type hint "
                          "on every argument and a Google-style docstring with a description and an Args: section "
                          "(transformers.utils.get_json_schema)") from None


def env_methods(env: Any) -> list[Callable]:
    """The environment's tools: public plain functions of its class, sorted by name, bound to `env` (TRL: listed on
    the class, so properties are not evaluated; reset and get_reward are reserved, and groupwise's RESERVED names)."""
    return [getattr(env, name) for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
            if name not in RESERVED and not name.startswith("_")]


def _timed_out(env: Any, timed_out: set[int], name: str) -> bool:
    """Did a tool call of this rollout time out on `env`? Such a call was abandoned, not stopped: what it does to the
    instance lands after the model was told it failed (or never), so the state get_reward / get_step_rewards read is
    not the one the rollout led to: the rollout is left unscored, with a warning."""
    if id(env) not in timed_out:
        return False
    warnings.warn(f"{name}: a rollout whose tool call timed out is left unscored (the call runs on after the model was "
                  "told it failed, so the environment's state is not the one the rollout led to); raise tool_timeout "
                  "if the tool is merely slow", RuntimeWarning, stacklevel=2)
    return True


def _env_reward(env_type: type, asynchronous: bool, name: str, call_on: Callable, timed_out: set[int]) -> Callable:
    """TRL's reward function for an environment class: `get_reward()` of each rollout whose environment is exactly
    that class (a sync one on the instance's thread: `call_on`), None (unscored) for the others and for a rollout
    whose tool call timed out (`timed_out`: id of its instance)."""
    if asynchronous:
        async def get_reward(environments, **_):
            return [await e.get_reward() if type(e) is env_type and not _timed_out(e, timed_out, name) else None
                    for e in environments]
    else:
        def get_reward(environments, **_):
            return [call_on(e, e.get_reward) if type(e) is env_type and not _timed_out(e, timed_out, name) else None
                    for e in environments]
    get_reward.__name__ = name
    return get_reward


def _env_step_rewards(env_type: type, name: str, call_on: Callable, timed_out: set[int]) -> Callable:
    """A process reward function for an environment class (step_split="turn"): `get_step_rewards()` of each rollout
    whose environment is exactly that class — one reward per assistant turn; when the last turn was cut by the
    length budget and is not scored (score_truncated_step=False), its reward is left out — and None per step for
    the others and for a rollout whose tool call timed out."""
    def get_step_rewards(environments, steps, dropped_last, **_):
        out = []
        for env, row_steps, dropped in zip(environments, steps, dropped_last):
            if type(env) is not env_type or _timed_out(env, timed_out, f"{name}.get_step_rewards"):
                out.append([None] * len(row_steps))
                continue
            values = list(call_on(env, env.get_step_rewards))
            if dropped and len(values) == len(row_steps) + 1:  # the truncated last turn, dropped from the steps
                values = values[:-1]
            out.append(values)  # any other count is an error naming the function (rewards.process._validate)
        return out
    get_step_rewards.__name__ = f"{name}.get_step_rewards"
    return get_step_rewards


def _unique(name: str, taken: set[str]) -> str:
    """`name`, or `name_2`, `name_3`, … when it is taken."""
    k = 2
    unique = name
    while unique in taken:
        unique, k = f"{name}_{k}", k + 1
    return unique


class Toolbox:
    """The run's standalone tools and environments (see the module docstring). `names` are the environment names:
    [None] for a single factory, the dict's keys for several, [] without environments."""

    def __init__(self, tools: list[Callable] | None = None, environment_factory=None):
        if callable(tools) or isinstance(tools, (str, dict)):
            name = getattr(tools, "__name__", type(tools).__name__)
            raise ConfigError(f"tools must be a list of functions, got {name!r} alone: pass tools=[{name}]"
                              if callable(tools) else
                              f"tools must be a list of functions, got a {type(tools).__name__}")
        tools = list(tools or [])
        for i, fn in enumerate(tools):
            if not callable(fn):
                raise ConfigError(f"tools[{i}] is a {type(fn).__name__}, not a function")
        self.standalone = tools
        standalone_schemas = [tool_schema(fn, f"tools[{i}] ({getattr(fn, '__name__', fn)!r})")
                              for i, fn in enumerate(tools)]
        self.multi = isinstance(environment_factory, dict)
        if environment_factory is None:
            factories = {}
        elif self.multi:
            if not environment_factory:
                raise ConfigError("environment_factory is an empty dict: map at least one name to a factory")
            factories = dict(environment_factory)
        else:
            factories = {None: environment_factory}
        self.factories: dict[str | None, Callable] = {}
        self.schemas: dict[str | None, list[dict]] = {None: standalone_schemas} if not factories else {}
        self.pool: dict[str | None, list[Any]] = {}
        self.reward_sources: list[RewardSource] = []
        self.process_sources: list[RewardSource] = []  # get_step_rewards (groupwise), for step_split="turn"
        self.threaded = False  # the last start() ran the environments on their threads (a tool timeout)
        self._threads: dict[int, ToolThread] = {}  # id(instance) → its thread; instances live in the pool
        self.replaced = 0  # pooled instances replaced by new ones: a call given up on still ran on them (start)
        self.timed_out: set[int] = set()  # id() of this rollout's instances a tool call timed out on (unscored)
        self._standalone_thread = ToolThread("groupwise tools")
        class_names: dict[type, str] = {}  # each environment class's name in the reward sources (unique)
        for name, factory in factories.items():
            where = "environment_factory" if name is None else f"environment_factory[{name!r}]"
            if not callable(factory):
                raise ConfigError(f"{where} must be a callable returning an environment (a class, or a function)")
            try:
                env = factory()  # the probe: checked, listed, then the pool's first instance
            except Exception as e:
                e.add_note(f"(raised by {where}, called once when the trainer is built to list the environment's "
                           "tools, as TRL does)")
                raise
            if not callable(getattr(env, "reset", None)):
                raise ConfigError(f"{where}: the environment {type(env).__name__} has no reset() method; define "
                                  "reset(self, **row) returning None or a string appended to the prompt")
            methods = env_methods(env)
            self.schemas[name] = standalone_schemas + [tool_schema(m, f"{where}: {type(env).__name__}.{m.__name__}")
                                                      for m in methods]
            self.factories[name], self.pool[name] = factory, [env]
            cls = type(env)
            if cls in class_names:  # the same class under several names: its rewards are read once
                continue
            class_names[cls] = _unique(cls.__name__, set(class_names.values()))
            if callable(getattr(env, "get_reward", None)):
                fn = _env_reward(cls, inspect.iscoroutinefunction(env.get_reward), class_names[cls], self.call_on,
                                 self.timed_out)
                self.reward_sources.append(RewardSource(name=fn.__name__, fn=fn))
            if callable(getattr(env, "get_step_rewards", None)):
                fn = _env_step_rewards(cls, class_names[cls], self.call_on, self.timed_out)
                self.process_sources.append(RewardSource(name=fn.__name__, fn=fn, takes_dropped_last=True))

    @property
    def has_environments(self) -> bool:
        return bool(self.factories)

    @property
    def has_tools(self) -> bool:
        """Is there any tool at all (standalone, or a method of some environment)? Without one there is no tool loop
        and no tools/* metric (TRL)."""
        return any(self.schemas.values())

    def environment_of(self, row: dict[str, Any], i: int) -> str | None:
        """The environment name a dataset row uses (its `environment` column with several factories)."""
        if not self.multi:
            return None
        return self.check_environment_name(row.get("environment"), f"a dataset row (row {i} of this generation batch)")

    def check_environment_name(self, name: Any, where: str) -> str:
        """The one rule for a row's `environment` value with several factories: a name environment_factory gives."""
        if name not in self.factories:
            raise ConfigError(f"{where} has environment={name!r}, which environment_factory does not name: expected "
                              f"one of {list(self.factories)}")
        return name

    def call_on(self, env: Any, fn: Callable[[], Any]) -> Any:
        """fn() on the environment instance's thread when the last start() was threaded, else here; an `async def`
        method (reset, start_turn, get_step_rewards) is run to completion on the shared event loop of async user code
        (as async tools and reward functions: a client the instance made there in one call works in the next)."""
        def run() -> Any:
            value = fn()
            return run_async(value, None, type(env).__name__) if inspect.isawaitable(value) else value

        thread = self._threads.get(id(env)) if self.threaded else None
        if thread is None:  # not threaded, or not one of the pool's instances
            return run()
        return thread.call(run, None, f"{type(env).__name__}.{getattr(fn, '__name__', 'call')}")

    def start_turn(self, env: Any, message: dict) -> None:
        """The environment's optional start_turn() before an assistant turn's calls run (groupwise's addition to TRL's
        protocol); one that takes an argument gets the turn's tool calls as parsed (the message's `tool_calls`,
        [] for none), calls that will not reach it included (an unknown tool, bad arguments)."""
        fn = getattr(env, "start_turn", None)
        if not callable(fn):
            return
        calls = copy.deepcopy(list(message.get("tool_calls") or []))  # the completions' own stay as parsed
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):  # a callable without a signature: called without arguments
            params = []
        if any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params):
            fn = functools.update_wrapper(functools.partial(fn, calls), fn)
        elif any(p.name == "tool_calls" or p.kind is p.VAR_KEYWORD for p in params):  # start_turn(self, *, tool_calls)
            fn = functools.update_wrapper(functools.partial(fn, tool_calls=calls), fn)
        self.call_on(env, fn)

    def _thread_of(self, env: Any) -> ToolThread:
        return self._threads.setdefault(id(env), ToolThread(f"groupwise {type(env).__name__}"))

    def start(self, rows: list[dict[str, Any]], threaded: bool = False
              ) -> tuple[list[Any] | None, list[str | None], list[Any]]:
        """One environment instance per row (pooled: reused across batches, new ones made only when a batch needs
        more at once), each reset with its row (on the instance's thread when `threaded`: with a tool timeout).
        Returns (instances, or None without environments; each row's environment name; what each reset() returned)."""
        names = [self.environment_of(r, i) for i, r in enumerate(rows)] if self.factories else [None] * len(rows)
        self.threaded = threaded
        self.timed_out.clear()
        if not self.factories:
            return None, names, [None] * len(rows)
        taken: dict[str | None, int] = {}
        envs = []
        for name in names:
            k = taken.get(name, 0)
            while len(self.pool[name]) <= k:
                self.pool[name].append(self.factories[name]())
            env = self.pool[name][k]
            if (thread := self._threads.get(id(env))) is not None and thread.stale:
                # a call its caller gave up on (a timed-out tool or reward) still runs on this instance: what it
                # does would land in this rollout, so the instance is left to it and a new one takes its place
                self._threads.pop(id(env)).abandon()
                env = self.pool[name][k] = self.factories[name]()
                self.replaced += 1
            envs.append(env)
            taken[name] = k + 1
        observations = []
        for env, row in zip(envs, rows):
            kwargs = {k: v for k, v in row.items() if not (k == "environment" and self.multi)
                      and not (k == "prompt" and isinstance(v, EmptyPrompt))}  # TRL: a defaulted prompt is not passed
            if threaded:
                self._thread_of(env)  # its thread from now on: reset, tools, rewards
            observation = self.call_on(env, lambda env=env, kwargs=kwargs: env.reset(**kwargs))
            if observation is not None and not isinstance(observation, (str, list)):
                raise TypeError(f"{type(env).__name__}.reset() returned a {type(observation).__name__}: return None, "
                                "or a string (or a list of content blocks) to append to the prompt's last message")
            observations.append(observation)
        return envs, names, observations

    def tools_of(self, env: Any) -> dict[str, Callable]:
        """A rollout's tools by name: the standalone ones, then its environment's methods bound to its instance."""
        return {getattr(fn, "__name__", repr(fn)): fn for fn in self.standalone + (env_methods(env) if env is not None
                                                                                    else [])}

    def threads_of(self, env: Any) -> dict[str, ToolThread]:
        """The thread each of a rollout's tools runs on (with a tool timeout): its environment's, or the standalone
        tools' (by name, as tools_of)."""
        own = self._thread_of(env) if env is not None else None
        threads = {getattr(fn, "__name__", repr(fn)): self._standalone_thread for fn in self.standalone}
        threads.update({m.__name__: own for m in (env_methods(env) if env is not None else [])})
        return threads

    def placeholder_dataset(self, args, prompts_per_generation: int) -> list[dict[str, Any]]:
        """TRL: without a train_dataset an environment owns the data (its reset() returns the prompt): one
        generation round of empty user prompts, and max_steps says how long to train."""
        if not self.factories:
            raise ConfigError("train_dataset is required unless an environment_factory is given")
        if self.multi:
            raise ConfigError("a dict environment_factory (several environments) needs a train_dataset with an "
                              "'environment' column to route each row; provide one, or pass a single factory")
        if args.max_steps <= 0:
            raise ConfigError("without a train_dataset (the environment's reset() returns the prompt) set max_steps "
                              "to say how long to train")
        return [{"prompt": [{"role": "user", "content": ""}]} for _ in range(prompts_per_generation)]


def with_observation(prompt: list[dict], observation: Any) -> list[dict]:
    """TRL: a string (or list of content blocks) from reset() is appended to the last message's content, as is."""
    if observation is None:
        return prompt
    if (other := non_text_block(observation)) is not None:  # refused, not dropped by the chat template
        raise ConfigError(f"an environment's reset() returned {NON_TEXT.format(other)}: return text (a string, "
                          "or text blocks)")
    last = prompt[-1]
    content = last["content"]
    if isinstance(content, list) and isinstance(observation, str):
        observation = [{"type": "text", "text": observation}]
    elif isinstance(content, str) and isinstance(observation, list):
        content = [{"type": "text", "text": content}]
    return prompt[:-1] + [{**last, "content": content + observation}]


def default_train_dataset(train_dataset, toolbox: Toolbox | None, args, prompts_per_generation: int):
    """train_dataset as given; with environments, marked so that its rows may lack a prompt (TRL 1.16: an empty user
    turn, which reset() completes; groupwise.data.EnvironmentPrompts); when it is None and an environment owns the
    data, TRL's placeholder."""
    if toolbox is not None and toolbox.has_environments and train_dataset is None:
        return toolbox.placeholder_dataset(args, prompts_per_generation)
    return environment_prompts(train_dataset, toolbox)


def environment_prompts(dataset, toolbox: Toolbox | None):
    """A train or eval dataset as given; with environments, marked so that its rows may lack a `prompt` (TRL 1.16
    defaults it for every row it generates from, evaluation included)."""
    if dataset is None or toolbox is None or not toolbox.has_environments:
        return dataset
    return EnvironmentPrompts(dataset, stream=is_stream(dataset))
