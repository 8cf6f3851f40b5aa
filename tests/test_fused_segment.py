"""Tests of fused layers checkpointed (the C++ SegmentFunction): enable_checkpointing(every=1, 2, all) on fused
models equals the non-checkpointed fused model exactly, dropout on; the pool is empty again after backward;
the segment is one autograd node, replays only in backward, skips the last linear, detects modified parameters,
serves Hugging Face's gradient checkpointing and shared weights."""
import copy

import pytest
import torch

import ckpt_ext
from ckpt_ext import FusedTransformerLayer

transformers = pytest.importorskip("transformers")
from helpers.devices import DEVICES  # noqa: E402
from helpers.hf_models import (B, H, RELATIVES, S, close, embeds_call,  # noqa: E402
                               fused_copy, hf_enable, inputs_for, layers_of, make_model)
from helpers.fused import _checkpointed_pair, _seed  # noqa: E402,F401  (an autouse fixture)
from helpers.pool import allocator_events  # noqa: E402


# ---- checkpointing: SegmentFunction --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("every", [1, 2, 3], ids=["every1", "every2", "all"])
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama", "llama-gqa"] + RELATIVES)
def test_checkpointed_equals_not_checkpointed_exactly_with_dropout(family, every, device):
    model, ck = _checkpointed_pair(family, every)
    model.to(device)
    ck.to(device)
    kw = inputs_for(family, padding=True, device=device)
    torch.manual_seed(7)
    e_ref, ref = embeds_call(model, family, kw)
    torch.manual_seed(7)
    before = ckpt_ext.pool_stats(device)["in_use_bytes"]
    e_ck, out = embeds_call(ck, family, kw)
    assert ckpt_ext.pool_stats(device)["in_use_bytes"] > before  # the segment outputs live in the pool
    assert torch.equal(out, ref)
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g)
    assert torch.equal(e_ck.grad, e_ref.grad)
    layer_params = {id(p) for p in layers_of(ck).parameters()}
    for (name, p), q in zip(model.named_parameters(), ck.parameters()):
        if id(q) in layer_params:
            assert q.grad is not None, name
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name
    del out, ref
    assert ckpt_ext.pool_stats(device)["in_use_bytes"] == before


def test_segment_is_one_node_with_pooled_output():
    model, ck = _checkpointed_pair("bert", every=3)
    out = ck(**inputs_for("bert", padding=True)).last_hidden_state
    assert "SegmentFunction" in out.grad_fn.name()
    assert ckpt_ext.is_pooled(out)
    # The node's inputs: the hidden states and every distinct parameter of the three layers.
    n_params = sum(1 for _ in ck.encoder.layer.parameters())
    assert len(out.grad_fn.next_functions) == 1 + n_params


def test_is_recomputing_during_the_segment_replay_only():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append((str(func), ckpt_ext.is_recomputing()))
            return func(*args, **(kwargs or {}))

    _, ck = _checkpointed_pair("gpt2", every=2, layers=2)
    with Record() as fwd:
        out = ck(**inputs_for("gpt2", padding=False)).last_hidden_state
    assert fwd.seen and not any(flag for _, flag in fwd.seen)
    with Record() as bwd:
        out.sum().backward()
    replayed = [op for op, flag in bwd.seen if flag]
    assert any("addmm" in op or "mm" in op for op in replayed), bwd.seen  # the layers' GEMMs, rerun
    assert not ckpt_ext.is_recomputing()


def test_segment_grad_wrt_input_only_and_eval():
    model, ck = _checkpointed_pair("gpt2", every=2, layers=2)
    kw = inputs_for("gpt2", padding=False)
    torch.manual_seed(1)
    e_ref, ref = embeds_call(model, "gpt2", kw)
    torch.manual_seed(1)
    e_ck, out = embeds_call(ck, "gpt2", kw)
    (g_ref,) = torch.autograd.grad(ref.sum(), e_ref)
    (g_ck,) = torch.autograd.grad(out.sum(), e_ck)
    assert torch.equal(g_ck, g_ref)
    assert all(p.grad is None for p in ck.parameters())
    ck.eval()
    model.eval()
    with torch.no_grad():
        assert torch.equal(ck(**kw).last_hidden_state, model(**kw).last_hidden_state)


def test_segment_detects_parameters_modified_before_backward():
    model, ck = _checkpointed_pair("llama", every=2, layers=2)
    out = ck(**inputs_for("llama", padding=False)).last_hidden_state
    with torch.no_grad():
        ck.layers[0].mlp.up_proj.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place between forward and backward"):
        out.sum().backward()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_replay_skips_the_last_linear(family):
    """The backward replays the segment but never multiplies the last linear's input by its weight."""
    model, ck = _checkpointed_pair(family, every=2, layers=2)
    last = ck.get_submodule("h.1.mlp.c_proj" if family == "gpt2" else "layers.1.mlp.down_proj")
    weight = last.weight
    out = ck(**inputs_for(family, padding=False)).last_hidden_state
    forward_orientation = (weight.t() if family == "llama" else weight).stride()  # x @ W^T (Linear), x @ W (Conv1D)
    uses = []  # (is the forward product?) for every matrix product reading the weight

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                w = args[-1]
                if w.data_ptr() == weight.data_ptr():
                    uses.append(w.stride() == forward_orientation)
            return func(*args, **(kwargs or {}))

    with Spy():
        out.sum().backward()
    assert uses == [False]  # only the input-gradient product g @ W (transposed orientation)
    assert weight.grad is not None


