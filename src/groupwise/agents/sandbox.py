"""Where model-generated code is executed: `run_python`, always in a separate, contained process tree.

`run_python(code)` writes the code to `main.py` in a fresh temporary directory and runs it there with the
trainer's own interpreter in a new session (`start_new_session`), with an empty environment (PATH, HOME and
TMPDIR pointing at that directory, LANG=C.UTF-8, the BLAS/OpenMP thread counts set to 1) and `-I -B -u -X utf8`
(and `-S` unless `site_packages=True`: only the standard library is importable by default). Nothing of the code runs
in the trainer's process, and no `preexec_fn` is used (it is unsafe with threads): a small supervisor program
(`_SUPERVISOR`, run as `python -I -S -c`) sets everything up in the child before the code starts.

Process tree, per call::

    trainer ── supervisor (session and process-group leader; trusted)
                 └─ reaper (pid 1 of a new pid namespace where allowed; trusted; reaps orphans)
                      └─ python main.py (the model's code: limits applied, privileges dropped, then exec)

What is contained, and how (each mechanism is reported in `SandboxResult.isolation`; a mechanism the OS refuses is
reported as missing, never claimed):

* Wall clock (`timeout_s`): the trainer watches the call; at the deadline it SIGKILLs the whole process group, and
  everything else the call started (below). Measured here: the call returns ~0.05 s after the deadline (bounded
  by ~timeout_s + 3 s: a grace for the pipes to close, and the kill sweeps).
* CPU time (`cpu_s`, RLIMIT_CPU per process: SIGXCPU at cpu_s, SIGKILL one second later).
* Memory (`memory_mb`, RLIMIT_AS per process: allocations beyond it fail, in Python as MemoryError). This is per
  process, not per sandbox: a program that forks can hold up to max_processes x memory_mb (no cgroup is used).
* Processes and threads (`max_processes`, RLIMIT_NPROC, counting the program itself; threads count too). RLIMIT_NPROC
  counts every task of a *user*, and the kernel ignores it for uid 0, so it is made both effective and harmless:
  - trainer running as root: the code runs under a uid of its own, claimed for this call only (from
    SANDBOX_UID_BASE on, with a lock file per uid so concurrent calls and processes never share one), so the limit
    is exact and the trainer's own uid is untouched. Dropping root also means the code cannot write root's files
    nor signal any process but its own. If that uid cannot read the interpreter (e.g. Python under /root, mode
    0700), the program gets a mount namespace of its own where each directory closed to others on the
    interpreter's paths (e.g. /root) is an empty tmpfs with only the interpreter's directories (its prefixes, its
    executable's links, its sys.path) bound back in, so it can neither read nor list anything else there (the
    trainer's ~/.cache/huggingface/token, ~/.ssh, ...); reported as "hidden:<dir>". Only when that does not work
    (checked once per process) does the code keep CAP_DAC_READ_SEARCH (it can then *read* every file, it still
    cannot write them); reported as "read-all-files". The program also runs with no_new_privs, so set-uid binaries
    cannot give root back.
  - other users, with an unprivileged user namespace: the count is per namespace, so the limit is exact too (the
    code keeps the user's uid, and so the user's file permissions).
  - other users without one (or without a pid namespace): the code would run as the trainer's own user, able to
    signal the trainer's processes and, without a user namespace, to read their environment (HF_TOKEN, keys) in
    /proc. So this is refused (run_python raises, naming the fix) unless `allow_same_user=True` or
    GROUPWISE_SANDBOX_ALLOW_SAME_USER=1. Then the limit is set to the user's current task count + max_processes, so
    the code can add at most max_processes tasks whatever it does and the trainer keeps its own (larger) limit;
    concurrent sandboxes of one user share that headroom. Reported as "nproc-relative".
* Files (`max_file_mb`, RLIMIT_FSIZE per file written; RLIMIT_CORE=0, RLIMIT_NOFILE=256). The number of files is not
  limited: the code can fill the disk of its temp dir (or /tmp) until the wall clock stops it. As root (a uid of its
  own), what that uid left at the top of the standard world-writable directories — /tmp, /var/tmp, /dev/shm (RAM),
  /run/lock (/var/lock), /var/crash — is deleted after the call, with the call's processes; deeper, in another
  user's world-writable directory, or in a world-writable directory elsewhere, it stays. A non-root trainer's code runs
  as the trainer's user, whose files cannot be told apart: what it leaves there stays.
* Leftover processes: when the program's main process ends (or at the deadline) every process it started is killed,
  detached ones (setsid, double fork) included: with a pid namespace its pid 1 (the reaper) exits, and the kernel
  kills the rest; as root, additionally every process of the call's uid is killed; otherwise the reaper is a child
  subreaper that kills every orphan it inherits. Only in the last case (non-root, no user namespaces) can code that
  kills the reaper first leave a detached process behind. (Killed processes can stay zombies, dead and holding
  nothing, until the system's init reaps them.)
* Network (`network=False`): a new network namespace where allowed (only a loopback device that is down: no
  connection to anything, localhost included), reported as network="netns". Where unshare is refused, the call is
  refused (run_python raises, naming the fix) unless `allow_socket_patch=True` or
  GROUPWISE_SANDBOX_ALLOW_SOCKET_PATCH=1: then a Python-level block replaces `socket.socket` for non-Unix families
  inside the child, which stops ordinary Python code but NOT ctypes, `_socket`, or a subprocess such as curl:
  reported as network="python-socket-patch".
* Environment: the trainer's environment variables (tokens, keys) are not passed on.
* The temporary directory is deleted after the call.

Not contained: filesystem *reads* (the code can read whatever its uid can: for a non-root trainer, everything the
trainer's user can; as root, what others may read, outside the hidden directories), writes outside the temp dir to
places its uid may write (for a non-root trainer: everything the trainer's user can write; as root, only
world-writable places such as /tmp), information in /proc — the pid namespace's /proc is not remounted, so the
code still lists the host's processes and reads their command lines (a `--hub_token` given on the trainer's command
line too; their environments stay closed to another uid) —, and total memory/disk as noted above. Use a container
or VM for adversarial isolation.

What works on the machine this was written on (Linux 6.18, running as root, Debian 12, Python 3.11): pid and
network namespaces (unshare as root), a per-call uid (with hidden:/root, because the interpreter lives under
/root), RLIMIT_NPROC exact for that uid.

`groupwise.agents.execution.call_with_timeout(fn, kwargs, timeout_s)` is the other half: it runs a *trusted* tool (a
Python function the user passed) in-process, in a worker thread, with a wall-clock timeout. A timed-out call cannot be stopped (Python threads
cannot be killed): it is abandoned as a daemon thread and keeps running in the background. Tools that run code
must therefore go through `run_python`.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from groupwise.agents.sandbox_uids import SANDBOX_UID_BASE, SANDBOX_UID_COUNT, _access_plan, _ClaimedUid, _kill_uid
from groupwise.rewards.calls import MachineError

__all__ = ["SANDBOX_UID_BASE", "SANDBOX_UID_COUNT", "SandboxResult", "run_python"]

_CHILD_ENV_BASE = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
                   "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_MAX_OPEN_FILES = 256
_USE_NAMESPACES = True  # False: behave as where unshare is refused (tests use it to exercise the fallbacks)
_OWN_UID = True         # False: no uid of its own even as root, as for a non-root trainer (tests use it)
_GRACE_S = 1.0          # after the deadline / after the supervisor ended: how long to wait for the pipes to close


class SandboxUnavailable(MachineError):
    """The sandbox cannot run here (its containment or supervisor failed before the code ran): the run stops."""


@dataclass(frozen=True)
class SandboxResult:
    """What a `run_python` call did.

    returncode: the program's exit status (negative: killed by that signal, as in subprocess), None when it never
    ran to a status (e.g. the deadline killed the whole tree first). timed_out: the wall-clock deadline was hit.
    limit_hit: "wall_timeout" or "cpu_time" (from the kernel's verdict), "memory" or "file_size" (inferred from a
    MemoryError / ENOMEM / EFBIG message at the end of stderr), or None. stdout/stderr: at most max_output_chars
    each (the first ones), with *_truncated telling whether more was written. isolation: the mechanisms that were
    actually in force (see the module docstring): always "subprocess", "rlimits", "empty-env", "temp-dir"; then
    "user-namespace" / "pid-namespace" / "net-namespace" for each namespace obtained (the pid namespace contains
    the call's processes; /proc still lists the host's, see above); how the process limit is made
    per-sandbox: "own-uid:<uid>" (root), "nproc-per-namespace" or "nproc-relative"; "hidden:<dir>" or
    "read-all-files" (see above); "subreaper-cleanup" when leftovers are killed by the reaper alone;
    ("not-started",) when the deadline came before the supervisor had set anything up. network: "netns",
    "python-socket-patch" or "allowed".
    pid: the supervisor's pid on the host, which is also the session and process-group id of the call.
    """

    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool
    limit_hit: str | None
    duration_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    network: str = "allowed"
    isolation: tuple[str, ...] = ()
    pid: int | None = None

    @property
    def ok(self) -> bool:
        """The program ran to completion and exited 0."""
        return self.returncode == 0 and not self.timed_out


# ---------------------------------------------------------------------------------------------------------------------
# The supervisor: runs in the child as `python -I -S -B -X utf8 -c _SUPERVISOR CONFIG_JSON`, single-threaded.
# It reports on the status pipe (fd cfg["status_fd"]) one JSON line {"event": "setup", ...} once namespaces are
# decided, and one {"event": "exit", ...} with the program's wait status and CPU time when it ends.
# The supervisor program (supervisor.py, run from its text with `python -c`, never imported here).
_SUPERVISOR = (Path(__file__).parent / "supervisor.py").read_text()

# The program run instead of main.py when only a Python-level network block is possible (socket_patch.py's text).
_SOCKET_PATCH = (Path(__file__).parent / "socket_patch.py").read_text()


# ---------------------------------------------------------------------------------------------------------------------

class _Capture:
    """Keeps the first `max_chars` characters of a stream (reading on and dropping the rest) and its last bytes."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self.max_bytes = 4 * max_chars + 4
        self.head = bytearray()
        self.tail = b""
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.max_bytes - len(self.head)
        if room > 0:
            self.head += data[:room]
        self.tail = (self.tail + data)[-4096:]

    def text(self) -> tuple[str, bool]:
        text = self.head.decode("utf-8", errors="replace")
        truncated = self.total > len(self.head) or len(text) > self.max_chars
        return text[:self.max_chars], truncated


