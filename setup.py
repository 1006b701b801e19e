"""Build and package specdec_kernels.

The compiled extension ``specdec_kernels._C`` registers the ``torch.ops.specdec`` ops
(tree-attention metadata, KV-cache compaction, the C++ CPU path). It is built against the
torch already installed in the environment (hence ``--no-build-isolation``). When that torch
is a CUDA build (``torch.version.cuda``) and nvcc is found (``CUDA_HOME`` or
``/usr/local/cuda``) it is a CUDAExtension compiled for sm_80 and sm_90 with the CUDA dispatch
registered (``SPECDEC_WITH_CUDA``); otherwise (a CPU torch, whatever nvcc the machine has; no
nvcc; or ``SPECDEC_FORCE_CPU=1``) a CPU-only CppExtension.

    MAX_JOBS=2 python setup.py build_ext --inplace     # the extension, in place
    pip install --no-build-isolation .                  # into an environment (builds it)

Installed with pip, the extension is optional: if it does not compile (no C++ compiler, a
toolkit that does not match torch's CUDA), the package installs without it, says so once in
pip's output, and runs on the Triton and reference backends. ``SPECDEC_REQUIRE_EXTENSION=1``
(and every in-place build, as ``make`` runs it) makes that failure an error.

``make`` builds the torch-free core once, with CMake (``build/cmake/libspecdec_core.a``, the
library the C++ tests link), and passes it as ``SPECDEC_CORE_LIB``: the extension then links
that archive instead of compiling the core's sources a second time. It installs this checkout
editable into .venv after the in-place build, with ``SPECDEC_SKIP_EXTENSION=1``: the package
then declares no extension (pip compiles nothing) and the in-place ``specdec_kernels/_C*.so``
is imported from the checkout.
"""
from __future__ import annotations

