"""Process supervision over turns (step_split="turn"): each assistant turn of a multi-turn rollout is a step, scored
by the environment's get_step_rewards() or a step-reward function, and flows through §4.1.3's advantages (or the
step_return form) to the tokens of that turn only."""

from __future__ import annotations

import dataclasses
import itertools
import math
import re

import pytest
import torch

from groupwise import GRPOConfig, GRPOTrainer
from groupwise import rollout as R
from groupwise import trainer as trainer_module
from groupwise.agents import Toolbox
from groupwise.config_base import ConfigError
from groupwise.demo import POLICY_DIR
from groupwise.core.advantages import process_advantages
from groupwise.rewards.steps import StepSplitter
from groupwise.tasks import toy
from tests.agents_support import TOKENIZER, Opening, add, call, context, multiply, two_calls, user

TOOL = "<|im_start|>tool"


class Counter:
    """Count up to the target with increment(step); one step reward per assistant turn: 1 for a call that does not
    overshoot, and for the final turn 1 when the target was reached."""

    def reset(self, target: int = 3, **_) -> None:
        self.counter, self.target, self.turns = 0, target, []

    def increment(self, step: int) -> int:
        """
        Increment the counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The counter.
        """
        self.counter += step
        self.turns.append(float(self.counter <= self.target))
        return self.counter

    def get_step_rewards(self) -> list[float]:
        return self.turns + [float(self.counter == self.target)]

    def get_reward(self) -> float:
        return float(self.counter == self.target)


def counting(prompt: str) -> str:
    """Two increments of 2, then done: right for target 4, overshooting for target 3."""
    return ([call("increment", step=2) + "<|im_end|>"] * 2 + ["done<|im_end|>"])[prompt.count(TOOL)]


def test_turns_are_the_steps_with_their_own_text_and_end():
    """split_turns on the scripted two-call conversation: three steps, the texts of the model's own turns (the tool
    tokens in between belong to no step), ending at turn_ends."""
    ctx, _ = context(two_calls)
    comp = R.generate(ctx, None, [{"prompt": user("What is 3*4+1?")}, {"prompt": user("no tools")}])
    splitter = StepSplitter("turn")
    rows = comp.token_lists()
    steps = splitter.split_turns(rows[0], comp.tool_mask[0].tolist(), comp.turn_ends[0], TOKENIZER, truncated=False)
    assert steps.texts == ('Let me compute.<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</tool_call>',
                           '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 1}}</tool_call>',
                           "The answer is 13.")
    assert steps.ends == tuple(comp.turn_ends[0]) == (89, 182, 222) and not steps.truncated_last
    one = splitter.split_turns(rows[1], comp.tool_mask[1].tolist(), comp.turn_ends[1], TOKENIZER, truncated=False)
    assert one.texts == ("no tools here",) and one.ends == (13,)


