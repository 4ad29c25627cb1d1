"""Seconds per GRPO step, split by phase, and peak memory: groupwise (full fine-tune and LoRA, β = 0 and β > 0)
beside TRL 1.16 on the same configuration.

    .venv/bin/python benchmarks/gpu_step.py                 # on a GPU: Qwen2.5-0.5B-shaped model, bf16
    .venv/bin/python benchmarks/gpu_step.py --small         # anywhere: a small model of the same family (CPU check)
    .venv/bin/python benchmarks/gpu_step.py --trl           # also the TRL row (needs `pip install groupwise[bench]`)

The model is built from a Qwen2 config with random weights (nothing is downloaded): hidden 896, 24 layers, 14 heads
(2 KV), MLP 4864, vocabulary 151 936 — Qwen2.5-0.5B's shape. G = 8, 16 prompts per step (128 completions), 256
completion tokens (every completion runs to the limit: EOS is never sampled, min_new_tokens-free), 32 prompt tokens,
bf16 on a GPU, float32 on CPU, μ = 1, loss dapo. Each configuration runs in its own process; the median of the steps
after the first 2 is reported. Phases: generate (sampling), rewards, logprobs (π_θold / π_ref passes), update
(forward + backward + optimizer: time/step − time/rollout). Peak memory: torch.cuda.max_memory_allocated on a GPU,
the process's peak RSS on CPU.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import write_table  # noqa: E402

SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936),
    "small": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=352, vocab_size=4096),
}


def build(shape: str, folder: str) -> None:
    """A random-weight Qwen2 model of `shape` and a word-level tokenizer over its vocabulary, saved to folder."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    dims = SHAPES[shape]
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, dims["vocab_size"])}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")
    config = Qwen2Config(**dims, max_position_embeddings=1024, tie_word_embeddings=True, pad_token_id=0,
                         eos_token_id=1, bos_token_id=1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)


