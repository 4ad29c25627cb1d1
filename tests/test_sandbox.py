"""groupwise.agents.sandbox: model code runs in a contained process tree; trusted tools get a wall-clock timeout.

Every containment test checks the effect (the process is gone, the connection never arrived, the file was not
written), not just a flag. The ones marked with the `mode` fixture run twice: with the namespaces this machine
allows, and as where unshare is refused (the fallbacks: Python-level socket block, subreaper / uid cleanup).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import time

import pytest

from groupwise.agents import sandbox, sandbox_uids
from groupwise.agents.execution import call_with_timeout
from groupwise.agents.sandbox import SandboxUnavailable, run_python

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux (/proc, rlimits)")


@pytest.fixture(autouse=True)
def same_user_allowed(monkeypatch):
    """The containment tests also run where only the same-user mode exists (non-root, no user namespaces), and
    where no network namespace can be made (the "fallback" mode below), which run_python refuses by default
    (test_same_user_mode_is_refused_unless_allowed, test_the_socket_patch_is_refused_unless_allowed)."""
    monkeypatch.setenv("GROUPWISE_SANDBOX_ALLOW_SAME_USER", "1")
    monkeypatch.setenv("GROUPWISE_SANDBOX_ALLOW_SOCKET_PATCH", "1")


@pytest.fixture(params=["namespaces", "fallback"])
def mode(request, monkeypatch):
    if request.param == "fallback":
        monkeypatch.setattr(sandbox, "_USE_NAMESPACES", False)
    return request.param


def _stat_fields(pid: str) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()     # state, ppid, pgrp, session, ...
    except (OSError, IndexError):
        return None


def _survivors(result, marker: bytes | None = None) -> list[int]:
    """Live (non-zombie) processes left by a call: in its session or process group, of its uid (when it had one),
    or with `marker` on their command line."""
    own_uid = next((int(tag.split(":")[1]) for tag in result.isolation if tag.startswith("own-uid:")), None)
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fields = _stat_fields(pid)
        if fields is None or fields[0] == b"Z":
            continue
        hit = int(fields[2]) == result.pid or int(fields[3]) == result.pid
        if own_uid is not None:
            try:
                hit |= os.stat(f"/proc/{pid}").st_uid == own_uid
            except OSError:
                pass
        if marker is not None:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    hit |= marker in f.read()
            except OSError:
                pass
        if hit:
            found.append(int(pid))
    return found


def test_normal_code_returns_stdout_and_zero():
    r = run_python("import sys\nprint('hello', 6 * 7)\nprint('warn', file=sys.stderr)")
    assert (r.stdout, r.stderr, r.returncode, r.timed_out, r.limit_hit) == ("hello 42\n", "warn\n", 0, False, None)
    assert r.ok and r.duration_s < 5 and "subprocess" in r.isolation
    assert r.pid != os.getpid()


def test_exception_and_exit_code_reported():
    r = run_python("def f():\n    raise ValueError('boom')\nf()")
    assert r.returncode == 1 and not r.ok
    assert "ValueError: boom" in r.stderr and 'main.py", line 2' in r.stderr
    assert run_python("import sys; sys.exit(3)").returncode == 3


def test_busy_loop_is_stopped_by_the_cpu_limit():
    r = run_python("while True:\n    pass", cpu_s=1, timeout_s=15)
    assert r.limit_hit == "cpu_time" and not r.timed_out and r.returncode in (-24, -9)  # SIGXCPU, or SIGKILL at hard
    assert r.duration_s < 8


def test_sleeping_code_is_stopped_by_the_wall_clock():
    t0 = time.monotonic()
    r = run_python("import time\nprint('before', flush=True)\ntime.sleep(100)", timeout_s=1)
    assert r.timed_out and r.limit_hit == "wall_timeout" and not r.ok
    assert r.stdout == "before\n"                     # output written before the kill is kept
    assert 1 <= time.monotonic() - t0 < 4
    assert _survivors(r) == []


def test_process_limit_is_enforced_and_children_are_killed(mode):
    code = """
