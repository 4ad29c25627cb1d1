"""Write steps.jsonl, the step-labelled data examples/prm.yaml trains a process reward model on, from the demo's
arithmetic task (groupwise.tasks.arithmetic): each line a problem's worked solution, one step per line, with some
lines made wrong (an operand or a result off by a few), labelled 1/0 by the task's own step judge (judge_steps).

    python examples/make_prm_steps.py                    # steps.jsonl, 2000 problems of the training split
    python examples/make_prm_steps.py out.jsonl 500      # another path and size
    groupwise prm train examples/prm.yaml                # then train the PRM (after `make demo`, for its checkpoint)
    python examples/make_prm_steps.py held.jsonl 200 test    # problems of the task's test split
    groupwise prm eval --process_reward_func outputs/prm --eval_file held.jsonl   # the PRM on problems it never saw

Each line also carries its `problem`, the column the task's own step judge reads, so `groupwise prm eval
--process_reward_func groupwise.tasks.arithmetic:step_correct --eval_file held.jsonl` scores that judge (the labels'
source: every score metric 1, except eval/bad_mean_score, its mean score on the wrong steps: 0; eval/unscored 0).
"""

import json
import random
import re
import sys

from groupwise.tasks import arithmetic


def corrupt(line: str, rng: random.Random) -> str:
    """The line made wrong: its running total copied wrong (the first number off by 1-3) or its result off by 1-3
    (an answer line: the answer off)."""
    off = rng.choice([-3, -2, -1, 1, 2, 3])
    if line.startswith("A:"):
        return f"A: {int(line[3:]) + off}"
    m = re.match(r"^(-?\d+)([+-]\d+)=(-?\d+)$", line)
    first, rest, result = int(m.group(1)), m.group(2), int(m.group(3))
    return f"{first + off}{rest}={result}" if rng.random() < 0.5 else f"{first}{rest}={result + off}"


def rows(n: int, seed: int = 0, split: str = "train"):
    rng = random.Random(seed)
    for problem in arithmetic.problems(n, split=split, seed=seed):
        steps = arithmetic.solution_lines(problem)
        if rng.random() < 0.8:  # most solutions carry one wrong line (what a PRM must spot)
            first = rng.randrange(len(steps))
            steps = steps[:first] + [corrupt(s, rng) for s in steps[first:first + 1]] + steps[first + 1:]
        labels = [int(x) for x in arithmetic.judge_steps(problem, steps)]
        yield {"prompt": arithmetic.prompt_of(problem), "steps": steps, "labels": labels, "problem": problem}


def main(path: str = "steps.jsonl", n: int = 2000, split: str = "train") -> None:
    with open(path, "w") as f:
        for row in rows(n, split=split):
            f.write(json.dumps(row) + "\n")
    print(f"wrote {n} problems of the {split} split to {path}")


if __name__ == "__main__":
    main(*(sys.argv[1:2]), *(int(a) for a in sys.argv[2:3]), *(sys.argv[3:4]))
