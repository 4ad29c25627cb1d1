"""An in-repo stand-in for the parts of vLLM's Python API that groupwise's vLLM backends call (vLLM itself needs
a supported GPU; CI has none). It follows vLLM's names and shapes, backed by a transformers model on the CPU:

    LLM(model=path, **engine_args)  (ENGINE_ARGS: an unknown name is a TypeError, as vLLM's EngineArgs(**kwargs);
        distributed_executor_backend="external_launcher" reads RANK / LOCAL_RANK and, torch.distributed not being
        initialized, needs MASTER_ADDR / MASTER_PORT, as vLLM's ExecutorWithExternalLauncher and env:// do)
    LLM.generate([{"prompt_token_ids": [...]}, ...], sampling_params=SamplingParams(...) or one per prompt,
                 use_tqdm=False)
        -> [RequestOutput(prompt_token_ids, outputs=[CompletionOutput(token_ids, logprobs=[{id: Logprob}])])]
    LLM.llm_engine.model_executor.driver_worker.model_runner.model.load_weights([(name, tensor)])
    LLM.reset_prefix_cache(), LLM.sleep(level) (level 2 discards the weights), LLM.wake_up(tags)

tensor_parallel_size > 1 (with the external launcher) is emulated: the engine spans a group of consecutive
processes, each holding the whole model, and generate() checks that every process of the group called it with the
same requests (a process that does not call it leaves the others waiting, as vLLM's collectives would) and that
they sampled the same tokens (vLLM's engines of a group must: their random streams have to agree).
Random streams: with the external launcher, as vLLM's in-process worker, the engine seeds python's, numpy's and
torch's streams with its `seed` (0 when unset) when it starts and samples from torch's stream; otherwise (the server,
a process of its own in vLLM) from a generator of its own seeded alike; a request with a `seed`, from its own.
SamplingParams checks its fields' ranges as vLLM's _verify_args. Sampling: temperature (0 = greedy), top-k (top-p,
min-p and the repetition penalty are accepted, not applied), structured_outputs=StructuredOutputsParams(regex=…)
(vllm.sampling_params: a token is allowed when the completion's text stays a prefix of a match, EOS once it is a
full match); logprobs of the sampled token under the processed
distribution (logprobs_mode="processed_logprobs": after temperature). It records what it is sent (`loads`, `calls`, `sizes`)
and what it sampled (`outputs`, `sampled_logprobs`) so tests can check that weights reach the engine and log-probs
the trainer. `LLM.reply` (an engine's, or a staticmethod on the class) may script completions: prompt ids -> completion ids (no log-probs),
or None to sample.

Server mode (tests/vllm_standin/serve.py serves this engine over HTTP) also uses, on the trainer's side:
    vllm.utils.network_utils.get_ip()
    vllm.distributed.weight_transfer.nccl_common.trainer_init / packed_tensor.packed_nccl_broadcast_producer (≥ 0.28)
    vllm.distributed.weight_transfer.nccl_engine.NCCLWeightTransferEngine (before 0.28)
with a gloo group on the CPU where vLLM has NCCL. `__version__` is the newest vLLM TRL 1.16 supports."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__version__ = "0.31.0+standin"
ENGINES: list["LLM"] = []  # every engine built in this process (tests read them)


# vLLM's EngineArgs fields the stand-in knows (LLM(**kwargs) builds EngineArgs(**kwargs): any other name is a
# TypeError there too), and the values it checks
ENGINE_ARGS = ("tensor_parallel_size", "gpu_memory_utilization", "max_model_len", "max_num_seqs",
               "max_num_batched_tokens", "enable_sleep_mode", "distributed_executor_backend", "seed", "logprobs_mode",
               "model_impl", "trust_remote_code", "quantization", "dtype", "revision", "enforce_eager",
               "enable_prefix_caching", "kv_cache_dtype")
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
MODEL_IMPLS = ("auto", "vllm", "transformers", "terratorch")
EXECUTORS = (None, "mp", "ray", "uni", "external_launcher")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    logprobs: int | None = None
    seed: int | None = None
    stop_token_ids: list[int] | None = None  # generation also ends after these (kept in the output, as vLLM does)
    structured_outputs: object = None  # vllm.sampling_params.StructuredOutputsParams (regex only here)
    min_tokens: int = 0  # accepted and checked as vLLM checks it, not applied

    def __post_init__(self):  # vLLM's SamplingParams._verify_args, for the fields above
        checks = [(self.n >= 1, "n must be at least 1"), (self.temperature >= 0, "temperature must be non-negative"),
                  (0 < self.top_p <= 1, "top_p must be in (0, 1]"), (self.top_k >= -1, "top_k must be 0 (disable), "
                  "or at least 1"), (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
                  (self.repetition_penalty > 0, "repetition_penalty must be greater than zero"),
                  (self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be at least 1"),
                  (self.logprobs is None or self.logprobs >= -1, "logprobs must be non-negative or -1"),
                  (self.min_tokens >= 0, "min_tokens must be greater than or equal to 0"),
                  (self.max_tokens is None or self.min_tokens <= self.max_tokens,
                   "min_tokens must be less than or equal to max_tokens")]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"{message}, got {self}")


@dataclass
class Logprob:
    logprob: float
    rank: int = 1
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    text: str = ""


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


class _Runner:
    def __init__(self, model: torch.nn.Module, engine: "LLM"):
        self.model = _WeightLoader(model, engine)


class _WeightLoader:
    """vLLM's model_runner.model: `load_weights(iterable of (name, tensor))` copies them into the engine's model."""

    def __init__(self, model: torch.nn.Module, engine: "LLM"):
        self.hf, self.engine = model, engine

    def load_weights(self, weights):
        if "weights" in self.engine.asleep:  # vLLM: the weights' memory is unmapped until wake_up(["weights"])
            raise RuntimeError("stand-in vLLM: load_weights while the weights sleep; call wake_up(['weights'])")
        params = dict(self.hf.named_parameters())
        with torch.no_grad():
            for name, tensor in weights:
                if name not in params:
                    raise KeyError(f"stand-in vLLM: no parameter {name!r} in the engine's model")
                if tuple(tensor.shape) != tuple(params[name].shape):  # vLLM's weight loaders assert it (no broadcast)
                    raise AssertionError(f"stand-in vLLM: {name!r} has shape {tuple(tensor.shape)}, the engine's "
                                         f"{tuple(params[name].shape)}")
                params[name].copy_(tensor.to(params[name].dtype))
                self.engine.loads.append(name)


def _seed_everything(seed: int) -> None:
    """vLLM's set_random_seed: python's, numpy's and torch's (CPU and every CUDA device's) random streams."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _tensor_parallel_group(tp: int, executor: str | None):
    """The group of `tp` consecutive ranks this process's engine spans (vLLM's tensor-parallel groups under the
    external launcher, which runs on the launcher's torch.distributed world); built by every rank together."""
    import datetime

    import torch.distributed as dist

    if executor != "external_launcher" or not dist.is_initialized():
        raise ValueError("stand-in vLLM: tensor_parallel_size > 1 is emulated only with distributed_executor_backend="
                         "'external_launcher' in a torch.distributed run")
    world = dist.get_world_size()
    if world % tp:
        raise ValueError(f"world_size ({world}) is not divisible by tensor_parallel_size ({tp})")
    group, _ = dist.new_subgroups_by_enumeration([list(range(r, r + tp)) for r in range(0, world, tp)],
                                                 timeout=datetime.timedelta(seconds=60))
    return group


class LLM:
    # tests may script completions: prompt ids -> completion ids, or None to sample that prompt from the model
    reply = None

    def __init__(self, model: str, **kwargs):
        import os

        from transformers import AutoModelForCausalLM

        unknown = sorted(set(kwargs) - set(ENGINE_ARGS))
        if unknown:
            raise TypeError(f"EngineArgs.__init__() got an unexpected keyword argument {unknown[0]!r}")
        for name, allowed in (("logprobs_mode", LOGPROBS_MODES), ("model_impl", MODEL_IMPLS),
                              ("distributed_executor_backend", EXECUTORS)):
            if name in kwargs and kwargs[name] not in allowed:
                raise ValueError(f"{name}={kwargs[name]!r} is not one of {allowed}")
        if kwargs.get("distributed_executor_backend") == "external_launcher":
            # vLLM's ExecutorWithExternalLauncher reads os.environ["RANK"] / ["LOCAL_RANK"] and rendezvous env://
            import torch.distributed as dist

            self.rank, self.local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
            if not dist.is_initialized():
                for name in ("MASTER_ADDR", "MASTER_PORT"):
                    if not os.environ.get(name):
                        raise ValueError(f"Error initializing torch.distributed using env:// rendezvous: "
                                         f"environment variable {name} expected, but not set")
        self.group = None  # tensor parallelism: the group of processes sharing this engine
        tp = int(kwargs.get("tensor_parallel_size") or 1)
        if tp > 1:
            self.group = _tensor_parallel_group(tp, kwargs.get("distributed_executor_backend"))
        self.kwargs = kwargs
        self.path = model
        self.hf = AutoModelForCausalLM.from_pretrained(model).eval()
        # with the external launcher (colocate mode) vLLM's worker runs in this process: it seeds python's, numpy's
        # and torch's random streams with `seed` (0 when unset) when it starts (Worker.init_device, and again after
        # its warm-up), then samples from the device's torch stream. Otherwise (`vllm serve`) the engine runs in a
        # process of its own, seeded alike: here, a generator of its own.
        seed = int(kwargs.get("seed") or 0)
        self.generator = None
        if kwargs.get("distributed_executor_backend") == "external_launcher":
            _seed_everything(seed)
        else:
            self.generator = torch.Generator().manual_seed(seed)
        self.loads: list[str] = []
        self.calls = 0
        self.sizes: list[int] = []  # the number of prompts of each generate() call
        self.asleep: set[str] = set()  # what sleep() put to sleep and wake_up() has not woken yet
        self.prefix_cache_resets = 0
        self.outputs: list[list[int]] = []  # the token ids of every completion of the last generate()
        self.sampled_logprobs: list[list[float]] = []  # and the log-prob of each of their tokens
        runner = _Runner(self.hf, self)
        worker = type("Worker", (), {"model_runner": runner})()
        executor = type("Executor", (), {"driver_worker": worker})()
        self.llm_engine = type("Engine", (), {"model_executor": executor})()
        ENGINES.append(self)

    def reset_prefix_cache(self) -> bool:
        self.prefix_cache_resets += 1
        return True

    def sleep(self, level: int = 1) -> None:
        """Level 1 offloads the weights (kept); level 2 discards them, as vLLM does: here they become NaN, and
        generate() refuses to run on them until load_weights has replaced them."""
        self.asleep = {"weights", "kv_cache"}
        if level == 2:
            with torch.no_grad():
                for p in self.hf.parameters():
                    p.fill_(float("nan"))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.asleep -= set(tags or ["weights", "kv_cache"])

    def _regex_mask(self, pattern: str, completion: list[int], eos: set[int]) -> torch.Tensor:
        """0 where a token keeps the completion's text a prefix of a match of `pattern` (EOS: a full match), −inf
        elsewhere: a brute-force stand-in for vLLM's grammar-compiled token bitmask."""
        import regex
        from transformers import AutoTokenizer

        if not hasattr(self, "tokenizer"):
            self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        mask = torch.full((self.hf.config.vocab_size,), float("-inf"))
        text = self.tokenizer.decode(completion, skip_special_tokens=True)
        for t in range(self.hf.config.vocab_size):
            if t in eos:
                ok = regex.fullmatch(pattern, text) is not None
            else:
                piece = self.tokenizer.decode(completion + [t], skip_special_tokens=True)
                ok = piece != text and regex.fullmatch(pattern, piece, partial=True) is not None
            if ok:
                mask[t] = 0.0
        return mask

    @property
    def sleeping(self) -> bool:
        return bool(self.asleep)

    @torch.no_grad()
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True):
        params = sampling_params if isinstance(sampling_params, list) else \
            [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):  # vLLM's LLM._validate_and_add_requests
            raise ValueError("The lengths of prompts and params must be the same.")
        if self.group is not None:  # vLLM's external launcher: every rank of the group runs the same requests
            import torch.distributed as dist

            seen = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(seen, (list(prompts), params), group=self.group)
            if any(other != seen[0] for other in seen):
                raise RuntimeError("stand-in vLLM: the processes of a tensor-parallel group called generate() with "
                                   "different requests (vLLM's external launcher needs the same on every rank)")
        if self.asleep:
            raise RuntimeError(f"stand-in vLLM: generate() while {sorted(self.asleep)} sleep; call wake_up first")
        if any(q.isnan().any() for q in self.hf.parameters()):
            raise RuntimeError("stand-in vLLM: the weights were discarded by sleep(level=2) and not loaded again")
        eos = self.hf.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        self.calls += 1
        self.sizes.append(len(prompts))
        self.last_params = params[0] if params else None
        self.last_params_per_prompt = list(params)
        out = []
        for prompt, p in zip(prompts, params):
            ids = list(prompt["prompt_token_ids"])
            scripted = self.reply(ids) if self.reply is not None else None
            if scripted is not None:  # a test's scripted completion (no log-probs), cut at max_tokens as vLLM's
                scripted = list(scripted)[:p.max_tokens]
                out.append(RequestOutput(ids, [CompletionOutput(k, scripted, None) for k in range(p.n)]))
                continue
            completions, stop = [], eos | set(p.stop_token_ids or [])
            for k in range(p.n):
                # a request's own seed: its own generator; vLLM gives the k-th of n > 1 samples seed + k
                # (ParentRequest's child sampling params)
                generator = self.generator if p.seed is None else torch.Generator().manual_seed(p.seed + k)
                seq, lps = list(ids), []
                for _ in range(p.max_tokens):
                    logits = self.hf(torch.tensor([seq])).logits[0, -1].float()
                    if p.structured_outputs is not None:
                        logits = logits + self._regex_mask(p.structured_outputs.regex, seq[len(ids):], eos)
                    if p.temperature == 0:
                        probs = torch.softmax(logits, -1)
                        token = int(logits.argmax())
                    else:
                        logits = logits / p.temperature
                        if p.top_k and p.top_k > 0:
                            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]  # vLLM clamps it
                            logits = logits.masked_fill(logits < kth, float("-inf"))
                        probs = torch.softmax(logits, -1)
                        token = int(torch.multinomial(probs, 1, generator=generator))
                    lps.append({token: Logprob(float(torch.log(probs[token])))})
                    seq.append(token)
                    if token in stop:
                        break
                completions.append(CompletionOutput(k, seq[len(ids):], lps if p.logprobs is not None else None))
            out.append(RequestOutput(ids, completions))
        self.outputs = [c.token_ids for r in out for c in r.outputs]
        if self.group is not None:  # one engine in vLLM: every rank of the group holds the same tokens
            import torch.distributed as dist

            sampled = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(sampled, self.outputs, group=self.group)
            if any(other != sampled[0] for other in sampled):
                raise RuntimeError("stand-in vLLM: the processes of a tensor-parallel group sampled different tokens "
                                   "(their random streams differ; vLLM seeds the engines of a group alike)")
        self.sampled_logprobs = [[e[t].logprob for t, e in zip(c.token_ids, lps)] for c, lps in
                                 ((c, c.logprobs) for r in out for c in r.outputs) if lps is not None]
        return out
