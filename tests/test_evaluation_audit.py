"""trainer.evaluate() and evaluation during training, against transformers' / TRL's semantics: the callbacks'
TrainerControl handling, a dataset given to evaluate() checked as the constructor's, hand-worked mean@k / pass@k,
evaluation leaving the training's random streams, sampler and train/eval mode alone, and two processes evaluating
an eval set that does not split evenly (every row scored once)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import TrainerCallback, TrainerControl

from groupwise import GRPOTrainer
from groupwise.callbacks import CallbackHandler
from groupwise.config_base import ConfigError
from groupwise.tasks import toy
from tests.conftest import small_args
from tests.launcher import torchrun


def _length(completions, **_):
    return [float(len(c)) for c in completions]


def _trainer(tmp_path, tokenizer, funcs=(_length,), eval_data=None, model=None, callbacks=None, **kw):
    kw.setdefault("output_dir", str(tmp_path / "run"))
    return GRPOTrainer(model or toy.build_model(tokenizer, seed=0, hidden_size=32), list(funcs),
                       args=small_args(tmp_path, **kw), train_dataset=toy.dataset(12), eval_dataset=eval_data,
                       processing_class=tokenizer, callbacks=callbacks)


def _eval_steps(trainer) -> list[int]:
    return [h["step"] for h in trainer.state.log_history if "eval_reward" in h]


# ---- callbacks' TrainerControl ----------------------------------------------------------------------------------------
class _NewControlAtStep1(TrainerCallback):
    """Returns a fresh TrainerControl instead of the one it was given (transformers takes the returned object)."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            return TrainerControl(should_evaluate=True)
        return None


