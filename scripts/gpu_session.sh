#!/usr/bin/env bash
# On the device machine (GPU): install carried wheels, then run one stage. Used as
#   bash scripts/gpu_session.sh tests|demo|gen|fast|autotune|profile|profile2|bench
# Output lands in $OUT (the device tool brings it back). Wheels travel in .whl/: scripts/gpu_wheels.sh fetches them
# (a fresh clone has none); carry ".whl" in the device call (and ".whl_arrow" for `bench`).
set -uo pipefail
if ! ls .whl/*.whl >/dev/null 2>&1; then echo "no wheels in .whl/: run scripts/gpu_wheels.sh here and carry .whl"; exit 2; fi
stage=${1:-tests}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
# pyarrow (55 MB, for TRL's datasets in `bench` only) travels apart, in .whl_arrow/: carry it only for `bench`, as
# .whl/ and the working tree together must stay under the device tool's 64 MiB
if [ -d .whl_arrow ]; then
python3 - <<'PY' || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_arrow/*.whl
import pyarrow, sys
sys.exit(0 if int(pyarrow.__version__.split(".")[0]) >= 24 else 1)
PY
fi
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 - > "$OUT/env.txt" 2>&1 <<'PY'
import importlib, torch, transformers, accelerate, peft
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
print("transformers", transformers.__version__, "accelerate", accelerate.__version__, "peft", peft.__version__)
for name in ("triton", "numpy", "datasets", "pyarrow"):
    try:
        print(name, importlib.import_module(name).__version__)
    except ImportError as e:
        print(name, "not importable:", e)
PY
cat "$OUT/env.txt"
# a run that dies before writing its table must not send back the table of an earlier session as if it were new
rm -f benchmarks/results/generation_gpu.md benchmarks/results/generation_gpu_autotune.md \
      benchmarks/results/generation_gpu_profile.md benchmarks/results/gpu_step.md
case "$stage" in
  tests) timeout 400 python3 -m pytest -q -p no:cacheprovider -o addopts="" --timeout 240 tests 2>&1 | tee "$OUT/tests.log" | tail -60 ;;
  demo)  (time timeout 170 python3 -m groupwise train --output_dir /tmp/demo --bf16 false) 2>&1 | tee "$OUT/demo.log" | tail -25 ;;
  gen)   # GEN_TESTS=0: leave out tests/generation (when `fast` ran its CUDA tests already)
         if [ "${GEN_TESTS:-1}" != 0 ]; then
         timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -rf -p no:cacheprovider -o addopts="" tests/generation 2>&1 | tee "$OUT/gen_tests.log" | tail -15
         fi
         timeout ${GEN_TIMEOUT:-400} python3 benchmarks/generation.py --gpu ${GEN_ARGS:-} 2>&1 | tee "$OUT/generation.log" | tail -30
         cp benchmarks/results/generation_gpu.md "$OUT/" 2>/dev/null ;;
  fast)  # the compiled sampler: its CUDA tests (the CPU ones ran here already), then the table with ablations;
         # pytest's own limit per test keeps the failure report from being cut off by the outer timeout
         timeout 150 python3 -m pytest -q -rf -p no:cacheprovider -o addopts="" --timeout 100 tests/generation -k cuda 2>&1 | tee "$OUT/gen_tests.log" | tail -15
         # fp16 mixed precision on CUDA (its tests pick the GPU when there is one)
         timeout 45 python3 -m pytest -q -rf -p no:cacheprovider -o addopts="" --timeout 30 tests/test_fp16.py 2>&1 | tee "$OUT/fp16_tests.log" | tail -8
         # FSDP2 on CUDA: one process with CPU offload (NCCL with gloo next to it, pinned host copies)
         timeout 90 python3 -m pytest -q -rf -p no:cacheprovider -o addopts="" --timeout 80 tests/test_fsdp.py -k one_process 2>&1 | tee "$OUT/fsdp_tests.log" | tail -8
         timeout 400 python3 benchmarks/generation.py --gpu --ablate 2>&1 | tee "$OUT/generation.log" | tail -30
         cp benchmarks/results/generation_gpu.md "$OUT/" 2>/dev/null ;;
  autotune)  # the compiled loop under torch.compile's max-autotune mode, against the default, at 64×8
         timeout ${GEN_TIMEOUT:-540} python3 benchmarks/generation.py --gpu --autotune 2>&1 | tee "$OUT/autotune.log" | tail -20
         cp benchmarks/results/generation_gpu_autotune.md "$OUT/" 2>/dev/null ;;
  profile2)  # the profile, then the two-process tool-loop test that session 5 could not finish
         timeout 240 python3 benchmarks/generation.py --gpu --profile 2>&1 | tee "$OUT/profile.log" | tail -60
         cp benchmarks/results/generation_gpu_profile.md "$OUT/" 2>/dev/null
         # the two-process tool-loop worker run directly; if it is still running after 90 s, every process of it
         # is sent SIGABRT so that Python's faulthandler prints where each one waits
         # (how the host name resolves: gloo binds to that address, which may not be reachable on an isolated machine)
         { hostname; getent hosts "$(hostname)"; ip -brief addr 2>/dev/null || true; } > "$OUT/host.txt" 2>&1
         (export ACCELERATE_USE_CPU=1 OMP_NUM_THREADS=1 PYTHONFAULTHANDLER=1
          timeout 200 python3 -m torch.distributed.run --standalone --nproc_per_node=2 tests/agents_dist_worker.py \
              /tmp/agents_dist > "$OUT/agents_dist.log" 2>&1 &
          pid=$!
          for _ in $(seq 90); do kill -0 $pid 2>/dev/null || break; sleep 1; done
          if kill -0 $pid 2>/dev/null; then echo "STILL RUNNING AFTER 90 s" >> "$OUT/agents_dist.log"
              pkill -ABRT -f agents_dist_worker.py; sleep 5; fi
          wait $pid; echo "exit $?" >> "$OUT/agents_dist.log"; tail -40 "$OUT/agents_dist.log")
         timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_agents_training.py -k "not two_processes" 2>&1 | tee "$OUT/agents_training.log" | tail -15 ;;
  profile) timeout 300 python3 benchmarks/generation.py --gpu --profile 2>&1 | tee "$OUT/profile.log" | tail -45
         cp benchmarks/results/generation_gpu_profile.md "$OUT/" 2>/dev/null ;;
  bench) timeout 560 python3 benchmarks/gpu_step.py --trl --steps 5 --runs "${RUNS:-full:0,full:0:bf16,lora:0}" 2>&1 | tee "$OUT/gpu_step.log" | tail -30
         cp benchmarks/results/gpu_step.md "$OUT/" 2>/dev/null ;;
esac
