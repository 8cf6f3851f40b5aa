"""Tests of the fused transformer layers (ckpt_ext.fuse, FusedTransformerLayer, csrc/layers/).

* Parity with the Hugging Face module each fused layer replaces (dropout off): outputs, the input's
  gradient and every parameter's gradient, float32, on odd shapes (hidden 72, 3 heads, seq 37; Llama
  with grouped-query attention), with and without padding masks; eval / no_grad parity.
* Dropout on: reproducible under torch.manual_seed, the observed drop rate within statistical bounds.
* fuse(): state_dict keys and Parameter identity preserved, warnings and errors, Hugging Face's own
  forward for the calls the fused path cannot serve (KV cache in eval, attention weights requested).
* Checkpointing (SegmentFunction): enable_checkpointing(every=1, 2, all) on fused models equals the
  non-checkpointed fused model exactly, dropout on; the pool is empty again after backward.

Tolerances (float32): |fused - hf| <= 1e-5 * |hf| + 1e-6 * scale, scale = the largest magnitude of the
quantity compared (per tensor; per model for gradients, because some gradients -- BERT's key bias -- are
zero in exact arithmetic and pure rounding noise in both implementations); the models and comparisons are
in helpers/hf_models.py.
"""
import copy
import math
import warnings

import pytest
import torch

import ckpt_ext
from ckpt_ext import FusedTransformerLayer, fuse

transformers = pytest.importorskip("transformers")
from helpers.devices import DEVICES, requires_cuda  # noqa: E402
from helpers.hf_models import (B, FAMILIES, H, S, assert_training_parity, close, embeds_call,  # noqa: E402
                               fused_copy, inputs_for, layers_of, make_model)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---- parity with Hugging Face (dropout off) ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padding", [False, True], ids=["nomask", "padding"])
