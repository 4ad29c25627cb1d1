"""LoRA through PEFT: the one place groupwise talks to peft.

- `GRPOTrainer(..., peft_config=LoraConfig(...))` (TRL's argument) or, in a config, TRL's `use_peft` with `lora_r`,
  `lora_alpha`, `lora_dropout`, `lora_target_modules`, … wrap the policy with `peft.get_peft_model`; a model that
  is already a PeftModel is trained as it is. Only the adapter's parameters train.
- The reference policy of the KL term (β > 0) is the initial policy (DeepSeekMath Alg. 1: π_ref ← π_θ before the
  updates), with no copy of the base weights (`Reference`): adapters that groupwise created are disabled (they
  start at zero: the base model is the initial policy, as in TRL); a PeftModel passed in (an adapter trained
  before, e.g. by SFT) has its initial adapter tensors put back for the reference pass (TRL's frozen "ref" copy of
  the adapter). A full fine-tune's reference is a frozen copy.
- `merged` hands a sampler the merged weights and restores the frozen base bit for bit; `check_passed_model` refuses
  a passed-in model whose adapters cannot train or resume here.
- Checkpoints hold the adapter (`adapter_model.safetensors`, loadable with `PeftModel.from_pretrained`) next to the
  optimizer, scheduler and RNG state; `groupwise.export.export_merged` writes base + adapter merged, loadable with
  `AutoModelForCausalLM.from_pretrained`.

peft is optional (`pip install groupwise[peft]`); nothing here imports it unless adapters are asked for.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import warnings
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from groupwise.config_base import ConfigError
from groupwise.quantization import gguf_base

if TYPE_CHECKING:
    from groupwise.config import GRPOConfig

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_CREATED: weakref.WeakSet = weakref.WeakSet()  # PeftModels whose adapters `wrap` created (fresh: the base is π_ref)


def _peft():
    try:
        import peft
    except ImportError:
        raise ConfigError("LoRA (peft_config / use_peft) needs peft: `pip install groupwise[peft]`") from None
    return peft


def is_peft_model(model: Any) -> bool:
    """A PEFT-wrapped model (it can disable its adapters and has a base model)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


_PLAIN_NAME = re.compile(r"[\w.]+")  # a module name (or dotted suffix), not 'all-linear' or a regular expression


def peft_config_from_args(args: GRPOConfig):
    """TRL's ModelConfig LoRA fields (use_peft, lora_*) → a LoraConfig, as TRL's get_peft_config builds it."""
    if not args.use_peft:
        return None
    peft = _peft()
    kwargs = {"target_parameters": args.lora_target_parameters} if args.lora_target_parameters else {}
    dropout = args.lora_dropout
    if args.lora_target_parameters and dropout:  # PEFT's ParamWrapper takes no dropout (get_peft_model refuses it)
        if not args.disable_dropout:
            raise ConfigError(f"lora_target_parameters with lora_dropout={dropout}: PEFT adapts parameters without "
                              "dropout; set lora_dropout: 0")
        dropout = 0.0  # disable_dropout sets every dropout to 0 once the adapters are in, this one too
    targets = args.lora_target_modules
    if isinstance(targets, (list, tuple)) and len(targets) == 1 and not _PLAIN_NAME.fullmatch(str(targets[0])):
        # TRL's ModelConfig reads a list of one as that string: 'all-linear' (peft reads the shortcut from a string
        # only) or a regular expression matched against full module names; a plain name ([q_proj], which as a
        # regular expression TRL matches against nothing) stays a name
        targets = targets[0]
    return peft.LoraConfig(task_type=args.lora_task_type, r=args.lora_r, target_modules=targets,
                           lora_alpha=args.lora_alpha, lora_dropout=dropout, bias="none",
                           use_rslora=args.use_rslora, use_dora=args.use_dora,
                           modules_to_save=args.lora_modules_to_save, **kwargs)


