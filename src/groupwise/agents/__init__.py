"""Multi-turn rollouts with tools and environments (TRL 1.16's `tools=` / `environment_factory=`; docs/agents.md).

    tools.py      which tools a rollout has: standalone functions, environment methods, the environment pool
    parsing.py    the model's output as a chat message (tool calls parsed); the tokenizer checks
    execution.py  one turn's tool calls, each with a timeout, on a thread per environment instance (ToolThread)
    turns.py      the loop: generate → parse → run tools → append their tokens → generate, batched over rollouts
    sandbox.py    where model-generated code runs (run_python), never in this process
    sandbox_uids.py  the uid of its own each sandbox call gets when the trainer runs as root
"""

from groupwise.agents.tools import Toolbox, default_train_dataset, environment_prompts
from groupwise.agents.turns import Agent, Turns, build_agent

__all__ = ["Agent", "Toolbox", "Turns", "build_agent", "default_train_dataset", "environment_prompts"]
