"""Build ckpt_ext._C.

A CUDA extension is built whenever the installed torch has CUDA (``torch.version.cuda``) and a CUDA
toolkit is found; no visible GPU is needed. Otherwise a C++ extension is built whose CPU code is
complete. The choice, what was compiled and what was skipped are printed at the end.

Object files live in build/temp-<torch>-<cuda|cpu>/ (pip's editable builds would use a new temporary
folder each time), so ninja recompiles only what changed.
"""
import glob
import importlib.util
import os
import sys
import time

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
# The range `make check-headers` compiles every C++ source against (tools/check_headers.py reads these):
# the oldest torch whose headers accept the sources, and the newest one tested. Newer ones get a warning.
MIN_TORCH = "2.5"
NEWEST_TESTED_TORCH = "2.15"


def _load_toolchain():
    spec = importlib.util.spec_from_file_location("ckpt_ext_toolchain", os.path.join(HERE, "tools", "toolchain.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


toolchain = _load_toolchain()


def log(msg):
    print(f"ckpt_ext setup: {msg}", file=sys.stderr, flush=True)


def sources(pattern):
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "csrc", "**", pattern), recursive=True))


def _major_minor(version):
    return TorchVersion(".".join(str(version).split("+")[0].split(".")[:2]))


if TorchVersion(torch.__version__) < MIN_TORCH:
    sys.exit(f"ckpt_ext needs torch >= {MIN_TORCH}, found {torch.__version__}")
if _major_minor(torch.__version__) > NEWEST_TESTED_TORCH:
    log(f"warning: torch {torch.__version__} is newer than the newest tested ({NEWEST_TESTED_TORCH})")

cuda_home = toolchain.real_cuda_home(cpp_extension.CUDA_HOME)
if cuda_home != cpp_extension.CUDA_HOME:  # torch's build reads this global when it links and runs nvcc
    log(f"CUDA_HOME: {cpp_extension.CUDA_HOME} (from the nvcc on PATH) has no CUDA libraries; using {cuda_home}, "
        "where that nvcc runs from (set CUDA_HOME to choose another)")
    cpp_extension.CUDA_HOME = cuda_home
with_cuda = bool(torch.version.cuda) and cuda_home is not None
if os.environ.get("CKPT_EXT_FORCE_CPU", "0") == "1":
    with_cuda = False
    log("CKPT_EXT_FORCE_CPU=1: building the CPU extension only")

# torch 2.15's headers need C++20, older ones C++17: ask the headers rather than a version table.
CXX_STD = toolchain.cxx_standard(cpp_extension.include_paths()[0])
cpp_sources = sources("*.cpp")
cu_sources = sources("*.cu")
cxx_flags = ["-O3", f"-std={CXX_STD}"]
link_flags = []
# Python's own CFLAGS carry -g: with torch's headers that makes each object ~50x larger and its compile ~35%
# slower (70 -> 46 s for csrc/checkpoint/checkpoint_checks.cpp here). CKPT_EXT_DEBUG_INFO=1 keeps it.
if os.environ.get("CKPT_EXT_DEBUG_INFO", "0") != "1":
    cxx_flags.append("-g0")
define_macros = []

# Every CPU kernel splits its work with at::parallel_for, a header template: under torch's OpenMP backend
# it runs in parallel only in code compiled with -fopenmp, and on one thread otherwise, whatever
# torch.get_num_threads() says. GCC's -fopenmp links libgomp.so.1, the soname torch ships in torch/lib and
# has already loaded, so the kernels run on torch's own OpenMP runtime and thread count (tests/test_build.py
# checks that they do). CKPT_EXT_NO_OPENMP=1 builds without it (a compiler without OpenMP).
OPENMP = bool(torch._C.has_openmp) and sys.platform.startswith("linux") and os.environ.get("CKPT_EXT_NO_OPENMP", "0") != "1"
if OPENMP:
    cxx_flags.append("-fopenmp")
    link_flags.append("-fopenmp")

if with_cuda:
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0+PTX"
    define_macros.append(("CKPT_EXT_WITH_CUDA", "1"))
    ext = cpp_extension.CUDAExtension(
        "ckpt_ext._C",
        cpp_sources + cu_sources,
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", f"-std={CXX_STD}", "--expt-relaxed-constexpr", "-lineinfo"]},
        extra_link_args=link_flags,
    )
    KIND = (f"CUDA extension (torch {torch.__version__}, CUDA {torch.version.cuda}, toolkit {cuda_home}, "
            f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}, -std={CXX_STD})")
    SKIPPED = []
