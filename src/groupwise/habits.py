"""What TRL / transformers users call on a trainer besides train() and evaluate(): save_model, push_to_hub,
log_metrics, save_metrics, save_state, and the TrainOutput-like value train() returns. A mixin of GRPOTrainer: it
reads the trainer's args, dist, state, tokenizer and models."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from tqdm.auto import tqdm

from groupwise.config_base import ConfigError
from groupwise.hub import check_card, push_folder, write_model_card
from groupwise.logging import speed_metrics


class TrainResult(dict):
    """What train() returns: the last logged metrics (a dict), also readable as transformers' TrainOutput —
    `.global_step`, `.training_loss` (the mean `loss` of this call's steps) and `.metrics` (the end-of-training
    line: train_runtime, train_samples_per_second, train_steps_per_second, total_flos, train_loss, epoch), so TRL
    scripts' `train_result.metrics` works."""

    def __init__(self, last: dict[str, float], global_step: int, training_loss: float, metrics: dict[str, float]):
        super().__init__(last)
        self.global_step, self.training_loss, self.metrics = global_step, training_loss, metrics


class TransformersHabits:
    # TRL's trainer attributes, read-only views of groupwise's own
    @property
    def processing_class(self):
        return self.tokenizer

    @property
    def train_dataset(self):
        return self.train_data.data

    @property
    def eval_dataset(self):
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

    def push_to_hub(self, commit_message: str = "groupwise: end of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None,
                    **card) -> str | None:
        """Save the model to output_dir with a model card (README.md, from TRL's / transformers' card keywords:
        model_name, dataset_name, tags, …) and upload it (model, tokenizer, config, card; not the checkpoints or
        logs) to hub_model_id (default: output_dir's folder name), as transformers' Trainer.push_to_hub. Uploads
        are synchronous (`blocking` is accepted for TRL scripts). Returns the commit URL on the main process."""
        check_card(card)  # on every process, before anything is written
        out = self.args.output_dir
        self.save_model(out)
        base = getattr(getattr(self.unwrapped, "config", None), "_name_or_path", None) or None
        if self.dist.is_main:
            write_model_card(out, self.args, base, **card)
        self._pushed_at = self.global_step
        # the main process uploads; a failure there stops every process instead of leaving them in a barrier
        return self.dist.run_together(
            lambda: push_folder(self.args, out, commit_message, token=token, revision=revision, private=private)
            if self.dist.is_main else None, "push_to_hub")

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
        self._event("on_log", logs=logs)

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
        per prompt with mean@k / pass@k) on `eval_dataset` (default: the trainer's; a dict: each dataset, its
        metrics prefixed with `metric_key_prefix`_<name>). The metrics, named `metric_key_prefix`_<TRL name>, are
        logged (metrics.jsonl during training, state.log_history, on_log) and passed to on_evaluate."""
        from groupwise.evaluation import evaluate

        if isinstance(eval_dataset, dict):
            return {k: v for name, data in eval_dataset.items()
                    for k, v in self.evaluate(data, ignore_keys, f"{metric_key_prefix}_{name}").items()}
        data = self.eval_data if eval_dataset is None else self._check_lengths(self._eval_data(eval_dataset))
        if data is None:
            raise ConfigError("evaluate() needs an eval_dataset (pass it to GRPOTrainer or to evaluate())")
        start = time.perf_counter()
        raw = evaluate(self.rollout_ctx, self.sampling_model, data, self.reward_sources, self.state)
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in raw.items() if k not in (ignore_keys or ())}
        # transformers' speed metrics: prompts evaluated, batches of per_device_eval_batch_size prompts per process
        per_step = self.args.per_device_eval_batch_size * self.dist.world_size
        metrics.update(speed_metrics(time.perf_counter() - start, math.ceil(len(data) / per_step), len(data),
                                     metric_key_prefix))
        self.log(metrics)  # with the epoch, as transformers' evaluate() returns it
        self._event("on_evaluate", metrics=metrics)
        return metrics

    def _check_lengths(self, data):
        """Prompt lengths of a dataset (the constructor's, or one given to evaluate()): truncate_prompt cuts with a
        warning or is an error; room for max_completion_length in the model's positions. Returns `data`."""
        args = self.args
        data.check_lengths(self.tokenizer, max_prompt_length=args.max_prompt_length,
                           max_completion_length=args.max_completion_length, max_positions=self._max_positions,
                           truncate_prompt=args.truncate_prompt, chat_template_kwargs=args.chat_template_kwargs)
        return data

    # transformers' callback list (groupwise.callbacks.CallbackHandler)
    def add_callback(self, callback) -> None:
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback):
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback) -> None:
        self.callback_handler.remove_callback(callback)

    def save_model(self, output_dir: str | None = None) -> None:
        """The policy (safetensors) and its tokenizer, loadable with from_pretrained (TRL / transformers' name)."""
        out = output_dir or self.args.output_dir
        if self.dist.is_main:
            model = self.sampling_model if self.dist.sharding is not None else self.unwrapped  # fsdp: consolidated
            model.save_pretrained(out, safe_serialization=True)
            self.tokenizer.save_pretrained(out)
        self.dist.barrier()

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