def tokenizer(folder: str):
    """The word-level tokenizer as saved (AutoTokenizer would pick Qwen2's tokenizer class from the model config)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(folder)


def prompts(n: int = 4096, length: int = 32, vocab: int = 4096) -> list[dict]:
    import random

    rng = random.Random(0)
    return [{"prompt": " ".join(f"w{rng.randrange(2, vocab)}" for _ in range(length))} for _ in range(n)]


def length_reward(completions, **_):
    return [float(len(c.split())) + (hash(c) % 7) / 7 for c in completions]  # varied, so groups carry signal


def settings(small: bool, cuda: bool) -> dict:
    return dict(num_generations=8, per_device_train_batch_size=128, max_completion_length=32 if small else 256,
                temperature=1.0, learning_rate=1e-6, loss_type="dapo", logging_steps=1, seed=0, bf16=cuda,
                gradient_checkpointing=False)


def peak_memory(cuda: bool) -> float:
    import torch

    if cuda:
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB → GiB


VARIANTS = {"": {}, "eager": dict(generation_compile=False), "bf16": dict(generation_dtype="bfloat16"),
            "fp16": dict(bf16=False, fp16=True)}  # fp16 mixed precision (a T4 / V100 run) instead of bf16


def run_groupwise(model_dir: str, steps: int, lora: bool, beta: float, small: bool, out: str,
                  variant: str = "") -> dict:
    import torch

    from groupwise import GRPOConfig, GRPOTrainer

    cuda = torch.cuda.is_available()
    kwargs = dict(use_peft=True, lora_r=16, lora_alpha=32, lora_dropout=0.0, lora_target_modules="all-linear") \
        if lora else {}
    kwargs.update(VARIANTS[variant])
    args = GRPOConfig(output_dir=out, max_steps=steps, save_strategy="no", beta=beta,
                      **{**settings(small, cuda), **kwargs})
    vocab = SHAPES["small" if small else "qwen2.5-0.5b"]["vocab_size"]
    trainer = GRPOTrainer(model_dir, length_reward, args=args, train_dataset=prompts(vocab=vocab),
                          processing_class=tokenizer(model_dir))
    _suppress_eos(trainer)  # completions run to max_completion_length
    trainer.train()
    lines = [json.loads(x) for x in open(f"{out}/metrics.jsonl") if "time/step" in json.loads(x)][2:]
    med = {k: statistics.median(x[k] for x in lines) for k in
           ("time/step", "time/rollout", "time/generate", "time/rewards", "time/logprobs")}
    tokens = 128 * args.max_completion_length
    return {"step": med["time/step"], "generate": med["time/generate"], "rewards": med["time/rewards"],
            "logprobs": med["time/logprobs"], "update": med["time/step"] - med["time/rollout"],
            "gen_tokens_per_s": tokens / med["time/generate"], "peak_gib": peak_memory(cuda)}


def _suppress_eos(trainer) -> None:
    """Make every completion run to max_completion_length, for both trainers alike (EOS logit → −inf)."""
    import torch

    eos = trainer.tokenizer.eos_token_id
    models = {id(m): m for m in (getattr(trainer, "unwrapped", None), trainer.sampling_model) if m is not None}
    for model in models.values():  # the policy and the replica it refreshes (generation_dtype) alike
        head = model.get_output_embeddings()
        if head.bias is None:
            head.bias = torch.nn.Parameter(torch.zeros(head.out_features, device=head.weight.device,
                                                       dtype=head.weight.dtype), requires_grad=False)
        with torch.no_grad():
            head.bias[eos] = -1e4


def run_trl(model_dir: str, steps: int, small: bool, out: str) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = torch.cuda.is_available()
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t)

    s = settings(small, cuda)
    args = GRPOConfig(output_dir=out, max_steps=steps, report_to="none", save_strategy="no", use_vllm=False,
                      disable_dropout=True, **s)
    vocab = SHAPES["small" if small else "qwen2.5-0.5b"]["vocab_size"]
    trainer = GRPOTrainer(model_dir, length_reward, args=args, train_dataset=Dataset.from_list(prompts(vocab=vocab)),
                          processing_class=tokenizer(model_dir), callbacks=[Clock()])
    _suppress_eos(_TRLView(trainer))
    trainer.train()
    step = statistics.median(times[2:])
    return {"step": step, "peak_gib": peak_memory(cuda)}


class _TRLView:  # what _suppress_eos reads, from a TRL trainer
    def __init__(self, trainer):
        self.tokenizer = trainer.processing_class
        self.sampling_model = trainer.model


def child(args) -> None:
    with tempfile.TemporaryDirectory() as out:
        if args.which == "trl":
            result = run_trl(args.model_dir, args.steps, args.small, out)
        else:
            lora, beta, variant = (args.which + "::").split(":")[:3]
            result = run_groupwise(args.model_dir, args.steps, lora == "lora", float(beta), args.small, out,
                                   variant)
    print("RESULT " + json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="a small model of the same family (runs on CPU)")
    ap.add_argument("--steps", type=int, default=6, help="steps per run, ≥ 3 (the first two, warm-up, are not timed)")
    ap.add_argument("--trl", action="store_true", help="also run TRL 1.16 on the same configuration")
    ap.add_argument("--runs", default="full:0,full:0.04,lora:0,lora:0.04",
                    help="comma-separated kind:β[:variant], kind full|lora, variant eager (generation_compile=False), "
                         "bf16 (generation_dtype='bfloat16') or fp16 (fp16 mixed precision instead of bf16)")
    ap.add_argument("--which")
    ap.add_argument("--model_dir")
    args = ap.parse_args()
    if args.steps < 3:
        ap.error(f"--steps {args.steps}: give at least 3 (the first two steps are warm-up, not timed)")
    if args.which:
        child(args)
        return
    import torch

    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as folder:
        build("small" if args.small else "qwen2.5-0.5b", folder)
        runs = args.runs.split(",") + (["trl"] if args.trl else [])
        results = {}
        for which in runs:
            cmd = [sys.executable, __file__, "--which", which, "--model_dir", folder, "--steps", str(args.steps)]
            cmd += ["--small"] if args.small else []
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not line:
                print(proc.stderr[-3000:], file=sys.stderr)
                print(f"{which} failed", flush=True)
                continue
            results[which] = json.loads(line[0][7:])
            print(which, results[which], flush=True)
    rows = []
    for which, r in results.items():
        kind, _, rest = which.partition(":")
        beta, _, variant = rest.partition(":")
        label = {"": "", "eager": ", eager loop", "bf16": ", bf16 sampling", "fp16": ", fp16 training"}[variant]
        name = {"trl": "TRL 1.16 (full, β 0)"}.get(which, f"groupwise {kind}, β {beta}{label}")
        rows.append([name, f"{r['step']:.2f}", *(f"{r[k]:.2f}" if k in r else "—" for k in
                                                 ("generate", "rewards", "logprobs", "update")),
                     f"{r['gen_tokens_per_s']:.0f}" if "gen_tokens_per_s" in r else "—", f"{r['peak_gib']:.2f}"])
    shape = "small Qwen2" if args.small else "Qwen2.5-0.5B-shaped"
    notes = [f"{shape} model (random weights), G = 8, 16 prompts × 8 = 128 completions per step, "
             f"{settings(args.small, cuda)['max_completion_length']} completion tokens (EOS suppressed), "
             f"{'bf16' if cuda else 'float32'}; medians of steps 3–{args.steps}.",
             "groupwise samples with its fast backend; on CUDA its decode step is compiled (generation_compile, "
             "the default; 'eager loop' turns it off); 'bf16 sampling' samples from a bf16 copy of the weights "
             "(generation_dtype, importance-corrected); 'fp16 training' trains in fp16 mixed precision (float16 "
             "autocast, loss scale) instead of bf16.",
             "β 0.04 with LoRA uses the same model with the adapters disabled as the reference (no copy); the full "
             "fine-tune keeps a frozen copy. Peak memory: " + ("torch.cuda.max_memory_allocated." if cuda else
                                                               "peak RSS of the process (CPU).")]
    write_table("gpu_step" if cuda else "gpu_step_cpu", "GRPO step: phases and peak memory",
                ["run", "s/step", "generate", "rewards", "logprobs", "update", "gen tok/s", "peak GiB"], rows, notes)


if __name__ == "__main__":
    main()
