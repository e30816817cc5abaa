"""The physical floor of a training step and its model FLOPs (docs/benchmarking.md, "The floor").

    model FLOPs = (6 x GEMM parameters + 6 x layers x S x h) x tokens
    floor       = block GEMM FLOPs / GEMM peak of the run's precision
                + head GEMM FLOPs / bf16 GEMM peak (graphfp8 keeps the head in bf16)
                + causal attention FLOPs / attention rate
                + minimal bytes of everything else / copy rate

GEMM parameters are the weights that multiply activations: the blocks' q/k/v, projection and MLP
weights and the vocabulary head (also when tied to the embedding); the embedding lookup and the
norms are not GEMMs. Causal attention costs 2 x S x h FLOPs per token and layer forward
(q.k and p.v over S / 2 keys on average), 3 times that with its backward. The minimal bytes are
those of an ideally fused step (`memory_bytes`): every tensor between two GEMMs (or attention)
read once and written once, in the dtype the next GEMM takes. The ceilings are the H200's of
docs/benchmarking.md until `calibrate` measures them on the GPU at hand.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from graphfp8.training.presets import ModelConfig

__all__ = ["ACTIVATION_PARTS", "Ceilings", "H200", "calibrate", "cuda_ms", "floor",
           "gemm_parameters", "memory_bytes", "memory_parts", "model_flops"]  # fmt: skip


@dataclass(frozen=True)
class Ceilings:
    """Rates of one GPU: GEMM peaks (TFLOP/s), the copy rate (TB/s of bytes read + written) and
    causal attention's forward + backward (model TFLOP/s)."""

    fp8_gemm_tflops: float
    bf16_gemm_tflops: float
    copy_tbps: float
    attention_tflops: float
    source: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# docs/benchmarking.md's H200 ceilings (2026-11-29): torch._scaled_mm and a bf16 matmul at 8192^3,
# a device-to-device copy. Attention's rate is an estimate (cuDNN's bf16 flash attention at
# head_dim 128, forward + backward) until a calibration measures it.
H200 = Ceilings(fp8_gemm_tflops=1469.0, bf16_gemm_tflops=799.0, copy_tbps=4.3,
                attention_tflops=550.0, source="H200 constants, docs/benchmarking.md")  # fmt: skip


def gemm_parameters(cfg: ModelConfig) -> dict[str, int]:
    """{"blocks": the blocks' GEMM weights, "head": the vocabulary head's (vocab x hidden)}."""
    h, f = cfg.hidden, cfg.ffn
    per_layer = h * cfg.qkv_width + h * h + h * f * (2 if cfg.gated else 1) + f * h
    return {"blocks": per_layer * cfg.layers, "head": cfg.vocab * h}


def model_flops(cfg: ModelConfig, tokens: int) -> dict[str, float]:
    """Training FLOPs (forward + backward) of `tokens` tokens at cfg.seq_len:
    {"blocks", "head", "attention", "total"}."""
    params = gemm_parameters(cfg)
    attention = 6 * cfg.layers * cfg.seq_len * cfg.hidden * tokens
    out = {"blocks": 6.0 * params["blocks"] * tokens, "head": 6.0 * params["head"] * tokens,
           "attention": float(attention)}  # fmt: skip
    out["total"] = out["blocks"] + out["head"] + out["attention"]
    return out


def memory_bytes(cfg: ModelConfig, precision: str, tokens: int) -> dict:
    """The bytes an ideally fused step moves outside the GEMMs and attention: {"activations",
    "loss", "optimizer", "total"} (memory_parts says which kernels move them).

    Per layer and token, each tensor between two GEMMs (or attention) is read once (bf16, 2
    bytes) and written once as the next GEMM's operand (e bytes: 1 for fp8, 2 for bf16; fp8 also
    writes the transposed copy its weight gradient takes, t = 2 layouts, else t = 1); norms read
    the residual stream as well. Per token: the loss reads the bf16 logits and writes their
    gradient. Per step and parameter: AdamW (bf16 weight and gradient, fp32 moments: 22 bytes)
    and, in fp8, each weight's cast into both layouts (4 bytes).
    """
    parts = memory_parts(cfg, precision, tokens)
    out = {"activations": sum(parts[k] for k in ACTIVATION_PARTS), "loss": parts["loss"],
           "optimizer": parts["optimizer"] + parts["weight_casts"]}  # fmt: skip
    out["total"] = out["activations"] + out["loss"] + out["optimizer"]
    return out


# memory_parts' per-layer terms, in the order of a layer's forward then backward
ACTIVATION_PARTS = ("norm_fwd", "rope_fwd", "casts", "act_fwd", "act_bwd", "norm_bwd", "rope_bwd")


