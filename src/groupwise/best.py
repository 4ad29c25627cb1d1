"""Best-model tracking, as transformers' Trainer does it: `metric_for_best_model`, `greater_is_better`,
`load_best_model_at_end`.

After every evaluation during training, the metric (`eval_<name>`) is compared with `state.best_metric`; a better
value records `state.best_metric` and `state.best_global_step`, and the checkpoint of that step, once written, becomes
`state.best_model_checkpoint`; with `load_best_model_at_end` a new best at a step with no save is saved then, so
that it can be loaded (transformers requires save_steps to be a multiple of eval_steps, as groupwise does, yet a best
at an evaluation between two saves has no checkpoint there, and it keeps the last model). The rotation of
`save_total_limit` never deletes it (and counts it: transformers' rotation), and `load_best_model_at_end` loads its
weights when training ends. `save_strategy="best"` saves a checkpoint exactly when an evaluation gives a new best.
EarlyStoppingCallback reads `state.best_metric` the same way.
"""

from __future__ import annotations

import difflib
import math
import re
from pathlib import Path

from groupwise.config_base import ConfigError, warn_user
from groupwise.rollout_metrics import LENGTH_METRICS


def check_fields(args, *, sharded: bool = False) -> None:
    """transformers' TrainingArguments and Trainer rules, plus groupwise's: evaluation reports no eval_loss, so the
    metric is named; save_strategy 'best' needs evaluations. `sharded`: the run uses fsdp. Fills
    `greater_is_better` as transformers does (True unless the name ends with 'loss')."""
    if args.metric_for_best_model is not None and args.greater_is_better is None:
        args.greater_is_better = not args.metric_for_best_model.endswith("loss")
    if args.metric_for_best_model in ("loss", "eval_loss"):  # TRL's prediction_step computes one: a TRL habit
        raise ConfigError(f"metric_for_best_model={args.metric_for_best_model!r}: groupwise's evaluation reports no "
                          "eval_loss (it samples and scores, it computes no loss); name an evaluation metric, e.g. "
                          "'reward' or 'rewards/<func>/mean'")
    if args.save_strategy == "best" and args.metric_for_best_model is None:
        raise ConfigError("save_strategy='best' needs metric_for_best_model (a save follows each evaluation that "
                          "gives it a new best value): name an evaluation metric, e.g. 'reward'")
    if args.save_strategy == "best" and args.eval_strategy == "no":
        raise ConfigError("save_strategy='best' saves after an evaluation that gives a new best metric: set "
                          "eval_strategy to 'steps' or 'epoch'")
    if not args.load_best_model_at_end:
        return
    if args.metric_for_best_model is None:
        raise ConfigError("load_best_model_at_end=True needs metric_for_best_model: groupwise's evaluation reports no "
                          "eval_loss (transformers' default); name an evaluation metric, e.g. 'reward'")
    if sharded and args.save_only_model:  # transformers' Trainer refuses it too ("FSDP can't be used with …")
        raise ConfigError("load_best_model_at_end=True with fsdp and save_only_model=True: such checkpoints hold no "
                          "shards to load the best model from; drop save_only_model or load_best_model_at_end")
    if args.save_strategy == "best":  # saves follow the evaluations: any eval_strategy (transformers)
        return
    if args.eval_strategy == "no" or args.eval_strategy != args.save_strategy:
        raise ConfigError(f"load_best_model_at_end=True needs eval_strategy and save_strategy to match (and not be "
                          f"'no'), got eval_strategy={args.eval_strategy!r}, save_strategy={args.save_strategy!r}")
    if args.eval_strategy == "steps":
        every = args.eval_steps if args.eval_steps is not None else args.logging_steps
        save = args.save_steps
        if (every < 1) != (save < 1) or round(save * 1_000_000) % round(every * 1_000_000):
            raise ConfigError(f"load_best_model_at_end=True needs save_steps ({save}) to be a multiple of eval_steps "
                              f"({every}), both in steps or both fractions of max_steps")


# the metrics evaluation reports per kind of reward function (groupwise.evaluation)
OUTCOME_METRIC = re.compile(r"^(?:reward|reward_std|frac_reward_zero_std|rewards/(?P<func>.+)/(?:mean|std|mean@\d+|"
                            r"pass@\d+))$")
OTHER_METRICS = ("num_tokens", *LENGTH_METRICS, "tools/call_frequency", "tools/failure_frequency", "runtime",
                 "samples_per_second", "steps_per_second")
PROCESS_METRIC = re.compile(r"^process/(?:step_reward_mean|steps_per_completion|no_step_completions|unscored_steps|"
                            r"zero_std_groups|(?P<func>.+)/(?:mean|errors))$")


