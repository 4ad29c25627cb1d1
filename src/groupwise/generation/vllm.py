"""Generation with vLLM in colocate mode (TRL's `use_vllm=True, vllm_mode="colocate"`): an in-process `vllm.LLM`
on each process's device, sharing it with training; with vllm_tensor_parallel_size = tp > 1 each engine spans a
group of tp consecutive processes, whose prompts are gathered into one engine call per round (as TRL gathers them).

It follows the contract TRL 1.16's colocate mode uses with vLLM (docs/vllm.md): the engine is built with
`LLM(model=<policy path>, tensor_parallel_size, gpu_memory_utilization, max_model_len, max_num_seqs=
per_device_train_batch_size · tensor_parallel_size · steps_per_generation, enable_sleep_mode, model_impl,
distributed_executor_backend="external_launcher", seed=<rank> // tensor_parallel_size, max_num_batched_tokens=4096,
logprobs_mode="processed_logprobs", trust_remote_code)` once RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT are set (launcher_environment: the external launcher reads them), prompts go in
as `{"prompt_token_ids": ids}` with `SamplingParams(n=1, temperature, top_p, top_k, min_p, repetition_penalty,
max_tokens, logprobs=0)` (updated with generation_kwargs), and after each optimizer step (with sleep mode: before
each generation instead) the policy's weights are loaded with
`llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(weights)` followed by
`llm.reset_prefix_cache()` (a LoRA policy's adapters are merged for the copy, then unmerged; the names are
vllm_named_weights's, the same server mode sends), as they are before the engine's first generation too. The engine
starts with the trainer (start(), after the trainer's seeding, as TRL builds it: it seeds the process's random
streams). With `vllm_enable_sleep_mode` the engine sleeps (level 2, which discards the weights) when it starts and
after each generation and, before the next, wakes its weights, loads the policy's current ones, then wakes its KV
cache.

vLLM is optional (`pip install vllm`, the build for the machine's CUDA and torch: docs/vllm.md); nothing imports it until this backend is built. With
`vllm_mode="server"` the backend is groupwise.generation.vllm_server's client of a separate vLLM server; what both
modes share lives here: the weights' names (vllm_named_weights), the sampling fields, and the trainer's end of
vLLM's weight-transfer group (weight_transfer). CI and the development machines have no vLLM: the backend is tested
against the in-repo stand-in (tests/vllm_standin).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from groupwise.config_base import ConfigError
from groupwise.distributed import ProcessFailed
from groupwise.generation import Generated, repeats


def _vllm():
    try:
        import vllm
    except ImportError:
        raise ConfigError("use_vllm=True needs vLLM: `pip install vllm` (on a machine with a GPU vLLM "
                          "supports)") from None
    return vllm


@contextlib.contextmanager
def vllm_named_weights(model: torch.nn.Module) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The policy's parameters under the names vLLM loads, as TRL 1.16 walks an unsharded model (tied weights once):
    a LoRA policy merged while the caller reads them (groupwise.adapters.merged: the frozen base is restored bit for
    bit afterwards), adapters and `modules_to_save`'s originals left out. vLLM loads a checkpoint's names and layout:
    where transformers ≥ 5 holds a model in another layout than its checkpoints (a MoE's experts fused into one
    `experts.gate_up_proj` tensor, where the checkpoint has `experts.<i>.gate_proj.weight` …), the weights are
    converted back as save_pretrained converts them (transformers' revert_weight_conversion); for the other models
    that changes nothing."""
    from groupwise.adapters import is_peft_model, merged

    peft = is_peft_model(model)
    with merged(model):
        prefix = getattr(model, "prefix", "lora_") if peft else None
        named = []
        for name, param in model.named_parameters():
            if peft:
                name = name.removeprefix("base_model.model.").replace(".base_layer", "")
                if prefix in name or "original_module" in name:
                    continue
                name = name.replace("modules_to_save.default.", "")
            named.append((name.replace("_checkpoint_wrapped_module.", ""), param.data))
        yield checkpoint_layout(model.get_base_model() if peft else model, named)


