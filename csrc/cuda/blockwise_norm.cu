// CUDA: the norm with a blockwise FP8 output (csrc/blockwise_norm.h) in two passes. First the
// norm kernel of norm_fwd.cu with no output (norm_stats_params: mu, rsigma and residual_out
// only, so the same per-row sums as the per-tensor norm); then one 256-thread block per 128x128
// region of z (x, or residual_out) recomputes y = ((z - mu) rsigma) g (+ beta) with norm_fwd.cu's
// roundings, rounds it to the input dtype and quantizes it as blockwise.cu's 1x128 tiles do
// (phase 1: each row's tile; phase 2, with out_t: the columns' tiles from shared memory). Per
// element: 2 bytes of z read twice and the FP8 layouts written, against the unfused path's
// z read, y written, y read (and the layouts written): the bf16 y is never written.
#include <atomic>

#include "../blockwise_norm.h"
#include "../dtype_switch.h"
#include "blockwise_io.cuh"
#include "fp8_util.cuh"
#include "vec.cuh"

namespace graphfp8 {
namespace {

using namespace cuda::blockwise;  // NOLINT: the shared tile constants and I/O

// g (gamma, + 1 when zero-centred) and beta of the four columns at c (zeros past `valid`).
template <typename T>
__device__ __forceinline__ void column_weights(const BlockNormParams& p, int64_t c, int valid,
                                               float (&g)[4], float (&b)[4]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    g[k] = b[k] = 0.0f;
    if (k >= valid) continue;
    g[k] = cuda::to_float(static_cast<const T*>(p.gamma)[c + k]);
    if (p.zero_centered_gamma) g[k] = __fadd_rn(g[k], 1.0f);
    if (p.beta != nullptr) b[k] = cuda::to_float(static_cast<const T*>(p.beta)[c + k]);
  }
}

template <typename T, bool kE4M3, bool kTranspose>
__global__ void __launch_bounds__(kThreads)
    block_norm_kernel(BlockNormParams p, bool vec_z, bool vec_out, bool vec_out_t) {
  extern __shared__ float tile[];  // [kTile][kStride]: y rounded to T, as floats
  __shared__ uint32_t part[2][kTile];
  constexpr float kMax = kE4M3 ? kE4M3Max : kE5M2Max;
  const T* z = static_cast<const T*>(p.residual_out != nullptr ? p.residual_out : p.x);
  const int64_t rows = p.rows, cols = p.hidden;
  const int64_t strip = blockIdx.x, col_tile = blockIdx.y;
  const int64_t r0 = strip * kTile, c0 = col_tile * kTile;
  const int nr = static_cast<int>(rows - r0 < kTile ? rows - r0 : kTile);
  const int nc = static_cast<int>(cols - c0 < kTile ? cols - c0 : kTile);
  const int64_t row_tiles = (rows + kTile - 1) / kTile, col_tiles = (cols + kTile - 1) / kTile;
  const int warp = threadIdx.x / cuda::kWarpSize, lane = threadIdx.x % cuda::kWarpSize;
  const int c = lane * 4, valid = max(0, min(4, nc - c));
  const bool whole = nc == kTile;
  float g[4], b[4];
  column_weights<T>(p, c0 + c, valid, g, b);
  // Phase 1: the rows, all of a warp's loads in flight before any is used.
  constexpr int kRowsPerWarp = kTile / kWarps;
  float f[kRowsPerWarp][4];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp + i * kWarps;
#pragma unroll
    for (int k = 0; k < 4; ++k) f[i][k] = 0.0f;
    if (r < nr) load4(z + (r0 + r) * cols + c0 + c, valid, whole && vec_z, f[i]);
  }
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp + i * kWarps;
    if (r < nr) {  // norm_fwd.cu's norm_row, element by element
      const float mu = p.mu != nullptr ? p.mu[r0 + r] : 0.0f, rsigma = p.rsigma[r0 + r];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        float y = __fmul_rn(__fmul_rn(__fsub_rn(f[i][k], mu), rsigma), g[k]);
        if (p.beta != nullptr) y = __fadd_rn(y, b[k]);
        f[i][k] = k < valid ? cuda::to_float(cuda::from_float<T>(y)) : 0.0f;
      }
    }
    *reinterpret_cast<float4*>(tile + r * kStride + c) =
        make_float4(f[i][0], f[i][1], f[i][2], f[i][3]);
    if (r >= nr) continue;
    uint32_t a = 0u;
