// The 128x64 FP8 transpose tile shared by the cast-transpose kernels: its shape and the shared
// memory swizzle that keeps the transposed reads free of bank conflicts.
#pragma once

namespace graphfp8::cuda {

// Vector-path tile: 128 rows x 64 columns. Its transpose is 64 rows of 128 bytes, so every warp
// of the transposed phase writes whole 128-byte lines.
constexpr int kVecRows = 128;
constexpr int kVecCols = 64;

// Shared tile row r holds 64 FP8 bytes as four 16-byte units; unit u of row r is stored at
// u ^ ((r / 32) & 3), so that the four 32-row quarters read in the transposed phase fall in
// different banks.
__device__ __forceinline__ int swizzle(int r, int byte) {
  return ((((byte >> 4) ^ (r >> 5)) & 3) << 4) | (byte & 15);
}

}  // namespace graphfp8::cuda