import os, time
n = 0
try:
    while n < 500:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        n += 1
except OSError as e:
    print("blocked after", n, e.errno)
"""
    r = run_python(code, max_processes=8, timeout_s=10)
    assert r.returncode == 0, r.stderr
    words = r.stdout.split()
    assert words[:2] == ["blocked", "after"] and int(words[3]) == 11      # EAGAIN from fork
    assert 1 <= int(words[2]) <= 7                                        # 8 processes at most, itself included
    assert _survivors(r) == []                                            # the sleeping children went with it


def test_fork_bomb_is_contained_and_leaves_nothing(mode):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    t0 = time.monotonic()
    r = run_python(bomb, timeout_s=2, max_processes=16)
    assert time.monotonic() - t0 < 2 + 3
    assert r.timed_out and r.limit_hit == "wall_timeout"
    time.sleep(0.1)
    assert _survivors(r) == []                        # nothing alive in its session, process group or uid
    # this process can still fork and spawn
    assert subprocess.run(["true"]).returncode == 0
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7
    assert run_python("print(1)").stdout == "1\n"


def test_memory_bomb_fails_without_hurting_the_parent():
    before = resource.getrlimit(resource.RLIMIT_AS), resource.getrlimit(resource.RLIMIT_NPROC)
    r = run_python("x = bytearray(2**34)")
    assert r.returncode == 1 and "MemoryError" in r.stderr and r.limit_hit == "memory"
    r = run_python("x = []\nwhile True:\n    x.append(bytearray(10**7))", memory_mb=128, timeout_s=10)
    assert r.returncode != 0 and r.limit_hit == "memory" and not r.timed_out
    assert (resource.getrlimit(resource.RLIMIT_AS), resource.getrlimit(resource.RLIMIT_NPROC)) == before
    big = bytearray(2**28)                            # the parent's own allocations are unaffected
    assert len(big) == 2**28


def test_background_and_detached_children_are_killed_when_the_call_ends(mode):
    marker = f"{os.getpid() % 1000}.{time.time_ns() % 10**6:06d}"   # a unique `sleep` argument to look for
    code = f"""
import os, subprocess
subprocess.Popen(["sleep", "9{marker}"])
subprocess.Popen(["sleep", "8{marker}"], start_new_session=True)
if os.fork() == 0:                                 # double fork + setsid: a classic daemon
    os.setsid()
    if os.fork() == 0:
        os.execvp("sleep", ["sleep", "7{marker}"])
    os._exit(0)
print("started")
"""
    r = run_python(code, timeout_s=10)
    assert r.stdout == "started\n" and r.returncode == 0, r.stderr
    time.sleep(0.1)
    assert _survivors(r, marker.encode()) == []


def test_network_is_refused(mode):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.3)
    port = listener.getsockname()[1]
    code = f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=3)
    print("connected")
except OSError as e:
    print("refused", type(e).__name__)
"""
    try:
        r = run_python(code)
        assert r.stdout.startswith("refused"), (r.stdout, r.stderr)
        assert r.network == ("netns" if mode == "namespaces" and "net-namespace" in r.isolation else
                             "python-socket-patch")
        if r.network == "netns":                      # a real boundary: the low-level module cannot get out either
            raw = run_python(f"import _socket\ns = _socket.socket()\ns.settimeout(3)\n"
                             f"try:\n    s.connect(('127.0.0.1', {port})); print('connected')\n"
                             f"except OSError as e:\n    print('refused', e.errno)")
            assert raw.stdout.startswith("refused"), raw.stdout
        with pytest.raises(socket.timeout):           # nothing ever reached the listener
            listener.accept()
        allowed = run_python(code, network=True)      # the same code does connect when the network is allowed
        assert allowed.stdout == "connected\n" and allowed.network == "allowed", allowed.stderr
        listener.accept()[0].close()
    finally:
        listener.close()


