"""The TRL scripts under examples/trl/ run as they are (TRL's code with the import line changed and a tiny local
model), each as `__main__` in a fresh folder, as a user would run them (the quickstart in a new interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import training_lines
from tests.launcher import torchrun

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "trl"


def _run(script: str, cwd: Path, fresh: bool = False) -> None:
    """`python examples/trl/SCRIPT` in `cwd`: `fresh`, a new interpreter as a user starts it; otherwise forked from
    tests/launcher.py's server, which imported torch, transformers and groupwise already (the same run, ~5 s less)."""
    env = {"PYTHONPATH": os.pathsep.join([str(EXAMPLES.parent.parent / "src"), os.environ.get("PYTHONPATH", "")]),
           "TQDM_DISABLE": "1"}
    if fresh:
        proc = subprocess.run([sys.executable, str(EXAMPLES / script)], cwd=cwd, env={**os.environ, **env},
                              capture_output=True, text=True, timeout=600)
    else:
        proc = torchrun(EXAMPLES / script, nproc=1, env=env, cwd=cwd, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in training_lines(path)]


@pytest.mark.slow
def test_quickstart(tmp_path):
    _run("quickstart.py", tmp_path, fresh=True)
    out = tmp_path / "outputs" / "groupwise"  # GRPOConfig's default output_dir
    assert (out / "checkpoint-12").is_dir()  # 4 prompts × 3 epochs (TRL's num_train_epochs), 1 prompt per step
    rows = _lines(out / "completions.jsonl")
    # accuracy_reward scored every row and logged TRL's extra columns through log_extra
    assert rows and all("accuracy_reward" in r["rewards"] and "gold_parsed" in r for r in rows)


@pytest.mark.slow
def test_async_reward(tmp_path):
    _run("async_reward.py", tmp_path)
    last = _lines(tmp_path / "async-reward" / "metrics.jsonl")[-1]
    for name in ("reward_func", "async_reward_func1", "async_reward_func2"):
        assert last[f"rewards/{name}/errors"] == 0.0 and last[f"rewards/{name}/mean"] == last[f"rewards/{name}/mean"]
    assert last["rewards/async_reward_func1/mean"] == 1.0  # every completion non-empty


@pytest.mark.slow
def test_trainer_state_reward(tmp_path):
    _run("trainer_state_reward.py", tmp_path)
    lines = _lines(tmp_path / "curriculum" / "metrics.jsonl")
    # log_metric: progress = global_step / max_steps when the step's rewards were computed (steps 0, 1, 2 of 3)
    assert [round(x["curriculum/progress"], 4) for x in lines] == [0.0, 0.3333, 0.6667]
    assert all("exact" in r for r in _lines(tmp_path / "curriculum" / "completions.jsonl"))


@pytest.mark.slow
def test_tools(tmp_path):
    _run("tools.py", tmp_path)
    lines = _lines(tmp_path / "tools" / "metrics.jsonl")
    assert [x["step"] for x in lines] == [1, 2]
    # tools/* are logged (TRL's names) and only model tokens count in the lengths
    assert all("tools/call_frequency" in x and "tools/failure_frequency" in x for x in lines)
    assert all(x["rewards/correctness_reward/errors"] == 0.0 for x in lines)
    rows = _lines(tmp_path / "tools" / "completions.jsonl")
    assert rows and all(isinstance(r["completion"], list) and r["completion"][0]["role"] == "assistant" for r in rows)


@pytest.mark.slow
def test_trls_own_grpo_script_with_its_imports_switched(tmp_path):
    """TRL 1.16's scripts/grpo.py (`trl grpo`), its two imports of GRPOConfig / GRPOTrainer switched to groupwise,
    everything else TRL's (TrlParser with ScriptArguments, ModelConfig and DatasetMixtureConfig, get_dataset,
    get_peft_config, its reward registry, trainer.end()): it trains with LoRA from a local model and data folder and
    exits 0 (it exited 1: no trainer.end(); before that TrlParser could not even build)."""
    import trl.scripts.grpo as trl_grpo

    from groupwise.tasks import toy

    source = Path(trl_grpo.__file__).read_text()
    switched = source.replace("    from trl import GRPOTrainer, get_dataset,",
                              "    from groupwise import GRPOTrainer\n    from trl import get_dataset,")
    switched = switched.replace("    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig, TrlParser",
                                "    from groupwise import GRPOConfig\n"
                                "    from trl import DatasetMixtureConfig, ModelConfig, TrlParser")
    assert switched.count("from groupwise import") == 2, "TRL's grpo.py changed its imports"
    script = tmp_path / "grpo.py"
    script.write_text(switched)
    toy.save_tiny_model(str(tmp_path / "model"))
    (tmp_path / "data").mkdir()
    toy.math_dataset(8).to_json(str(tmp_path / "data" / "train.jsonl"))
    args = ["--model_name_or_path", "model", "--dataset_name", "data", "--output_dir", "out", "--max_steps", "2",
            "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "8",
            "--bf16", "false", "--report_to", "none", "--logging_steps", "1", "--save_steps", "1",
            "--reward_funcs", "think_format_reward", "--use_peft", "--lora_r", "8"]
    proc = torchrun(script, *args, nproc=1, cwd=tmp_path, timeout=600,
                    env={"TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1",
                         "PYTHONPATH": os.pathsep.join([str(EXAMPLES.parent.parent / "src"),
                                                        os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    assert (out / "adapter_model.safetensors").exists() and (out / "checkpoint-2").is_dir()
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 8  # ModelConfig's --lora_r reached it
    assert [x["step"] for x in _lines(out / "metrics.jsonl")] == [1, 2]
