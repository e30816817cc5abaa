// Checks and launches of the blockwise FP8 quantizer (csrc/blockwise.h): 1x128 tiles or 128x128
// blocks of x, optionally with the layout of x^T in the same pass; of the MLP activations with
// their output in 1x128 tiles (csrc/blockwise_act.h); and of the per-block statistics (the
// numerics report's).
#include <string>

#include "../blockwise_act.h"
#include "blockwise_args.h"
#include "ops.h"
#include "switches.h"

namespace graphfp8 {

void blockwise_quantize(const at::Tensor& x, const at::Tensor& out, const at::Tensor& scale_inv,
                        const c10::optional<at::Tensor>& out_t,
                        const c10::optional<at::Tensor>& scale_inv_t, int64_t block_rows,
                        bool power_2_scale, const c10::optional<at::Tensor>& noop) {
  const char* op = "graphfp8.blockwise_quantize";
  check_block_input(op, x);
  check_block_rows(op, block_rows);
  BlockQuantizeParams p{};
  p.x = x.data_ptr();
  p.x_dtype = to_dtype(x.scalar_type());
  p.rows = x.size(0);
  p.cols = x.size(1);
  p.dst = check_block_out(op, x, p.rows, p.cols, block_rows, out, scale_inv, out_t, scale_inv_t,
                          power_2_scale);
  p.noop = noop_ptr(op, noop, x);
  p.block_rows = block_rows;
  p.staged = switch_on("BLOCK_QUANTIZE_STAGED");
  if (x.numel() == 0) return;
  launch(op, x, p, block_quantize_cpu,
         [](const BlockQuantizeParams& q, void* s) { return block_quantize_cuda(q, s); });
}

void blockwise_stats(const at::Tensor& x, const at::Tensor& x_fp8, const at::Tensor& scale_inv,
                     int64_t block_rows, const at::Tensor& enabled, const at::Tensor& out) {
  const char* op = "graphfp8.blockwise_stats";
  check_block_input(op, x);
  check_block_rows(op, block_rows);
  const int64_t rows = x.size(0), cols = x.size(1);
  const int64_t row_tiles = (rows + block_rows - 1) / block_rows;
  const int64_t col_tiles = (cols + kBlockTile - 1) / kBlockTile;
  check_fp8_out(op, "x_fp8", x_fp8, x, x.sizes());
  check_block_scales(op, "scale_inv", scale_inv, x, {row_tiles, col_tiles});
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

namespace {

BlockAct parse_block_act(const char* op, c10::string_view activation) {
  if (activation == "gelu") return BlockAct::kGelu;
  if (activation == "swiglu") return BlockAct::kSwiglu;
  if (activation == "geglu") return BlockAct::kGeglu;
  TORCH_CHECK(false, op, ": argument 'activation' must be 'gelu', 'swiglu' or 'geglu', got '",
              std::string(activation), "'");
}

}  // namespace

// The activation of x (gelu: (rows, F); swiglu, geglu: (rows, 2 F)) in 1x128 tiles of a (rows,
// F) and, with out_t, of a^T (csrc/blockwise_act.h).
void blockwise_act(const at::Tensor& x, c10::string_view activation, const at::Tensor& out,
                   const at::Tensor& scale_inv, const c10::optional<at::Tensor>& out_t,
                   const c10::optional<at::Tensor>& scale_inv_t, bool power_2_scale) {
  const char* op = "graphfp8.blockwise_act";
  check_block_input(op, x);
  BlockActParams p{};
  p.act = parse_block_act(op, activation);
  const bool gated = p.act != BlockAct::kGelu;
  TORCH_CHECK(!gated || x.size(1) % 2 == 0, op,
              ": argument 'x' must have an even width (gate | up), got ", fmt(x.size(1)));
  p.x = x.data_ptr();
  p.dtype = to_dtype(x.scalar_type());
  p.rows = x.size(0);
  p.cols = gated ? x.size(1) / 2 : x.size(1);
  p.dst = check_block_out(op, x, p.rows, p.cols, 1, out, scale_inv, out_t, scale_inv_t,
                          power_2_scale);
  if (p.rows * p.cols == 0) return;
  launch(op, x, p, block_act_cpu,
         [](const BlockActParams& q, void* s) { return block_act_cuda(q, s); });
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m,
         "blockwise_act(Tensor x, str activation, Tensor(a!) out, Tensor(b!) scale_inv, "
         "Tensor(c!)? out_t=None, Tensor(d!)? scale_inv_t=None, bool power_2_scale=True) -> ()",
         blockwise_act);
}

}  // namespace graphfp8
