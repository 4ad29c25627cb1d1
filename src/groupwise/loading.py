"""Everything a trainer needs from its inputs before training: checks that run before any model loads, the
tokenizer (and the model's positions) before the weights, the policy, its EOS ids."""

from __future__ import annotations

import importlib.util
import os
import warnings

import torch

from groupwise.config import GRPOConfig
from groupwise.adapters import check_passed_model, is_peft_model
from groupwise.config_base import ConfigError, check_model_location, warn_user
from groupwise.core.supervision import SUPERVISIONS
from groupwise.data import refuse_images
from groupwise.generation import unapplied_generation_config
from groupwise.modeling import Float32Head, disable_dropout
from groupwise.quantization import check_quantization, forget_gguf, gguf_base, gguf_quantizer
from groupwise.rewards.process import PROCESS_REWARD_KEYWORDS, check_prm_separator, resolve_process_spec
from groupwise.rewards.steps import SPLIT_MODES, TOOL_TEXT_STEPS
from groupwise.rewards.sources import check_reward_columns, resolve_spec
from groupwise.text import ensure_pad_token


# the dtypes a policy given as a path may load in (TRL's create_model_from_path), besides "auto" and None
MODEL_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def policy_init_kwargs(args: GRPOConfig) -> dict:
    """from_pretrained kwargs of a policy given as a path, as TRL builds them (create_model_from_path):
    model_init_kwargs (torch_dtype read as dtype), with dtype float32 unless given — TRL's default, where
    from_pretrained alone would keep the checkpoint's dtype ('auto') — and a dtype name as the torch dtype;
    trust_remote_code from the config unless given. A bad dtype is a ConfigError, before anything loads."""
    kwargs = dict(args.model_init_kwargs or {})
    if "torch_dtype" in kwargs:  # transformers' former name
        if "dtype" in kwargs and kwargs["dtype"] != kwargs["torch_dtype"]:
            raise ConfigError(f"model_init_kwargs has dtype={kwargs['dtype']!r} and torch_dtype="
                              f"{kwargs['torch_dtype']!r}: give one")
        kwargs["dtype"] = kwargs.pop("torch_dtype")
    dtype = kwargs.setdefault("dtype", "float32")
    if isinstance(dtype, str) and dtype in MODEL_DTYPES:
        kwargs["dtype"] = MODEL_DTYPES[dtype]
    elif not (dtype is None or dtype == "auto" or isinstance(dtype, torch.dtype)):
        raise ConfigError(f"model_init_kwargs dtype={dtype!r} is not one of {['auto', *MODEL_DTYPES]}")
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    return kwargs


def from_pretrained_or_error(auto, model: str, what: str, **kwargs):
    """auto.from_pretrained(model), its failure (no tokenizer files, an unknown architecture, no network) one
    ConfigError naming the model, before the weights load."""
    try:
        return auto.from_pretrained(model, **kwargs)
    except (OSError, ValueError) as e:
        fix = " (save it there with tokenizer.save_pretrained, or pass processing_class)" if what == "tokenizer" else ""
        if _not_cached_offline(e):
            fix = (" (not in the Hugging Face cache, and the hub cannot be reached: download it on a machine with "
                   "network, `hf download " + model + "`, or pass a local folder; set HF_HUB_OFFLINE=1 where there "
                   "is no network, so the hub's retries stop at once)")
        raise ConfigError(f"model {model!r}: cannot load its {what}{fix}: {type(e).__name__}: "
                          f"{' '.join(str(e).split())[:200]}") from e


