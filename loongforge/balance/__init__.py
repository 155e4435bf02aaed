"""Data-parallel load balancing: the compute-cost model and the step planner (pure numpy, no torch.distributed)."""
