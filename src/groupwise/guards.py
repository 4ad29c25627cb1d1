"""What a TRL script may do to a GRPOTrainer that groupwise would ignore, refused by name:

- a subclass overriding a method of TRL's GRPOTrainer or transformers' Trainer that groupwise's loop never calls
  (groupwise's GRPOTrainer is not a transformers Trainer: its loop, loss, optimizer and checkpoints are its own),
  with what to use instead. Methods groupwise's GRPOTrainer has (`log`, `evaluate`, `save_model`, `push_to_hub`, …)
  are called where TRL calls them, and a subclass may override them;
- `trainer.args` changed between building the trainer and `train()`: the layout, the schedule, the optimizer, the
  state's logging / eval / save steps and the rollout are built from args when the trainer is built (TRL's Trainer
  reads many fields again in `train()`)."""

from __future__ import annotations

import dataclasses

from groupwise.config_base import ConfigError

_LOSS = ("the loss is groupwise's: loss_type picks one of groupwise.core.losses.LOSS_TYPES (TRL's), with its "
         "GRPOConfig fields (epsilon, beta, importance_sampling_level, …); reward shaping belongs in reward_funcs")
_OPTIMIZER = ("pass GRPOTrainer(optimizers=(optimizer, lr_scheduler)), or set optim / optim_args / "
              "lr_scheduler_type / lr_scheduler_kwargs")
_CHECKPOINT = ("checkpoints are groupwise's (safetensors, exact resume): a callback's on_save gets each checkpoint "
               "folder as checkpoint=…, to add files to it")
_ROLLOUT = ("pass rollout_func= (TRL's: your function samples the completions), or tools= / environment_factory= "
            "for tool-calling rollouts")
_REWARDS = "pass reward_funcs= (and process_reward_funcs= for step rewards), weighted by reward_weights"
_DATA = "prompts are read by index, not by a DataLoader: train_dataset, shuffle_dataset and data_seed set the order"
_EVALUATION = "override evaluate() itself, or compute metrics in a callback's on_evaluate"
_FLOW = ("use a callback: in on_step_end it may set control.should_log / should_evaluate / should_save / "
         "should_training_stop")
_VLLM = "weights reach vLLM through groupwise's generation backend (use_vllm) after every optimizer step"

# TRL 1.16's GRPOTrainer methods groupwise's has no counterpart of (its Trainer methods are read from transformers)
INSTEAD: dict[str, str] = {
    "compute_loss": _LOSS, "_compute_loss": _LOSS, "training_step": _LOSS, "compute_liger_loss": _LOSS,
    "_get_per_token_logps_and_entropies": _LOSS, "get_high_entropy_mask": _LOSS, "get_off_policy_mask": _LOSS,
    "get_gamma_weights": _LOSS, "compute_loss_context_manager": _LOSS,
    "create_optimizer": _OPTIMIZER, "create_scheduler": _OPTIMIZER, "create_optimizer_and_scheduler": _OPTIMIZER,
    "get_optimizer_cls_and_kwargs": _OPTIMIZER, "_load_optimizer_and_scheduler": _OPTIMIZER,
    "_save_checkpoint": _CHECKPOINT, "_save": _CHECKPOINT, "_load_from_checkpoint": _CHECKPOINT,
    "_load_rng_state": _CHECKPOINT, "_load_best_model": _CHECKPOINT,
    "_generate_and_score_completions": _ROLLOUT, "_generate": _ROLLOUT, "_generate_single_turn": _ROLLOUT,
    "_prepare_inputs": _ROLLOUT, "_tool_call_loop": _ROLLOUT, "_get_tool_suffix_ids": _ROLLOUT,
    "_tokenize_prompts": _ROLLOUT, "_calculate_rewards": _REWARDS, "_log_completion_extra": _REWARDS,
    "get_train_dataloader": _DATA, "_get_train_sampler": _DATA, "get_eval_dataloader": _DATA,
    "_get_eval_sampler": _DATA, "_set_signature_columns_if_needed": _DATA, "_remove_unused_columns": _DATA,
    "prediction_step": _EVALUATION, "evaluation_loop": _EVALUATION, "_evaluate": _EVALUATION,
    "_maybe_log_save_evaluate": _FLOW, "_inner_training_loop": _FLOW,
    "_move_model_to_vllm": _VLLM, "_sync_fsdp_params_to_vllm": _VLLM,
}
_OTHER = "use a callback (transformers' events) or the GRPOConfig fields"


def check_overrides(cls: type, base: type) -> None:
    """Refuse a subclass `cls` of `base` (groupwise's GRPOTrainer) that defines a method TRL's GRPOTrainer or
    transformers' Trainer has and `base` has not: groupwise would never call it. One error naming each such method
    and what to use instead."""
    if cls is base:
        return
    own = {name for klass in cls.__mro__[:cls.__mro__.index(base)] for name in vars(klass)}
    new = {name for name in own - set(dir(base)) if not name.startswith("__")}
    if not new:
        return
    from transformers import Trainer  # only for a subclass with methods of its own (an import of ~1 s)

    ignored = sorted(name for name in new if name in INSTEAD or hasattr(Trainer, name))
    if ignored:
        hints = dict.fromkeys(INSTEAD.get(name, _OTHER) for name in ignored)  # each hint once, in order
        names = ", ".join(f"{name}()" for name in ignored)
        raise TypeError(f"{cls.__name__} overrides {names} of TRL's / transformers' trainer, which groupwise's "
                        f"GRPOTrainer never calls (its training loop is its own), so the override would have no "
                        f"effect: {'; '.join(hints)} (docs/trl_compat.md)")


# read by train() itself (TRL's meaning): changing it after the trainer is built takes effect
READ_BY_TRAIN = frozenset({"resume_from_checkpoint"})


def args_fingerprint(args) -> dict[str, str]:
    """Each field's value as text (repr: a list or dict changed in place counts as a change)."""
    return {f.name: repr(getattr(args, f.name)) for f in dataclasses.fields(args)}


def check_args_unchanged(args, built: dict[str, str]) -> None:
    """Refuse args whose fields differ from `built` (args_fingerprint when the trainer was built), naming each change
    as `field: before → now`."""
    now = args_fingerprint(args)
    changed = [name for name, value in now.items() if name not in READ_BY_TRAIN and built.get(name) != value]
    if changed:
        listed = "; ".join(f"{name}: {built.get(name)} → {now[name]}" for name in changed)
        raise ConfigError(f"trainer.args changed after the GRPOTrainer was built ({listed}): groupwise builds the "
                          "batch layout, schedule, optimizer and rollout from args when the trainer is built, so the "
                          "change would be ignored. Set these fields in the GRPOConfig before building the trainer "
                          "(TRL's Trainer reads some of them again in train())")
