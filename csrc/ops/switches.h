// Switches between CUDA kernel variants (docs/benchmarking.md, "Kernel switches"): a new kernel
// lands off until it has run on a GPU. All but NORM_BWD_STAGED ran in the CUDA suite on the H200
// on 2026-12-01 and are on unless their environment variable is "0" (docs/benchmarking.md has
// what each measured).
// Each starts from its environment variable, read once, and can be flipped at run time
// (graphfp8.ops.switches) so that one process can compare a new kernel with the one it
// replaces, bit for bit. The CPU kernels ignore them (ROPE_CAST_BWD chooses a path in Python).
#pragma once

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace graphfp8 {

struct KernelSwitch {
  const char* name;  // also the environment variable, prefixed GRAPHFP8_
  std::atomic<bool> on;
};

// GRAPHFP8_NORM_BWD_BATCHED: the norm backward with several rows in flight per block and the
// fast fixed-order parameter-gradient reduction (cuda/norm_bwd_batched.cu).
// GRAPHFP8_PAIRED_QUANTIZE: the cast-transposes' FP8 conversion two values at a time with one
// saturating convert, and word-wide transposed stores (cuda/tile.cuh).
// GRAPHFP8_DBIAS_IN_KERNEL: the fused dbias's column sums by the
// last block of each column of tiles instead of a second kernel (cuda/dbias.cuh; the same sums).
// GRAPHFP8_NORM_BWD_STAGED (off: 0.94-1.02x the batched kernel on the H200): the batched norm
// backward with each thread's next rows staged in shared memory by cp.async
// (cuda/norm_bwd_staged.cu; the same sums).
// GRAPHFP8_NORM_BWD_PARAM_IN_KERNEL: only while NORM_BWD_STAGED is on, dgamma and dbeta summed by
// the staged kernel's last blocks instead of a second kernel (the same sums).
// GRAPHFP8_NORM_BWD_V2 (off until it has run on a GPU): the 16-bit vectorised norm backward at
// hidden sizes up to 4096 by cuda/norm_bwd_v2.cu (row loads double-buffered in registers, the
// per-element work specialised; the batched kernel's sums, bit for bit).
// GRAPHFP8_ROPE_PARTS_BWD: the bf16 attention path's RoPE
// backward from dq, dk, dv in one kernel (rope_fp8_backward's high-precision form) instead of a
// cat and rope_qkv (graphfp8/modules/_rope.py; the CPU always takes it).
// GRAPHFP8_NORM_FWD_TRANSPOSE (off until it has run on a GPU): the norm forward writes the FP8
// transpose from its own kernel through a band of rows staged in shared memory, instead of a
// second pass over the FP8 output (cuda/norm_fwd_band.cu; the same bytes; the CPU always does).
// GRAPHFP8_ROPE_CAST_BWD (off until it has run on a GPU): TransformerLayer's QKV projection and
// RoPE as one autograd Function whose backward casts the QKV gradient to FP8 straight from dq,
// dk, dv, rotating them back inside the cast-transpose (cuda/rope_cast.cu; the same bytes, amax
// and dbias as the separate RoPE backward and cast). Unlike the others it also switches the CPU.
// GRAPHFP8_BLOCK_QUANTIZE_STAGED (off until it has run on a GPU): blockwise_quantize's 1x128
// tiles of a 16-bit x and x^T by blocks that walk several tiles, the next one staged in shared
// memory by cp.async while the current one is quantized (cuda/blockwise_staged.cuh; the same
// bytes).
// GRAPHFP8_GLU_V2 (off until it has run on a GPU): the per-tensor SwiGLU / GeGLU cast-transposes
// on vector tiles with paired FP8 converts and word-wide transposed stores of both layouts
// (cuda/glu_v2.cuh; the same bytes, amax and dbias).
// GRAPHFP8_GLU_V2_DIV (off until it has run on a GPU): only while GLU_V2 is on, SwiGLU's divisions
// written out without a branch per value where the gates allow (cuda/glu_v2.cuh; the same bytes).
inline KernelSwitch* kernel_switches(int* count) {
  static KernelSwitch switches[] = {{"NORM_BWD_BATCHED", {true}},
                                    {"PAIRED_QUANTIZE", {true}},
                                    {"DBIAS_IN_KERNEL", {true}},
                                    {"NORM_BWD_STAGED", {false}},
                                    {"NORM_BWD_PARAM_IN_KERNEL", {true}},
                                    {"ROPE_PARTS_BWD", {true}},
                                    {"NORM_FWD_TRANSPOSE", {false}},
                                    {"ROPE_CAST_BWD", {false}},
                                    {"NORM_BWD_V2", {false}},
                                    {"BLOCK_QUANTIZE_STAGED", {false}},
                                    {"GLU_V2", {false}},
                                    {"GLU_V2_DIV", {false}}};
  static const bool from_env = [] {
    for (auto& s : switches) {
      char var[64] = "GRAPHFP8_";
      std::strncat(var, s.name, sizeof(var) - std::strlen(var) - 1);
      const char* v = std::getenv(var);
      if (v != nullptr) s.on = std::strcmp(v, "0") != 0;
    }
    return true;
  }();
  (void)from_env;
  *count = static_cast<int>(sizeof(switches) / sizeof(switches[0]));
  return switches;
}

// The switch named `name`, or nullptr.
inline KernelSwitch* kernel_switch(const char* name) {
  int n = 0;
  KernelSwitch* all = kernel_switches(&n);
  for (int i = 0; i < n; ++i) {
    if (std::strcmp(all[i].name, name) == 0) return &all[i];
  }
  return nullptr;
}

inline bool switch_on(const char* name) {
  const KernelSwitch* s = kernel_switch(name);
  return s != nullptr && s->on.load();
}

}  // namespace graphfp8
