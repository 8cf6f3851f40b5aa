"""What the package says about its compiled core: a mismatched or missing ckpt_ext._C is explained
with what it was built against, what is installed, and the command that rebuilds it."""
import importlib
import types

import pytest
import torch

import ckpt_ext
from ckpt_ext import _extension


def test_build_record_matches_installed_torch():
    from ckpt_ext import _build_info

    assert _extension._same_minor(_build_info.TORCH_VERSION, torch.__version__)
    assert ckpt_ext._C.with_cuda == _build_info.WITH_CUDA
    if torch.version.cuda is None:
        assert not ckpt_ext._C.with_cuda


def test_versions_compare_as_versions_not_strings():
    assert _extension._same_minor("2.13.0+cpu", "2.13.1")
    assert not _extension._same_minor("2.10.0", "2.1.0")  # equal as strings up to "2.1"
    assert not _extension._same_minor("2.11.0+cu130", "2.13.0")


def test_mismatched_build_is_explained(monkeypatch):
    fake = types.SimpleNamespace(TORCH_VERSION="1.99.0", CUDA_VERSION=None, WITH_CUDA=False)
    monkeypatch.setattr(_extension, "_build_info", lambda: fake)
    with pytest.raises(ImportError) as e:
        _extension.load()
    msg = str(e.value)
    assert "torch 1.99.0" in msg and torch.__version__ in msg and "pip install --no-build-isolation" in msg


def test_missing_extension_is_explained(monkeypatch):
    real = importlib.import_module

    def fail(name, *a, **k):
        if name == "ckpt_ext._C":
            raise ImportError("undefined symbol: _ZN3c10...")
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", fail)
    with pytest.raises(ImportError) as e:
        _extension.load()
    assert "undefined symbol" in str(e.value) and "pip install --no-build-isolation" in str(e.value)


# ---- toolchain, C++ standard, source-tree shadowing ------------------------------------------------------------------
import importlib.util  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLCHAIN = os.path.join(ROOT, "tools", "toolchain.py")
needs_source = pytest.mark.skipif(not os.path.exists(TOOLCHAIN), reason="needs the source tree (tools/)")
needs_gxx = pytest.mark.skipif(not (shutil.which("g++") and shutil.which("readelf")), reason="needs g++ and readelf")


def _toolchain():
    spec = importlib.util.spec_from_file_location("ckpt_ext_toolchain_test", TOOLCHAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _static_wrapper(tmp_path):
    """A compiler like the GPU image's /opt/gcc wrapper: g++ that links libstdc++ statically."""
    wrapper = tmp_path / "g++-static"
    wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("g++")} "$@" -static-libstdc++\n')
    wrapper.chmod(0o755)
    return str(wrapper)


@needs_source
@needs_gxx
def test_static_libstdcxx_compiler_is_detected(tmp_path):
    tc = _toolchain()
    assert tc.libstdcxx_linkage(shutil.which("g++")) == "dynamic"
    assert tc.libstdcxx_linkage(_static_wrapper(tmp_path)) == "static"
    assert tc.libstdcxx_linkage(str(tmp_path / "no-such-compiler")) == "unknown"


@needs_source
@needs_gxx
def test_built_extension_uses_the_shared_libstdcxx():
    # A _C.so with its own libstdc++ crashed in codecvt on the GPU image; the build refuses one now.
    assert _toolchain().shared_object_linkage(ckpt_ext._C.__file__) == "dynamic"


@pytest.mark.skipif(not torch._C.has_openmp, reason="torch's parallel backend is not OpenMP")
@pytest.mark.parametrize("threads", [1, 2])
def test_kernels_parallelise_as_torch_does(threads):
    # at::parallel_for is a header template: an extension compiled without -fopenmp ran every CPU kernel
    # on one thread whatever torch.get_num_threads() said (found on a 2-core machine: no kernel scaled).
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert ckpt_ext._C.parallel_threads(64) == threads
    finally:
        torch.set_num_threads(before)


