// GRAPHFP8_HOST_DEVICE: a function that the CPU (.cpp) and CUDA (.cu) kernels both compile, for
// math that the two must compute bit for bit alike (gelu_math.h, scale_math.h).
#pragma once

#ifdef __CUDACC__
#define GRAPHFP8_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define GRAPHFP8_HOST_DEVICE inline
#endif
