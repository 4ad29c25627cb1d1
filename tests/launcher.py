"""Multi-process test runs without paying for the imports every time.

`torchrun(script, *args, nproc=N)` runs `script` as `__main__` on N processes with the environment torchrun gives its
workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...), so a worker cannot tell the difference, and
returns a `subprocess.CompletedProcess` (stdout and stderr of every process, rank order; the first failing process's
exit code). The processes are real processes talking over gloo, but they are forked from one server process that
imported torch, transformers, accelerate, peft and groupwise once (multiprocessing's forkserver with those
preloaded): a fresh `python -m torch.distributed.run` spends ~7 s of a 2-core machine importing before a worker runs
a line, and more on the first GRPOTrainer (transformers' callbacks import peft, bitsandbytes and torch's compiler),
and the suite has ~30 such launches. Like torchrun, when one process fails the others are stopped (after
`grace` seconds), and a run past `timeout` is killed and raises `subprocess.TimeoutExpired`.

What stays on the real launchers: tests of the launch itself (torchrun's and accelerate's environment, faults
that torchrun's own supervision handles) and anything that must start from a bare interpreter (import checks).
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).parents[1]
# what every worker imports: torch, transformers' Llama and Trainer callbacks (which import peft, bitsandbytes and
# torch's compiler), accelerate, groupwise. Not `datasets`: pyarrow starts a thread, and a fork would not copy it.
PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.trainer_callback",
           "transformers.models.llama.modeling_llama", "accelerate", "peft", "safetensors.torch", "groupwise",
           "groupwise.trainer", "groupwise.tasks.toy"]
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")
_context = None


def _forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def free_port() -> int:
    """A port nothing listens on, for a test to hand to a process that binds it later. Chosen below the kernel's
    ephemeral range: a port the kernel picked (bind to 0) is free again once released, and the kernel may give it
    to any later connection or listener (gloo's pairs, a TCPStore client) before the process binds it
    (EADDRINUSE, seen once in test_vllm_server); below that range only an explicit bind takes a port."""
    import random

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()  # not the tests' seeded global generator: two pytest processes would pick alike
    for _ in range(100):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low}")


def _child(script: str, args: list[str], env: dict[str, str], cwd: str | None, stdout: str, stderr: str) -> None:
    """One process of the run, in the forked child: the environment, folder, output and argv of `python script
    args`."""
    if cwd is not None:
        os.chdir(cwd)
    for fd, path in ((1, stdout), (2, stderr)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(handle, fd)
        os.close(handle)
    os.environ.clear()
    os.environ.update(env)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [str(Path(script).parent), *extra]
    sys.argv = [script, *args]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as the interpreter does (sys.last_* set, sys.excepthook), exit 1
        sys.last_type, sys.last_value, sys.last_traceback = sys.exc_info()
        sys.excepthook(*sys.exc_info())
        code = 1
    try:  # what a plain interpreter does at exit (os._exit below skips it): join non-daemon threads, run atexit
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _read(path: str) -> str:
    return Path(path).read_text(errors="replace") if os.path.exists(path) else ""


class Launch:
    """The processes of one `start`: `send_signal`, then `wait` for them (a `subprocess.CompletedProcess`)."""

    def __init__(self, procs, logs: tempfile.TemporaryDirectory, argv: list[str]):
        self.procs, self.logs, self.argv = procs, logs, argv

    def send_signal(self, signum: int) -> None:
        for p in self.procs:
            if p.exitcode is None:
                os.kill(p.pid, signum)

    def wait(self, timeout: float = 300, grace: float = 30) -> subprocess.CompletedProcess:
        """Until every process exits; once one fails, the others get `grace` seconds before they are killed (as
        torchrun stops the survivors). Past `timeout` all are killed and subprocess.TimeoutExpired is raised."""
        deadline, failed_at, code = time.monotonic() + timeout, None, 0
        try:
            while any(p.exitcode is None for p in self.procs):
                now = time.monotonic()
                if now > deadline:
                    raise subprocess.TimeoutExpired(self.argv, timeout)
                if failed_at is not None and now > failed_at + grace:
                    break
                multiprocessing.connection.wait([p.sentinel for p in self.procs if p.exitcode is None], timeout=0.2)
                for p in self.procs:
                    if p.exitcode not in (None, 0) and failed_at is None:
                        failed_at, code = time.monotonic(), p.exitcode
        finally:
            for p in self.procs:
                if p.exitcode is None:
                    p.kill()
                p.join()
        code = code or next((p.exitcode for p in self.procs if p.exitcode != 0), 0)
        ranks = range(len(self.procs))
        stdout, stderr = ("".join(_read(os.path.join(self.logs.name, f"{r}.{kind}")) for r in ranks)
                          for kind in ("out", "err"))
        self.logs.cleanup()
        return subprocess.CompletedProcess(self.argv, code, stdout, stderr)


def start(script, *args, nproc: int = 2, env: dict[str, str] | None = None, cwd=None) -> Launch:
    """`python -m torch.distributed.run --standalone --nproc_per_node=nproc script *args`, started, with `env` on top
    of this process's environment (gloo on CPU: ACCELERATE_USE_CPU=1, OMP_NUM_THREADS=1 unless `env` says otherwise).
    With nproc=1 it is `python script *args` (no distributed variables), as the tests run a one-process side; `cwd`
    is the folder the processes start in."""
    ctx = _forkserver()
    base = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), base.get("PYTHONPATH", "")])
    for name in [k for k in base if k in TORCHRUN_VARIABLES or k.startswith("TORCHELASTIC_")]:
        base.pop(name)  # left by an earlier run in the test process: torchrun sets its own
    port, argv, run_id = free_port(), [str(script), *map(str, args)], uuid.uuid4().hex
    logs = tempfile.TemporaryDirectory(prefix="launch-")
    procs = []
    for rank in range(nproc):
        penv = dict(base)
        if nproc > 1:
            # torchrun's worker environment (tests/test_launcher.py compares them), less what only its agent reads:
            # no agent store here (rank 0 hosts the TCPStore), no error file, no forwarded signals
            penv.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                        GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc),
                        ROLE_NAME="default", MASTER_ADDR="localhost", MASTER_PORT=str(port),
                        TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                        TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
        out, err = (os.path.join(logs.name, f"{rank}.{kind}") for kind in ("out", "err"))
        folder = None if cwd is None else str(cwd)
        proc = ctx.Process(target=_child, args=(argv[0], argv[1:], penv, folder, out, err), name=f"rank{rank}")
        proc.start()
        procs.append(proc)
    return Launch(procs, logs, argv)


def torchrun(script, *args, nproc: int = 2, env: dict[str, str] | None = None, cwd=None, timeout: float = 300,
             grace: float = 30) -> subprocess.CompletedProcess:
    """`start(...)`, then `wait(timeout, grace)`: what `subprocess.run` of the torchrun command returns."""
    return start(script, *args, nproc=nproc, env=env, cwd=cwd).wait(timeout, grace)
