import atexit
import os

# No test reaches the Hugging Face hub: an id that gets as far as a download fails at once, where a machine with no
# network spent ~25 s in huggingface_hub's retries first (read when huggingface_hub is imported, so before any import)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from groupwise.tasks import toy

torch.set_num_threads(2)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# trackio reads its store's folder once, when imported: a run with report_to trackio (or 'all') writes here, not to
# the user's ~/.cache/huggingface/trackio; subprocesses inherit it (a worker importing this module keeps its parent's:
# a worker killed by a fault test would leave its own folder behind)
if not Path(os.environ.get("TRACKIO_DIR", "")).name.startswith("groupwise-trackio-"):
    os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="groupwise-trackio-")
    atexit.register(shutil.rmtree, os.environ["TRACKIO_DIR"], ignore_errors=True)


@pytest.fixture
def tokenizer():
    return toy.build_tokenizer()


@pytest.fixture
def tiny_model(tokenizer):
    return toy.build_model(tokenizer, seed=0, hidden_size=32)


@pytest.fixture
def model_dir(tmp_path, tokenizer, tiny_model):
    """A tiny model + tokenizer saved as a real local checkpoint folder."""
    path = tmp_path / "tiny-model"
    tiny_model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture
def base_dir(tmp_path, tokenizer):
    """A small policy (hidden 32) and its tokenizer saved to a folder: for what loads a model from a path."""
    from groupwise.tasks import toy

    path = tmp_path / "base"
    toy.build_model(tokenizer, seed=0, hidden_size=32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tr_dpo_fsdp_runs(tmp_path_factory):
    """(straight, crashed) folders of tests.fsdp_support.tr_dpo_runs, launched once for the FSDP2 resume tests
    (test_fsdp.py, test_fsdp_ref_audit.py): each copies the crashed run before resuming it, leaving these as they
    are."""
    from tests.fsdp_support import tr_dpo_runs

    return tr_dpo_runs(tmp_path_factory.mktemp("tr_dpo_fsdp"))


def training_lines(path) -> list[str]:
    """metrics.jsonl's lines without the end-of-training line (total_flos, train_runtime, …; logged last by every
    train())."""
    return [x for x in Path(path).read_text().splitlines() if '"total_flos"' not in x]


def small_args(tmp_path, **kw):
    from groupwise import GRPOConfig

    base = dict(output_dir=str(tmp_path / "out"), num_generations=4, per_device_train_batch_size=8,
                max_completion_length=6, max_steps=2, learning_rate=1e-2, logging_steps=1, save_steps=0, seed=0,
                lr_scheduler_type="constant")
    base.update(kw)
    return GRPOConfig(**base)
