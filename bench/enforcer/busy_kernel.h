// A compute-bound kernel that runs for about `iterations` dependent FMAs per thread.
#pragma once

#include <cuda_runtime_api.h>

void launch_busy_kernel(cudaStream_t stream, int iterations);