def test_output_flood_is_truncated():
    r = run_python("import sys\nfor i in range(2000):\n    sys.stdout.write('x' * 999 + '\\n')", max_output_chars=1000)
    assert r.ok and len(r.stdout) == 1000 and r.stdout_truncated and not r.stderr_truncated
    r = run_python("while True:\n    print('y' * 100)", timeout_s=1, max_output_chars=500)
    assert r.timed_out and len(r.stdout) == 500 and r.stdout_truncated
    r = run_python("print('é' * 10)", max_output_chars=5)
    assert r.stdout == "ééééé" and r.stdout_truncated


def test_parent_environment_is_not_passed_on(monkeypatch):
    monkeypatch.setenv("GROUPWISE_SANDBOX_TEST_SECRET", "hunter2-token")
    r = run_python("import os\nprint(sorted(os.environ.items()))\nprint(os.getcwd() == os.environ['HOME'])")
    assert r.ok and "hunter2" not in r.stdout and "GROUPWISE_SANDBOX_TEST_SECRET" not in r.stdout
    assert r.stdout.splitlines()[-1] == "True"


def test_working_directory_is_private_and_deleted():
    r = run_python("import os\nopen('data.txt', 'w').write('ok')\nprint(os.getcwd())\nprint(os.listdir('.'))")
    cwd, listing = r.stdout.splitlines()
    assert r.ok and "data.txt" in listing
    assert os.path.basename(cwd).startswith("groupwise-sandbox-") and not os.path.exists(cwd)


@pytest.mark.skipif(os.geteuid() != 0, reason="writes elsewhere are only prevented when the trainer is root "
                                              "(the code then runs under a uid of its own)")
def test_as_root_the_code_cannot_write_the_trainers_files(tmp_path):
    target = tmp_path / "owned-by-root.txt"
    os.chmod(tmp_path, 0o755)
    r = run_python(f"open({str(target)!r}, 'w').write('pwned')")
    assert r.returncode == 1 and "PermissionError" in r.stderr
    assert not target.exists()
    assert any(tag.startswith("own-uid:") for tag in r.isolation)


@pytest.mark.skipif(os.geteuid() != 0, reason="as another user the code runs with that user's own permissions")
def test_as_root_the_code_cannot_read_the_trainers_private_files(tmp_path):
    # where the interpreter lives in a directory closed to others (/root/.pyenv, mode 0700), the code used to keep
    # CAP_DAC_READ_SEARCH to start at all, so it could read every file: ~/.cache/huggingface/token, ~/.ssh, ...
    secret = tmp_path / "token"
    secret.write_text("hf_secret")
    os.chmod(secret, 0o600)
    os.chmod(tmp_path, 0o755)
    r = run_python(f"print(open({str(secret)!r}).read())")
    assert "hf_secret" not in r.stdout and "PermissionError" in r.stderr, r
    plan = sandbox_uids.hide_plan(False, sandbox._CHILD_ENV_BASE, "/tmp")
    if plan is not None:  # the directory that kept the interpreter from the code's uid is covered, not read past
        assert "read-all-files" not in r.isolation and [f"hidden:{top}" for top, _ in plan] == [
            tag for tag in r.isolation if tag.startswith("hidden:")]
        top, kept = plan[0]
        listing = run_python(f"import os\nprint(os.listdir({top!r}))").stdout
        assert set(eval(listing)) == {os.path.relpath(d, top).split("/")[0] for d in kept}
    site = run_python("import jinja2\nprint(jinja2.__name__)", site_packages=True, timeout_s=20)
    assert site.ok and site.stdout == "jinja2\n", site  # the installed packages are still importable


def test_a_directory_tree_deeper_than_the_recursion_limit_is_removed():
    # shutil.rmtree recurses once per level: a mkdir/chdir loop made run_python raise RecursionError in the trainer
    # and leave the tree on disk
    depth = sys.getrecursionlimit() + 500
    r = run_python(f"import os\nprint(os.getcwd())\nfor _ in range({depth}):\n    os.mkdir('d')\n    os.chdir('d')\n"
                   "    open('f', 'w').close()\nprint('deep')", timeout_s=20)
    workdir, done = r.stdout.splitlines()
    assert r.ok and done == "deep", r
    assert os.path.basename(workdir).startswith("groupwise-sandbox-") and not os.path.lexists(workdir)


