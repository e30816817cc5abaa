// CPU kernel of the blockwise quantization statistics (csrc/blockwise.h, BlockStatsParams):
// one row of float64 partial sums per tile or block, each summed in row-major element order.
// graphfp8/ops/blockwise_stats.py reduces the rows; its torch-op twin sums in torch's order, so
// the sums agree to rounding and every count, amax and scale exactly (the tests check both).
#include <algorithm>
#include <cmath>

#include "../blockwise.h"
#include "../dtype_switch.h"
#include "fp8_convert.h"

namespace graphfp8 {
namespace {

template <typename T, bool kE4M3>
void stats_blocks(const BlockStatsParams& p) {
  const auto* x = static_cast<const T*>(p.x);
  const double limit = kE4M3 ? kE4M3Max : kE5M2Max;
  const int64_t col_tiles = (p.cols + kBlockTile - 1) / kBlockTile;
  const int64_t row_tiles = (p.rows + p.block_rows - 1) / p.block_rows;
  for (int64_t i = 0; i < row_tiles; ++i) {
    for (int64_t j = 0; j < col_tiles; ++j) {
      const int64_t b = i * col_tiles + j;
      const double inv = p.scale_inv[b];
      double amax = 0.0, sat = 0.0, under = 0.0, nonzero = 0.0, signal = 0.0, noise = 0.0;
      const int64_t r1 = std::min(p.rows, (i + 1) * p.block_rows);
      const int64_t c0 = j * kBlockTile, c1 = std::min(p.cols, c0 + kBlockTile);
      for (int64_t r = i * p.block_rows; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          const double v = static_cast<float>(x[r * p.cols + c]);
          const double q = cpu::fp8_to_float<kE4M3>(p.x_fp8[r * p.cols + c]);
          const double a = std::fabs(v);
          if (!std::isnan(amax) && !(a <= amax)) amax = a;  // a NaN sticks, as torch's amax
          sat += a / inv > limit;
          under += v != 0.0 && q == 0.0;
          nonzero += v != 0.0;
          signal += v * v;
          const double e = v - q * inv;
          noise += e * e;
        }
      }
      double* row = p.out + b * kBlockStatsColumns;
      row[0] = amax, row[1] = sat, row[2] = under, row[3] = nonzero;
      row[4] = signal, row[5] = noise, row[6] = inv;
    }
  }
}

}  // namespace

Status block_stats_cpu(const BlockStatsParams& p) {
  if (*p.enabled == 0.0f) return Status{};
  GRAPHFP8_SWITCH_HP(p.x_dtype, "block_stats_cpu", T,
    GRAPHFP8_SWITCH_FP8(p.fp8_dtype, "block_stats_cpu", kE4M3, stats_blocks<T, kE4M3>(p);))
  return Status{};
}

}  // namespace graphfp8
