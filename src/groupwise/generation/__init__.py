"""prompts → completions. The generation backends and the one place one is chosen (GRPOConfig.generation_backend).

A backend is a class with
    from_config(args, *, pad_token_id, eos_token_ids, dist=None)
                                                         build itself from a GRPOConfig (`dist`: the run's
                                                         groupwise.distributed.Distributed, for a backend whose
                                                         processes share one engine)
    __call__(model, prompt_ids, prompt_mask, *, greedy=False, logprobs=False) -> Generated
    update_weights(model)                                receive the policy's new weights after an optimizer step
                                                         (and when a resume, the best checkpoint or the start of
                                                         training with a replica loads them; a no-op for
                                                         backends that sample from the policy itself)
    independently(model) (optional)                      a context in which processes may make different numbers
                                                         of calls, for a backend whose calls are collective
                                                         (`independently` below)
    start(model) (optional)                              build what it holds apart from the policy (vLLM
                                                         colocate: its engine, which seeds the random streams as
                                                         it starts; vLLM server: the weight-transfer group),
                                                         called by the trainer on every process
                                                         together once its models are built and seeded; a backend
                                                         holding a copy of the weights loads the policy's itself
                                                         before its first generation (update_weights is not always
                                                         called before it: evaluate() before training, a fresh run
                                                         without a replica)
and registers here with what it supports. Backends are imported on first use, so `import groupwise` (and config
validation) never imports transformers or an inference engine.
"""

from __future__ import annotations

import contextlib
import importlib
import weakref
from dataclasses import dataclass
from typing import Protocol

import torch

from groupwise.config_base import ConfigError

# GRPOConfig.generation_dtype: sample from a copy of the policy in this dtype
GENERATION_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Generated:
    """What a backend returns for N left-padded prompts."""

    completion_ids: torch.Tensor  # (N, T ≤ max_completion_length); anything after the first EOS is ignored
    logprobs: torch.Tensor | None = None  # (N, T) log π_sampler of each sampled token, when asked for
    # (N,) tokens each row generated, from a backend whose rows may end before T without an EOS (vLLM: a stop
    # string or stop token, its max_model_len); the columns past them are padding. None: a row ends at its first
    # EOS or runs to T.
    lengths: torch.Tensor | None = None

    @classmethod
    def from_rows(cls, rows: list[list[int]], logprobs: list[list[float | None] | None] | None, pad_token_id: int,
                  device: torch.device) -> "Generated":
        """An engine's ragged completions (each ended by EOS, a stop or the length limit) right-padded with
        pad_token_id, their log-probs (None / NaN → NaN, and on padding) when given, and each row's length."""
        from groupwise.text import pad_rows

        T = max(1, max((len(r) for r in rows), default=0))
        ids, _ = pad_rows(rows, pad_token_id, width=T)
        lps = None
        if logprobs is not None:
            values = [[float("nan") if v is None else float(v) for v in row or ()] for row in logprobs]
            lps = pad_rows(values, float("nan"), width=T, dtype=torch.float)[0].to(device)
        return cls(ids.to(device), lps, torch.tensor([len(r) for r in rows], device=device))


class Generator(Protocol):
    def __call__(self, model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *,
                 greedy: bool = False, logprobs: bool = False, max_new_tokens: int | None = None) -> Generated:
        """Completions of the left-padded prompts, at most `max_new_tokens` tokens each (None: max_completion_length;
        a later turn of a tool loop asks for less: what is left of the completion's budget, or of the positions)."""

    def update_weights(self, model: torch.nn.Module) -> None: ...


@dataclass(frozen=True)
class Backend:
    target: str  # "module:Class", imported on first use
    generation_kwargs: bool  # accepts GRPOConfig.generation_kwargs (extra GenerationConfig fields)
    summary: str
    model_generation_config: bool = False  # applies the model's own generation_config (generate() merges it)
    static_loop: bool = False  # has the compiled static decode loop (generation_compile, generation_fuse_projections)

    def load(self) -> type:
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)


BACKENDS: dict[str, Backend] = {
    "fast": Backend("groupwise.generation.fast:FastGenerator", generation_kwargs=False, static_loop=True,
                    summary="groupwise's sampler: prompt prefilled once per group, finished rows leave the batch"),
    "transformers": Backend("groupwise.generation.hf:TransformersGenerator", generation_kwargs=True,
                            summary="model.generate, the reference", model_generation_config=True),
    "vllm": Backend("groupwise.generation.vllm:VLLMColocateGenerator", generation_kwargs=True,
                    summary="vLLM (use_vllm=True): an engine in each process (vllm_mode 'colocate') or a vLLM "
                            "server's client ('server', generation/vllm_server.py); weights pushed after every "
                            "optimizer step"),
}


# generation_kwargs that would change the shape of what a backend returns: each has its own GRPOConfig field
SHAPING_GENERATION_KWARGS = {"max_new_tokens": "max_completion_length", "max_tokens": "max_completion_length",
                             "max_length": "max_completion_length", "num_return_sequences": "num_generations",
                             "n": "num_generations"}


