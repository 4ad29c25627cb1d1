"""Built-in tasks: a prompt dataset plus reward functions, addressable as `builtin:<name>` from the CLI."""

from groupwise.tasks import arithmetic, toy

TASKS = {"arithmetic": arithmetic, "toy": toy}

__all__ = ["TASKS", "arithmetic", "toy"]