def test_replayed_output_is_freed_before_the_layer_backward():
    """BERT's replay runs its last layer whole; the layer's output (its last norm's, which the norm's backward
    does not read: it saves the pre-norm sum) is only the root of the inner backward, and its memory goes back
    before that backward runs (as torch's engine lets an unsaved recomputed output go), not after the whole
    layer's backward: one [tokens, hidden] tensor less at the segment's peak. (With the pre-norm boundary on, the
    default, BERT's replay stops before that norm; this is the full replay it falls back to, e.g. for an adapter on
    the output linear.)"""
    model, ck = _checkpointed_pair("bert", every=1, layers=1, dropout=0.0)
    before = ckpt_ext._C.pre_norm_boundaries(False)
    try:
        out = ck(**inputs_for("bert", padding=False)).last_hidden_state
        row_bytes = out.numel() * out.element_size()
        events = allocator_events(lambda: out.backward(torch.ones_like(out)))
    finally:
        ckpt_ext._C.pre_norm_boundaries(before)
    norm = [k for k, (_, size, op) in enumerate(events) if size == row_bytes and op == "ckpt_ext::bias_dropout_add_layer_norm"]
    first_bwd = next(k for k, (_, size, op) in enumerate(events) if size > 0 and
                     op == "ckpt_ext::bias_dropout_add_layer_norm_backward")
    assert len(norm) == 4  # the replay's two norms, each writing its output and its pre-norm sum
    freed_at = {}
    for k, (ptr, size, _) in enumerate(events):
        if size < 0:
            for a in norm:
                if events[a][0] == ptr and a < k and a not in freed_at:
                    freed_at[a] = k
                    break
    # The second norm's output is freed before the first norm backward allocates; its pre-norm sum (saved) after.
    assert sorted(freed_at.get(a, len(events)) < first_bwd for a in norm[2:]) == [False, True], (norm, freed_at, first_bwd)
    assert all(freed_at.get(a, len(events)) > first_bwd for a in norm[:2])


def test_hugging_face_gradient_checkpointing_uses_the_segment_function():
    model, _ = _checkpointed_pair("gpt2", every=1, layers=2)
    hf_ck = copy.deepcopy(model)
    hf_enable(hf_ck)
    assert all(m.gradient_checkpointing for m in hf_ck.h)
    kw = inputs_for("gpt2", padding=True)
    torch.manual_seed(2)
    ref = model(**kw).last_hidden_state
    torch.manual_seed(2)
    out = hf_ck(**kw).last_hidden_state
    assert torch.equal(out, ref)
    ref.sum().backward()
    out.sum().backward()
    for (name, p), q in zip(model.named_parameters(), hf_ck.parameters()):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), name
    with pytest.raises(ValueError, match="gradient checkpointing enabled"):
        ckpt_ext.enable_checkpointing(hf_ck)


def test_segment_with_a_weight_shared_by_two_layers():
    """Tied weights are one input of the node; the last linear's hand-computed gradient adds to the rest."""
    model, ck = _checkpointed_pair("llama", every=2, layers=2)
    for m in (model, ck):
        m.layers[0].mlp.down_proj.weight = m.layers[1].mlp.down_proj.weight  # the last linear of the segment
    kw = inputs_for("llama", padding=False)
    torch.manual_seed(4)
    ref = model(**kw).last_hidden_state
    torch.manual_seed(4)
    out = ck(**kw).last_hidden_state
    assert torch.equal(out, ref)
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g)
    shared_ref, shared = model.layers[1].mlp.down_proj.weight, ck.layers[1].mlp.down_proj.weight
    close(shared.grad, shared_ref.grad)
    for (name, p), q in zip(model.named_parameters(), ck.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            close(q.grad, p.grad, scale=p.grad.abs().max().item())


def test_masks_are_checked():
    model = make_model("bert", layers=1)
    layer = FusedTransformerLayer(model.encoder.layer[0])
    x = torch.randn(B, S, H)
    with pytest.raises(RuntimeError, match="4-D mask"):
        layer(x, torch.ones(B, S, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="bool or have the dtype"):
        layer(x, torch.zeros(B, 1, S, S, dtype=torch.float64))


def test_submodule_replaced_after_fuse_runs_hugging_face_forward():
    model = make_model("gpt2", layers=2).train()
    fused = fused_copy(model)
    new = copy.deepcopy(model.h[1].mlp.c_fc)
    with torch.no_grad():
        new.weight.mul_(2.0)
    model.h[1].mlp.c_fc = new
    fused.h[1].mlp.c_fc = copy.deepcopy(new)
    new_mlp = copy.deepcopy(model.h[0].mlp)
    model.h[0].mlp = new_mlp
    fused.h[0].mlp = copy.deepcopy(new_mlp)  # a direct child of the fused layer
    kw = inputs_for("gpt2", padding=True)
    with pytest.warns(UserWarning, match="was replaced after fuse"):
        out = fused(**kw).last_hidden_state
    close(out, model(**kw).last_hidden_state)
