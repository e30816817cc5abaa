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


def cublaslt() -> tuple[list[str], list[str]] | None:
    """(include dirs, link args) of cuBLASLt for the CUDA build (csrc/cuda/gemm_accumulate.cu):
    the CUDA toolkit's where it has the header, else the nvidia-cublas wheel that a pip torch
    installs (its library is versioned only: linked by path, found at run time through torch,
    which has loaded it, or the rpath)."""
    if os.path.exists(os.path.join(CUDA_HOME, "include", "cublasLt.h")):
        return [], ["-lcublasLt"]
    for root in sys.path:
        for header in sorted(glob.glob(os.path.join(root, "nvidia", "*", "include", "cublasLt.h"))):
            base = os.path.dirname(os.path.dirname(header))
            libs = sorted(glob.glob(os.path.join(base, "lib", "libcublasLt.so*")))
            if libs:
                lib_dir = os.path.dirname(libs[0])
                return [os.path.dirname(header)], [libs[0], f"-Wl,-rpath,{lib_dir}"]
    print(
        "graphfp8: no cuBLASLt found (cublasLt.h and libcublasLt: the CUDA toolkit's cuBLAS, or "
        "`pip install nvidia-cublas`); building without it: fp8_gemm_accumulate (the layers' "
        "fuse_wgrad_accumulation) raises on CUDA tensors",
        file=sys.stderr,
    )
    return None


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
    found = cublaslt()
    include_dirs, link_args = found if found is not None else ([], [])
    macros = [("GRAPHFP8_WITH_CUDA", None)] + ([] if found else [("GRAPHFP8_NO_CUBLASLT", None)])
    return CUDAExtension(
        "graphfp8._C",
        cpp_sources + cu_sources,
        define_macros=macros,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        extra_link_args=link_args,
    )


setup(
    ext_modules=[extension()], cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)}
)
