"""Built-in tasks: a prompt dataset plus reward functions, addressable as `builtin:<name>` from the CLI."""

from groupwise.tasks import toy

TASKS = {"toy": toy}

__all__ = ["TASKS", "toy"]
