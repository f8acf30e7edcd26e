"""Reading rollouts into training: shards followed as they commit (`follow`), agent trajectories
(`trajectories`, one per lineage of a session's tree of calls: `call_tree`, `lineage_rows`; episode runs
`episodes`; `trajectory_batches`),
lineages as trees packed into one sequence (`trees`, `tree_packing`), torch datasets and collation
(`torch_data`), importance weights (`importance`). Reading a run whole is `pipeline.core.shards`; a
submitted run's handle is `pipeline.runs`."""
