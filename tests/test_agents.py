"""Multi-turn rollouts with tools (groupwise.agents) through rollout.generate, the model's turns scripted: the token
layout and tool_mask token by token, tool errors and timeouts, the loop's three ends, environments, batching."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from groupwise import rollout as R
from groupwise.agents import Toolbox
from groupwise.agents.parsing import prepare_tokenizer
from groupwise.config_base import ConfigError
from groupwise.dynamic import select_groups
from groupwise.rollout_metrics import round_metrics
from groupwise.tasks import toy
from groupwise.types import Round
from tests.agents_support import SAMPLING_LOGP, TOKENIZER, call, context, multiply, spans, two_calls, user

TOOL = "<|im_start|>tool"  # a tool turn in the rendered prompt
SUFFIX_12 = "\n<|im_start|>tool\n12<|im_end|>\n<|im_start|>assistant\n"  # the tool tokens after multiply(3, 4)


def ids(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


def _round(comp) -> Round:
    n = comp.completion_ids.size(0)
    return Round(comp, torch.zeros(n), torch.full((n,), float("nan")), None, None, None)


def test_tool_mask_token_by_token_for_a_two_call_conversation():
    ctx, gen = context(two_calls, correct_sampling=True)
    comp = R.generate(ctx, None, [{"prompt": user("What is 3*4+1?")}, {"prompt": user("no tools")}])
    # TRL's trace: model turn, tool result + next assistant header (tool_mask 0), model turn, …
    expected = [(1, 'Let me compute.<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</tool_call>'
                    '<|im_end|>'),
                (0, SUFFIX_12),
                (1, '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 1}}</tool_call><|im_end|>'),
                (0, "\n<|im_start|>tool\n13<|im_end|>\n<|im_start|>assistant\n"),
                (1, "The answer is 13.<|im_end|>")]
    want_ids = [t for _, text in expected for t in ids(text)]
    want_mask = [v for v, text in expected for _ in ids(text)]
    L, T = len(want_ids), comp.completion_ids.size(1)
    assert T == L == 90 + 22 + 71 + 22 + 18
    assert comp.completion_ids[0].tolist() == want_ids
    assert comp.tool_mask[0].tolist() == want_mask
    assert comp.completion_mask[0].tolist() == [1] * L  # every token is context for the forward pass
    assert spans(want_ids, comp.tool_mask[0].tolist()) == expected
    # the row without tools: all model tokens, then padding (0 in both masks)
    assert comp.tool_mask[1].tolist() == [1] * 14 + [0] * (T - 14) == comp.completion_mask[1].tolist()
    assert comp.lengths.tolist() == [90 + 71 + 18, 14]  # generated tokens only (TRL's completion lengths)
    assert comp.turn_ends == [[89, 89 + 22 + 71, L - 1], [13]]
    assert comp.truncated.tolist() == [False, False]
    counts = (comp.tool_calls.tolist(), comp.tool_failures.tolist(), comp.tool_timeouts.tolist())
    assert counts == ([2, 0], [0, 0], [0, 0])
    # the sampler's log-probs: its values on model tokens, 0 on tool tokens and padding (TRL)
    assert comp.sampling_logps[0].tolist() == [SAMPLING_LOGP if m else 0.0 for m in want_mask]
    assert comp.completions[0] == [
        {"role": "assistant", "content": "Let me compute.",
         "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}]},
        {"role": "tool", "name": "multiply", "content": "12"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 1}}}]},
        {"role": "tool", "name": "add", "content": "13"},
        {"role": "assistant", "content": "The answer is 13."}]
    assert comp.completions[1] == [{"role": "assistant", "content": "no tools here"}]
    # the prompt lists the tools' schemas, in the order given; later turns continue each row's own tokens
    assert gen.prompts[0][0].startswith('<|im_start|>system\nTools:{"type": "function", "function": {"name": '
                                        '"multiply", "description": "Multiplies two integers."')
    assert gen.prompts[0][0].index('"name": "multiply"') < gen.prompts[0][0].index('"name": "add"')
    assert gen.prompts[1][0].endswith("What is 3*4+1?<|im_end|>\n<|im_start|>assistant\n" + expected[0][1] + SUFFIX_12)
    assert gen.calls == [2, 1, 1]
    metrics = round_metrics(ctx, _round(comp))
    assert metrics["tools/call_frequency"] == 1.0 and metrics["tools/failure_frequency"] == 0.0
    assert metrics["completions/mean_length"] == (179 + 14) / 2


def test_the_loss_mask_is_completion_mask_times_tool_mask_and_truncation_zeros_it():
    ctx, _ = context(two_calls)
    comp = R.generate(ctx, None, [{"prompt": user("go")}, {"prompt": user("no tools")}])
    batch = R.build_batch(ctx, _round(comp), None)
    assert torch.equal(batch.completion_mask, comp.completion_mask * comp.tool_mask)
    assert batch.completion_mask[0].sum() == 179 and batch.attention_mask[0].sum() == comp.prompt_mask[0].sum() + 223
    cut = R.generate(context(lambda p: "Let me count: 1 2 3 4 5 6", max_completion_length=10,
                             mask_truncated_completions=True)[0], None, [{"prompt": user("go")}])
    assert cut.truncated.tolist() == [True] and cut.tool_mask.tolist() == [[1] * 10]
    assert R.build_batch(context(two_calls, mask_truncated_completions=True)[0], _round(cut), None
                         ).completion_mask.tolist() == [[0] * 10]


def test_a_raising_tool_becomes_an_error_message_counted_as_a_failure_and_the_run_goes_on():
    def broken(x: int) -> int:
        """
        Always fails.

        Args:
            x: Anything.
        """
        raise ValueError("no luck")

    def reply(prompt):
        if TOOL in prompt:
            return "sorry<|im_end|>"
        failing = "<|im_start|>user\nfail" in prompt
        return (call("broken", x=1) if failing else call("multiply", a=3, b=4)) + "<|im_end|>"

    ctx, gen = context(reply, tools=(multiply, broken))
    comp = R.generate(ctx, None, [{"prompt": user("fail")}, {"prompt": user("ok")}])
    assert comp.completions[0][1] == {"role": "tool", "name": "broken", "content": "{'error': 'no luck'}"}
    assert comp.completions[0][2] == {"role": "assistant", "content": "sorry"}  # the conversation continued
    assert comp.completions[1][1] == {"role": "tool", "name": "multiply", "content": "12"}
    assert comp.tool_failures.tolist() == [1, 0] and comp.tool_calls.tolist() == [1, 1]
    metrics = round_metrics(ctx, _round(comp))
    assert metrics["tools/call_frequency"] == 1.0 and metrics["tools/failure_frequency"] == 0.5
    assert metrics["tools/timeout_frequency"] == 0.0


def test_unknown_tools_bad_arguments_and_async_tools():
    async def async_add(a: int, b: int) -> int:
        """
        Asynchronously adds two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        await asyncio.sleep(0.01)
        return a + b

    turn = call("async_add", a=1, b=2) + call("nope") + call("multiply", a=3) + call("multiply", a=2, b=3)
    ctx, _ = context(lambda p: "done<|im_end|>" if TOOL in p else turn + "<|im_end|>", tools=(multiply, async_add),
                     max_completion_length=1000)
    comp = R.generate(ctx, None, [{"prompt": user("go")}])
    # TRL's order: the sync calls (and errors) in call order, then the async results
    assert [m["content"] for m in comp.completions[0][1:5]] == [
        "{'error': 'Tool nope not found.'}",
        "{'error': \"multiply() missing 1 required positional argument: 'b'\"}", "6", "3"]
    assert [m["name"] for m in comp.completions[0][1:5]] == ["nope", "multiply", "multiply", "async_add"]
    assert comp.tool_calls.tolist() == [4] and comp.tool_failures.tolist() == [2]


