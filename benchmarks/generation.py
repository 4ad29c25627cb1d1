"""Generation throughput: groupwise's fast sampler vs transformers `generate`.

    .venv/bin/python benchmarks/generation.py [--repeats 3]          # CPU table (results/generation.md)
    python3 benchmarks/generation.py --gpu                           # GPU table (results/generation_gpu.md)
    python3 benchmarks/generation.py --gpu --profile                 # where the compiled sampler's time goes
The CPU run copies the last GPU table into generation.md as its own section.

GPU (--gpu): a randomly initialised model of Qwen2.5-0.5B's shape (Qwen2, hidden 896, 24 layers, 14 heads / 2 KV,
vocabulary 151 936, tied embeddings) in bf16, prompts of 32 tokens, 256 new tokens for every row (EOS is never
sampled, so every path does the same work), B×G = 16×8 and 64×8. Paths: generate(); transformers' continuous
batching (model.generate_batch: paged attention, the engine of TRL's use_transformers_paged); the fast sampler's
eager loop (generation_compile=False); its static loop compiled with CUDA graphs (generation_compile, the default on
CUDA; the first call, which compiles, is not timed). Roofline: a decode step must read every weight once and the KV
cache of every row, so at bandwidth BW a step takes at least (weight bytes + N · layers · 2 · KV heads · head dim ·
2 bytes · context length) / BW; the roofline tokens/s sums this over the 256 steps. Targets: fast ≥ 5× generate()
and ≥ 30 % of the roofline at 64×8.

CPU (default, B×G = 8×8 and 32×8):
Models: the demo policy on arithmetic prompts (0.8 M parameters, real completion lengths), and a randomly
initialised 40 M-parameter Llama (vocab 32 000) whose EOS logit is raised so that ~2% of tokens end a completion
(completion lengths vary as in real rollouts). Same sampling settings for both paths (T = 1, top-p 1).
Paths: generate(), transformers' continuous batching (generate_batch, on the B distinct prompts with G return
sequences each) and the fast sampler. Tokens/s counts completion tokens up to and including EOS. Target: fast ≥ 4×
generate at 32×8.
"""

from __future__ import annotations

import argparse
import copy
import math
import time

import torch
from common import RESULTS, median_time, write_table
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig

from groupwise.demo import POLICY_DIR
from groupwise.generation import static as static_module
from groupwise.generation.fast import FastGenerator
from groupwise.text import completion_masks, encode_prompts
from groupwise.tasks import arithmetic


NOTE = ("What bounds the speedup on CPU: the 40 M model is compute-bound on 2 cores, so the speedup is about the "
        "ratio of token-forwards. generate() prefills every row's prompt and runs all rows to the longest completion "
        "(about B·G·(P + 128) token-forwards); the fast sampler prefills once per group and drops finished rows "
        "(about B·(P) + B·G·46), a ratio near 3.2 at these lengths; longer prompts and a larger max/mean completion "
        "ratio raise it. The 0.8 M demo policy is bound by per-call framework overhead, which every path pays per "
        "step.")


def llama40m(eos_share: float = 0.02):
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512, pad_token_id=0,
                      eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    boost = math.log(eos_share * cfg.vocab_size)  # ≈ eos_share of the probability mass on EOS

    def raise_eos(module, inputs, output):
        output[..., cfg.eos_token_id] += boost
        return output

    model.lm_head.register_forward_hook(raise_eos)
    return model


def continuous_batching(model, ids, mask, gen_cfg, G: int) -> list[list[int]]:
    """transformers' continuous batching (model.generate_batch: paged attention, rows scheduled as they finish; the
    engine TRL's use_transformers_paged selects) on the B distinct prompts of ids (every G-th row, pads dropped),
    G completions each. Returns the completions' token lists (up to and including EOS)."""
    prompts = [row[m.bool()].tolist() for row, m in zip(ids[::G].cpu(), mask[::G].cpu())]
    cfg = copy.deepcopy(gen_cfg)
    cfg.num_return_sequences = G
    out = model.generate_batch(prompts, generation_config=cfg, progress_bar=False)
    assert len(out) == len(prompts) * G and not any(o.error for o in out.values()), "generate_batch failed"
    return [list(o.generated_tokens) for o in out.values()]


