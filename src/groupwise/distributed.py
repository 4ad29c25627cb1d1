"""The only module that talks to accelerate / torch.distributed.

CPU multi-process runs: `ACCELERATE_USE_CPU=1 python -m torch.distributed.run --nproc_per_node 2 -m groupwise train …`
(`accelerate launch --cpu` starts one process only). The process group is destroyed at exit: gloo runs that skip
it abort intermittently. Every collective is bounded by `ddp_timeout` seconds (TRL / transformers' name), so a
process that dies makes the others fail within that time instead of waiting forever; user code that may raise on
one process only (reward functions) runs under `run_together`, so every process stops with that process's message.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import os
import sys
import threading
import traceback
import types
import warnings
from collections.abc import Callable

import torch
import torch.distributed as torch_dist
from accelerate import Accelerator

from groupwise.config_base import ConfigError


PRECISIONS = ("no", "bf16", "fp16")  # what groupwise trains in; accelerate's fp8 is not among them


def launch_precision(bf16: bool = False, fp16: bool = False) -> str:
    """The run's mixed precision: 'bf16' or 'fp16' by the fields, or else an `accelerate launch` config's
    mixed_precision (ACCELERATE_MIXED_PRECISION), as transformers' TrainingArguments reads them; else 'no'."""
    if bf16 or fp16:
        return "bf16" if bf16 else "fp16"
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    return precision if precision in PRECISIONS else "no"


def check_launch(bf16: bool, fp16: bool = False) -> None:
    """What an `accelerate launch` exports that groupwise does not apply, refused by name before anything starts:
    mixed_precision other than no / bf16 / fp16 (fp8) unless a field overrides it, and a dynamo_backend (accelerate
    would compile the whole model in `prepare`, under DDP only; groupwise compiles with its torch_compile field)."""
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if not (bf16 or fp16) and precision not in PRECISIONS:
        raise ConfigError(f"the accelerate config sets mixed_precision: {precision}, which groupwise does not support: "
                          "set mixed_precision: bf16, fp16 or no in the accelerate config file (or --mixed_precision "
                          "bf16), or bf16: true / fp16: true in the groupwise config")
    dynamo = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no")
    if dynamo.lower() != "no":
        raise ConfigError(f"the accelerate config sets dynamo_backend: {dynamo}, which groupwise does not apply: set "
                          "dynamo_backend: no in the accelerate config file and torch_compile: true "
                          f"(torch_compile_backend: {dynamo.lower()}) in the groupwise config")


def check_process_count(accelerator) -> None:
    """The launcher's process count (WORLD_SIZE: torchrun, accelerate launch) is accelerate's. On a machine without
    GPUs, accelerate takes a launch without ACCELERATE_USE_CPU=1 for one process each: each would train alone into
    the same output_dir (and a sharded one would wait forever on the others)."""
    launched = int(os.environ.get("WORLD_SIZE") or 1)
    if launched != accelerator.num_processes:
        hint = ("; on CPUs set ACCELERATE_USE_CPU=1 in the launch's environment (`ACCELERATE_USE_CPU=1 torchrun …` "
                "or `ACCELERATE_USE_CPU=1 accelerate launch …`: --cpu and use_cpu: true do not give it to the "
                "processes)") if accelerator.device.type == "cpu" else ""
        raise ConfigError(f"the launcher started {launched} processes (WORLD_SIZE={launched}) but accelerate sees "
                          f"{accelerator.num_processes}{hint}")


def _under(context, fn):
    """`fn` run inside a fresh `context()` at every call."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with context():
            return fn(*args, **kwargs)
    return run


def exact_dtype(device) -> torch.dtype:
    """The dtype for sums that must not lose precision across processes (metric sums and counts): float64, or
    float32 on MPS, which has no float64."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


def empty_cache(device: torch.device) -> None:
    """torch_empty_cache_steps: give cached accelerator memory back (nothing to do on CPU)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "mps":
        torch.mps.empty_cache()


class ProcessFailed(RuntimeError):
    """Another process raised in a `run_together` block (or, sharing a tensor-parallel vLLM engine, in a block of
    generation.independently()); the message is that process's."""


