"""After generation: reading shards back (whole, followed, batched, as tensors), take, cancel, rewards."""
