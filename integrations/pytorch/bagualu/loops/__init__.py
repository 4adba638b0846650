"""The loops: pipeline schedules as scheduling points, the adapter for
torch.distributed.pipelining schedules, and gradient accumulation."""
