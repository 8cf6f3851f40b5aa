"""Keep-attention for checkpointed fused layers (issue 23): a fused segment run with keep_attention=True
(ckpt_ext.fused.run_segment's seam) keeps each layer's attention output and log-sum-exp in the pool, and its
replay runs no attention forward. Checked against the fused model without checkpointing (bit-identical:
outputs, the input gradient, every parameter gradient; hidden dropout on and off, with and without padding),
against Hugging Face (float32 tolerance), for what the pool holds from forward to backward, for the layers whose
attention has no log-sum-exp (attention dropout on CPU, SDPA's math path: replayed in full, one warning) and the
refusal under torch.compile; on CUDA, cuDNN attention kept (the kernel SDPA picks on Hopper)."""
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ckpt_ext
from ckpt_ext import compiled, fuse
from ckpt_ext import keep as keep_attention
from ckpt_ext.fused import run_segment

transformers = pytest.importorskip("transformers")
from helpers.devices import DEVICES, requires_cuda  # noqa: E402
from helpers.fused import _seed  # noqa: E402,F401  (an autouse fixture)
from helpers.hf_models import (B, DECODERS, RELATIVES, S, assert_training_parity, embeds_call,  # noqa: E402
                               inputs_for, layers_of, make_model)
from helpers.pool import slot_bytes, stats  # noqa: E402

FAMILIES = ["bert", "gpt2", "llama", "llama-gqa"] + RELATIVES


def _hidden_dropout(family, p):
    """A model's hidden dropout at p, attention dropout 0 (keep-attention's CPU kernel takes none)."""
    if family == "bert":
        return {"hidden_dropout_prob": p, "attention_probs_dropout_prob": 0.0}
    if family == "gpt2":
        return {"resid_pdrop": p, "attn_pdrop": 0.0}
    return {"attention_dropout": 0.0}  # Llama has no hidden dropout


def _segments(model, every, keep_attention=True):
    """Checkpoints the model's fused layers in groups of `every` through run_segment (the seam
    enable_checkpointing(keep="attention") calls): a group's first layer runs the group, the later ones hand
    its output on. Returns the model."""
    layers = list(layers_of(model))
    for start in range(0, len(layers), every):
        group = layers[start:start + every]

        def first(*args, _group=group, **kwargs):
            out = run_segment(_group, args, kwargs, keep_attention=keep_attention)
            assert out is not NotImplemented
            return out

        group[0].forward = first
        for later in group[1:]:
            later.forward = lambda hidden, *a, _layer=later, **kw: _layer._as_returned(hidden)
    return model


def _pair(family, every, hidden_p=0.0, layers=3, keep_attention=True):
    model = fuse(make_model(family, layers=layers, **_hidden_dropout(family, hidden_p))).train()
    return model, _segments(copy.deepcopy(model), every, keep_attention)


