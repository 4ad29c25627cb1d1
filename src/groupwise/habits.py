"""What TRL / transformers users call on a trainer besides train() and evaluate(): save_model, push_to_hub,
log_metrics, save_metrics, save_state, and the TrainOutput-like value train() returns; and transformers' flow after
an optimizer step (the epoch's end, then log / evaluate / save as the control's flags say). A mixin of GRPOTrainer:
it reads the trainer's args, dist, state, control, tokenizer and models."""

from __future__ import annotations

import json
import math
import os
import re
import time
from functools import partial
from pathlib import Path

import torch
from tqdm.auto import tqdm

from groupwise.agents import environment_prompts
from groupwise.config_base import ConfigError
from groupwise.data import PromptData, is_stream, named_datasets
from groupwise.data_checks import check_same_everywhere
from groupwise.distributed import exact_dtype
from groupwise.hub import check_card, completions_uploader, push_checkpoint, push_folder, repo_id, write_model_card
from groupwise.logging import (EVAL_COMPLETIONS, MetricsLogger, append_rows, completion_rows, print_rows,
                               speed_metrics, window_summary)
from groupwise.loading import check_dataset
from groupwise.modeling import eval_mode
from groupwise.rewards.combine import reward_weights as weights_of

# transformers' own log keys: their NaN is logged as NaN; every other metric (TRL's `_metrics`) with no finite value
# in the logging window is logged as None, as TRL's log() does (and as metrics.jsonl, hence a resumed history, has it)
TRANSFORMERS_KEYS = ("loss", "grad_norm", "learning_rate")


class TrainResult(dict):
    """What train() returns: the last logged metrics (a dict), also readable as transformers' TrainOutput —
    `.global_step`, `.training_loss` (the mean `loss` of this call's steps) and `.metrics` (the end-of-training
    line: train_runtime, train_samples_per_second, train_steps_per_second, total_flos, train_loss, epoch), so TRL
    scripts' `train_result.metrics` works."""

    def __init__(self, last: dict[str, float], global_step: int, training_loss: float, metrics: dict[str, float]):
        super().__init__(last)
        self.global_step, self.training_loss, self.metrics = global_step, training_loss, metrics


