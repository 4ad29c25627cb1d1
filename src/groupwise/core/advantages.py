"""Group-relative advantages: every estimator, for outcome (§4.1.2) and process (§4.1.3) supervision.

An estimator turns the rewards of a group into normalised rewards r̃. It sees them as a (B, G, K) tensor: B
prompts, G completions per prompt, K rewards per completion, NaN where there is none (K = 1 for outcome rewards;
for step rewards completion i has K_i ≤ K steps and the rest is NaN padding). The group of prompt b is every
reward of row b: the G outcome rewards, or, as DeepSeekMath §4.1.3 prescribes, all step rewards of all G
completions. NaN rewards (could not be scored) are left out of every statistic and get r̃ = 0. A group whose
rewards are all equal carries no signal: its r̃ is exactly 0 under grpo and reinforce_plus_plus_baseline, also at
eps = 0 (masked_mean_std gives such a set std 0 exactly).

Then, whichever the estimator:
    outcome supervision (§4.1.2)  Â_{i,t} = r̃_i                              outcome_advantages → (B, G)
    process supervision (§4.1.3)  Â_{i,t} = Σ_{index(j) ≥ t} r̃_i^{index(j)}   process_advantages → (B, G, T)
        (or, GRPOConfig.step_advantage="step_return", the return-to-go normalised per step index: _step_return)

The estimators (`ESTIMATORS`, chosen by GRPOConfig.advantage_estimator):
    grpo    r̃ = (r − mean(R_b)) / (std(R_b) + eps)             DeepSeekMath §4.1.2/§4.1.3 (scale="group")
            scale="batch": std over every reward of the batch; scale="none": r − mean(R_b) only (Dr. GRPO)
    rloo    r̃_{i} = r_i − mean of the rewards of the *other* completions of the group (REINFORCE leave-one-out,
            Ahmadian et al. 2024); for step rewards, the baseline of a step of completion i is the mean of the
            step rewards of the other G − 1 completions. No scaling.
    reinforce_plus_plus_baseline
            c = r − mean(R_b), then r̃ = c / (std_batch(c) + eps): a group-mean baseline, then scaling by the std of
            every centred reward of the batch (the batch mean of c is 0 by construction), after REINFORCE++-baseline
            (Hu et al. 2025). Here the batch statistics are over rewards (completions or steps); the paper's
            implementations whiten over tokens, which weighs long completions more.
`std="population"` is the 1/n definition of DeepSeekMath's std(·); `std="unbiased"` is Bessel's 1/(n−1).
Statistics, and process supervision's step values and token lookup, are computed in float64 (one cast to float32
at the end), so rewards of very different magnitude (1e20 next to 0) keep their signal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

SCALES = ("group", "batch", "none")
STDS = ("population", "unbiased")


def masked_mean_std(x: torch.Tensor, valid: torch.Tensor, dims, *, std: str = "population"
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NaN-aware mean and std of `x` over `dims` (keepdim), counting only `valid` entries; also the count.
    An empty, single-value or all-equal set has std exactly 0 (never NaN, never float noise: the mean of
    [0.1, 0.1, 0.1] is not exactly 0.1, so the deviations alone would give a std near 1e-17). The one std of the
    package. Computed on x / s, s the largest power of two ≤ the set's largest |x| (exact: the same bits as
    unscaled), so that squares of rewards near 1e300 do not overflow to a std of inf (every advantage 0, nothing
    said)."""
    if std not in STDS:
        raise ValueError(f"std={std!r} is not one of {list(STDS)}")
    zero = torch.zeros_like(x)
    count = valid.sum(dim=dims, keepdim=True).to(x.dtype)
    largest = torch.where(valid, x.abs(), zero).amax(dim=dims, keepdim=True)
    one = torch.ones_like(largest)
    s = torch.where((largest > 0) & torch.isfinite(largest), torch.ldexp(one, torch.frexp(largest).exponent - 1), one)
    xs = x / s
    mean_s = torch.where(valid, xs, zero).sum(dim=dims, keepdim=True) / count.clamp(min=1)
    sq = torch.where(valid, (xs - mean_s) ** 2, zero).sum(dim=dims, keepdim=True)
    denom = count if std == "population" else count - 1
    mean = mean_s * s
    sd = torch.where(denom > 0, sq / denom.clamp(min=1), torch.zeros_like(sq)).sqrt() * s
    inf = torch.full_like(x, float("inf"))
    spread = torch.where(valid, x, -inf).amax(dim=dims, keepdim=True) > torch.where(valid, x, inf).amin(dim=dims,
                                                                                                        keepdim=True)
    return mean, torch.where(spread, sd, torch.zeros_like(sd)), count


