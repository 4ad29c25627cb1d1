"""The batch layout of a generation round: how many completions one round samples and how they are cut into
micro-batches, resolved from GRPOConfig's batch fields for a number of processes (TRL's semantics: batch sizes
count completions, not prompts)."""

from __future__ import annotations

from dataclasses import dataclass

from groupwise.config_base import ConfigError

# the two fields that size a round: one is given, TRL's __post_init__ derives the other (both from
# gradient_accumulation_steps when neither is given)
ROUND_FIELDS = ("steps_per_generation", "generation_batch_size")


@dataclass(frozen=True)
class BatchLayout:
    """How a generation round is laid out."""

    world_size: int
    steps_per_generation: int  # micro-batches per process per round
    generation_batch_size: int  # completions per round, all processes
    prompts_per_generation: int  # B of the round, all processes
    num_generations: int  # G
    micro_batch_size: int  # completions per micro-batch per process

    @property
    def local_rows(self) -> int:
        return self.generation_batch_size // self.world_size


def given(args) -> dict[str, int]:
    """The round fields the user set: those not filled in by `fill` (or changed since it filled them)."""
    derived = getattr(args, "_derived_round_fields", {})
    return {name: getattr(args, name) for name in ROUND_FIELDS
            if getattr(args, name) is not None and derived.get(name) != getattr(args, name)}


def fill(args, world_size: int) -> BatchLayout:
    """Resolve the layout and fill in the round field(s) the user left None, as TRL's GRPOConfig does, remembering
    which were derived so that the trainer derives them again for its real number of processes."""
    layout = resolve(args, world_size)
    derived = {name: getattr(layout, name) for name in ROUND_FIELDS if name not in given(args)}
    for name, value in derived.items():
        setattr(args, name, value)
    object.__setattr__(args, "_derived_round_fields", derived)
    return layout


def resolve(args, world_size: int) -> BatchLayout:
    """The layout of `args` for `world_size` processes; raises ConfigError naming the fields."""
    per_round = args.per_device_train_batch_size * world_size
    user = given(args)
    if len(user) == 2:
        # a dumped TRL config carries both: fine when they agree
        if user["generation_batch_size"] != per_round * user["steps_per_generation"]:
            raise ConfigError(
                f"steps_per_generation={user['steps_per_generation']} and generation_batch_size="
                f"{user['generation_batch_size']} disagree with per_device_train_batch_size × processes = "
                f"{per_round}: set one of them (a config copied with dataclasses.replace or rebuilt from to_dict() "
                "carries both as filled in for its old batch fields: pass steps_per_generation=None, "
                "generation_batch_size=None with the change)")
        steps = user["steps_per_generation"]
    elif "generation_batch_size" in user:
        if user["generation_batch_size"] % per_round:
            raise ConfigError(
                f"generation_batch_size={user['generation_batch_size']} must be divisible by "
                f"per_device_train_batch_size × processes = {per_round}")
        steps = user["generation_batch_size"] // per_round
    else:
        steps = user.get("steps_per_generation", args.gradient_accumulation_steps)
    gen_batch = per_round * steps
    G = args.num_generations
    if gen_batch % G:
        raise ConfigError(
            f"the generation batch (per_device_train_batch_size={args.per_device_train_batch_size} × "
            f"{world_size} process(es) × steps_per_generation={steps} = {gen_batch} completions) must be divisible "
            f"by num_generations={G}; valid per_device_train_batch_size values here: "
            f"{[b for b in range(1, 4 * G + 1) if b * world_size * steps % G == 0][:6]}")
    if args.dynamic_sampling and (gen_batch // world_size) % G:
        raise ConfigError(
            f"dynamic_sampling needs whole groups on each process: {gen_batch // world_size} completions per "
            f"process is not a multiple of num_generations={G}")
    if (steps * args.num_iterations) % args.gradient_accumulation_steps:
        raise ConfigError(
            f"steps_per_generation × num_iterations = {steps * args.num_iterations} must be a multiple of "
            f"gradient_accumulation_steps={args.gradient_accumulation_steps}, so an optimizer step never spans two "
            "generation batches")
    tp = args.vllm_tensor_parallel_size
    if args.use_vllm and args.vllm_mode == "colocate" and world_size % tp:
        raise ConfigError(f"vllm_tensor_parallel_size={tp} must divide the number of training processes "
                          f"({world_size}): each colocated engine spans {tp} of them; launch a multiple of {tp} "
                          "processes (torchrun --nproc_per_node), or lower it")
    return BatchLayout(world_size, steps, gen_batch, gen_batch // G, G, args.per_device_train_batch_size)