def _not_cached_offline(e: BaseException) -> bool:
    """The hub could not be reached and the files are not in its cache (huggingface_hub's LocalEntryNotFoundError,
    which transformers re-raises as an OSError)."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, LocalEntryNotFoundError):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


# from_pretrained's own keywords (transformers 5), what a model_init_kwargs key most likely meant
FROM_PRETRAINED_WORDS = ("attn_implementation", "dtype", "device_map", "revision", "trust_remote_code", "gguf_file",
                         "quantization_config", "subfolder", "variant", "use_safetensors", "low_cpu_mem_usage",
                         "cache_dir", "local_files_only", "token", "max_memory", "offload_folder", "key_mapping")


def unknown_init_kwarg(error: TypeError, kwargs: dict) -> ConfigError | None:
    """transformers' TypeError for a model_init_kwargs key neither from_pretrained nor the model takes (a typo such
    as attn_impl), as a ConfigError naming the key and the nearest word; None for any other TypeError."""
    import difflib
    import re

    found = re.search(r"unexpected keyword argument '(\w+)'", str(error))
    if found is None or found.group(1) not in kwargs:
        return None
    key = found.group(1)
    near = [w for w in difflib.get_close_matches(key, FROM_PRETRAINED_WORDS, n=2, cutoff=0.6) if w != key][:1]
    return ConfigError(f"model_init_kwargs key {key!r} is taken neither by from_pretrained nor by the model "
                       f"({error}){f'; did you mean {near[0]!r}?' if near else ''}")


def load_tokenizer(model, processing_class, args: GRPOConfig):
    """The policy's tokenizer and its max positions (from the model's config), before the weights load."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, ProcessorMixin

    if isinstance(processing_class, ProcessorMixin):
        raise ConfigError(f"processing_class is a {type(processing_class).__name__}, a multimodal processor: groupwise "
                          "trains text-only causal language models (vision-language models are not supported yet); "
                          "pass its tokenizer (processing_class=processor.tokenizer) to train on text alone")
    if isinstance(model, str):
        # the config and tokenizer of the same revision, and of the same GGUF file (which holds both)
        same = {k: v for k, v in (args.model_init_kwargs or {}).items() if k in ("revision", "gguf_file") and v}
        hub = {"trust_remote_code": args.trust_remote_code, **same}
        config = from_pretrained_or_error(AutoConfig, model, "config", **hub)
        if type(config) not in AutoModelForCausalLM._model_mapping and \
                "AutoModelForCausalLM" not in (getattr(config, "auto_map", None) or {}):
            raise ConfigError(f"model {model!r} is a {type(config).__name__}, which AutoModelForCausalLM cannot load: "
                              "groupwise trains causal language models (vision-language models are not supported "
                              "yet); give a causal LM")
        tokenizer = processing_class or from_pretrained_or_error(AutoTokenizer, model, "tokenizer", **hub)
    else:
        config, tokenizer = model.config, processing_class
        if tokenizer is None:
            name = getattr(config, "_name_or_path", "")
            if not name:
                raise ConfigError("the model was passed as an object: pass its tokenizer as processing_class")
            # a model read from a GGUF file: its tokenizer is in that file too, named by the quantizer transformers
            # keeps, or (dequantized at load: no quantizer left) the one .gguf file of a folder without config.json
            gguf = getattr(getattr(gguf_quantizer(model), "quantization_config", None), "gguf_file", None)
            if gguf:
                found = {"gguf_file": gguf}
            else:
                try:
                    name, found = gguf_base(name)
                except ConfigError:  # several .gguf files: the folder's tokenizer files, if any, or the error below
                    found = {}
            tokenizer = from_pretrained_or_error(AutoTokenizer, name, "tokenizer",
                                                 trust_remote_code=args.trust_remote_code, **found)
    try:
        ensure_pad_token(tokenizer)
    except ValueError as e:  # neither a pad nor an EOS token: the run cannot batch prompts
        raise ConfigError(str(e)) from None
    router_aux_loss_coef(args, config)  # a coefficient for a dense model: refused before the weights load
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return tokenizer, getattr(text_config, "max_position_embeddings", None)