def workloads():
    policy = AutoModelForCausalLM.from_pretrained(POLICY_DIR).eval()
    tok = AutoTokenizer.from_pretrained(POLICY_DIR)
    yield "demo policy (0.8 M)", policy, tok.pad_token_id, [tok.eos_token_id], 48, \
        lambda B: [arithmetic.prompt_of(p) for p in arithmetic.problems(B, split="test")], tok
    yield "Llama 40 M, vocab 32k", llama40m(), 0, [2], 128, None, None


# nominal HBM bandwidth by device name (bytes/s); the measured copy bandwidth is reported beside it
BANDWIDTH = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100 NVL": 3.9e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.04e12,
             "A100": 1.56e12}


# nominal dense bf16 tensor-core throughput by device name (FLOP/s, without sparsity)
BF16_PEAK = {"H200": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "A100": 312e12}


def nominal_bandwidth(name: str) -> float | None:
    return next((bw for key, bw in BANDWIDTH.items() if key in name), None)


def compute_note(model, N: int, P: int, T: int, bw: float, name: str) -> str:
    """How the roofline compares with the compute floor at N rows: a decode step multiplies N rows by every weight
    (2 · N · parameters FLOPs; attention's share is left out), so at the device's peak it cannot take less than that
    over the peak, whatever the memory traffic."""
    peak = next((f for key, f in BF16_PEAK.items() if key in name), None)
    if peak is None:
        return ""
    params = sum(p.numel() for p in model.parameters())  # the tied head counts once, as it is read once
    flops = 2 * N * params
    roof_step = sum((params * 2 + N * kv_bytes_per_token(model.config) * (P + t)) / bw for t in range(T)) / T
    need = flops / (roof_step / 0.30)
    return (f"At {N} rows a step's matrix products are {flops / 1e9:.0f} GFLOP: {1e3 * flops / peak:.2f} ms at the "
            f"{name}'s {peak / 1e12:.0f} TFLOP/s dense bf16 peak, against {1e3 * roof_step:.2f} ms for the roofline's "
            f"average step (weights + KV cache at the bandwidth above): the compute floor is "
            f"{100 * flops / peak / roof_step:.0f} % of the memory floor, so at the throughput matrix products of "
            f"this shape reach in practice (well under the peak) the step is bound by compute, not memory. 30 % of "
            f"the roofline needs {need / 1e12:.0f} TFLOP/s ({100 * need / peak:.0f} % of the peak) sustained over "
            "the whole step, attention and sampling included.")