def _assert_same_step(model, ck, family, kw, autocast=False):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):  # forward only, as in training
        torch.manual_seed(7)
        e_ref, ref = embeds_call(model, family, kw)
        torch.manual_seed(7)
        e_ck, out = embeds_call(ck, family, kw)
    assert torch.equal(out, ref)
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g)
    assert torch.equal(e_ck.grad, e_ref.grad)
    for (name, p), q in zip(model.named_parameters(), ck.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name


# ---- bit-identity with the fused model without checkpointing ------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hidden_p", [0.0, 0.2], ids=["nodrop", "hidden-dropout"])
@pytest.mark.parametrize("padding", [False, True], ids=["nomask", "padding"])
@pytest.mark.parametrize("every", [1, 3], ids=["every1", "all"])
@pytest.mark.parametrize("family", FAMILIES)
def test_keep_attention_equals_not_checkpointed_exactly(family, every, padding, hidden_p, device):
    if family in DECODERS and hidden_p:
        pytest.skip("Llama and its relatives have no hidden dropout")
    model, ck = _pair(family, every, hidden_p)
    model.to(device)
    ck.to(device)
    _assert_same_step(model, ck, family, inputs_for(family, padding=padding, device=device))


@pytest.mark.parametrize("mode", ["bf16", "autocast"])
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama-gqa"])
def test_keep_attention_bf16_and_autocast_exactly(family, mode):
    """bfloat16 weights, and float32 weights under CPU autocast (SDPA's inputs cast as autocast casts them):
    the kept kernel outputs are bfloat16, the log-sum-exp float32; gradients the same bits."""
    model, ck = _pair(family, every=2, hidden_p=0.0 if family.startswith("llama") else 0.2)
    if mode == "bf16":
        model.bfloat16()
        ck.bfloat16()
    _assert_same_step(model, ck, family, inputs_for(family, padding=True), autocast=mode == "autocast")


def test_keep_attention_two_steps_and_a_bool_mask():
    """A second step (new seeds, pool slots reused) and a bool 4-D mask passed to the layers directly."""
    model, ck = _pair("llama", every=2, layers=2)
    for _ in range(2):
        _assert_same_step(model, ck, "llama", inputs_for("llama", padding=True))
        model.zero_grad()
        ck.zero_grad()
    x = torch.randn(B, S, 72)
    mask = torch.ones(B, 1, S, S, dtype=torch.bool).tril()
    mask[0, :, :, :4] = False
    mask[0, :, :4, 0] = True  # no fully masked row
    rot = model.rotary_emb(x, torch.arange(S).expand(B, S))
    g = torch.randn_like(x)
    results = []
    for m in (model, ck):
        m.zero_grad()
        h = xm = x.clone().requires_grad_()
        for layer in m.layers:
            h = layer(h, attention_mask=mask, position_embeddings=rot)
        h.backward(g)
        results.append((h, xm.grad, [p.grad for p in m.layers.parameters()]))
    (h0, gx0, gp0), (h1, gx1, gp1) = results
    assert torch.equal(h0, h1) and torch.equal(gx0, gx1)
    assert all(torch.equal(a, b) for a, b in zip(gp0, gp1))


@pytest.mark.parametrize("family", FAMILIES)
def test_keep_attention_matches_hugging_face(family):
    hf = make_model(family, layers=3).train()
    assert_training_parity(hf, _segments(fuse(copy.deepcopy(hf)), every=2), family, inputs_for(family, padding=True))


# ---- what runs in backward, and what is held from forward to backward ------------------------------------------


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("keep", [False, True], ids=["full-recompute", "keep-attention"])
def test_replay_runs_no_attention_forward(keep):
    _, ck = _pair("llama", every=3, keep_attention=keep)
    out = ck(**inputs_for("llama", padding=False)).last_hidden_state
    with _Ops() as ops:
        out.sum().backward()
    forwards = [op for op in ops.seen if "flash_attention_for_cpu.default" in op]
    backwards = [op for op in ops.seen if "flash_attention_for_cpu_backward" in op]
    assert len(backwards) == 3
    assert len(forwards) == (0 if keep else 3)


@pytest.mark.parametrize("family", ["gpt2", "llama-gqa", "bert"])
def test_pool_holds_boundaries_kept_outputs_and_lse_only(family):
    """From forward to backward the pool holds each segment's output (a boundary) and each layer's attention
    output and log-sum-exp, nothing else; after backward, what it held before. BERT/RoBERTa (the pre-norm
    boundary, tests/test_bert_boundary.py): a segment keeps its last layer's pre-norm sum outside the pool and the
    next one does not keep its input, so of the outputs only the last is held."""
    n = 3
    model, keep = _pair(family, every=1, layers=n)
    _, full = _pair(family, every=1, layers=n, keep_attention=False)
    full.load_state_dict(model.state_dict())
    kw = inputs_for(family, padding=True)
    heads = model.config.num_attention_heads
    hidden = model.config.hidden_size
    boundary = slot_bytes(torch.empty(B, S, hidden))
    kept = slot_bytes(torch.empty(B, heads, S, hidden // heads)) + slot_bytes(torch.empty(B, heads, S))
    outputs = 1 if family in ("bert", "roberta") else n
    for ck, per_layer in ((full, 0), (keep, kept)):
        before = stats()
        out = ck(**kw).last_hidden_state
        held = stats()
        assert held["in_use_bytes"] - before["in_use_bytes"] == outputs * boundary + n * per_layer
        assert held["live_slots"] - before["live_slots"] == outputs + (0 if ck is full else 2 * n)
        out.sum().backward()
        del out
        assert stats()["in_use_bytes"] == before["in_use_bytes"]


# ---- no log-sum-exp to keep: that layer replayed in full, one warning, never an error ------------------------------


def _counting(names):
    """A dispatch mode counting the runs of the aten ops whose names contain one of `names`."""
    class _Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.runs = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(n in str(func) for n in names):
                self.runs += 1
            return func(*args, **(kwargs or {}))
    return _Count()


def test_attention_dropout_on_cpu_replays_those_layers_in_full_with_one_warning(monkeypatch):
    """Attention dropout on CPU: SDPA's CPU flash kernel takes none, so the fused layer writes the attention out
    (no log-sum-exp). keep-attention keeps nothing for those layers, replays them in full (the same dropout
    masks: bit-identical to the fused model without checkpointing), warns once, and the pool holds only the
    segments' outputs."""
    model = fuse(make_model("gpt2", dropout=0.1, layers=3)).train()
    ck = _segments(copy.deepcopy(model), every=1)
    kw = inputs_for("gpt2", padding=True)
    monkeypatch.setattr(keep_attention, "_warned", set())  # warned once per process: as in a fresh one
    with pytest.warns(UserWarning, match=r"fused GPT2Block \(layer 0 of this checkpointed group of 1\) keeps no "
                                         r"attention output, because of attention dropout \(p=0\.1.*\) on CPU") as w:
        _assert_same_step(model, ck, "gpt2", kw)
    assert len([x for x in w if "keeps no attention output" in str(x.message)]) == 1
    held_before = stats()["in_use_bytes"]
    out = ck(**kw).last_hidden_state
    assert stats()["in_use_bytes"] - held_before == 3 * slot_bytes(torch.empty(B, S, model.config.hidden_size))
    out.sum().backward()


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_math_path_replays_those_layers_in_full_exactly(family, every, monkeypatch):
    """sdpa_kernel(MATH): no fused kernel, no log-sum-exp. keep-attention runs the step anyway, bit-identical to
    the fused model without checkpointing; the replay runs the attention forward again; one warning names the
    first layer and the reason."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model, ck = _pair(family, every=every, layers=2)
    kw = inputs_for(family, padding=True)
    monkeypatch.setattr(keep_attention, "_warned", set())  # warned once per process: as in a fresh one
    with sdpa_kernel(SDPBackend.MATH):
        with pytest.warns(UserWarning, match=r"layer 0 of this checkpointed group of \d\) keeps no attention output, "
                                             r"because no fused SDPA kernel takes this attention .*math path") as w:
            _assert_same_step(model, ck, family, kw)
        assert len([x for x in w if "keeps no attention output" in str(x.message)]) == 1
        out = ck(**kw).last_hidden_state
        with _counting(["aten._softmax.default", "aten._safe_softmax.default"]) as ops:
            out.sum().backward()
        assert ops.runs == 2  # each layer's attention forward (its softmax) runs again in the replay


def test_cudnn_attention_ops_match_their_schemas_on_this_torch():
    """The cuDNN attention ops are called by name (their C++ signatures are private): on this torch every
    argument ckpt_ext passes exists, every other one has a default, and the results are where they are read."""
    from ckpt_ext._extension import load

    assert load().cudnn_attention_problem() == ""


# ---- CUDA: cuDNN attention (SDPA's default on Hopper) kept ----------------------------------------------------------


def _cudnn_chosen(model, family):
    """Whether SDPA picks cuDNN for this model's attention (bfloat16, head dim 64, no mask) on this GPU."""
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    q = torch.randn(B, cfg.num_attention_heads, S, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    k = torch.randn(B, kv, S, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return torch._fused_sdp_choice(q, k, k, None, 0.0, True, None, kv != cfg.num_attention_heads) == 3


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("forced", [False, True], ids=["default-settings", "sdpa_kernel-cudnn"])
@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("family", ["llama", "llama-gqa"])
def test_cudnn_attention_is_kept_exactly(family, every, forced):
    """Where SDPA picks cuDNN (torch's default on H100/H200 for bfloat16), keep-attention keeps cuDNN's output and
    log-sum-exp: the step is bit-identical to the fused model without checkpointing, the replay runs cuDNN's
    backward but not its forward, and nothing is warned."""
    import contextlib
    import warnings

    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = fuse(make_model(family, layers=2, hidden_size=128, num_attention_heads=2,
                            num_key_value_heads=1 if family == "llama-gqa" else 2)).train().cuda().bfloat16()
    ck = _segments(copy.deepcopy(model), every)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]) if forced else contextlib.nullcontext():
        if not _cudnn_chosen(model, family):
            pytest.skip("SDPA does not pick cuDNN attention here (GPU, cuDNN version or settings)")
        kw = inputs_for(family, padding=False, device="cuda")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _assert_same_step(model, ck, family, kw)
        out = ck(**kw).last_hidden_state
        with _counting(["_scaled_dot_product_cudnn_attention.default"]) as fwd, \
                _counting(["_scaled_dot_product_cudnn_attention_backward"]) as bwd:
            out.float().sum().backward()
        assert fwd.runs == 0 and bwd.runs == 2


def test_keep_attention_on_the_operator_path_runs_as_boundaries(monkeypatch):
    """The operator path (torch.compile's) keeps only the segment's input: keep="attention" runs as "boundaries"
    there, warned once, with the same gradients as the eager keep="attention" step."""
    import ckpt_ext.keep as keep_mod
    keep_mod._warned.discard(("compiled fused level", "attention"))
    _, ck = _pair("bert", every=1, layers=1)
    kw = inputs_for("bert", padding=False)
    ck(**kw).last_hidden_state.sum().backward()
    expected = {n: p.grad.clone() for n, p in ck.named_parameters()}
    ck.zero_grad(set_to_none=True)
    monkeypatch.setattr(compiled, "USE_OPS_EAGERLY", True)  # the operator path torch.compile takes
    with pytest.warns(UserWarning, match="run as keep='boundaries'"):
        ck(**kw).last_hidden_state.sum().backward()
    for n, p in ck.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-5, atol=1e-6, msg=n)


# ---- explain() through enable_checkpointing ------------------------------------------------------------------------
@pytest.mark.parametrize("every", [1, 3])
def test_explain_states_what_fused_layers_kept_after_a_step(every):
    """Before the first training step explain() says the attention is checked then; after it, the bytes each
    layer's attention output and log-sum-exp took in the pool (the group's slots besides its output, shared out
    evenly), never "checked at the first training step" again."""
    family = "llama"
    model = fuse(make_model(family, layers=3)).train()
    ckpt_ext.enable_checkpointing(model, every=every, keep="attention")
    assert ckpt_ext.explain(model).count("checked at the first training step") == 3
    model(**inputs_for(family, padding=True)).last_hidden_state.sum().backward()
    text = ckpt_ext.explain(model)
    heads, hidden = model.config.num_attention_heads, model.config.hidden_size
    per_layer = slot_bytes(torch.empty(B, heads, S, hidden // heads)) + slot_bytes(torch.empty(B, heads, S))
    assert "checked at the first" not in text, text
    assert text.count(f"({ckpt_ext.planner.fmt_bytes(per_layer)} in the last step); the replay skips the attention "
                      "forward") == 3, text
    ckpt_ext.disable_checkpointing(model)