@pytest.mark.parametrize("form", ["suffix_sum", "step_return"])
def test_environment_step_rewards_score_each_turn_and_reach_only_that_turns_tokens(form):
    """Targets 4 and 3, both rollouts make the same two calls of +2: step rewards [1, 1, 1] (target 4) and [1, 0, 0]
    (target 3: the second call overshoots and the end misses). The round's advantages are process_advantages of
    those rewards at the turn ends; tool tokens get the value of the turn that follows them, and are masked
    from the loss (tool_mask) anyway."""
    ctx, _ = context(counting, tools=(), environment_factory=Counter, supervision="process", step_split="turn",
                     step_advantage=form, reward_sources=())
    toolbox = Toolbox([], Counter)
    ctx = dataclasses.replace(ctx, process_sources=toolbox.process_sources, splitter=StepSplitter("turn"))
    rows = [{"prompt": user("count to 4"), "target": 4}, {"prompt": user("count to 3"), "target": 3}]
    comp = R.generate(ctx, None, rows)
    s = R.score_steps(ctx, comp)
    assert s.names == ("Counter.get_step_rewards",)
    assert s.rewards == [[[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]]
    assert s.ends == [[comp.turn_ends[0], comp.turn_ends[1]]] and len(comp.turn_ends[0]) == 3
    adv = R.advantages(ctx, comp, None, s).cpu()  # on the run's device (CUDA when there is one)
    want = process_advantages(s.rewards, s.ends, ctx.args.max_completion_length, form=form,
                              **ctx.args.estimator_options())[0][:, :adv.size(1)]
    torch.testing.assert_close(adv, want)
    e = comp.turn_ends[0]
    if form == "step_return":
        # returns-to-go [3, 2, 1] vs [1, 0, 0]: each index a two-value group, z = ±1 (eps aside)
        assert adv[0, 0] == pytest.approx(1, abs=1e-3) and adv[1, e[1]] == pytest.approx(-1, abs=1e-3)
    else:
        # all six rewards: mean 2/3, std sqrt(2)/3; r̃ = 0.7071 (reward 1), −1.4142 (reward 0)
        a, b = (1 / 3) / (math.sqrt(2) / 3), (2 / 3) / (math.sqrt(2) / 3)
        assert float(adv[0, 0]) == pytest.approx(3 * a, abs=1e-3) and float(adv[1, 0]) == pytest.approx(a - 2 * b,
                                                                                                         abs=1e-3)
    assert (adv[:, e[2] + 1:] == 0).all()  # after the last turn: nothing


class AsyncCounter(Counter):
    """Counter with `async def` reset, start_turn and get_step_rewards (its get_reward may be async, TRL's rule: so
    may these); start_turn counts the turns the rewards are then checked against."""

    async def reset(self, target: int = 3, **_) -> None:
        super().reset(target)
        self.started = 0

    async def start_turn(self) -> None:
        self.started += 1

    async def get_step_rewards(self) -> list[float]:
        assert self.started == len(self.turns) + 1  # start_turn ran before every turn (was: never awaited)
        return super().get_step_rewards()


@pytest.mark.parametrize("tool_timeout", [None, 30.0], ids=["here", "on-the-instance-thread"])
def test_async_environment_methods_are_awaited(tool_timeout):
    """The same step rewards as the sync Counter's ([1, 1, 1] for target 4, [1, 0, 0] for 3), with the methods
    `async def`: each is run to completion, on the instance's thread when tool_timeout gives it one."""
    ctx, _ = context(counting, tools=(), environment_factory=AsyncCounter, supervision="process", step_split="turn",
                     tool_timeout=tool_timeout)
    toolbox = ctx.agent.toolbox
    ctx = dataclasses.replace(ctx, process_sources=toolbox.process_sources, splitter=StepSplitter("turn"))
    rows = [{"prompt": user("count to 4"), "target": 4}, {"prompt": user("count to 3"), "target": 3}]
    comp = R.generate(ctx, None, rows)
    assert [e.started for e in comp.columns["environments"]] == [3, 3]
    assert R.score_steps(ctx, comp).rewards == [[[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]]


def test_an_environment_giving_one_reward_too_many_is_an_error_unless_its_last_turn_was_cut():
    """get_step_rewards counts every assistant turn; only a last turn cut by the length budget and left unscored
    (score_truncated_step=False) is dropped from the steps, and its reward with it. An environment that returns one
    reward more than there are turns, with nothing cut, used to lose its last reward silently."""
    from groupwise.rewards import RewardFunctionError

    class OverCounting(Counter):
        def get_step_rewards(self) -> list[float]:
            return super().get_step_rewards() + [1.0]  # 4 rewards for 3 turns

    ctx, _ = context(counting, tools=(), environment_factory=OverCounting, supervision="process", step_split="turn",
                     reward_sources=())
    toolbox = Toolbox([], OverCounting)
    ctx = dataclasses.replace(ctx, process_sources=toolbox.process_sources, splitter=StepSplitter("turn"))
    comp = R.generate(ctx, None, [{"prompt": user("count to 4"), "target": 4}, {"prompt": user("count"), "target": 3}])
    assert not comp.truncated.any()
    with pytest.raises(RewardFunctionError, match="OverCounting.get_step_rewards"):
        R.score_steps(ctx, comp)


def test_a_step_reward_function_scores_turns_too():
    def short_turns(steps, **_):
        return [[1.0 if len(t) < 40 else 0.0 for t in row] for row in steps]

    ctx, _ = context(two_calls, supervision="process", step_split="turn")
    from groupwise.rewards.process import load_process_reward_sources

    ctx = dataclasses.replace(ctx, process_sources=load_process_reward_sources([short_turns]),
                              splitter=StepSplitter("turn"))
    comp = R.generate(ctx, None, [{"prompt": user("What is 3*4+1?")}, {"prompt": user("no tools")}])
    s = R.score_steps(ctx, comp)
    assert s.rewards == [[[0.0, 0.0, 1.0], [1.0]]] and s.texts[1] == ["no tools here"]


def test_step_split_turn_needs_tools_and_is_checked_before_the_model_loads(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), supervision="process", step_split="turn", num_generations=2,
                      per_device_train_batch_size=2)
    with pytest.raises(ConfigError, match="step_split='turn' .* needs multi-turn rollouts, so pass tools= or "
                                          "environment_factory="):
        GRPOTrainer("no/such-model", process_reward_funcs=[lambda steps, **_: [[1.0] * len(s) for s in steps]],
                    args=args, train_dataset=[{"prompt": "x"}])
    # an environment's per-turn rewards read by process supervision need turns as steps
    args = dataclasses.replace(args, step_split="delimiter")
    with pytest.raises(ConfigError, match="Counter.get_step_rewards gives one reward per assistant turn.*set "
                                          "step_split='turn'"):
        GRPOTrainer("no/such-model", args=args, train_dataset=[{"prompt": user("x")}], environment_factory=Counter)
    with pytest.raises(ConfigError, match="step_advantage='paper' is not one of"):
        GRPOConfig(step_advantage="paper")


def test_training_with_per_turn_rewards_from_the_environment(tmp_path):
    """A real tiny model, 2 steps, supervision="both" over turns with step_return: the environment's get_reward
    (outcome) and get_step_rewards (per turn) both reach the logged metrics, and the weights move."""
    model = toy.build_model(TOKENIZER, seed=0, hidden_size=32, max_positions=1024)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=2, per_device_train_batch_size=4,
                      max_completion_length=120, max_steps=2, learning_rate=1e-3, logging_steps=1, save_steps=0,
                      seed=0, max_tool_calling_iterations=2, supervision="both", step_split="turn",
                      step_advantage="step_return", log_completions=False, generation_compile=False)
    data = [{"prompt": user(f"count to {t}"), "target": t} for t in (2, 3, 4, 5)]
    trainer = GRPOTrainer(model, args=args, train_dataset=data, processing_class=TOKENIZER,
                          environment_factory=Counter)
    assert [s.name for s in trainer.process_sources] == ["Counter.get_step_rewards"]
    # the two rollouts of a group open differently: one hits the target (turn reward 1), one overshoots (0), so every
    # group has step-reward spread (nonzero advantages) whatever the model's own random turns do
    rows_seen = itertools.count()

    def opening(prompt):
        target = int(re.search(r"count to (\d+)", prompt).group(1))
        return call("increment", step=target + next(rows_seen) % 2) + "<|im_end|>"

    trainer.rollout_ctx = dataclasses.replace(trainer.rollout_ctx,
                                              generator=Opening(trainer.rollout_ctx.generator, opening))
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2
    for h in logged:  # the scripted call is a turn; the model's own (random) turn is cut by the budget or not
        assert h["process/steps_per_completion"] >= 1 and 0 <= h["process/step_reward_mean"] <= 1
        assert h["process/Counter.get_step_rewards/errors"] == 0 and "rewards/Counter/mean" in h
    assert any(not torch.equal(before[n].cpu(), p.detach().cpu()) for n, p in trainer.unwrapped.named_parameters())