def _centered(r: torch.Tensor, mean: torch.Tensor, sd: torch.Tensor) -> torch.Tensor:
    """r − mean, exactly 0 in a set of equal rewards (sd = 0), where the float mean may differ from them by an ulp."""
    return torch.where(sd > 0, r - mean, torch.zeros_like(r))


def _scaled(centered: torch.Tensor, sd: torch.Tensor, eps: float) -> torch.Tensor:
    """centered / (sd + eps), and 0 where sd = 0: a set of equal rewards carries no signal, also at eps = 0."""
    return torch.where(sd > 0, centered / (sd + eps), torch.zeros_like(centered))


def _grpo(r: torch.Tensor, valid: torch.Tensor, *, scale: str = "group", std: str = "population",
          eps: float = 1e-4) -> torch.Tensor:
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r} is not one of {list(SCALES)}")
    mean, group_sd, _ = masked_mean_std(r, valid, (1, 2), std=std)  # (B, 1, 1)
    centered = _centered(r, mean, group_sd)
    if scale == "group":
        return _scaled(centered, group_sd, eps)
    if scale == "batch":
        _, batch_sd, _ = masked_mean_std(r, valid, (0, 1, 2), std=std)
        return _scaled(centered, batch_sd, eps)
    return centered


def _rloo(r: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    filled = torch.where(valid, r, torch.zeros_like(r))
    group_sum, group_n = filled.sum((1, 2), keepdim=True), valid.sum((1, 2), keepdim=True)  # (B, 1, 1)
    own_sum, own_n = filled.sum(2, keepdim=True), valid.sum(2, keepdim=True)  # (B, G, 1)
    others_n = (group_n - own_n).to(r.dtype)
    baseline = (group_sum - own_sum) / others_n.clamp(min=1)
    # no other completion has a reward: no baseline, no signal
    return torch.where(others_n > 0, r - baseline, torch.zeros_like(r))


def _reinforce_pp(r: torch.Tensor, valid: torch.Tensor, *, std: str = "population",
                  eps: float = 1e-4) -> torch.Tensor:
    mean, group_sd, _ = masked_mean_std(r, valid, (1, 2))
    centered = _centered(r, mean, group_sd)  # each group's centred rewards sum to 0, so their batch mean is 0
    _, batch_sd, _ = masked_mean_std(centered, valid, (0, 1, 2), std=std)
    return _scaled(centered, batch_sd, eps)


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator: `normalize(r (B, G, K) float64, valid (B, G, K) bool, **options) → r̃ (B, G, K)`
    and the keyword options it takes (GRPOConfig maps scale → scale_rewards, std → reward_std,
    eps → advantage_eps, and rejects a non-default field the chosen estimator would ignore)."""

    normalize: Callable[..., torch.Tensor]
    options: tuple[str, ...]
    summary: str
    # the fewest completions of a group with a reward for any r̃ ≠ 0: rloo's baseline is the *other* completions'
    min_rewarded: int = 1


ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(_grpo, ("scale", "std", "eps"), "group z-score, DeepSeekMath §4.1.2/§4.1.3"),
    "rloo": Estimator(_rloo, (), "leave-one-out baseline: r_i − mean of the other completions' rewards",
                      min_rewarded=2),
    "reinforce_plus_plus_baseline": Estimator(_reinforce_pp, ("std", "eps"),
                                              "group-mean baseline, then batch whitening"),
}


def normalize_rewards(rewards: torch.Tensor, estimator: str = "grpo", **options) -> torch.Tensor:
    """(B, G, K) rewards with NaN → (B, G, K) normalised rewards r̃ (float32), 0 where the reward is NaN."""
    return _normalize64(rewards, estimator, **options).float()


def _normalize64(rewards: torch.Tensor, estimator: str = "grpo", **options) -> torch.Tensor:
    """normalize_rewards in float64: the step values built from r̃ (suffix sums) stay exact before the one cast."""
    try:
        est = ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(f"advantage_estimator={estimator!r} is not one of {sorted(ESTIMATORS)}") from None
    unknown = sorted(set(options) - set(est.options))
    if unknown:
        raise ValueError(f"advantage estimator {estimator!r} takes no option(s) {unknown} (it takes {list(est.options)})")
    if rewards.dim() != 3:
        raise ValueError(f"rewards must be (B, G, K), got shape {tuple(rewards.shape)}")
    r = rewards.double()
    valid = ~torch.isnan(r)
    out = est.normalize(torch.where(valid, r, torch.zeros_like(r)), valid, **options)
    return torch.where(valid, out, torch.zeros_like(out))


def pack_steps(ragged: Sequence[Sequence[Sequence[float | None]]], *, fill: float = float("nan"),
               dtype: torch.dtype = torch.float) -> torch.Tensor:  # [B][G][K_i] → (B, G, max K_i)
    """Ragged per-completion step values as one tensor, `fill` (NaN) past each completion's last step; None → NaN."""
    B = len(ragged)
    G = len(ragged[0]) if B else 0
    K = max((len(row) for group in ragged for row in group), default=0)
    out = torch.full((B, G, K), fill, dtype=dtype)
    for b, group in enumerate(ragged):
        for g, row in enumerate(group):
            if len(row):
                out[b, g, :len(row)] = torch.tensor([float("nan") if v is None else v for v in row], dtype=dtype)
    return out


def outcome_advantages(
    rewards: torch.Tensor,  # (B, G), NaN = could not be scored
    *,
    estimator: str = "grpo",
    **options,  # the estimator's options, e.g. scale="group", std="population", eps=1e-4 for grpo
) -> torch.Tensor:  # (B, G)
    """Outcome-supervision advantages (DeepSeekMath §4.1.2): Â_{i,t} = r̃_i for every token of completion i.
    With the default grpo estimator: r̃ = (r − group mean) / (group std + eps); an all-equal group gets 0 and
    eps keeps float noise from being blown up into ±1 advantages."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (B, G), got shape {tuple(rewards.shape)}")
    return normalize_rewards(rewards.unsqueeze(-1), estimator, **options).squeeze(-1)


def _suffix_sum(rewards: torch.Tensor, exists: torch.Tensor, estimator: str, **options) -> torch.Tensor:
    """DeepSeekMath §4.1.3: every step reward of the group normalised together, r̃_{i,j}; step j's value is the
    suffix sum Σ_{j' ≥ j} r̃_{i,j'}. (B, G, K) → (B, G, K)."""
    normalized = _normalize64(rewards, estimator, **options)  # 0 on padding and NaN
    return normalized.flip(-1).cumsum(-1).flip(-1)


def _returns_to_go(rewards: torch.Tensor, exists: torch.Tensor) -> torch.Tensor:  # (B, G, K), NaN where unknown
    """G_{i,j} = Σ_{j' ≥ j} r_{i,j'}; padding adds 0, an unscored step makes its own and every earlier return NaN
    (unknown, not 0: left out of its index's statistics, value 0); NaN past the last step."""
    summed = torch.where(exists, rewards, torch.zeros_like(rewards)).flip(-1).cumsum(-1).flip(-1)
    return torch.where(exists, summed, torch.full_like(rewards, float("nan")))


def _suffix_sum_spread(rewards: torch.Tensor, exists: torch.Tensor) -> torch.Tensor:  # (B,)
    r = rewards.double()
    if r.size(-1) == 0:  # no completion of the round has a step: nothing spread (every advantage is 0)
        return torch.zeros(r.size(0), dtype=torch.float64)
    return masked_mean_std(r, ~torch.isnan(r), (1, 2))[1].view(-1)


def _step_return_spread(rewards: torch.Tensor, exists: torch.Tensor) -> torch.Tensor:  # (B,)
    returns = _returns_to_go(rewards.double(), exists)
    if returns.size(-1) == 0:
        return torch.zeros(returns.size(0), dtype=torch.float64)
    return masked_mean_std(returns, ~torch.isnan(returns), (1,))[1].amax(dim=(1, 2))  # the widest step index


def _step_return(rewards: torch.Tensor, exists: torch.Tensor, estimator: str, **options) -> torch.Tensor:
    """Returns-to-go normalised per step index. G_{i,j} = Σ_{j' ≥ j} r_{i,j'} (raw step rewards; NaN when step j
    or a later step is unscored: left out of index j's statistics, value 0), and the estimator normalises G_{·,j}
    over the completions of the group that have a step j (grpo:
    (G_{i,j} − mean_j) / (std_j + eps); rloo: minus the mean of the *other* completions with a step j).

    Why: the paper's value of step j, Σ_{j' ≥ j} (r_{i,j'} − μ)/σ = (G_{i,j} − (K_i − j)·μ)/σ, subtracts a baseline
    (K_i − j)·μ that grows with the number of steps K_i the completion goes on to take. When the model chooses how
    many steps or turns it takes, K_i depends on its own actions from step j on, so that baseline is correlated
    with the actions it scores and the policy gradient is biased: with μ > 0 it pushes toward fewer steps, with
    μ < 0 toward more, even where the return does not depend on length (test_step_return_is_unbiased_when_length_
    does_not_matter: stopping after one step with reward 1, or continuing for two steps of 0.5, has the same
    return; the paper's form still prefers stopping). Here the baseline of step j is a statistic of the group's
    returns at the same step index, so it does not grow with the completion's own length: with rloo it uses only
    the other completions, independent samples, and E[∇log π · b] = 0 exactly; with grpo the completion's own
    return is one of the n values averaged, the same O(1/n) coupling GRPO's outcome baseline has. The scale
    (std_j) is a per-index positive factor; a step index reached by one completion only has no comparison and gets
    0. For a fixed number of steps equal across the group, this is outcome GRPO on each suffix's return."""
    returns = _returns_to_go(rewards, exists)
    B, G, K = returns.shape
    per_index = returns.permute(0, 2, 1).reshape(B * K, G, 1)  # one group per (prompt, step index)
    normalized = _normalize64(per_index, estimator, **options)  # 0 where the completion has no such step
    return normalized.view(B, K, G).permute(0, 2, 1)


@dataclass(frozen=True)
class StepAdvantage:
    """How step rewards become a value per step (GRPOConfig.step_advantage): `value(rewards (B, G, K) float64 with
    NaN = unscored or padding, exists (B, G, K) bool, estimator, **options) → (B, G, K)`; the tokens of step j get
    step j's value."""

    value: Callable[..., torch.Tensor]
    summary: str
    # spread(rewards, exists) → (B,): population std of what the form compares within group b (0 = every value 0)
    spread: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


STEP_ADVANTAGES: dict[str, StepAdvantage] = {
    "suffix_sum": StepAdvantage(_suffix_sum, "DeepSeekMath §4.1.3: Σ of the group-normalised step rewards of this "
                                             "and later steps", _suffix_sum_spread),
    "step_return": StepAdvantage(_step_return, "return-to-go normalised per step index: no baseline that grows "
                                               "with the completion's own number of steps", _step_return_spread),
}


def step_spread(step_rewards: Sequence[Sequence[Sequence[float | None]]], form: str = "suffix_sum",
                estimator: str = "grpo") -> torch.Tensor:
    """(B,) float64: the spread of what step_advantage=`form` compares in each group (suffix_sum: every step reward
    of the group; step_return: the returns-to-go at each step index, the widest index), and 0 where fewer
    completions have a scored step than the estimator compares (rloo: 2). ≈ 0: the group's process advantages
    are all 0, it carries no signal (dynamic sampling, process/zero_std_groups)."""
    rewards = pack_steps(step_rewards, dtype=torch.float64)
    lengths = torch.tensor([[len(row) for row in group] for group in step_rewards]).view(*rewards.shape[:2], 1)
    exists = torch.arange(rewards.size(-1)) < lengths
    spread = STEP_ADVANTAGES[form].spread(rewards, exists)
    rewarded = (~torch.isnan(rewards)).any(-1).sum(-1)  # (B,) completions with a scored step
    return torch.where(rewarded >= ESTIMATORS[estimator].min_rewarded, spread, torch.zeros_like(spread))


def process_advantages(
    step_rewards: Sequence[Sequence[Sequence[float | None]]],  # [B][G][K_i]
    step_ends: Sequence[Sequence[Sequence[int]]],  # [B][G][K_i], token index within the completion, ascending
    num_tokens: int,  # T
    *,
    estimator: str = "grpo",
    form: str = "suffix_sum",
    **options,
) -> torch.Tensor:  # (B, G, T)
    """Process-supervision advantages (DeepSeekMath §4.1.3).

    form="suffix_sum" (the paper): the step rewards of group b (all completions, all steps) are normalised
    together by the estimator (grpo: r̃ = (r − mean(R_b)) / (std(R_b) + eps)); A[b, g, t] = Σ_{j : end_j ≥ t}
    r̃_{b,g,j}. form="step_return": step j's value is the return-to-go normalised among the group's completions
    that have a step j (_step_return, for completions whose number of steps is the model's choice). Either way
    the tokens of step j (after step j − 1's end, up to end_j) get step j's value; tokens after a completion's
    last step get 0; a completion with no steps gets 0 everywhere. None/NaN step rewards are left out of the
    statistics and contribute 0.
    """
    if form not in STEP_ADVANTAGES:
        raise ValueError(f"step_advantage={form!r} is not one of {sorted(STEP_ADVANTAGES)}")
    B = len(step_rewards)
    if len(step_ends) != B:
        raise ValueError(f"step_rewards has {B} prompts but step_ends has {len(step_ends)}")
    G = len(step_rewards[0]) if B else 0
    for b in range(B):
        if len(step_rewards[b]) != G or len(step_ends[b]) != G:
            raise ValueError(f"prompt {b}: expected {G} completions in step_rewards and step_ends")
        for g in range(G):
            rs, es = step_rewards[b][g], step_ends[b][g]
            if len(rs) != len(es):
                raise ValueError(f"prompt {b}, completion {g}: {len(rs)} step rewards but {len(es)} step ends")
            if any(float(e) != int(e) for e in es):  # int() would silently move a step's end
                bad = next(e for e in es if float(e) != int(e))
                raise ValueError(f"prompt {b}, completion {g}: step end {bad!r} is not a whole token index")
            if any(not 0 <= int(e) < num_tokens for e in es):
                bad = next(int(e) for e in es if not 0 <= int(e) < num_tokens)
                raise ValueError(f"prompt {b}, completion {g}: step end {bad} outside [0, {num_tokens})")
            if any(int(a) > int(c) for a, c in zip(es, es[1:])):
                raise ValueError(f"prompt {b}, completion {g}: step ends must be ascending, got {list(es)}")
    rewards = pack_steps(step_rewards, dtype=torch.float64)  # (B, G, K)
    if rewards.numel() == 0:
        return torch.zeros(B, G, num_tokens)
    ends = pack_steps(step_ends, fill=num_tokens, dtype=torch.long)  # padding lands in a spare column T
    exists = ends < num_tokens  # (B, G, K): completion g has a step j
    value = STEP_ADVANTAGES[form].value(rewards, exists, estimator, **options).double()  # (B, G, K), 0 past K_i
    # token t belongs to the first step j with end_j ≥ t (ends are ascending, padding = T sorts last); tokens after
    # the last step find only padding, whose value is 0. A lookup, not a difference of running sums, so a step's
    # value is exact whatever the magnitude of its neighbours' (a float32 cumsum of jumps lost 1 next to 1e8)
    first = torch.searchsorted(ends.reshape(B * G, -1).contiguous(),
                               torch.arange(num_tokens).expand(B * G, num_tokens).contiguous())  # (B·G, T) in [0, K]
    padded = torch.nn.functional.pad(value.reshape(B * G, -1), (0, 1))  # (B·G, K + 1), column K = 0
    return padded.gather(-1, first.clamp(max=padded.size(-1) - 1)).view(B, G, num_tokens).float()
