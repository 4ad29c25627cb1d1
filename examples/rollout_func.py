"""A custom rollout with TRL's `rollout_func`: a two-turn exchange with an environment, fully offline.

    python examples/rollout_func.py

The function samples every completion itself: the model answers the prompt, the environment replies " again:",
the model answers once more. It returns TRL's keys: the token ids, the sampler's log-prob of each completion token,
`env_mask` (0 on the environment's tokens, which are context and never trained on; each run of 1s is one assistant
turn, so `step_split="turn"` works too) and an extra key, `second_turn`, that reaches the reward function as a
keyword. groupwise scores and trains on the output as on its own samples (docs/trl_compat.md, "rollout_func").
Replace `trainer.model.generate` with your engine (a vLLM server, an agent loop) for real work. Ten steps show the
mechanics in about 20 s on a CPU; the tiny random model's reward stays near chance that early (a few hundredths:
0.03-0.05 in a run).
"""

import torch

from groupwise import GRPOConfig, GRPOTrainer
from groupwise.tasks import toy

FEEDBACK = " again:"  # the environment's reply between the two assistant turns


def sample(model, tokenizer, rows: list[list[int]], max_new_tokens: int, temperature: float):
    """One sampled continuation per row of token ids (transformers' generate): its tokens, cut after the first EOS,
    and the sampler's log-prob of each (log-softmax of the logits at `temperature`, nothing truncated)."""
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), do_sample=True,
                         top_k=0, top_p=1.0, temperature=temperature, max_new_tokens=max_new_tokens,
                         output_scores=True, return_dict_in_generate=True, pad_token_id=pad)
    logps = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    tokens, logprobs = [], []
    for row, lps in zip(out.sequences[:, width:].tolist(), logps.tolist()):
        n = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
        tokens.append(row[:n])
        logprobs.append(lps[:n])
    return tokens, logprobs


def rollout_func(prompts, trainer):
    """prompts: this process's rows (each prompt num_generations times); one completion per row."""
    tokenizer, args, model = trainer.processing_class, trainer.args, trainer.model
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    feedback = tokenizer(FEEDBACK, add_special_tokens=False)["input_ids"]
    turn = (args.max_completion_length - len(feedback)) // 2  # the two turns and the reply fit the budget
    first, first_lp = sample(model, tokenizer, prompt_ids, turn, args.temperature)
    second, second_lp = sample(model, tokenizer, [p + f + feedback for p, f in zip(prompt_ids, first)], turn,
                               args.temperature)
    return {
        "prompt_ids": prompt_ids,
        "completion_ids": [f + feedback + s for f, s in zip(first, second)],
        "logprobs": [f + [None] * len(feedback) + s for f, s in zip(first_lp, second_lp)],  # None: not sampled
        "env_mask": [[1] * len(f) + [0] * len(feedback) + [1] * len(s) for f, s in zip(first, second)],
        "second_turn": tokenizer.batch_decode(second, skip_special_tokens=True),
    }


def second_turn_reward(completions, second_turn, letter, **kwargs):
    """The share of the prompt's letter in the answer after the environment's reply."""
    return [text.count(c) / len(text) if text else 0.0 for text, c in zip(second_turn, letter)]


def main(**overrides):
    tokenizer = toy.build_tokenizer()
    model = toy.build_model(tokenizer, seed=0)
    args = GRPOConfig(**{"output_dir": "outputs/example-rollout-func", "overwrite_output_dir": True,
                         "num_generations": 8, "per_device_train_batch_size": 32, "max_completion_length": 23,
                         "max_steps": 10, "learning_rate": 1e-2, "logging_steps": 5, "lr_scheduler_type": "constant",
                         **overrides})
    trainer = GRPOTrainer(model, second_turn_reward, args=args, train_dataset=toy.dataset(128),
                          processing_class=tokenizer, rollout_func=rollout_func)
    result = trainer.train()
    print(f"final mean reward {result['reward']:.3f}")
    return trainer


if __name__ == "__main__":
    main()
