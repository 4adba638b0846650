"""Planning: the governor (daemon over gRPC or the embedded planner), the model document built
from a captured micro-batch, and the per-micro-batch plans of this process."""
