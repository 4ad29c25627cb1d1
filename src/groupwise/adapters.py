"""LoRA through PEFT: the one place groupwise talks to peft.

- `GRPOTrainer(..., peft_config=LoraConfig(...))` (TRL's argument) or, in a config, TRL's `use_peft` with `lora_r`,
  `lora_alpha`, `lora_dropout`, `lora_target_modules`, … wrap the policy with `peft.get_peft_model`; a model that
  is already a PeftModel is trained as it is. Only the adapter's parameters train.
- The reference policy of the KL term (β > 0) is the same model with its adapters disabled: no copy of the weights
  (`Reference`). A full fine-tune's reference is a frozen copy.
- Checkpoints hold the adapter (`adapter_model.safetensors`, loadable with `PeftModel.from_pretrained`) next to the
  optimizer, scheduler and RNG state; `export_merged` writes base + adapter merged, loadable with
  `AutoModelForCausalLM.from_pretrained`.

peft is optional (`pip install groupwise[peft]`); nothing here imports it unless adapters are asked for.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from groupwise.config_base import ConfigError

if TYPE_CHECKING:
    from groupwise.config import GRPOConfig

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def _peft():
    try:
        import peft
    except ImportError:
        raise ConfigError("LoRA (peft_config / use_peft) needs peft: `pip install groupwise[peft]`") from None
    return peft


def is_peft_model(model: Any) -> bool:
    """A PEFT-wrapped model (it can disable its adapters and has a base model)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


def peft_config_from_args(args: GRPOConfig):
    """TRL's ModelConfig LoRA fields (use_peft, lora_*) → a LoraConfig, as TRL's get_peft_config builds it."""
    if not args.use_peft:
        return None
    peft = _peft()
    kwargs = {"target_parameters": args.lora_target_parameters} if args.lora_target_parameters else {}
    return peft.LoraConfig(task_type=args.lora_task_type, r=args.lora_r, target_modules=args.lora_target_modules,
                           lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, bias="none",
                           use_rslora=args.use_rslora, use_dora=args.use_dora,
                           modules_to_save=args.lora_modules_to_save, **kwargs)


def wrap(model: torch.nn.Module, peft_config, *, gradient_checkpointing: bool) -> torch.nn.Module:
    """The policy with adapters: get_peft_model(model, peft_config). With gradient checkpointing the input
    embeddings' outputs must require grad, or a frozen base leaves the checkpointed blocks without gradients."""
    peft = _peft()
    if is_peft_model(model):
        raise ConfigError("the model is already a PeftModel: pass it without peft_config / use_peft (its adapters "
                          "train as they are)")
    wrapped = peft.get_peft_model(model, peft_config)
    if gradient_checkpointing:
        wrapped.enable_input_require_grads()
    return wrapped


class Reference:
    """π_ref of the KL term: `model` evaluated inside `context()`. For a PeftModel: the policy itself with its
    adapters disabled (no second copy of the weights); otherwise a frozen copy of the initial policy."""

    def __init__(self, model: torch.nn.Module, adapters_off: bool):
        self.model, self.adapters_off = model, adapters_off

    @classmethod
    def of(cls, policy: torch.nn.Module, device) -> Reference:
        if is_peft_model(policy):
            return cls(policy, adapters_off=True)
        return cls(copy.deepcopy(policy).eval().requires_grad_(False).to(device), adapters_off=False)

    def context(self):
        return self.model.disable_adapter() if self.adapters_off else contextlib.nullcontext()

    @property
    def copy(self) -> torch.nn.Module | None:
        """The separate reference model (TR-DPO moves it, checkpoints save it), or None when adapters are off."""
        return None if self.adapters_off else self.model

    @torch.no_grad()
    def mix(self, policy: torch.nn.Module, alpha: float) -> None:
        """TR-DPO (Gorbatovski et al. 2024), TRL's sync_ref_model: ref ← α·policy + (1−α)·ref, parameter by
        parameter (`policy`: the trained weights in full precision)."""
        for ref_p, p in zip(self.copy.parameters(), policy.parameters()):
            ref_p.mul_(1 - alpha).add_(p.detach().to(ref_p.dtype), alpha=alpha)


def load_adapter(model: torch.nn.Module, folder: Path, source: str) -> None:
    """Load a checkpoint's adapter weights into a PeftModel (exactly: every adapter tensor, nothing else)."""
    from safetensors.torch import load_file

    from groupwise.checkpoint import CheckpointError

    path = folder / ADAPTER_WEIGHTS
    if not path.exists():
        raise CheckpointError(f"{source} holds no {ADAPTER_WEIGHTS}: it was not saved from a LoRA run; resume it "
                              "without peft_config / use_peft")
    result = _peft().set_peft_model_state_dict(model, load_file(str(path)))
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    missing = [k for k in getattr(result, "missing_keys", []) or [] if "lora_" in k or "modules_to_save" in k]
    if unexpected or missing:
        raise CheckpointError(f"{source}: the adapter does not match the model (missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]}): resume with the same LoRA configuration")


def export_merged(checkpoint: str, out: str, base: str | None = None, trust_remote_code: bool = False) -> str:
    """Base model + the checkpoint's adapter, merged (merge_and_unload), saved to `out` with the tokenizer.
    `base` defaults to the adapter's base_model_name_or_path. A full fine-tune checkpoint is copied as a model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from groupwise.config_base import check_location

    folder = Path(checkpoint)
    if not folder.is_dir():
        raise ConfigError(f"export: {checkpoint!r} is not a checkpoint folder")
    if (folder / ADAPTER_CONFIG).exists():
        peft = _peft()
        config = peft.PeftConfig.from_pretrained(str(folder))
        base = base or config.base_model_name_or_path
        if not base:
            raise ConfigError(f"export: {checkpoint} does not name its base model (the policy was built in memory): "
                              "give it with --base PATH")
        check_location(base, "--base")
        model = AutoModelForCausalLM.from_pretrained(base, trust_remote_code=trust_remote_code)
        model = peft.PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code).save_pretrained(out)
    return out
