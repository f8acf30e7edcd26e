"""Reading rollouts into training: shards followed as they commit (`follow`), agent trajectories
(`trajectories`, `trajectory_batches`), torch datasets and collation (`torch_data`), importance
weights (`importance`). Reading a run whole is `pipeline.core.shards`; a submitted run's handle is
`pipeline.runs`."""