def test_concurrent_calls_from_a_thread_pool():
    def one(i):
        return run_python(f"import time\ntime.sleep(0.2)\nprint({i})")
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(8)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(8)]
    assert all(r.ok for r in results) and len({r.pid for r in results}) == 8
    assert time.monotonic() - t0 < 8


def test_call_with_timeout():
    t0 = time.monotonic()
    def slow(seconds):
        time.sleep(seconds)
    out = call_with_timeout(slow, {"seconds": 30}, timeout_s=0.3)
    assert (out.ok, out.error) == (False, "timeout") and "timed out" in out.content
    assert time.monotonic() - t0 < 1.5

    def boom(x):
        raise ValueError(f"bad {x}")
    out = call_with_timeout(boom, {"x": 3}, timeout_s=5)
    assert (out.ok, out.error, out.content) == (False, "exception", "ValueError: bad 3")
    out = call_with_timeout(lambda: sys.exit(2), {}, timeout_s=5)
    assert (out.ok, out.error) == (False, "exception") and out.content.startswith("SystemExit")

    out = call_with_timeout(lambda a, b: a + b, {"a": 2, "b": 3}, 5)
    assert (out.ok, out.content, out.error) == (True, "5", None)
    out = call_with_timeout(lambda: {"temp": 21.5, "unit": "C"}, None, 5)
    assert out.ok and out.error is None and out.content == '{"temp": 21.5, "unit": "C"}'
    assert call_with_timeout(lambda: "plain text", {}, 5).content == "plain text"

    async def fetch(q):
        return f"result for {q}"
    assert call_with_timeout(fetch, {"q": "x"}, 5).content == "result for x"

    def needs_the_sandbox():  # a machine that cannot sandbox is not the model's error: raised, as in the tool loop
        raise SandboxUnavailable("user namespaces are off")
    with pytest.raises(SandboxUnavailable, match="user namespaces are off"):
        call_with_timeout(needs_the_sandbox, {}, 5)


def test_same_user_mode_is_refused_unless_allowed(monkeypatch):
    monkeypatch.setattr(sandbox, "_USE_NAMESPACES", False)   # no namespaces …
    monkeypatch.setattr(sandbox, "_OWN_UID", False)          # … and no uid of its own, as for a non-root trainer
    monkeypatch.delenv("GROUPWISE_SANDBOX_ALLOW_SAME_USER")
    code = f"import os\nprint(len(open('/proc/{os.getpid()}/environ', 'rb').read()) > 0)\nos.kill({os.getpid()}, 0)"
    with pytest.raises(RuntimeError, match=r"could not be set up.*could signal the trainer's processes and read "
                                           r"their environment.*run_python\(allow_same_user=True\)"):
        run_python(code)
    r = run_python(code, allow_same_user=True)                # what it would expose: the trainer's environment
    assert r.ok and r.stdout == "True\n" and "nproc-relative" in r.isolation, r.stderr
    monkeypatch.setenv("GROUPWISE_SANDBOX_ALLOW_SAME_USER", "1")
    assert run_python(code).ok


def test_the_socket_patch_is_refused_unless_allowed(monkeypatch):
    """Where no network namespace can be made, network=False used to fall back to a Python-level socket block that
    `_socket` gets past (reported only in result.network): refused now, naming the fix, unless accepted."""
    monkeypatch.setattr(sandbox, "_USE_NAMESPACES", False)  # as where unshare(CLONE_NEWNET) is refused
    monkeypatch.delenv("GROUPWISE_SANDBOX_ALLOW_SOCKET_PATCH")
    with pytest.raises(RuntimeError, match=r"network=False, but no network namespace could be made .* ctypes, "
                                           r"_socket or a subprocess gets past .*run_python\(allow_socket_patch=True\)"):
        run_python("print('ran')")
    r = run_python("print('ran')", allow_socket_patch=True)
    assert r.ok and r.stdout == "ran\n" and r.network == "python-socket-patch"
    assert run_python("print('ran')", network=True).ok  # no block asked for: nothing to refuse
    monkeypatch.setenv("GROUPWISE_SANDBOX_ALLOW_SOCKET_PATCH", "1")
    assert run_python("print('ran')").network == "python-socket-patch"


