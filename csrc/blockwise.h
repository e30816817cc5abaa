// Params, scale math and launchers of the blockwise FP8 quantizers (docs/fp8.md, "Blockwise
// scaling"): one fused pass per operand instead of graphfp8/ops/blockwise.py's torch ops, which
// stay as the twin. No torch headers (see common.h).
//
// x (rows, cols) row-major in tiles of block_rows x 128 (block_rows 1: 1x128 tiles along cols,
// 128: 128x128 blocks); a partial last tile takes its amax over the elements it has. Per tile,
// with a = max |x| over it (NaN if any element is NaN):
//   s = fp8_max / a (a finite and > 0), else 1;  an infinite s -> FLT_MAX;
//   s = 2^floor(log2(s)) when power_2_scale (the mantissa bits cleared);
//   out = saturate(x * s) (float32 product; NaN -> the canonical 0x7F), scale_inv = 1 / s.
// With out_t: block_rows 1 also quantizes x^T (cols, rows) in its own 1x128 tiles (along rows)
// from the same read, scale_inv_t (cols, ceil(rows / 128)); block_rows 128 writes out^T and the
// transposed block scales (ceil(cols / 128), ceil(rows / 128)): a block is its transpose's block.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "host_device.h"

namespace graphfp8 {

constexpr int64_t kBlockTile = 128;

// The FP8 layouts a blockwise quantization writes: x's tiles or blocks and, with out_t, those
// of x^T (the module comment's layouts), shared by block_quantize and the fused ops that
// quantize their output in 1x128 tiles (blockwise_norm.h, blockwise_act.h).
struct BlockOut {
  void* out;             // (rows, cols), out_dtype (FP8)
  float* scale_inv;      // (ceil(rows / block_rows), ceil(cols / 128))
  void* out_t;           // (cols, rows), out_dtype, or nullptr
  float* scale_inv_t;    // with out_t: the module comment's transposed scales
  DType out_dtype;       // E4M3 or E5M2
  bool power_2_scale;
};

struct BlockQuantizeParams {
  const void* x;         // (rows, cols), x_dtype, contiguous
  DType x_dtype;         // float32, bfloat16 or float16
  BlockOut dst;
  const float* noop;     // (1,) or nullptr: when *noop == 1 nothing is written
  int64_t rows;
  int64_t cols;
  int64_t block_rows;    // 1 or 128
  bool staged;           // CUDA: the staged kernel where it applies (BLOCK_QUANTIZE_STAGED)
};

// Bytes per element of a high-precision dtype (float32, bfloat16, float16).
inline int64_t hp_bytes(DType t) { return t == DType::kFloat32 ? 4 : 2; }

// block_quantize of y (rows, cols) in 1x128 tiles into dst: the CPU fused ops' second step (a
// host scratch holding their high-precision output).
inline BlockQuantizeParams tile_quantize_params(const void* y, DType y_dtype, const BlockOut& dst,
                                                int64_t rows, int64_t cols) {
  BlockQuantizeParams q{};
  q.x = y;
  q.x_dtype = y_dtype;
  q.dst = dst;
  q.rows = rows;
  q.cols = cols;
  q.block_rows = 1;
  return q;
}

// The bits of max |x| over a tile: the largest bit pattern of |x| (an unsigned compare orders
// non-negative floats, with every NaN above inf), so a tile holding a NaN reports a NaN.
GRAPHFP8_HOST_DEVICE uint32_t abs_bits(float v) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(v) & 0x7FFFFFFFu;
#else
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return b & 0x7FFFFFFFu;
#endif
}

// The scale of a tile from abs_bits' maximum (the module comment's rule).
GRAPHFP8_HOST_DEVICE float block_scale(uint32_t amax_bits, float fp8_max, bool power_2_scale) {
  float s = 1.0f;
  if (amax_bits > 0u && amax_bits < 0x7F800000u) {  // finite and > 0
#ifdef __CUDA_ARCH__
    s = fp8_max / __uint_as_float(amax_bits);
    if (isinf(s)) s = FLT_MAX;
#else
    float a;
    std::memcpy(&a, &amax_bits, sizeof(a));
    s = fp8_max / a;
    if (std::isinf(s)) s = FLT_MAX;
#endif
  }
  if (power_2_scale) {
#ifdef __CUDA_ARCH__
    s = __uint_as_float(__float_as_uint(s) & 0x7F800000u);
#else
    uint32_t b;
    std::memcpy(&b, &s, sizeof(b));
    b &= 0x7F800000u;
    std::memcpy(&s, &b, sizeof(s));
#endif
  }
  return s;
}

// Per-block statistics of one blockwise quantization (graphfp8/ops/blockwise_stats.py sums
// them): one row of kBlockStatsColumns float64 per tile or block b of scale_inv (row-major):
//   amax (max |x|, NaN if any element is NaN), saturated (|x| / scale_inv > fp8_max), underflow
//   (x != 0 and x_fp8 == 0), nonzero (x != 0), signal (sum x^2), noise (sum (x - x_fp8
//   scale_inv)^2), scale_inv; all in float64, each block summed in a fixed order.
// Nothing is written while *enabled == 0 (the numerics report's device flag: a graph holds the
// kernel and a replay with the report off runs it empty).
constexpr int64_t kBlockStatsColumns = 7;

struct BlockStatsParams {
  const void* x;             // (rows, cols), x_dtype
  DType x_dtype;
  const uint8_t* x_fp8;      // (rows, cols), fp8_dtype
  DType fp8_dtype;
  const float* scale_inv;    // (ceil(rows / block_rows), ceil(cols / 128))
  const float* enabled;      // (1,)
  double* out;               // (scale_inv's numel, kBlockStatsColumns)
  int64_t rows;
  int64_t cols;
  int64_t block_rows;        // 1 or 128
};

// Launchers assume csrc/ops/'s checks passed and a non-empty x.
Status block_quantize_cpu(const BlockQuantizeParams& p);
Status block_quantize_cuda(const BlockQuantizeParams& p, void* stream);
Status block_stats_cpu(const BlockStatsParams& p);
Status block_stats_cuda(const BlockStatsParams& p, void* stream);

}  // namespace graphfp8
