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
    """The layout of `args` for `world_size` processes; raises ConfigError naming the fields and a fix. The checks
    TRL's GRPOConfig.__post_init__ makes, in its words; then groupwise's own (whole optimizer steps per round,
    dynamic sampling's whole groups per process, vLLM tensor parallelism)."""
    B, W, G, GA, mu = (args.per_device_train_batch_size, world_size, args.num_generations,
                       args.gradient_accumulation_steps, args.num_iterations)
    per_round = B * W  # completions per micro-batch over all processes (TRL's "global batch size")
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
        gbs = user["generation_batch_size"]
        if gbs % per_round:
            raise ConfigError(
                f"generation_batch_size={gbs} must be divisible by per_device_train_batch_size × processes = "
                f"{B} × {W} = {per_round}: set it to a multiple of {per_round} (e.g. {_multiples(per_round, gbs)}), "
                "or set steps_per_generation instead")
        steps = gbs // per_round
    else:
        steps = user.get("steps_per_generation", GA)
    gen_batch = per_round * steps

    def fits(k: int) -> bool:  # a round of k micro-batches per process passes every check below
        return (per_round * k) % G == 0 and (k * mu) % GA == 0 and not (args.dynamic_sampling and (B * k) % G)

    def fix() -> str:  # the nearest working round, in the field the user sized it with
        k = next(k for k in range(steps + 1, steps + 1 + G * GA) if fits(k))  # lcm of the step counts ≤ G · GA
        if "generation_batch_size" in user:
            return f"set generation_batch_size={per_round * k} (steps_per_generation={k})"
        return f"set steps_per_generation={k} (generation_batch_size={per_round * k})"

    if gen_batch % G:
        valid = [b for b in range(1, 4 * G + 1)  # each passing the dynamic_sampling check below too
                 if b * W * steps % G == 0 and not (args.dynamic_sampling and b * steps % G)][:6]
        change = "" if "generation_batch_size" in user else \
            f", or per_device_train_batch_size to one of {valid}"
        raise ConfigError(
            f"generation_batch_size={gen_batch} (= per_device_train_batch_size={B} × {W} process(es) × "
            f"steps_per_generation={steps}) must be divisible by num_generations={G}, so that every prompt's group "
            f"is whole: {fix()}{change}")
    if args.dynamic_sampling and (gen_batch // W) % G:
        raise ConfigError(
            f"dynamic_sampling needs whole groups on each process: {gen_batch // W} completions per process "
            f"(per_device_train_batch_size={B} × steps_per_generation={steps}) is not a multiple of "
            f"num_generations={G}: {fix()}")
    if (steps * mu) % GA:
        raise ConfigError(
            f"steps_per_generation × num_iterations = {steps} × {mu} must be a multiple of "
            f"gradient_accumulation_steps={GA}, so an optimizer step never spans two generation batches (TRL "
            f"allows that; groupwise does not): {fix()}, or lower gradient_accumulation_steps to a divisor of "
            f"{steps * mu}")
    tp = args.vllm_tensor_parallel_size
    if args.use_vllm and args.vllm_mode == "colocate" and W % tp:
        raise ConfigError(f"vllm_tensor_parallel_size={tp} must divide the number of training processes "
                          f"({W}): each colocated engine spans {tp} of them; launch a multiple of {tp} "
                          "processes (torchrun --nproc_per_node), or lower it")
    return BatchLayout(W, steps, gen_batch, gen_batch // G, G, B)


def _multiples(step: int, near: int) -> str:
    """The multiples of `step` either side of `near`, for an error message."""
    below = near // step * step
    return f"{below} or {below + step}" if below else str(step)