@pytest.mark.skipif(os.geteuid() != 0 or not sandbox._OWN_UID, reason="a uid of the call's own (root) is needed to "
                    "tell the call's files from the trainer's")
def test_what_the_call_left_in_the_shared_temp_dirs_is_deleted():
    """/dev/shm (RAM), /tmp and /var/tmp outlived the call: 3 calls of 8 × 15 MiB files held 360 MiB of /dev/shm;
    /run/lock (world-writable, RAM) kept a file a later call of another uid read back."""
    tag = f"groupwise-test-{os.getpid()}"
    assert "/run/lock" not in os.path.realpath("/tmp") and (not os.path.isdir("/run/lock")
                                                             or "/run/lock" in sandbox.SHARED_TEMP_DIRS)
    code = (f"import os\nfor top in {sandbox.SHARED_TEMP_DIRS!r}:\n"
            f"    open(os.path.join(top, '{tag}'), 'wb').write(b'x' * 1024)\n"
            f"    os.makedirs(os.path.join(top, '{tag}-dir', 'sub'))\n"
            f"    os.symlink('/etc', os.path.join(top, '{tag}-dir', 'sub', 'etc'))\nprint('left')")
    r = run_python(code)
    assert r.ok and r.stdout == "left\n", r.stderr
    assert not [p for top in sandbox.SHARED_TEMP_DIRS for p in os.listdir(top) if p.startswith(tag)]
    assert os.path.isfile("/etc/hostname") or os.path.isdir("/etc")  # the symlink was removed, not followed


