"""Run under `python -m torch.distributed.run --nproc_per_node N tests/vllm_server_worker.py OUT` (or plainly for N=1)
with the stand-in `vllm` on PYTHONPATH: a GRPOTrainer run in vLLM server mode against the stand-in server at
$STANDIN_URL (tests/test_vllm_server.py starts it), 8 rows per round over all processes, then an evaluation of 5
prompts in batches of 2 (with 2 processes: 2 batches on one, 1 on the other), then one step with a tool whose
rollouts take 2 turns for one prompt and 1 for the other (the server scripts them: with 2 processes one process runs
more turns than the other). Writes result_<rank>.json (the logged losses and rewards, the rows this process trained
on, the evaluation's metrics, the tool step's metrics) and, from rank 0, weights.safetensors."""

import dataclasses
import json
import os
import sys
from pathlib import Path

from safetensors.torch import save_file

from groupwise import GRPOConfig, GRPOTrainer
from groupwise.tasks import toy


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def main(out: Path) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = GRPOConfig(output_dir=str(out), use_vllm=True, vllm_mode="server",
                      vllm_server_base_url=os.environ["STANDIN_URL"],
                      vllm_group_port=int(os.environ["STANDIN_GROUP_PORT"]), vllm_server_timeout=10.0,
                      num_generations=4, per_device_train_batch_size=8 // world, max_completion_length=6, max_steps=2,
                      learning_rate=1e-2, logging_steps=1, save_steps=0, lr_scheduler_type="constant", seed=0,
                      per_device_eval_batch_size=2, ddp_timeout=60.0)
    seen = []

    def length(completions, **_):  # varied rewards: every step moves the weights
        seen.extend(completions)
        return [float(len(c)) for c in completions]

    t = GRPOTrainer(os.environ["BASE_DIR"], [length], args=args, train_dataset=toy.dataset(16),
                    eval_dataset=toy.dataset(5, seed=1))
    t.train()
    trained = list(seen)
    evaluation = t.evaluate()
    t.rollout_ctx.generator.close()
    lines = [{k: h[k] for k in ("loss", "reward") if k in h} for h in t.state.log_history if "loss" in h]
    if t.dist.is_main:
        save_file({k: v.detach().clone() for k, v in t.unwrapped.state_dict().items()}, str(out / "weights.safetensors"))
    tools = dataclasses.replace(args, output_dir=str(out / "tools"), max_steps=1, max_completion_length=200,
                                max_tool_calling_iterations=2, vllm_group_port=args.vllm_group_port + 1)
    chat = [{"prompt": [{"role": "user", "content": text}]} for text in ("call the tool", "answer directly")]
    t = GRPOTrainer(os.environ["BASE_DIR"], [length], args=tools, train_dataset=chat, tools=[multiply])
    t.train()
    t.rollout_ctx.generator.close()
    tool_line = next(h for h in t.state.log_history if "loss" in h)
    (out / f"result_{t.dist.rank}.json").write_text(json.dumps({"lines": lines, "completions": trained,
                                                                      "eval": evaluation, "tools": tool_line}))


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    main(out)
