"""`groupwise prm eval CONFIG.yaml` — how well a step scorer separates good steps from bad ones, on step-labelled
JSONL (the lines `groupwise prm train` reads: `prompt`, `steps` or TRL's `completions`, `labels`, 1 = good step).

The scorer is one `process_reward_funcs` entry, loaded and called as GRPO calls it (DeepSeekMath §4.1.3's step
rewards): a PRM folder written by `groupwise prm train`, a PRM spec `{path, kind, …options}`, or a step-reward
function `'package.module:function'` (the line's other keys are its dataset columns; its completion is the steps
joined by `step_delimiter`). A step is judged good when its score is above `threshold`. The metrics (step_metrics)
are those `prm train` reports on its held-out rows, so a PRM trained with an `eval_file` and evaluated on that
file gives its `eval_metrics.json` numbers again.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from groupwise.config_base import ConfigError, StrictConfig, check_location, option
from groupwise.rewards.sources import ON_REWARD_ERROR


@dataclass
class PRMEvalConfig(StrictConfig):
    process_reward_func: str | dict = option("The step scorer, as one process_reward_funcs entry: a folder `groupwise prm train` wrote, a PRM spec {path: …, kind: …, options} (JSON text on the command line), or 'package.module:function'.", default="")
    eval_file: str = option("Step-labelled JSONL: prompt, steps (or TRL's completions), labels (1 = good); other keys are a step-reward function's dataset columns.", default="")
    threshold: float = option("A step is judged good when its score is above this: 0.5 for a PRM's probabilities; set it for a function's scale (0 for ±1 rewards).", default=0.5)
    step_delimiter: str = option("Joins a line's steps into the completion a step-reward function receives (GRPO's step_delimiter).", default="\n")
    output_file: str | None = option("Also write the metrics as JSON to this file.", default=None)
    trust_remote_code: bool = option("Allow the PRM's repository to run its own code (a spec's own trust_remote_code wins).", default=False)
    on_reward_error: str = option("An exception in a step-reward function: 'raise' (stop, naming the row) or 'nan' (its steps unscored, counted in eval/unscored).", default="raise", choices=ON_REWARD_ERROR)

    def validate(self) -> None:
        if isinstance(self.process_reward_func, str) and self.process_reward_func.lstrip().startswith("{"):
            try:  # a spec given on the command line
                self.process_reward_func = json.loads(self.process_reward_func)
            except json.JSONDecodeError as e:
                raise ConfigError(f"process_reward_func: not a JSON mapping ({e}): write it as "
                                  '\'{"path": "…", "kind": "…"}\'') from None
        if not self.process_reward_func:
            raise ConfigError("process_reward_func is required: a PRM folder, a PRM spec {path: …, kind: …}, or "
                              "'package.module:function'")
        if not self.eval_file:
            raise ConfigError("eval_file is required (JSONL with prompt, steps, labels)")
        check_location(self.eval_file, "eval_file")


def _auroc(good: list[float], bad: list[float]) -> float:
    """P(score of a good step > score of a bad step), ties counted half: the Mann-Whitney U statistic over
    |good|·|bad|, from the average ranks of the pooled scores (O(n log n))."""
    if not good or not bad:
        return math.nan
    pooled = sorted([(s, 1) for s in good] + [(s, 0) for s in bad])
    rank_sum, i = 0.0, 0
    while i < len(pooled):
        j = i
        while j < len(pooled) and pooled[j][0] == pooled[i][0]:
            j += 1
        average = (i + 1 + j) / 2  # ranks i+1 … j share their mean
        rank_sum += average * sum(label for _, label in pooled[i:j])
        i = j
    return (rank_sum - len(good) * (len(good) + 1) / 2) / (len(good) * len(bad))


def step_metrics(scores: list[list[float | None]], labels: list[list[int]], threshold: float = 0.5,
                 prefix: str = "eval/") -> dict[str, float]:
    """Per example, its steps' scores (None or NaN: unscored, e.g. past the PRM's max_length) and labels (1 good).

    steps: the labelled steps scored; unscored: those left unscored (out of every other metric);
    accuracy: the share judged right (good ⇔ score > threshold);
    good_ / bad_ precision, recall, f1: per class (0 for 0/0, as sklearn's zero_division=0);
    auroc: P(a good step scores above a bad one), ties half; threshold-free, 0.5 is chance (NaN without both kinds);
    first_error_accuracy: the share of examples, all steps scored, whose first step judged bad is their first
    labelled bad step (none judged bad for none labelled): where the scorer would call a solution wrong;
    good_mean_score / bad_mean_score."""
    pairs = [(float(s), int(g)) for row, gold in zip(scores, labels) for s, g in zip(row, gold)
             if s is not None and not math.isnan(s)]
    n_labels = sum(len(gold) for gold in labels)
    preds, golds = [s > threshold for s, _ in pairs], [g for _, g in pairs]
    out = {f"{prefix}steps": float(len(pairs)), f"{prefix}unscored": float(n_labels - len(pairs)),
           f"{prefix}accuracy": sum(p == bool(g) for p, g in zip(preds, golds)) / max(len(pairs), 1)}
    for cls, name in ((1, "good"), (0, "bad")):
        tp = sum(p == cls and g == cls for p, g in zip(preds, golds))
        fp = sum(p == cls and g != cls for p, g in zip(preds, golds))
        fn = sum(p != cls and g == cls for p, g in zip(preds, golds))
        precision = tp / (tp + fp) if tp + fp else 0.0
        recall = tp / (tp + fn) if tp + fn else 0.0
        out[f"{prefix}{name}_precision"], out[f"{prefix}{name}_recall"] = precision, recall
        out[f"{prefix}{name}_f1"] = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    good, bad = [s for s, g in pairs if g == 1], [s for s, g in pairs if g == 0]
    out[f"{prefix}auroc"] = _auroc(good, bad)
    out[f"{prefix}good_mean_score"] = sum(good) / len(good) if good else math.nan
    out[f"{prefix}bad_mean_score"] = sum(bad) / len(bad) if bad else math.nan
    complete = [(row, gold) for row, gold in zip(scores, labels)
                if len(row) == len(gold) and all(s is not None and not math.isnan(s) for s in row)]
    first = lambda flags: next((k for k, f in enumerate(flags) if f), None)  # noqa: E731
    right = sum(first([s <= threshold for s in row]) == first([g == 0 for g in gold]) for row, gold in complete)
    out[f"{prefix}first_error_accuracy"] = right / len(complete) if complete else math.nan
    return out


def evaluate_scorer(cfg: PRMEvalConfig) -> dict[str, float]:
    from groupwise.prm_train import read_step_jsonl
    from groupwise.rewards.process import (PROCESS_REWARD_KEYWORDS, compute_step_rewards, load_process_reward_sources,
                                           resolve_process_spec)

    rows = read_step_jsonl(cfg.eval_file, keep_columns=True)
    columns = {k: [r["columns"].get(k) for r in rows] for k in sorted({k for r in rows for k in r["columns"]})}
    taken = sorted(PROCESS_REWARD_KEYWORDS & set(columns))  # a line holding both `steps` and `completions`, …
    if taken:
        raise ConfigError(f"{cfg.eval_file}: the key {taken[0]!r} is one a step-reward function gets from groupwise "
                          f"itself ({', '.join(sorted(PROCESS_REWARD_KEYWORDS))}), so it cannot be a column too: "
                          "rename it (a line gives its steps as `steps` or as `completions`, not both)")
    resolve_process_spec(cfg.process_reward_func, "process_reward_func")  # named before anything loads
    device = "cuda" if torch.cuda.is_available() else "cpu"
    [source] = load_process_reward_sources([cfg.process_reward_func], trust_remote_code=cfg.trust_remote_code,
                                           device=device)
    scores: list[list[float]] = []
    chunk = 64
    for lo in tqdm(range(0, len(rows), chunk), desc="scoring steps", disable=len(rows) <= chunk):
        part = rows[lo:lo + chunk]
        steps = [r["steps"] for r in part]
        scores += compute_step_rewards(
            [source], torch.ones(1), [r["prompt"] for r in part], [cfg.step_delimiter.join(s) for s in steps], steps,
            {k: v[lo:lo + chunk] for k, v in columns.items()}, on_error=cfg.on_reward_error)[0]
    metrics = step_metrics(scores, [r["labels"] for r in rows], cfg.threshold)
    metrics["eval/examples"] = float(len(rows))
    if cfg.output_file:
        os.makedirs(os.path.dirname(os.path.abspath(cfg.output_file)), exist_ok=True)
        with open(cfg.output_file, "w") as f:
            json.dump(metrics, f, indent=2)
    return metrics