def test_a_sleeping_tool_times_out_within_the_timeout_and_is_counted():
    def slow(seconds: float) -> str:
        """
        Sleeps.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "awake"

    ctx, _ = context(lambda p: "late<|im_end|>" if TOOL in p else call("slow", seconds=5) + "<|im_end|>",
                     tools=(slow,), tool_timeout=0.3)
    start = time.perf_counter()
    comp = R.generate(ctx, None, [{"prompt": user("go")}])
    assert time.perf_counter() - start < 2.0
    assert comp.completions[0][1] == {"role": "tool", "name": "slow",
                                      "content": "{'error': \"tool 'slow' timed out after 0.3 s\"}"}
    assert comp.completions[0][2]["content"] == "late"
    assert (comp.tool_calls.tolist(), comp.tool_failures.tolist(), comp.tool_timeouts.tolist()) == ([1], [1], [1])
    metrics = round_metrics(ctx, _round(comp))
    assert metrics["tools/failure_frequency"] == 1.0 and metrics["tools/timeout_frequency"] == 1.0


@pytest.mark.parametrize("limit", [0, 1, 2])
def test_the_iteration_limit_counts_tool_rounds_and_leaves_the_last_call_unexecuted(limit):
    ran = []

    def double(a: int) -> int:
        """
        Doubles.

        Args:
            a: A number.
        """
        ran.append(a)
        return 2 * a

    ctx, gen = context(lambda p: call("double", a=p.count(TOOL)) + "<|im_end|>", tools=(double,),
                       max_tool_calling_iterations=limit)
    comp = R.generate(ctx, None, [{"prompt": user("go")}])
    assert gen.calls == [1] * (limit + 1) and ran == list(range(limit)) and comp.tool_calls.tolist() == [limit]
    roles = [m["role"] for m in comp.completions[0]]
    assert roles == ["assistant"] + ["tool", "assistant"] * limit
    assert comp.completions[0][-1]["tool_calls"][0]["function"] == {"name": "double", "arguments": {"a": limit}}
    assert len(comp.turn_ends[0]) == limit + 1 and comp.truncated.tolist() == [False]


def _one_call(answer: str = "The answer is 12.<|im_end|>"):
    first = "Let me compute." + call("multiply", a=3, b=4) + "<|im_end|>"
    return first, (lambda p: answer if TOOL in p else first)


def test_a_post_tool_turn_is_cut_to_what_is_left_of_max_completion_length():
    first, reply = _one_call()
    n1, ns = len(ids(first)), len(ids(SUFFIX_12))
    ctx, _ = context(reply, max_completion_length=n1 + ns + 5)
    comp = R.generate(ctx, None, [{"prompt": user("go")}])
    assert comp.completion_ids.size(1) == n1 + ns + 5 and comp.truncated.tolist() == [True]
    assert comp.tool_mask[0].tolist() == [1] * n1 + [0] * ns + [1] * 5
    assert comp.completions[0][-1] == {"role": "assistant", "content": "The a"}
    assert comp.turn_ends == [[n1 - 1, n1 + ns + 4]]
    # the later turn asks the sampler for what is left (TRL asks for max_completion_length and cuts the rest)
    assert gen_limits(ctx) == [None, 5]
    # cut to nothing: no message is added, and the completion ends inside the tool tokens (truncated); no sampler
    # call is made for a turn with no budget (TRL makes one and cuts it to nothing)
    ctx, gen = context(reply, max_completion_length=n1 + ns)
    comp = R.generate(ctx, None, [{"prompt": user("go")}])
    assert gen.calls == [1] and [m["role"] for m in comp.completions[0]] == ["assistant", "tool"]
    assert comp.tool_mask[0].tolist() == [1] * n1 + [0] * ns and comp.truncated.tolist() == [True]
    assert comp.turn_ends == [[n1 - 1]]


def gen_limits(ctx) -> list:
    return ctx.generator.limits


def test_no_later_turn_runs_past_the_model_s_positions():
    """A model with learned position embeddings has none past max_position_embeddings. A later turn starts from the
    prompt, the earlier turns and the tool tokens, so asking it for the completion's whole budget (TRL) runs past
    them (an IndexError in the position embedding; a device assert on CUDA). Each row may take min(its budget,
    its positions left): the row of the longer prompt is sampled alone with its 3 positions left, the other with
    its own, more; neither is cut below what its positions allow."""
    from types import SimpleNamespace

    first, reply = _one_call("The answer is twelve, computed with the tool.<|im_end|>")
    n1, ns, answer = len(ids(first)), len(ids(SUFFIX_12)), len(ids("The answer is twelve, computed with the tool."))
    rows = [{"prompt": user("go")}, {"prompt": user("go " * 8)}]
    ctx, _ = context(reply, max_completion_length=400)
    P = R.generate(ctx, None, rows).prompt_mask.sum(1).tolist()  # each row's prompt tokens
    assert P[1] - P[0] >= 8
    positions = P[1] + n1 + ns + 3  # the long row has 3 positions left for its second turn
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=positions))
    ctx, gen = context(reply, max_completion_length=400)
    comp = R.generate(ctx, model, rows)
    room_a = positions - (P[0] + n1 + ns)
    assert gen.calls == [2, 1, 1] and gen_limits(ctx) == [None, 3, min(room_a, answer + 1)]
    lengths = comp.completion_mask.sum(1).tolist()
    assert lengths == [n1 + ns + min(room_a, answer + 1), n1 + ns + 3]  # the long row: cut at its positions
    assert all(P[i] + lengths[i] <= positions for i in range(2))
    assert comp.truncated.tolist() == [room_a < answer + 1, True]


def test_an_overlong_tool_result_is_rolled_back_and_the_rollout_leaves_the_loop():
    first, reply = _one_call()
    n1, ns = len(ids(first)), len(ids(SUFFIX_12))
    ctx, gen = context(reply, max_completion_length=n1 + ns - 1)
    comp = R.generate(ctx, None, [{"prompt": user("go")}])
    assert gen.calls == [1]  # nobody left to generate for
    assert comp.completion_ids[0].tolist() == ids(first) and comp.tool_mask[0].tolist() == [1] * n1
    assert [m["role"] for m in comp.completions[0]] == ["assistant"]  # the tool message was removed
    assert comp.completions[0][0]["tool_calls"]  # and the call stays, unexecuted in the record
    assert comp.tool_calls.tolist() == [1] and comp.truncated.tolist() == [False]  # still counted (TRL)


def test_malformed_tool_calls_fall_back_to_plain_text_and_end_the_conversation():
    bad = '<tool_call>{"name": "multiply", "arguments": {"a": 3</tool_call><|im_end|>'
    ctx, gen = context(lambda p: bad)
    comp = R.generate(ctx, None, [{"prompt": user("go")}])
    assert comp.completions[0] == [{"role": "assistant",
                                    "content": '<tool_call>{"name": "multiply", "arguments": {"a": 3</tool_call>'}]
    assert gen.calls == [1] and comp.tool_calls.tolist() == [0]


def test_later_turns_generate_all_active_rows_in_one_call():
    def reply(prompt):  # rows "a" and "b" call a tool; "b" calls a second one; "c" and "d" answer at once
        name = prompt.split("<|im_start|>user\n")[1][0]
        rounds = {"a": 1, "b": 2}.get(name, 0)
        return (call("add", a=1, b=1) if prompt.count(TOOL) < rounds else f"{name} done") + "<|im_end|>"

    ctx, gen = context(reply, num_generations=4, per_device_train_batch_size=4)
    comp = R.generate(ctx, None, [{"prompt": user(x)} for x in "abcd"])
    assert gen.calls == [4, 2, 1]
    assert [p.split("<|im_start|>user\n")[1][0] for p in gen.prompts[1]] == ["a", "b"]  # each with its own history
    assert comp.tool_calls.tolist() == [1, 2, 0, 0]
    assert [c[-1]["content"] for c in comp.completions] == ["a done", "b done", "c done", "d done"]


class CounterEnv:
    """Counts; rewarded when the counter reaches the row's target."""

    def __init__(self):
        self.counter, self.resets = 0, []

    def reset(self, **row) -> str | None:
        self.resets.append(row)
        self.counter, self.target = 0, row["target"]
        return f" (target {row['target']})"

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

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def _helper(self) -> None:  # private: not a tool
        pass


