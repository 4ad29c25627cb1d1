"""Built-in tasks: a prompt dataset plus reward functions (or an environment that owns its rewards), addressable as
`builtin:<name>` from the CLI."""

from groupwise.tasks import arithmetic, calculator, toy

TASKS = {"arithmetic": arithmetic, "calculator": calculator, "toy": toy}

__all__ = ["TASKS", "arithmetic", "calculator", "toy"]
