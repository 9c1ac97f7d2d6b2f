"""Sharding-aware pieces: shard_map dispatch, collectives, grouped matmuls."""