def test_a_returned_new_trainer_control_acts_at_that_step(tmp_path, tokenizer):
    # before the fix the trainer read the flags of the object it held, so the evaluation came one step late (step 2)
    t = _trainer(tmp_path, tokenizer, eval_data=toy.dataset(2), max_steps=3, callbacks=[_NewControlAtStep1])
    t.train()
    assert _eval_steps(t) == [1]

    class Wrong(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            return True

    t = _trainer(tmp_path, tokenizer, max_steps=1, callbacks=[Wrong], output_dir=str(tmp_path / "w"))
    with pytest.raises(TypeError, match="Wrong.on_step_begin returned a bool: return the TrainerControl"):
        t.train()


def test_events_clear_the_flags_transformers_clears():
    """transformers' CallbackHandler: on_step_begin clears log / evaluate / save, on_log / on_evaluate / on_save their
    own flag, on_train_begin should_training_stop, on_epoch_begin should_epoch_stop — before the callbacks run."""
    seen = {}

    class Spy(TrainerCallback):
        def __getattribute__(self, name):
            if name.startswith("on_"):
                return lambda args, state, control, **kw: seen.__setitem__(name, dict(vars(control)))
            return super().__getattribute__(name)

    handler = CallbackHandler([Spy()])
    every = dict(should_training_stop=True, should_epoch_stop=True, should_save=True, should_evaluate=True,
                 should_log=True)
    for event, cleared in [("on_step_begin", {"should_log", "should_evaluate", "should_save"}),
                           ("on_log", {"should_log"}), ("on_evaluate", {"should_evaluate"}), ("on_save", {"should_save"}),
                           ("on_train_begin", {"should_training_stop"}), ("on_epoch_begin", {"should_epoch_stop"}),
                           ("on_step_end", set())]:
        control = TrainerControl(**every)
        assert handler.call_event(event, None, None, control) is control
        assert {k for k, v in seen[event].items() if not v} == cleared, event


def test_a_save_asked_for_in_an_evaluation_before_training_is_not_carried_into_step_1(tmp_path, tokenizer):
    # eval_on_start's on_evaluate asks for a save; transformers clears it at on_step_begin (no save_strategy here)
    class SaveAfterEval(TrainerCallback):
        def on_evaluate(self, args, state, control, **kwargs):
            control.should_save = True

    t = _trainer(tmp_path, tokenizer, eval_data=toy.dataset(2), max_steps=2, eval_on_start=True, save_strategy="no",
                 callbacks=[SaveAfterEval])
    t.train()
    assert not list((tmp_path / "run").glob("checkpoint-*"))


def test_flags_asked_for_in_on_log_and_on_evaluate_act_at_that_step(tmp_path, tokenizer):
    # transformers' _maybe_log_save_evaluate: log, then `if control.should_evaluate`, then `if control.should_save`
    class Ask(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" in logs and state.global_step == 1:
                control.should_evaluate = True

        def on_evaluate(self, args, state, control, **kwargs):
            control.should_save = True  # "save when the eval metric improves"

    t = _trainer(tmp_path, tokenizer, eval_data=toy.dataset(2), max_steps=2, save_strategy="no", callbacks=[Ask])
    t.train()
    assert _eval_steps(t) == [1]
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-1"]


# ---- a dataset given to evaluate() ---------------------------------------------------------------------------------
def test_evaluate_checks_a_given_dataset_as_the_constructor_checks_eval_dataset(tmp_path, tokenizer):
    long_rows = [{"prompt": "repeat a:" * 10}]  # 90 characters: 90 tokens with the character tokenizer
    t = _trainer(tmp_path, tokenizer, max_prompt_length=20, truncate_prompt="error")
    with pytest.raises(ConfigError, match="eval_dataset row 0 has 90 prompt tokens > max_prompt_length=20"):
        t.evaluate(eval_dataset=long_rows)  # before the fix: silently cut to 20 tokens and scored
    with pytest.raises(ConfigError, match=r"eval_dataset\['long'\] row 0 has 90 prompt tokens > max_prompt_length=20"):
        t.evaluate(eval_dataset={"long": long_rows})
    small = toy.build_model(tokenizer, seed=0, hidden_size=32, max_positions=64)
    t = _trainer(tmp_path, tokenizer, model=small, max_prompt_length=None)
    with pytest.raises(ConfigError, match="the model's 64 positions"):
        t.evaluate(eval_dataset=long_rows)  # 90 + 6 completion tokens > 64 positions
    assert "eval_reward" in t.evaluate(eval_dataset=toy.dataset(2))


# ---- mean@k and pass@k, by hand -------------------------------------------------------------------------------------
# prompt i, sample j (k = 2 samples per prompt, contiguous in each reward call):
#   solved: p0 [1, 0]        p1 [0, 0]        p2 [1, 1]
#   graded: p0 [None, 0.5]   p1 [None, None]  p2 [2.0, -1.0]      (None: cannot score → NaN, left out)
_SOLVED = [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]]
_GRADED = [[None, 0.5], [None, None], [2.0, -1.0]]


def _by_sample(table):
    def reward(completions, **kw):  # idx is an eval column only (the constructor checks train_dataset's columns)
        if table is _SOLVED and "log_extra" in kw:  # a log_extra column: eval_completions.jsonl's `shown`
            kw["log_extra"]("shown", [f"{i}.{j % 2}" for j, i in enumerate(kw["idx"])])
        return [table[i][j % 2] for j, i in enumerate(kw["idx"])]
    return reward


def test_mean_and_pass_at_k_hand_worked(tmp_path, tokenizer):
    solved, graded = _by_sample(_SOLVED), _by_sample(_GRADED)
    solved.__name__, graded.__name__ = "solved", "graded"
    rows = [{"prompt": f"repeat {c}:", "idx": i} for i, c in enumerate("abc")]
    t = _trainer(tmp_path, tokenizer, funcs=(solved, graded), eval_data=rows, num_generations_eval=2,
                 per_device_eval_batch_size=2, reward_weights=[1.0, 2.0])  # calls: [p0 p0 p1 p1], [p2 p2]
    out = t.evaluate()
    # solved: mean@2 = (1+0+0+0+1+1)/6 = 0.5; pass@2 = mean(max(1,0), max(0,0), max(1,1)) = 2/3
    assert out["eval_rewards/solved/mean@2"] == out["eval_rewards/solved/mean"] == pytest.approx(0.5)
    assert out["eval_rewards/solved/pass@2"] == pytest.approx(2 / 3)
    # graded: mean@2 over the 3 scored samples = (0.5 + 2 - 1)/3 = 0.5; pass@2 over the 2 prompts with a score:
    # mean(0.5, 2.0) = 1.25 (p1, never scored, is left out)
    assert out["eval_rewards/graded/mean@2"] == pytest.approx(0.5)
    assert out["eval_rewards/graded/pass@2"] == pytest.approx(1.25)
    # reward = Σ w·r over the scored terms, w = (1, 2): p0 [1, 0+1], p1 [0, 0], p2 [1+4, 1-2] → (1+1+0+0+5-1)/6 = 1
    assert out["eval_reward"] == pytest.approx(1.0)
    # eval_completions.jsonl: one line per completion in dataset order (index, sample), each function's value
    # (unscored: null) and the reward above, with the step, the run id, the metric prefix and the log_extra column
    lines = [json.loads(x) for x in (tmp_path / "run" / "eval_completions.jsonl").read_text().splitlines()]
    assert [(r["index"], r["sample"]) for r in lines] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert [r["rewards"] for r in lines] == [{"solved": s, "graded": g} for row in zip(_SOLVED, _GRADED)
                                             for s, g in zip(*row)]
    assert [r["reward"] for r in lines] == [1.0, 1.0, 0.0, 0.0, 5.0, -1.0]  # p1's w·r: 0 + nothing scored = 0
    assert {(r["step"], r["run_id"], r["dataset"]) for r in lines} == {(0, t.run_id, "eval")}
    assert [r["prompt"] for r in lines] == [f"repeat {c}:" for c in "abc" for _ in range(2)]
    assert all(isinstance(r["completion"], str) for r in lines)
    assert [r["shown"] for r in lines] == [f"{i}.{j}" for i in range(3) for j in range(2)]


def test_on_prediction_step_fires_after_each_evaluation_batch(tmp_path, tokenizer):
    """transformers' evaluation loop fires it per batch (its eval progress bar reads it); it was never fired."""
    class Batches(TrainerCallback):
        seen: list = []

        def on_prediction_step(self, args, state, control, **kwargs):
            self.seen.append(state.global_step)

    t = _trainer(tmp_path, tokenizer, eval_data=toy.dataset(5, seed=1), per_device_eval_batch_size=2,
                 callbacks=[Batches])
    t.evaluate()
    assert Batches.seen == [0, 0, 0]  # 5 prompts in batches of 2, 2, 1


def test_an_iterable_eval_dataset_is_named_here_and_in_evaluate(tmp_path, tokenizer):
    """The constructor refused a stream; evaluate(eval_dataset=stream) failed with "object of type
    'IterableDataset' has no len()"."""
    from datasets import Dataset

    stream = Dataset.from_list(toy.dataset(3)).to_iterable_dataset()
    message = r"eval_dataset must be a datasets.Dataset or a list of dicts .* Dataset.from_list\(list\(stream\)\)"
    with pytest.raises(ConfigError, match=message):
        _trainer(tmp_path, tokenizer, eval_data=stream)
    with pytest.raises(ConfigError, match=message):
        _trainer(tmp_path, tokenizer).evaluate(eval_dataset=stream)


def test_process_reward_functions_are_scored_in_evaluation(tmp_path, tokenizer):
    """supervision='process' (no outcome function): evaluation reported lengths only, so nothing measured the
    process rewards and no metric_for_best_model could name them. Now training's process/* metrics over the eval
    set, a prompt's k completions being a group. A rollout_func gives fixed completions; steps end at "\n"; each
    step scores its length: c0 "ab\ncd" → [2, 2], c1 "a" → [1], c2 "abc\nd\ne" → [3, 1, 1], c3 "" → no step."""
    eos = tokenizer.eos_token_id
    texts = ["ab\ncd", "a", "abc\nd\ne", ""]

    def rollout_func(prompts, trainer):
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [eos] for t in texts[:len(prompts)]]
        return {"prompt_ids": [[5]] * len(prompts), "completion_ids": ids, "logprobs": None}

    def step_len(prompts, completions, steps, **_):
        return [[float(len(s.strip())) for s in row] for row in steps]

    rows = [{"prompt": "p0"}, {"prompt": "p1"}]
    t = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [], process_reward_funcs=[step_len],
                    args=small_args(tmp_path, supervision="process", num_generations_eval=2,
                                    per_device_eval_batch_size=2, max_completion_length=8),
                    train_dataset=toy.dataset(8), eval_dataset=rows, processing_class=tokenizer,
                    rollout_func=rollout_func)
    out = t.evaluate()
    assert out["eval_process/step_reward_mean"] == pytest.approx(10 / 6)  # (2+2+1+3+1+1) / 6 steps
    assert out["eval_process/steps_per_completion"] == 1.5  # 6 steps / 4 completions
    assert out["eval_process/no_step_completions"] == 1.0  # c3
    assert out["eval_process/unscored_steps"] == 0.0 and out["eval_process/step_len/errors"] == 0.0
    assert out["eval_process/step_len/mean"] == pytest.approx(10 / 6)  # the one function's own mean
    assert out["eval_process/zero_std_groups"] == 0.0  # both groups' step rewards differ
    assert "eval_reward" not in out  # no outcome function
    lines = [json.loads(x) for x in (tmp_path / "out" / "eval_completions.jsonl").read_text().splitlines()]
    # each completion's steps with their rewards (the lengths above), in dataset order
    assert [r["steps"] for r in lines] == [[["ab", 2.0], ["cd", 2.0]], [["a", 1.0]],
                                           [["abc", 3.0], ["d", 1.0], ["e", 1.0]], []]
    assert [(r["index"], r["sample"]) for r in lines] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["completion"] for r in lines] == texts and not any("rewards" in r or "reward" in r for r in lines)


