// CPU kernel of the blockwise FP8 quantizers (csrc/blockwise.h): 1x128 tiles of x and, from the
// same read, of x^T; 128x128 blocks of x and their transpose. Bit-identical to the torch
// quantizers of graphfp8/ops/blockwise.py (NaN as the canonical 0x7F), which the tests check.
//
// Work goes by strips of up to 128 rows: the strip's column amaxes (x^T's tiles, and for blocks
// the block amaxes) are gathered row by row, so every pass reads x in row order.
#include <algorithm>
#include <vector>

#include "../blockwise.h"
#include "../dtype_switch.h"
#include "fp8_convert.h"

namespace graphfp8 {
namespace {

template <typename T, bool kE4M3>
void quantize_strips(const BlockQuantizeParams& p) {
  const auto* x = static_cast<const T*>(p.x);
  auto* out = static_cast<uint8_t*>(p.dst.out);
  auto* out_t = static_cast<uint8_t*>(p.dst.out_t);
  const float fp8_max = kE4M3 ? kE4M3Max : kE5M2Max;
  const int64_t rows = p.rows, cols = p.cols;
  const int64_t col_tiles = (cols + kBlockTile - 1) / kBlockTile;
  const int64_t row_tiles = (rows + kBlockTile - 1) / kBlockTile;
  const bool blocks = p.block_rows == kBlockTile;
  std::vector<uint32_t> col_amax(static_cast<size_t>(cols));
  std::vector<float> col_scale(static_cast<size_t>(cols));
  for (int64_t strip = 0; strip < row_tiles; ++strip) {
    const int64_t r0 = strip * kBlockTile, r1 = std::min(rows, r0 + kBlockTile);
    // The strip's per-column amaxes: x^T's tiles (1x128 with out_t) or, folded, its blocks.
    if (blocks || out_t != nullptr) {
      std::fill(col_amax.begin(), col_amax.end(), 0u);
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          col_amax[c] = std::max(col_amax[c], abs_bits(static_cast<float>(x[r * cols + c])));
        }
      }
    }
    if (blocks) {
      for (int64_t j = 0; j < col_tiles; ++j) {
        const int64_t c0 = j * kBlockTile, c1 = std::min(cols, c0 + kBlockTile);
        const uint32_t a = *std::max_element(col_amax.begin() + c0, col_amax.begin() + c1);
        const float s = block_scale(a, fp8_max, p.dst.power_2_scale);
        std::fill(col_scale.begin() + c0, col_scale.begin() + c1, s);
        p.dst.scale_inv[strip * col_tiles + j] = 1.0f / s;
        if (out_t != nullptr) p.dst.scale_inv_t[j * row_tiles + strip] = 1.0f / s;
      }
    } else if (out_t != nullptr) {
      for (int64_t c = 0; c < cols; ++c) {
        col_scale[c] = block_scale(col_amax[c], fp8_max, p.dst.power_2_scale);
        p.dst.scale_inv_t[c * row_tiles + strip] = 1.0f / col_scale[c];
      }
    }
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = x + r * cols;
      for (int64_t j = 0; j < col_tiles; ++j) {
        const int64_t c0 = j * kBlockTile, c1 = std::min(cols, c0 + kBlockTile);
        float s = 0.0f;
        if (!blocks) {
          uint32_t a = 0u;
          for (int64_t c = c0; c < c1; ++c) a = std::max(a, abs_bits(static_cast<float>(row[c])));
          s = block_scale(a, fp8_max, p.dst.power_2_scale);
          p.dst.scale_inv[r * col_tiles + j] = 1.0f / s;
        }
        for (int64_t c = c0; c < c1; ++c) {
          const float v = static_cast<float>(row[c]);
          out[r * cols + c] = cpu::quantize<kE4M3>(v * (blocks ? col_scale[c] : s));
          if (out_t == nullptr) continue;
          // Blocks: the same byte transposed; tiles: x^T's own tile scale.
          out_t[c * rows + r] = blocks ? out[r * cols + c] : cpu::quantize<kE4M3>(v * col_scale[c]);
        }
      }
    }
  }
}

}  // namespace

Status block_quantize_cpu(const BlockQuantizeParams& p) {
  if (p.noop != nullptr && *p.noop == 1.0f) return Status{};
  GRAPHFP8_SWITCH_HP(p.x_dtype, "block_quantize_cpu", T,
    GRAPHFP8_SWITCH_FP8(p.dst.out_dtype, "block_quantize_cpu", kE4M3,
      quantize_strips<T, kE4M3>(p);))
  return Status{};
}

}  // namespace graphfp8
