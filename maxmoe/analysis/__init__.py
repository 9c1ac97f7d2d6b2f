"""Ahead-of-time analysis: the dry run (compile for a target mesh, read memory and collectives),
HLO readers, CUDA lowering checks, the step-time planner and the sweep's ranking of its results
(sweep_plan). Used by maxmoe.sweep and maxmoe.info."""