import os
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def _find_cuda_home() -> str | None:
    """CUDA_HOME / CUDA_PATH, else /usr/local/cuda; exported before torch.utils.cpp_extension
    is imported, since it fixes its CUDA_HOME at import (from ``which nvcc`` otherwise, which
    may be a wrapper outside the toolkit)."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if not cuda_home and Path("/usr/local/cuda/bin/nvcc").exists():
        cuda_home = "/usr/local/cuda"
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        os.environ["CUDA_HOME"] = cuda_home
        return cuda_home
    return None


try:
    import torch
except ImportError as exc:  # pip's isolated build environment, or no torch installed yet
    raise SystemExit(
        "specdec_kernels builds against the torch of the environment it goes into: install "
        "torch first, then `pip install --no-build-isolation .` (without that flag pip builds "
        f"in an empty environment with no torch) ({exc})") from exc


def _cuda_build() -> str | None:
    """CUDA_HOME when the extension should be a CUDAExtension: torch is a CUDA build and nvcc
    is found. A CPU torch (torch.version.cuda is None) cannot compile or load CUDA code, and
    torch.utils.cpp_extension refuses a CUDAExtension there (CUDA_HOME not set)."""
    if os.environ.get("SPECDEC_FORCE_CPU") == "1" or not torch.version.cuda:
        return None
    return _find_cuda_home()


CUDA_HOME = _cuda_build()

from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def _extension():
    # Relative paths: setuptools rejects absolute source paths for in-place builds.
    core_sources = [
        "csrc/core/tree_attention.cpp",
        "csrc/core/kv_cache.cpp",
        "csrc/core/sampling_cpu.cpp",
        "csrc/core/sampling_cpu_avx2.cpp",
        "csrc/core/sampling_cpu_avx512.cpp",
    ]
    sources = ["csrc/torch/ops.cpp", "csrc/torch/ops_sampling_cpu.cpp",
               "csrc/torch/ops_adapters_cpu.cpp", "csrc/torch/module.cpp"]
    # The core prebuilt by CMake (the same -O3 and floating-point flags, position-
    # independent; without the -g -fwrapv Python adds here, which change no value of code free
    # of signed overflow, as the UBSan build checks) is linked as an archive, after the
    # objects that use it; else compiled here. A newer archive relinks the extension.
    core_lib = os.environ.get("SPECDEC_CORE_LIB")
    if core_lib:
        if not Path(core_lib).is_file():
            raise SystemExit(f"SPECDEC_CORE_LIB={core_lib}: no such file (cmake --build first)")
        extra_objects = [str(Path(core_lib).resolve())]
    else:
        sources, extra_objects = core_sources + sources, []
    include_dirs = [str(ROOT / "csrc" / "core"), str(ROOT / "csrc" / "torch")]
    # No -std flag: torch.utils.cpp_extension adds the standard its headers need (C++20 in
    # recent releases, C++17 in older ones); the core itself is plain C++17.
    # -ffp-contract=off: no a * b + c fused into one rounding anywhere (the instruction-set
    # builds of the CPU path must round alike; the files also say so in a pragma).
    # -fno-trapping-math: the selects of the exp and the kept weight may be computed on every
    # lane (no FP exception is ever observed); without it GCC leaves those loops scalar
    # wherever there are no masked vector ops (AVX2, SSE2). It changes no value.
    # -fopenmp: at::parallel_for is a header template that splits the work only when the
    # including file is compiled with OpenMP; without it every op ran on one thread. The
    # OpenMP runtime is torch's own (its wheel ships libgomp.so.1, already loaded).
    cxx_flags = ["-O3", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp"]
    link_flags = ["-fopenmp"]
    if CUDA_HOME is not None:
        return CUDAExtension(
            "specdec_kernels._C",
            sources + ["csrc/torch/ops_cuda.cpp", "csrc/core/kernels.cu"],
            include_dirs=include_dirs,
            extra_objects=extra_objects,
            depends=extra_objects,
            define_macros=[("SPECDEC_WITH_CUDA", "1")],
            extra_link_args=link_flags,
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
        extra_objects=extra_objects,
        depends=extra_objects,
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=link_flags,
    )


class _BuildExtension(BuildExtension):
    """torch's BuildExtension; under pip an extension that fails to compile is left out with
    one warning (the package runs without it), unless SPECDEC_REQUIRE_EXTENSION=1 or the build
    is in place (make's), where the failure stays an error."""

    def build_extensions(self):
        try:
            super().build_extensions()  # (torch's compiler checks, then each extension)
        except Exception as exc:  # no working compiler: CalledProcessError, RuntimeError, ...
            if self.inplace or os.environ.get("SPECDEC_REQUIRE_EXTENSION") == "1":
                raise
            names = [ext.name for ext in self.extensions]
            self.warn(f"specdec_kernels: the compiled extension {', '.join(names)} did not "
                      f"build ({type(exc).__name__}: {exc}); installing without it: the C++ "
                      "CPU path and the extension ops are unavailable, the Triton and "
                      "reference backends run (SPECDEC_REQUIRE_EXTENSION=1 makes this an "
                      "error)")
            self._failed.extend(names)

    def initialize_options(self):
        super().initialize_options()
        self._failed = []

    def get_outputs(self):  # what pip records: not the file of an extension left out
        failed = {self.get_ext_fullpath(name) for name in self._failed}
        return [path for path in super().get_outputs() if path not in failed]


setup(
    name="specdec_kernels",
    version="0.1.0",
    description="Fused kernels for speculative-decoding verification",
    packages=find_packages(include=["specdec_kernels", "specdec_kernels.*"]),
    python_requires=">=3.10",
    # Run time: numpy. torch is not declared: the extension is compiled against the torch
    # already installed (the engine's), and pip must never replace it.
    install_requires=["numpy"],
    ext_modules=[] if os.environ.get("SPECDEC_SKIP_EXTENSION") == "1" else [_extension()],
    cmdclass={"build_ext": _BuildExtension},
    zip_safe=False,
)
