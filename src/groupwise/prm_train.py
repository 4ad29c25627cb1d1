"""`groupwise prm train CONFIG.yaml` — train a token-classification process reward model from step-labelled JSONL
(one object per line: `prompt`, `steps` (list of strings), `labels` (one 0/1 or bool per step, 1 = good step):
the Math-Shepherd / PRM800K shape; TRL's stepwise-supervision datasets, whose steps are in `completions`, are read
as they are), evaluate it on a held-out split (groupwise.prm_eval.step_metrics: step accuracy, F1, AUROC,
first-error accuracy), and save a folder that `groupwise.rewards.prm.load_prm` (and `process_reward_funcs:
[{path: …}]`) loads directly; groupwise_prm.json there records the kind, separator, prompt_separator, positive
label and max_length, which scoring uses by default.

Inputs are built exactly as TokenClassificationPRM reads them (`build_prm_input`: the whole text tokenized at once):
the loss is the cross-entropy of the step label at the last token of each step's separator; every other position is
ignored. The weights are float32 whatever the base's saved dtype (as load_prm scores them by default). One process,
on the GPU when CUDA is there (CUDA_VISIBLE_DEVICES='' keeps it on the CPU). Every save_steps it writes a resumable
checkpoint-N/ (groupwise.prm_checkpoint); a signal stops it after the current step with one written.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from groupwise import prm_checkpoint
from groupwise.config_base import ConfigError, StrictConfig, check_model_location, option, warn_user
from groupwise.config_trl import NotSupported
from groupwise.logging import warnings_above_bars
from groupwise.modeling import disable_dropout, eval_mode
from groupwise.prm_eval import step_metrics
from groupwise.rewards.prm import PRM_CONFIG, build_prm_input, position_limit
from groupwise.rewards.steps import check_writable
from groupwise.signals import interrupted, stop_on_signals
from groupwise.text import ensure_pad_token, pad_rows


_CUT = ("prm train cuts the text (prompt and steps, tokenized at once) at max_length from the right, and the steps "
        "past it go unlabelled; drop the field and set max_length")


@dataclass
class PRMTrainConfig(StrictConfig):
    # TRL's PRMConfig fields groupwise does not take, named with what to do instead (docs/trl_compat.md)
    UNSUPPORTED = {"train_on_last_step_only": NotSupported(False, "every step's label trains: drop the field"),
                   "max_prompt_length": NotSupported(None, _CUT), "max_completion_length": NotSupported(None, _CUT)}

    model_name_or_path: str = option("Base model folder or hub id (a causal LM gets a new 2-label token-classification head).", default="")
    train_file: str = option("Step-labelled JSONL: prompt, steps (or TRL's completions), labels.", default="")
    eval_file: str | None = option("Held-out JSONL (default: eval_fraction of train_file, seeded).", default=None)
    eval_fraction: float = option("Share of train_file's examples held out when eval_file is not given: whole prompts, all of a problem's solutions on one side.", default=0.1, gt=0, lt=1)
    output_dir: str = option("Where the trained PRM (safetensors), its tokenizer and eval_metrics.json go.", default="outputs/prm")
    separator: str = option("Text after each step; the step is judged at its last token.", default="\n")
    prompt_separator: str = option("Text between the prompt and the first step (recorded for scoring).", default="\n")
    learning_rate: float = option("AdamW learning rate.", default=2e-5, gt=0)
    weight_decay: float = option("AdamW weight decay.", default=0.0, ge=0)
    lr_scheduler_type: str = option("Learning-rate schedule over the run (transformers' names).", default="linear", choices=("linear", "cosine", "constant", "constant_with_warmup"))
    warmup_steps: int = option("Optimizer steps over which the learning rate rises linearly from 0.", default=0, ge=0)
    max_grad_norm: float = option("Clip the gradient to this global norm before each step (0: no clipping).", default=1.0, ge=0)
    num_train_epochs: int = option("Passes over the training examples.", default=1, ge=1)
    per_device_train_batch_size: int = option("Examples per optimizer step.", default=8, ge=1)
    max_length: int = option("Tokens kept per example (steps past it are not trained on).", default=1024, ge=1)
    seed: int = option("Seed of the split, the order and the head initialisation.", default=42)
    logging_steps: int = option("Every this many steps: the progress bar's loss, and a line of output_dir/train_log.jsonl (step, loss, grad_norm before clipping, learning_rate).", default=10, ge=1)
    save_steps: int = option("Write a resumable checkpoint-N/ to output_dir every this many optimizer steps (0: none; a signal still writes one). Each also loads as a PRM.", default=500, ge=0)
    save_total_limit: int | None = option("Keep at most this many checkpoint-N/ folders of the run (oldest deleted first; null, 0 or less: no limit; transformers).", default=None)
    resume_from_checkpoint: str | bool | None = option("A checkpoint-N/ folder of a prm train run to resume exactly, or true for the newest in output_dir (transformers' meaning).", default=None)
    overwrite_output_dir: bool = option("Let a new (not resumed) run delete the checkpoints another run left in output_dir; without it such a run refuses to start.", default=False)
    disable_dropout: bool = option("Turn the model's dropout off for training (TRL's PRMConfig default): the scores a PRM is judged and used by are dropout-free.", default=True)
    trust_remote_code: bool = option("Allow the base model's repository to run its own code.", default=False)

    def validate(self) -> None:
        if not self.model_name_or_path:
            raise ConfigError("model_name_or_path is required")
        if not self.train_file:
            raise ConfigError("train_file is required (JSONL with prompt, steps, labels)")
        if not self.separator:
            raise ConfigError("separator must be a non-empty string")


def read_step_jsonl(path: str, keep_columns: bool = False) -> list[dict[str, Any]]:
    """Rows {prompt, steps, labels} of a step-labelled JSONL; the steps may be given as `steps` or, as in TRL's
    stepwise-supervision datasets, `completions`. Each step is stripped of the whitespace around it, as GRPO's
    splitter gives a PRM the policy's steps (groupwise.rewards.steps). A bad line is a ConfigError naming the file,
    line and field."""
    rows = []
    if str(path).endswith((".parquet", ".arrow", ".csv", ".json.gz")) or Path(path).is_dir():
        raise ConfigError(f"{path} is not a JSONL file: the step-labelled data is read as JSON lines (prompt, steps or "
                          "completions, labels); write a datasets.Dataset as one with Dataset.to_json(path)")
    with open(path, "rb") as f:  # UTF-8 whatever the locale; a bad byte names its line
        for line_no, raw in enumerate(f, 1):
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{where}: not UTF-8 ({e}): save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: not JSON ({e}): write one JSON object per line") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{where}: a line must be a JSON object with prompt, steps, labels")
            if "steps" in row and "completions" in row:
                raise ConfigError(f"{where}: both 'steps' and 'completions' (TRL's name for them): keep one")
            step_key = "steps" if "steps" in row or "completions" not in row else "completions"
            for key in ("prompt", step_key, "labels"):
                if key not in row:
                    raise ConfigError(f"{where}: missing {key!r} (need prompt, steps (or TRL's completions), labels)")
            prompt, steps, labels = row["prompt"], row[step_key], row["labels"]
            if not (isinstance(prompt, str) or isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt)):
                raise ConfigError(f"{where}: 'prompt' must be a string or a list of chat messages "
                                  f"({{\"role\", \"content\"}}), got {type(prompt).__name__}")
            if not isinstance(steps, list) or not all(isinstance(s, str) for s in steps):
                raise ConfigError(f"{where}: {step_key!r} must be a list of strings (one per step)")
            if not steps or any(not s.strip() for s in steps):  # a policy's blank steps are dropped when it is split
                i = next((k for k, s in enumerate(steps) if not s.strip()), None)
                raise ConfigError(f"{where}: " + (f"{step_key!r} is empty" if i is None else
                                                  f"step {i} is blank ({steps[i]!r})") +
                                  ": give each example at least one step, each with text")
            if not isinstance(labels, list):
                raise ConfigError(f"{where}: 'labels' must be a list of 0/1 (one per step), got {labels!r:.80}")
            if len(labels) != len(steps):
                raise ConfigError(f"{where}: {len(labels)} labels for {len(steps)} steps (give 'labels' one label "
                                  "per step)")
            if not all(lbl in (0, 1) for lbl in labels):  # True / False are 1 / 0
                raise ConfigError(f"{where}: labels must be 0/1 or true/false, got {labels}")
            rows.append({"prompt": prompt, "steps": [s.strip() for s in steps], "labels": [int(x) for x in labels]})
            if keep_columns:  # the other keys: a step-reward function's dataset columns (groupwise prm eval)
                rows[-1]["columns"] = {k: v for k, v in row.items() if k not in ("prompt", step_key, "labels")}
    if not rows:
        raise ConfigError(f"{path}: no examples (need JSONL lines of prompt, steps, labels)")
    return rows


def _prompt_key(row: dict) -> str:
    return json.dumps(row["prompt"], sort_keys=True)


def split_by_prompt(rows: list[dict], fraction: float, seed: int, where: str) -> tuple[list[dict], list[dict]]:
    """(train, held out): whole prompts held out, in a seeded order, until `fraction` of the examples (at least one)
    are. Step-labelled data has many solutions per problem (Math-Shepherd, PRM800K): a split by example would
    score solutions of problems the PRM trained on, and overstate its held-out accuracy. With one prompt in all, the
    examples are held out one by one, with a warning."""
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(_prompt_key(r), []).append(i)
    if len(groups) < 2:
        warn_user(f"{where}: all {len(rows)} examples have one prompt, so the held-out examples are solutions of the "
                  "prompt the PRM trains on; give an eval_file of other problems to measure how it generalises")
        groups = {str(i): [i] for i in range(len(rows))}
    keys = list(groups)
    random.Random(seed).shuffle(keys)
    target = max(1, round(fraction * len(rows)))
    held: list[int] = []
    for key in keys[:-1]:  # at least one prompt stays for training
        if len(held) >= target:
            break
        held += groups[key]
    if not held:
        raise ConfigError(f"{where} has {len(rows)} example(s): too few to hold out any for evaluation (give more, "
                          "or an eval_file)")
    if len(held) > 2 * target:  # one prompt with many solutions took the held-out share past eval_fraction
        warn_user(f"{where}: {len(held)} of {len(rows)} examples are held out (eval_fraction asks for {target}): "
                  "whole prompts are held out and one has many examples; give an eval_file to choose")
    held_set = set(held)
    return [r for i, r in enumerate(rows) if i not in held_set], [rows[i] for i in sorted(held)]


def _encode(rows, tokenizer, cfg: PRMTrainConfig, max_length: int | None = None, desc: str | None = None):
    out = []
    for r in tqdm(rows, desc=desc, disable=desc is None or len(rows) < 1000):
        try:
            ids, positions = build_prm_input(tokenizer, r["prompt"], r["steps"], cfg.separator,
                                             max_length=max_length or cfg.max_length,
                                             prompt_separator=cfg.prompt_separator, refuse_merged=True)
        except ValueError as e:  # the separator and this tokenizer (a token judging a step runs into the next, or
            # two steps at one token, which implies it): named with the example's steps
            raise ConfigError(f"{e}. Steps: {r['steps']!r:.200}") from None
        labels = [-100] * len(ids)
        for p, lbl in zip(positions, r["labels"]):
            labels[p] = lbl
        out.append((ids, labels))
    return out


def _batches(encoded, size: int, pad_id: int):
    for lo in range(0, len(encoded), size):
        chunk = encoded[lo:lo + size]
        ids, mask = pad_rows([x for x, _ in chunk], pad_id)
        labels, _ = pad_rows([y for _, y in chunk], -100)
        yield ids, mask, labels


@torch.no_grad()
def evaluate_prm(model, encoded, pad_id: int, batch_size: int = 16,
                 labels: list[list[int]] | None = None) -> dict[str, float]:
    """groupwise.prm_eval.step_metrics of P(good) at each labelled token (> 0.5: the argmax of the two labels).
    `labels`: each example's labels, every step's: those past max_length (no label in `encoded`) count unscored."""
    scores = []
    with eval_mode(model):
        for ids, mask, marks in tqdm(_batches(encoded, batch_size, pad_id), desc="PRM eval", leave=False,
                                     total=math.ceil(len(encoded) / batch_size), disable=len(encoded) <= batch_size):
            logits = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device)).logits
            good = torch.softmax(logits.float(), -1)[..., 1].cpu()
            scores += [good[i][marks[i] != -100].tolist() for i in range(len(ids))]
    labels = labels or [[y for y in marks if y != -100] for _, marks in encoded]
    return step_metrics([row + [None] * (len(gold) - len(row)) for row, gold in zip(scores, labels)], labels)


def train_prm(cfg: PRMTrainConfig) -> dict[str, float]:
    from transformers import AutoModelForTokenClassification, AutoTokenizer, get_scheduler

    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:  # each process would train the whole run into one folder
        raise ConfigError(f"prm train runs in one process, but WORLD_SIZE={os.environ['WORLD_SIZE']} (a launcher "
                          "such as torchrun or accelerate launch): run `groupwise prm train` directly")
    if not Path(cfg.train_file).is_file():
        raise ConfigError(f"train_file={cfg.train_file!r} does not exist: give a JSONL of prompt, steps, labels")
    if not cfg.resume_from_checkpoint:  # a resume loads the checkpoint, not the base
        check_model_location(cfg.model_name_or_path, "model_name_or_path")  # a wrong folder, named before anything
    base_dir = Path(cfg.model_name_or_path)
    if base_dir.exists() and Path(cfg.output_dir).resolve() == base_dir.resolve():
        raise ConfigError(f"output_dir {cfg.output_dir!r} is model_name_or_path: the PRM would overwrite the base "
                          "model; give another output_dir")
    rows = read_step_jsonl(cfg.train_file)  # data errors surface before any model loads
    inside = sum(cfg.separator in step for r in rows for step in r["steps"])
    if inside:  # labelled at its end only, while GRPO's step_delimiter splits it there: scored where never trained
        warnings.warn(f"{inside} step(s) of {cfg.train_file} contain the separator {cfg.separator!r}: each is "
                      "labelled at its end only, but a completion split on that separator (step_delimiter) makes "
                      "several steps of it, scored at tokens the PRM never learned; choose a separator no step "
                      "contains (and the same step_delimiter in GRPO)", UserWarning, stacklevel=2)
    resume, state = prm_checkpoint.start(cfg)  # so do a checkpoint of another run, and output_dir's claim
    rng = random.Random(cfg.seed)  # the batch order
    if cfg.eval_file:
        train_rows, eval_rows = rows, read_step_jsonl(cfg.eval_file)
        shared = {_prompt_key(r) for r in train_rows} & {_prompt_key(r) for r in eval_rows}
        if shared:
            warnings.warn(f"{len(shared)} prompt(s) of eval_file {cfg.eval_file} are also in train_file: their "
                          "held-out metrics measure solutions of problems the PRM trained on", UserWarning,
                          stacklevel=2)
    else:
        train_rows, eval_rows = split_by_prompt(rows, cfg.eval_fraction, cfg.seed, cfg.train_file)
    torch.manual_seed(cfg.seed)
    source = resume or cfg.model_name_or_path
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    ensure_pad_token(tokenizer, f"the tokenizer of {source}")
    check_writable(tokenizer, cfg.separator, "separator", f"the tokenizer of {source}",
                   "every step would be judged at its unknown token")
    # float32 weights whatever the saved dtype (transformers 5 keeps it): AdamW's small steps vanish in bf16
    # weights, and load_prm scores in float32 by default, so the held-out numbers are the ones it reproduces
    # a base with a classification head of another size (an outcome reward model's 1 label, a 3-label tagger):
    # its backbone is kept and the head starts anew, as for a causal LM (a resumed PRM's head always fits)
    model, info = AutoModelForTokenClassification.from_pretrained(
        source, num_labels=2, id2label={0: "bad", 1: "good"}, label2id={"bad": 0, "good": 1},
        trust_remote_code=cfg.trust_remote_code, dtype=torch.float32, output_loading_info=True,
        ignore_mismatched_sizes=resume is None)
    new_head = sorted(info["missing_keys"]) + sorted(k for k, *_ in info.get("mismatched_keys", []))
    if new_head:  # a causal LM (or any base without this head): the head starts from the seed
        base = ", ".join(model.config.architectures or []) or "a model without a token-classification head"
        print(f"{cfg.model_name_or_path} ({base}): a new 2-label token-classification head "
              f"({', '.join(new_head)}) initialised with seed {cfg.seed}; label 1 = good step")
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model.to("cuda" if torch.cuda.is_available() else "cpu")  # CUDA_VISIBLE_DEVICES='' for the CPU
    # a base model with fewer positions than max_length (BERT-like: 512) would index past its position table
    max_length = min(cfg.max_length, position_limit(model, tokenizer) or cfg.max_length)
    # what load_prm passes to TokenClassificationPRM: scoring sees inputs cut as in training
    record = {"kind": "token_classification", "separator": cfg.separator, "prompt_separator": cfg.prompt_separator,
              "positive_label": 1, "max_length": max_length}
    eval_labels = [r["labels"] for r in eval_rows]  # every step's: those past max_length are counted unscored
    train_enc, eval_enc = (_encode(r, tokenizer, cfg, max_length, desc) for r, desc in
                           ((train_rows, "PRM tokenize (train)"), (eval_rows, "PRM tokenize (eval)")))
    # an example whose steps are all past max_length adds no loss: left out, so that every batch is an update and
    # the schedule's length (warmup, decay to 0) counts the updates that happen
    n_train, train_enc = len(train_enc), [e for e in train_enc if any(lbl != -100 for lbl in e[1])]
    if not train_enc:
        raise ConfigError(f"no step of {cfg.train_file} fits in max_length={max_length} tokens (prompt + steps): "
                          "nothing to train on; raise max_length or shorten the prompts")
    if not any(lbl != -100 for _, labels in eval_enc for lbl in labels):
        warnings.warn(f"no step of the held-out examples fits in max_length={max_length} tokens (prompt + steps): "
                      "the eval metrics are empty (eval/steps 0); raise max_length or give another eval_file",
                      UserWarning, stacklevel=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    steps = cfg.num_train_epochs * math.ceil(len(train_enc) / cfg.per_device_train_batch_size)
    schedule = get_scheduler(cfg.lr_scheduler_type, optimizer, num_warmup_steps=cfg.warmup_steps,
                             num_training_steps=steps)
    if resume:  # the held-out metrics before training are the first run's
        prm_checkpoint.restore(resume, optimizer=optimizer, scheduler=schedule)
    else:
        state["eval_before"] = evaluate_prm(model, eval_enc, tokenizer.pad_token_id, labels=eval_labels)
    before, step = state["eval_before"], state["step"]
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = _open_log(out / "train_log.jsonl", step)
    bar = tqdm(total=steps, initial=step, desc="PRM")
    saved = step

    def save_checkpoint() -> Path:
        return prm_checkpoint.save(cfg, step, model=model, tokenizer=tokenizer, optimizer=optimizer,
                                   scheduler=schedule, state=state, prm_record=record)

    model.train()
    if cfg.disable_dropout:
        disable_dropout(model)
    # SIGINT / SIGTERM: stop after this step, checkpoint, evaluate and save; a warning is written above the bar
    with stop_on_signals() as received, warnings_above_bars():
        for ids, mask, labels in _remaining_batches(train_enc, rng, cfg, tokenizer.pad_token_id, step):
            loss, grad_norm, lr = _train_step(model, optimizer, schedule, ids, mask, labels, cfg.max_grad_norm)
            step += 1
            bar.update(1)
            if step % cfg.logging_steps == 0:  # (.item() waits for the GPU: only here)
                bar.set_postfix(loss=f"{loss.item():.4f}")
                log.write(json.dumps({"step": step, "loss": loss.item(), "grad_norm": grad_norm.item(),
                                      "learning_rate": lr}) + "\n")
                log.flush()
            if cfg.save_steps and step % cfg.save_steps == 0 or received and step > saved:
                save_checkpoint()
                saved = step
            if received:
                break
    bar.close()
    log.close()
    after = evaluate_prm(model, eval_enc, tokenizer.pad_token_id, labels=eval_labels)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / PRM_CONFIG).write_text(json.dumps(record, indent=2))
    metrics = {**after, **{k.replace("eval/", "eval_before/"): v for k, v in before.items()},
               "train/examples": float(n_train), "train/examples_without_steps": float(n_train - len(train_enc)),
               "train/steps": float(step), "train/planned_steps": float(steps)}
    (out / "eval_metrics.json").write_text(json.dumps(metrics, indent=2))
    print(f"PRM step accuracy {before['eval/accuracy']:.3f} → {after['eval/accuracy']:.3f}, "
          f"bad-step F1 {after['eval/bad_f1']:.3f}, good-step F1 {after['eval/good_f1']:.3f}; saved to {out}")
    if received and step < steps:
        raise interrupted(received[0], f"stopped by {signal.Signals(received[0]).name} after step {step} of "
                                       f"{steps}; the PRM trained so far is saved in {out} (evaluated above) "
                                       f"and in {out / f'checkpoint-{step}'}: resume it with "
                                       "--resume_from_checkpoint true")
    return metrics


def _open_log(path: Path, step: int):
    """train_log.jsonl for appending from `step`: a new run starts it empty; a resume keeps its lines up to the
    checkpoint's step (the lines past it are the interrupted branch's)."""
    kept = []
    if step and path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a line cut by a kill
                if json.loads(line).get("step", math.inf) <= step:
                    kept.append(line + "\n")
    path.write_text("".join(kept))
    return path.open("a")


def _remaining_batches(train_enc, rng: random.Random, cfg: PRMTrainConfig, pad_id: int, done: int):
    """Every epoch's batches, the examples shuffled by `rng` at the start of each, from step done + 1 on: a resume
    replays the (seeded) shuffles of the steps done and skips their batches, so it sees the uninterrupted order."""
    step = 0
    for _ in range(cfg.num_train_epochs):
        rng.shuffle(train_enc)
        for batch in _batches(train_enc, cfg.per_device_train_batch_size, pad_id):
            step += 1
            if step > done:
                yield batch


def _train_step(model, optimizer, schedule, ids, mask, labels, max_grad_norm: float):
    """One optimizer step on the cross-entropy of the labelled positions; returns (the loss, the gradient norm before
    clipping: 0-d tensors, the learning rate the step used)."""
    ids, mask, labels = (t.to(model.device) for t in (ids, mask, labels))
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.view(-1, 2), labels.view(-1), ignore_index=-100)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm or math.inf)
    lr = schedule.get_last_lr()[0]  # the rate this step uses
    optimizer.step()
    schedule.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), grad_norm, lr
