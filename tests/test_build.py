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
