"""GRPOConfig's rules for the sampler: `use_vllm` and its mode (colocated engine or server, where the server is,
the engine settings a server ignores) and the importance-sampling correction's clip bounds (DeepSeekMath's GRPO
assumes π_θold sampled; these weights correct for a sampler whose numerics differ). Called by
GRPOConfig.validate; the vLLM package itself is never imported here."""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from groupwise.config_base import ConfigError, warn_user

if TYPE_CHECKING:
    from groupwise.config import GRPOConfig

# fields of the colocated vLLM engine, and where a vLLM server takes the same setting (vllm_mode='server')
VLLM_COLOCATE_ONLY = {
    "vllm_gpu_memory_utilization": "start the server with `vllm serve --gpu-memory-utilization`",
    "vllm_tensor_parallel_size": "start the server with `vllm serve --tensor-parallel-size`",
    "vllm_enable_sleep_mode": "the server's memory is its own",
    "vllm_max_model_length": "start the server with `vllm serve --max-model-len`",
    "vllm_model_impl": "start the server with `vllm serve --model-impl`",
}


def check_sampler_fields(args: GRPOConfig, _default: Callable[[str], Any]) -> None:
    """The rules spanning the sampler's fields; `_default(name)` is a field's default. Sets generation_backend to
    'vllm' when use_vllm (TRL's switch) and vllm_importance_sampling_clip_max from TRL's deprecated cap."""
    if args.use_vllm:
        if args.vllm_mode == "server":
            _check_server(args, _default)
        if args.generation_backend not in ("fast", "vllm"):
            raise ConfigError(f"use_vllm=True and generation_backend={args.generation_backend!r} ask for two "
                              "samplers: drop one")
        if args.generation_dtype is not None:
            raise ConfigError("use_vllm=True samples with vLLM: generation_dtype does not apply")
        args.generation_backend = "vllm"
        top = (args.generation_kwargs or {}).get("logprobs", 0)
        if isinstance(top, bool) or not isinstance(top, int) or top < -1:
            raise ConfigError(f"generation_kwargs['logprobs']={top!r}: vLLM must return the sampled token's log-prob "
                              "(logprobs=0; k > 0 adds the top k, -1 every token, which groupwise does not read): "
                              "drop it, or give an int ≥ -1")
        constraint = ("vllm_structured_outputs_regex" if args.vllm_structured_outputs_regex is not None else
                      "generation_kwargs['structured_outputs']" if "structured_outputs" in (args.generation_kwargs
                                                                                            or {}) else None)
        if constraint and args.keeps_sampling_logps:
            reader = ("vllm_importance_sampling_correction=True" if args.corrects_sampling else
                      f"off_policy_mask_threshold={args.off_policy_mask_threshold}")
            raise ConfigError(f"{constraint} with {reader}: vLLM's log-probs are those of the constrained "
                              "distribution, which the trainer's log-probs are not, so the sampler's log-probs would "
                              "shrink (or mask) every completion by the probability the constraint removes, not "
                              "correct a numerics difference; set vllm_importance_sampling_correction: false (and "
                              "off_policy_mask_threshold: null), or drop the constraint")
    elif args.generation_backend == "vllm":
        raise ConfigError("generation_backend='vllm' with use_vllm=False: vLLM is selected with use_vllm=True "
                          "(TRL's switch; a config saved from such a run holds generation_backend='vllm'): set "
                          "use_vllm=True, or generation_backend='fast' to sample without vLLM")
    elif args.vllm_structured_outputs_regex is not None:  # TRL reads it with vLLM only; a dumped config still loads
        warn_user(f"vllm_structured_outputs_regex={args.vllm_structured_outputs_regex!r} has no effect without "
                  "use_vllm=True (only vLLM constrains the sampling to it)")
    if args.vllm_importance_sampling_cap is not None:  # TRL's deprecated alias, with TRL's warning
        warn_user("vllm_importance_sampling_cap is deprecated (TRL); use vllm_importance_sampling_clip_max",
                  FutureWarning)
        args.vllm_importance_sampling_clip_max = args.vllm_importance_sampling_cap
    lo, hi = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    if lo is not None and hi is not None and lo >= hi:
        raise ConfigError(f"vllm_importance_sampling_clip_min ({lo}) must be less than "
                          f"vllm_importance_sampling_clip_max ({hi}): lower the first or raise the second")
    if (args.vllm_importance_sampling_correction and lo is None and hi is None
            and args.vllm_importance_sampling_mode.endswith("_truncate")):
        raise ConfigError(f"vllm_importance_sampling_mode={args.vllm_importance_sampling_mode!r} clips the "
                          "weights: set vllm_importance_sampling_clip_min or vllm_importance_sampling_clip_max")


def _check_server(args: GRPOConfig, _default: Callable[[str], Any]) -> None:
    """vllm_mode='server': where the server is, and the colocated engine's settings (the server has its own)."""
    if args.vllm_server_base_url is not None:
        url = urllib.parse.urlparse(args.vllm_server_base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ConfigError(f"vllm_server_base_url={args.vllm_server_base_url!r} must be an http(s) URL such "
                              "as 'http://localhost:8000'")
        for name in ("vllm_server_host", "vllm_server_port"):
            if getattr(args, name) != _default(name):
                raise ConfigError(f"vllm_server_base_url and {name}={getattr(args, name)!r} both say where the "
                                  f"server is (TRL reads vllm_server_base_url and ignores {name}): give one")
    if args.world_size > 1 and args.vllm_server_timeout >= args.ddp_timeout:
        raise ConfigError(f"vllm_server_timeout={args.vllm_server_timeout:g} s ≥ ddp_timeout={args.ddp_timeout:g} s: "
                          "while the main process waits for the vLLM server, the others wait in a collective that "
                          "ddp_timeout ends first, with an error that does not name the server; raise ddp_timeout "
                          "above vllm_server_timeout")
    for name, flag in VLLM_COLOCATE_ONLY.items():
        if getattr(args, name) != _default(name):
            warn_user(f"{name}={getattr(args, name)!r} has no effect with vllm_mode='server' (the colocated "
                      f"engine's setting, as in TRL): {flag}")
