"""What a TRL script may do to a GRPOTrainer that groupwise would ignore, refused by name:

- a subclass overriding a method of TRL's GRPOTrainer or transformers' Trainer that groupwise's loop never calls
  (groupwise's GRPOTrainer is not a transformers Trainer: its loop, loss, optimizer and checkpoints are its own),
  with what to use instead. Methods groupwise's GRPOTrainer has (`log`, `evaluate`, `push_to_hub`, …) are called
  where TRL calls them, and a subclass may override them (`save_model` with a warning: not at checkpoints);
- `trainer.args` changed between building the trainer and `train()`: the layout, the schedule, the optimizer, the
  state's logging / eval / save steps and the rollout are built from args when the trainer is built (TRL's Trainer
  reads many fields again in `train()`)."""

from __future__ import annotations

import dataclasses

from groupwise.config_base import ConfigError, warn_user

_LOSS = ("the loss is groupwise's: loss_type picks one of groupwise.core.losses.LOSS_TYPES (TRL's), with its "
         "GRPOConfig fields (epsilon, beta, importance_sampling_level, …); reward shaping belongs in reward_funcs")
_OPTIMIZER = ("pass GRPOTrainer(optimizers=(optimizer, lr_scheduler)), or set optim / optim_args / "
              "lr_scheduler_type / lr_scheduler_kwargs")
_CHECKPOINT = ("checkpoints are groupwise's (safetensors, exact resume): a callback's on_save finds each one at "
               "args.output_dir/checkpoint-{state.global_step}, to add files to it")
_ROLLOUT = ("pass rollout_func= (TRL's: your function samples the completions), or tools= / environment_factory= "
            "for tool-calling rollouts")
_REWARDS = "pass reward_funcs= (and process_reward_funcs= for step rewards), weighted by reward_weights"
_DATA = "prompts are read by index, not by a DataLoader: train_dataset, shuffle_dataset and data_seed set the order"
_EVALUATION = "override evaluate() itself, or compute metrics in a callback's on_evaluate"
_FLOW = ("use a callback: in on_step_end it may set control.should_log / should_evaluate / should_save / "
         "should_training_stop")
_OTHER = "use a callback (transformers' events) or the GRPOConfig fields"
_VLLM = "weights reach vLLM through groupwise's generation backend (use_vllm) after every optimizer step"

# methods TRL 1.16's GRPOTrainer or transformers' Trainer call from their loops and groupwise's trainer lacks (the
# other `_`-prefixed Trainer methods are read from transformers)
INSTEAD: dict[str, str] = {
    "compute_loss": _LOSS, "_compute_loss": _LOSS, "training_step": _LOSS, "compute_liger_loss": _LOSS,
    "_get_per_token_logps_and_entropies": _LOSS, "get_high_entropy_mask": _LOSS, "get_off_policy_mask": _LOSS,
    "get_gamma_weights": _LOSS, "compute_loss_context_manager": _LOSS,
    "create_optimizer": _OPTIMIZER, "create_scheduler": _OPTIMIZER, "create_optimizer_and_scheduler": _OPTIMIZER,
    "get_optimizer_cls_and_kwargs": _OPTIMIZER, "_load_optimizer_and_scheduler": _OPTIMIZER,
    "get_decay_parameter_names": _OPTIMIZER, "floating_point_ops": _OTHER, "get_batch_samples": _DATA,
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


# methods groupwise's trainer has but calls in fewer places than transformers: an override is warned about
PARTLY_CALLED = {
    "save_model": "transformers also calls it to write each checkpoint's model; groupwise writes its checkpoints "
                  "itself, so the override runs when save_model() is called (by you, the CLI at the end of "
                  "training, push_to_hub()), not at checkpoints: add files to checkpoints in a callback's on_save",
}


def check_overrides(cls: type, base: type) -> None:
    """Refuse a subclass `cls` of `base` (groupwise's GRPOTrainer) that defines a method transformers' Trainer or
    TRL's GRPOTrainer calls from its own loop (INSTEAD, and transformers' `_`-prefixed hooks) and `base` has not:
    groupwise would never call it. One error naming each such method and what to use instead. A public method of
    transformers' Trainer that groupwise lacks (`predict`, …) is the subclass's own: it runs when called. An
    override of a PARTLY_CALLED method is a warning."""
    if cls is base:
        return
    own = {name for klass in cls.__mro__ if klass not in base.__mro__ for name in vars(klass)}  # mixins too
    for name in sorted(own & set(PARTLY_CALLED)):
        warn_user(f"{cls.__name__} overrides {name}(): {PARTLY_CALLED[name]}")
    new = {name for name in own - set(dir(base)) if not name.startswith("__")}
    if not new:
        return
    from transformers import Trainer  # only for a subclass with methods of its own (an import of ~1 s)

    ignored = sorted(name for name in new if name in INSTEAD or (name.startswith("_") and hasattr(Trainer, name)))
    if ignored:
        hints = dict.fromkeys(INSTEAD.get(name, _OTHER) for name in ignored)  # each hint once, in order
        names = ", ".join(f"{name}()" for name in ignored)
        raise TypeError(f"{cls.__name__} overrides {names} of TRL's / transformers' trainer, which groupwise's "
                        f"GRPOTrainer never calls (its training loop is its own), so the override would have no "
                        f"effect: {'; '.join(hints)} (docs/trl_compat.md)")


# read where they are used, never when the trainer is built: changing them after building takes effect
# (resume_from_checkpoint by train(), TRL's meaning; the evaluation's by evaluate(); the token at each upload)
READ_WHEN_USED = frozenset({"resume_from_checkpoint", "num_generations_eval", "per_device_eval_batch_size",
                            "hub_token"})


def args_fingerprint(args) -> dict[str, str]:
    """Each field's value as text (repr: a list or dict changed in place counts as a change)."""
    return {f.name: repr(getattr(args, f.name)) for f in dataclasses.fields(args)}


def check_args_unchanged(args, built: dict[str, str]) -> None:
    """Refuse args whose fields differ from `built` (args_fingerprint when the trainer was built), naming each change
    as `field: before → now` (READ_WHEN_USED fields may change: the token among them is never shown)."""
    now = args_fingerprint(args)
    changed = [name for name, value in now.items() if name not in READ_WHEN_USED and built.get(name) != value]
    if changed:
        listed = "; ".join(f"{name}: {built.get(name)} → {now[name]}" for name in changed)
        raise ConfigError(f"trainer.args changed after the GRPOTrainer was built ({listed}): groupwise builds the "
                          "batch layout, schedule, optimizer, generation backend and rollout from args when the "
                          "trainer is built and does not support changing them afterwards (some changes would be "
                          "ignored). Set these fields in the GRPOConfig before building the trainer (TRL's Trainer "
                          "reads some of them again in train())")
