"""SIGINT / SIGTERM during training: recorded, and the run ends after the current optimizer step (the trainer
checks the list after each step, writes a checkpoint and raises TrainingInterrupted); a second signal interrupts at
once. Launchers (torchrun, accelerate) forward the terminal's signal, so a copy within 2 s is that, not a second
request. Only the main thread can install handlers; elsewhere signals keep their handlers."""

from __future__ import annotations

import contextlib
import signal
import threading
import time

from tqdm.auto import tqdm


class TrainingInterrupted(RuntimeError):
    """SIGINT / SIGTERM stopped the run after an optimizer step (GRPO: a checkpoint written when save_on_interrupt;
    prm train: the PRM trained so far saved). The CLI exits with 128 + signum. Raise it with `interrupted()`: a
    SIGINT's is a KeyboardInterrupt too, so a script's `except KeyboardInterrupt:` (Ctrl-C, as transformers
    raises it) still runs."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class KeyboardTrainingInterrupted(TrainingInterrupted, KeyboardInterrupt):
    """TrainingInterrupted by SIGINT (Ctrl-C)."""


def interrupted(signum: int, message: str) -> TrainingInterrupted:
    """Every process stops after the same step (the trainer agrees on it): `shared`, the exit waits for the others."""
    from groupwise.distributed import shared

    return shared((KeyboardTrainingInterrupted if signum == signal.SIGINT else TrainingInterrupted)(signum, message))


@contextlib.contextmanager
def stop_on_signals(where=None):
    """Yields the list the received signal numbers go into. `where(frame)`: where the run is when the first signal
    comes, said with it (a process stuck in a reward function is stopped by the launcher's SIGKILL later, and this
    line is all it leaves)."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    first: list[float] = []

    def handler(signum, frame):
        if received:
            if time.monotonic() - first[0] > 2.0:
                raise KeyboardInterrupt
            return
        first.append(time.monotonic())
        received.append(signum)
        now = where(frame) if where is not None and frame is not None else ""
        tqdm.write(f"groupwise: {signal.Signals(signum).name} received: stopping after this optimizer step "
                   f"(again to stop at once){f'; now in {now}' if now else ''}")

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for s, h in previous.items():  # None: a handler installed outside Python, which cannot be put back
            signal.signal(s, h if h is not None else signal.SIG_DFL)
