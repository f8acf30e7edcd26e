"""The agent endpoint: OpenAI's Chat Completions over the rollout queue."""