@needs_source
@needs_gxx
def test_setup_refuses_a_static_libstdcxx_compiler(tmp_path):
    env = dict(os.environ, CXX=_static_wrapper(tmp_path), CKPT_EXT_FORCE_CPU="1")
    env.pop("CKPT_EXT_ALLOW_STATIC_LIBSTDCXX", None)
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "links libstdc++ statically" in out and "CXX=/usr/bin/g++" in out, out[-3000:]
    assert not list((tmp_path / "lib").rglob("_C*.so"))


@needs_source
@pytest.mark.parametrize("guard, std", [("201703L", "c++17"), ("202002L", "c++20")])
def test_cxx_standard_follows_torch_headers(tmp_path, guard, std):
    (tmp_path / "ATen").mkdir()
    (tmp_path / "ATen" / "ATen.h").write_text(
        f"#pragma once\n#if !defined(_MSC_VER) && __cplusplus < {guard}\n#error C++ compiler required\n#endif\n")
    tc = _toolchain()
    assert tc.cxx_standard(str(tmp_path)) == std
    from torch.utils.cpp_extension import include_paths

    installed = tc.cxx_standard(include_paths()[0])
    from torch.torch_version import TorchVersion

    assert installed == ("c++20" if TorchVersion(torch.__version__) >= "2.15" else "c++17")


def _copy_sources(dst):
    """The Python files of the package, without the compiled extension: a source checkout."""
    pkg = os.path.dirname(ckpt_ext.__file__)
    shutil.copytree(pkg, dst, ignore=shutil.ignore_patterns("_C.*", "__pycache__"))


