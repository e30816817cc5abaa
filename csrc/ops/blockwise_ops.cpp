// Checks and launch of the blockwise FP8 quantizer (csrc/blockwise.h): 1x128 tiles or 128x128
// blocks of x, optionally with the layout of x^T in the same pass; and of its per-block
// statistics (the numerics report's).
#include "../blockwise.h"
#include "ops.h"

namespace graphfp8 {
namespace {

void check_scales(const char* op, const char* name, const at::Tensor& t, const at::Tensor& x,
                  int64_t rows, int64_t cols) {
  check_common(op, name, t, x);
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": argument '", name, "' must be float32, got ",
              t.scalar_type());
  TORCH_CHECK(t.sizes() == at::IntArrayRef({rows, cols}), op, ": argument '", name,
              "' must have shape ", fmt({rows, cols}), ", got ", fmt(t.sizes()));
}

}  // namespace

void blockwise_quantize(const at::Tensor& x, const at::Tensor& out, const at::Tensor& scale_inv,
                        const c10::optional<at::Tensor>& out_t,
                        const c10::optional<at::Tensor>& scale_inv_t, int64_t block_rows,
                        bool power_2_scale, const c10::optional<at::Tensor>& noop) {
  const char* op = "graphfp8.blockwise_quantize";
  TORCH_CHECK(is_hp(x.scalar_type()), op, ": argument 'x' must be float32, bfloat16 or float16, got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() == 2, op, ": argument 'x' must be 2-D, got ", fmt(x.dim()), "-D");
  TORCH_CHECK(x.is_contiguous(), op, ": argument 'x' must be contiguous");
  TORCH_CHECK(block_rows == 1 || block_rows == kBlockTile, op,
              ": argument 'block_rows' must be 1 (1x128 tiles) or 128 (128x128 blocks), got ",
              fmt(block_rows));
  TORCH_CHECK(out_t.has_value() == scale_inv_t.has_value(), op,
              ": give 'out_t' and 'scale_inv_t' together, or neither");
  const int64_t rows = x.size(0), cols = x.size(1);
  const int64_t row_tiles = (rows + kBlockTile - 1) / kBlockTile;
  const int64_t col_tiles = (cols + kBlockTile - 1) / kBlockTile;
  check_fp8_out(op, "out", out, x, x.sizes());
  check_scales(op, "scale_inv", scale_inv, x, block_rows == 1 ? rows : row_tiles, col_tiles);
  BlockQuantizeParams p{};
  if (out_t.has_value()) {
    check_fp8_out(op, "out_t", *out_t, x, {cols, rows});
    TORCH_CHECK(out_t->scalar_type() == out.scalar_type(), op,
                ": arguments 'out' and 'out_t' must have the same dtype");
    check_scales(op, "scale_inv_t", *scale_inv_t, x, block_rows == 1 ? cols : col_tiles,
                 row_tiles);
    p.out_t = out_t->data_ptr();
    p.scale_inv_t = scale_inv_t->data_ptr<float>();
  }
  p.x = x.data_ptr();
  p.x_dtype = to_dtype(x.scalar_type());
  p.out = out.data_ptr();
  p.scale_inv = scale_inv.data_ptr<float>();
  p.out_dtype = to_dtype(out.scalar_type());
  p.noop = noop_ptr(op, noop, x);
  p.rows = rows;
  p.cols = cols;
  p.block_rows = block_rows;
  p.power_2_scale = power_2_scale;
  if (x.numel() == 0) return;
  launch(op, x, p, block_quantize_cpu,
         [](const BlockQuantizeParams& q, void* s) { return block_quantize_cuda(q, s); });
}

void blockwise_stats(const at::Tensor& x, const at::Tensor& x_fp8, const at::Tensor& scale_inv,
                     int64_t block_rows, const at::Tensor& enabled, const at::Tensor& out) {
  const char* op = "graphfp8.blockwise_stats";
  TORCH_CHECK(is_hp(x.scalar_type()), op, ": argument 'x' must be float32, bfloat16 or float16, got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() == 2, op, ": argument 'x' must be 2-D, got ", fmt(x.dim()), "-D");
  TORCH_CHECK(x.is_contiguous(), op, ": argument 'x' must be contiguous");
  TORCH_CHECK(block_rows == 1 || block_rows == kBlockTile, op,
              ": argument 'block_rows' must be 1 (1x128 tiles) or 128 (128x128 blocks), got ",
              fmt(block_rows));
  const int64_t rows = x.size(0), cols = x.size(1);
  const int64_t row_tiles = (rows + block_rows - 1) / block_rows;
  const int64_t col_tiles = (cols + kBlockTile - 1) / kBlockTile;
  check_fp8_out(op, "x_fp8", x_fp8, x, x.sizes());
  check_scales(op, "scale_inv", scale_inv, x, row_tiles, col_tiles);
  check_scalar_f32(op, "enabled", enabled, x);
  check_common(op, "out", out, x);
  TORCH_CHECK(out.scalar_type() == at::kDouble, op, ": argument 'out' must be float64, got ",
              out.scalar_type());
  TORCH_CHECK(out.sizes() == at::IntArrayRef({row_tiles * col_tiles, kBlockStatsColumns}), op,
              ": argument 'out' must have shape ", fmt({row_tiles * col_tiles, kBlockStatsColumns}),
              ", got ", fmt(out.sizes()));
  BlockStatsParams p{};
  p.x = x.data_ptr();
  p.x_dtype = to_dtype(x.scalar_type());
  p.x_fp8 = static_cast<const uint8_t*>(x_fp8.data_ptr());
  p.fp8_dtype = to_dtype(x_fp8.scalar_type());
  p.scale_inv = scale_inv.data_ptr<float>();
  p.enabled = enabled.data_ptr<float>();
  p.out = out.data_ptr<double>();
  p.rows = rows;
  p.cols = cols;
  p.block_rows = block_rows;
  if (x.numel() == 0) return;
  launch(op, x, p, block_stats_cpu,
         [](const BlockStatsParams& q, void* s) { return block_stats_cuda(q, s); });
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m,
         "blockwise_stats(Tensor x, Tensor x_fp8, Tensor scale_inv, int block_rows, "
         "Tensor enabled, Tensor(a!) out) -> ()",
         blockwise_stats);
  def_op(m,
         "blockwise_quantize(Tensor x, Tensor(a!) out, Tensor(b!) scale_inv, "
         "Tensor(c!)? out_t=None, Tensor(d!)? scale_inv_t=None, int block_rows=1, "
         "bool power_2_scale=True, Tensor? noop=None) -> ()",
         blockwise_quantize);
}

}  // namespace graphfp8
