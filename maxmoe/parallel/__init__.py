"""Parallel strategies: expert dispatch (shard_map + ragged all-to-all), pipeline stages, two-tier
data parallelism (replicas), collectives, and the layout that binds the model's operations to them."""