@pytest.mark.skipif(os.geteuid() != 0, reason="the parent-death signal is cleared by the drop to the call's own uid")
def test_the_program_dies_with_a_killed_trainer():
    marker = f"96{os.getpid() % 1000}{time.time_ns() % 10**6:06d}"
    code = f"import os\nos.execvp('sleep', ['sleep', '{marker[:4]}' + '{marker[4:]}'])"  # only sleep's has it whole
    trainer = subprocess.Popen([sys.executable, "-c", "import sys\nfrom groupwise.agents import sandbox\n"
                                "sandbox._USE_NAMESPACES = False  # no pid namespace to end it with the reaper\n"
                                f"sandbox.run_python({code!r}, timeout_s=60)"])
    workdir = None
    try:
        deadline = time.monotonic() + 20
        while not _survivors_with(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _survivors_with(marker), "the sandboxed program never started"
        workdir = os.readlink(f"/proc/{_survivors_with(marker)[0]}/cwd")  # the trainer cannot delete it now
        trainer.kill()                                     # SIGKILL: no cleanup of its own runs
        trainer.wait()
        deadline = time.monotonic() + 3
        while _survivors_with(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _survivors_with(marker) == []
    finally:
        trainer.kill()
        for pid in _survivors_with(marker):
            os.kill(pid, 9)
        if workdir is not None and os.path.basename(workdir).startswith("groupwise-sandbox-"):
            shutil.rmtree(workdir, ignore_errors=True)


def _survivors_with(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                hit = marker.encode() in f.read()
        except OSError:
            continue
        fields = _stat_fields(pid)
        if hit and fields is not None and fields[0] != b"Z":
            found.append(int(pid))
    return found


def test_a_program_that_cannot_be_executed_is_a_setup_failure(monkeypatch, tmp_path):
    not_executable = tmp_path / "python"
    not_executable.write_text("x")
    os.chmod(tmp_path, 0o755)
    popen = subprocess.Popen

    def start(argv, **kwargs):                            # the supervisor starts; the program's exec fails
        if argv[-1].startswith("{"):
            cfg = json.loads(argv[-1])
            cfg["argv"][0] = cfg["argv_socket_patch"][0] = str(not_executable)
            argv = argv[:-1] + [json.dumps(cfg)]
        return popen(argv, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", start)
    with pytest.raises(RuntimeError, match="could not be set up, the code did not run: PermissionError"):
        run_python("print(1)")


def test_removing_a_tree_never_changes_the_folder_that_holds_it(tmp_path):
    """_remove_tree's retry made the parent of a refused entry 0700; for the tree itself (already gone, as the
    workdir once _remove_files_of has deleted it) that parent was /tmp: every other user lost it."""
    tmp_path.chmod(0o1777)
    sandbox._remove_tree(str(tmp_path / "gone"))
    (tmp_path / "tree" / "sub").mkdir(parents=True)
    (tmp_path / "tree" / "sub" / "f").touch()
    (tmp_path / "tree" / "sub").chmod(0o500)  # a folder the code made unwritable (for a non-root trainer)
    sandbox._remove_tree(str(tmp_path / "tree"))
    assert not (tmp_path / "tree").exists() and oct(tmp_path.stat().st_mode & 0o7777) == "0o1777"


def test_a_sandbox_that_cannot_be_set_up_stops_the_tool_loop_instead_of_telling_the_model(monkeypatch):
    """A machine that cannot contain run_python (a non-root trainer without user namespaces) turned every call into
    a tool message to the model ('the sandbox could not be set up … run the trainer as root …'): the user saw only
    tools/failure_frequency = 1, and a budget too small for the message hid even that. SandboxUnavailable now goes
    through the tool loop (sync and async tools) and stops the rollout with that message."""
    from groupwise import rollout as R
    from tests.agents_support import call, context, user

    monkeypatch.setattr(sandbox, "_USE_NAMESPACES", False)
    monkeypatch.setattr(sandbox, "_OWN_UID", False)
    monkeypatch.delenv("GROUPWISE_SANDBOX_ALLOW_SAME_USER")

    def python(code: str) -> str:
        """
        Runs a Python program in a sandbox.

        Args:
            code: The program's source.
        """
        return run_python(code).stdout

    async def apython(code: str) -> str:
        """
        Runs a Python program in a sandbox.

        Args:
            code: The program's source.
        """
        return run_python(code).stdout

    for tool in (python, apython):
        turns = [call(tool.__name__, code="print(6*7)") + "<|im_end|>", "done<|im_end|>"]
        ctx, _ = context(lambda p: turns[min(p.count("<|im_start|>tool"), 1)], tools=(tool,))
        with pytest.raises(sandbox.SandboxUnavailable, match=r"^run_python: the sandbox could not be set up, the code "
                                                             r"did not run: .*run the trainer as root"):
            R.generate(ctx, None, [{"prompt": user("go")}])


def test_a_sandbox_that_cannot_be_set_up_stops_a_reward_function_too(monkeypatch):
    """A code-execution reward function calling run_python on such a machine had SandboxUnavailable caught as a row
    error under on_reward_error='nan': every row NaN, the function called 1 + n times, the run going on with no
    reward. It is a MachineError now, raised through the row-by-row retry (sync and async functions)."""
    from groupwise.rewards.sources import RewardSource, compute_rewards

    monkeypatch.setattr(sandbox, "_USE_NAMESPACES", False)
    monkeypatch.setattr(sandbox, "_OWN_UID", False)
    monkeypatch.delenv("GROUPWISE_SANDBOX_ALLOW_SAME_USER")
    calls = []

    def passes(completions, **_):
        calls.append(len(completions))
        return [float(run_python(c).ok) for c in completions]

    async def apasses(completions, **_):
        return passes(completions)

    for fn in (passes, apasses):
        calls.clear()
        with pytest.raises(sandbox.SandboxUnavailable, match="the sandbox could not be set up"):
            compute_rewards([RewardSource(name="passes", fn=fn)], ["p"] * 3, ["print(1)"] * 3, [[1]] * 3, {},
                            on_error="nan")
        assert calls == [3]  # the batch call only: no row-by-row retry
