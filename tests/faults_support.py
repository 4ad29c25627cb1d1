"""Shared by the fault-injection tests (tests/test_faults.py, tests/test_faults_checkpoints.py): a reward that
trains every step, a command-line config on a tiny model, the CLI's exit code and first message line, a trainer on
the toy task, and a script run in a process of its own."""

import json
import textwrap
from pathlib import Path

import yaml

from groupwise import GRPOTrainer
from groupwise.cli import main
from groupwise.tasks import toy
from tests.conftest import small_args
from tests.launcher import Launch, start

ROOT = Path(__file__).parents[1]


def _length(completions, **_):  # spread in every group, so every step trains
    return [float(len(c)) for c in completions]


def _config(tmp_path, model_dir, rows=None, **extra) -> str:
    data = tmp_path / "prompts.jsonl"
    rows = rows if rows is not None else [{"prompt": f"repeat {c}:", "letter": c} for c in "abcdabcd"]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"model_name_or_path": model_dir, "dataset_name": str(data), "reward_funcs": ["tests.faults_support:_length"],
           "num_generations": 4, "per_device_train_batch_size": 8, "max_completion_length": 5, "logging_steps": 1,
           "output_dir": str(tmp_path / "run"), "learning_rate": 1e-3, **extra}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _exit_and_first_line(capsys, argv) -> tuple[int, str]:
    code = main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("groupwise:")]
    return code, err[0] if err else ""


def _trainer(tmp_path, tokenizer, out="run", reward=_length, **kw):
    args = small_args(tmp_path, output_dir=str(tmp_path / out), **kw)
    return GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [reward], args=args,
                       train_dataset=toy.dataset(12), processing_class=tokenizer)


def _run_script(tmp_path, body: str) -> Launch:
    """`body` as a script started in a process of its own (tests/launcher.py: forked with groupwise imported)."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return start(script, nproc=1)