def checkpoint_layout(model: torch.nn.Module, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """`named` (the model's own parameter names) in its checkpoints' names and layout, as save_pretrained writes
    them: unchanged for a model transformers holds as its checkpoints do (dense models, transformers 4)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: models hold their checkpoints' layout
        return named
    return list(revert_weight_conversion(model, dict(named)).items())


def launcher_environment() -> int:
    """Set the variables vLLM's `external_launcher` backend reads, as TRL 1.16 sets them before building the engine:
    RANK and LOCAL_RANK (read unconditionally: a KeyError without them), WORLD_SIZE, and MASTER_ADDR / MASTER_PORT
    for its env:// rendezvous (localhost and a free port unless set, TRL's ensure_master_addr_port). torchrun sets
    them all; a plain `python train.py` sets none. Returns this process's rank."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    os.environ["LOCAL_RANK"] = os.environ.get("LOCAL_RANK") or str(rank % max(1, torch.cuda.device_count()))
    os.environ["MASTER_ADDR"] = os.environ.get("MASTER_ADDR") or "localhost"
    if os.environ.get("MASTER_PORT", "").strip().lower() in ("", "0", "auto"):
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    return rank


def sampling_fields(args, greedy: bool, max_new_tokens: int | None = None) -> dict:
    """The sampling fields sent to vLLM (SamplingParams, or the server's request) for a GRPOConfig, as TRL sends
    them; generation_kwargs override them (TRL), and a greedy call (evaluation) stays greedy whatever they say.
    `max_new_tokens`: a later tool turn's limit on max_tokens (and on a min_tokens, which vLLM refuses above it)."""
    fields = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  min_p=0.0 if args.min_p is None else args.min_p, repetition_penalty=args.repetition_penalty,
                  max_tokens=args.max_completion_length)
    fields.update(args.generation_kwargs or {})
    if greedy:
        fields.update(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0)
    if max_new_tokens is not None:
        fields["max_tokens"] = min(fields["max_tokens"], max_new_tokens)
        if fields.get("min_tokens"):
            fields["min_tokens"] = min(fields["min_tokens"], fields["max_tokens"])
    return fields


def structured_outputs(args, given: dict | None) -> dict | None:
    """vLLM's structured-outputs constraint for colocate mode, as TRL sets it: vllm_structured_outputs_regex, which
    wins over generation_kwargs["structured_outputs"] (with TRL's warning), else that dict. Server mode sends the
    regex in the request, where generation_kwargs win (TRL's client)."""
    if args.vllm_structured_outputs_regex is None:
        return given
    if given is not None:
        warnings.warn("Both `structured_outputs_regex` and `generation_kwargs['structured_outputs']` are set; "
                      "`structured_outputs_regex` takes precedence.", UserWarning, stacklevel=3)
    return {"regex": args.vllm_structured_outputs_regex}


