"""Process-supervision settings that trained without steps, or that changed nothing, silently: each is now an error
naming the field (or, where it may be meant, a warning), before any model loads."""

from __future__ import annotations

import json
import warnings

import pytest

from groupwise import GRPOConfig, GRPOTrainer
from groupwise.config_base import ConfigError
from groupwise.rewards.process import load_process_reward_sources
from groupwise.rewards.sources import RewardFunctionError
from groupwise.tasks import toy
from tests.conftest import small_args
from tests.rewards.test_process import _run


def _steps(prompts, completions, steps, **_):
    return [[1.0] * len(row) for row in steps]


@pytest.mark.parametrize("kwargs, match", [
    (dict(step_tag="ки"), r"step_tag='ки' is read when step_split='tag', but step_split='delimiter': set "
                          r"step_split='tag', or drop step_tag"),
    (dict(step_pattern=r"\.\s"), r"step_pattern='\\\\.\\\\s' is read when step_split='regex', but "
                                 r"step_split='delimiter'"),
    (dict(step_split="tag", step_tag="ки", step_delimiter=". "), r"step_delimiter='\. ' is read when "
                                                                 r"step_split='delimiter', but step_split='tag'"),
    (dict(step_split="turn", step_tag="ки"), r"step_tag='ки' is read when step_split='tag', but step_split='turn'"),
    (dict(supervision="process", process_advantage_weight=0.3),
     r"process_advantage_weight weighs the outcome and process advantages of supervision='both'; "
     r"supervision='process' does not read it"),
    (dict(outcome_advantage_weight=2.0), r"outcome_advantage_weight weighs .* supervision='outcome' does not read"),
    (dict(score_truncated_step=True), r"score_truncated_step applies to the steps of process supervision; "
                                      r"supervision='outcome' has none"),
])
def test_a_process_field_the_run_would_not_read_is_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        GRPOConfig(**kwargs)


def test_the_fields_the_run_reads_are_taken():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # taken without a word
        GRPOConfig(supervision="both", outcome_advantage_weight=2.0, process_advantage_weight=0.5)
        GRPOConfig(supervision="process", score_truncated_step=True, step_split="tag", step_tag="ки")
        GRPOConfig(step_split="regex", step_pattern=r"\n")  # a regex's \n is the regex for a newline: no warning


def test_a_backslash_escape_written_out_warns():
    """`--step_delimiter '\\n'` in a shell is a backslash and an n: no completion holds that, so no step ended."""
    with pytest.warns(UserWarning, match=r"step_delimiter='\\\\n' holds a backslash escape as two characters"):
        GRPOConfig(step_delimiter="\\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GRPOConfig(step_delimiter="\n")
        GRPOConfig(step_delimiter="\\")  # a lone backslash: nothing escaped


def test_a_step_marker_the_tokenizer_cannot_write_is_refused_before_the_model_loads(tmp_path, tokenizer):
    """The toy tokenizer has no 'ки': each character encodes to its unknown token ('<eos>'), so no completion could
    end a step (the whole completion was one step, a truncated one none). Checked right after the tokenizer
    loads."""
    with pytest.raises(ConfigError, match=r"step_tag='ки' is not text the policy's tokenizer can write \(it encodes "
                                          r"to \[1, 1\], which decodes to '<eos><eos>'\), so no completion would ever end"):
        GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [], process_reward_funcs=[_steps],
                    args=small_args(tmp_path, supervision="process", step_split="tag", step_tag="ки"),
                    train_dataset=toy.dataset(8), processing_class=tokenizer)
    tokenizer.add_tokens(["ки"])  # once the tokenizer has it, the run builds
    GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [], process_reward_funcs=[_steps],
                args=small_args(tmp_path, supervision="process", step_split="tag", step_tag="ки"),
                train_dataset=toy.dataset(8), processing_class=tokenizer)


def test_a_round_without_any_step_warns(tmp_path, tokenizer):
    """Completions of 6 tokens without EOS, cut by max_completion_length, and a delimiter they never hold (a token
    the tokenizer has, three times): each is one truncated step, dropped (score_truncated_step=False), so no
    completion has a step and the loss is 0."""
    tokenizer.add_tokens(["§"])
    t = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [], process_reward_funcs=[_steps],
                    args=small_args(tmp_path, supervision="process", step_delimiter="§§§", max_steps=1),
                    train_dataset=toy.dataset(8), processing_class=tokenizer)
    with pytest.warns(RuntimeWarning, match=r"no completion of this round or evaluation has a step to score "
                                            r"\(step_delimiter='§§§'\), so step rewards give no signal"):
        t.train()
    assert json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])[
        "process/no_step_completions"] == 8


