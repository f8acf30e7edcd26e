"""Scoring committed shards with a run's reward function (`pipeline reward-worker`)."""