class VLLMColocateGenerator:
    @classmethod
    def from_config(cls, args, *, pad_token_id: int, eos_token_ids: list[int], dist=None):
        """The engine vllm_mode names: this class for 'colocate', a vLLM server's client for 'server'."""
        if args.vllm_mode == "server":
            from groupwise.generation.vllm_server import VLLMServerGenerator

            return VLLMServerGenerator.from_config(args, pad_token_id=pad_token_id, eos_token_ids=eos_token_ids,
                                                   dist=dist)
        if args.vllm_mode != "colocate":
            raise ConfigError(f"vllm_mode={args.vllm_mode!r} is not one of 'colocate', 'server'")
        return cls(args, pad_token_id=pad_token_id, dist=dist)

    def __init__(self, args, *, pad_token_id: int, dist=None):
        self.args, self.pad_token_id, self.dist = args, pad_token_id, dist
        self.llm = None  # built by start(), with the trainer (else at the first call), from the policy's path
        self.asleep = False
        # vllm_tensor_parallel_size = tp > 1: one engine spans each group of tp consecutive processes (TRL's layout);
        # every call is a round of the group: its processes' prompts are gathered, generated by one collective
        # engine call, and each process takes its own rows back
        # (groupwise.layout checked that tp divides the number of processes)
        tp = args.vllm_tensor_parallel_size
        self.group = dist.subgroup(tp) if tp > 1 else None
        self.failed = False  # a process of the group reported a failure within independently()
        self.exchanging = False  # inside the group's exchange (a gather that raised leaves it True)
        self.current = False  # the engine holds the policy's current weights (not yet: its path's, as it starts)

    def start(self, model) -> None:
        """Build the engine, with the trainer (as TRL builds it), on every process together. vLLM's worker, in this
        process, seeds python's, numpy's and torch's (CPU and CUDA) random streams with its `seed` as it starts,
        then samples from the device's stream: so the trainer starts it after its own seeding, as TRL does, and a
        resume restores the checkpoint's streams after it, not before (an engine first built at a resumed run's
        first generation, or inside an evaluation that keeps the streams, would undo them). The policy's weights
        are loaded before the first generation. With sleep mode it goes to sleep at once (TRL), its memory given
        back until then."""
        self._engine(model)
        if self.args.vllm_enable_sleep_mode:
            self._sleep()

    def _sleep(self) -> None:
        self.asleep, self.current = True, False
        self.llm.sleep(level=2)  # level 2 discards the weights

    def _engine(self, model):
        if self.llm is not None:
            return self.llm
        vllm = _vllm()
        args = self.args
        path = getattr(getattr(model, "config", None), "_name_or_path", "") or getattr(model, "name_or_path", "")
        if hasattr(model, "get_base_model"):  # PEFT: the engine serves the base architecture
            path = model.get_base_model().config._name_or_path
        if not path:  # a model built in memory; a local directory or any hub id ("gpt2" too) is vLLM's to load
            raise ConfigError("use_vllm: vLLM loads the policy from a path; pass the model as a path (or hub id), "
                              "not as a model built in memory")
        rank = launcher_environment()
        tp = args.vllm_tensor_parallel_size
        self.llm = vllm.LLM(model=path, tensor_parallel_size=tp,
                            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                            max_model_len=args.vllm_max_model_length,
                            max_num_seqs=args.per_device_train_batch_size * tp * (args.steps_per_generation or 1),
                            enable_sleep_mode=args.vllm_enable_sleep_mode, model_impl=args.vllm_model_impl,
                            distributed_executor_backend="external_launcher", seed=rank // tp,
                            max_num_batched_tokens=4096, logprobs_mode="processed_logprobs",
                            trust_remote_code=args.trust_remote_code)
        return self.llm

    def update_weights(self, model) -> None:
        """Load the policy's current weights into the engine (merged adapters for a LoRA policy). Not built yet, or
        asleep: nothing to do now, the weights are loaded at its first generation or when it wakes."""
        if self.llm is not None and not self.asleep:  # asleep: `current` is False (_sleep), so it loads on waking
            self._load(model)

    def _load(self, model) -> None:
        self.current = False  # (until the load has finished)
        runner_model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        with torch.no_grad(), vllm_named_weights(model) as named:
            runner_model.load_weights(named)
        self.llm.reset_prefix_cache()
        self.current = True

    def _fields(self, greedy: bool, max_new_tokens: int | None = None) -> dict:
        """This call's SamplingParams fields: TRL's, with the structured-outputs constraint resolved."""
        fields = sampling_fields(self.args, greedy, max_new_tokens)
        constraint = structured_outputs(self.args, fields.get("structured_outputs"))
        if constraint is not None:
            fields["structured_outputs"] = constraint
        return fields

    @staticmethod
    def _params(vllm, fields: dict):
        fields = dict(fields)
        if isinstance(fields.get("structured_outputs"), dict):  # TRL converts a dict; a StructuredOutputsParams
            from vllm.sampling_params import StructuredOutputsParams  # passes as it is

            fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
        return vllm.SamplingParams(**{"n": 1, "logprobs": 0, **fields})  # generation_kwargs' logprobs wins (TRL)

    @torch.no_grad()
    def __call__(self, model, prompt_ids, prompt_mask, *, greedy: bool = False, logprobs: bool = False,
                 max_new_tokens: int | None = None) -> Generated:
        mine = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        request = (mine, self._fields(greedy, max_new_tokens))
        if self.group is None:
            outputs = self._round(model, [request])
        else:  # the group's requests in rank order; this process's rows follow those of the lower ranks
            parts = self._exchange(request)
            start = sum(len(part[0]) for part in parts[:self.dist.rank % len(parts)] if part is not None)
            outputs = self._round(model, parts)[start:start + len(mine)]
        rows = [out.outputs[0] for out in outputs]
        values = None if not logprobs else [
            None if r.logprobs is None else [entry[token].logprob for token, entry in zip(r.token_ids, r.logprobs)]
            for r in rows]
        return Generated.from_rows([list(r.token_ids) for r in rows], values, self.pad_token_id, prompt_ids.device)

    def _round(self, model, parts: list) -> list:
        """One engine call for every (prompt ids, sampling fields) request of `parts` (None: a process with none);
        the RequestOutputs in order. Requests with different fields get one SamplingParams per prompt."""
        vllm = _vllm()
        llm = self._engine(model)
        parts = [part for part in parts if part is not None and part[0]]
        if not parts:
            return []
        prompts = [{"prompt_token_ids": ids} for rows, _ in parts for ids in rows]
        if any(fields.get("seed") is not None for _, fields in parts):
            # generation_kwargs' seed: server mode sends a group as one request with n = G, whose j-th sample vLLM
            # seeds with seed + j; one request per row with the seed as it is would sample one completion G times.
            # Row j of each group gets seed + j: counted in this call when its rows are whole groups, else (a group
            # split over processes) from the round's first row, the training rows being equal contiguous slices
            G = self.args.num_generations
            n = repeats([p["prompt_token_ids"] for p in prompts], (G, self.args.num_generations_eval))
            offset = 0
            if n not in (G, self.args.num_generations_eval):  # not whole groups
                n = G
                if self.dist is not None:
                    tp = self.args.vllm_tensor_parallel_size if self.group is not None else 1
                    offset = (self.dist.rank - self.dist.rank % tp) * len(parts[0][0])
            rows = [fields for rows, fields in parts for _ in rows]
            params = [self._params(vllm, fields if fields.get("seed") is None else
                                   {**fields, "seed": fields["seed"] + (offset + i) % n})
                      for i, fields in enumerate(rows)]
        elif all(fields == parts[0][1] for _, fields in parts):
            params = self._params(vllm, parts[0][1])
        else:
            params = [self._params(vllm, fields) for rows, fields in parts for _ in rows]
        try:
            if self.asleep:  # a level-2 sleep discarded the weights: wake them, load the policy's, then the KV cache
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()  # TRL: "required to avoid OOM in some cases"
                llm.wake_up(tags=["weights"])
            if not self.current:  # the engine's first generation, or its weights woke from a sleep: the policy's
                self._load(model)
            if self.asleep:
                llm.wake_up(tags=["kv_cache"])
                self.asleep = False
            return llm.generate(prompts, sampling_params=params, use_tqdm=False)
        finally:
            if self.args.vllm_enable_sleep_mode:  # the memory goes back to training until the next generation
                self._sleep()

    def _exchange(self, item) -> list:
        """Every process of the tensor-parallel group's `item` (a request, None when it has finished, or _Failed),
        in rank order; ProcessFailed when another process reported a failure."""
        self.exchanging = True  # left True when the gather raises: the group is broken, no further exchange is tried
        parts = self.dist.gather_object_in(self.group, item)
        self.exchanging = False
        failures = [part.message for part in parts if isinstance(part, _Failed)]
        if failures:
            self.failed = True
            if not isinstance(item, _Failed):
                raise ProcessFailed(f"generation failed on another process of the vLLM tensor-parallel group: "
                                    f"{failures[0]}")
        return parts

    @contextlib.contextmanager
    def independently(self, model):
        """Evaluation and the tool loop, whose processes make different numbers of calls. Each process's engine is
        its own at tensor_parallel_size 1: nothing else to do. At tp > 1 the engine is collective over its group (vLLM's
        external launcher: every process of the group calls it with the same inputs): every call stays a round of the
        group, a process that has finished joins the group's remaining rounds with no prompts, and a process that
        fails tells the group, whose processes stop with its message instead of waiting. Every process enters
        together: an engine not started yet (no trainer called start()) is built here (vLLM's external launcher
        builds it collectively over every process, at any tp)."""
        self._engine(model)
        if self.group is None:
            yield
            return
        self.failed = self.exchanging = False
        try:
            yield
            while True:  # the group's other processes may still be generating
                parts = self._exchange(None)
                if all(part is None for part in parts):
                    return
                self._round(model, parts)
        except Exception as e:  # in this process's calls or in a round it joined: the group stops with it
            if not (self.failed or self.exchanging):  # (unless it knows already, or the exchange itself failed)
                self._exchange(_Failed(f"{type(e).__name__}: {e}"))
            raise


