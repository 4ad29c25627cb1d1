"""transformers' callback protocol for GRPOTrainer: the callback list (`add_callback`, `pop_callback`,
`remove_callback`, `callback_handler.callbacks`), the ExportableState callbacks' states a checkpoint keeps
(`restore_callback_states_from_checkpoint`), and the default callbacks the list starts with, as transformers'
Trainer's: DefaultFlowCallback first, which decides after each optimizer step and at each epoch's end whether to log,
evaluate and save (its flags are set on `control` in `on_step_end` / `on_epoch_end`, so a later callback sees them and
may change them), and last ProgressCallback (the bar, log lines written under it) or, with disable_tqdm,
PrinterCallback. Each is a subclass of transformers' class of that name, so removing transformers' class
(`trainer.remove_callback(ProgressCallback)`) removes it, and one of transformers' own put in its place runs."""

from __future__ import annotations

import dataclasses
import logging
import warnings

from tqdm.auto import tqdm
from transformers import trainer_callback

from groupwise.logging import console_line, hook_warnings, unhook_warnings

log = logging.getLogger(__name__)

# the flags transformers' CallbackHandler clears before an event's callbacks run (the event is where they are acted on)
CLEARED = {"on_train_begin": ("should_training_stop",), "on_epoch_begin": ("should_epoch_stop",),
           "on_step_begin": ("should_log", "should_evaluate", "should_save"), "on_log": ("should_log",),
           "on_evaluate": ("should_evaluate",), "on_save": ("should_save",)}


