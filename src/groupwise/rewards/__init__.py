"""Reward sources (functions, outcome reward models) and how several are combined."""

from groupwise.rewards.combine import combine_rewards
from groupwise.rewards.math import accuracy_reward, reasoning_accuracy_reward
from groupwise.rewards.shaping import get_soft_overlong_punishment, think_format_reward
from groupwise.rewards.sources import RewardFunctionError, RewardSource, compute_rewards, load_reward_sources

__all__ = ["RewardFunctionError", "accuracy_reward", "RewardSource", "combine_rewards", "compute_rewards",
           "get_soft_overlong_punishment", "load_reward_sources", "reasoning_accuracy_reward", "think_format_reward"]