@dataclass(frozen=True)
class _Failed:
    """A process's failure, sent to the others of its tensor-parallel group within independently()."""

    message: str


# ---- the weight-transfer group: vLLM's trainer end, the one place it is reached ---------------------------------
@dataclass(frozen=True)
class WeightTransfer:
    open: Callable[[dict], Any]  # init_info -> the communicator (rank 0 of the group)
    send: Callable[[Any, Iterator[tuple[str, torch.Tensor]]], None]  # communicator, (name, tensor)… -> broadcast
    packed_in_init: bool  # vLLM ≥ 0.28 reads "packed" from the init info, older versions from each update's info
    cpu: bool  # the transport runs on the CPU (the in-repo stand-in's gloo group); vLLM's NCCL needs CUDA


def _vllm_version(vllm) -> str:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return getattr(vllm, "__version__", "0")


def weight_transfer() -> WeightTransfer:
    """The trainer's end of vLLM's NCCL weight-transfer engine, reached as TRL 1.16 reaches it: from vLLM 0.28 (which
    replaced the engine's static trainer methods by a stateful engine) the rendezvous `nccl_common.trainer_init` and
    `packed_tensor.packed_nccl_broadcast_producer`; before, `NCCLWeightTransferEngine.trainer_init` and
    `.trainer_send_weights(packed=True)`. Both build a StatelessProcessGroup hosted by this process (rank 0) and a
    PyNcclCommunicator over it."""
    from packaging.version import InvalidVersion, Version

    vllm = _vllm()
    try:
        stateful = Version(_vllm_version(vllm)) >= Version("0.28.0")
    except InvalidVersion:
        stateful = True
    if stateful:
        from vllm.distributed.weight_transfer import nccl_common
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        def send(group, named):
            packed_nccl_broadcast_producer(iterator=named, group=group, src=0, post_iter_func=lambda item: item[1])

        return WeightTransfer(nccl_common.trainer_init, send, packed_in_init=True,
                              cpu=getattr(nccl_common, "CPU_WEIGHT_TRANSFER", False))
    from vllm.distributed.weight_transfer import nccl_engine
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerSendWeightsArgs, NCCLWeightTransferEngine

    def send_static(group, named):
        NCCLWeightTransferEngine.trainer_send_weights(
            iterator=named, trainer_args=NCCLTrainerSendWeightsArgs(group=group, packed=True))

    return WeightTransfer(NCCLWeightTransferEngine.trainer_init, send_static, packed_in_init=False,
                          cpu=getattr(nccl_engine, "CPU_WEIGHT_TRANSFER", False))
