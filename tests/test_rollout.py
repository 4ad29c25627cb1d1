import torch

from groupwise import GRPOConfig
from groupwise import rollout as R
from groupwise.distributed import Distributed
from groupwise.text import completion_masks, encode_prompts
from groupwise.rewards.process import load_process_reward_sources
from groupwise.rewards.steps import StepSplitter
from groupwise.types import Completions, Round


def _completions(tokenizer, texts, T=8):
    prompts = ["q:"] * len(texts)
    pids, pmask = encode_prompts(prompts, tokenizer, None)
    cids = torch.full((len(texts), T), tokenizer.pad_token_id)
    for i, text in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        cids[i, :len(ids)] = torch.tensor(ids)
    cmask, trunc = completion_masks(cids, [tokenizer.eos_token_id], T)
    return Completions(pids, pmask, cids, cmask, trunc, prompts, texts, {})


def test_process_advantages_through_the_rollout_by_hand(tokenizer):
    """One group of G = 2: "a\\nb" (steps a, b) and "\\n" (no steps).
    Step rewards: a → 1, b → 0 ⇒ R = [1, 0], mean 0.5, population std 0.5 ⇒ r̃ = [+1, −1] (eps 0).
    Tokens of completion 0: a(0) \\n(1) b(2) <eos>(3); step a ends at 1, step b at the EOS (3):
    A = [1 − 1, 1 − 1, −1, −1] = [0, 0, −1, −1], then 0. Completion 1 has no steps: all 0, counted."""
    args = GRPOConfig(num_generations=2, per_device_train_batch_size=2, max_completion_length=8, supervision="process",
                      advantage_eps=0.0)
    reward = lambda steps, **_: [[1.0 if s == "a" else 0.0 for s in row] for row in steps]  # noqa: E731
    ctx = R.RolloutContext(args=args, tokenizer=tokenizer, generator=None, dist=Distributed(),
                           eos_token_ids=[tokenizer.eos_token_id], process_sources=load_process_reward_sources([reward]),
                           splitter=StepSplitter())
    comp = _completions(tokenizer, ["a\nb", "\n"])
    steps = R.score_steps(ctx, comp)
    assert steps.texts == [["a", "b"], []] and steps.ends == [[[1, 3], []]]
    adv = R.advantages(ctx, comp, None, steps)
    assert torch.equal(adv, torch.tensor([[0.0, 0.0, -1.0, -1.0, 0, 0, 0, 0], [0.0] * 8]))
    metrics = R.round_metrics(ctx, Round(comp, adv, torch.full((2,), float("nan")), None, None, None, None, steps))
    assert metrics["process/no_step_completions"] == 1.0 and metrics["process/steps_per_completion"] == 1.0
    assert metrics["process/step_reward_mean"] == 0.5 and metrics["process/zero_std_groups"] == 0.0