def wrap(model: torch.nn.Module, peft_config, *, gradient_checkpointing: bool) -> torch.nn.Module:
    """The policy with adapters: get_peft_model(model, peft_config). With gradient checkpointing the input
    embeddings' outputs must require grad, or a frozen base leaves the checkpointed blocks without gradients."""
    peft = _peft()
    if is_peft_model(model):
        raise ConfigError("the model is already a PeftModel: pass it without peft_config / use_peft (its adapters "
                          "train as they are)")
    if not isinstance(peft_config, peft.PeftConfig):  # TRL's check (a dict from a config file, say)
        raise TypeError(f"peft_config must be a peft.PeftConfig (e.g. peft.LoraConfig), got "
                        f"{type(peft_config).__name__}; in a config file use use_peft with the lora_* fields")
    _refuse_prompt_learning(peft_config, "peft_config")
    try:
        wrapped = peft.get_peft_model(model, peft_config)
    except ValueError as e:
        if "not found in the base model" not in str(e):  # PEFT's other refusals of the config: one line
            raise ConfigError(f"PEFT cannot apply this LoRA config (peft_config, or use_peft's lora_* fields): "
                              f"{' '.join(str(e).split())[:300]}") from None
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ConfigError(f"LoRA target modules {getattr(peft_config, 'target_modules', None)!r} match no module of "
                          f"{type(model).__name__}: set lora_target_modules (LoraConfig.target_modules) to a list of "
                          f"its module names, e.g. {names[:8]}, or 'all-linear' (a plain string is a regular "
                          "expression matched against full module names)") from None
    targets = getattr(peft_config, "target_modules", None)
    if isinstance(targets, (list, tuple, set)):  # PEFT adapts the names that match and passes over the others
        names = [n for n, _ in model.named_modules()]
        unmatched = sorted(t for t in targets if not any(n == t or n.endswith("." + t) for n in names))
        if unmatched:
            warnings.warn(f"LoRA target modules {unmatched} match no module of {type(model).__name__}: they get no "
                          "adapter (the other targets do); check their spelling in lora_target_modules "
                          "(LoraConfig.target_modules)", UserWarning, stacklevel=3)
    if gradient_checkpointing:
        wrapped.enable_input_require_grads()
    _CREATED.add(wrapped)
    return wrapped


def _refuse_prompt_learning(config, what: str) -> None:
    """Prompt-learning methods (prompt / prefix / p-tuning) live in PeftModel.forward, which adds virtual tokens; the
    log-prob pass (modeling.PolicyForLogps) runs the decoder itself, so they would get no gradient."""
    if getattr(config, "is_prompt_learning", False):
        raise ConfigError(f"{what} is a {type(config).__name__}, a prompt-learning method (virtual tokens added by "
                          "PeftModel.forward), which groupwise's log-prob pass does not run: use an adapter inside "
                          "the layers (LoraConfig / use_peft, IA3Config, LoHaConfig, …)")


def check_passed_model(model: torch.nn.Module) -> None:
    """A model object passed to the trainer, before anything is built around it. Adapters that transformers added
    (model.add_adapter / load_adapter) make save_pretrained write the adapter only, which a full fine-tune's resume
    cannot read: refused. A PeftModel must be trainable here: not a prompt-learning method
    (`_refuse_prompt_learning`), and with adapter tensors to train (PeftModel.from_pretrained loads an adapter
    frozen unless is_trainable=True, and the optimizer would then get no parameters)."""
    if getattr(model, "_hf_peft_config_loaded", False) and not is_peft_model(model):
        raise ConfigError("the model carries adapters added by transformers (model.add_adapter / load_adapter), "
                          "which groupwise does not checkpoint or resume: pass the model without them and "
                          "peft_config=LoraConfig(…), or wrap it with peft.get_peft_model")
    if not is_peft_model(model):
        return
    for config in model.peft_config.values():
        _refuse_prompt_learning(config, "the PeftModel's adapter")
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError("the PeftModel has no trainable parameters (PeftModel.from_pretrained loads an adapter for "
                          "inference): load it with PeftModel.from_pretrained(base, path, is_trainable=True)")


@contextlib.contextmanager
def merged(model: torch.nn.Module):
    """A PeftModel with its adapters merged into the base weights for the block (weights handed to a sampler that
    serves the base architecture), the base weights restored exactly afterwards: peft's unmerge subtracts the
    update again, and (W + ΔW) − ΔW ≠ W in floating point, so merging at every weight sync would move the frozen
    base (π_ref with adapters off, and what a resume reloads) a little at every optimizer step. Costs one copy of
    the adapted base layers' weights while the block runs. Other models pass through unchanged."""
    if not is_peft_model(model):
        yield model
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    saved = [(p, p.detach().clone()) for m in model.modules() if isinstance(m, BaseTunerLayer)
             for p in m.get_base_layer().parameters(recurse=False)]
    model.merge_adapter()
    try:
        yield model
    finally:
        model.unmerge_adapter()
        with torch.no_grad():
            for p, original in saved:
                p.copy_(original)