def test_step_reward_functions_returning_a_value_per_completion_are_named(tokenizer):
    with pytest.raises(RewardFunctionError, match=r"returned 1.0 for completion 0 where a list of 2 step rewards is "
                                                  r"expected: return one list per completion"):
        _run([lambda steps, **_: [1.0]], [["a", "b"]])
    with pytest.raises(RewardFunctionError, match=r"returned None for completion 0 where a list of 1 step rewards"):
        _run([lambda steps, **_: [None]], [["a"]])


def test_a_prm_kind_misspelt_is_named_before_anything_loads(tmp_path):
    with pytest.raises(ConfigError, match=r"process_reward_funcs\[0\]\.kind='tokenclassification' is not a PRM kind "
                                          r"\(did you mean 'token_classification'\?\)"):
        load_process_reward_sources([{"path": str(tmp_path), "kind": "tokenclassification"}])


def test_a_reward_function_without_kwargs_is_named_before_the_model_loads(tmp_path, tokenizer):
    """TRL passes prompts, completions, completion_ids, trainer_state, log_metric, log_extra and the dataset's
    columns to every reward function: one without **kwargs failed at every call, and the advice then given
    (on_reward_error='nan') trained on all-NaN rewards. A signature naming every keyword is fine."""
    def strict(completions):
        return [1.0] * len(completions)

    def explicit(prompts, completions, completion_ids, trainer_state, log_metric, log_extra, letter):
        return [1.0] * len(completions)

    def steps_only(steps):
        return [[1.0] * len(s) for s in steps]

    def build(funcs=(), process=(), **kw):
        return GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), list(funcs),
                           process_reward_funcs=list(process), args=small_args(tmp_path, **kw),
                           train_dataset=toy.dataset(8), processing_class=tokenizer)

    with pytest.raises(ConfigError, match=r"reward_funcs\[0\] 'strict' takes no \*\*kwargs, but every call passes "
                                          r"the keywords \['completion_ids', 'letter', 'log_extra', 'log_metric', "
                                          r"'prompts', 'trainer_state'\]: add \*\*kwargs"):
        build([strict])
    with pytest.raises(ConfigError, match=r"process_reward_funcs\[0\] 'steps_only' takes no \*\*kwargs, but every "
                                          r"call passes the keywords \['completions', 'letter', 'log_extra', "):
        build(process=[steps_only], supervision="process")
    build([explicit])
    import functools

    def passes_kwargs(fn):  # a decorator whose own signature takes **kwargs (inspect would follow __wrapped__)
        @functools.wraps(fn)
        def wrapper(completions, **kwargs):
            return fn(completions)
        return wrapper

    build([passes_kwargs(strict)])
    with pytest.raises(ConfigError, match=r"reward_funcs\[0\] 'strict' takes no \*\*kwargs"):  # a partial: named
        build([functools.partial(strict)])
    # with environments every call also passes `environments`
    from groupwise.rewards.sources import check_reward_columns

    def named_all(prompts, completions, completion_ids, trainer_state, log_metric, log_extra):
        return [1.0] * len(completions)

    check_reward_columns([named_all], ["prompt"], False)
    with pytest.raises(ConfigError, match=r"every call passes the keywords \['environments'\]"):
        check_reward_columns([named_all], ["prompt"], False, environments=True)
    # a dataset given to evaluate() is checked against the functions too (its extra column would reach them)
    t = build([explicit])
    with pytest.raises(ConfigError, match=r"reward_funcs\[0\] 'explicit' takes no \*\*kwargs, but every call "
                                          r"passes the keywords \['source'\]"):
        t.evaluate([{"prompt": "repeat a:", "letter": "a", "source": "x"}])
    with pytest.raises(ConfigError, match=r"supervision='outcome' needs at least one outcome reward: pass "
                                          r"reward_funcs, or an environment_factory whose environment defines "
                                          r"get_reward"):
        build([])


