"""Builds graphfp8._C: CPU kernels always; CUDA kernels when torch has CUDA and nvcc exists."""

import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension


def want_cuda() -> bool:
    import torch

    if os.environ.get("GRAPHFP8_FORCE_CPU", "0") == "1":
        return False
    return torch.version.cuda is not None and CUDA_HOME is not None


def extension():
    cpp_sources = sorted(glob.glob("csrc/ops/*.cpp")) + sorted(glob.glob("csrc/cpu/*.cpp"))
    # No contraction into fused multiply-adds: the CPU kernels must round like their twins.
    cxx_flags = ["-O3", "-std=c++17", "-ffp-contract=off"]
    if not want_cuda():
        return CppExtension("graphfp8._C", cpp_sources, extra_compile_args={"cxx": cxx_flags})
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    nvcc_flags = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]
    return CUDAExtension(
        "graphfp8._C",
        cpp_sources + sorted(glob.glob("csrc/cuda/*.cu")),
        define_macros=[("GRAPHFP8_WITH_CUDA", None)],
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
    )


setup(
    ext_modules=[extension()], cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)}
)