@pytest.mark.parametrize("family", FAMILIES)
def test_training_parity_outputs_and_all_grads(family, padding, device):
    model = make_model(family).train().to(device)
    fused = fused_copy(model)
    assert all(isinstance(m, FusedTransformerLayer) for m in layers_of(fused))
    kw = inputs_for(family, padding, device)
    assert_training_parity(model, fused, family, kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama-gqa"])
def test_eval_and_no_grad_parity(family, attn, device):
    model = make_model(family, dropout=0.1, attn=attn).eval().to(device)  # dropout inactive in eval
    fused = fused_copy(model)
    kw = inputs_for(family, padding=True, device=device)
    with torch.no_grad():
        ref = model(**kw).last_hidden_state
        out = fused(**kw).last_hidden_state
    close(out, ref)
    assert not out.requires_grad
    with torch.inference_mode():
        close(fused(**kw).last_hidden_state, ref)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_kv_cache_in_eval_runs_hugging_face_forward(family):
    """Generation-style calls (a cache) run the original forward on the same parameters: same outputs, cache filled."""
    model = make_model(family).eval()
    fused = fused_copy(model)
    kw = inputs_for(family, padding=False)
    kw["use_cache"] = True
    with torch.no_grad():
        ref = model(**kw)
        out = fused(**kw)
    assert torch.equal(out.last_hidden_state, ref.last_hidden_state)
    assert out.past_key_values.get_seq_length() == S


def test_kv_cache_in_training_is_dropped_with_a_warning():
    model = make_model("gpt2").train()
    fused = fused_copy(model)
    kw = inputs_for("gpt2", padding=False)
    kw["use_cache"] = True
    with pytest.warns(UserWarning, match="do not write a KV cache in training"):
        out = fused(**kw).last_hidden_state
    kw["use_cache"] = False
    close(out, model(**kw).last_hidden_state)


def test_output_hidden_states_and_attentions():
    model = make_model("bert", attn="eager").eval()
    fused = fused_copy(model)
    ids = inputs_for("bert", padding=True)
    with torch.no_grad():
        ref = model(**ids, output_hidden_states=True, output_attentions=True)
        got = fused(**ids, output_hidden_states=True)
        assert len(got.hidden_states) == len(ref.hidden_states) == 3
        for a, b in zip(got.hidden_states, ref.hidden_states):
            close(a, b)
        # Attention weights are computed by Hugging Face's forward (the fused layer has none).
        got = fused(**ids, output_attentions=True)
    assert len(got.attentions) == 2
    for a, b in zip(got.attentions, ref.attentions):
        close(a, b)


def test_single_layer_call_signatures():
    """Layers called directly, as Hugging Face's stacks call them (positional mask / cache arguments)."""
    model = make_model("gpt2").train()
    fused = fused_copy(model)
    x = torch.randn(B, S, H)
    ref_layer, fused_layer = model.h[0], fused.h[0]
    mask = torch.ones(B, 1, S, S, dtype=torch.bool).tril()
    mask[0, :, :, :4] = False
    mask[0, :, :4, 0] = True  # no row fully masked
    close(fused_layer(x, None, mask), ref_layer(x, None, mask))
    close(fused_layer(x, attention_mask=mask), ref_layer(x, attention_mask=mask))
    additive = torch.zeros(B, 1, S, S).masked_fill(~mask, torch.finfo(torch.float32).min)
    close(fused_layer(x, None, additive), ref_layer(x, None, additive))
    with pytest.raises(TypeError, match="multiple values"):
        fused_layer(x, None, mask, attention_mask=mask)
    with pytest.raises(TypeError, match="at most"):
        fused_layer(x, None, None, None, None, False, 7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama-gqa"])
def test_low_precision_error_within_a_multiple_of_hugging_faces(family, dtype, device):
    """Low precision (flash-attention's scheme): the fused model's error against a float32 reference is
    at most 2x (outputs) / 3x (gradients) Hugging Face's own error in that dtype, plus a tiny atol."""
    if dtype == torch.float16 and device == "cpu" and family != "gpt2":
        pytest.skip("one float16 CPU case is enough (slow CPU float16 GEMMs)")
    ref32 = make_model(family).train().to(device)
    kw = inputs_for(family, padding=True, device=device)
    hf = copy.deepcopy(ref32).to(dtype)
    fused = fused_copy(hf)
    runs = {}
    for name, model in (("ref", ref32), ("hf", hf), ("fused", fused)):
        emb, out = embeds_call(model, family, kw)
        out.float().backward(torch.ones_like(out, dtype=torch.float32) / out.numel() ** 0.5)
        runs[name] = (out.float(), emb.grad.float(), {n: p.grad.float() for n, p in model.named_parameters()
                                                      if p.grad is not None})
    ref_out, ref_in, ref_grads = runs["ref"]
    for factor, pick in ((2, lambda r: r[0]), (3, lambda r: r[1])):
        err_hf = (pick(runs["hf"]) - pick(runs["ref"])).abs().max().item()
        err_fused = (pick(runs["fused"]) - pick(runs["ref"])).abs().max().item()
        assert err_fused <= factor * err_hf + 1e-5 * pick(runs["ref"]).abs().max().item(), (err_fused, err_hf)
    for n, g in ref_grads.items():
        err_hf = (runs["hf"][2][n] - g).abs().max().item()
        err_fused = (runs["fused"][2][n] - g).abs().max().item()
        assert err_fused <= 3 * err_hf + 1e-3 * g.abs().max().item(), (n, err_fused, err_hf)


@pytest.mark.parametrize("padding", [False, True], ids=["nomask", "padding"])
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama-gqa"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_explicit_attention_path_matches(family, padding, attn):
    """With attention dropout the fused layer calls SDPA with dropout from a generator state derived from the
    layer's seed (on CPU SDPA's math path, not the flash kernel of p = 0). At p = 1e-9 the mask keeps
    everything, so it must match Hugging Face without dropout: checks the masking (bool, additive -- fully
    masked rows included -- causal) and GQA of that path."""
    model = make_model(family, layers=2, attn=attn, **{
        "bert": dict(attention_probs_dropout_prob=1e-9), "gpt2": dict(attn_pdrop=1e-9),
        "llama-gqa": dict(attention_dropout=1e-9)}[family]).train()
    fused = fused_copy(model)
    assert all(m.spec.attn_p == 1e-9 for m in layers_of(fused))
    for m in model.modules():  # the reference: no attention dropout at all
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.0
    kw = inputs_for(family, padding)
    assert_training_parity(model, fused, family, kw)


# ---- dropout -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_dropout_is_reproducible_and_seeded(family):
    model = fuse(make_model(family, dropout=0.2)).train()
    kw = inputs_for(family, padding=True)
    torch.manual_seed(5)
    a = model(**kw).last_hidden_state
    torch.manual_seed(5)
    b = model(**kw).last_hidden_state
    c = model(**kw).last_hidden_state
    assert torch.equal(a, b)
    assert not torch.equal(b, c)
    model.eval()
    with torch.no_grad():
        d = model(**kw).last_hidden_state
    assert not torch.equal(a, d)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_residual_dropout_rate(p):
    """GPT-2 block with zero projections and unit biases: out - x is the residual dropout of ones."""
    model = make_model("gpt2", dropout=p, layers=1, attn_pdrop=0.0).train()
    block = model.h[0]
    with torch.no_grad():
        for lin, bias in ((block.attn.c_proj, 0.0), (block.mlp.c_proj, 1.0)):
            lin.weight.zero_()
            lin.bias.fill_(bias)
    fused = FusedTransformerLayer(block).train()
    x = torch.randn(4, 100, H)
    drop = fused(x) - x
    scaled = 1.0 / (1.0 - p)
    kept = (drop - scaled).abs() < 1e-5
    dropped = drop.abs() < 1e-5
    assert bool((kept | dropped).all())
    n = drop.numel()
    rate = dropped.sum().item() / n
    assert abs(rate - p) < 5 * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_attention_dropout_rate(p):
    """GPT-2 block with q = 0 (uniform causal attention: row i weighs i + 1 keys by 1/(i+1)), v = 1, an
    identity output projection and a zero MLP: out - x = dropout(probs) @ 1, so (out - x) * (i+1) * (1-p)
    counts the kept attention weights of each row exactly."""
    model = make_model("gpt2", layers=1, attn_pdrop=p, resid_pdrop=0.0).train()
    block = model.h[0]
    with torch.no_grad():
        block.attn.c_attn.weight[:, :H].zero_()  # q
        block.attn.c_attn.bias[:H].zero_()
        block.attn.c_attn.weight[:, 2 * H:].zero_()  # v = bias = 1
        block.attn.c_attn.bias[2 * H:].fill_(1.0)
        block.attn.c_proj.weight.copy_(torch.eye(H))
        block.attn.c_proj.bias.zero_()
        block.mlp.c_proj.weight.zero_()
        block.mlp.c_proj.bias.zero_()
    fused = FusedTransformerLayer(block).train()
    batch, seq = 4, 100
    x = torch.randn(batch, seq, H)
    ctx = (fused(x) - x).view(batch, seq, 3, H // 3)[..., 0]  # one value per (batch, row, head)
    rows = torch.arange(1, seq + 1, dtype=torch.float32).view(1, seq, 1)
    kept = ctx * rows * (1 - p)
    assert torch.allclose(kept, kept.round(), atol=1e-3)
    n = batch * 3 * seq * (seq + 1) // 2
    rate = 1 - kept.round().sum().item() / n
    assert abs(rate - p) < 5 * math.sqrt(p * (1 - p) / n)


def test_attention_dropout_changes_only_the_attention():
    """Attention-probability dropout is applied (SDPA's, seeded from the layer's seed), reproducibly."""
    model = make_model("llama", dropout=0.3, layers=1).train()
    layer = model.layers[0]
    fused = FusedTransformerLayer(layer)
    x = torch.randn(B, S, H)
    cos, sin = model.rotary_emb(x, torch.arange(S)[None])
    torch.manual_seed(1)
    a = fused(x, position_embeddings=(cos, sin))
    torch.manual_seed(1)
    assert torch.equal(a, fused(x, position_embeddings=(cos, sin)))
    fused.eval()
    ref = fused(x, position_embeddings=(cos, sin))
    assert not torch.allclose(a, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_attention_dropout_leaves_the_generator_as_it_was(device):
    """SDPA's dropout runs from a generator state derived from the layer's seed and the user's generator is
    put back afterwards: a GPT-2 block call with attention dropout leaves the generator exactly where the
    same call without it (residual dropout only: one seed drawn) does, and repeats under the same seed."""
    gen = torch.default_generator if device == "cpu" else torch.cuda.default_generators[0]
    x = torch.randn(B, S, H, device=device)
    states, outs = [], []
    for attn_p in (0.3, 0.0, 0.3):
        torch.manual_seed(0)  # same weights each time
        block = make_model("gpt2", layers=1, attn_pdrop=attn_p, resid_pdrop=0.1).train().to(device).h[0]
        torch.manual_seed(3)
        outs.append(FusedTransformerLayer(block)(x))
        states.append(gen.get_state())
    assert torch.equal(states[0], states[1]) and torch.equal(states[0], states[2])
    assert torch.equal(outs[0], outs[2])


# ---- fuse(): structure, warnings, errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_state_dict_keys_and_parameter_identity(family):
    model = make_model(family)
    keys = list(model.state_dict().keys())
    params = {n: p for n, p in model.named_parameters()}
    assert fuse(model) is model
    assert list(model.state_dict().keys()) == keys
    for n, p in model.named_parameters():
        assert p is params[n], n
    model.load_state_dict(make_model(family).state_dict())  # loads into the same Parameters
    for n, p in model.named_parameters():
        assert p is params[n]
    clone = copy.deepcopy(model)
    assert list(clone.state_dict().keys()) == keys
    layer = layers_of(clone)[0]
    assert {id(p) for p in layer._hf_layer.parameters()} == {id(p) for p in layer.parameters()}


@pytest.mark.parametrize("family,overrides,reason", [
    ("bert", dict(hidden_act="relu"), "activation ReLU"),
    ("bert", dict(is_decoder=True), "is_decoder"),
    ("bert", dict(is_decoder=True, add_cross_attention=True), "cross-attention"),
    ("gpt2", dict(add_cross_attention=True), "cross-attention"),
    ("gpt2", dict(activation_function="relu"), "activation ReLU"),
    ("gpt2", dict(reorder_and_upcast_attn=True, attn="eager"), "reorder_and_upcast_attn"),
    ("llama", dict(hidden_act="gelu"), "activation GELUActivation"),
    ("bert", dict(output_attentions=True, attn="eager"), "output_attentions"),
])
def test_unsupported_configurations_warn_and_are_left_alone(family, overrides, reason):
    overrides = dict(overrides)
    attn = overrides.pop("attn", "sdpa")
    model = make_model(family, attn=attn, **overrides)
    with pytest.warns(UserWarning, match=reason):
        with pytest.raises(ValueError, match="could be fused"):
            fuse(model)
    assert not any(isinstance(m, FusedTransformerLayer) for m in model.modules())


def test_one_unsupported_layer_is_left_alone():
    model = make_model("bert", layers=3)
    model.encoder.layer[1].intermediate.intermediate_act_fn = torch.nn.ReLU()
    with pytest.warns(UserWarning, match=r"encoder\.layer\.1 left unfused.*activation ReLU"):
        fuse(model)
    kinds = [type(m).__name__ for m in model.encoder.layer]
    assert kinds == ["FusedTransformerLayer", "BertLayer", "FusedTransformerLayer"]
    model(**inputs_for("bert", padding=True)).last_hidden_state.sum().backward()


AUTOCAST = [pytest.param("cpu", torch.bfloat16, id="cpu-bf16"),
            pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=[requires_cuda, pytest.mark.cuda]),
            pytest.param("cuda", torch.float16, id="cuda-fp16", marks=[requires_cuda, pytest.mark.cuda])]


def _autocast_run(model, family, kw, device, dtype, cotangent=None):
    """Output, input gradient and parameter gradients of one training step under autocast."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the fused path runs under autocast
        with torch.autocast(device, dtype=dtype):
            emb, out = embeds_call(model, family, kw)
    out.float().backward(torch.ones_like(out, dtype=torch.float32) if cotangent is None else cotangent)
    return out, emb.grad, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("device,dtype", AUTOCAST)
@pytest.mark.parametrize("padding", [False, True], ids=["nomask", "padding"])
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama-gqa"])
def test_autocast_error_within_a_multiple_of_hugging_faces(family, padding, device, dtype):
    """Under autocast (float32 master weights) the fused layers run (no fallback) with Hugging Face's dtype
    policy: the output has the dtype Hugging Face's has, gradients arrive in float32, and the error against a
    float32 run is at most 2x Hugging Face's own under the same autocast (outputs, input gradient and every
    parameter gradient), plus a tiny atol."""
    ref32 = make_model(family).train().to(device)
    kw = inputs_for(family, padding, device=device)
    runs = {"ref": None, "hf": None, "fused": None}
    e, out = embeds_call(ref32, family, kw)
    cot = torch.randn_like(out)  # not ones: LayerNorm outputs sum to a constant, their gradients would be noise
    out.backward(cot)
    runs["ref"] = (out, e.grad, {n: p.grad for n, p in ref32.named_parameters() if p.grad is not None})
    ref32.zero_grad(set_to_none=True)
    runs["hf"] = _autocast_run(copy.deepcopy(ref32), family, kw, device, dtype, cot)
    runs["fused"] = _autocast_run(fused_copy(ref32), family, kw, device, dtype, cot)
    assert runs["fused"][0].dtype == runs["hf"][0].dtype
    for i, what in ((0, "output"), (1, "input gradient")):
        ref = runs["ref"][i].float()
        err_hf = (runs["hf"][i].float() - ref).abs().max().item()
        err_fused = (runs["fused"][i].float() - ref).abs().max().item()
        assert err_fused <= 2 * err_hf + 1e-4 * ref.abs().max().item(), (what, err_fused, err_hf)
    assert runs["fused"][2].keys() == runs["hf"][2].keys()
    # Per model, as grads_close: some gradients (BERT's key bias) are zero in exact arithmetic.
    scale = max(g.abs().max().item() for g in runs["ref"][2].values())
    for n, g in runs["ref"][2].items():
        got = runs["fused"][2][n]
        assert got.dtype == torch.float32, n
        err_hf = (runs["hf"][2][n] - g).abs().max().item()
        err_fused = (got - g).abs().max().item()
        assert err_fused <= 2 * err_hf + 1e-3 * scale, (n, err_fused, err_hf)


@pytest.mark.parametrize("device,dtype", AUTOCAST)
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama-gqa"])
def test_autocast_checkpointed_equals_not_checkpointed_exactly_with_dropout(family, device, dtype):
    """Under autocast with dropout on everywhere (attention dropout included), the checkpointed fused model
    (the SegmentFunction replays under forward's autocast state) equals the fused model bitwise."""
    model, ck = _checkpointed_pair(family, every=2)
    model.to(device)
    ck.to(device)
    kw = inputs_for(family, padding=True, device=device)
    grads = []
    for m in (model, ck):
        torch.manual_seed(7)
        out, e_grad, g = _autocast_run(m, family, kw, device, dtype)
        grads.append((out, e_grad, g))
    assert torch.equal(grads[0][0], grads[1][0])
    assert torch.equal(grads[0][1], grads[1][1])
    assert grads[0][2].keys() == grads[1][2].keys()
    for n, g in grads[0][2].items():
        assert torch.equal(g, grads[1][2][n]), n


# ---- checkpointing: SegmentFunction --------------------------------------------------------------------------------


def _checkpointed_pair(family, every, layers=3, dropout=0.2):
    model = fuse(make_model(family, dropout=dropout, layers=layers)).train()
    ck = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' is_gradient_checkpointing rename
        ckpt_ext.enable_checkpointing(ck, every=every)
    return model, ck


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("every", [1, 2, 3], ids=["every1", "every2", "all"])
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama", "llama-gqa"])
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


def test_hugging_face_gradient_checkpointing_uses_the_segment_function():
    model, _ = _checkpointed_pair("gpt2", every=1, layers=2)
    hf_ck = copy.deepcopy(model)
    (getattr(hf_ck, "activation_checkpointing_enable", None) or hf_ck.gradient_checkpointing_enable)()
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
