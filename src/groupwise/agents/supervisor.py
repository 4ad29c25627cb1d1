"""The sandbox's supervisor program (groupwise.agents.sandbox.run_python): standard library only, never imported.

run_python starts it as `python -I -S -B -X utf8 -c <this file's text> CONFIG_JSON`, single-threaded, in the new
session of each call. It reports on the status pipe (fd cfg["status_fd"]) one JSON line {"event": "setup", ...} once
namespaces are decided, and one {"event": "exit", ...} with the program's wait status and CPU time when it ends.
"""
import ctypes, json, os, resource, signal, sys, time
cfg = json.loads(sys.argv[1])
STATUS_FD = cfg["status_fd"]
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
libc.unshare.argtypes = [ctypes.c_int]
PR_SET_PDEATHSIG, PR_SET_KEEPCAPS, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 8, 36, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CAP_DAC_READ_SEARCH = 47, 2, 2
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 0x4000, 1 << 18
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]

def check(ret):
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))

def prctl(option, a=0, b=0, c=0, d=0):
    check(libc.prctl(option, a, b, c, d))

def report(obj):
    os.write(STATUS_FD, (json.dumps(obj) + "\n").encode())

def tasks_of_uid(uid):
    n = 0
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open("/proc/%s/status" % p) as f:
                    st = dict(l.split(":", 1) for l in f.read().splitlines() if ":" in l)
            except OSError:
                continue
            if int(st["Uid"].split()[0]) == uid:
                n += int(st.get("Threads", "1"))
    return n

def children_of(pid):
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open("/proc/%s/stat" % p, "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == pid and fields[0] != b"Z":
                out.append(int(p))
    return out

def hide(plan):
    """The program's own mount namespace: each directory closed to others (e.g. /root, where the interpreter may
    live) covered by an empty tmpfs, with only the directories the interpreter needs bound back in (as root, before
    the privilege drop). The program's uid cannot undo it (no CAP_SYS_ADMIN; mounts a user namespace inherits are
    locked)."""
    check(libc.unshare(CLONE_NEWNS))
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None))
    umask = os.umask(0o022)                       # the directories made on the tmpfs: traversable by the program
    for top, dirs in plan:
        fds = [(d, os.open(d, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)) for d in dirs]   # before they are covered
        check(libc.mount(b"tmpfs", top.encode(), b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, b"mode=0755,size=64k"))
        for d, fd in fds:
            os.makedirs(d, 0o755, exist_ok=True)
            check(libc.mount(("/proc/self/fd/%d" % fd).encode(), d.encode(), None, MS_BIND | MS_REC, None))
            os.close(fd)
    os.umask(umask)

class Stop(Exception):
    pass

def on_stop(signum, frame):
    raise Stop()

def run_program(parent):
    """The model's process: drop privileges, set the limits, exec `python main.py`. Fails closed (exit 126)."""
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        uid = cfg["uid"]
        if cfg["hide"]:
            hide(cfg["hide"])
        if uid is not None:
            if cfg["read_all_files"]:
                prctl(PR_SET_KEEPCAPS, 1)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            if cfg["read_all_files"]:
                class Header(ctypes.Structure):
                    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
                class Data(ctypes.Structure):
                    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                                ("inheritable", ctypes.c_uint32)]
                data = (Data * 2)()
                data[0].effective = data[0].permitted = data[0].inheritable = 1 << CAP_DAC_READ_SEARCH
                check(libc.capset(ctypes.byref(Header(0x20080522, 0)), data))
                prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CAP_DAC_READ_SEARCH)
            if os.getuid() != uid or os.geteuid() != uid or os.getgid() != uid:
                raise RuntimeError("privilege drop did not take")
            try:
                os.setuid(0)
            except PermissionError:
                pass
            else:
                raise RuntimeError("privilege drop is reversible")
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # again: the kernel clears it when the credentials change
        if os.getppid() != parent:                # the parent died before that: nobody would kill us
            raise RuntimeError("the supervisor ended during setup")
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        nproc = cfg["max_processes"]
        if cfg["nproc_mode"] == "userns":
            nproc += 2                       # the supervisor and the reaper are counted in the namespace too
        elif cfg["nproc_mode"] == "relative":
            nproc += tasks_of_uid(os.getuid()) - 1
        mb = 1024 * 1024
        limits = [(resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, nproc),
                  (resource.RLIMIT_FSIZE, cfg["max_file_mb"] * mb), (resource.RLIMIT_NOFILE, cfg["max_open_files"]),
                  (resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1)), (resource.RLIMIT_AS, cfg["memory_mb"] * mb)]
        for which, value in limits:
            soft, hard = value if isinstance(value, tuple) else (value, value)
            cur_hard = resource.getrlimit(which)[1]
            if cur_hard != resource.RLIM_INFINITY:
                soft, hard = min(soft, cur_hard), min(hard, cur_hard)
            resource.setrlimit(which, (soft, hard))
        os.closerange(3, STATUS_FD)
        os.closerange(STATUS_FD + 1, 1 << 16)
        os.set_inheritable(STATUS_FD, False)     # closed by a successful exec; open to report a failed one
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
    except BaseException as e:
        report({"event": "setup_failed", "error": "%s: %s" % (type(e).__name__, e)})
        os._exit(126)