def check_generation_fields(args) -> None:
    """GRPOConfig's rules for what each backend reads (called by GRPOConfig.validate): generation_kwargs only where
    model.generate-like backends take them, never one that changes the completions' shape or samples by beam
    search; generation_compile and generation_fuse_projections only with the fast backend's static decode loop."""
    if args.generation_kwargs and not BACKENDS[args.generation_backend].generation_kwargs:
        raise ConfigError(f"generation_kwargs {sorted(args.generation_kwargs)} need generation_backend="
                          "'transformers' (model.generate takes them, as in TRL); the fast sampler reads "
                          "temperature, top_p, top_k, min_p and repetition_penalty as GRPOConfig fields instead")
    shaping = sorted(set(args.generation_kwargs or {}) & set(SHAPING_GENERATION_KWARGS))
    if shaping:
        raise ConfigError(f"generation_kwargs[{shaping[0]!r}] would change the shape of the completions: set "
                          f"{SHAPING_GENERATION_KWARGS[shaping[0]]} instead")
    beams = (args.generation_kwargs or {}).get("num_beams", 1)
    if beams not in (None, 1):
        raise ConfigError(f"generation_kwargs['num_beams']={beams!r} would run beam search, whose completions are "
                          "not samples of the policy (the advantages, the log-probs and the importance correction "
                          "assume they are): drop num_beams")
    static_loop = BACKENDS[args.generation_backend].static_loop
    if args.generation_compile and not static_loop:
        raise ConfigError(f"generation_compile=True applies to generation_backend='fast', not "
                          f"{args.generation_backend!r}: drop generation_compile or use the fast backend")
    if args.generation_fuse_projections and (not static_loop or args.generation_compile is False):
        raise ConfigError("generation_fuse_projections applies to the fast backend's static decode loop: use "
                          "generation_backend='fast' without generation_compile=False, or drop "
                          "generation_fuse_projections")


# logits processors a model's generation_config may switch on, which model.generate() applies (it merges the model's
# generation_config into the one passed in) and the other backends do not; value: the field's off value
MODEL_PROCESSOR_FIELDS = {"no_repeat_ngram_size": 0, "bad_words_ids": None, "suppress_tokens": None,
                          "begin_suppress_tokens": None, "min_new_tokens": None, "min_length": 0, "typical_p": 1.0,
                          "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "sequence_bias": None, "forced_bos_token_id": None,
                          "forced_eos_token_id": None, "exponential_decay_length_penalty": None, "top_h": None,
                          "watermarking_config": None, "guidance_scale": None, "min_p": None}


def repeats(rows: list, sizes: tuple[int | None, ...] = ()) -> int:
    """How many consecutive rows share each prompt. Rollouts lay a prompt's rows side by side (the G completions of a
    group, or k per prompt in evaluation): a backend prefills each prompt once (fast) or sends it once with n = the
    group size (vLLM server, as TRL sends `all_prompts[::num_generations]` with n=num_generations). `rows`: one
    comparable item per row (its prompt ids, or an id of them). The first of `sizes` the rows are whole groups of,
    else the length of the first run of identical rows if they all come in such runs, else 1."""
    first = 1
    while first < len(rows) and rows[first] == rows[0]:
        first += 1
    for n in (*sizes, first):
        if n and len(rows) % n == 0 and all(rows[i] == rows[i - i % n] for i in range(len(rows))):
            return n
    return 1


def unapplied_generation_config(model, args) -> dict[str, object]:
    """The fields of the model's generation_config that change sampling, which model.generate() (and TRL's
    transformers path) would apply and `args.generation_backend` does not. min_p counts only when the config leaves
    it unset (GRPOConfig.min_p set is applied by every backend)."""
    config = getattr(model, "generation_config", None)
    if config is None or BACKENDS[args.generation_backend].model_generation_config:
        return {}
    found = {k: getattr(config, k, off) for k, off in MODEL_PROCESSOR_FIELDS.items()}
    found = {k: v for k, v in found.items() if v is not None and v != MODEL_PROCESSOR_FIELDS[k]}
    if args.min_p is not None:
        found.pop("min_p", None)
    return found


_INDEPENDENT: weakref.WeakSet = weakref.WeakSet()  # generators inside an independently() block


@contextlib.contextmanager
def independently(generator, model):
    """A block in which processes may make different numbers of generator calls: evaluation and the multi-turn tool
    loop. Backends whose processes share an engine implement `independently(model)`: vLLM server mode (each process
    then sends its own requests) and a tensor-parallel colocated vLLM engine (a process that has finished joins its
    group's remaining calls when it leaves the block). Every process enters it together, so it may first sync
    `model`'s weights or build the engine collectively; for the other backends there is nothing to change. Nested
    blocks (the tool loop within an evaluation) are the outermost one: only it is the backend's."""
    method = getattr(generator, "independently", None)
    if method is None or generator in _INDEPENDENT:
        yield
        return
    _INDEPENDENT.add(generator)
    try:
        with method(model):
            yield
    finally:
        _INDEPENDENT.discard(generator)


def build_generator(args, *, pad_token_id: int, eos_token_ids: list[int], dist=None) -> Generator:
    """The backend GRPOConfig.generation_backend names, built from the config."""
    return BACKENDS[args.generation_backend].load().from_config(args, pad_token_id=pad_token_id,
                                                                eos_token_ids=eos_token_ids, dist=dist)