#pragma unroll
    for (int k = 0; k < 4; ++k) a = max(a, abs_bits(f[i][k]));
    const float s = block_scale(warp_max(a), kMax, p.power_2_scale);
    if (lane == 0) p.scale_inv[(r0 + r) * col_tiles + col_tile] = 1.0f / s;
    uint8_t q[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) q[k] = cuda::quantize<kE4M3>(f[i][k] * s);
    store4(static_cast<uint8_t*>(p.out) + (r0 + r) * cols + c0 + c, q, valid, whole && vec_out);
  }
  if constexpr (!kTranspose) return;
  __syncthreads();
  // Phase 2: the columns, as rows of out_t (blockwise.cu's phase 2 for 1x128 tiles).
  const int tc = threadIdx.x % kTile, half = threadIdx.x / kTile, h0 = half * (kTile / 2);
  uint32_t a = 0u;
  for (int i = 0; i < kTile / 2; ++i) a = max(a, abs_bits(tile[(h0 + i) * kStride + tc]));
  part[half][tc] = a;
  __syncthreads();
  const float s = block_scale(max(part[0][tc], part[1][tc]), kMax, p.power_2_scale);
  if (half == 0 && tc < nc) p.scale_inv_t[(c0 + tc) * row_tiles + strip] = 1.0f / s;
  if (tc >= nc) return;
  uint8_t* dst = static_cast<uint8_t*>(p.out_t) + (c0 + tc) * rows + r0 + h0;
  const int n = max(0, min(kTile / 2, nr - h0));
  const bool vec = nr == kTile && vec_out_t;
  for (int i0 = 0; i0 < kTile / 2; i0 += 16) {
    uint8_t q[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      q[k] = cuda::quantize<kE4M3>(tile[(h0 + i0 + k) * kStride + tc] * s);
    }
    if (vec) {
      *reinterpret_cast<uint4*>(dst + i0) = pack16(q);
    } else {
      for (int k = 0; k < 16 && i0 + k < n; ++k) dst[i0 + k] = q[k];
    }
  }
}

template <typename T, bool kE4M3, bool kTranspose>
Status launch(const BlockNormParams& p, cudaStream_t stream) {
  // The shared-memory limit is set once per device and kernel (devices < 64), as blockwise.cu.
  auto kernel = block_norm_kernel<T, kE4M3, kTranspose>;
  static std::atomic<uint64_t> done{0};
  int device = 0;
  cudaGetDevice(&device);
  const uint64_t bit = uint64_t{1} << (device & 63);
  if (!(done.load() & bit)) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (err != cudaSuccess) return Status{"block_norm (shared memory)", cudaGetErrorString(err)};
    done.fetch_or(bit);
  }
  const dim3 grid(static_cast<unsigned>(cuda::ceil_div(p.rows, kTile)),
                  static_cast<unsigned>(cuda::ceil_div(p.hidden, kTile)));
  const void* z = p.residual_out != nullptr ? p.residual_out : p.x;
  const bool vec_z = p.hidden % 4 == 0 && cuda::aligned16(z);
  const bool vec_out = p.hidden % 4 == 0 && cuda::aligned16(p.out);
  const bool vec_out_t = p.out_t != nullptr && p.rows % 16 == 0 && cuda::aligned16(p.out_t);
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(p, vec_z, vec_out, vec_out_t);
  return cuda::check_launch("block_norm");
}

}  // namespace

Status block_norm_cuda(const BlockNormParams& p, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  NormParams norm = norm_stats_params(p);  // out == nullptr: mu, rsigma, residual_out
  norm.scale = p.workspace;
  norm.amax = p.workspace + 1;
  norm.scale_inv = p.workspace + 2;
  const Status st = norm_fwd_cuda(norm, stream);
  if (!st.ok()) return st;
  if (cuda::ceil_div(p.hidden, kTile) > 65535) {
    return Status{"block_norm", "more than 65535 column tiles"};
  }
  GRAPHFP8_SWITCH_HP(p.dtype, "block_norm", T,
    GRAPHFP8_SWITCH_FP8(p.out_dtype, "block_norm", kE4M3,
      GRAPHFP8_SWITCH_BOOL(p.out_t != nullptr, kTranspose,
        return launch<T, kE4M3, kTranspose>(p, stream);)))
  return Status{};
}

}  // namespace graphfp8
