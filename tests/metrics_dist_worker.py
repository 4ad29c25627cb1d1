"""Run under `python -m torch.distributed.run --nproc_per_node 2 tests/metrics_dist_worker.py OUT`: one training
step and one evaluation whose reward function calls log_metric("rank", <this process's rank>) (test_metrics_parity)."""

import os
import sys
from pathlib import Path

from groupwise import GRPOConfig, GRPOTrainer
from groupwise.tasks import toy


def reward(completions, log_metric, **_):
    log_metric("rank", float(os.environ.get("RANK", "0")))
    return [float(len(c)) for c in completions]


if __name__ == "__main__":
    out = Path(sys.argv[1])
    tok = toy.build_tokenizer()
    args = GRPOConfig(output_dir=str(out), num_generations=4, per_device_train_batch_size=4, max_completion_length=6,
                      max_steps=1, save_steps=0, learning_rate=1e-2, logging_steps=1)
    t = GRPOTrainer(toy.build_model(tok, seed=0, hidden_size=32), [reward], args=args, train_dataset=toy.dataset(8),
                    eval_dataset=toy.dataset(2), processing_class=tok)
    t.train()
    t.evaluate()
