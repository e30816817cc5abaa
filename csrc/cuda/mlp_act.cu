// CUDA: the MLP activations and their gradients in the input dtype (csrc/mlp_act.h), at the
// copy rate: a 2-D grid-stride loop (rows; 16-byte vectors of a row of a: 8 bf16 / fp16, 4
// float32), each thread loading its vector of g (and u, F apart, and dy for the backward),
// computing in float32 with glu_math.h's / gelu_math.h's math and storing the results with one
// 16-byte store per output (the backward's dg and du side by side in dx's row). Shapes or
// pointers that do not allow aligned vectors take the same loop one element at a time.
#include <algorithm>
#include <cstdint>

#include "../dtype_switch.h"
#include "../gelu_math.h"
#include "../glu_math.h"
#include "../mlp_act.h"
#include "fp8_util.cuh"
#include "vec.cuh"

namespace graphfp8 {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;

template <typename T, int N>
__device__ __forceinline__ void load(const T* p, float (&f)[N]) {
  if constexpr (N == 1) {
    f[0] = cuda::to_float(*p);
  } else {
    cuda::load_vec(p, f);
  }
}

__device__ __forceinline__ uint32_t bits(float v, float) { return __float_as_uint(v); }
template <typename T>
__device__ __forceinline__ uint32_t bits(float v, T) { return cuda::to_bits(v, T{}); }

// Stores N floats rounded to T (torch's CUDA rounding): one 16-byte store for a whole vector.
template <typename T, int N>
__device__ __forceinline__ void store(T* p, const float (&f)[N]) {
  if constexpr (N == 1) {
    *p = cuda::from_float<T>(f[0]);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (sizeof(T) == 4) {
        w[k] = bits(f[k], float{});
      } else {
        w[k] = bits(f[2 * k], T{}) | (bits(f[2 * k + 1], T{}) << 16);
      }
    }
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

template <MlpAct kAct>
constexpr GluAct glu_act() {
  return kAct == MlpAct::kSwiglu ? GluAct::kSwiglu : GluAct::kGeglu;
}

// One launch: a (rows, F) or, with kBackward, dx; N elements per step (1, or a 16-byte vector).
// A 2-D grid-stride loop, rows along y and a row's vectors along x: no division per vector.
template <typename T, MlpAct kAct, bool kBackward, int N>
__global__ void __launch_bounds__(kThreads)
    mlp_act_kernel(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ out,
                   int64_t rows, int64_t cols) {
  constexpr bool kGated = kAct != MlpAct::kGelu;
  const int64_t per_row = cols / N;  // N divides cols (the launcher's choice)
  const int64_t x_stride = kGated ? 2 * cols : cols;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    for (int64_t v = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; v < per_row;
         v += step) {
      const int64_t c = v * N;
      const T* xr = x + r * x_stride + c;
      float g[N], u[N], d[N], o[N], o2[N];
      load(xr, g);
      if constexpr (kGated) load(xr + cols, u);
      if constexpr (kBackward) load(dy + r * cols + c, d);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        if constexpr (!kGated && !kBackward) {
          o[k] = gelu_tanh(g[k], GluTanh{});
        } else if constexpr (!kGated) {
          o[k] = dgelu_tanh(d[k], g[k], GluTanh{});
        } else if constexpr (!kBackward) {
          o[k] = glu_forward<glu_act<kAct>()>(g[k], u[k]);
        } else {
          const GluGrad gd = glu_backward<glu_act<kAct>()>(d[k], g[k], u[k]);
          o[k] = gd.dg;
          o2[k] = gd.du;
        }
      }
      if constexpr (kBackward) {
        store(out + r * x_stride + c, o);
        if constexpr (kGated) store(out + r * x_stride + cols + c, o2);
      } else {
        store(out + r * cols + c, o);
      }
    }
  }
}

template <typename T, MlpAct kAct, bool kBackward>
Status launch(const MlpActParams& p, cudaStream_t stream) {
  constexpr int kN = cuda::Vec<T>::N;
  // Vectors stay inside a row and aligned: F a multiple of the vector, 16-byte aligned tensors.
  const bool vec = p.cols % kN == 0 && cuda::aligned16(p.x) && cuda::aligned16(p.out) &&
                   (p.dy == nullptr || cuda::aligned16(p.dy));
  const int n = vec ? kN : 1;
  // x: enough blocks for a row's vectors; y: rows, up to kBlocksPerSm blocks per SM in all.
  const int64_t gx = cuda::ceil_div(p.cols / n, kThreads);
  const int cap = cuda::grid_size(gx * p.rows, kBlocksPerSm);
  const int64_t gy = std::min<int64_t>({p.rows, std::max<int64_t>(cap / gx, 1), 65535});
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(gx, INT32_MAX)),
                  static_cast<unsigned>(gy));
  const auto* x = static_cast<const T*>(p.x);
  const auto* dy = static_cast<const T*>(p.dy);
  auto* out = static_cast<T*>(p.out);
  if (vec) {
    mlp_act_kernel<T, kAct, kBackward, kN><<<grid, kThreads, 0, stream>>>(x, dy, out, p.rows,
                                                                           p.cols);
  } else {
    mlp_act_kernel<T, kAct, kBackward, 1><<<grid, kThreads, 0, stream>>>(x, dy, out, p.rows,
                                                                          p.cols);
  }
  return cuda::check_launch(kBackward ? "mlp_dact" : "mlp_act");
}

template <typename T, bool kBackward>
Status launch_act(const MlpActParams& p, cudaStream_t stream) {
  switch (p.act) {
    case MlpAct::kGelu: return launch<T, MlpAct::kGelu, kBackward>(p, stream);
    case MlpAct::kSwiglu: return launch<T, MlpAct::kSwiglu, kBackward>(p, stream);
    case MlpAct::kGeglu: return launch<T, MlpAct::kGeglu, kBackward>(p, stream);
  }
  return Status{"mlp_act", "unknown activation"};
}

}  // namespace

Status mlp_act_cuda(const MlpActParams& p, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  GRAPHFP8_SWITCH_HP(p.dtype, "mlp_act", T,
    GRAPHFP8_SWITCH_BOOL(p.dy != nullptr, kBackward,
      return launch_act<T, kBackward>(p, stream);))
  return Status{};
}

}  // namespace graphfp8