def test_environments_reset_with_the_row_own_their_tools_and_reward():
    from groupwise.rewards import load_reward_sources

    def seen(completions, environments, **_):  # TRL's `environments` keyword
        return [float(e.counter) for e in environments]

    ctx, gen = context(lambda p: "done<|im_end|>" if TOOL in p else call("increment", step=3) + "<|im_end|>",
                       tools=(), environment_factory=CounterEnv, reward_sources=load_reward_sources([seen]),
                       reward_weights=[0.5])
    rows = [{"prompt": user("count"), "target": 3}, {"prompt": user("count"), "target": 5}]
    comp = R.generate(ctx, None, rows)
    envs = comp.columns["environments"]
    assert [type(e) for e in envs] == [CounterEnv, CounterEnv] and envs[0] is not envs[1]
    assert envs[0].resets == [rows[0]] and envs[1].resets == [rows[1]]  # the whole row, prompt included
    assert comp.prompts == [user("count (target 3)"), user("count (target 5)")]  # appended as is (TRL)
    assert "count (target 3)<|im_end|>" in gen.prompts[0][0]
    assert '"name": "increment"' in gen.prompts[0][0] and "_helper" not in gen.prompts[0][0]
    assert "get_reward" not in gen.prompts[0][0] and '"name": "reset"' not in gen.prompts[0][0]
    assert [e.counter for e in envs] == [3, 3]  # each rollout's tool ran on its own instance
    scores = R.score(ctx, comp)
    assert scores.names == ("seen", "CounterEnv")
    assert scores.per_func.tolist() == [[[3.0, 1.0], [3.0, 0.0]]]  # get_reward: a reward source of weight 1
    assert ctx.reward_weights.tolist() == [0.5, 1.0]
    again = R.generate(ctx, None, rows)  # pooled: the same instances, reset again
    assert [id(e) for e in again.columns["environments"]] == [id(e) for e in envs] and len(envs[0].resets) == 2