def router_aux_loss_coef(args: GRPOConfig, config) -> float:
    """The weight of a Mixture-of-Experts model's router load-balancing loss in the GRPO loss (TRL's rule):
    router_aux_loss_coef, or when unset the model config's own (0.0 when it declares none); 0.0 for a dense model,
    for which setting it is a ConfigError. A model is MoE when its config has `output_router_logits`."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    moe = hasattr(text, "output_router_logits")
    if args.router_aux_loss_coef is None:
        coef = float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0) if moe else 0.0
    elif args.router_aux_loss_coef and not moe:
        raise ConfigError(f"router_aux_loss_coef={args.router_aux_loss_coef} but {type(config).__name__} is not a "
                          "Mixture-of-Experts model that returns router logits: there is no auxiliary loss to weight; "
                          "remove router_aux_loss_coef")
    else:
        coef = float(args.router_aux_loss_coef)
    if coef and args.torch_compile:
        raise ConfigError(f"torch_compile with the router loss of {type(config).__name__} (router_aux_loss_coef="
                          f"{coef}) is not supported yet: set router_aux_loss_coef=0.0, or drop torch_compile")
    from groupwise.sharding import resolve

    # under FSDP2 the float32 head is a unit of its own, which the model's own forward (for aux_loss) would call too
    if coef and args.cast_lm_head_to_fp32 and resolve(args.fsdp, args.fsdp_config) is not None:
        raise ConfigError(f"cast_lm_head_to_fp32 with fsdp and the router loss of {type(config).__name__} "
                          f"(router_aux_loss_coef={coef}) is not supported yet: set router_aux_loss_coef=0.0, or drop "
                          "cast_lm_head_to_fp32")
    return coef


def load_policy(model, args: GRPOConfig, quantization_config=None, device: torch.device | None = None):
    """The policy: loaded from a path (policy_init_kwargs; with `quantization_config` in 4 / 8 bits, placed on
    `device` by from_pretrained on a GPU, as TRL's scripts do) or the model given; dropout, activation checkpointing,
    the fp32 head as configured; in train mode."""
    from transformers import AutoModelForCausalLM

    if isinstance(model, str):
        kwargs = policy_init_kwargs(args)
        if quantization_config is not None:  # checked before (groupwise.quantization.check_quantization)
            kwargs["quantization_config"] = quantization_config
        if kwargs.get("quantization_config") is not None and device is not None and device.type == "cuda":
            kwargs.setdefault("device_map", {"": device})  # (or model_init_kwargs')
        try:
            policy = AutoModelForCausalLM.from_pretrained(model, **kwargs)
        except TypeError as e:  # a key from_pretrained passed on to the model's __init__, which does not take it
            named = unknown_init_kwarg(e, kwargs)
            if named is None:
                raise
            raise named from None
    else:
        policy = model
    forget_gguf(policy)  # its weights are plain once read: saved as a plain model
    if args.disable_dropout:
        disable_dropout(policy)
    if args.gradient_checkpointing:
        enable_activation_checkpointing(policy, args.gradient_checkpointing_kwargs)
        policy.config.use_cache = False
        if hasattr(policy, "enable_input_require_grads") and hasattr(policy, "peft_config"):
            policy.enable_input_require_grads()  # a frozen base would leave checkpointed blocks without gradients
    if args.cast_lm_head_to_fp32:
        cast_head_to_fp32(policy)
    unapplied = unapplied_generation_config(policy, args)
    if unapplied:
        names = ", ".join(f"{k}={v!r}" for k, v in unapplied.items())
        warnings.warn(f"the model's generation_config sets {names}, which generation_backend="
                      f"'{args.generation_backend}' does not apply (model.generate() would): set generation_backend="
                      "'transformers' to sample with it, or unset it on model.generation_config to silence this",
                      UserWarning, stacklevel=3)
    policy.train()
    return policy


def enable_activation_checkpointing(model, kwargs: dict | None) -> None:
    """transformers 5's activation_checkpointing_enable (every_n_layers, offload, torch checkpoint kwargs), or
    gradient_checkpointing_enable on older transformers (torch checkpoint kwargs only)."""
    kwargs = dict(kwargs or {})
    if hasattr(model, "activation_checkpointing_enable"):
        extra = {k: kwargs.pop(k) for k in ("every_n_layers", "offload") if k in kwargs}
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None, **extra)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)


def cast_head_to_fp32(model) -> None:
    """The output head's weights in float32 and its matmul in float32, outside autocast (TRL's
    cast_lm_head_to_fp32). A head tied to the input embeddings cannot change dtype alone: a ConfigError."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        raise ConfigError(f"cast_lm_head_to_fp32=True: {type(model).__name__} has no separable output head")
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None and embeddings.weight is head.weight:
        raise ConfigError("cast_lm_head_to_fp32=True needs an output head that is not tied to the input embeddings "
                          "(tie_word_embeddings=False in the model config); set cast_lm_head_to_fp32=False")
    if type(head) is not torch.nn.Linear:
        raise ConfigError(f"cast_lm_head_to_fp32=True: the output head is a {type(head).__name__}, not a plain Linear "
                          "(a PEFT adapter on lm_head?); set cast_lm_head_to_fp32=False")
    head.float()
    head.__class__ = Float32Head  # a copy (the reference model) keeps the behaviour


