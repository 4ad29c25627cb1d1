"""What a checkpoint records of the trainer's run besides the weights, optimizer and scheduler (the step, the prompt
order, the metrics window, an unfinished round, transformers' TrainerState fields, the callbacks' states), and how
a resume restores it: the trainer's checkpoint section, beside the loop (groupwise.trainer) that calls it. The files
themselves: groupwise.checkpoint (writing), groupwise.checkpoint_load (checking and loading)."""

from __future__ import annotations

import json
import math
from collections import defaultdict

from groupwise.best import BestModel
from groupwise.checkpoint import read_state, save_checkpoint, set_aside_later
from groupwise.checkpoint_load import (RESUME_FIELDS, SAVED_OPTIMIZER_FIELDS, check_pending, check_resume,
                                       load_checkpoint)
from groupwise.types import Rollout, TrainBatch


class RunState:
    """GRPOTrainer's checkpoint section: `save` writes the run's state with its weights, `_resume` reads it back so
    that the resumed run continues the interrupted one exactly (the same prompts, samples and metrics)."""

    def save(self, pending: TrainBatch | None = None, round_metrics: dict | None = None, round_step: int = 0):
        best = BestModel.at_save(self.state, self.args.output_dir, self.global_step)  # as transformers: this save's
        state = {"global_step": self.global_step, "max_steps": self.max_steps, "sampler": self.sampler.state_dict(),
                 "epochs_done": self._epochs_done, "data": self.train_data.fingerprint(), "epoch_plan": "passes",
                 "run_id": self.run_id, "config": {k: getattr(self.args, k) for k in RESUME_FIELDS},
                 "optimizer_fields": {k: getattr(self.args, k) for k in SAVED_OPTIMIZER_FIELDS},
                 "skipped_steps": self.skipped_steps, "world_size": self.dist.world_size,
                 "consecutive_skipped": self.consecutive_skipped, "window": dict(self._window),
                 "round_step": round_step if pending is not None else 0,
                 "round_metrics": round_metrics if pending is not None else None,
                 "round_rows": json.loads(json.dumps(self._rows, default=str)) if pending is not None else None,
                 "round_span": self._span, "num_input_tokens_seen": self.state.num_input_tokens_seen,
                 "total_flos": self.state.total_flos, "best": BestModel.state_dict(self.state, best),
                 "stateful_callbacks": self.callback_handler.states(self.control),  # transformers' (ExportableState)
                 "log_history": json.loads(json.dumps(self.state.log_history, default=str)),
                 "entropy_control": self.update_ctx.entropy.state_dict() if self.args.use_adaptive_entropy else None,
                 "grad_scaler": self.dist.scaler.state_dict() if self.dist.scaler is not None else None}
        sharded = self.dist.sharding is not None
        consolidated, weights = self.consolidated()
        return save_checkpoint(self.args.output_dir, self.global_step, dist=self.dist, model=consolidated,
                               model_state=weights, sharded_model=self.unwrapped if sharded else None,
                               tokenizer=self.tokenizer, optimizer=self.optimizer, scheduler=self.scheduler,
                               state=state, pending=pending.tensors() if pending is not None else None,
                               ref_model=self.reference.copy if self.args.sync_ref_model else None,
                               save_total_limit=self.args.save_total_limit, model_only=self.args.save_only_model,
                               keep=best)

    def _resume(self, path: str):
        state = read_state(path)  # verified against its checksums before anything loads (once)
        digest = self.train_data.fingerprint()  # None for a stream
        check_resume(path, state, self.args, world_size=self.dist.world_size, max_steps=self.max_steps,
                     data=digest, epoch_steps_before=None if self.args.max_steps > 0 else
                     math.ceil(self.args.num_train_epochs * self.sampler.rounds_per_epoch() * self.steps_per_round),
                     rows=None if digest is None else len(self.train_data))
        pending = self.dist.run_together(lambda: load_checkpoint(  # a file missing on one process stops them all
            path, dist=self.dist, model=self.unwrapped, optimizer=self.optimizer,
            sharded_model=self.unwrapped if self.dist.sharding is not None else None, scheduler=self.scheduler,
            ref_model=self.reference.copy if self.reference is not None else None), "loading the checkpoint")
        self.dist.run_together(lambda: self.dist.is_main and set_aside_later(
            self.args.output_dir, state["global_step"], state.get("run_id")), "setting aside the abandoned checkpoints")
        self.run_id = state.get("run_id", self.run_id)
        self.global_step, self.skipped_steps = state["global_step"], state["skipped_steps"]
        self.sampler.load_state_dict(state["sampler"])
        self._epochs_done = state.get("epochs_done", int(self.sampler.progress()))
        self.consecutive_skipped = state.get("consecutive_skipped", 0)
        self._window = defaultdict(list, state.get("window", {}))  # the metrics since the last log line
        self.state.num_input_tokens_seen = state.get("num_input_tokens_seen", 0)
        self.state.total_flos = state.get("total_flos", 0.0)
        self._restored_history = state.get("log_history")  # transformers' TrainerState.log_history
        if self.args.use_adaptive_entropy and state.get("entropy_control"):  # an adapted coefficient, where it was
            self.update_ctx.entropy.load_state_dict(state["entropy_control"])
        if self.dist.scaler is not None and state.get("grad_scaler"):  # fp16: the loss scale where it was
            self.dist.scaler.load_state_dict(state["grad_scaler"])
        BestModel.load_state_dict(self.state, state.get("best"), self.args.output_dir)
        self.callback_handler.restore_states(self.args, state.get("stateful_callbacks"), self.control)
        self._span = start, end = tuple(state.get("round_span", (self.sampler.progress(),) * 2))
        self.state.epoch = start + (end - start) * (state["round_step"] or self.steps_per_round) / self.steps_per_round
        if pending is None:
            return None
        check_pending(path, pending, self.args, custom_rollout=self.rollout_func is not None)
        self._rows = state.get("round_rows")
        device = self.dist.device  # the checkpoint's tensors load on the CPU
        return Rollout(TrainBatch.from_tensors({k: v.to(device) for k, v in pending.items()}),
                       state["round_metrics"]), state["round_step"]