def test_several_environments_route_rows_and_show_only_their_tools():
    class Calc:
        def reset(self, **row):
            return None

        def times(self, a: int, b: int) -> int:
            """
            Multiplies.

            Args:
                a: First.
                b: Second.
            """
            return a * b

    ctx, gen = context(lambda p: "ok<|im_end|>", tools=(), environment_factory={"calc": Calc, "counter": CounterEnv})
    comp = R.generate(ctx, None, [{"prompt": user("x"), "environment": "calc", "target": 0},
                                  {"prompt": user("y"), "environment": "counter", "target": 1}])
    assert '"name": "times"' in gen.prompts[0][0] and '"name": "increment"' not in gen.prompts[0][0]
    assert '"name": "increment"' in gen.prompts[0][1] and '"name": "times"' not in gen.prompts[0][1]
    assert comp.columns["environments"][1].resets == [{"prompt": user("y"), "target": 1}]  # without `environment`
    with pytest.raises(ConfigError, match=r"^a dataset row \(row \d of this generation batch\) has environment='nope', "
                                          r"which environment_factory does not name: expected one of"):
        R.generate(ctx, None, [{"prompt": user("x"), "environment": "nope"}])


def test_inputs_that_cannot_work_are_refused_naming_the_fix():
    def undocumented(a: int) -> int:
        return a

    with pytest.raises(ConfigError, match=r"tools\[0\] \('undocumented'\): cannot be described to the model"):
        Toolbox([undocumented])
    with pytest.raises(ConfigError, match=r"tools must be a list of functions, got 'multiply' alone: pass "
                                          r"tools=\[multiply\]"):
        Toolbox(multiply)  # was: TypeError: 'function' object is not iterable

    class NoReset:
        pass

    with pytest.raises(ConfigError, match="NoReset has no reset"):
        Toolbox(environment_factory=NoReset)
    with pytest.raises(ConfigError, match="cannot render a tool-calling conversation"):
        prepare_tokenizer(toy.build_chat_tokenizer())
    tokenizer = toy.build_tool_tokenizer()
    tokenizer.response_template = None
    with pytest.raises(ConfigError, match="no response_template.*QWEN3_RESPONSE_TEMPLATE"):
        prepare_tokenizer(tokenizer)
    ctx, _ = context(lambda p: "x<|im_end|>")
    with pytest.raises(ConfigError, match="tools need conversational prompts"):
        R.generate(ctx, None, [{"prompt": "a plain string"}])