def memory_parts(cfg: ModelConfig, precision: str, tokens: int) -> dict[str, float]:
    """memory_bytes by the kernels that move them in an ideally fused step, in bytes per step:
    ACTIVATION_PARTS over all layers (norm_fwd: both norms with the residual adds, writing their
    GEMM operands; casts: the attention output and the MLP output gradient cast to the
    projection's and fc2's operands; act_fwd / act_bwd: the activation and its gradient written
    as fc2's / fc1's operand; norm_bwd: both norm backwards with the residual gradient, the first
    writing the projection's operand; rope_fwd / rope_bwd: RoPE, its backward writing the QKV
    gradient's operand), "loss", "optimizer" (AdamW) and "weight_casts" (fp8: each weight into
    both layouts once per step)."""
    e, t = (1, 2) if precision == "fp8" else (2, 1)
    h, q, f = cfg.hidden, cfg.qkv_width, cfg.ffn
    g = 2 if cfg.gated else 1
    per_token = {
        "norm_fwd": (4 * h + e * t * h) + (6 * h + e * t * h),  # x (+ residual) -> norm -> qkv;
        # projection output + residual -> norm -> fc1 operand
        "rope_fwd": 4 * q,  # RoPE over q, k, v (bf16 in, bf16 out)
        "casts": (2 * h + e * t * h) + (2 * h + e * t * h),  # attention out; dy -> fc2 operand
        "act_fwd": 2 * g * f + e * t * f,  # fc1 output -> activation -> fc2 operand
        "act_bwd": 2 * f + 2 * g * f + e * t * g * f,  # fc2 dgrad, saved fc1 output -> fc1's
        "norm_bwd": (6 * h + 2 * h + e * t * h) + (6 * h + 2 * h),  # fc1 dgrad, x, residual grad
        # -> norm bwd -> projection operand; qkv dgrad, x, residual grad -> norm backward
        "rope_bwd": 2 * q + e * t * q,  # dq, dk, dv -> RoPE backward -> qkv operand
    }
    params = gemm_parameters(cfg)
    out = {k: float(cfg.layers * v * tokens) for k, v in per_token.items()}
    out["loss"] = float(4 * cfg.vocab * tokens)
    out["optimizer"] = float(22 * (params["blocks"] + params["head"]))
    out["weight_casts"] = float(4 * params["blocks"] if precision == "fp8" else 0)
    return out


def floor(cfg: ModelConfig, precision: str, tokens: int, ceilings: Ceilings = H200) -> dict:
    """The floor of one optimizer step of `tokens` tokens (all microbatches), in seconds, by
    part: {"blocks_gemm", "head_gemm", "attention", "memory", "total"} and the ceilings used."""
    flops = model_flops(cfg, tokens)
    peak = ceilings.fp8_gemm_tflops if precision == "fp8" else ceilings.bf16_gemm_tflops
    parts = {
        "blocks_gemm": flops["blocks"] / (peak * 1e12),
        "head_gemm": flops["head"] / (ceilings.bf16_gemm_tflops * 1e12),
        "attention": flops["attention"] / (ceilings.attention_tflops * 1e12),
        "memory": memory_bytes(cfg, precision, tokens)["total"] / (ceilings.copy_tbps * 1e12),
    }
    return {**parts, "total": sum(parts.values()), "ceilings": ceilings.to_dict()}


def calibrate(device, attention_shape: tuple[int, int, int, int, int] | None = None) -> Ceilings:
    """The ceilings measured now on a CUDA `device`: torch._scaled_mm (FP8, bf16 out) and a bf16
    matmul at 8192^3, a device-to-device copy of 1 GiB, and, given (batch, seq, heads, kv_heads,
    head_dim), causal bf16 scaled_dot_product_attention (cuDNN's where it runs) forward +
    backward at that shape; without a shape attention keeps H200's estimate."""
    import torch
    import torch.nn.functional as F

    n, dev = 8192, torch.device(device)
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev)
    fp8 = _rate(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                         out_dtype=torch.bfloat16), 2 * n**3)  # fmt: skip
    bf16 = _rate(lambda: a @ b, 2 * n**3)
    src = torch.empty(1 << 29, device=dev, dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    copy = _rate(lambda: dst.copy_(src), 2 * src.numel() * src.element_size())
    attention = H200.attention_tflops * 1e12
    if attention_shape is not None:
        bsz, seq, heads, kv, d = attention_shape
        q = torch.randn(bsz, heads, seq, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(bsz, kv, seq, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        do = torch.randn(bsz, heads, seq, d, device=dev, dtype=torch.bfloat16)

        def attend():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != heads)
            out.backward(do)

        attention = _rate(attend, 6 * bsz * seq * seq * heads * d)  # model FLOPs
    return Ceilings(fp8 / 1e12, bf16 / 1e12, copy / 1e12, attention / 1e12,
                    source=f"measured on {torch.cuda.get_device_name(dev)}")  # fmt: skip


def _rate(fn, work: float, iters: int = 10) -> float:
    """work per second of fn (CUDA events over `iters` calls after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    return work * iters / (cuda_ms(fn, iters) / 1e3)


def cuda_ms(fn, iters: int) -> float:
    """Milliseconds that `iters` back-to-back calls of fn take on the current CUDA stream (CUDA
    events; also benchmarks/' device timer)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)