def check_head_cast(policy) -> None:
    """cast_lm_head_to_fp32 under FSDP2, after the adapters are added: PEFT on the output head (lora_modules_to_save
    or target_modules with lm_head) puts a wrapper in its place, so the head is not the float32 unit groupwise.sharding
    makes of it and would be gathered in the mixed precision (unsharded, the wrapped Float32Head still computes in
    float32)."""
    head = policy.get_output_embeddings() if hasattr(policy, "get_output_embeddings") else None
    if not isinstance(head, Float32Head):
        raise ConfigError(f"cast_lm_head_to_fp32=True with fsdp and adapters on the output head (it is a "
                          f"{type(head).__name__}: lm_head in lora_modules_to_save or lora_target_modules) is not "
                          "supported yet: leave lm_head out of the adapters, or set cast_lm_head_to_fp32=False")


def eos_token_ids(tokenizer, model) -> list[int]:
    ids = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for v in (tokenizer.eos_token_id, gen_eos):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    if not ids:
        raise ValueError("no EOS token: the tokenizer and the model's generation_config both lack eos_token_id")
    return sorted(ids)


def as_list(funcs) -> list:
    if funcs is None:
        return []
    return list(funcs) if isinstance(funcs, (list, tuple)) else [funcs]


def check_inputs(args: GRPOConfig, model, reward_funcs: list, process_reward_funcs: list,
                 toolbox=None, data=(), custom_rollout: bool = False) -> tuple[list, list]:
    """What can be checked before a model loads: the model argument (a local path must exist), reward specs
    (imported or located), counts against weights and against what the supervision variant reads (the toolbox's
    environments' get_reward are outcome rewards not counted by reward_weights, as in TRL; their get_step_rewards
    step rewards not counted by process_reward_weights), and step_split="turn" against the toolbox (tools or
    environments given), reward keywords against the columns of `data` (the train dataset, each eval dataset). With
    a rollout_func (`custom_rollout`) its output may add reward keywords and turns (env_mask), known only once it
    runs. Returns the reward and step-reward specs with 'module:function' strings imported."""
    env_rewards = len(toolbox.reward_sources) if toolbox is not None else 0
    # an environment's get_step_rewards is read only by a supervision variant that uses step rewards
    env_step_rewards = len(toolbox.process_sources) if toolbox is not None and SUPERVISIONS[args.supervision].process else 0
    if env_step_rewards and not SPLIT_MODES[args.step_split].turns:
        raise ConfigError(f"{toolbox.process_sources[0].name} gives one reward per assistant turn, which "
                          f"supervision={args.supervision!r} reads as step rewards, but step_split="
                          f"{args.step_split!r} splits the text: set step_split='turn' (or supervision='outcome')")
    if SPLIT_MODES[args.step_split].turns and toolbox is None and not custom_rollout:
        raise ConfigError("step_split='turn' makes each assistant turn a step: it needs multi-turn rollouts, so pass "
                          "tools= or environment_factory= to GRPOTrainer, or a rollout_func returning env_mask (or "
                          "choose another step_split)")
    if args.reward_weights is not None and len(args.reward_weights) != len(reward_funcs):
        raise ConfigError(f"reward_weights has {len(args.reward_weights)} entries for {len(reward_funcs)} reward "
                          "functions: give one weight per reward function, in reward_funcs' order (None: all 1)")
    if args.process_reward_weights is not None and len(args.process_reward_weights) != len(process_reward_funcs):
        raise ConfigError(f"process_reward_weights has {len(args.process_reward_weights)} entries for "
                          f"{len(process_reward_funcs)} process reward functions: give one weight per process reward "
                          "function, in process_reward_funcs' order (None: all 1)")
    try:
        SUPERVISIONS[args.supervision].check_sources(args.supervision, len(reward_funcs) + env_rewards,
                                                     len(process_reward_funcs) + env_step_rewards)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    step_sources = len(process_reward_funcs) + env_step_rewards
    if args.multi_objective_aggregation == "normalize_then_sum" and step_sources > 1 \
            and args.process_reward_weights is None:  # supervision 'both'
        warn_user(f"multi_objective_aggregation='normalize_then_sum' z-scores the outcome reward functions one by "
                  f"one; the {step_sources} step-reward sources are summed with process_reward_weights as they are "
                  "(not z-scored): weigh them onto one scale with process_reward_weights")
    if process_reward_funcs and toolbox is not None and toolbox.has_tools and not SPLIT_MODES[args.step_split].turns:
        raise ConfigError(TOOL_TEXT_STEPS.format(args.step_split))
    if args.use_vllm and importlib.util.find_spec("vllm") is None:
        raise ConfigError("use_vllm=True needs vLLM: `pip install vllm` (on a machine with a GPU vLLM "
                          "supports), or drop use_vllm to sample with generation_backend 'fast'")
    if not isinstance(model, (str, torch.nn.Module)):
        fix = f": pass str({model!r}), as TRL takes a path" if isinstance(model, os.PathLike) else ""
        raise TypeError(f"model must be a path / hub id (a str) or a transformers model, got {type(model).__name__}"
                        + fix)
    if isinstance(model, str):
        check_model_location(model, "model", policy=True)
        policy_init_kwargs(args)  # a bad dtype, named now
    reward_funcs = [resolve_spec(s, f"reward_funcs[{i}]") for i, s in enumerate(reward_funcs)]
    if not isinstance(model, str) and args.model_init_kwargs:
        policy_init_kwargs(args)  # a bad dtype, named now (reward models given as paths load with it)
        # they load reward models given as paths too, all but the policy's gguf_file
        reward_paths = any(isinstance(s, str) for s in reward_funcs)
        unused = [k for k in args.model_init_kwargs if k == "gguf_file" or not reward_paths]
        if unused:
            raise ConfigError(f"model_init_kwargs {', '.join(unused)} would apply to nothing: they load a model given "
                              "as a path (and reward models given as paths, all but gguf_file), but the model was "
                              "passed loaded: drop them, or pass the model's path")
    process_reward_funcs = [resolve_process_spec(s, f"process_reward_funcs[{i}]")
                            for i, s in enumerate(process_reward_funcs)]
    for i, spec in enumerate(process_reward_funcs):
        check_prm_separator(spec, args, f"process_reward_funcs[{i}]")
    for rows in data:  # PromptData / StreamData (train_dataset, then each eval dataset), or None
        if rows is not None and not custom_rollout:
            check_dataset(rows, reward_funcs, process_reward_funcs, args, toolbox)
    return reward_funcs, process_reward_funcs


