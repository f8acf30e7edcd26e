"""Bridges from trainer libraries to the pipeline: `trl` (TRL's `GRPOTrainer`); `push` (a model's weights
to the pool's workers). Each module imports its library only when used: `import pipeline` loads none."""