class TransformersHabits:
    _card_defaults: dict | None = None  # model-card keywords every push uses (the CLI's dataset_name, as TRL's script)

    # TRL's trainer attributes, read-only views of groupwise's own
    @property
    def processing_class(self):
        return self.tokenizer

    @property
    def train_dataset(self):
        return self.train_data.data

    @property
    def eval_dataset(self):
        if isinstance(self.eval_data, dict):
            return {name: data.data for name, data in self.eval_data.items()}
        return self.eval_data.data if self.eval_data is not None else None

    @property
    def reward_funcs(self) -> list:
        """As TRL: each reward function, or reward model, in the order given."""
        return [s.fn if s.fn is not None else s.model for s in self.reward_sources]

    @property
    def reward_processing_classes(self) -> list:
        return [s.tokenizer for s in self.reward_sources]

    @property
    def accelerator(self):
        return self.dist.accelerator

    @property
    def hub_model_id(self) -> str | None:
        """The hub repository pushes go to, on the main process (transformers' attribute; None on the others): the
        repository's full id once a push happened (read from its commit URL), before that hub_model_id or, with
        push_to_hub, output_dir's folder name. Setting it sets args.hub_model_id: the next pushes go there."""
        if not self.dist.is_main:
            return None
        url = getattr(self, "_hub_commit_url", None)
        found = re.match(r"^https?://[^/]+/(.+?)/commit/", url) if isinstance(url, str) else None
        return found[1] if found else repo_id(self.args) if self.args.push_to_hub else self.args.hub_model_id

    @hub_model_id.setter
    def hub_model_id(self, value: str | None) -> None:
        self.args.hub_model_id, self._hub_commit_url = value, None

    def end(self) -> None:
        """transformers' Trainer.end() (TRL's scripts call it last): the trackers were closed by train(); the
        process group is destroyed, so nothing that talks to the other processes (train, evaluate, save_model,
        push_to_hub) can run after it."""
        self.dist.teardown()

    @property
    def ref_model(self):
        """The frozen reference copy; None when β = 0 and for a PEFT policy (the policy with its adapters off), as
        in TRL."""
        return self.reference.copy if self.reference is not None else None

    @property
    def lr_scheduler(self):
        return self.scheduler

    @property
    def num_generations(self) -> int:
        return self.args.num_generations

    def is_world_process_zero(self) -> bool:
        return self.dist.is_main

    def is_local_process_zero(self) -> bool:
        return self.dist.is_local_main

    @property
    def reward_func_names(self) -> list[str]:
        """As TRL: each reward function's name in the metrics (`rewards/<name>/mean`), in order."""
        return [s.name for s in self.reward_sources]

    @property
    def reward_weights(self) -> torch.Tensor:  # (F,)
        """As TRL: the weight of each reward function (reward_weights, else 1), float32."""
        return weights_of(self.args.reward_weights, len(self.reward_sources))

    def push_to_hub(self, commit_message: str = "groupwise: end of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None,
                    **card) -> str | None:
        """Save the model to output_dir with a model card (README.md, from TRL's / transformers' card keywords:
        model_name, dataset_name, tags, …) and upload it (model, tokenizer, config, card, and the `completions/`
        parquet tables of log_completions, as TRL; not the checkpoints, metrics.jsonl / completions.jsonl or the
        tensorboard `runs/`) to hub_model_id (default: output_dir's folder name), as transformers' Trainer.push_to_hub. Uploads
        are synchronous (`blocking` is accepted for TRL scripts). Returns the upload's CommitInfo (a str, the commit
        URL, with `.oid`) on the main process, as transformers.
        Callbacks' `on_push_begin` fires first on every process, as in transformers."""
        self._event("on_push_begin")
        return self._upload(commit_message, token, revision, private, card)

    def _upload(self, commit_message: str, token: str | None = None, revision: str | None = None,
                private: bool | None = None, card: dict | None = None) -> str | None:
        card = {**(self._card_defaults or {}), **(card or {})}
        check_card(card)  # on every process, before anything is written
        out = self.args.output_dir
        self.save_model(out, _internal_call=True)
        base = getattr(getattr(self.unwrapped, "config", None), "_name_or_path", None) or None
        if base is not None and os.path.isdir(base):  # a local folder is no hub id: left out, as TRL's card does
            base = None
        if self.dist.is_main:
            write_model_card(out, self.args, base, **card)
        self._pushed_at = self.global_step
        # the main process uploads; a failure there stops every process instead of leaving them in a barrier
        url = self.dist.run_together(
            lambda: push_folder(self.args, out, commit_message, token=token, revision=revision, private=private)
            if self.dist.is_main else None, "push_to_hub")
        self._hub_commit_url = url if url is not None else getattr(self, "_hub_commit_url", None)
        return url

    def _push_save(self, checkpoint) -> None:
        """push_to_hub at a save, by hub_strategy (transformers' _push_from_checkpoint): the model (output_dir), then
        with 'checkpoint' the whole checkpoint to the repository's last-checkpoint/ folder (replacing it: for
        resuming), with 'all_checkpoints' to its checkpoint-N/ folder."""
        message = f"groupwise: step {self.global_step}"
        if self.dist.is_main:  # transformers' _push_from_checkpoint: on the main process only
            self._event("on_push_begin")
        self._upload(message)
        if self.args.hub_strategy in ("checkpoint", "all_checkpoints"):
            self.dist.run_together(lambda: push_checkpoint(self.args, str(checkpoint), f"{message}, checkpoint")
                                   if self.dist.is_main else None, "push_to_hub (checkpoint)")

    def _best_at_end(self) -> None:
        """transformers' end of training: load_best_model_at_end loads the best checkpoint's weights (and the final
        push uploads them: the last save's push had the last step's); with save_total_limit=1 this run's checkpoints
        other than the best are deleted (the rotation kept the newest beside it)."""
        from groupwise.checkpoint import keep_only_best
        from groupwise.checkpoint_load import load_model_from

        args, best = self.args, self.state.best_model_checkpoint
        if args.load_best_model_at_end and best is not None:
            self.dist.run_together(lambda: load_model_from(
                best, dist=self.dist, model=self.unwrapped,
                sharded_model=self.unwrapped if self.dist.sharding is not None else None), "loading the best model")
            self._weights_changed()
            if Path(best).name != f"checkpoint-{self.global_step}":  # not the weights pushed at this step
                self._pushed_at = None
        if best is not None and args.save_total_limit == 1:
            self.dist.run_together(lambda: self.dist.is_main and keep_only_best(args.output_dir, self.run_id, best),
                                   "deleting the checkpoints other than the best (save_total_limit=1)")

    def _elapsed(self) -> dict[str, float]:
        return {"time/elapsed": time.perf_counter() - self._started}  # this process's run

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """transformers' Trainer.log: `logs` (with the epoch, once training has begun) to state.log_history (with the
        step) and the callbacks' on_log; during train() also to metrics.jsonl (with `time/elapsed`) and the trackers,
        after train() to metrics.jsonl only (the trackers are closed). `start_time` is accepted for transformers'
        signature."""
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        if getattr(self, "_logger", None) is not None:
            self._logger.log(self.global_step, {**logs, **self._elapsed()})
        self.state.log_history.append({**logs, "step": self.global_step})
        self._event("on_log", logs=logs)  # printed by ProgressCallback / PrinterCallback (groupwise.callbacks)

    def _log(self, rollout) -> None:
        """A training log line: the window's metrics (groupwise.logging.window_summary), the round's completions
        (completions.jsonl; with log_completions printed and TRL's completions table)."""
        last = window_summary(self._window, self.args.logging_nan_inf_filter)
        self._last = last = {k: None if k not in TRANSFORMERS_KEYS and isinstance(v, float) and math.isnan(v) else v
                             for k, v in last.items()}
        self._window.clear()
        self.log(last, start_time=self._start_time)  # transformers passes train()'s start (time.time())
        rows = self._round_rows(rollout)
        self._logger.log_completions(self.global_step, rows)
        if self.args.log_completions and rows and self.dist.is_main:
            print_rows(self.global_step, rows, self.args.num_completions_to_print)
            self._logger.log_table(self.global_step, rows, unique_prompts=self.args.log_unique_prompts)

    def _round_rows(self, rollout) -> list[dict]:
        """The round's completions.jsonl rows, every process's (gathered once per round; a round restored from a
        checkpoint has the rows its checkpoint saved)."""
        if self._rows is None and rollout.round is not None:
            names = [src.name for src in self.reward_sources]
            self._rows = self.dist.gather_object(completion_rows(rollout.round, names, self._extra))
        return self._rows or []

    def _log_metric(self, name: str, value: float) -> None:
        """TRL's `log_metric` reward keyword: a scalar, averaged over the round's calls on every process (once per
        round, _flush_logged), then over the logging window, logged under `name`."""
        self._logged[name].append(float(value))

    def _flush_logged(self) -> dict[str, float]:
        """After a round: each log_metric name's mean over every process's calls (TRL's flush after a generation
        batch; a collective, so every process calls it)."""
        logged, self._logged = self._logged, type(self._logged)(list)
        names = sorted(set(self.dist.gather_object(sorted(logged))))  # processes may log different names
        if not names:
            return {}
        local = [[sum(logged.get(n, [])), float(len(logged.get(n, [])))] for n in names]
        dtype = exact_dtype(self.dist.device)
        totals = self.dist.sum(torch.tensor(local, dtype=dtype)).tolist()
        return {n: total / count for n, (total, count) in zip(names, totals) if count}

    def _log_extra(self, column: str, values: list) -> None:
        """TRL's `log_extra` reward keyword: a column of completions.jsonl, one value per completion of the call."""
        self._extra[column].extend(values)

    def _summary(self) -> dict[str, float]:
        """transformers' end-of-training line (speed, total_flos, train_loss: the mean loss of this call's steps),
        logged like any other."""
        args, steps = self.args, self.global_step - self._first_step
        samples = steps * args.per_device_train_batch_size * args.gradient_accumulation_steps * self.dist.world_size
        summary = {**speed_metrics(time.perf_counter() - self._started, steps, samples),
                   "total_flos": self.state.total_flos,
                   "train_loss": self._loss_sum / self._loss_steps if self._loss_steps else float("nan")}
        self.log(summary)
        return summary

    def _flos(self, tokens: float) -> float:
        """transformers' estimate for training on `tokens` tokens (all processes'), 6 × the policy's parameters
        without the embeddings × tokens, for each of the num_iterations passes over them."""
        count = getattr(self.unwrapped, "num_parameters", None)
        params = count(exclude_embeddings=True) if count else sum(p.numel() for p in self.unwrapped.parameters())
        return 6.0 * params * tokens * self.args.num_iterations

    def evaluate(self, eval_dataset=None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """transformers' Trainer.evaluate(): groupwise.evaluation.evaluate (greedy, or num_generations_eval samples
        per prompt with mean@k / pass@k) on `eval_dataset` (default: the trainer's; a dict: each dataset in turn, its
        metrics prefixed with `metric_key_prefix`_<name>, each evaluation logged and passed to on_evaluate as
        transformers' evaluate() does; a str: the trainer's dataset of that name). The metrics, named
        `metric_key_prefix`_<TRL name>, are logged (metrics.jsonl during training, state.log_history, on_log) and
        passed to on_evaluate."""
        given = eval_dataset is not None and not isinstance(eval_dataset, str)
        data = self._eval_data(eval_dataset) if given else self._trainers_eval_data(eval_dataset)
        if given:  # the same rows on every process, as the constructor's (each evaluates its share of the prompts)
            check_same_everywhere(self.dist, {d.name: d for d in data.values()} if isinstance(data, dict) else
                                  {data.name: data})
        with self.dist.naming_stuck_collectives(self.PHASES, lambda names: f"after step {self.global_step}"):
            if isinstance(data, dict):
                return {k: v for name, one in data.items()
                        for k, v in self._evaluate_one(one, given, ignore_keys, f"{metric_key_prefix}_{name}").items()}
            return self._evaluate_one(data, given, ignore_keys, metric_key_prefix)

    def _eval_data(self, dataset, name: str = "eval_dataset") -> PromptData | dict[str, PromptData]:
        """An eval dataset (the constructor's or evaluate()'s), or {name: dataset} as a dict of them; with
        environments its rows may lack a prompt."""
        if named_datasets(dataset, name):
            if not dataset:
                raise ConfigError(f"{name} is an empty dict: pass a dataset, or {{name: dataset, …}} with at least "
                                  "one")
            bad = [k for k in dataset if not isinstance(k, str) or not k]
            if bad:
                raise ConfigError(f"{name} is a dict of datasets whose key {bad[0]!r} is not a name: its metrics are "
                                  f"named eval_<key>_…, so use non-empty strings as keys")
            return {key: self._eval_data(data, f"{name}[{key!r}]") for key, data in dataset.items()}
        if is_stream(dataset):
            raise ConfigError(f"{name} must be a datasets.Dataset or a list of dicts (evaluation reads every "
                              "row); an IterableDataset can be materialised with Dataset.from_list(list(stream))")
        return PromptData(environment_prompts(dataset, self.toolbox), name)

    def _trainers_eval_data(self, name: str | None):
        """The trainer's eval data; `name`: one of its datasets given as {name: dataset} (transformers'
        get_eval_dataloader takes a name)."""
        if self.eval_data is None:
            raise ConfigError("evaluate() needs an eval_dataset (pass it to GRPOTrainer or to evaluate())")
        if name is None:
            return self.eval_data
        if not isinstance(self.eval_data, dict) or name not in self.eval_data:
            names = sorted(self.eval_data) if isinstance(self.eval_data, dict) else []
            raise ConfigError(f"evaluate(eval_dataset={name!r}): a name picks one of the trainer's eval datasets "
                              f"given as {{name: dataset}}, which are {names}; pass a dataset instead")
        return self.eval_data[name]

    def _evaluate_one(self, data, given: bool, ignore_keys, metric_key_prefix: str) -> dict[str, float]:
        """evaluate() on one dataset; `given`: passed to evaluate() (checked now), not the trainer's (checked when
        the trainer was built)."""
        from groupwise.evaluation import evaluate

        if given and self.rollout_func is None:  # a rollout_func tokenizes its prompts itself
            check_dataset(data, [s.fn for s in self.reward_sources if s.fn is not None],
                          [s.fn for s in self.process_sources if s.fn is not None], self.args, self.toolbox)
            self._check_lengths(data)
        from transformers import ProgressCallback

        start = time.perf_counter()
        # in eval mode, as transformers' evaluation loop: a rollout_func or reward function reading
        # trainer.model.training knows it is evaluating (TRL's _generate tells the two apart by it); on_log and
        # on_evaluate see the model in eval mode too (transformers sets train mode again at the next step)
        samples: list[dict] = []  # every completion's row (the main process's list): eval_completions.jsonl
        with eval_mode(self.unwrapped), eval_mode(self.sampling_model):
            raw = evaluate(self.rollout_ctx, self.sampling_model, data, self.reward_sources, self.state,
                           on_batch=lambda: self._event("on_prediction_step"),
                           progress=any(isinstance(c, ProgressCallback) for c in self.callback_handler.callbacks),
                           samples=samples)
            if self.dist.is_main:
                append_rows(Path(self.args.output_dir) / EVAL_COMPLETIONS, self.global_step, self.run_id,
                            samples, dataset=metric_key_prefix)
            metrics = {f"{metric_key_prefix}_{k}": None if isinstance(v, float) and math.isnan(v) else v  # TRL
                       for k, v in raw.items() if k not in (ignore_keys or ())}
            # transformers' speed metrics: prompts evaluated, batches of per_device_eval_batch_size prompts per process
            per_step = self.args.per_device_eval_batch_size * self.dist.world_size
            metrics.update(speed_metrics(time.perf_counter() - start, math.ceil(len(data) / per_step), len(data),
                                         metric_key_prefix))
            self.log(metrics)  # with the epoch, as transformers' evaluate() returns it
            self._event("on_evaluate", metrics=metrics)
        return metrics

    def _check_lengths(self, data):
        """Prompt lengths of a dataset (the constructor's, or one given to evaluate()): truncate_prompt cuts with a
        warning or is an error; room for max_completion_length in the model's positions, and in the sampler's context
        when lower (_sampler_limit: a colocated engine's vllm_max_model_length, which would stop the completion short,
        as TRL's does silently; a vLLM server's max_model_len, read once it is reached, which refuses the request).
        Returns `data`."""
        args = self.args
        data.check_lengths(self.tokenizer, max_prompt_length=args.max_prompt_length,
                           max_completion_length=args.max_completion_length, max_positions=self._max_positions,
                           truncate_prompt=args.truncate_prompt, chat_template_kwargs=args.chat_template_kwargs,
                           sampler_limit=self._sampler_limit)
        return data

    # transformers' callback list (groupwise.callbacks.CallbackHandler)
    def add_callback(self, callback) -> None:
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback):
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback) -> None:
        self.callback_handler.remove_callback(callback)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The policy (safetensors) and its tokenizer, loadable with from_pretrained (TRL / transformers' name). With
        push_to_hub, a call from the user also uploads output_dir's model ("Model save", as transformers). Under DDP
        a user may call it on the main process alone (`if trainer.is_world_process_zero():`), as with transformers;
        with fsdp (the weights gathered) or push_to_hub (the upload's failure shared), every process calls it."""
        out = output_dir or self.args.output_dir
        collective = self.dist.sharding is not None or _internal_call or self.args.push_to_hub
        # called on the main process alone under fsdp, its gather waits ddp_timeout, then says so (PHASES)
        with self.dist.naming_stuck_collectives(self.PHASES, lambda names: f"after step {self.global_step}"):
            model, weights = self.consolidated()  # with fsdp every process gathers
            if self.dist.is_main:
                model.save_pretrained(out, safe_serialization=True, state_dict=weights)
                self.tokenizer.save_pretrained(out)
            if collective:
                self.dist.barrier()
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save")

    def log_metrics(self, split: str, metrics: dict) -> None:
        """Print `metrics` as a table under `split` (main process), as transformers' Trainer.log_metrics."""
        if self.dist.is_main:
            width = max((len(k) for k in metrics), default=0)
            tqdm.write(f"***** {split} metrics *****\n" + "\n".join(f"  {k:<{width}} = {v}" for k, v in metrics.items()))

    def save_metrics(self, split: str, metrics: dict, combined: bool = True) -> None:
        """output_dir/{split}_results.json, and merged into all_results.json (transformers' Trainer.save_metrics)."""
        if not self.dist.is_main:
            return
        out = Path(self.args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{split}_results.json").write_text(json.dumps(metrics, indent=2, sort_keys=True))
        if combined:
            path = out / "all_results.json"
            merged = json.loads(path.read_text()) if path.exists() else {}
            path.write_text(json.dumps({**merged, **metrics}, indent=2, sort_keys=True))

    def save_state(self) -> None:
        """output_dir/trainer_state.json: transformers' TrainerState (global_step, log_history, …)."""
        if self.dist.is_main:
            Path(self.args.output_dir).mkdir(parents=True, exist_ok=True)
            self.state.save_to_json(str(Path(self.args.output_dir) / "trainer_state.json"))

    def _open_trackers(self) -> MetricsLogger:
        """metrics.jsonl and the report_to trackers, opened by the main process; a tracker failing there stops every
        process."""
        args = self.args
        uploads = (partial(completions_uploader, args, str(Path(args.output_dir) / "completions")),) \
            if args.log_completions_hub_repo else ()
        return self.dist.run_together(lambda: MetricsLogger(
            args.output_dir, args.report_to, enabled=self.dist.is_main, config=args.to_dict(), model=self.unwrapped,
            resume_step=self.global_step, run_id=self.run_id, resumed=self.global_step > 0,
            logging_steps=self.state.logging_steps, uploads=uploads), "opening the trackers")

    # ---- transformers' flow after an optimizer step (GRPOTrainer._after_step) ----------------------------------
    def _finished(self) -> bool:
        """max_steps reached, the epochs done (transformers' epoch loop: with should_epoch_stop they can end before
        max_steps), or a callback's should_training_stop — which, as transformers reads it after each step, stops
        nothing before the epoch's first step: set in on_train_begin / on_epoch_begin, one step runs."""
        stepped = self.global_step > self._epoch_first_step
        return self.global_step >= self.max_steps or self._epochs_done >= self.state.num_train_epochs or (
            stepped and self.control.should_training_stop)

    def _begin_epoch(self) -> None:
        self._epoch_first_step = self.global_step
        self._event_agreed("on_epoch_begin")  # a stop asked for on one process is every process's

    def _event_agreed(self, name: str) -> None:
        """An event after which the loop reads the stop flags: every process takes any process's callbacks' flags."""
        self._event(name)
        self._agree()

    def _agree(self) -> bool:
        """Every process takes the stop flags any process's callbacks set (saves and evaluations are collective).
        Returns whether a signal has arrived on any process."""
        control = self.control
        flags = (self.dist.sum(torch.tensor([float(control.should_training_stop), control.should_epoch_stop,
                                             bool(self._signals)], device=self.dist.device)) > 0).tolist()
        control.should_training_stop, control.should_epoch_stop, signalled = flags
        return signalled

    def _epoch_end(self, epoch_end: bool, done: int) -> tuple[bool, bool]:
        """on_epoch_end, with the "epoch" strategies' flags (transformers' DefaultFlowCallback.on_epoch_end), when the
        epoch ends: `epoch_end` (a pass over the prompts ended with this step), a callback's should_epoch_stop (at
        the end of the generation round, so that a checkpoint never holds half a round the run then dropped), or
        the end of training. Returns (fired, a new epoch begins)."""
        control = self.control
        at_round_end = done == self.steps_per_round
        cut = control.should_epoch_stop and at_round_end and not epoch_end and self.sampler.end_epoch()
        if cut:
            self._epochs_done += 1
        elif control.should_epoch_stop and at_round_end and not epoch_end:
            control.should_epoch_stop = False  # a stream's epoch cannot end early (it warned)
        if not (epoch_end or cut or control.should_training_stop):
            return False, False
        self._event("on_epoch_end")  # DefaultFlowCallback sets the "epoch" strategies' flags
        self._agree()
        return True, epoch_end or cut

    def _log_evaluate_save(self, rollout, done: int, acted: set[str]) -> None:
        """transformers' _maybe_log_save_evaluate: log, then evaluate, then save, each as the control's flag says when
        it is reached (on_log may ask for or cancel the evaluation, on_evaluate the save), each at most once per step
        (`acted`). Every process acts on the same flags: saves and evaluations are collective."""
        args, control = self.args, self.control
        if self.dist.any(control.should_log) and "log" not in acted:
            acted.add("log")
            self._log(rollout)
        control.should_log = False
        if self.dist.any(control.should_evaluate) and "evaluate" not in acted:
            if self.eval_data is None:
                raise ConfigError("a callback asked for an evaluation (control.should_evaluate) but the trainer has "
                                  "no eval_dataset: pass one to GRPOTrainer")
            acted.add("evaluate")
            new_best = self._best.observe(self.state, self.evaluate())
            if args.save_strategy == "best":  # transformers: saved exactly when the evaluation gives a new best
                control.should_save = new_best
            elif new_best and args.load_best_model_at_end:  # a best without a checkpoint could not be loaded at
                control.should_save = True  # the end (eval_steps 2, save_steps 4: transformers keeps the last model)
        control.should_evaluate = False
        if self.dist.any(control.should_save) and "save" not in acted:
            acted.add("save")
            self._save_round(rollout, done)
        control.should_save = False
        self._agree()  # on_log / on_evaluate / on_save may have asked to stop, on one process
