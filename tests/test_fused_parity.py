"""Tests of the fused transformer layers (ckpt_ext.fuse, FusedTransformerLayer, csrc/layers/).

* Parity with the Hugging Face module each fused layer replaces (dropout off): outputs, the input's
  gradient and every parameter's gradient, float32, on odd shapes (hidden 72, 3 heads, seq 37; Llama
  with grouped-query attention), with and without padding masks; eval / no_grad parity.
* fuse(): state_dict keys and Parameter identity preserved, warnings and errors, Hugging Face's own
  forward for the calls the fused path cannot serve (KV cache in eval, attention weights requested).
* Autocast: error within a multiple of Hugging Face's, and checkpointed == not checkpointed exactly.

Tolerances (float32): |fused - hf| <= 1e-5 * |hf| + 1e-6 * scale, scale = the largest magnitude of the
quantity compared (per tensor; per model for gradients, because some gradients -- BERT's key bias -- are
zero in exact arithmetic and pure rounding noise in both implementations); the models and comparisons are
in helpers/hf_models.py.
"""
import copy
import warnings

import pytest
import torch

from ckpt_ext.hf.layers import positional_parameters

from ckpt_ext import FusedTransformerLayer, fuse

transformers = pytest.importorskip("transformers")
from helpers.devices import DEVICES, requires_cuda  # noqa: E402
from helpers.hf_models import (skip_if_eager_differs_from_sdpa_on_padding, B, FAMILIES, H, RELATIVES, S, assert_training_parity, close, embeds_call,  # noqa: E402
                               fused_copy, inputs_for, layers_of, make_model)
from helpers.fused import _checkpointed_pair, _seed  # noqa: E402,F401  (an autouse fixture)


# ---- parity with Hugging Face (dropout off) ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padding", [False, True], ids=["nomask", "padding"])
@pytest.mark.parametrize("family", FAMILIES + RELATIVES)
def test_training_parity_outputs_and_all_grads(family, padding, device):
    model = make_model(family).train().to(device)
    fused = fused_copy(model)
    assert all(isinstance(m, FusedTransformerLayer) for m in layers_of(fused))
    kw = inputs_for(family, padding, device)
    assert_training_parity(model, fused, family, kw)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_qwen2_sliding_layers_use_the_mask_their_model_passes(attn):
    """Qwen2 with use_sliding_window: the layers from max_window_layers on attend within the window, the others
    causally; the model passes each layer its own mask, which the fused layer applies (fp32 parity, left
    padding). Checkpointed one layer at a time it equals the unchecked model exactly; a group of layers with
    different masks is refused (a group runs its layers with the first one's arguments)."""
    model = make_model("qwen2", layers=3, attn=attn, use_sliding_window=True, sliding_window=7,
                       max_window_layers=1).train()
    types = getattr(model.config, "layer_types", None)
    if types is None:
        pytest.skip(f"transformers {transformers.__version__}'s Qwen2 has no per-layer attention types")
    assert list(types) == ["full_attention", "sliding_attention", "sliding_attention"]
    kw = inputs_for("qwen2", padding=True)
    skip_if_eager_differs_from_sdpa_on_padding(model, "qwen2", kw)
    fused = fused_copy(model)
    assert_training_parity(model, fused, "qwen2", kw)
    import ckpt_ext
    ck = ckpt_ext.enable_checkpointing(copy.deepcopy(fused), every=1)
    for m in (fused, ck):
        m.zero_grad(set_to_none=True)
    _, ref = embeds_call(fused, "qwen2", kw)
    _, out = embeds_call(ck, "qwen2", kw)
    assert torch.equal(out, ref)
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g)
    for (name, p), q in zip(fused.named_parameters(), ck.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name
    grouped = ckpt_ext.enable_checkpointing(copy.deepcopy(fused), every=2)
    with pytest.raises(RuntimeError, match="receives different arguments"):
        grouped(**kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama-gqa"] + RELATIVES)
def test_eval_and_no_grad_parity(family, attn, device):
    model = make_model(family, dropout=0.1, attn=attn).eval().to(device)  # dropout inactive in eval
    fused = fused_copy(model)
    kw = inputs_for(family, padding=True, device=device)
    skip_if_eager_differs_from_sdpa_on_padding(model, family, kw)
    model.eval()
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
    """Layers called directly, as Hugging Face's stacks call them (positional mask / cache arguments, in the
    order the installed release's forward declares them)."""
    model = make_model("gpt2").train()
    fused = fused_copy(model)
    x = torch.randn(B, S, H)
    ref_layer, fused_layer = model.h[0], fused.h[0]
    params = positional_parameters(type(ref_layer))
    at = params.index("attention_mask")

    def positional(mask):  # hidden states, None up to the mask (the cache, ...), the mask
        return (x,) + (None,) * (at - 1) + (mask,)

    def hidden(out):
        return out[0] if isinstance(out, tuple) else out

    mask = torch.ones(B, 1, S, S, dtype=torch.bool).tril()
    mask[0, :, :, :4] = False
    mask[0, :, :4, 0] = True  # no row fully masked
    close(hidden(fused_layer(*positional(mask))), hidden(ref_layer(*positional(mask))))
    close(hidden(fused_layer(x, attention_mask=mask)), hidden(ref_layer(x, attention_mask=mask)))
    additive = torch.zeros(B, 1, S, S).masked_fill(~mask, torch.finfo(torch.float32).min)
    close(hidden(fused_layer(*positional(additive))), hidden(ref_layer(*positional(additive))))
    with pytest.raises(TypeError, match="multiple values"):
        fused_layer(*positional(mask), attention_mask=mask)
    with pytest.raises(TypeError, match="at most"):
        fused_layer(x, *([None] * len(params)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama-gqa"] + RELATIVES)
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
    layer's seed (on CPU: SDPA's math path for bool masks, else attention written out with the Philox dropout
    op; not the flash kernel of p = 0). At p = 1e-9 the mask keeps
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
    skip_if_eager_differs_from_sdpa_on_padding(model, family, kw)
    assert_training_parity(model, fused, family, kw)



# ---- fuse(): structure, warnings, errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"] + RELATIVES)
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
    ("qwen2", dict(hidden_act="gelu"), "activation GELUActivation"),
    ("gemma", dict(hidden_act="silu"), "activation SiLU"),
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
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama-gqa"] + RELATIVES)
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
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama-gqa"] + RELATIVES)
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