def test_dynamic_sampling_keeps_the_tool_fields_of_the_groups_it_picks():
    ctx, _ = context(two_calls)
    rounds = []
    for prompt in ("go", "no tools"):
        comp = R.generate(ctx, None, [{"prompt": user(prompt)}] * 2)
        rounds.append(Round(comp, torch.zeros(2), torch.zeros(2), None, None, torch.tensor([True])))
    chosen = select_groups(rounds, [(1, 0), (0, 0)], 2, TOKENIZER.pad_token_id).completions
    T = rounds[0].completions.completion_ids.size(1)
    assert chosen.tool_mask.tolist() == [[1] * 14 + [0] * (T - 14)] * 2 + rounds[0].completions.tool_mask.tolist()
    assert chosen.turn_ends == [[13], [13], [89, 182, 222], [89, 182, 222]]
    assert chosen.tool_calls.tolist() == [0, 0, 2, 2] and chosen.tool_timeouts.tolist() == [0, 0, 0, 0]


def test_printed_completions_show_the_tool_calls():
    from groupwise.logging import _short

    ctx, _ = context(two_calls)
    comp = R.generate(ctx, None, [{"prompt": user("go")}])
    assert _short(comp.completions[0], 1000) == ("assistant: Let me compute. [multiply({'a': 3, 'b': 4})] | tool: 12 | "
                                                 "assistant:  [add({'a': 12, 'b': 1})] | tool: 13 | "
                                                 "assistant: The answer is 13.")


