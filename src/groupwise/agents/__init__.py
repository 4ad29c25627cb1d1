"""Multi-turn rollouts with tools and environments."""
