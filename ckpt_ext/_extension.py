"""Loads the compiled core, ckpt_ext._C, and explains a missing or mismatched build."""
import importlib

import torch

REBUILD = "pip install --no-build-isolation .   (or: make build)"


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


def load():
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