def reap(pidns):
    """Run the program, reap every orphan until it ends, then see that nothing it started survives."""
    signal.signal(signal.SIGUSR1, on_stop)
    parent = os.getpid()
    program = os.fork()
    if program == 0:
        run_program(parent)
    status = cpu = None
    try:
        while True:
            pid, st, ru = os.wait4(-1, 0)
            if pid == program:
                status, cpu = st, ru.ru_utime + ru.ru_stime
                break
    except (Stop, ChildProcessError):
        pass
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    if status is None:
        try:
            os.kill(program, signal.SIGKILL)
        except OSError:
            pass
    if not pidns:                                  # a subreaper: every orphan of the tree ends up as our child
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            kids = children_of(os.getpid())
            for k in kids:
                try:
                    os.kill(k, signal.SIGKILL)
                except OSError:
                    pass
            while True:
                try:
                    pid, st, ru = os.wait4(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                if pid == program and status is None:
                    status, cpu = st, ru.ru_utime + ru.ru_stime
            if not kids:
                break
            time.sleep(0.005)
    event = {"event": "exit", "status": status, "cpu_s": cpu}
    if status is not None:
        if os.WIFSIGNALED(status):
            event["signal"] = os.WTERMSIG(status)
        else:
            event["code"] = os.WEXITSTATUS(status)
    report(event)
    os._exit(0)

def main():
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != cfg["host_pid"]:
        os._exit(125)
    namespaces, refused = [], {}
    if not cfg["use_namespaces"]:
        pass
    elif os.getuid() != 0:
        try:
            uid, gid = os.getuid(), os.getgid()
            check(libc.unshare(CLONE_NEWUSER))
            for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (uid, uid)),
                               ("gid_map", "%d %d 1" % (gid, gid))):
                with open("/proc/self/" + name, "w") as f:
                    f.write(text)
            namespaces.append("user")
        except OSError as e:
            refused["user"] = e.strerror
    wanted = [("pid", CLONE_NEWPID)] + ([] if cfg["network"] else [("net", CLONE_NEWNET)])
    if not cfg["use_namespaces"]:
        wanted = []
    for name, flag in wanted:
        try:
            check(libc.unshare(flag))
            namespaces.append(name)
        except OSError as e:
            refused[name] = e.strerror
    if cfg["uid"] is not None:
        cfg["nproc_mode"] = "uid"
    elif "user" in namespaces and "pid" in namespaces:
        cfg["nproc_mode"] = "userns"
    else:
        cfg["nproc_mode"] = "relative"
        if not cfg["allow_same_user"]:
            report({"event": "setup_failed", "error": "the code would run as the trainer's own user without a user "
                    "and a pid namespace (refused here: %s), so it could signal the trainer's processes and read "
                    "their environment (tokens) in /proc; run the trainer as root or where unprivileged user "
                    "namespaces are allowed, or accept this with run_python(allow_same_user=True) or "
                    "GROUPWISE_SANDBOX_ALLOW_SAME_USER=1" % (", ".join(sorted(refused)) or "namespaces off")})
            os._exit(126)
    net_blocked = "net" in namespaces
    if not cfg["network"] and not net_blocked:
        if not cfg["allow_socket_patch"]:
            report({"event": "setup_failed", "error": "network=False, but no network namespace could be made "
                    "(refused here: %s): only a Python-level socket block is possible, which ctypes, _socket or a "
                    "subprocess gets past (to localhost services, a cloud metadata endpoint, the internet); run the "
                    "trainer where unshare(CLONE_NEWNET) is allowed (root with CAP_SYS_ADMIN, or unprivileged user "
                    "namespaces), or accept this with run_python(allow_socket_patch=True) or "
                    "GROUPWISE_SANDBOX_ALLOW_SOCKET_PATCH=1" % (refused.get("net") or "namespaces off")})
            os._exit(126)
        cfg["argv"] = cfg["argv_socket_patch"]
    report({"event": "setup", "namespaces": namespaces, "refused": refused, "nproc_mode": cfg["nproc_mode"],
            "network": "allowed" if cfg["network"] else ("netns" if net_blocked else "python-socket-patch")})
    if "pid" in namespaces:
        reaper = os.fork()                         # pid 1 of the new namespace; when it exits the kernel kills the rest
        if reaper == 0:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            reap(pidns=True)
        while True:
            try:
                os.waitpid(reaper, 0)
                break
            except ChildProcessError:
                break
        os._exit(0)
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    reap(pidns=False)


if __name__ == "__main__":
    main()