def test_a_missing_or_unknown_environment_column_is_named_before_the_model_loads(tmp_path, monkeypatch):
    """environment_factory as a dict: a dataset without an `environment` column, or a row naming no factory, failed
    at the first rollout (after the weights loaded) as "row 0 has environment=None", row 0 being the position in the
    generation batch. Now named from the dataset when the trainer is built: its column, or its row and value."""
    from groupwise import GRPOConfig, GRPOTrainer
    from groupwise import trainer as trainer_module

    def no_model(*a, **k):
        raise AssertionError("the model loaded before the dataset was checked")

    monkeypatch.setattr(trainer_module, "load_policy", no_model)
    factories = {"calc": CounterEnv, "counter": CounterEnv}
    args = GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=2, per_device_train_batch_size=2,
                      report_to="none")
    rows = [{"prompt": user("x"), "target": 0}] * 2
    with pytest.raises(ConfigError, match=r"^train_dataset has no 'environment' column: with environment_factory a dict "
                                          r"\(\['calc', 'counter'\]\), each row names the environment it runs in there"):
        GRPOTrainer("some/model", [], args=args, train_dataset=rows, environment_factory=factories)
    rows = [{"prompt": user("x"), "environment": "calc"}, {"prompt": user("y"), "environment": "calculator"}]
    with pytest.raises(ConfigError, match=r"^train_dataset row 1 has environment='calculator', which "
                                          r"environment_factory does not name: expected one of \['calc', 'counter'\]"):
        GRPOTrainer("some/model", [], args=args, train_dataset=rows, environment_factory=factories)
    from datasets import Dataset

    with pytest.raises(ConfigError, match=r"^eval_dataset row 0 has environment=None"):
        GRPOTrainer("some/model", [], args=args, train_dataset=rows[:1] * 2, environment_factory=factories,
                    eval_dataset=Dataset.from_list([{"prompt": user("z"), "environment": None}]))

    def route(batch):  # a transform that makes the column (the rollout reads the transformed rows)
        return {**batch, "environment": ["calc" if t == 0 else "counter" for t in batch["target"]]}

    from groupwise.data import PromptData
    from groupwise.loading import check_environment_column

    stored = Dataset.from_list([{"prompt": user("x"), "target": t} for t in (0, 1)])
    toolbox = Toolbox(environment_factory=factories)
    check_environment_column(PromptData(stored.with_transform(route), "train_dataset"), toolbox)  # accepted
    with pytest.raises(ConfigError, match=r"^train_dataset row 1 has environment='counters'"):
        check_environment_column(PromptData(stored.with_transform(
            lambda b: {**b, "environment": ["calc" if t == 0 else "counters" for t in b["target"]]}), "train_dataset"),
            toolbox)


def test_an_environment_factory_raising_when_probed_says_so():
    """The probe call at init gave the user's bare exception ('needs a server'), with nothing saying it came from
    calling environment_factory to list its tools; the exception keeps its type and gains that note."""
    class NeedsServer:
        def __init__(self):
            raise RuntimeError("needs a server")

        def reset(self, **row):
            return None

    with pytest.raises(RuntimeError, match="needs a server") as caught:
        Toolbox(environment_factory=NeedsServer)
    assert caught.value.__notes__ == ["(raised by environment_factory, called once when the trainer is built to list "
                                      "the environment's tools, as TRL does)"]