def measured_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy (the best of 5)."""
    src = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 2 / best


def qwen05b():
    from transformers import Qwen2Config

    cfg = Qwen2Config(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                      intermediate_size=4864, vocab_size=151936, max_position_embeddings=2048,
                      tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()

    def no_eos(module, inputs, output):
        output[..., cfg.eos_token_id] = float("-inf")
        return output

    model.lm_head.register_forward_hook(no_eos)
    return model, cfg


def kv_bytes_per_token(cfg) -> int:
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 2  # keys and values, bf16


def roofline_tps(model, cfg, N: int, P: int, T: int, bw: float) -> float:
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    seconds = sum((weights + N * kv_bytes_per_token(cfg) * (P + t)) / bw for t in range(T))
    return N * T / seconds


def with_chunk(chunk, fn):
    """Run fn with static.SAMPLE_CHUNK set to `chunk` (None: unchanged)."""
    if chunk is None:
        return fn()
    before, static_module.SAMPLE_CHUNK = static_module.SAMPLE_CHUNK, chunk
    try:
        return fn()
    finally:
        static_module.SAMPLE_CHUNK = before


FUSED = ("compiled, q/k/v and gate/up fused (fuse_projections)", dict(compile=True, fuse_projections=True))


def gpu_main(repeats: int, ablate: bool = False, autotune: bool = False) -> None:
    """The GPU table; ablate: also what each part of the compiled loop buys at 64×8; autotune: only 64×8, the
    default compiled loop against other torch.compile settings: combo kernels, and the max-autotune mode (Triton
    matmul templates with fused epilogues, CUDA graphs), written to results/generation_gpu_autotune.md."""
    model, cfg = qwen05b()
    name = torch.cuda.get_device_name()
    nominal, measured = nominal_bandwidth(name), measured_bandwidth()
    bw = nominal or measured
    P, T = 32, 256
    rows = []
    write = gpu_table_writer("generation_gpu_autotune" if autotune else "generation_gpu", model, cfg, P, T, repeats,
                             ablate or autotune, bw, nominal, measured, name)
    for B, G in ((64, 8),) if autotune else ((16, 8), (64, 8)):
        N = B * G
        g = torch.Generator().manual_seed(B)
        ids = torch.randint(3, cfg.vocab_size, (B, P), generator=g).repeat_interleave(G, 0).cuda()
        mask = torch.ones_like(ids)
        gen_cfg = GenerationConfig(do_sample=True, max_new_tokens=T, top_k=0, top_p=1.0, pad_token_id=0,
                                   eos_token_id=1)

        def timed(fn, n=repeats):
            def run():
                out = fn()
                torch.cuda.synchronize()
                return out
            run()  # warm-up (and, for the compiled loop, compilation)
            return median_time(run, n)

        paths = {
            "generate()": lambda: model.generate(input_ids=ids, attention_mask=mask,
                                                 generation_config=gen_cfg)[:, P:],
        }
        if not ablate and not autotune:  # (left out of the ablation runs, to fit one call of the device tool)
            paths["transformers continuous batching (generate_batch)"] = (
                lambda: continuous_batching(model, ids, mask, gen_cfg, G))
        # with --ablate the eager loop is left out and generate() timed once, to fit one call of the device tool
        variants = [("fast, compiled static loop", dict(compile=True))]
        if not ablate and not autotune:
            variants.insert(0, ("fast, eager loop", dict(compile=False)))
        if autotune:
            tuned = dict(mode="max-autotune", dynamic=False)
            combo = dict(options={"triton.cudagraphs": True, "combo_kernels": True}, dynamic=False)
            variants += [FUSED,
                         ("compiled, fused projections, combo kernels (independent small kernels launched as one)",
                          dict(compile=True, compile_mode=combo, fuse_projections=True)),
                         ("compiled, max-autotune, fused projections",
                          dict(compile=True, compile_mode=tuned, fuse_projections=True)),
                         ("compiled, max-autotune", dict(compile=True, compile_mode=tuned))]
        if ablate and B == 64:  # what each part of the compiled loop buys, and fused projections
            variants += [FUSED,
                         ("compiled, sdpa attention (no decode kernel)", dict(compile=True, attention_kernel=False)),
                         ("compiled, one-level race (chunk = vocabulary)", dict(compile=True, chunk=cfg.vocab_size))]
        for label, kw in variants:
            chunk, kw = kw.get("chunk"), {k: v for k, v in kw.items() if k != "chunk"}  # (FUSED is shared)
            fast = FastGenerator(max_completion_length=T, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
                                 repetition_penalty=1.0, pad_token_id=0, eos_token_ids=[1], group_size=G, **kw)
            paths[label] = (lambda f, c: lambda: with_chunk(c, lambda: f(model, ids, mask).completion_ids))(fast, chunk)
        roof = roofline_tps(model, cfg, N, P, T, bw)
        base = None
        for label, fn in paths.items():
            torch.manual_seed(0)
            started = time.perf_counter()
            try:  # a path that fails (a compile error, out of memory) is a row of the table, not the end of the run
                seconds, out = timed(fn, 1 if (ablate or autotune) and label == "generate()" else repeats)
                lengths = [len(c) for c in out] if isinstance(out, list) else [out.shape[1]] * out.shape[0]
                assert lengths == [T] * N, f"rows did not all run to the limit: {sorted(set(lengths))}"
            except Exception as e:  # noqa: BLE001 (reported in the table and the log)
                reason = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}".replace("|", "/")
                rows.append([f"{B}×{G}", label, "failed", reason, "", ""])
                print(rows[-1], flush=True)
                torch.cuda.empty_cache()
                continue
            finally:
                print(f"{label}: {time.perf_counter() - started:.0f} s, warm-up (compilation) and timed runs",
                      flush=True)
            tps = N * T / seconds
            base = tps if label == "generate()" else base
            rows.append([f"{B}×{G}", label, f"{seconds:.2f}", f"{tps:,.0f}", f"{tps / base:.2f}×" if base else "",
                         f"{100 * tps / roof:.1f} %"])
            print(rows[-1], flush=True)
            write(rows, echo=False)  # after every row: a call cut short by its time limit still brings back what it measured
            torch.cuda.empty_cache()
        if ablate and B == 64:  # the matmuls alone, as a ceiling: what no sampler built on these layers can beat
            for fused in (False, True):
                seconds = T * matmul_step_seconds(model, cfg, N, fused)
                label = f"ceiling: the step's matmuls only{', q/k/v and gate/up fused' if fused else ''}"
                rows.append([f"{B}×{G}", label, f"{seconds:.2f}", f"{N * T / seconds:,.0f}", "",
                             f"{100 * N * T / seconds / roof:.1f} %"])
                print(rows[-1], flush=True)
        rows.append([f"{B}×{G}", "roofline", f"{N * T / roof:.2f}", f"{roof:,.0f}", "", "100 %"])
    write(rows)


def gpu_table_writer(name: str, model, cfg, P: int, T: int, repeats: int, one_generate: bool, bw: float,
                     nominal: float | None, measured: float, device: str):
    """A function that writes results/<name>.md from the rows so far, with the verdict on the targets when the
    compiled fast sampler's 64×8 row is among them."""
    def write(rows, echo: bool = True) -> None:
        fast64 = next((r for r in rows if r[0] == "64×8" and r[1].startswith("fast, compiled")
                       and r[2] != "failed"), None)
        if fast64 is None or not fast64[4]:
            verdict = "no verdict (the compiled fast sampler's or generate()'s 64×8 row is missing or failed)"
        else:
            speed, share = float(fast64[4][:-1]), float(fast64[5][:-2])
            verdict = (f"{speed:.2f}× generate() (target 5×: {'met' if speed >= 5 else 'missed'}), {share:.1f} % of "
                       f"the roofline (target 30 %: {'met' if share >= 30 else 'missed'})")
        bw_note = (f"Bandwidth used for the roofline: {bw / 1e12:.2f} TB/s "
                   f"({'nominal for ' + device if nominal else 'measured'}); a 2 GiB device copy measured "
                   f"{measured / 1e12:.2f} TB/s.")
        write_table(name, "Generation throughput on a GPU: fast sampler vs transformers generate",
                    ["B×G", "path", "seconds", "tokens/s", "vs generate()", "share of roofline"], rows,
                    [f"Qwen2.5-0.5B shape, bf16, sdpa, 32 prompt tokens, {T} new tokens per row, medians of "
                     f"{repeats} runs after a warm-up{' (generate(): one run)' if one_generate else ''}. At 64×8 the "
                     f"compiled fast sampler reaches {verdict}.", "", bw_note, "",
                     compute_note(model, 64 * 8, P, T, bw, device)], echo=echo)
    return write


