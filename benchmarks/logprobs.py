"""Peak memory and time of per-token log-probs + GRPO loss (forward and backward) at a Qwen-size vocabulary
(V = 151 936), T = 1024, N = 8: groupwise's chunked, checkpointed head vs computing the full (N, T, V) logits.

    .venv/bin/python benchmarks/logprobs.py [--hidden 256] [--repeats 3]
Each variant runs in its own process; peak memory is that process's peak resident set size above what it held
after building the inputs (hidden states (N, T, H) with grad, head (V, H) with grad). Target: chunked ≤ 25% of full.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch


def run_variant(variant: str, N: int, T: int, V: int, H: int, repeats: int) -> dict:
    from groupwise.core.logprobs import logps_from_hidden, selective_log_softmax
    from groupwise.core.losses import policy_loss

    torch.manual_seed(0)
    hidden = (torch.randn(N, T, H) * 0.1).requires_grad_()
    weight = (torch.randn(V, H) * 0.02).requires_grad_()
    targets = torch.randint(0, V, (N, T))
    adv = torch.randn(N)
    mask = torch.ones(N, T)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, loss_value = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        if variant == "full":
            logits = hidden @ weight.T  # (N, T, V): 4.98 GB in float32
            logps = selective_log_softmax(logits, targets)
        else:
            logps, _ = logps_from_hidden(hidden, weight, targets, chunk_tokens=1024)
        loss, _ = policy_loss(logps, logps.detach(), adv, mask)
        loss.backward()
        times.append(time.perf_counter() - start)
        loss_value = float(loss)
        grad_norm = float(hidden.grad.norm())
        hidden.grad = weight.grad = None
        del logps, loss
        if variant == "full":
            del logits
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_mb": (peak - base) / 1024, "seconds": sorted(times)[len(times) // 2], "loss": loss_value,
            "grad_norm": grad_norm}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--N", type=int, default=8)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--V", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variant")
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.N, args.T, args.V, args.hidden, args.repeats)))
        return
    from common import write_table

    results = {}
    for variant in ("full", "chunked"):
        out = subprocess.run([sys.executable, __file__, "--variant", variant, "--N", str(args.N), "--T", str(args.T),
                              "--V", str(args.V), "--hidden", str(args.hidden), "--repeats", str(args.repeats)],
                             capture_output=True, text=True, check=True)
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
        print(variant, results[variant], flush=True)
    full, chunked = results["full"], results["chunked"]
    ratio = chunked["peak_mb"] / full["peak_mb"]
    same = abs(full["loss"] - chunked["loss"]) < 1e-4 and abs(full["grad_norm"] - chunked["grad_norm"]) < 1e-3 * full["grad_norm"]
    rows = [[v, f"{r['peak_mb']:,.0f}", f"{r['seconds']:.2f}", f"{r['loss']:.6f}", f"{r['grad_norm']:.6f}"]
            for v, r in results.items()]
    write_table("logprobs", f"Log-probs + loss memory at V = {args.V:,}, T = {args.T}, N = {args.N}",
                ["path", "peak memory above inputs (MB)", "seconds (fwd+bwd, median)", "loss", "‖∂loss/∂hidden‖"], rows,
                [f"Hidden size {args.hidden}. Chunked peak = {100 * ratio:.1f}% of full (target ≤ 25%: "
                 f"**{'met' if ratio <= 0.25 else 'missed'}**); same loss and gradient: **{same}**."])


if __name__ == "__main__":
    main()