# ---- evaluation leaves training alone ---------------------------------------------------------------------------------
def test_sampled_evaluation_leaves_rng_sampler_mode_and_weights_untouched(tmp_path, tokenizer):
    t = _trainer(tmp_path, tokenizer, eval_data=toy.dataset(3), num_generations_eval=2, disable_dropout=False)
    t.sampler.next_round()
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy(), t.sampler.state_dict())
    weights = {k: v.clone() for k, v in t.unwrapped.state_dict().items()}
    assert t.unwrapped.training
    t.evaluate()
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert np.array_equal(np.random.get_state()[1], before[2]) and t.sampler.state_dict() == before[3]
    assert t.unwrapped.training  # generation ran in eval mode and gave the mode back
    assert all(torch.equal(v, weights[k]) for k, v in t.unwrapped.state_dict().items())


# ---- two processes ----------------------------------------------------------------------------------------------------
def _worker(out: str) -> None:
    """Run under torch.distributed.run: 5 eval prompts over the processes (3 + 2 with two), greedy and k = 2."""
    tokenizer = toy.build_tokenizer()
    scored: list[int] = []

    def index(completions, **kw):
        scored.extend(kw["idx"])
        return [float(i) for i in kw["idx"]]

    rows = [{"prompt": f"repeat {c}:", "idx": i} for i, c in enumerate("abcde")]
    out_dir = Path(out)
    args = small_args(out_dir, output_dir=str(out_dir / "run"), per_device_eval_batch_size=1)
    trainer = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [_length, index], args=args,
                          train_dataset=toy.dataset(12), eval_dataset=rows, processing_class=tokenizer)
    greedy = trainer.evaluate()
    trainer.args.num_generations_eval = 2
    sampled = trainer.evaluate()
    seen = list(scored)  # the two evaluations' rows (the rollout_func's below score again)
    modes: list[bool] = []

    def rollout_func(prompts, trainer):  # fixed completions; sees the mode, as a TRL rollout_func reads it
        modes.append(trainer.model.training)
        return {"prompt_ids": [tokenizer(p)["input_ids"] for p in prompts],
                "completion_ids": [[5, 6, tokenizer.eos_token_id]] * len(prompts),
                "logprobs": [[-1.0, -1.0, -1.0]] * len(prompts)}

    args = small_args(out_dir, output_dir=str(out_dir / "custom"), per_device_eval_batch_size=1)
    custom = GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [index], args=args,
                         train_dataset=toy.dataset(12), eval_dataset=rows, processing_class=tokenizer,
                         rollout_func=rollout_func).evaluate()
    rank = trainer.dist.rank
    rows = (out_dir / "run" / "eval_completions.jsonl")  # the main process's, every process's completions
    lines = [json.loads(x) for x in rows.read_text().splitlines()] if rank == 0 else []
    (out_dir / f"eval_{rank}.json").write_text(json.dumps({"greedy": greedy, "sampled": sampled, "scored": seen,
                                                           "custom": custom, "modes": modes,
                                                           "lines": lines}))