def test_an_environment_with_step_rewards_trains_under_outcome_supervision(tmp_path):
    """get_step_rewards is read only when the supervision variant uses step rewards: with supervision="outcome" the
    environment is accepted and its step rewards are left out."""
    model = toy.build_model(TOKENIZER, seed=0, hidden_size=32, max_positions=1024)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=2, per_device_train_batch_size=2,
                      max_completion_length=60, max_steps=1, save_steps=0, supervision="outcome")
    trainer = GRPOTrainer(model, args=args, train_dataset=[{"prompt": user("count to 2"), "target": 2}],
                          processing_class=TOKENIZER, environment_factory=Counter)
    assert trainer.process_sources == [] and [s.name for s in trainer.reward_sources] == ["Counter"]


def test_a_text_step_split_with_tools_is_refused_naming_step_split_turn(monkeypatch):
    # step_split="delimiter" split the whole completion text: the tool's result became a scored step (in the group
    # statistics) and step ends fell on tool tokens; now refused before any model loads, and at scoring for
    # completions with tool tokens from elsewhere (a rollout_func's env_mask)
    from groupwise.rewards.process import load_process_reward_sources

    step_reward = lambda steps, **_: [[1.0] * len(s) for s in steps]  # noqa: E731
    sources = load_process_reward_sources([step_reward])
    ctx, _ = context(two_calls, supervision="process")  # step_split defaults to a text split
    loaded = []
    monkeypatch.setattr(trainer_module, "load_policy", lambda *a, **k: loaded.append(1) or 1 / 0)
    with pytest.raises(ConfigError, match="step_split='delimiter' splits the completion's text.*set step_split='turn'"):
        GRPOTrainer(str(POLICY_DIR), process_reward_funcs=[step_reward], tools=[multiply, add], args=ctx.args,
                    train_dataset=[{"prompt": user("What is 3*4+1?")}], processing_class=TOKENIZER)
    assert loaded == []  # refused before the model loads
    comp = R.generate(ctx, None, [{"prompt": user("What is 3*4+1?")}, {"prompt": user("no tools")}])
    assert (comp.tool_mask[0] == 0).any()  # the first rollout called tools
    bare = R.RolloutContext(args=ctx.args, tokenizer=TOKENIZER, generator=None, dist=ctx.dist,
                            eos_token_ids=ctx.eos_token_ids, process_sources=sources,
                            splitter=StepSplitter.from_config(ctx.args))  # no agent: tool tokens from a rollout_func
    with pytest.raises(ConfigError, match="step_split='delimiter' splits the completion's text.*set step_split='turn'"):
        R.score_steps(bare, comp)
    turn = dataclasses.replace(ctx, args=dataclasses.replace(ctx.args, step_split="turn"), process_sources=sources,
                               splitter=StepSplitter("turn"))  # the fix named by the error works
    assert len(R.score_steps(turn, comp).texts[0]) == 3


