"""Build ckpt_ext._C.

A CUDA extension is built whenever the installed torch has CUDA (``torch.version.cuda``) and a CUDA
toolkit is found; no visible GPU is needed. Otherwise a C++ extension is built whose CPU code is
complete. The choice, and anything skipped, is printed.
"""
import glob
import os
import sys

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:  # pragma: no cover - message for users
    sys.exit(
        "ckpt_ext: torch must be installed before building, and the build must see it:\n"
        "    pip install torch && pip install --no-build-isolation ."
    )

from torch.torch_version import TorchVersion  # compares as versions, not strings

HERE = os.path.dirname(os.path.abspath(__file__))
MIN_TORCH = "2.4"


def log(msg):
    print(f"ckpt_ext setup: {msg}", file=sys.stderr)


def sources(pattern):
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "csrc", "**", pattern), recursive=True))


if TorchVersion(torch.__version__) < MIN_TORCH:
    sys.exit(f"ckpt_ext needs torch >= {MIN_TORCH}, found {torch.__version__}")

cuda_home = cpp_extension.CUDA_HOME
with_cuda = bool(torch.version.cuda) and cuda_home is not None
if os.environ.get("CKPT_EXT_FORCE_CPU", "0") == "1":
    with_cuda = False
    log("CKPT_EXT_FORCE_CPU=1: building the CPU extension only")

cpp_sources = sources("*.cpp")
cu_sources = sources("*.cu")
cxx_flags = ["-O3", "-std=c++17"]
define_macros = []

if with_cuda:
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not arch_list:
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0+PTX"
    log(
        f"building CUDA extension (torch {torch.__version__}, CUDA {torch.version.cuda}, toolkit {cuda_home}, "
        f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']})"
    )
    define_macros.append(("CKPT_EXT_WITH_CUDA", "1"))
    ext = cpp_extension.CUDAExtension(
        "ckpt_ext._C",
        cpp_sources + cu_sources,
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]},
    )
else:
    reason = "torch has no CUDA" if not torch.version.cuda else "no CUDA toolkit found (CUDA_HOME)"
    log(f"building CPU extension ({reason}); skipped {len(cu_sources)} CUDA source(s): {', '.join(cu_sources) or 'none'}")
    ext = cpp_extension.CppExtension(
        "ckpt_ext._C", cpp_sources, define_macros=define_macros, extra_compile_args={"cxx": cxx_flags}
    )

# Record what the extension was built against, so that a mismatch is explained at import time.
with open(os.path.join(HERE, "ckpt_ext", "_build_info.py"), "w") as f:
    f.write(
        "# Written by setup.py at build time.\n"
        f"TORCH_VERSION = {torch.__version__!r}\n"
        f"CUDA_VERSION = {torch.version.cuda if with_cuda else None!r}\n"
        f"WITH_CUDA = {with_cuda!r}\n"
    )

setup(
    name="ckpt_ext",
    version="0.1.0",
    description="Fast activation checkpointing for PyTorch: a C++ autograd Function with pooled boundaries",
    packages=find_packages(include=["ckpt_ext", "ckpt_ext.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.9",
    zip_safe=False,
)
