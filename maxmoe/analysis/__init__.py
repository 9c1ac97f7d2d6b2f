"""Ahead-of-time analysis: the dry run (compile for a target mesh, read memory and collectives),
HLO readers, CUDA lowering checks and the step-time planner. Used by maxmoe.sweep and maxmoe.info."""
