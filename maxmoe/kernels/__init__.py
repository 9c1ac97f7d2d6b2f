"""GPU kernels and their choice: grouped GEMMs (XLA ragged_dot, Mosaic GPU, tokamax), attention
cores (chunked, Triton flash, cuDNN), FP8 GEMMs and quantisers, and how `auto` picks among them.
Each kernel runs on one device's arrays; `fp8_dense` and `attention` wrap theirs in shard_map."""
