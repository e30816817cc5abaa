"""Builds graphfp8._C: CPU kernels always; CUDA kernels when torch has CUDA and nvcc exists."""

import glob
import os
import sys

from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

# Only a command that compiles says so (pip also runs setup.py for metadata).
BUILDING = any(a.startswith(("build", "bdist", "develop", "install", "editable")) for a in sys.argv)


def want_cuda() -> bool:
    import torch

    if os.environ.get("GRAPHFP8_FORCE_CPU", "0") == "1":
        return False
    return torch.version.cuda is not None and CUDA_HOME is not None


def announce(cpp: list[str], cu: list[str]) -> None:
    """One line before the compile, which prints nothing for a minute or more."""
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    cuda = f" and {len(cu)} CUDA files (TORCH_CUDA_ARCH_LIST={arch})" if cu else " (CPU kernels)"
    print(f"graphfp8: building the extension graphfp8._C from {len(cpp)} C++ files{cuda} "
          "(a minute or more, silent while it compiles)", file=sys.stderr, flush=True)  # fmt: skip


def extension():
    cpp_sources = sorted(glob.glob("csrc/ops/*.cpp")) + sorted(glob.glob("csrc/cpu/*.cpp"))
    # No contraction into fused multiply-adds: the CPU kernels must round like their twins.
    cxx_flags = ["-O3", "-std=c++17", "-ffp-contract=off"]
    if not want_cuda():
        if BUILDING:
            announce(cpp_sources, [])
        return CppExtension("graphfp8._C", cpp_sources, extra_compile_args={"cxx": cxx_flags})
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    cu_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    if BUILDING:
        announce(cpp_sources, cu_sources)
    nvcc_flags = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]
    return CUDAExtension(
        "graphfp8._C",
        cpp_sources + cu_sources,
        define_macros=[("GRAPHFP8_WITH_CUDA", None)],
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
    )


setup(
    ext_modules=[extension()], cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)}
)
