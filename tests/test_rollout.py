import torch

from groupwise import GRPOConfig
from groupwise import rollout as R
from groupwise.distributed import Distributed
from groupwise.text import completion_masks, encode_prompts
from groupwise.rewards.process import load_process_reward_sources
from groupwise.rewards.steps import StepSplitter
from groupwise.rollout_metrics import round_metrics
from groupwise.types import Completions, Round, Scores


def _completions(tokenizer, texts, T=8):
    prompts = ["q:"] * len(texts)
    pids, pmask = encode_prompts(prompts, tokenizer, None)
    cids = torch.full((len(texts), T), tokenizer.pad_token_id)
    for i, text in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        cids[i, :len(ids)] = torch.tensor(ids)
    cmask, trunc = completion_masks(cids, [tokenizer.eos_token_id], T)
    return Completions(pids, pmask, cids, cmask, trunc, prompts, texts, {})


def _a_is_right(tokenizer) -> R.RolloutContext:
    """Process supervision of G = 2, T = 8, eps 0, one step function: a step "a" scores 1, any other 0."""
    args = GRPOConfig(num_generations=2, per_device_train_batch_size=2, max_completion_length=8, supervision="process",
                      advantage_eps=0.0)
    reward = lambda steps, **_: [[1.0 if s == "a" else 0.0 for s in row] for row in steps]  # noqa: E731
    return R.RolloutContext(args=args, tokenizer=tokenizer, generator=None, dist=Distributed(),
                            eos_token_ids=[tokenizer.eos_token_id],
                            process_sources=load_process_reward_sources([reward]), splitter=StepSplitter())


def test_process_advantages_through_the_rollout_by_hand(tokenizer):
    """One group of G = 2: "a\\nb" (steps a, b) and "\\n" (no steps).
    Step rewards: a → 1, b → 0 ⇒ R = [1, 0], mean 0.5, population std 0.5 ⇒ r̃ = [+1, −1] (eps 0).
    Tokens of completion 0: a(0) \\n(1) b(2) <eos>(3); step a ends at 1, step b at the EOS (3):
    A = [1 − 1, 1 − 1, −1, −1] = [0, 0, −1, −1], then 0. Completion 1 has no steps: all 0, counted."""
    ctx = _a_is_right(tokenizer)
    comp = _completions(tokenizer, ["a\nb", "\n"])
    steps = R.score_steps(ctx, comp)
    assert steps.texts == [["a", "b"], []] and steps.ends == [[[1, 3], []]]
    adv = R.advantages(ctx, comp, None, steps)
    assert torch.equal(adv, torch.tensor([[0.0, 0.0, -1.0, -1.0, 0, 0, 0, 0], [0.0] * 8]))
    metrics = round_metrics(ctx, Round(comp, adv, torch.full((2,), float("nan")), None, None, None, None, steps))
    assert metrics["process/no_step_completions"] == 1.0 and metrics["process/steps_per_completion"] == 1.0
    assert metrics["process/step_reward_mean"] == 0.5 and metrics["process/zero_std_groups"] == 0.0


def test_each_process_function_reports_its_own_mean_by_hand(tokenizer):
    """process/<f>/mean: one function's step rewards, unweighted, over the steps it scored. Steps a, b (completion
    0), c (completion 1). is_a: a → 1, b → 0, c → 0 ⇒ mean 1/3. flat (weight 0.5): 2 on a and c, None on b ⇒ mean
    (2 + 2) / 2 = 2. Combined per step: a 1 + 0.5·2 = 2, b 0 (flat skipped), c 0 + 1 = 1 ⇒ step_reward_mean 1."""
    args = GRPOConfig(num_generations=2, per_device_train_batch_size=2, max_completion_length=8, supervision="process",
                      advantage_eps=0.0, process_reward_weights=[1.0, 0.5])

    def is_a(steps, **_):
        return [[1.0 if s == "a" else 0.0 for s in row] for row in steps]

    def flat(steps, **_):
        return [[None if s == "b" else 2.0 for s in row] for row in steps]

    ctx = R.RolloutContext(args=args, tokenizer=tokenizer, generator=None, dist=Distributed(),
                           eos_token_ids=[tokenizer.eos_token_id],
                           process_sources=load_process_reward_sources([is_a, flat]), splitter=StepSplitter())
    comp = _completions(tokenizer, ["a\nb", "c"])
    steps = R.score_steps(ctx, comp)
    metrics = round_metrics(ctx, Round(comp, R.advantages(ctx, comp, None, steps), torch.full((2,), float("nan")),
                                       None, None, None, None, steps))
    assert metrics["process/is_a/mean"] == 1 / 3 and metrics["process/flat/mean"] == 2.0
    assert metrics["process/step_reward_mean"] == 1.0 and metrics["process/flat/errors"] == 0.0


