"""groupwise: GRPO with outcome and process supervision (DeepSeekMath §4.1).

    from groupwise import GRPOConfig, GRPOTrainer   # instead of `from trl import …`

Importing groupwise never imports vllm, wandb or deepspeed; the trainer (and transformers) load on first use.
"""

from groupwise.config import ConfigError, GRPOConfig

__version__ = "0.1.0"
__all__ = ["ConfigError", "GRPOConfig", "GRPOTrainer", "__version__"]


def __getattr__(name):
    if name == "GRPOTrainer":
        from groupwise.trainer import GRPOTrainer

        return GRPOTrainer
    raise AttributeError(f"module 'groupwise' has no attribute {name!r}")
