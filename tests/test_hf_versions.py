"""What ckpt_ext asks of each transformers release instead of mirroring its names: the KV-cache argument
(from the value and the forward's annotations, whatever it is called), GPT-2's attention scale (from what
the module holds), the positional parameters of a layer; and the one-time warning outside the tested range."""
import math
import sys
import warnings

import pytest
import torch
from torch import nn

import ckpt_ext
from ckpt_ext.hf import versions
from ckpt_ext.hf.cache import cache_parameters, drop_cache
from ckpt_ext.hf.layers import Unsupported, _gpt2_scaling, positional_parameters

transformers = pytest.importorskip("transformers")
from transformers.cache_utils import Cache, DynamicCache  # noqa: E402


class _Writer(nn.Module):
    """A layer that appends to its cache on every call, its cache argument named as no release names it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, kv_store: "Cache | None" = None, use_cache: bool = False):
        if kv_store is not None:
            kv_store.calls = getattr(kv_store, "calls", 0) + 1
        return self.lin(x).tanh()


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Writer() for _ in range(3))

    def forward(self, x, cache=None, by_keyword=False):
        for layer in self.layers:
            x = layer(x, kv_store=cache, use_cache=True) if by_keyword else layer(x, cache, True)
        return x


@pytest.mark.parametrize("by_keyword", [False, True])
def test_cache_argument_found_from_annotation_whatever_its_name(by_keyword):
    model = ckpt_ext.enable_checkpointing(_Stack())
    cache = DynamicCache()
    x = torch.randn(2, 8, requires_grad=True)
    model(x, cache, by_keyword).sum().backward()
    # dropped before the checkpointed call: never written in forward, so not written again by the replay
    assert getattr(cache, "calls", 0) == 0
    assert x.grad is not None


def test_cache_value_found_without_annotation():
    layer = nn.Linear(2, 2)  # forward(input): no cache parameter at all
    args, kwargs = drop_cache(layer, (torch.zeros(1, 2), DynamicCache()), {"other": DynamicCache(), "n": 3})
    assert args[1] is None and kwargs["other"] is None and kwargs["n"] == 3


def test_cache_inside_a_container_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="inside past.*use_cache=False"):
        drop_cache(nn.Linear(2, 2), (torch.zeros(1, 2),), {"past": (DynamicCache(),)})


def test_layer_that_declares_it_only_reads_its_cache_keeps_it():
    class Reader(_Writer):
        _can_checkpoint_with_cache = True

    cache = DynamicCache()
    args, _ = drop_cache(Reader(), (torch.zeros(1, 8), cache), {})
    assert args[1] is cache


def test_every_release_cache_parameter_of_the_installed_layers_is_found():
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    for cls in (GPT2Block, LlamaDecoderLayer):
        positions, names = cache_parameters(cls)
        assert names, f"{cls.__name__}: no cache parameter found in {positional_parameters(cls)}"
        params = positional_parameters(cls)
        assert all(params[i] in names for i in positions)


def test_gpt2_scaling_from_what_the_module_holds():
    held = nn.Module()
    held.scaling = 0.125
    assert _gpt2_scaling(held, 64) == 0.125
    old = nn.Module()  # transformers 5.0: no `scaling`, flags only
    old.scale_attn_weights, old.scale_attn_by_inverse_layer_idx = True, False
    assert _gpt2_scaling(old, 64) == pytest.approx(1 / math.sqrt(64))
    old.scale_attn_by_inverse_layer_idx = True
    with pytest.raises(Unsupported, match="scale_attn_by_inverse_layer_idx"):
        _gpt2_scaling(old, 64)


def test_outside_the_tested_range_is_said_once(monkeypatch):
    low, high = versions.TESTED["transformers"]
    assert versions.outside("transformers", low) is None and versions.outside("transformers", high) is None
    assert "newer" in versions.outside("transformers", "99.0.0")
    assert "older" in versions.outside("transformers", "4.40.0")
    # transformers' lazy module may stand in sys.modules under another object than the one first imported
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "99.0.0")
    monkeypatch.setattr(versions, "_checked", set())
    with pytest.warns(UserWarning, match=rf"transformers 99.0.0 is newer .* {low} to {high}"):
        ckpt_ext.enable_checkpointing(_Stack())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt_ext.enable_checkpointing(_Stack())  # said once


def test_installed_release_inside_the_range_is_not_warned_about(monkeypatch):
    if versions.outside("transformers", transformers.__version__):
        pytest.skip(f"transformers {transformers.__version__} is outside the tested range (the canary run)")
    monkeypatch.setattr(versions, "_checked", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        versions.check_versions()