def check_dataset(rows, reward_funcs: list, process_reward_funcs: list, args, toolbox=None) -> None:
    """A dataset's columns against what reads them (the constructor's datasets, or one given to evaluate()): no
    image column; the reward functions' keywords (with environments every call also gets `environments`)."""
    refuse_images(rows.columns() or [], rows.name)
    environments = toolbox is not None and toolbox.has_environments
    check_reward_columns(reward_funcs, rows.columns(), args.remove_unused_columns, rows.name,
                         environments=environments)
    if process_reward_funcs:
        check_reward_columns(process_reward_funcs, rows.columns(), args.remove_unused_columns, rows.name,
                             keywords=PROCESS_REWARD_KEYWORDS, field="process_reward_funcs", environments=environments)
    if environments and toolbox.multi:
        check_environment_column(rows, toolbox)


def check_environment_column(rows, toolbox) -> None:
    """With environment_factory a dict, each row names its environment in an `environment` column: the column, and
    (a dataset read ahead, not a stream) every row's value, checked before any model loads."""
    names = list(toolbox.factories)
    columns = rows.columns()
    data = getattr(rows, "data", None)
    if (getattr(data, "format", None) or {}).get("type") == "custom":  # a transform may make the column: its row
        columns = list(data[0]) if len(data) else columns
    if columns is not None and "environment" not in columns:
        raise ConfigError(f"{rows.name} has no 'environment' column: with environment_factory a dict ({names}), each "
                          "row names the environment it runs in there")
    from groupwise.data import StreamData

    if columns is None or isinstance(rows, StreamData):
        return  # a stream: its rows are checked as they are read (Toolbox.environment_of)
    transformed = (getattr(data, "format", None) or {}).get("type") == "custom"
    values = data["environment"] if hasattr(data, "column_names") and not transformed else \
        [v for lo in range(0, len(data), 1000) for v in data[lo:lo + 1000]["environment"]] if transformed else \
        [row.get("environment") for row in data]  # (a transform's column: read through it, in slices)
    for i, value in enumerate(values):
        toolbox.check_environment_name(value, f"{rows.name} row {i}")


