"""Engine outputs to shard rows: the stop/logprob contracts, continuations, the Arrow table, the shard writer."""