@needs_source
def test_source_tree_shadowing_an_installed_build_is_explained(tmp_path):
    source, site = tmp_path / "checkout", tmp_path / "site-packages"
    _copy_sources(source / "ckpt_ext")
    (site / "ckpt_ext").mkdir(parents=True)
    (site / "ckpt_ext" / "_C.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")  # found, never loaded
    env = dict(os.environ, PYTHONPATH=str(site))
    r = subprocess.run([sys.executable, "-c", "import ckpt_ext"], cwd=source, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    # The installed build named may be this one or another one on the path (an editable install's).
    assert "shadows the installed package" in r.stderr and str(source / "ckpt_ext") in r.stderr, r.stderr[-3000:]
    assert "pip install --no-build-isolation -e ." in r.stderr and "was built against" not in r.stderr


def test_missing_build_without_an_installed_one_asks_for_a_build(tmp_path, monkeypatch):
    monkeypatch.setattr(_extension, "PACKAGE_DIR", str(tmp_path))
    monkeypatch.setattr(_extension, "_installed_elsewhere", lambda *a: None)
    monkeypatch.setattr(importlib, "import_module", lambda name, *a: (_ for _ in ()).throw(ImportError("No module")))
    with pytest.raises(ImportError) as e:
        _extension.load()
    assert "Build it with" in str(e.value) and "shadows" not in str(e.value)


def test_cuda_home_behind_an_nvcc_wrapper_is_found(tmp_path, monkeypatch):
    """torch derives CUDA_HOME from the nvcc on PATH; a wrapper script in /usr/local/bin gives /usr/local,
    where linking fails on -lcudart. The toolkit is then taken from where nvcc says it runs."""
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    toolkit = tmp_path / "cuda-13.0"
    (toolkit / "lib64").mkdir(parents=True)
    (toolkit / "lib64" / "libcudart.so").write_text("")
    wrapper_home = tmp_path / "local"
    (wrapper_home / "bin").mkdir(parents=True)
    nvcc = wrapper_home / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho '#$ _HERE_={toolkit}/bin' >&2\necho '#$ TOP={toolkit}/bin/..' >&2\n")
    nvcc.chmod(0o755)
    tc = _toolchain()
    assert tc.real_cuda_home(str(wrapper_home)) == str(toolkit)
    assert tc.real_cuda_home(str(toolkit)) == str(toolkit)  # a home with the libraries is kept
    assert tc.real_cuda_home(None) is None
    monkeypatch.setenv("CUDA_HOME", str(wrapper_home))  # the user's choice is kept
    assert tc.real_cuda_home(str(wrapper_home)) == str(wrapper_home)


# ---- the build record after installing over a build made with another torch ----------------------------------------
_TINY_EXTENSION = """\
// Stands in for csrc/ in test_build_record_*: setup.py's steps without minutes of compiling.
// It formats a number so that it links libstdc++, which setup.py checks the extension loads (not carries).
#include <Python.h>
#include <sstream>
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) {
    std::ostringstream doc;
    doc << "test build " << 1.5;
    PyObject* m = PyModule_Create(&module);
    if (m) PyModule_AddStringConstant(m, "doc", doc.str().c_str());
    return m;
}
"""
_STALE_TORCH = "2.11.0+cu130"  # another minor release than any the suite runs on


def _checkout_built_with_another_torch(root):
    """A copy of the checkout whose csrc/ is one tiny source, with the build record an earlier in-place build
    with another torch left (ckpt_ext/_build_info.py, untracked)."""
    for f in ("setup.py", "pyproject.toml", os.path.join("tools", "toolchain.py")):
        os.makedirs(os.path.dirname(os.path.join(root, f)), exist_ok=True)
        shutil.copy(os.path.join(ROOT, f), os.path.join(root, f))
    shutil.copytree(os.path.join(ROOT, "ckpt_ext"), os.path.join(root, "ckpt_ext"),
                    ignore=shutil.ignore_patterns("_C.*", "__pycache__", "_build_info.py"))
    os.makedirs(os.path.join(root, "csrc"))
    with open(os.path.join(root, "csrc", "tiny.cpp"), "w") as f:
        f.write(_TINY_EXTENSION)
    with open(os.path.join(root, "ckpt_ext", "_build_info.py"), "w") as f:
        f.write(f"TORCH_VERSION = {_STALE_TORCH!r}\nCUDA_VERSION = '13.0'\nWITH_CUDA = True\n")


def _build(root, hook, out):
    """What pip runs for `pip install --no-build-isolation .` (build_wheel) or `-e .` (build_editable)."""
    code = f"from setuptools import build_meta; print(build_meta.{hook}({str(out)!r}))"
    env = dict(os.environ, CKPT_EXT_FORCE_CPU="1")
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return os.path.join(out, r.stdout.strip().splitlines()[-1])


def _recorded_torch(text):
    record = {}
    exec(text, record)
    return record["TORCH_VERSION"]


@needs_source
@needs_gxx
def test_build_record_in_a_wheel_built_over_another_torchs_build(tmp_path):
    # build_py copies the package, the old record included, into build_lib before build_ext runs: the wheel
    # carried the previous torch's record and the installed package refused to import until built twice.
    import zipfile

    root = tmp_path / "checkout"
    _checkout_built_with_another_torch(str(root))
    wheel = _build(str(root), "build_wheel", tmp_path / "dist")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        assert any(n.startswith("ckpt_ext/_C.") and n.endswith(".so") for n in names), names
        assert _recorded_torch(z.read("ckpt_ext/_build_info.py").decode()) == torch.__version__


@needs_source
@needs_gxx
def test_build_record_next_to_an_in_place_build_over_another_torchs_build(tmp_path):
    # `pip install -e .` (make build): the extension is copied into the source tree, and so must the record be.
    root = tmp_path / "checkout"
    _checkout_built_with_another_torch(str(root))
    _build(str(root), "build_editable", tmp_path / "dist")
    assert list((root / "ckpt_ext").glob("_C.*so"))
    assert _recorded_torch((root / "ckpt_ext" / "_build_info.py").read_text()) == torch.__version__
