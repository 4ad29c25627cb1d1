"""The uids `groupwise.agents.sandbox.run_python` gives model code when the trainer runs as root: one per concurrent
call, claimed with a lock file (released when the call is over, or when the process dies: flock), and the checks and
kills that go with them. Moved out of sandbox.py, which uses them."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

# uids run_python may use when the trainer runs as root: SANDBOX_UID_BASE .. + SANDBOX_UID_COUNT - 1 (uids no
# account should have; override with GROUPWISE_SANDBOX_UID_BASE when they clash, or to fit a user namespace's map)
SANDBOX_UID_BASE = int(os.environ.get("GROUPWISE_SANDBOX_UID_BASE", "1900000000"))
SANDBOX_UID_COUNT = 4096


_UID_LOCK = threading.Lock()
_UIDS_IN_USE: set[int] = set()
_READ_CAP_NEEDED: dict[bool, Any] = {}  # site_packages → _access_plan's answer
_NEXT_UID = os.getpid() * 7919


def _lock_dir() -> str:
    for parent in ("/run", tempfile.gettempdir()):
        if os.access(parent, os.W_OK):
            path = os.path.join(parent, "groupwise-sandbox-uids")
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise RuntimeError(f"{path} is not a private directory of this user: refusing to use it")
            return path
    raise RuntimeError("no writable directory for the sandbox uid locks")


def _uid_range_mapped(lo: int, hi: int) -> bool:
    try:
        with open("/proc/self/uid_map") as f:
            rows = [tuple(map(int, line.split())) for line in f if line.strip()]
    except OSError:
        return True
    return any(inside <= lo and hi <= inside + count for inside, _outside, count in rows)


class _ClaimedUid:
    """A uid that no other call (in this process or another) uses until `release`."""

    def __init__(self) -> None:
        if not _uid_range_mapped(SANDBOX_UID_BASE, SANDBOX_UID_BASE + SANDBOX_UID_COUNT):
            raise RuntimeError(f"uids {SANDBOX_UID_BASE}..+{SANDBOX_UID_COUNT} are not mapped in this user namespace;"
                               " set GROUPWISE_SANDBOX_UID_BASE to a free mapped range")
        global _NEXT_UID
        directory = _lock_dir()
        with _UID_LOCK:                        # rotate, so a uid whose zombies the system has not reaped yet rests
            start, _NEXT_UID = _NEXT_UID, _NEXT_UID + 1
        for i in range(SANDBOX_UID_COUNT):
            uid = SANDBOX_UID_BASE + (start + i) % SANDBOX_UID_COUNT
            with _UID_LOCK:
                if uid in _UIDS_IN_USE:
                    continue
                fd = os.open(os.path.join(directory, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)
                    continue
                if _processes_of_uid(uid, zombies=True):   # left over (zombies count for RLIMIT_NPROC), or not ours
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    os.close(fd)
                    continue
                _UIDS_IN_USE.add(uid)
                self.uid, self._fd = uid, fd
                return
        raise RuntimeError("all sandbox uids are in use")

    def release(self) -> None:
        with _UID_LOCK:
            _UIDS_IN_USE.discard(self.uid)
            os.close(self._fd)


def _proc_status(pid: str) -> dict[str, str] | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
    except (OSError, ValueError):
        return None


def _processes_of_uid(uid: int, zombies: bool = False) -> list[int]:
    """Processes whose real, effective or saved uid is `uid` (live ones only unless `zombies`)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            st = _proc_status(pid)
            if st and str(uid) in st.get("Uid", "").split()[:3] and (
                    zombies or not st.get("State", "").strip().startswith("Z")):
                found.append(int(pid))
    return found


def _kill_uid(uid: int, budget_s: float = 2.0) -> None:
    """SIGKILL every process of `uid` until none is left (the process limit bounds how many can be forked meanwhile)."""
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline:
        pids = _processes_of_uid(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.002)


def _can_run(uid: int, site_packages: bool, env: dict[str, str]) -> bool:
    """Can `uid` start this interpreter (and import ctypes) on its own?"""
    argv = [sys.executable, "-I", "-B"] + ([] if site_packages else ["-S"]) + ["-c", "import ctypes, json, decimal"]
    try:
        return subprocess.run(argv, user=uid, group=uid, extra_groups=[], cwd="/", env=dict(env),
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _closed_to_others(path: str) -> str | None:
    """The top-most directory on `path` (an absolute real path) that a uid of no account cannot traverse
    (no o+x), or None."""
    parts = path.strip("/").split("/")
    for k in range(1, len(parts) + 1):
        d = "/" + "/".join(parts[:k])
        try:
            st = os.stat(d)
        except OSError:
            return None
        if stat.S_ISDIR(st.st_mode) and not st.st_mode & stat.S_IXOTH:
            return d
    return None


def hide_plan(site_packages: bool, env: dict[str, str], workdir_parent: str) -> list[tuple[str, list[str]]] | None:
    """What the program's mount namespace needs so that the interpreter runs without reading past permissions:
    [(a directory closed to others, e.g. /root, covered by an empty tmpfs; [the directories under it the interpreter
    needs — its prefixes, its executable's links, its sys.path — bound back in])]. None when there is none, or when
    the sandbox's own directory would be hidden."""
    argv = [sys.executable, "-I", "-B"] + ([] if site_packages else ["-S"]) + [
        "-c", "import sys, json; print(json.dumps([sys.prefix, sys.base_prefix, sys.executable] + sys.path))"]
    try:
        out = subprocess.run(argv, cwd="/", env=dict(env), stdin=subprocess.DEVNULL, capture_output=True,
                             timeout=30, check=True).stdout
        paths = json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    link, chain = sys.executable, []
    for _ in range(40):  # the directory of every symlink the exec of the interpreter goes through, and the binary's
        chain.append(os.path.realpath(os.path.dirname(os.path.abspath(link))))
        if not os.path.islink(link):
            break
        link = os.path.join(os.path.dirname(link), os.readlink(link))
    needed = set(chain)
    for p in paths:
        real = os.path.realpath(p) if isinstance(p, str) and p else None
        if real and os.path.exists(real):
            needed.add(real if os.path.isdir(real) else os.path.dirname(real))  # a directory, or a zip's
    if _closed_to_others(os.path.realpath(workdir_parent)) is not None:
        return None
    plan: dict[str, list[str]] = {}
    for d in sorted(needed, key=len):  # parents first
        top = _closed_to_others(d)
        if top is None:
            continue
        if top == "/":
            return None
        kept = plan.setdefault(top, [])
        if not any(d == k or d.startswith(k + "/") for k in kept):
            kept.append(d)
    return sorted(plan.items()) or None


def _access_plan(uid: int, site_packages: bool, env: dict[str, str], probe) -> Any:
    """How the program of `uid` reaches the interpreter: None (it can on its own); a hide plan (`hide_plan`) that
    `probe(plan)` showed to work; or "read-all-files" (it keeps CAP_DAC_READ_SEARCH: the last resort)."""
    with _UID_LOCK:
        if site_packages in _READ_CAP_NEEDED:
            return _READ_CAP_NEEDED[site_packages]
    if _can_run(uid, site_packages, env):
        mode = None
    else:
        plan = hide_plan(site_packages, env, tempfile.gettempdir())
        mode = plan if plan is not None and probe(plan) else "read-all-files"
    with _UID_LOCK:
        _READ_CAP_NEEDED[site_packages] = mode
    return mode
