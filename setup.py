"""Build and package specdec_kernels.

The compiled extension ``specdec_kernels._C`` registers the ``torch.ops.specdec`` ops
(tree-attention metadata, KV-cache compaction). With nvcc available (``CUDA_HOME`` or
``/usr/local/cuda``) it is a CUDAExtension compiled for sm_80 and sm_90 with the CUDA
dispatch registered (``SPECDEC_WITH_CUDA``); otherwise a CPU-only CppExtension.

    MAX_JOBS=2 python setup.py build_ext --inplace
    pip install -e . --no-build-isolation
"""
from __future__ import annotations

import os
from pathlib import Path

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

ROOT = Path(__file__).resolve().parent


def _nvcc_available() -> bool:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if not cuda_home and Path("/usr/local/cuda/bin/nvcc").exists():
        cuda_home = "/usr/local/cuda"
        os.environ["CUDA_HOME"] = cuda_home  # torch.utils.cpp_extension reads it at import
    return bool(cuda_home) and (Path(cuda_home) / "bin" / "nvcc").exists()


def _extension():
    # Relative paths: setuptools rejects absolute source paths for in-place builds.
    sources = [
        "csrc/core/tree_attention.cpp",
        "csrc/core/kv_cache.cpp",
        "csrc/torch/ops.cpp",
        "csrc/torch/module.cpp",
    ]
    include_dirs = [str(ROOT / "csrc" / "core"), str(ROOT / "csrc" / "torch")]
    # No -std flag: torch.utils.cpp_extension adds the standard its headers need (C++20 in
    # recent releases, C++17 in older ones); the core itself is plain C++17.
    cxx_flags = ["-O3"]
    if os.environ.get("SPECDEC_FORCE_CPU") != "1" and _nvcc_available():
        return CUDAExtension(
            "specdec_kernels._C",
            sources + ["csrc/torch/ops_cuda.cpp", "csrc/core/kernels.cu"],
            include_dirs=include_dirs,
            define_macros=[("SPECDEC_WITH_CUDA", "1")],
            extra_compile_args={
                "cxx": cxx_flags,
                "nvcc": [
                    "-O3",
                    "-gencode=arch=compute_80,code=sm_80",
                    "-gencode=arch=compute_90,code=sm_90",
                ],
            },
        )
    return CppExtension(
        "specdec_kernels._C",
        sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags},
    )


setup(
    name="specdec_kernels",
    version="0.1.0",
    description="Fused kernels for speculative-decoding verification",
    packages=find_packages(include=["specdec_kernels", "specdec_kernels.*"]),
    python_requires=">=3.10",
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension},
    zip_safe=False,
)
