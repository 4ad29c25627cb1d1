#!/usr/bin/env bash
# Fetch, on this machine (PyPI reachable), the wheels that scripts/gpu_session.sh installs on the device machine
# (no network there; it has torch, transformers, accelerate and peft of its own): .whl/ for every stage, and pyarrow
# apart in .whl_arrow/ for `bench` only (.whl/ and the working tree together must stay under the device tool's
# 64 MiB). Both folders are git-ignored (.gitignore) and a fresh clone lacks them: run this first, then carry
# ".whl" (and ".whl_arrow" for `bench`) in the device call. The device runs CPython 3.12 on x86_64 Linux.
set -euo pipefail
cd "$(dirname "$0")/.."
fetch() {  # folder, requirement…: wheels only, for the device's Python, without their dependencies (listed here)
  local dest=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
      --platform any -d "$dest" "$@"
}
mkdir -p .whl .whl_arrow
# TRL (the side-by-side benchmark and the parity tests), datasets and what it needs beyond the device's packages,
# math-verify (the math rewards), pytest-timeout (the stages' per-test limits)
fetch .whl trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 math-verify==0.9.0 \
    latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 pytest-timeout
fetch .whl_arrow pyarrow==26.0.1
du -sh .whl .whl_arrow
ls .whl .whl_arrow
