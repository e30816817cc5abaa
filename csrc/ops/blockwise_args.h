// The argument checks the blockwise ops share (blockwise_ops.cpp, norm_ops.cpp): the input of a
// quantizer and the FP8 layouts of csrc/blockwise.h's BlockOut, checked once here.
#pragma once

#include "../blockwise.h"
#include "ops.h"

namespace graphfp8 {

// A 2-D contiguous float32 / bfloat16 / float16 input.
inline void check_block_input(const char* op, const at::Tensor& x) {
  TORCH_CHECK(is_hp(x.scalar_type()), op,
              ": argument 'x' must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, op, ": argument 'x' must be 2-D, got ", fmt(x.dim()), "-D");
  TORCH_CHECK(x.is_contiguous(), op, ": argument 'x' must be contiguous");
}

inline void check_block_rows(const char* op, int64_t block_rows) {
  TORCH_CHECK(block_rows == 1 || block_rows == kBlockTile, op,
              ": argument 'block_rows' must be 1 (1x128 tiles) or 128 (128x128 blocks), got ",
              fmt(block_rows));
}

// float32 scales of `shape`, on ref's device.
inline void check_block_scales(const char* op, const char* name, const at::Tensor& t,
                               const at::Tensor& ref, at::IntArrayRef shape) {
  check_common(op, name, t, ref);
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": argument '", name, "' must be float32, got ",
              t.scalar_type());
  TORCH_CHECK(t.sizes() == shape, op, ": argument '", name, "' must have shape ", fmt(shape),
              ", got ", fmt(t.sizes()));
}

// The layouts of a (rows, cols) value in tiles of block_rows x 128: out and scale_inv, and
// out_t and scale_inv_t (given together) for its transpose; all on ref's device.
inline BlockOut check_block_out(const char* op, const at::Tensor& ref, int64_t rows, int64_t cols,
                                int64_t block_rows, const at::Tensor& out,
                                const at::Tensor& scale_inv,
                                const c10::optional<at::Tensor>& out_t,
                                const c10::optional<at::Tensor>& scale_inv_t,
                                bool power_2_scale) {
  TORCH_CHECK(out_t.has_value() == scale_inv_t.has_value(), op,
              ": give 'out_t' and 'scale_inv_t' together, or neither");
  const int64_t row_tiles = (rows + kBlockTile - 1) / kBlockTile;
  const int64_t col_tiles = (cols + kBlockTile - 1) / kBlockTile;
  check_fp8_out(op, "out", out, ref, {rows, cols});
  check_block_scales(op, "scale_inv", scale_inv, ref,
                     {block_rows == 1 ? rows : row_tiles, col_tiles});
  BlockOut dst{};
  if (out_t.has_value()) {
    check_fp8_out(op, "out_t", *out_t, ref, {cols, rows});
    TORCH_CHECK(out_t->scalar_type() == out.scalar_type(), op,
                ": arguments 'out' and 'out_t' must have the same dtype");
    check_block_scales(op, "scale_inv_t", *scale_inv_t, ref,
                       {block_rows == 1 ? cols : col_tiles, row_tiles});
    dst.out_t = out_t->data_ptr();
    dst.scale_inv_t = scale_inv_t->data_ptr<float>();
  }
  dst.out = out.data_ptr();
  dst.scale_inv = scale_inv.data_ptr<float>();
  dst.out_dtype = to_dtype(out.scalar_type());
  dst.power_2_scale = power_2_scale;
  return dst;
}

}  // namespace graphfp8