class CallbackHandler:
    """The trainer's callbacks, in order, with transformers' CallbackHandler's interface: `callbacks`,
    `callback_list`, the objects every event is given (`model`, `processing_class`, `optimizer`, `lr_scheduler`,
    `train_dataloader`, `eval_dataloader`; the dataloaders are None: GRPO samples its own prompts), `call_event`, and
    one method per event (`on_log(args, state, control, logs)`, …) returning the control, so that a trainer subclass
    written against transformers (`self.control = self.callback_handler.on_log(…)`) works. A class is instantiated
    (as transformers does); an event clears the flags transformers' handler clears (CLEARED); a returned
    TrainerControl's flags are copied into the trainer's own (transformers replaces the object: the same flags, and
    the trainer's loop keeps reading the object it holds)."""

    def __init__(self, callbacks, model=None, processing_class=None, optimizer=None, lr_scheduler=None):
        self.callbacks: list = []
        for callback in callbacks or []:
            self.add_callback(callback)
        self.model, self.processing_class = model, processing_class
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.train_dataloader = self.eval_dataloader = None

    @property
    def callback_list(self) -> str:
        return "\n".join(type(cb).__name__ for cb in self.callbacks)

    def close_bars(self) -> None:
        """Every ProgressCallback's bar closed: training stopped without on_train_end (an error, a signal)."""
        for callback in self.callbacks:
            if isinstance(callback, trainer_callback.ProgressCallback):
                close_bar(callback)

    def add_callback(self, callback) -> None:
        cb = callback() if isinstance(callback, type) else callback
        if any(type(c) is type(cb) for c in self.callbacks):  # transformers' warning, on its logger's level
            log.warning(f"a {type(cb).__name__} is already among the callbacks; this one is added too")
        self.callbacks.append(cb)

    def pop_callback(self, callback):
        """Remove and return the callback (an instance, or the first one of a class); None when absent."""
        for cb in self.callbacks:
            if cb is callback or (isinstance(callback, type) and isinstance(cb, callback)):
                self.callbacks.remove(cb)
                return cb
        return None

    def remove_callback(self, callback) -> None:
        """Remove the callback (an instance, or the first one of a class); an instance not in the list is a
        ValueError, an absent class nothing (transformers' rules)."""
        if self.pop_callback(callback) is None and not isinstance(callback, type):
            raise ValueError(f"remove_callback: this {type(callback).__name__} is not among the trainer's callbacks "
                             f"({', '.join(type(cb).__name__ for cb in self.callbacks)})")

    def states(self, control) -> dict:
        """transformers' `stateful_callbacks` as a checkpoint's trainer_state.json holds it: each ExportableState
        callback's `.state()` ({"args": …, "attributes": …}), then the TrainerControl's, keyed by class name (a
        list, in the callbacks' order, for several of one class)."""
        from transformers import TrainerState
        from transformers.trainer_callback import ExportableState

        stateful = [cb for cb in [*self.callbacks, control] if isinstance(cb, ExportableState)]
        return TrainerState(stateful_callbacks=stateful).stateful_callbacks  # transformers' own grouping

    def restore_states(self, args, stored: dict | None, control) -> None:
        """restore_callback_states_from_checkpoint (transformers' Trainer._load_callback_state): the callbacks whose
        class name a checkpoint's `stateful_callbacks` holds are replaced by new instances of their class built from
        the stored args, with the stored attributes set (several of one class: paired in order), and moved to the
        end of the list; the control takes the stored flags. A stored class no callback has is warned about."""
        if not args.restore_callback_states_from_checkpoint:
            return
        not_found, new_callbacks = [], []
        for name, data in sorted((stored or {}).items()):  # by class name: transformers' trainer_state.json is sorted
            current = [cb for cb in [*self.callbacks, control] if type(cb).__name__ == name]
            if not current:
                not_found.append(name)
                continue
            for callback, saved in zip(current, data if isinstance(data, list) else [data]):
                new = type(callback)(**saved.get("args", {}))
                for attribute, value in saved.get("attributes", {}).items():
                    setattr(new, attribute, value)
                if callback is control:  # the trainer keeps its object (as a returned TrainerControl): the flags
                    for field in dataclasses.fields(control):
                        setattr(control, field.name, getattr(new, field.name))
                else:
                    self.pop_callback(callback)  # this instance (transformers: the first of its class)
                    new_callbacks.append(new)
            log.info("Continuing training from checkpoint, restoring any callbacks that were passed in")
        if not_found:
            warnings.warn("Checkpoint included callbacks not included in current configuration. Ignoring. "
                          f"({', '.join(not_found)}) (transformers' warning)", stacklevel=3)
        for callback in new_callbacks:
            self.add_callback(callback)

    def call_event(self, name: str, args, state, control, **kwargs):
        """Every callback's `name` method, with transformers' arguments (flags in CLEARED cleared first)."""
        for flag in CLEARED.get(name, ()):
            setattr(control, flag, False)
        objects = dict(model=self.model, processing_class=self.processing_class, optimizer=self.optimizer,
                       lr_scheduler=self.lr_scheduler, train_dataloader=self.train_dataloader,
                       eval_dataloader=self.eval_dataloader)
        for callback in self.callbacks:
            method = getattr(callback, name, None)
            if method is None:
                continue
            result = method(args, state, control, **objects, **kwargs)
            if result is not None and result is not control:
                if not isinstance(result, type(control)):
                    raise TypeError(f"{type(callback).__name__}.{name} returned a {type(result).__name__}: return the "
                                    f"TrainerControl it was given (or None)")
                for field in dataclasses.fields(control):
                    setattr(control, field.name, getattr(result, field.name))
        return control

    def on_log(self, args, state, control, logs, **kwargs):
        return self.call_event("on_log", args, state, control, logs=logs, **kwargs)

    def on_evaluate(self, args, state, control, metrics, **kwargs):
        return self.call_event("on_evaluate", args, state, control, metrics=metrics, **kwargs)

    def on_predict(self, args, state, control, metrics, **kwargs):
        return self.call_event("on_predict", args, state, control, metrics=metrics, **kwargs)

    def __getattr__(self, name: str):
        """The other events (on_step_end, on_save, …): `handler.on_x(args, state, control, **kwargs)`."""
        if name.startswith("on_") and callable(getattr(trainer_callback.TrainerCallback, name, None)):
            return lambda args, state, control, **kwargs: self.call_event(name, args, state, control, **kwargs)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


class DefaultFlowCallback(trainer_callback.DefaultFlowCallback):
    """groupwise's flow (step_flow, epoch_flow) in transformers' DefaultFlowCallback's place: removed, no log,
    evaluation or save is scheduled (training still stops at max_steps); transformers' own class put in its place
    schedules by transformers' rules."""

    def on_step_end(self, args, state, control, **kwargs):
        log, evaluate, save = step_flow(args, state)
        control.should_log |= log
        control.should_evaluate |= evaluate
        control.should_save |= save
        control.should_training_stop |= state.global_step >= state.max_steps
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        log, evaluate, save = epoch_flow(args, state)
        control.should_log |= log
        control.should_evaluate |= evaluate
        control.should_save |= save
        return control