def test_round_metrics_follow_trls_definitions_by_hand():
    """Two groups of G = 2. Completion lengths (EOS included) 3, 4 (truncated: no EOS), 1, 2; prompt tokens 2 each.
    completions/*: mean 10/4 = 2.5, min 1, max 4, clipped 1/4; terminated (3, 1, 2): mean 2, min 1, max 3.
    num_tokens: 4·2 + 10 = 18. Function f scores [1, 1, NaN, 3], g scores 0 everywhere (weights 1):
    rewards [[1, 1], [0, 3]]: reward = 5/4 = 1.25; reward_std with Bessel's
    correction: squares (0.0625·2 + 1.5625 + 3.0625) = 4.75 over 3 → √1.58333 = 1.258306 (population would be
    1.089725); group 0 has no spread: frac_reward_zero_std = 1/2. rewards/f/std of [1, 1, NaN, 3]: mean 5/3,
    squares (4/9·2 + 16/9) = 24/9 over 2 → √(4/3) = 1.154701."""
    ids = torch.tensor([[5, 6, 2, 0], [5, 6, 7, 8], [2, 0, 0, 0], [5, 2, 0, 0]])
    mask = (torch.arange(4) < torch.tensor([[3], [4], [1], [2]])).long()
    comp = Completions(torch.ones(4, 2, dtype=torch.long), torch.ones(4, 2, dtype=torch.long), ids, mask,
                       torch.tensor([False, True, False, False]), ["q"] * 4, ["c"] * 4, {})
    per_func = torch.tensor([[[1.0, 0.0], [1.0, 0.0]], [[float("nan"), 0.0], [3.0, 0.0]]])
    scores = Scores(per_func, torch.tensor([[1.0, 1.0], [0.0, 3.0]]), ("f", "g"), torch.zeros(2))
    ctx = R.RolloutContext(args=GRPOConfig(num_generations=2, per_device_train_batch_size=4), tokenizer=None,
                           generator=None, dist=Distributed(), eos_token_ids=[2])
    m = round_metrics(ctx, Round(comp, torch.zeros(4), scores.rewards.view(-1), None, None, None, scores))
    assert (m["completions/mean_length"], m["completions/min_length"], m["completions/max_length"]) == (2.5, 1, 4)
    assert m["completions/clipped_ratio"] == 0.25 and m["num_tokens"] == 18
    assert (m["completions/mean_terminated_length"], m["completions/min_terminated_length"],
            m["completions/max_terminated_length"]) == (2, 1, 3)
    assert m["reward"] == 1.25 and abs(m["reward_std"] - 1.258306) < 1e-6 and m["frac_reward_zero_std"] == 0.5
    assert abs(m["rewards/f/mean"] - 5 / 3) < 1e-6 and abs(m["rewards/f/std"] - 1.154701) < 1e-6


