"""Run under `python -m torch.distributed.run --nproc_per_node 2 tests/checkpoint_audit_worker.py OUT`: a run whose
first checkpoint cannot be written on rank 1 (its disk is full)."""

import os
import sys
from pathlib import Path

import groupwise.checkpoint as C
import groupwise.checkpoint_files as F
from groupwise import GRPOConfig, GRPOTrainer
from groupwise.tasks import toy


def main(out: Path) -> None:
    real = C.save_file

    def full_disk(tensors, path, *a, **k):
        if int(os.environ.get("RANK", "0")) == 1:
            raise OSError(28, "No space left on device")
        return real(tensors, path, *a, **k)

    C.save_file = F.save_file = full_disk  # rank 1 writes its RNG state (checkpoint_files) first
    tok = toy.build_tokenizer()
    args = GRPOConfig(output_dir=str(out), num_generations=4, per_device_train_batch_size=4, max_completion_length=6,
                      max_steps=2, save_steps=1, learning_rate=1e-2, ddp_timeout=60)
    GRPOTrainer(toy.build_model(tok, seed=0, hidden_size=32), [toy.letter_reward], args=args,
                train_dataset=toy.dataset(16), processing_class=tok).train()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