class CollectiveTimeout(ProcessFailed):
    """A collective waited ddp_timeout for a process that never joined it (Distributed.naming_stuck_collectives)."""


# what the backends' own errors say when a collective outlives the process group's timeout
_TIMED_OUT = ("Timed out waiting", "Application timeout caused pair closure",  # gloo
              "Watchdog caught collective operation timeout")  # NCCL
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer")  # gloo: another process exited

def phase_of(phases: dict[str, str], names: list[str]) -> str:
    """Where the run is, from its call stack's function names (outermost first) read through `phases`
    (GRPOTrainer.PHASES): 'a round › scoring the completions (reward functions)'; '' when none is named."""
    return " › ".join(dict.fromkeys(phases[n] for n in names if n in phases))


_FAILED = False  # this process is leaving on an error of its own: its exit does not wait for the others (teardown)


def shared(exc: BaseException) -> BaseException:
    """Tag `exc` as raised on every process together (a run_together failure, an agreed stop, a check every process
    makes alike): a process leaving on it still waits for the others at exit, so that the main process finishes
    closing its trackers and uploads before the launcher, seeing a process exit, stops the rest."""
    with contextlib.suppress(AttributeError):
        exc.groupwise_shared = True
    return exc


def mark_failed(exc: BaseException | None = None) -> None:
    """Record that this process leaves on an error of its own (`exc` not `shared`): teardown then skips its
    barrier. The CLI calls it on its error exits; an exception reaching the interpreter is read at exit."""
    global _FAILED
    if exc is None or not getattr(exc, "groupwise_shared", False):
        _FAILED = True


def _leaving_alone(at_exit: bool) -> bool:
    """Whether this process leaves on an error of its own: marked, or at interpreter exit an uncaught exception
    (sys.last_value, which the interpreter sets whatever sys.excepthook is) that is not `shared`."""
    if _FAILED or not at_exit:
        return _FAILED
    last = _last_error()
    return last is not None and last is not _STALE and not getattr(last, "groupwise_shared", False)


def _last_error() -> BaseException | None:
    return getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)


_STALE: BaseException | None = None  # the error sys.last_value held when the process group was set up (pytest
# and IPython set it for errors they handled: not this process's exit)