@pytest.mark.slow
def test_two_processes_evaluate_every_row_once(tmp_path):
    (tmp_path / "one").mkdir()
    _worker(str(tmp_path / "one"))  # one process: here
    (tmp_path / "two").mkdir()
    proc = torchrun(__file__, tmp_path / "two")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    one = json.loads((tmp_path / "one" / "eval_0.json").read_text())
    two = [json.loads((tmp_path / "two" / f"eval_{r}.json").read_text()) for r in (0, 1)]
    assert sorted(two[0]["scored"] + two[1]["scored"]) == sorted(one["scored"])  # no row twice, none left out
    assert sorted(two[0]["scored"]) == [0, 0, 0, 2, 2, 2, 4, 4, 4] and sorted(two[1]["scored"]) == [1, 1, 1, 3, 3, 3]
    # eval_rewards/index/mean = (0+1+2+3+4)/5 = 2 on every process, greedy and sampled; pass@2 of a constant is it
    for result in (one, *two):
        assert result["greedy"]["eval_rewards/index/mean"] == result["sampled"]["eval_rewards/index/pass@2"] == 2.0
        assert result["greedy"]["eval_reward"] == pytest.approx(one["greedy"]["eval_reward"])  # same greedy texts
        assert result["greedy"]["eval_completions/mean_length"] == one["greedy"]["eval_completions/mean_length"]
        # a rollout_func's evaluation: 3 calls on one process and 2 on the other (it crashed: each call was a
        # collective, paired across the processes' different counts), in eval mode as transformers' loop (it saw
        # training=True); the mean index is 2 and every completion is 3 tokens
        assert result["custom"]["eval_rewards/index/mean"] == 2.0
        assert result["custom"]["eval_completions/mean_length"] == 3.0
        assert result["modes"] and not any(result["modes"])
    assert [len(r["modes"]) for r in two] == [3, 2]
    # eval_completions.jsonl, written by the main process: every process's rows in dataset order; the greedy
    # evaluation's lines equal one process's (but the run id), the sampled one's k = 2 rows per prompt follow
    assert two[1]["lines"] == []
    lines = {n: [{k: v for k, v in r.items() if k != "run_id"} for r in result["lines"]] for n, result in
             (("one", one), ("two", two[0]))}
    assert lines["two"][:5] == lines["one"][:5] and [r["index"] for r in lines["two"][:5]] == [0, 1, 2, 3, 4]
    assert [(r["index"], r["sample"]) for r in lines["two"][5:]] == [(i, j) for i in range(5) for j in range(2)]
    assert [r["rewards"]["index"] for r in lines["two"][5:]] == [float(i) for i in range(5) for _ in range(2)]


if __name__ == "__main__":
    _worker(sys.argv[1])


def test_an_eval_dataset_without_a_column_a_reward_function_needs_is_named_before_training(tmp_path, tokenizer):
    """letter_reward needs the `letter` column: checked on eval_dataset as on train_dataset, before the model loads
    (it crashed at the first evaluation, after training steps)."""
    from groupwise import ConfigError

    rows = [{"prompt": r["prompt"]} for r in toy.dataset(4)]
    with pytest.raises(ConfigError, match=r"reward_funcs\[0\] 'letter_reward' needs the keyword 'letter': "
                                          r"eval_dataset has no column 'letter' \(columns: \['prompt'\]\)"):
        GRPOTrainer("no/such-model", [toy.letter_reward], args=small_args(tmp_path, remove_unused_columns=False),
                    train_dataset=toy.dataset(8), eval_dataset=rows)