class BestModel:
    def __init__(self, args, datasets: tuple[str, ...] | None = None):
        """`datasets`: the names of eval datasets given as {name: dataset}, whose metrics are eval_<name>_…
        (transformers): the metric must name one, checked now, before any model loads. The reward functions'
        names come later (check_reward_names)."""
        self.args = args
        name = args.metric_for_best_model
        self.key = None if name is None else name if name.startswith("eval_") else f"eval_{name}"
        if self.key is None:
            return
        self.metric = self.key.removeprefix("eval_")  # the name evaluation gives, without a dataset's prefix
        if datasets is not None:
            of = [d for d in datasets if self.metric.startswith(f"{d}_")]
            if not of:
                raise ConfigError(f"metric_for_best_model={name!r}: the eval datasets are given as {{name: dataset}}, "
                                  f"so every evaluation metric is eval_<name>_<metric>, with <name> one of "
                                  f"{list(datasets)}: name one dataset's, e.g. '{datasets[0]}_reward'")
            self.metric = self.metric.removeprefix(f"{max(of, key=len)}_")
            if self.metric == "loss":
                raise ConfigError(f"metric_for_best_model={name!r}: groupwise's evaluation reports no loss (it "
                                  "samples and scores, it computes no loss); name an evaluation metric, e.g. "
                                  f"'{datasets[0]}_reward'")

    def check_reward_names(self, outcome: tuple[str, ...], process: tuple[str, ...]) -> None:
        """`outcome` / `process`: the names of the run's reward functions of each kind, whose metrics evaluation
        reports (reward, rewards/<name>/…; process/…): a metric_for_best_model of a kind the run lacks, or of a
        function it does not have, is refused now, not at the first evaluation."""
        if self.key is None:
            return
        name = self.args.metric_for_best_model
        for kind, names, pattern in (("outcome reward functions", outcome, OUTCOME_METRIC),
                                     ("process reward functions", process, PROCESS_METRIC)):
            match = pattern.match(self.metric)  # a name evaluation gives (a log_metric name may be anything else)
            if match and not names:
                raise ConfigError(f"metric_for_best_model={name!r}: this run has no {kind}, so evaluation does not "
                                  "report it; name another evaluation metric")
            if match and match["func"] is not None and match["func"] not in names:
                raise ConfigError(f"metric_for_best_model={name!r}: no reward function named {match['func']!r} "
                                  f"among the {kind} {list(names)}")
        if OUTCOME_METRIC.match(self.metric) or PROCESS_METRIC.match(self.metric) or self.metric in OTHER_METRICS:
            return
        known = [*OTHER_METRICS, *(["reward", "reward_std", "frac_reward_zero_std"] if outcome else []),
                 *(f"rewards/{f}/{s}" for f in outcome for s in ("mean", "std")),
                 *([f"process/{m}" for m in ("step_reward_mean", "steps_per_completion", "unscored_steps")]
                   if process else []), *(f"process/{f}/mean" for f in process)]
        close = difflib.get_close_matches(self.metric, known, n=1, cutoff=0.6)
        warn_user(f"metric_for_best_model={name!r}: evaluation reports no {self.metric!r} by itself; unless a reward "
                  "function logs it with log_metric, the first evaluation stops the run"
                  + (f" (did you mean {close[0]!r}?)" if close else ""))

    def observe(self, state, metrics: dict) -> bool:
        """After an evaluation during training: is `metrics` the best so far? Updates state.best_metric and
        state.best_global_step (transformers' _determine_best_metric); a None / NaN value is never the best."""
        if self.key is None:
            return False
        if self.key not in metrics:  # a name no check could rule out before (a log_metric name may be anything)
            raise ConfigError(f"metric_for_best_model={self.args.metric_for_best_model!r}: '{self.key}' is not among "
                              f"the evaluation metrics {sorted(metrics)}: set metric_for_best_model to one of them")
        value = metrics[self.key]
        if value is None or not math.isfinite(value):
            return False
        best = state.best_metric
        if best is not None and not (value > best if self.args.greater_is_better else value < best):
            return False
        state.best_metric = float(value)
        if self.args.save_strategy in ("steps", "epoch", "best"):  # transformers: a step whose checkpoint may exist
            state.best_global_step = state.global_step
        return True

    @staticmethod
    def at_save(state, output_dir: str | Path, step: int) -> str | None:
        """The best checkpoint as of the save of `step`: transformers' _save_checkpoint updates
        state.best_model_checkpoint before it writes trainer_state.json and rotates, so a save at the best step
        records and protects itself, not the former best."""
        if state.best_global_step == step:
            return str(Path(output_dir) / f"checkpoint-{step}")
        return state.best_model_checkpoint

    @staticmethod
    def saved(state, path: str | Path) -> None:
        """After checkpoint-N is written: the best step's checkpoint becomes state.best_model_checkpoint."""
        if state.best_global_step is not None and Path(path).name == f"checkpoint-{state.best_global_step}":
            state.best_model_checkpoint = str(path)

    @staticmethod
    def state_dict(state, checkpoint: str | None) -> dict:
        """What a checkpoint's trainer_state.json keeps; `checkpoint`: the best checkpoint as of this save (at_save:
        a checkpoint of the best step names itself, as transformers' does)."""
        return {"best_metric": state.best_metric, "best_global_step": state.best_global_step,
                "best_model_checkpoint": checkpoint}

    @staticmethod
    def load_state_dict(state, saved: dict | None, output_dir: str | Path) -> None:
        """A resumed run continues from the checkpoint's best. The path was recorded as output_dir was spelt then
        (relative to that run's working directory, perhaps): the run's checkpoint of that name in this output_dir
        is taken first, so that another spelling or working directory does not lose it (the rotation would then
        delete it). One whose folder is gone is forgotten, as transformers does."""
        saved = saved or {}
        state.best_metric = saved.get("best_metric")
        state.best_global_step = saved.get("best_global_step")
        folder = saved.get("best_model_checkpoint")
        found = [] if folder is None else [p for p in (Path(output_dir) / Path(folder).name, Path(folder)) if p.is_dir()]
        state.best_model_checkpoint = str(found[0]) if found else None