# the world-writable directories the filesystem standard places (/var/lock is usually a link to /run/lock, read once):
# where code of any uid can leave files for a later call (another uid) to read
SHARED_TEMP_DIRS = tuple(dict.fromkeys(os.path.realpath(d) for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock",
                                                                    "/var/lock", "/var/crash")
                                        if os.path.isdir(d) and os.stat(d).st_mode & 0o002))  # world-writable


def _remove_files_of(uid: int) -> None:
    """Delete what `uid` (a call's own, its processes killed) left at the top of the shared temp directories: files
    there outlive the call (/dev/shm's hold RAM), and a sticky directory lets no one else's be taken for its.
    Symlinks are removed, never followed."""
    for top in SHARED_TEMP_DIRS:
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    _remove_tree(entry.path)
                else:
                    os.unlink(entry.path)
            except OSError:
                pass


def _remove_tree(path: str) -> None:
    """Delete the tree at `path`, whatever modes the code gave its folders (made 0700 on a refusal, inside the tree
    only: never the folder that holds `path`, such as /tmp)."""
    def retry(func, p, _exc):
        try:
            if p != path:
                os.chmod(os.path.dirname(p), 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass
    try:
        shutil.rmtree(path, onerror=retry)
    except RecursionError:      # the code made a tree deeper than Python's recursion limit (a mkdir/chdir loop)
        pass
    if os.path.lexists(path):
        _remove_deep(path)


def _remove_deep(path: str) -> None:
    """Remove the tree at `path` iteratively and fd-relative, so its depth and PATH_MAX do not matter: one directory
    fd open at a time, back up through "..", which nothing moves any more (the call's processes are dead). Best
    effort: stops at the first entry that cannot be removed."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    names: list[str] = []
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        while True:
            sub = None
            with os.scandir(fd) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        sub = entry.name
                        break
                    os.unlink(entry.name, dir_fd=fd)
            if sub is not None:
                try:
                    child = os.open(sub, flags, dir_fd=fd)
                except PermissionError:  # a directory the code made unreadable (same-user mode)
                    os.chmod(sub, 0o700, dir_fd=fd)
                    child = os.open(sub, flags, dir_fd=fd)
                os.close(fd)
                fd = child
                names.append(sub)
                if os.geteuid() != 0:
                    os.chmod(fd, 0o700)  # writable, so that its entries can be removed (same-user mode)
            elif names:
                parent = os.open("..", flags, dir_fd=fd)
                os.close(fd)
                fd = parent
                os.rmdir(names.pop(), dir_fd=fd)
            else:
                break
    except OSError:
        return
    finally:
        os.close(fd)
    try:
        os.rmdir(path)
    except OSError:
        pass


def _exited(pid: int) -> bool:
    """Has the child `pid` exited? (Leaves it unreaped, so its pid and process group id cannot be reused yet.)"""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_python(code: str, *, timeout_s: float = 5.0, cpu_s: int = 5, memory_mb: int = 512, max_processes: int = 32,
               max_output_chars: int = 10_000, max_file_mb: int = 16, network: bool = False,
               site_packages: bool = False, allow_same_user: bool = False,
               allow_socket_patch: bool = False) -> SandboxResult:
    """Run `code` as a Python program in a contained child process tree and return what it printed and how it ended.

    timeout_s: wall clock for the whole call (default 5 s); at the deadline every process of the call is killed.
    cpu_s: CPU seconds per process (RLIMIT_CPU, default 5). memory_mb: address space per process (RLIMIT_AS,
    default 512 MiB). max_processes: processes + threads alive at once, the program included (RLIMIT_NPROC made
    per-sandbox, default 32). max_output_chars: characters kept of stdout and of stderr each (default 10 000; the
    rest is read and dropped, so a print loop cannot fill memory). max_file_mb: size of any one file written
    (RLIMIT_FSIZE, default 16 MiB). network: False (default) cuts it off (see `SandboxResult.network` for how).
    site_packages: also let the program import the installed packages (default: the standard library only).
    allow_same_user: run the code even where it would run as the trainer's own user without a user and a pid namespace
    (non-root, namespaces refused: it could then read the trainer's environment in /proc and signal it); refused by
    default (a RuntimeError naming the fix) unless this or GROUPWISE_SANDBOX_ALLOW_SAME_USER=1 is set.
    allow_socket_patch: with network=False where no network namespace can be made, run the code behind the
    Python-level socket block (which ctypes, _socket or a subprocess gets past); refused by default (a RuntimeError
    naming the fix) unless this or GROUPWISE_SANDBOX_ALLOW_SOCKET_PATCH=1 is set.

    Thread-safe: calls may run concurrently (each has its own directory, pipes, process tree and, as root, uid).
    The module docstring says what is and is not contained.
    """
    if timeout_s <= 0 or cpu_s < 1 or memory_mb < 32 or max_processes < 1 or max_output_chars < 0 or max_file_mb < 0:
        raise ValueError("run_python: timeout_s > 0, cpu_s >= 1, memory_mb >= 32, max_processes >= 1, "
                         "max_output_chars >= 0 and max_file_mb >= 0 are required")
    return _run(code, timeout_s, cpu_s, memory_mb, max_processes, max_output_chars, max_file_mb, network,
                site_packages, allow_same_user, allow_socket_patch, access=...)


def _run(code: str, timeout_s: float, cpu_s: int, memory_mb: int, max_processes: int, max_output_chars: int,
         max_file_mb: int, network: bool, site_packages: bool, allow_same_user: bool, allow_socket_patch: bool,
         access: Any) -> SandboxResult:
    """run_python; `access`: how a uid of its own reaches the interpreter (sandbox_uids._access_plan; ...: ask it)."""
    claimed = _ClaimedUid() if os.geteuid() == 0 and _OWN_UID else None
    workdir = status_r = proc = None
    try:
        if claimed is not None and access is ...:  # once per process (cached): not counted in timeout_s
            access = _access_plan(claimed.uid, site_packages, _CHILD_ENV_BASE,
                                  lambda plan: _hide_works(plan, site_packages))
        t0 = time.monotonic()
        read_all = claimed is not None and access == "read-all-files"
        hide = access if claimed is not None and isinstance(access, list) else None
        workdir = tempfile.mkdtemp(prefix="groupwise-sandbox-")
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        if claimed is not None:
            os.chown(workdir, claimed.uid, claimed.uid)
        env = dict(_CHILD_ENV_BASE, HOME=workdir, TMPDIR=workdir)
        flags = [sys.executable, "-I", "-B", "-u", "-X", "utf8"] + ([] if site_packages else ["-S"])
        status_r, status_w = os.pipe()
        cfg = {"status_fd": status_w, "host_pid": os.getpid(), "network": network, "use_namespaces": _USE_NAMESPACES,
               "uid": claimed.uid if claimed else None, "read_all_files": read_all, "hide": hide,
               "cpu_s": int(cpu_s), "memory_mb": int(memory_mb), "max_processes": int(max_processes),
               "max_file_mb": int(max_file_mb), "max_open_files": _MAX_OPEN_FILES, "env": env,
               "argv": flags + ["main.py"], "argv_socket_patch": flags + ["-c", _SOCKET_PATCH],
               "allow_same_user": allow_same_user or os.environ.get("GROUPWISE_SANDBOX_ALLOW_SAME_USER") == "1",
               "allow_socket_patch": allow_socket_patch or os.environ.get("GROUPWISE_SANDBOX_ALLOW_SOCKET_PATCH") == "1"}
        try:
            supervisor = [sys.executable, "-I", "-S", "-B", "-X", "utf8", "-c", _SUPERVISOR, json.dumps(cfg)]
            proc = subprocess.Popen(supervisor, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, cwd=workdir, env=env, start_new_session=True,
                                    pass_fds=(status_w,))
        finally:
            os.close(status_w)
        return _watch(proc, status_r, claimed.uid if claimed else None, read_all, hide, t0, timeout_s, cpu_s,
                      max_output_chars)
    finally:
        if proc is not None:
            for stream in (proc.stdout, proc.stderr):
                stream.close()
            if proc.returncode is None:        # only on an error in _watch: make sure nothing is left running
                _killpg(proc.pid)
                proc.wait()
        if status_r is not None:
            os.close(status_r)
        if claimed is not None:
            _kill_uid(claimed.uid)
            _remove_files_of(claimed.uid)
            claimed.release()
        if workdir is not None:
            _remove_tree(workdir)


def _hide_works(plan: list, site_packages: bool) -> bool:
    """Does the interpreter start (and import ctypes) in a sandbox whose mount namespace follows `plan`?"""
    try:
        return _run("import ctypes, json, decimal", 30.0, 5, 512, 8, 1000, 1, False, site_packages, False, True,
                    plan).ok
    except (OSError, RuntimeError):  # e.g. mounts refused: the setup fails closed, the code did not run
        return False


def _watch(proc: subprocess.Popen, status_r: int, uid: int | None, read_all: bool, hide: list | None, t0: float,
           timeout_s: float, cpu_s: int, max_output_chars: int) -> SandboxResult:
    out, err, status = _Capture(max_output_chars), _Capture(max_output_chars), _Capture(1 << 16)
    captures = {proc.stdout.fileno(): out, proc.stderr.fileno(): err, status_r: status}
    deadline = t0 + timeout_s
    timed_out = False
    stop_at = None                   # once the tree is dead (or killed): stop waiting for stragglers' pipes then
    setup: dict[str, Any] = {}
    with selectors.DefaultSelector() as sel:
        for fd in captures:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            now = time.monotonic()
            if stop_at is None and now >= deadline:
                timed_out = True
                setup = _parse_status(status)[0] or setup
                if setup.get("nproc_mode") == "relative" and "pid" not in setup.get("namespaces", ()):
                    try:                     # let the supervisor (a subreaper) kill what it adopted, briefly
                        os.kill(proc.pid, signal.SIGUSR1)
                        proc_deadline = time.monotonic() + 0.5
                        while not _exited(proc.pid) and time.monotonic() < proc_deadline:
                            time.sleep(0.01)
                    except OSError:
                        pass
                _finish(proc.pid, uid)
                stop_at = time.monotonic() + _GRACE_S
            elif stop_at is None and _exited(proc.pid):
                _finish(proc.pid, uid)
                stop_at = time.monotonic() + _GRACE_S
            elif stop_at is not None and now >= stop_at:
                break
            wait = (stop_at if stop_at is not None else min(deadline, now + 0.2)) - now
            for key, _ in sel.select(max(wait, 0.0)):
                try:
                    data = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                if data:
                    captures[key.fd].feed(data)
                else:
                    sel.unregister(key.fd)
    if stop_at is None:                # every pipe closed: the supervisor has ended (or is ending)
        _finish(proc.pid, uid)
    proc.wait()
    duration = time.monotonic() - t0
    setup, exit_event, failed = _parse_status(status)
    stdout, stdout_trunc = out.text()
    stderr, stderr_trunc = err.text()
    returncode = None
    if exit_event and exit_event.get("status") is not None:
        returncode = -exit_event["signal"] if "signal" in exit_event else exit_event["code"]
    if failed is not None:                   # the program's containment could not be set up: it never ran
        raise SandboxUnavailable(f"run_python: the sandbox could not be set up, the code did not run: {failed}")
    if not setup and not timed_out:          # the supervisor (trusted code, before any of the program's) failed
        raise SandboxUnavailable(f"run_python: the sandbox supervisor failed (exit {proc.returncode}): "
                           f"{err.tail.decode(errors='replace')}")
    limit = None
    if timed_out:
        limit = "wall_timeout"
    elif exit_event and (exit_event.get("signal") == signal.SIGXCPU or exit_event.get("signal") == signal.SIGKILL
                         and (exit_event.get("cpu_s") or 0) >= cpu_s - 0.05):
        limit = "cpu_time"
    elif returncode not in (0, None):
        tail = err.tail[-1000:]
        if b"MemoryError" in tail or b"Cannot allocate memory" in tail:
            limit = "memory"
        elif b"File too large" in tail:
            limit = "file_size"
    if setup:
        isolation = ["subprocess", "rlimits", "empty-env", "temp-dir"]
        isolation += [f"{ns}-namespace" for ns in setup["namespaces"]]
        mode = setup["nproc_mode"]
        isolation.append({"uid": f"own-uid:{uid}", "userns": "nproc-per-namespace", "relative": "nproc-relative"}[mode])
        if read_all:
            isolation.append("read-all-files")
        isolation += [f"hidden:{top}" for top, _ in hide or ()]
        if "pid" not in setup["namespaces"] and mode != "uid":
            isolation.append("subreaper-cleanup")
    else:                                    # killed at the deadline before the supervisor had set anything up
        isolation = ["not-started"]
    return SandboxResult(stdout=stdout, stderr=stderr, returncode=returncode, timed_out=timed_out, limit_hit=limit,
                         duration_s=duration, stdout_truncated=stdout_trunc, stderr_truncated=stderr_trunc,
                         network=setup.get("network", "allowed"), isolation=tuple(isolation), pid=proc.pid)


def _finish(pid: int, uid: int | None) -> None:
    """Kill whatever of the call is still alive: its process group (the supervisor is not reaped yet, so the id is
    still ours) and, as root, every process of its uid."""
    _killpg(pid)
    if uid is not None:
        _kill_uid(uid)


def _parse_status(capture: _Capture) -> tuple[dict, dict, str | None]:
    setup, exit_event, failed = {}, {}, None
    for line in bytes(capture.head).splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "setup":
            setup = event
        elif event.get("event") == "exit":
            exit_event = event
        elif event.get("event") == "setup_failed":
            failed = str(event.get("error"))
    return setup, exit_event, failed