def test_start_turn_gets_a_copy_of_the_turn_s_calls_in_any_signature():
    """start_turn(self, tool_calls), start_turn(self, *, tool_calls) and start_turn(self) are each called as they
    can take it; an environment editing the calls leaves the parsed message (what reward functions read) as it
    was."""
    message = {"role": "assistant", "tool_calls": [{"type": "function",
                                                    "function": {"name": "add", "arguments": {"a": 1}}}]}
    seen = []

    class Positional:
        def start_turn(self, calls):
            seen.append(("positional", len(calls)))
            calls[0]["function"]["arguments"]["a"] = 99

    class KeywordOnly:
        def start_turn(self, *, tool_calls):
            seen.append(("keyword", len(tool_calls)))

    class Bare:
        def start_turn(self):
            seen.append(("bare", None))

    toolbox = Toolbox()
    for env in (Positional(), KeywordOnly(), Bare()):
        toolbox.start_turn(env, message)
    assert seen == [("positional", 1), ("keyword", 1), ("bare", None)]
    assert message["tool_calls"][0]["function"]["arguments"] == {"a": 1}


def test_the_tool_loops_context_is_vllm_max_model_length_in_colocate_mode_only():
    """vllm_max_model_length sizes the colocated engine (TRL); a server's context is its own, and TRL's tool loop
    then reads max_position_embeddings. The loop read the field in server mode too, where a warning says it has no
    effect."""
    import warnings

    from groupwise.agents import Agent, Toolbox
    from tests.agents_support import TOKENIZER, add

    colocate = GRPOConfig(use_vllm=True, vllm_max_model_length=96, max_completion_length=32)
    assert Agent.from_config(Toolbox([add]), TOKENIZER, colocate).max_model_len == 96
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "has no effect with vllm_mode='server'"
        server = GRPOConfig(use_vllm=True, vllm_mode="server", vllm_max_model_length=96, max_completion_length=32)
    assert Agent.from_config(Toolbox([add]), TOKENIZER, server).max_model_len is None