class Distributed:
    def __init__(self, bf16: bool = False, timeout: float = 1800.0, backend: str | None = None,
                 ddp_kwargs: dict | None = None, sharding=None, fp16: bool = False):
        """`backend`: torch.distributed's (None: nccl on GPUs, gloo on CPU); `ddp_kwargs`: DistributedDataParallel
        arguments (find_unused_parameters, bucket_cap_mb, broadcast_buffers, static_graph), None values left out.
        bf16: accelerate's autocast. fp16: groupwise's own float16 autocast around the prepared model's forward and a
        dynamic loss scale (torch.amp.GradScaler), the same on every device (accelerate's applies on GPUs only)."""
        if bf16 and fp16:
            raise ConfigError("bf16 and fp16 are both set: choose one mixed precision")
        from accelerate.utils import DistributedDataParallelKwargs, GradientAccumulationPlugin, InitProcessGroupKwargs

        check_launch(bf16, fp16)
        self.precision = launch_precision(bf16, fp16)
        self.timeout = timeout
        from groupwise.sharding import process_group_backend

        backend = process_group_backend(backend, sharding, torch.cuda.is_available())
        handlers = [InitProcessGroupKwargs(backend=backend, timeout=datetime.timedelta(seconds=timeout))]
        ddp = {k: v for k, v in (ddp_kwargs or {}).items() if v is not None}
        if ddp:
            handlers.append(DistributedDataParallelKwargs(**ddp))
        # bf16 False leaves accelerate's own setting (an `accelerate launch` config's mixed_precision) in charge.
        # accelerate keeps one mixed-precision setting per process and refuses another ("restart your runtime"), or
        # keeps an earlier trainer's bf16 when this one asks for nothing: its state is reset first, as transformers'
        # TrainingArguments does (the process group, PartialState, stays)
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=False)
        # one micro-batch per accelerate "step": groupwise scales the loss for gradient_accumulation_steps itself, so
        # ACCELERATE_GRADIENT_ACCUMULATION_STEPS (set by hand, or by a DeepSpeed launch) must not divide it again;
        # transformers' Trainer ignores it likewise (it passes its own plugin)
        self.accelerator = Accelerator(mixed_precision="bf16" if self.precision == "bf16" else "no",
                                       kwargs_handlers=handlers,
                                       gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=1))
        check_process_count(self.accelerator)
        self.sharding = sharding  # groupwise.sharding.Sharding: FSDP2, applied by `shard` instead of `prepare`
        if sharding is not None and not (torch_dist.is_available() and torch_dist.is_initialized()):
            if sharding.offload:  # one process: FSDP2 over it alone, to keep the weights and state in host memory
                torch_dist.init_process_group(backend=backend or "gloo", store=torch_dist.HashStore(), rank=0,
                                              world_size=1, timeout=datetime.timedelta(seconds=timeout))
            else:
                self.sharding = None  # one process: nothing to shard (the run is the same without it)
                warnings.warn("fsdp is set but this run has one process: nothing to shard, so it trains unsharded "
                              "(launch with torchrun or accelerate and 2+ processes to shard; with 'offload' one "
                              "process keeps its weights in host memory)", UserWarning, stacklevel=2)
        # fp16: gradients of a loss multiplied by a scale that halves when they overflow and doubles after
        # growth_interval clean steps (transformers / accelerate's defaults). Under FSDP2 the gradients are shards
        # (DTensors): unscale_'s overflow check is reduced over the mesh by DTensor (max), so every process sees
        # an overflow in any shard and keeps the same scale
        self.scaler = torch.amp.GradScaler(self.device.type) if self.precision == "fp16" else None
        global _FAILED, _STALE
        _FAILED = False  # a process training again (a notebook, tests) after an error exit of the CLI's
        _STALE = _last_error()
        atexit.register(self.teardown, at_exit=True)

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def is_local_main(self) -> bool:
        """The first process of this node."""
        return self.accelerator.is_local_main_process

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def _autocast_forward(self, module: torch.nn.Module) -> None:
        """fp16: the module's forward under float16 autocast, as accelerate wraps a prepared model's."""
        if self.scaler is not None:
            module.forward = types.MethodType(_under(self.autocast, type(module).forward), module)

    def prepare(self, *objs):
        for obj in objs:
            if isinstance(obj, torch.nn.Module):
                self._autocast_forward(obj)
        return self.accelerator.prepare(*objs)

    def fully_shard(self, root: torch.nn.Module, model: torch.nn.Module, frozen: bool = False) -> torch.nn.Module:
        """FSDP2 over all processes (groupwise.sharding): `model`'s decoder layers, then `root`. fp16: float32
        shards gathered as they are, the trained forward under float16 autocast (π_ref's runs under
        `autocast()`), so the numerics are DDP's."""
        from groupwise.sharding import shard

        root = shard(root, model, self.sharding, self.device, bf16=self.accelerator.mixed_precision == "bf16",
                     frozen=frozen)
        if not frozen:
            self._autocast_forward(root)
        return root

    def autocast(self):
        """The training forward's precision around another forward (π_ref's): accelerate's autocast, or nothing
        under FSDP2, whose mixed-precision policy casts the gathered weights itself (the policy is not wrapped by
        accelerate there)."""
        if self.precision == "fp16":
            return torch.autocast(self.device.type, dtype=torch.float16)
        return contextlib.nullcontext() if self.sharding is not None else self.accelerator.autocast()

    def unwrap(self, model):
        return self.accelerator.unwrap_model(model)

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss if self.scaler is None else self.scaler.scale(loss))

    @property
    def loss_scale(self) -> float | None:
        """fp16: the factor the loss is multiplied by before the backward (None otherwise)."""
        return None if self.scaler is None else float(self.scaler.get_scale())

    def unscale(self, optimizer) -> None:
        """fp16: divide the accumulated gradients by the loss scale, before they are clipped or read."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def update_scale(self) -> None:
        """fp16, after every optimizer step, taken or skipped: halve the scale if the gradients overflowed, else
        count toward doubling it (GradScaler.update)."""
        if self.scaler is not None:
            self.scaler.update()

    def no_sync(self, model, skip_sync: bool):
        """Skip the gradient all-reduce (reduce-scatter when sharded) on micro-batches that are not the last of an
        accumulation window."""
        if self.sharding is not None:
            model.set_requires_gradient_sync(not skip_sync)
            return contextlib.nullcontext()
        return self.accelerator.no_sync(model) if skip_sync and self.world_size > 1 else contextlib.nullcontext()

    def clip_grad_norm(self, params, max_norm: float) -> torch.Tensor:
        if self.sharding is not None:
            from groupwise.sharding import total_grad_norm

            return total_grad_norm(params, max_norm)
        if max_norm and max_norm > 0:
            return self.accelerator.clip_grad_norm_(params, max_norm)
        grads = [p.grad.detach().float().norm() for p in params if p.grad is not None]
        return torch.stack(grads).norm() if grads else torch.tensor(0.0)

    def shard(self, rows):
        """This process's contiguous share of rows laid out over all processes (a list, or a tensor along dim 0):
        process r owns rows [r·n, (r+1)·n), n = len(rows) / world_size. The one place ranks are mapped to rows."""
        n = len(rows) // self.world_size
        if n * self.world_size != len(rows):
            raise ValueError(f"{len(rows)} rows cannot be split evenly over {self.world_size} processes")
        return rows[self.rank * n:(self.rank + 1) * n]

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate along dim 0 in rank order. Every rank must pass the same shape (unequal shapes hang)."""
        if self.world_size == 1:
            return t
        return self.accelerator.gather(t.to(self.device).contiguous())

    def gather_ragged(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate 1-D tensors of any length per process, in rank order (padded to the longest for the
        collective, the padding dropped)."""
        if self.world_size == 1:
            return t
        sizes = self.gather(torch.tensor([t.numel()], device=self.device)).tolist()
        padded = torch.nn.functional.pad(t.to(self.device), (0, max(sizes) - t.numel()))
        rows = self.gather(padded).view(self.world_size, max(sizes))
        return torch.cat([row[:n] for row, n in zip(rows, sizes)])

    def gather_object(self, obj: list) -> list:
        if self.world_size == 1:
            return list(obj)
        from accelerate.utils import gather_object

        return gather_object(list(obj))

    def subgroup(self, size: int):
        """This process's group of `size` consecutive processes ([0, size), [size, 2·size), …: TRL's vLLM
        tensor-parallel groups), bounded by ddp_timeout like every collective; every process calls it together."""
        if self.world_size % size:
            raise ValueError(f"groups of {size} processes cannot split {self.world_size} processes")
        group, _ = torch_dist.new_subgroups_by_enumeration(
            [list(range(start, start + size)) for start in range(0, self.world_size, size)],
            timeout=datetime.timedelta(seconds=self.timeout))
        return group

    def gather_object_in(self, group, obj) -> list:
        """Every process's `obj` in `group` (from `subgroup`), in rank order."""
        out = [None] * torch_dist.get_world_size(group)
        torch_dist.all_gather_object(out, obj, group=group)
        return out

    def broadcast_object(self, obj):
        """The main process's `obj` on every process (the others' arguments are ignored)."""
        if self.world_size == 1:
            return obj
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([obj], from_process=0)[0]

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return t
        t = t.to(self.device).clone()
        torch_dist.all_reduce(t, op=torch_dist.ReduceOp.SUM)
        return t

    def extreme(self, t: torch.Tensor, largest: bool) -> torch.Tensor:
        """Elementwise max (largest) or min over processes, NaN left out (NaN where every process has NaN)."""
        fill = float("-inf") if largest else float("inf")
        t = torch.nan_to_num(t.to(self.device).float(), nan=fill, posinf=float("inf"), neginf=float("-inf"))
        if self.world_size > 1:
            t = t.clone()
            torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX if largest else torch_dist.ReduceOp.MIN)
        return torch.where(t == fill, torch.full_like(t, float("nan")), t)

    def any(self, flag: bool) -> bool:
        return bool(self.sum(torch.tensor([float(flag)], device=self.device)).item() > 0)

    def run_together(self, fn, what: str):
        """fn() on every process; if it raises on any, it raises on all: the failing process re-raises its own
        exception, the others raise ProcessFailed with its message (instead of waiting in the next collective)."""
        try:
            result, failure = fn(), None
        except (Exception, SystemExit) as e:  # noqa: BLE001 — shared with the other processes, then re-raised (a
            result, failure = None, e  # reward function calling sys.exit left the others waiting in the gather)
        if self.world_size == 1:
            if failure is not None:
                raise failure
            return result
        messages = [m for m in self.gather_object([None if failure is None else f"{type(failure).__name__}: {failure}"])
                    if m is not None]
        if failure is not None:
            raise shared(failure)
        if messages:
            raise shared(ProcessFailed(f"{what} failed on another process: {messages[0]}"))
        return result

    @contextlib.contextmanager
    def naming_stuck_collectives(self, phases: dict[str, str], when: Callable[[list[str]], str]):
        """A collective waiting ddp_timeout for a process that never joins it ends in the backend's own error
        (gloo: "Timed out waiting 1800000ms for recv operation to complete"), which names neither the setting nor
        where the run was. Re-raised as CollectiveTimeout naming this process, `when` (the step, given the
        traceback's function names), the phase (the functions of the traceback named in `phases`, outermost first,
        else "a collective") and what to do. A peer that exited on an error (gloo: "Connection closed by peer") is
        named alike, as ProcessFailed."""
        try:
            yield
        except RuntimeError as e:
            timed_out, gone = (any(t in str(e) for t in texts) for texts in (_TIMED_OUT, _PEER_GONE))
            frames = [frame for frame, _ in traceback.walk_tb(e.__traceback__)]
            # the backend's own error: gloo / NCCL named in it, or raised by torch (a reward function's HTTP client
            # saying "Connection reset by peer" is not one, nor an error every process already shares)
            backend = any(b in str(e) for b in ("gloo", "NCCL")) or (
                frames and frames[-1].f_code.co_filename.startswith(os.path.dirname(torch.__file__) + os.sep))
            if self.world_size == 1 or isinstance(e, ProcessFailed) or getattr(e, "groupwise_shared", False) \
                    or not backend or not (timed_out or gone):
                raise
            names = [frame.f_code.co_name for frame in frames]
            phase = phase_of(phases, names) or "a collective"
            if gone:
                raise ProcessFailed(f"process {self.rank}: another process left during {phase} {when(names)} (its own "
                                    f"error, in its output, says why): {e}") from e
            raise CollectiveTimeout(
                f"process {self.rank} waited ddp_timeout={self.timeout:g} s for the other processes in {phase} "
                f"{when(names)}: one of them is stuck or much slower (a reward function, tool or environment call with no "
                "time limit: set reward_timeout; a data read that hangs); its output says where. If a step "
                "legitimately takes that long, raise ddp_timeout") from e

    def barrier(self) -> None:
        if self.world_size > 1:
            self.accelerator.wait_for_everyone()

    def teardown(self, at_exit: bool = False) -> None:
        """At exit (and Trainer.end()): wait for the other processes, then destroy the process group. A process
        leaving on an error of its own (_leaving_alone) does not wait: its peers may be in another collective, which
        a barrier would not end (gloo bounds monitored_barrier on rank 0 only: elsewhere it waited ddp_timeout,
        30 min, and the launcher, seeing no process exit, never stopped the others); its closed connections end
        their wait. Its group is destroyed from a thread it waits on 10 s at most: a collective of its own still in
        flight would hold the destruction until ddp_timeout. An error every process raised together (`shared`)
        waits as a normal exit does."""
        if not (torch_dist.is_available() and torch_dist.is_initialized()):
            return
        if _leaving_alone(at_exit):
            done = threading.Thread(target=torch_dist.destroy_process_group, daemon=True)
            done.start()
            done.join(10)
            return
        with contextlib.suppress(Exception):  # bounded: a peer that died cannot hold this process forever
            if torch_dist.get_backend() == "gloo":
                torch_dist.monitored_barrier(timeout=datetime.timedelta(seconds=min(self.timeout, 60)))
            else:
                torch_dist.barrier()
        torch_dist.destroy_process_group()