def check_combinations(args: GRPOConfig, *, model, sharded: bool, peft_config, optimizers: tuple,
                       quantization_config=None) -> None:
    """Combinations of features that do not work together (yet), refused before any model loads."""
    if isinstance(model, torch.nn.Module):  # adapters that cannot train or resume here (groupwise.adapters)
        check_passed_model(model)
    lora = peft_config is not None or args.use_peft or is_peft_model(model)
    check_quantization(args, model, quantization_config, lora=lora, sharded=sharded)
    adapters = list(getattr(model, "peft_config", {}) or {}) if is_peft_model(model) else []
    if adapters and adapters != ["default"]:
        raise ConfigError(f"a PeftModel with adapters {adapters}: groupwise trains, checkpoints and resumes one "
                          "adapter named 'default' (get_peft_model's default adapter_name); build it with that name")
    if peft_config is not None and args.use_peft:
        raise ConfigError("peft_config and use_peft=True both ask for adapters: give one (peft_config wins in "
                          "Python scripts; use_peft with the lora_* fields in config files)")
    from groupwise.distributed import launch_precision

    precision = launch_precision(args.bf16, args.fp16)  # the fields, or an accelerate launch's mixed_precision
    if precision == "fp16" and isinstance(model, str) and not lora:  # a model object: checked in build_training
        dtype = policy_init_kwargs(args)["dtype"]
        if dtype in (torch.float16, torch.bfloat16):
            raise ConfigError(f"fp16 trains float32 weights under float16 autocast (the loss scale is undone in "
                              f"float32), but model_init_kwargs loads the policy in {dtype}: set its dtype to "
                              "float32 (the default)")
    if sharded and any(o is not None for o in optimizers):
        raise ConfigError("fsdp with optimizers=(…): the optimizer must be built over the sharded parameters; "
                          "choose it with optim / optim_args instead")
    if args.sync_ref_model and lora:
        raise ConfigError("sync_ref_model=True with LoRA: the reference policy is the base model with the adapters "
                          "disabled, which TR-DPO cannot move; train without sync_ref_model")