@torch.no_grad()
def matmul_step_seconds(model, cfg, N: int, fused: bool, replays: int = 50) -> float:
    """Seconds per decode step of the step's matrix products alone (every layer's q, k, v, o, gate, up, down
    projections and the output head, on N rows, bf16, with the model's weights), replayed from one CUDA graph: a
    floor for any decode step built on these layers. fused: q/k/v as one product and gate/up as one (weights
    concatenated once, outside the graph), as engines that own their weights do."""
    layers = model.model.layers
    x = torch.randn(N, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(N, cfg.intermediate_size, device="cuda", dtype=torch.bfloat16)
    groups = []
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        if fused:
            groups.append([(x, torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),
                           (x, a.o_proj.weight), (x, torch.cat([m.gate_proj.weight, m.up_proj.weight])),
                           (h, m.down_proj.weight)])
        else:
            groups.append([(x, a.q_proj.weight), (x, a.k_proj.weight), (x, a.v_proj.weight), (x, a.o_proj.weight),
                           (x, m.gate_proj.weight), (x, m.up_proj.weight), (h, m.down_proj.weight)])
    products = [pair for group in groups for pair in group] + [(x, model.lm_head.weight)]

    def step():
        for inp, w in products:
            torch.nn.functional.linear(inp, w)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the capture (cuBLAS workspaces)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / replays


def gpu_profile(B: int = 64, G: int = 8, top: int = 30) -> None:
    """Where the compiled sampler's time goes at B×G (the 30 % roofline target's gap): one warm call under
    torch.profiler, the `top` CUDA kernels by total time, written to results/generation_gpu_profile.md."""
    from torch.profiler import ProfilerActivity, profile

    model, cfg = qwen05b()
    P, T = 32, 256
    ids = torch.randint(3, cfg.vocab_size, (B, P), generator=torch.Generator().manual_seed(B))
    ids = ids.repeat_interleave(G, 0).cuda()
    mask = torch.ones_like(ids)
    fast = FastGenerator(max_completion_length=T, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
                         repetition_penalty=1.0, pad_token_id=0, eos_token_ids=[1], group_size=G, compile=True)
    for _ in range(2):  # compile, then one warm call
        fast(model, ids, mask)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fast(model, ids, mask)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    # "## Call CompiledFxGraph …" and "Torch-Compiled Region" annotate the graph whose kernels are listed on their
    # own: leave them out of the busy time, which would otherwise count those kernels twice
    kernels = [e for e in events if not e.key.startswith(("## ", "Torch-Compiled Region"))]
    gpu_total = sum(e.self_device_time_total for e in kernels) / 1e6
    rows = [[e.key[:90].replace("|", "/"), str(e.count), f"{e.device_time_total / 1e3:.1f}",
             f"{100 * e.self_device_time_total / 1e6 / wall:.1f} %"] for e in events[:top]]
    host = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0), key=lambda e: e.self_cpu_time_total,
                  reverse=True)[:15]
    host_rows = [[e.key[:90].replace("|", "/"), str(e.count), f"{e.self_cpu_time_total / 1e3:.1f}"] for e in host]
    write_table("generation_gpu_profile", f"Compiled sampler profile, {B}×{G}, {T} new tokens",
                ["kernel / op", "calls", "CUDA ms (incl. children)", "self CUDA share of wall"], rows,
                [f"Wall {wall:.3f} s for {B * G * T:,} tokens ({B * G * T / wall:,.0f} tok/s); GPU busy "
                 f"{gpu_total:.3f} s ({100 * gpu_total / wall:.0f} % of wall): the rest is the host between graph "
                 "replays (launches, the loop's bookkeeping).", "", "Host side, the 15 ops of largest self CPU time "
                 "(ms; under the profiler, which slows the host):", "", "| op | calls | self CPU ms |",
                 "|---|---|---|", *("| " + " | ".join(r) + " |" for r in host_rows)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gpu", action="store_true", help="the GPU table (needs CUDA)")
    ap.add_argument("--ablate", action="store_true",
                    help="with --gpu: also the compiled loop without the decode kernel and with a one-level race")
    ap.add_argument("--autotune", action="store_true",
                    help="with --gpu: only 64×8, the compiled loop under torch.compile's max-autotune mode "
                         "(results/generation_gpu_autotune.md)")
    ap.add_argument("--profile", action="store_true",
                    help="with --gpu: profile the compiled sampler at 64×8 instead (results/generation_gpu_profile.md)")
    ap.add_argument("--refresh-gpu-section", action="store_true",
                    help="only copy the last GPU table into generation.md (after a --gpu run elsewhere)")
    args = ap.parse_args()
    if args.refresh_gpu_section:
        return refresh_gpu_section()
    if args.gpu and args.profile:
        return gpu_profile()
    if args.gpu:
        return gpu_main(args.repeats, args.ablate, args.autotune)
    rows = []
    for name, model, pad, eos, max_new, prompts_of, tok in workloads():
        for B, G in ((8, 8), (32, 8)):
            if prompts_of is not None:
                ids, mask = encode_prompts([p for p in prompts_of(B) for _ in range(G)], tok, None)
            else:  # random prompts of 16–48 tokens, left-padded
                g = torch.Generator().manual_seed(B)
                lens = torch.randint(16, 49, (B,), generator=g).repeat_interleave(G)
                width = int(lens.max())
                base = torch.randint(3, 32000, (B, width), generator=g).repeat_interleave(G, 0)
                mask = (torch.arange(width)[None] >= width - lens[:, None]).long()
                ids = torch.where(mask.bool(), base, torch.zeros_like(base))
            fast = FastGenerator(max_completion_length=max_new, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
                                 repetition_penalty=1.0, pad_token_id=pad, eos_token_ids=eos, group_size=G)
            cfg = GenerationConfig(do_sample=True, max_new_tokens=max_new, top_k=0, top_p=1.0, pad_token_id=pad,
                                   eos_token_id=eos)

            def count(out):
                m, _ = completion_masks(out, eos, max_new)
                return int(m.sum())

            torch.manual_seed(0)
            t_ref, out_ref = median_time(
                lambda: model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)[:, ids.size(1):],
                args.repeats)
            torch.manual_seed(0)
            t_fast, out_fast = median_time(lambda: fast(model, ids, mask).completion_ids, args.repeats)
            torch.manual_seed(0)
            t_cb, out_cb = median_time(lambda: continuous_batching(model, ids, mask, cfg, G), args.repeats)
            ref_tps, fast_tps = count(out_ref) / t_ref, count(out_fast) / t_fast
            cb_tps = sum(min(len(c), max_new) for c in out_cb) / t_cb
            rows.append([name, f"{B}×{G}", f"{count(out_ref) / (B * G):.0f}", f"{ref_tps:,.0f}", f"{cb_tps:,.0f}",
                         f"{fast_tps:,.0f}", f"{fast_tps / ref_tps:.2f}×"])
            print(rows[-1], flush=True)
    speed32 = [float(r[-1][:-1]) for r in rows if r[1] == "32×8"]
    verdict = "met" if min(speed32) >= 4 else f"missed: {min(speed32):.2f}× at worst (target 4×)"
    write_table("generation", "Generation throughput: fast sampler vs transformers generate",
                ["model", "B×G", "mean completion tokens", "generate tok/s", "continuous batching tok/s",
                 "fast tok/s", "fast vs generate"], rows,
                [f"Medians of {args.repeats} runs. Target (fast ≥ 4× generate at 32×8): **{verdict}**.", "", NOTE,
                 *gpu_section()])


def refresh_gpu_section() -> None:
    """Replace generation.md's GPU section by the last GPU table, keeping its CPU table."""
    path = RESULTS / "generation.md"
    text = path.read_text()
    cpu = text[:text.index("\n## On a GPU")] if "\n## On a GPU" in text else text
    path.write_text(cpu.rstrip("\n") + "\n" + "\n".join(gpu_section()) + "\n")


def gpu_section() -> list[str]:
    """The last GPU table (results/generation_gpu.md, written by --gpu on a GPU machine), as a section of the CPU
    file, so generation.md holds both."""
    gpu = RESULTS / "generation_gpu.md"
    if not gpu.exists():
        return ["", "## On a GPU", "", "Not measured yet: run `python3 benchmarks/generation.py --gpu` on a CUDA machine."]
    lines = gpu.read_text().strip().splitlines()[1:]  # without its title
    while lines and not lines[0].strip():
        lines.pop(0)
    return ["", f"## On a GPU (copied from `{gpu.name}`, written by `--gpu`)", "", *lines]


if __name__ == "__main__":
    main()