def _wait_for_device() -> None:
    """Let the GPU finish its queued copies: with CPU offload FSDP2 copies the shards from pinned host memory
    asynchronously, so writing into them from the host must wait for those reads."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def adapted_tied_embeddings(model) -> str | None:
    """A PeftModel over a model whose input embeddings and output head are one tensor, with an adapter on either:
    "input embeddings" or "output head", else None. Such a policy trains and samples correctly as a PeftModel, but
    merged (vLLM's weights, `export --merge`) the one tensor cannot hold both: the pushed embeddings carry the
    head's update, or vLLM (which skips lm_head.* for tied models) samples with the embeddings as its head; LoRA on
    both, tied by ensure_weight_tying, merges its update into the shared tensor twice. Only modules_to_save copies
    that ensure_weight_tying keeps one tensor pass (None)."""
    if not is_peft_model(model):
        return None
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    def plain(module):  # the module PEFT wrapped, or the module itself
        if isinstance(module, ModulesToSaveWrapper):
            return module.original_module
        return module.get_base_layer() if isinstance(module, BaseTunerLayer) else module

    base = model.get_base_model()
    embed, head = base.get_input_embeddings(), base.get_output_embeddings()
    if embed is None or head is None or plain(embed).weight is not plain(head).weight:
        return None  # not tied (whatever the config says)
    copies_tied = any(getattr(c, "ensure_weight_tying", False) for c in model.peft_config.values())
    for where, module in (("input embeddings", embed), ("output head", head)):
        if isinstance(module, BaseTunerLayer) or (isinstance(module, ModulesToSaveWrapper) and not copies_tied):
            return where
    return None


def _starts_as_identity(model) -> bool:
    """Do the adapters start as the identity (LoRA's B = 0, IA3's ones, LoHa / LoKr's zero factor), so that the base
    model without them is the initial policy? Not for init_lora_weights=False (random B), the initialisations that
    rewrite the base weights (PiSSA, OLoRA, LoftQ, CorDA, EVA), or a method not known here: those take the initial
    tensors' swap, which is exact for any adapter."""
    for config in model.peft_config.values():
        if hasattr(config, "init_lora_weights"):  # LoRA and AdaLoRA: B = 0 for True / "gaussian"
            identity = config.init_lora_weights in (True, "gaussian")
        elif hasattr(config, "init_ia3_weights"):
            identity = config.init_ia3_weights is True
        elif str(getattr(config, "peft_type", "")).split(".")[-1] in ("LOHA", "LOKR"):
            identity = getattr(config, "init_weights", None) is True
        else:
            identity = False
        if not identity:
            return False
    return True


class Reference:
    """π_ref of the KL term, the initial policy: `model` evaluated inside `context()`. For a PeftModel: the policy
    itself (no second copy of the base weights), with the adapters groupwise created disabled, or with the initial
    values of a passed-in adapter's trainable tensors (`initial`) put back for the block; otherwise a frozen copy."""

    def __init__(self, model: torch.nn.Module, adapters_off: bool, initial: dict[str, torch.Tensor] | None = None):
        self.model, self.adapters_off, self.initial = model, adapters_off, initial
        self.root: torch.nn.Module | None = None  # set by shard(): the FSDP2 root whose forward gives log-probs

    def shard(self, dist, chunk_tokens: int) -> None:
        """FSDP2: shard the frozen copy as the policy is sharded (the same units and mixed precision), so that π_ref's
        forward has π_θ's numerics (at step 0 they are equal, KL 0) and each process holds 1 / world of it."""
        from groupwise.modeling import PolicyForLogps

        self.root = dist.fully_shard(PolicyForLogps(self.model, chunk_tokens), self.model, frozen=True)

    def use_sharded(self, root: torch.nn.Module) -> None:
        """FSDP2 with adapters: π_ref is the sharded policy `root` itself. A passed-in adapter's initial tensors are
        taken again as this process's shards of them (the parameters now are; nothing trained since `of`)."""
        self.root = root
        if self.initial is not None:
            self.initial = {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    @property
    def logps_model(self) -> torch.nn.Module:
        """What computes π_ref's log-probs (groupwise.modeling.batched_logps)."""
        return self.root if self.root is not None else self.model

    @classmethod
    def of(cls, policy: torch.nn.Module, device) -> Reference:
        if is_peft_model(policy):
            if policy in _CREATED and _starts_as_identity(policy):  # fresh (LoRA's B = 0): the base is π_θ0
                return cls(policy, adapters_off=True)
            # an adapter trained before (TRL keeps a frozen "ref" copy of it): its initial tensors, as they are now
            return cls(policy, adapters_off=True, initial={n: p.detach().clone() for n, p in
                                                           policy.named_parameters() if p.requires_grad})
        return cls(copy.deepcopy(policy).eval().requires_grad_(False).to(device), adapters_off=False)

    def context(self):
        if not self.adapters_off:
            return contextlib.nullcontext()
        return self._initial_adapter() if self.initial is not None else self._adapters_disabled()

    @contextlib.contextmanager
    def _adapters_disabled(self):
        """PEFT's disable_adapter(), which turns requires_grad off and back on for the parameter objects the adapter
        layers hold at that moment. Sharded (FSDP2), every unit is resharded on entry and before the exit, so both
        see the sharded parameters: a unit left gathered by the no-grad reference pass (shard_grad_op keeps them
        until a backward) would have its gathered copies turned back on and its shards left frozen, and the adapters
        would silently stop training. Sharded, FSDP2 is initialised first, with the adapters trainable (see
        sharding.initialize)."""
        if self.root is not None:
            from groupwise.sharding import initialize

            initialize(self.root)
        self._reshard()
        with self.model.disable_adapter():
            try:
                yield
            finally:
                self._reshard()

    def _reshard(self) -> None:
        """Sharded (FSDP2): every unit freed to this process's shards, the device done with the gathers."""
        from groupwise.sharding import reshard

        if self.root is not None:
            reshard(self.root)
            _wait_for_device()

    @contextlib.contextmanager
    def _initial_adapter(self):
        """The passed-in adapter's initial tensors in place of the trained ones for the block, then the trained
        ones back, bit for bit (no_grad: the reference pass builds no graph). Sharded (FSDP2), the swap is of this
        process's shards, with every unit resharded before and after: a unit left gathered (shard_grad_op keeps
        them until a backward) would otherwise run the reference with the trained values, and then π_θ with the
        initial ones."""
        self._reshard()
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            trained = {n: params[n].detach().clone() for n in self.initial}
            for n, t in self.initial.items():
                params[n].copy_(t)
        try:
            yield
        finally:
            self._reshard()
            with torch.no_grad():
                for n, t in trained.items():
                    params[n].copy_(t)

    @property
    def copy(self) -> torch.nn.Module | None:
        """The separate reference model (TR-DPO moves it, checkpoints save it), or None when adapters are off."""
        return None if self.adapters_off else self.model

    @torch.no_grad()
    def mix(self, policy: torch.nn.Module, alpha: float) -> None:
        """TR-DPO (Gorbatovski et al. 2024), TRL's sync_ref_model: ref ← α·policy + (1−α)·ref, parameter by
        parameter (`policy`: the trained weights in full precision; sharded alike when the copy is sharded, so each
        process mixes its own shards)."""
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
    _check_adapter_config(model, folder, source)
    try:
        result = _peft().set_peft_model_state_dict(model, load_file(str(path)))
    except RuntimeError as e:  # shapes differ: torch lists every tensor, one line is enough
        first = next((x.strip() for x in str(e).splitlines() if "size mismatch" in x), str(e).splitlines()[0])
        raise CheckpointError(f"{source}: the adapter does not match the model ({first}): resume with the same "
                              "LoRA configuration") from None
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    missing = [k for k in getattr(result, "missing_keys", []) or [] if "lora_" in k or "modules_to_save" in k]
    if unexpected or missing:
        raise CheckpointError(f"{source}: the adapter does not match the model (missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]}): resume with the same LoRA configuration")


# adapter_config.json fields that change what the adapter computes: a resume must keep them (lora_dropout is
# not one: disable_dropout zeroes it, and the run's own settings decide that)
RESUME_ADAPTER_FIELDS = ("peft_type", "r", "lora_alpha", "use_rslora", "use_dora", "target_modules",
                         "target_parameters", "modules_to_save", "bias", "lora_bias", "fan_in_fan_out", "rank_pattern",
                         "alpha_pattern", "layers_to_transform", "exclude_modules", "init_lora_weights")


def _check_adapter_config(model: torch.nn.Module, folder: Path, source: str) -> None:
    """The saved adapter's configuration against the model's: equal shapes do not mean an equal adapter (a
    different lora_alpha or use_rslora scales it differently, and the run would go on silently changed)."""
    import json

    from groupwise.checkpoint import CheckpointError

    def norm(v):
        return sorted(map(str, v)) if isinstance(v, (list, tuple, set, frozenset)) else v

    path = folder / ADAPTER_CONFIG
    if not path.exists():
        raise CheckpointError(f"{source} holds no {ADAPTER_CONFIG}: resume from a checkpoint of a LoRA run")
    saved, current = json.loads(path.read_text()), model.peft_config["default"].to_dict()
    for key in RESUME_ADAPTER_FIELDS:
        if key in saved and key in current and norm(saved[key]) != norm(current[key]):
            raise CheckpointError(f"resume: the adapter's {key} is {saved[key]!r} in {source} but {current[key]!r} "
                                  "now; resume with the same LoRA configuration (peft_config / lora_* fields)")


def load_adapter_checkpoint(folder: str, args, quantization_config=None):
    """An adapter folder (a LoRA run's checkpoint-N or output_dir) as the policy `groupwise eval` evaluates: a
    PeftModel over its base (adapter_config.json's base_model_name_or_path, loaded as a policy path is: the run's
    dtype, trust_remote_code and quantization_config) and the folder's tokenizer."""
    from transformers import AutoModelForCausalLM

    from groupwise.config_base import check_model_location
    from groupwise.loading import policy_init_kwargs

    peft = _peft()
    base = peft.PeftConfig.from_pretrained(folder).base_model_name_or_path
    if not base:
        raise ConfigError(f"model_name_or_path={folder!r} is an adapter that does not name its base model (the policy "
                          f"was built in memory): merge it first with `groupwise export {folder} --merge OUT --base "
                          "BASE` and evaluate OUT")
    fix = f"merge it with `groupwise export {folder} --merge OUT --base BASE` and evaluate OUT"
    try:
        check_model_location(base, f"{folder}'s base_model_name_or_path", policy=True)
    except ConfigError as e:
        raise ConfigError(f"{e}; {fix}") from None
    kwargs = policy_init_kwargs(args)
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    if "gguf_file" not in kwargs:  # a base read from a GGUF file, named by the folder that holds it
        base, gguf = gguf_base(base)
        kwargs.update(gguf)
    check_base(base, folder, {k: v for k, v in kwargs.items() if k in ("trust_remote_code", "gguf_file")}, fix)
    tokenizer = saved_tokenizer([(folder, {}), (base, {k: v for k, v in kwargs.items() if k == "gguf_file"})],
                                kwargs["trust_remote_code"], f"model_name_or_path={folder!r}")
    model = AutoModelForCausalLM.from_pretrained(base, **kwargs)
    model = peft.PeftModel.from_pretrained(model, folder, is_trainable=True)  # as trained: the trainer's checks hold
    return model, tokenizer


def saved_tokenizer(sources: list[tuple[Any, dict]], trust_remote_code: bool, what: str):
    """The first of `sources` ((folder or id, from_pretrained kwargs)) holding a tokenizer: an adapter's folder,
    then its base model's (PEFT's save_pretrained writes no tokenizer; groupwise writes one into every checkpoint);
    none: one line naming them, before any weights load."""
    from transformers import AutoTokenizer

    from groupwise.model_files import holds_tokenizer

    for source, kwargs in sources:
        folder = os.path.expanduser(str(source))
        files = os.path.isdir(folder) and holds_tokenizer(set(os.listdir(folder)))
        try:
            return AutoTokenizer.from_pretrained(str(source), trust_remote_code=trust_remote_code, **kwargs)
        except (OSError, ValueError, TypeError, KeyError) as e:
            if files:  # a tokenizer that fails to load is not a missing one: the base's may differ (added tokens)
                raise ConfigError(f"{what}: the tokenizer in {str(source)!r} does not load ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}): save it again there "
                                  "(tokenizer.save_pretrained(folder))") from None
    names = " nor ".join(repr(str(source)) for source, _ in sources)
    where = f"neither {names} holds a tokenizer" if len(sources) > 1 else f"{names} holds no tokenizer"
    raise ConfigError(f"{what}: {where}: save one into {str(sources[0][0])!r} (tokenizer.save_pretrained(folder))")


def check_base(base: str, folder: str, kwargs: dict, fix: str, given: bool = False) -> None:
    """The base model an adapter names loads (its config, before any weights), else one line naming the adapter,
    the base and `fix`: a relative path is read from the current folder, not from where the run trained. `given`:
    the base is the user's (--base), not the one the adapter names."""
    from transformers import AutoConfig

    from groupwise.loading import from_pretrained_or_error

    try:
        from_pretrained_or_error(AutoConfig, base, "config", **kwargs)
    except ConfigError as e:
        if given:
            raise ConfigError(f"--base {base!r} does not load ({e}): {fix}") from None
        where = "" if os.path.isabs(base) else (" (if it is a folder's relative path, it is read from the current "
                                                "folder, not from the one the run trained in)")
        raise ConfigError(f"{folder}'s adapter's base model {base!r}{where} does not load ({e}): {fix}") from None
