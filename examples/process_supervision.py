"""Process supervision (DeepSeekMath §4.1.3) with your own step-reward function, offline: the demo's arithmetic
policy ships inside the package.

    python examples/process_supervision.py
A step-reward function gets `steps` (the step texts of each completion) and returns one float (or None) per step.
With supervision="both" the token advantage is w_o · outcome + w_p · Σ_{steps ending at or after t} r̃.
"""

from transformers import AutoModelForCausalLM, AutoTokenizer

from groupwise import GRPOConfig, GRPOTrainer
from groupwise.demo import POLICY_DIR
from groupwise.tasks import arithmetic


def line_is_right(prompts, completions, steps, problem, **kwargs):
    """1.0 for a line that is the correct next line of the worked solution, else 0.0."""
    return [arithmetic.judge_steps(p, row) for p, row in zip(problem, steps)]


def main(**overrides):
    args = GRPOConfig(**{"output_dir": "outputs/example-process", "overwrite_output_dir": True, "supervision": "both",
                         "outcome_advantage_weight": 1.0, "process_advantage_weight": 0.5, "num_generations": 8,
                         "per_device_train_batch_size": 64, "max_completion_length": 48, "max_prompt_length": None,
                         "temperature": 0.7, "learning_rate": 5e-5, "max_steps": 30, "eval_steps": 15,
                         "eval_strategy": "steps", "eval_on_start": True, "logging_steps": 5,
                         "lr_scheduler_type": "constant", "log_completions": True, "num_completions_to_print": 1,
                         **overrides})
    trainer = GRPOTrainer(AutoModelForCausalLM.from_pretrained(POLICY_DIR), [arithmetic.accuracy], args=args,
                          train_dataset=arithmetic.dataset(2000), eval_dataset=arithmetic.dataset(100, split="test"),
                          processing_class=AutoTokenizer.from_pretrained(POLICY_DIR),
                          process_reward_funcs=[line_is_right])
    trainer.train()
    return trainer


if __name__ == "__main__":
    main()
