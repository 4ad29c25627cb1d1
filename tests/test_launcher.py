"""tests/launcher.py forks the suite's multi-process runs from a preloaded server instead of launching them with
torch.distributed.run; a worker must not be able to tell: the same launcher variables, a working env://
rendezvous, an exit code and output like a subprocess's."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launcher import start, torchrun

PROBE = Path(__file__).with_name("launcher_probe.py")
# set by torchrun for its agent only (where to write an error file, the agent's store, the signals it forwards) and
# the per-run values (port, run id)
AGENT_ONLY = {"TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_SIGNALS_TO_HANDLE"}
PER_RUN = {"MASTER_PORT", "TORCHELASTIC_RUN_ID"}


def _probes(out: Path, nproc: int) -> list[dict]:
    return [json.loads((out / f"probe_{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.slow
def test_workers_see_what_torchrun_gives_them(tmp_path):
    real, forked = tmp_path / "real", tmp_path / "forked"
    real.mkdir()
    forked.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(PROBE), str(real)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = torchrun(PROBE, forked)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for want, got in zip(_probes(real, 2), _probes(forked, 2), strict=True):
        assert got["sum"] == want["sum"] == 1.0  # 0 + 1 over gloo
        assert {k: v for k, v in got["env"].items() if k not in PER_RUN} == \
            {k: v for k, v in want["env"].items() if k not in PER_RUN | AGENT_ONLY}
        assert set(got["env"]) & PER_RUN == PER_RUN


def test_one_process_is_a_plain_interpreter_with_its_exit_code_and_output(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import os, sys\nprint('out', os.getcwd())\nprint('err', file=sys.stderr)\n"
                      "assert __name__ == '__main__' and sys.argv[1:] == ['a', '1']\nsys.exit(3)\n")
    proc = torchrun(script, "a", 1, nproc=1, cwd=tmp_path)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, f"out {tmp_path}\n", "err\n")
    torchrun(PROBE, tmp_path, nproc=1)
    assert _probes(tmp_path, 1) == [{"env": {}, "sum": None}]  # no launcher variables: not distributed


def test_a_failure_is_reported_and_a_signal_reaches_the_process(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("raise KeyError('boom')\n")
    proc = torchrun(script, nproc=1)
    assert proc.returncode == 1 and "KeyError: 'boom'" in proc.stderr
    ready = tmp_path / "ready"
    script.write_text("import pathlib, signal, sys, time\n"
                      "signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + 15))\n"
                      f"pathlib.Path({str(ready)!r}).touch()\ntime.sleep(60)\n")
    run = start(script, nproc=1)
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=30).returncode == 128 + 15
    with pytest.raises(subprocess.TimeoutExpired):
        start(script, nproc=1).wait(timeout=1)
