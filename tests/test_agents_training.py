"""Tools in training: tool tokens are left out of the loss, its gradient, the entropy and the KL (compared with the
formula on the model tokens alone), and GRPOTrainer trains with tools and with an environment on a real tiny model."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from groupwise import GRPOConfig, GRPOTrainer
from groupwise import rollout as R
from groupwise.core.losses import policy_loss
from groupwise.distributed import Distributed
from groupwise.modeling import PolicyForLogps
from groupwise.tasks import toy
from groupwise.types import Round
from groupwise.update import UpdateContext, micro_batch_loss
from tests.agents_support import TOKENIZER, Opening, call, context, multiply, two_calls, user
from tests.conftest import training_lines


def _grads(model) -> torch.Tensor:
    out = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return out


def test_tool_tokens_are_left_out_of_the_loss_gradient_entropy_and_kl():
    ctx, _ = context(two_calls, loss_type="dr_grpo", beta=0.1)  # a token sum: every token counts
    comp = R.generate(ctx, None, [{"prompt": user("What is 3*4+1?")}, {"prompt": user("no tools")}])
    torch.manual_seed(0)
    device = comp.completion_ids.device  # the rollout's device (CUDA where there is one)
    model = toy.build_model(TOKENIZER, seed=0, hidden_size=32, num_layers=1, max_positions=512).to(device)
    policy = PolicyForLogps(model)
    update = UpdateContext(ctx.args, Distributed(), policy, None, None)
    adv = torch.tensor([1.0, -0.5], device=device)
    T = comp.completion_ids.size(1)
    ref = (-5.0 + 0.1 * torch.randn(2, T)).to(device)  # some reference log-probs: the KL is not 0

    def loss_of(c):
        batch = dataclasses.replace(R.build_batch(ctx, Round(c, adv, torch.zeros(2), None, None, None), None),
                                    ref_logps=ref)
        loss, _, _, metrics = micro_batch_loss(update, batch, None)
        loss.backward()
        return loss.detach(), _grads(model), metrics

    loss, grads, metrics = loss_of(comp)
    # by hand: row 0 is 90 model tokens, 22 tool tokens, 71 model, 22 tool, 18 model; row 1 is 14 model tokens
    hand = comp.completion_mask.clone().float()
    hand[0, 90:112] = 0
    hand[0, 183:205] = 0
    assert hand.sum() == 90 + 71 + 18 + 14
    input_ids = torch.cat([comp.prompt_ids, comp.completion_ids], 1)
    attention = torch.cat([comp.prompt_mask, comp.completion_mask], 1)  # tool tokens stay visible as context
    logps, entropy = policy(input_ids, attention, T, compute_entropy=True)
    want, want_metrics = policy_loss(logps, logps.detach(), adv, hand, loss_type="dr_grpo", beta=0.1, ref_logps=ref,
                                     max_completion_length=ctx.args.max_completion_length)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grads, _grads(model), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(metrics["kl"], want_metrics["kl"])
    torch.testing.assert_close(metrics["entropy"], (entropy.detach() * hand).sum() / hand.sum())
    # the same rollout without its tool mask trains on the tool tokens: a different loss and gradient
    dropped, dropped_grads, dropped_metrics = loss_of(dataclasses.replace(comp, tool_mask=None))
    assert abs(float(dropped - loss)) > 0.02 and not torch.allclose(dropped_grads, grads)
    assert abs(float(dropped_metrics["kl"] - metrics["kl"])) > 1e-4


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), num_generations=2, per_device_train_batch_size=4,
                max_completion_length=120, max_steps=2, learning_rate=1e-3, logging_steps=1, save_steps=0, seed=0,
                max_tool_calling_iterations=2, beta=0.04, log_completions=False)
    return GRPOConfig(**{**base, **kw})


@pytest.mark.parametrize("backend", ["fast", "transformers"])
def test_later_tool_turns_stay_within_learned_position_embeddings(tmp_path, backend):
    """GPT-2 has a position embedding table of n_positions rows, nothing past it. Here prompt +
    max_completion_length fits (the run's check), but a later turn starts after the first turn and the tool tokens:
    asked for max_completion_length more tokens (TRL), both backends indexed past the table (IndexError). Each later
    turn asks for what is left, so the step trains."""
    from transformers import GPT2Config, GPT2LMHeadModel, utils

    schema = [utils.get_json_schema(multiply)]
    P = max(len(TOKENIZER.apply_chat_template(user(f"What is 3*4? ({i})"), tools=schema, add_generation_prompt=True,
                                              tokenize=True, return_dict=False)) for i in range(2))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(TOKENIZER), n_positions=P + 120 + 2, n_embd=32, n_layer=1,
                                       n_head=2, eos_token_id=TOKENIZER.eos_token_id,
                                       pad_token_id=TOKENIZER.pad_token_id, bos_token_id=TOKENIZER.eos_token_id))
    trainer = GRPOTrainer(model, lambda completions, **_: [float(len(c)) for c in completions],
                          args=_args(tmp_path, max_steps=1, per_device_train_batch_size=2, generation_backend=backend),
                          processing_class=TOKENIZER, tools=[multiply],
                          train_dataset=[{"prompt": user(f"What is 3*4? ({i})")} for i in range(2)])
    gen = Opening(trainer.rollout_ctx.generator, lambda p: call("multiply", a=3, b=4) + "<|im_end|>")
    trainer.rollout_ctx = dataclasses.replace(trainer.rollout_ctx, generator=gen)
    trainer.train()
    assert gen.calls == [("script", 2), ("model", 2)]  # the later turn was sampled by the model
    assert trainer.state.global_step == 1


def test_grpo_trainer_trains_with_tools_on_a_real_tiny_model(tmp_path):
    seen = []

    def final_answer(completions, **_):  # TRL's reward on the final answer
        seen.extend(completions)
        return [float("12" in c[-1]["content"]) for c in completions]

    model = toy.build_model(TOKENIZER, seed=0, hidden_size=32, max_positions=1024)
    trainer = GRPOTrainer(model, final_answer, args=_args(tmp_path), processing_class=TOKENIZER,
                          train_dataset=[{"prompt": user(f"What is 3*4? ({i})")} for i in range(4)], tools=[multiply])
    gen = Opening(trainer.rollout_ctx.generator, lambda p: call("multiply", a=3, b=4) + "<|im_end|>")
    trainer.rollout_ctx = dataclasses.replace(trainer.rollout_ctx, generator=gen)
    trainer.train()
    assert gen.calls == [("script", 4), ("model", 4)] * 2  # one call per turn, all rows together
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and all(h["tools/call_frequency"] == 1.0 for h in logged)
    assert all(h["tools/failure_frequency"] == 0.0 and torch.isfinite(torch.tensor(h["loss"])) for h in logged)
    assert all([m["role"] for m in c[:2]] == ["assistant", "tool"] and c[1]["content"] == "12" for c in seen)
    rows = [json.loads(x) for x in (tmp_path / "out" / "completions.jsonl").read_text().splitlines()]
    assert rows[0]["completion"][1] == {"role": "tool", "name": "multiply", "content": "12"}
    # the batch it trained on: tool tokens masked out of the loss, kept in the attention
    rollout = trainer._collect()
    comp = rollout.round.completions
    assert torch.equal(rollout.batch.completion_mask, comp.completion_mask * comp.tool_mask)
    assert (comp.tool_mask == 0).logical_and(comp.completion_mask == 1).sum() == 4 * 22


class IncrementEnv:  # TRL's documented environment (grpo_trainer.md, "Environments"), verbatim but the comments
    def reset(self, **kwargs) -> str | None:
        self.counter = 0
        self.target = random.randint(1, 6)
        return f"Increment the counter by {self.target}."

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


def test_an_environment_owns_the_data_and_the_reward_without_a_dataset(tmp_path):
    model = toy.build_model(TOKENIZER, seed=0, hidden_size=32, max_positions=1024)
    eval_rows = [{"level": 1}, {"level": 2}]  # no prompt: the environment's reset() supplies it (TRL), in eval too
    trainer = GRPOTrainer(model, args=_args(tmp_path), processing_class=TOKENIZER, environment_factory=IncrementEnv,
                          eval_dataset=eval_rows)
    assert [s.name for s in trainer.reward_sources] == ["IncrementEnv"]
    opening = lambda p: call("increment", step=int(p.split("counter by ")[1][0])) + "<|im_end|>"  # noqa: E731
    trainer.rollout_ctx = dataclasses.replace(trainer.rollout_ctx,
                                              generator=Opening(trainer.rollout_ctx.generator, opening))
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["rewards/IncrementEnv/mean"] for h in logged] == [1.0, 1.0]  # get_reward, weight 1
    assert all(h["tools/call_frequency"] == 1.0 for h in logged)
    assert trainer.evaluate()["eval_rewards/IncrementEnv/mean"] == 1.0
    assert trainer.evaluate(eval_dataset=eval_rows[:1])["eval_rewards/IncrementEnv/mean"] == 1.0


class GuessEnv:  # an environment without tool methods: it sets the task and scores the answer
    def reset(self, **kwargs) -> str:
        self.letter = kwargs["letter"]
        return f" Write the letter {self.letter}."

    def get_reward(self) -> float:
        return 1.0


def test_an_environment_without_tools_asks_nothing_of_the_tokenizer(tmp_path):
    """TRL decodes such rollouts as text: a chat template that cannot render tool calls (and no response_template)
    still trains; each completion is one assistant message, scored by get_reward and the reward functions."""
    tokenizer = toy.build_chat_tokenizer()  # no tool support, no response_template
    seen = []

    def record(completions, **_):
        seen.extend(completions)
        return [0.0] * len(completions)

    data = [{"prompt": [{"role": "user", "content": "hi"}], "letter": c} for c in "abcd"]
    trainer = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [record], processing_class=tokenizer,
                          args=_args(tmp_path, max_completion_length=6, max_steps=1), train_dataset=data,
                          environment_factory=GuessEnv)
    trainer.train()
    assert len(seen) == 4 and all(len(c) == 1 and c[0]["role"] == "assistant" and isinstance(c[0]["content"], str)
                                  for c in seen)
    line = next(h for h in trainer.state.log_history if "loss" in h)
    assert line["rewards/GuessEnv/mean"] == 1.0 and "tools/call_frequency" not in line  # TRL: no tools, no tools/*


def test_trainer_arguments_are_checked_before_the_model_loads(tmp_path):
    def undocumented(a: int) -> int:
        return a

    from groupwise.config_base import ConfigError

    with pytest.raises(ConfigError, match="cannot be described to the model"):
        GRPOTrainer("does/not/exist", lambda completions, **_: [0.0], args=_args(tmp_path), tools=[undocumented],
                    train_dataset=[{"prompt": user("x")}])
    with pytest.raises(ConfigError, match="set max_steps"):
        GRPOTrainer("does/not/exist", args=_args(tmp_path, max_steps=-1), environment_factory=IncrementEnv)
    model = toy.build_model(TOKENIZER, seed=0, hidden_size=32)
    with pytest.raises(ConfigError, match="train_dataset row 0 has 'a string'"):
        GRPOTrainer(model, lambda completions, **_: [0.0], args=_args(tmp_path), processing_class=TOKENIZER,
                    tools=[multiply], train_dataset=[{"prompt": "a string"}])


@pytest.mark.slow
def test_two_processes_run_their_own_tool_loops_and_sum_the_tool_metrics(tmp_path):
    """Rank 0's rows call tools (two rounds), rank 1's do not: rank 1 makes one generator call per round, rank 0
    three, and nothing waits on a collective; tools/* are over both processes' rollouts."""
    from pathlib import Path

    from tests.launcher import torchrun

    proc = torchrun(Path(__file__).with_name("agents_dist_worker.py"), tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    calls = [json.loads((tmp_path / f"result_{r}.json").read_text())["calls"] for r in (0, 1)]
    assert calls == [[2, 2, 2] * 2, [2] * 2]
    lines = [json.loads(x) for x in training_lines(tmp_path / "metrics.jsonl")]
    # 2 rollouts × 2 calls on rank 0, none on rank 1: 4 calls over 4 rollouts, the 2 calls to 'nope' failed
    assert [(x["tools/call_frequency"], x["tools/failure_frequency"]) for x in lines] == [(1.0, 0.5)] * 2


def test_an_environment_failing_on_one_process_stops_both_at_once(tmp_path):
    """Process 1's environment reset raises in round 2: process 0 used to go on to the next collective and wait
    there until ddp_timeout (120 s in the worker; 1800 s by default). Both stop within seconds, process 0 naming
    process 1's error."""
    import time
    from pathlib import Path

    from tests.launcher import torchrun

    start = time.monotonic()
    proc = torchrun(Path(__file__).with_name("agents_dist_worker.py"), tmp_path, "fails")
    assert proc.returncode != 0
    assert time.monotonic() - start < 90
    assert "the tool / environment rollout failed on another process: RuntimeError: environment service " \
           "unreachable" in proc.stderr, proc.stderr[-3000:]
