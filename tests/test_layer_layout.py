"""The fused layers' layout has one home (C++) and the checkpointed segment keeps parameter hooks single.

* Family ids and weight slots come from ``_C.layer_families()``; ckpt_ext/hf/layers.py maps Hugging Face's
  parameters to those slots. The map must name every slot, in C++'s order, and cover every parameter of the
  Hugging Face layer: a missing, extra or swapped slot fails here (and at import).
* A tensor hook on a parameter (``p.register_hook(lambda g: 2 * g)``) fires once per backward with
  ``enable_checkpointing`` on fused layers, as without it: the segment's replay differentiates detached
  aliases of the parameters, never the parameters themselves.
"""
import copy

import pytest
import torch

import ckpt_ext
from ckpt_ext import _layout, fused
from ckpt_ext.hf import layers as hf_layers

pytest.importorskip("transformers")
from helpers.hf_models import RELATIVES, layers_of, make_model  # noqa: E402

_C = fused._C


def test_family_ids_and_names_come_from_cpp():
    families = dict(_C.layer_families())
    names = ("bert", "gpt2", "llama", "qwen3", "gemma", "gemma3", "gemma2")
    assert sorted(families) == sorted(names)
    assert (_layout.BERT, _layout.GPT2, _layout.LLAMA, _layout.QWEN3, _layout.GEMMA, _layout.GEMMA3,
            _layout.GEMMA2) == \
        tuple(families[n][0] for n in names)
    assert len({fid for fid, _ in families.values()}) == len(names)
    for name, (fid, slots) in families.items():
        assert _layout.FAMILY_NAMES[fid] == name
        assert list(hf_layers.HF_PARAMETERS[name]) == list(slots)
        assert len(set(slots)) == len(slots)


@pytest.mark.parametrize("family,kw", [("bert", {}), ("gpt2", {}), ("llama", {"attention_bias": True, "mlp_bias": True})])
def test_slot_map_covers_every_parameter_of_the_hf_layer(family, kw):
    layer = layers_of(make_model(family, layers=1, **kw))[0]
    fid = dict(_C.layer_families())[family][0]
    paths = hf_layers.WEIGHT_PATHS[fid]
    assert sorted(paths) == sorted(name for name, _ in layer.named_parameters())


@pytest.mark.parametrize("family", RELATIVES)
def test_slot_map_covers_every_parameter_of_the_relatives(family):
    """Qwen2, Mistral, Qwen3, Gemma: every parameter of the layer has its slot; the slots without a parameter are
    biases the layer registers as None (nn.Linear(bias=False))."""
    layer = layers_of(make_model(family, layers=1))[0]
    fid = hf_layers.layer_classes()[type(layer)]
    paths = hf_layers.WEIGHT_PATHS[fid]
    params = {name for name, _ in layer.named_parameters()}
    assert params <= set(paths)
    for path in set(paths) - params:
        module, _, name = path.rpartition(".")
        assert name == "bias" and layer.get_submodule(module).bias is None, path


def _swapped(mapping, family, a, b):
    m = copy.deepcopy(mapping)
    items = list(m[family].items())
    i, j = [k for k, (slot, _) in enumerate(items) if slot in (a, b)]
    items[i], items[j] = items[j], items[i]
    m[family] = dict(items)
    return m


@pytest.mark.parametrize("family,a,b", [("bert", "q_weight", "k_weight"), ("gpt2", "fc_weight", "mlp_proj_weight"),
                                        ("llama", "gate_weight", "up_weight"), ("llama", "ln1_weight", "q_weight")])
def test_a_swapped_slot_fails(family, a, b):
    families = dict(_C.layer_families())
    assert hf_layers.slot_paths(families, hf_layers.HF_PARAMETERS)  # the shipped map passes
    with pytest.raises(RuntimeError, match="must agree in names and order"):
        hf_layers.slot_paths(families, _swapped(hf_layers.HF_PARAMETERS, family, a, b))


def test_a_missing_or_extra_slot_fails():
    families = dict(_C.layer_families())
    missing = copy.deepcopy(hf_layers.HF_PARAMETERS)
    del missing["gpt2"]["ln2_bias"]
    with pytest.raises(RuntimeError, match="gpt2"):
        hf_layers.slot_paths(families, missing)
    extra = copy.deepcopy(hf_layers.HF_PARAMETERS)
    extra["bert"]["pooler_weight"] = "pooler.dense.weight"
    with pytest.raises(RuntimeError, match="bert"):
        hf_layers.slot_paths(families, extra)


def test_uses_dropout_is_cpps_rule():
    model = ckpt_ext.fuse(make_model("gpt2", dropout=0.1, layers=1))
    spec = layers_of(model)[0].spec
    assert _C.uses_dropout(spec, True) and not _C.uses_dropout(spec, False)
    spec0 = layers_of(ckpt_ext.fuse(make_model("gpt2", dropout=0.0, layers=1)))[0].spec
    assert not _C.uses_dropout(spec0, True)


# ---- parameter hooks under the checkpointed segment -------------------------------------------------------------

def _hooked_grads(model, hooked, ids, steps=2):
    calls = {name: 0 for name in hooked}
    params = dict(model.named_parameters())

    def hook_for(name):
        def hook(g):
            calls[name] += 1
            return 2 * g
        return hook

    handles = [params[name].register_hook(hook_for(name)) for name in hooked]
    grads = []
    try:
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            out = model(input_ids=ids, use_cache=False).last_hidden_state
            out.pow(2).mean().backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    finally:
        for h in handles:
            h.remove()
    return grads, calls


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_parameter_hook_fires_once_per_step_with_checkpointing(family):
    base = ckpt_ext.fuse(make_model(family, layers=3)).train()
    ckpt = ckpt_ext.enable_checkpointing(copy.deepcopy(base), every=3)
    stack = "encoder.layer" if family == "bert" else "h"
    # An inner weight, and (GPT-2) the last layer's last linear, whose gradient the replay computes directly.
    hooked = [f"{stack}.0.attention.self.query.weight" if family == "bert" else f"{stack}.0.attn.c_attn.weight",
              f"{stack}.2.output.dense.weight" if family == "bert" else f"{stack}.2.mlp.c_proj.weight"]
    ids = torch.randint(0, 50, (2, 7))
    steps = 2
    want, want_calls = _hooked_grads(base, hooked, ids, steps)
    got, got_calls = _hooked_grads(ckpt, hooked, ids, steps)
    assert want_calls == {name: steps for name in hooked}
    assert got_calls == want_calls
    for w, g in zip(want, got):
        assert w.keys() == g.keys()
        for name in w:
            torch.testing.assert_close(g[name], w[name], rtol=1e-5, atol=1e-6, msg=name)