else:
    reason = "torch has no CUDA" if not torch.version.cuda else "no CUDA toolkit found (CUDA_HOME)"
    if os.environ.get("CKPT_EXT_FORCE_CPU", "0") == "1":
        reason = "CKPT_EXT_FORCE_CPU=1"
    ext = cpp_extension.CppExtension(
        "ckpt_ext._C", cpp_sources, define_macros=define_macros, extra_compile_args={"cxx": cxx_flags},
        extra_link_args=link_flags,
    )
    KIND = f"CPU extension (torch {torch.__version__}, -std={CXX_STD}; {reason})"
    SKIPPED = cu_sources
KIND += ", OpenMP" if OPENMP else ", no OpenMP (the CPU kernels run on one thread)"


class BuildExt(cpp_extension.BuildExtension.with_options(use_ninja=True)):
    """torch's BuildExtension with a persistent object folder, a toolchain check and a summary."""

    def finalize_options(self):
        super().finalize_options()
        flavour = f"cuda{torch.version.cuda}" if with_cuda else "cpu"
        self.build_temp = os.path.join(HERE, "build", f"temp-torch{torch.__version__.split('+')[0]}-{flavour}")

    def build_extensions(self):
        self._check_linker()
        log(f"building {KIND}; objects in {os.path.relpath(self.build_temp, HERE)}")
        start = time.time()
        super().build_extensions()
        for e in self.extensions:
            self._check_built(self.get_ext_fullpath(e.name))
        # setuptools builds into build_lib, where build_py has already copied the package, a build record
        # of the source tree's included (possibly one for another torch): the record written next to the
        # new extension replaces it, so the wheel records the torch it was built against.
        self._write_build_info(os.path.dirname(self.get_ext_fullpath("ckpt_ext._C")))
        self._summary(start)

    def copy_extensions_to_source(self):
        """In-place builds (pip install -e, make build): the record goes next to the copied extension too."""
        super().copy_extensions_to_source()
        self._write_build_info(self.get_finalized_command("build_py").get_package_dir("ckpt_ext"))

    def _allow_static(self):
        return os.environ.get("CKPT_EXT_ALLOW_STATIC_LIBSTDCXX", "0") == "1"

    def _check_linker(self):
        """Refuses a compiler that links libstdc++ statically before minutes are spent compiling."""
        if self._allow_static():
            return
        # distutils links C++ with compiler_cxx ($CXX) in place of linker_so's first word; probe both.
        commands = [getattr(self.compiler, name, None) for name in ("compiler_cxx", "linker_so_cxx", "linker_so")]
        for exe in dict.fromkeys(c[0] for c in commands if c):
            if toolchain.libstdcxx_linkage(exe) == "static":
                sys.exit(toolchain.static_libstdcxx_message(f"the compiler `{exe}`"))

    def _check_built(self, path):
        """The built extension must load the libstdc++ torch loads, not carry a copy of its own."""
        if self._allow_static() or not os.path.exists(path):
            return
        if toolchain.shared_object_linkage(path) == "static":
            os.remove(path)
            sys.exit(toolchain.static_libstdcxx_message(f"the compiler that built {os.path.basename(path)}"))

    def _write_build_info(self, package_dir):
        # What the extension was built against, so that a mismatch is explained at import time
        # (ckpt_ext/_extension.py). Written after a successful build only: a failed one leaves the old pair.
        with open(os.path.join(package_dir, "_build_info.py"), "w") as f:
            f.write(
                "# Written by setup.py at build time.\n"
                f"TORCH_VERSION = {torch.__version__!r}\n"
                f"CUDA_VERSION = {torch.version.cuda if with_cuda else None!r}\n"
                f"WITH_CUDA = {with_cuda!r}\n"
            )

    def _summary(self, start):
        objects = glob.glob(os.path.join(self.build_temp, "**", "*.o"), recursive=True)
        fresh = [o for o in objects if os.path.getmtime(o) >= start - 1]
        log(f"built {KIND}")
        log(f"compiled {len(fresh)} of {len(objects)} object(s) ({len(objects) - len(fresh)} up to date) "
            f"in {time.time() - start:.0f} s")
        if SKIPPED:
            log(f"skipped {len(SKIPPED)} CUDA source(s): {', '.join(SKIPPED)}")


setup(
    name="ckpt_ext",
    version="0.1.0",
    description="Fast activation checkpointing for PyTorch: a C++ autograd Function with pooled boundaries",
    packages=find_packages(include=["ckpt_ext", "ckpt_ext.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExt},
    python_requires=">=3.9",
    install_requires=[f"torch>={MIN_TORCH}"],
    zip_safe=False,
)
