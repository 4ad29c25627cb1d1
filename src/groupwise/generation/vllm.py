"""Generation with vLLM in colocate mode (TRL's `use_vllm=True, vllm_mode="colocate"`): an in-process `vllm.LLM`
on each process's device, sharing it with training.

It follows the contract TRL 1.16's colocate mode uses with vLLM (docs/vllm.md): the engine is built with
`LLM(model=<policy path>, tensor_parallel_size, gpu_memory_utilization, max_model_len, enable_sleep_mode,
distributed_executor_backend="external_launcher", seed=<rank>, logprobs_mode="processed_logprobs")`, prompts go in
as `{"prompt_token_ids": ids}` with `SamplingParams(n=1, temperature, top_p, top_k, min_p, repetition_penalty,
max_tokens, logprobs=0)`, and after each optimizer step the policy's weights are loaded with
`llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights([(name, tensor)])` followed by
`llm.reset_prefix_cache()` (a LoRA policy's adapters are merged for the copy, then unmerged). With
`vllm_enable_sleep_mode` the engine sleeps (level 2) between generations and wakes for weights and KV cache.

vLLM is optional (`pip install groupwise[vllm]`); nothing imports it until this backend is built. With
`vllm_mode="server"` the backend is groupwise.generation.vllm_server's client of a separate vLLM server. CI and the
development machines have no vLLM: the backend is tested against the in-repo stand-in (tests/vllm_standin).
"""

from __future__ import annotations

import math
import os

import torch

from groupwise.config_base import ConfigError
from groupwise.generation import Generated


def _vllm():
    try:
        import vllm
    except ImportError:
        raise ConfigError("use_vllm=True needs vLLM: `pip install groupwise[vllm]` (on a machine with a GPU vLLM "
                          "supports)") from None
    return vllm


class VLLMColocateGenerator:
    @classmethod
    def from_config(cls, args, *, pad_token_id: int, eos_token_ids: list[int]):
        """The engine vllm_mode names: this class for 'colocate', a vLLM server's client for 'server'."""
        if args.vllm_mode == "server":
            from groupwise.generation.vllm_server import VLLMServerGenerator

            return VLLMServerGenerator.from_config(args, pad_token_id=pad_token_id, eos_token_ids=eos_token_ids)
        if args.vllm_mode != "colocate":
            raise ConfigError(f"vllm_mode={args.vllm_mode!r} is not one of 'colocate', 'server'")
        return cls(args, pad_token_id=pad_token_id)

    def __init__(self, args, *, pad_token_id: int):
        self.args, self.pad_token_id = args, pad_token_id
        self.llm = None  # built on first use, from the policy's path
        self.asleep = False

    def _engine(self, model):
        if self.llm is not None:
            return self.llm
        vllm = _vllm()
        args = self.args
        path = getattr(getattr(model, "config", None), "_name_or_path", "") or getattr(model, "name_or_path", "")
        if hasattr(model, "get_base_model"):  # PEFT: the engine serves the base architecture
            path = model.get_base_model().config._name_or_path
        if not path or not os.path.exists(path) and "/" not in path:
            raise ConfigError("use_vllm: vLLM loads the policy from a path; pass the model as a path (or hub id), "
                              "not as a model built in memory")
        rank = int(os.environ.get("RANK", "0"))
        self.llm = vllm.LLM(model=path, tensor_parallel_size=args.vllm_tensor_parallel_size,
                            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                            max_model_len=args.vllm_max_model_length, enable_sleep_mode=args.vllm_enable_sleep_mode,
                            distributed_executor_backend="external_launcher", seed=rank,
                            logprobs_mode="processed_logprobs", model_impl=args.vllm_model_impl,
                            trust_remote_code=args.trust_remote_code)
        if args.vllm_enable_sleep_mode:
            self.llm.sleep(level=2)
            self.asleep = True
        self.update_weights(model)  # the engine starts from the policy as it is now (a resumed run's weights)
        return self.llm

    def update_weights(self, model) -> None:
        """Load the policy's current weights into the engine (merged adapters for a LoRA policy)."""
        if self.llm is None:
            return  # not built yet: it will load the weights when it is
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        runner_model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        peft = hasattr(model, "merge_adapter")
        if peft:
            model.merge_adapter()
        try:
            base = model.get_base_model() if peft else model
            with torch.no_grad():
                for name, tensor in base.state_dict().items():
                    if peft and ("lora_" in name or "modules_to_save" in name):
                        continue
                    name = name.replace(".base_layer", "")  # PEFT's wrapped Linear keeps the weight one level down
                    runner_model.load_weights([(name, tensor)])
        finally:
            if peft:
                model.unmerge_adapter()
        self.llm.reset_prefix_cache()
        if self.asleep:
            self.llm.sleep(level=2)

    @torch.no_grad()
    def __call__(self, model, prompt_ids, prompt_mask, *, greedy: bool = False, logprobs: bool = False) -> Generated:
        vllm = _vllm()
        llm, args = self._engine(model), self.args
        prompts = [{"prompt_token_ids": ids[mask.bool()].tolist()} for ids, mask in zip(prompt_ids, prompt_mask)]
        params = vllm.SamplingParams(
            n=1, temperature=0.0 if greedy else args.temperature, top_p=1.0 if greedy else args.top_p,
            top_k=0 if greedy else args.top_k, min_p=0.0 if greedy or args.min_p is None else args.min_p,
            repetition_penalty=args.repetition_penalty, max_tokens=args.max_completion_length, logprobs=0,
            **(args.generation_kwargs or {}))
        if self.asleep:
            llm.wake_up(tags=["kv_cache"])
        outputs = llm.generate(prompts, sampling_params=params, use_tqdm=False)
        if self.asleep:
            llm.sleep(level=2)
        rows = [out.outputs[0] for out in outputs]
        T = max(1, max(len(r.token_ids) for r in rows))
        ids = torch.full((len(rows), T), self.pad_token_id, dtype=torch.long)
        lps = torch.full((len(rows), T), float("nan"))
        for i, r in enumerate(rows):
            ids[i, :len(r.token_ids)] = torch.tensor(list(r.token_ids), dtype=torch.long)
            if logprobs and r.logprobs is not None:
                for t, (token, entry) in enumerate(zip(r.token_ids, r.logprobs)):
                    value = entry[token].logprob
                    lps[i, t] = float("nan") if value is None or math.isnan(value) else value
        device = prompt_ids.device
        return Generated(ids.to(device), lps.to(device) if logprobs else None)
