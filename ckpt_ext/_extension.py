"""Loads the compiled core, ckpt_ext._C, and explains a missing or mismatched build."""
import glob
import importlib
import importlib.metadata
import os
import sys

import torch

REBUILD = "pip install --no-build-isolation .   (or: make build)"
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _build_info():
    try:
        from . import _build_info as info
    except ImportError:
        return None
    return info


def _same_minor(a: str, b: str) -> bool:
    """Same major.minor release (the C++ ABI of torch changes between minor releases)."""
    def major_minor(v: str):
        parts = v.split("+")[0].split(".")
        return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts[:2])

    return major_minor(a) == major_minor(b)


def _has_extension(package_dir: str) -> bool:
    return bool(glob.glob(os.path.join(package_dir, "_C.*so")) or glob.glob(os.path.join(package_dir, "_C.*pyd")))


def _installed_elsewhere(package_dir: str = PACKAGE_DIR):
    """Another ckpt_ext folder that has a built _C: from the installed distribution's record, or on
    a later sys.path entry. None if there is none."""
    candidates = []
    try:
        dist = importlib.metadata.distribution("ckpt_ext")
        candidates += [os.path.dirname(str(dist.locate_file(f))) for f in (dist.files or [])
                       if f.parts[:1] == ("ckpt_ext",) and f.name.startswith("_C.")]
    except importlib.metadata.PackageNotFoundError:
        pass
    candidates += [os.path.join(p or os.getcwd(), "ckpt_ext") for p in sys.path]
    here = os.path.realpath(package_dir)
    for c in candidates:
        if os.path.realpath(c) != here and _has_extension(c):
            return os.path.realpath(c)
    return None


def _shadowing_message(package_dir: str, installed: str) -> str:
    return (
        f"ckpt_ext was imported from the source tree {package_dir}, which has no compiled extension (_C), "
        f"while a built ckpt_ext is installed at {installed}. The source folder shadows the installed "
        "package because Python looks in the current directory (or PYTHONPATH) first. Either run Python "
        f"from another directory, or install the source tree in place:\n    pip install --no-build-isolation -e ."
    )


def load():
    if not _has_extension(PACKAGE_DIR):
        installed = _installed_elsewhere()
        if installed:
            raise ImportError(_shadowing_message(PACKAGE_DIR, installed))
    info = _build_info()
    built = f"torch {info.TORCH_VERSION} (CUDA {info.CUDA_VERSION or 'none'})" if info else "unknown (no build record)"
    installed = f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'})"
    if info is not None and not _same_minor(info.TORCH_VERSION, torch.__version__):
        raise ImportError(
            f"ckpt_ext._C was built against {built} but {installed} is installed. "
            f"Rebuild the extension with:\n    {REBUILD}"
        )
    try:
        return importlib.import_module("ckpt_ext._C")
    except ImportError as e:
        raise ImportError(
            f"ckpt_ext._C could not be loaded ({e}). It was built against {built}; installed is {installed}. "
            f"Build it with:\n    {REBUILD}"
        ) from e