class ProgressCallback(trainer_callback.ProgressCallback):
    """The training bar on the main process (a resumed run's starts at its step) and each log line written under it
    as transformers' ProgressCallback prints it (console_line), with the last training line's reward, step reward,
    loss and length as the bar's postfix. The evaluation bar (groupwise.evaluation) is drawn while one is in the
    list, as transformers' ProgressCallback owns the prediction bar."""

    def on_train_begin(self, args, state, control, **kwargs):
        self.training_bar = tqdm(total=state.max_steps, initial=state.global_step, desc="GRPO",
                                 disable=not state.is_world_process_zero)
        self.current_step = state.global_step
        if not self.training_bar.disable and not getattr(self, "hooked", False):
            hook_warnings()  # warnings written above the bar
            self.hooked = True

    def on_step_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            self.training_bar.update(state.global_step - self.current_step)
            self.current_step = state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        bar = self.training_bar
        if bar is None or bar.disable:
            return
        bar.write(str(console_line(logs)))
        shown = {k.split("/")[-1]: f"{logs[k]:.4g}" for k in
                 ("reward", "process/step_reward_mean", "loss", "completions/mean_length")
                 if isinstance(logs.get(k), (int, float))}
        if "reward" in logs or "loss" in logs:  # a training line (an evaluation's metrics are eval_…)
            bar.set_postfix(shown)

    def on_prediction_step(self, args, state, control, **kwargs):  # evaluation has its own bar
        pass

    def on_evaluate(self, args, state, control, **kwargs):
        pass

    def on_predict(self, args, state, control, **kwargs):
        pass

    def on_train_end(self, args, state, control, **kwargs):
        close_bar(self)


class PrinterCallback(trainer_callback.PrinterCallback):
    """With disable_tqdm: each log line printed by each node's main process, as transformers' PrinterCallback."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_local_process_zero:
            print(console_line(logs))


def default_callbacks(args) -> tuple[list, list]:
    """The callbacks transformers' Trainer puts before and after the user's: [DefaultFlowCallback] and
    [ProgressCallback] ([PrinterCallback] with disable_tqdm)."""
    return [DefaultFlowCallback()], [PrinterCallback() if args.disable_tqdm else ProgressCallback()]


def close_bar(callback) -> None:
    """A ProgressCallback's training bar closed (at the end of training, or when it stops on an error)."""
    bar = getattr(callback, "training_bar", None)
    if bar is not None:
        bar.close()
        callback.training_bar = None
    if getattr(callback, "hooked", False):
        unhook_warnings()
        callback.hooked = False



def step_flow(args, state) -> tuple[bool, bool, bool]:
    """(log, evaluate, save) after optimizer step state.global_step, as transformers' DefaultFlowCallback.on_step_end
    sets them: logging_strategy / eval_strategy / save_strategy "steps" (every state.*_steps: the fields, fractions
    of max_steps resolved), with eval_delay and logging_first_step (transformers' meanings); save_strategy "best"
    saves after an evaluation that gives a new best metric (the trainer decides it then, as transformers). At the
    last step groupwise logs and evaluates unless the strategy is "no" or "epoch" (then the epoch's end does), and
    saves under "steps" (as transformers; "best": when a new best): a run's end is never unrecorded unless asked."""
    step, last_step = state.global_step, state.global_step >= state.max_steps

    def due(strategy: str, every: int) -> bool:
        return strategy == "steps" and bool(every) and step % every == 0

    log = due(args.logging_strategy, max(state.logging_steps, 1)) or (args.logging_first_step and step == 1) \
        or (last_step and args.logging_strategy == "steps")
    evaluate = step >= args.eval_delay and (due(args.eval_strategy, state.eval_steps) or (
        last_step and args.eval_strategy not in ("no", "epoch")))
    save = due(args.save_strategy, state.save_steps) or (last_step and args.save_strategy == "steps")
    return log, evaluate, save


def epoch_flow(args, state) -> tuple[bool, bool, bool]:
    """(log, evaluate, save) at an epoch's end — a pass over the prompts, or the partial one training stops in — as
    transformers' DefaultFlowCallback.on_epoch_end sets them: the "epoch" strategies (eval_delay against
    state.epoch)."""
    return (args.logging_strategy == "epoch", args.eval_strategy == "epoch" and args.eval_delay <= state.epoch,
            args.save_strategy == "epoch")
