"""The names several modules must agree on: mesh axes, remat checkpoint names, jax scopes.

A leaf module (it imports nothing): config validates against the axes, the model and the
kernels tag values with the checkpoint names, the dry run and the planner find collectives
by the scopes. docs/SHARDING.md has the axes; docs/ARCHITECTURE.md the remat policies.
"""

# Mesh axes, outermost (may span scale-up domains) to innermost. `pipeline`, `replica` and
# `context` are in a mesh only when larger than 1. `replica` is derived, not configured: under
# mesh.across_domains=zero1 it is the part of data parallelism that crosses scale-up domains.
MESH_AXES = ("pipeline", "replica", "data", "context", "expert", "tensor")
PIPELINE_AXIS, REPLICA_AXIS, DATA_AXIS, CONTEXT_AXIS, EXPERT_AXIS, TENSOR_AXIS = MESH_AXES
SIZED_MESH_AXES = tuple(a for a in MESH_AXES if a != REPLICA_AXIS)  # the axes mesh.<axis> sizes
OPTIONAL_MESH_AXES = (PIPELINE_AXIS, REPLICA_AXIS, CONTEXT_AXIS)  # left out of a mesh where their size is 1

# Checkpoint names (jax.ad_checkpoint.checkpoint_name) that remat policies save by.
DISPATCH_COUNTS = "moe_dispatch_counts"  # all-gathered per-expert counts (ragged_a2a)
DISPATCH_ROWS = "moe_dispatch_rows"  # rows received for the local experts
FP8_DISPATCH_ROWS = "moe_fp8_dispatch_rows"  # moe.fp8_dispatch: received e4m3 rows and their scales
DISPATCH_META = "moe_dispatch_meta"  # allgather dispatch: gathered expert ids and weights
COMBINE_ROWS = "moe_combine_rows"  # expert outputs back at their token copies
EMULATED_OFFSETS = "ragged_a2a_emulated_offsets"  # the CPU emulation's offset exchange
EXPERT_GATE_UP = "moe_expert_gate_up"  # the grouped gate/up GEMM's output [M, 2F], any backend
FP8_DENSE_OUT = "fp8_dense_out"  # a dense FP8 GEMM's output
ATTENTION_OUT = "attention_out"  # MLA output [B, T, D] before the residual add
SLOT_PARAMS = "pipeline_slot_params"  # one pipeline slot's parameters, sliced from its chunk's
COMM_NAMES = (DISPATCH_COUNTS, DISPATCH_ROWS, FP8_DISPATCH_ROWS, DISPATCH_META, COMBINE_ROWS, EMULATED_OFFSETS)
EXPERT_MATMUL_NAMES = (EXPERT_GATE_UP,)

# model.remat: what the backward pass of a scanned block keeps (maxmoe.model.transformer).
REMAT_CHOICES = ("none", "full", "save_matmuls", "save_comm", "save_moe", "save_dots_comm")
COMM_SAVING_POLICIES = ("save_comm", "save_moe", "save_dots_comm")  # run no collective again backward

# jax scopes (jax.named_scope) the dry run and the planner find collectives by.
LATENT_GATHER = "context_latent_gather"  # context parallelism's latent all-gathers (exposed)
ZERO1_REDUCTION = "reduce_to_zero1"  # the two-tier step's cross-domain gradient reduce-scatter
COMPUTE_COPY, FLOAT32_COPY = "compute_copy", "float32_copy"  # the two-tier step's weight gathers
# jax scopes on the kernels' ops, by which a profile's time is put in classes (maxmoe.analysis.trace_breakdown).
GROUPED_GEMM_SCOPE = "grouped_gemm"  # the routed experts' GEMMs, any backend (maxmoe.kernels.grouped_matmul)
ATTENTION_CORE_SCOPE = "attention_core"  # softmax(q k^T) v, any implementation (maxmoe.model.attention)
