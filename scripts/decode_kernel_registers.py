"""Compile the decode-attention kernel for a GPU target without a GPU and print its registers and shared memory
per (dtype, head dim, warps): the numbers behind decode_attention._block_n. Needs Triton (not a groupwise
dependency; install the version the target's torch uses, e.g. `pip install --no-deps --target /tmp/triton
triton==3.6.0`):

    PYTHONPATH=/tmp/triton:src .venv/bin/python scripts/decode_kernel_registers.py [--arch 90]
"""

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from groupwise.generation import decode_attention as da  # noqa: E402

POINTERS = {"Q": None, "K": None, "V": None, "Out": None, "Keep": "*i1", "Part": "*fp32", "Stats": "*fp32"}
CONSTEXPR = ("R", "D", "SPLITS", "BLOCK_R", "BLOCK_D", "BLOCK_N", "BLOCK_M", "IEEE")


def signature(kernel, dtype: str) -> dict:
    sig = {}
    for name in kernel.arg_names:
        if name in POINTERS:
            sig[name] = POINTERS[name] or "*" + dtype
        elif name in CONSTEXPR:
            sig[name] = "constexpr"
        else:
            sig[name] = "fp32" if name == "scale_log2e" else "i32"
    return sig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90, help="compute capability × 10 (90: H100/H200)")
    args = ap.parse_args()
    kernel = da._kernel()
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    print(f"Triton {triton.__version__}, sm_{args.arch}, 7 query heads per KV head, one split")
    print("| dtype | head dim | slots per iteration | warps | registers | spill (stack bytes) | shared bytes |")
    print("|---|---|---|---|---|---|---|")
    for dtype, D, block_n, warps in [("bf16", 64, 64, 4), ("bf16", 64, da._block_n(64), 4), ("bf16", 128, 64, 4),
                                     ("bf16", 128, da._block_n(128), 4), ("fp32", 64, da._block_n(64), 4)]:
        const = dict(R=7, D=D, SPLITS=1, BLOCK_R=16, BLOCK_D=D, BLOCK_N=block_n, BLOCK_M=da.BLOCK_M,
                     IEEE=dtype == "fp32")
        compiled = triton.compile(ASTSource(kernel, signature(kernel, dtype), const),
                                  target=GPUTarget("cuda", args.arch, 32), options=dict(num_warps=warps, num_stages=2))
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            usage = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True).stdout
        line = next(x for x in usage.splitlines() if "REG:" in x)
        fields = dict(part.split(":") for part in line.split() if ":" in part)
        print(f"| {dtype} | {D} | {block_n} | {warps} | {fields['REG']} | {fields['STACK']} | {compiled.metadata.shared} |")


if __name__ == "__main__":
    main()