def test_the_no_step_warning_reads_the_whole_round():
    """It read one process's share or one evaluation batch, and warned when other rows had steps."""
    from groupwise.rollout_metrics import process_metrics
    from groupwise.types import StepScores
    import torch

    def scores(rows):  # one group of len(rows) completions
        return StepScores([rows], [[list(range(len(r))) for r in rows]], [], ("f",), torch.zeros(1),
                          torch.zeros(1, 2))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert process_metrics(scores([[], [1.0, 0.5]]))["process/no_step_completions"] == 1.0
    with pytest.warns(RuntimeWarning, match="no completion of this round or evaluation has a step to score"):
        process_metrics(scores([[], []]))
    # a step_delimiter the policy never writes: each completion is one final step (it trained silently)
    with pytest.warns(RuntimeWarning, match=r"every completion of this round or evaluation is one step at most "
                                            r"\(the step marker\): the step rewards then score whole completions"):
        process_metrics(scores([[1.0], [0.0], []]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        process_metrics(scores([[1.0, 0.0], [1.0]]))  # one completion with two steps: the marker is written


def test_a_whitespace_marker_is_checked_too():
    """'\\n'.strip() is '', which every decoded text contains: a tokenizer writing '\\n' as a space passed."""
    from groupwise.rewards.steps import check_writable

    class SpaceForNewline:  # a T5-like tokenizer: no unknown token, newlines normalised to spaces
        unk_token_id = None

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [0] * len(text)}

        def decode(self, ids, **_):
            return " " * len(ids)

    with pytest.raises(ConfigError, match=r"step_delimiter='\\n' is not text the tokenizer can write"):
        check_writable(SpaceForNewline(), "\n", "step_delimiter", "the tokenizer", "no step would end")
    check_writable(SpaceForNewline(), " ", "step_delimiter", "the tokenizer", "no step would end")


def test_the_completions_printout_names_an_unscored_step(capsys):
    from groupwise.logging import print_completions

    print_completions(3, ["q"], ["a\nb"], [1.0], [0.5], None, steps=[[("a", float("nan")), ("b", 1.0)]])
    out = capsys.readouterr().out
    assert "step 1: unscored  a" in out and "step 2: +1.000  b" in out


def test_a_step_reward_function_taking_dropped_last_gets_it(tmp_path):
    """README: step-reward functions may take `dropped_last`. Only an environment's get_step_rewards got it: a
    function requiring it failed at the first scoring (TypeError), one defaulting it got None. Four fixed
    completions, max_completion_length 14; the fourth, '1=1\\n2345678901' (14 characters, no EOS), is cut: its last
    step is dropped (score_truncated_step=False), so dropped_last = [False, False, False, True] per group."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import groupwise.rollout as R
    from groupwise.demo import POLICY_DIR

    tok = AutoTokenizer.from_pretrained(POLICY_DIR)
    texts = [("11=2\n22=4\n", True), ("1=1\n2=2\n", True), ("3=3\n", True), ("1=1\n2345678901", False)]

    def rollout_func(prompts, trainer):
        return {"prompt_ids": [tok(p, add_special_tokens=False)["input_ids"] for p in prompts],
                "completion_ids": [tok(texts[i % 4][0], add_special_tokens=False)["input_ids"]
                                   + ([tok.eos_token_id] if texts[i % 4][1] else []) for i in range(len(prompts))],
                "logprobs": None}

    seen = []

    def required(prompts, completions, steps, dropped_last, **_):
        seen.append(list(dropped_last))
        return [[1.0] * len(row) for row in steps]

    def defaulted(steps, dropped_last=None, **_):
        seen.append(dropped_last)
        return [[0.0] * len(row) for row in steps]

    def without(steps, **_):  # **kwargs: gets it too, as every keyword
        seen.append(_["dropped_last"])
        return [[0.0] * len(row) for row in steps]

    args = small_args(tmp_path, supervision="process", num_generations=4, per_device_train_batch_size=4,
                      max_completion_length=14, max_steps=1)
    trainer = GRPOTrainer(AutoModelForCausalLM.from_pretrained(POLICY_DIR), None, args=args,
                          train_dataset=Dataset.from_list([{"prompt": "Q: 1+1\n"}] * 4), processing_class=tok,
                          process_reward_funcs=[required, defaulted, without], rollout_func=rollout_func)
    rollout = R.sample_round(trainer.rollout_ctx, trainer.sampling_model)
    assert seen and all(v == [False, False, False, True] * (len(v) // 4) and v for v in seen)
    assert len(seen) == 3 and rollout.step_scores.rewards[0][3] == [1.0]  # row 3 keeps its first step only