def test_reward_metric_is_the_weighted_sum_under_either_aggregation():
    """TRL logs reward / reward_std of Σ_f w_f r_f whatever multi_objective_aggregation is (normalize_then_sum's
    summed z-scores, which feed the advantages, have mean 0 by construction). Two groups of G = 2, F = 2, weights
    [1, 0.5]: rows (1, 0), (3, 2), (0, 1), (0, 5) ⇒ Σ w r = 1, 4, 0.5, 2.5: mean 2; squares about the mean
    1 + 4 + 2.25 + 0.25 = 7.5 over 3 (Bessel) ⇒ reward_std √2.5 = 1.581139."""
    from groupwise.rewards import combine_rewards

    per_func = torch.tensor([[[1.0, 0.0], [3.0, 2.0]], [[0.0, 1.0], [0.0, 5.0]]])
    comp = Completions(torch.ones(4, 1, dtype=torch.long), torch.ones(4, 1, dtype=torch.long),
                       torch.tensor([[5, 2]] * 4), torch.ones(4, 2, dtype=torch.long), torch.zeros(4, dtype=torch.bool),
                       ["q"] * 4, ["c"] * 4, {})
    for aggregation in ("sum_then_normalize", "normalize_then_sum"):
        args = GRPOConfig(num_generations=2, per_device_train_batch_size=4, reward_weights=[1.0, 0.5],
                          multi_objective_aggregation=aggregation)
        ctx = R.RolloutContext(args=args, tokenizer=None, generator=None, dist=Distributed(), eos_token_ids=[2])
        rewards = combine_rewards(per_func, ctx.reward_weights, aggregation=aggregation)
        scores = Scores(per_func, rewards, ("f", "g"), torch.zeros(2))
        m = round_metrics(ctx, Round(comp, torch.zeros(4), rewards.view(-1), None, None, None, scores))
        assert m["reward"] == 2.0 and abs(m["reward_std"] - 1.581139) < 1e-6, aggregation


def test_a_completion_ended_by_a_stop_string_keeps_its_last_step(tokenizer):
    """Only a cut by max_completion_length leaves the open last step out (score_truncated_step=False). A backend
    that stopped a row early without EOS (a stop string: Generated.lengths < max_completion_length) finished it:
    its last step is judged. Rows (T = 8): "a\\nb" ended by a stop (3 tokens, no EOS) keeps steps a, b; "a\\nbbbbbb"
    cut at 8 tokens loses its open step. Step rewards a → 1, others → 0: group [1, 0] and [1] ⇒ mean 2/3, population
    std √(2/9) = 0.4714 ⇒ b's normalized reward (0 − 2/3) / 0.4714 = −1.4142 lands on its tokens 2 (and nothing
    after: no EOS), a's +0.7071 on tokens 0–1 of both rows: row 0 = [0.7071 − 1.4142] ×2, −1.4142; row 1 = 0.7071 ×2."""
    ctx = _a_is_right(tokenizer)
    texts = ["a\nb", "a\nbbbbbb"]
    pids, pmask = encode_prompts(["q:"] * 2, tokenizer, None)
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert [len(r) for r in rows] == [3, 8]  # one token per character in the tests' tokenizer
    cids = torch.full((2, 8), tokenizer.pad_token_id)
    for i, r in enumerate(rows):
        cids[i, :len(r)] = torch.tensor(r)
    cmask, trunc = completion_masks(cids, [tokenizer.eos_token_id], 8, lengths=torch.tensor([3, 8]))
    assert trunc.tolist() == [True, True]  # TRL's `truncated`: no EOS in either
    comp = Completions(pids, pmask, cids, cmask, trunc, ["q:"] * 2, texts, {})
    steps = R.score_steps(ctx, comp)
    assert steps.texts == [["a", "b"], ["a"]] and steps.ends == [[[1, 2], [1]]]
    adv = R.advantages(ctx, comp, None, steps)
    a, b = 1 / 3 / (2 / 9) ** 0.5, -2 / 3 / (2 / 9) ** 0.5
    assert torch.allclose(adv, torch.tensor([[a + b, a + b, b, 0, 0, 0, 0, 0], [a, a, 0, 0, 0, 0, 0, 0]]), atol=1e-6)
