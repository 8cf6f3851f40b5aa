"""Recompute levels of checkpointed FUSED layers (issue 33 item 3 for the C++ layers): a fused segment at
keep="attention_inputs" keeps each layer's q/k/v projection output (with its attention output and log-sum-exp),
at "gemms" every GEMM output (the replay runs the attention, norms and elementwise ops), at "gemms_attention"
both (csrc/layers: layers::KeptGemms; csrc/segment: the node holds them; ckpt_ext.fused.run_segment's gemms=).

Gradients: every parameter's and the input's, bitwise (torch.equal) against the same fused model's full-recompute
replay and against the fused model without checkpointing, for every fused family (BERT, GPT-2, Llama and its
relatives), both CPU GEMM layouts (gemm.cpp: "off", ATen's calls, and "nt", the layout policy's own autograd
functions), float32 and CPU autocast bfloat16, hidden dropout on and off. That the replay skips the kept GEMMs is
checked by counting the GEMM kernels that run in backward (a dispatch mode sees the C++ layers' ATen calls).
"""
import copy
import warnings

import pytest
import torch

import ckpt_ext
from ckpt_ext import _C, fuse
from ckpt_ext.keep import GEMM_OPS, LEVELS, LSE_OPS, fused_level
from ckpt_ext.fused import run_segment

transformers = pytest.importorskip("transformers")
from helpers.devices import requires_cuda  # noqa: E402
from helpers.fused import CountKernels, _seed  # noqa: E402,F401  (_seed: an autouse fixture)
from helpers.hf_models import DECODERS, embeds_call, inputs_for, layers_of, make_model  # noqa: E402

FAMILIES = ["bert", "gpt2", "llama", "llama-gqa", "qwen2", "qwen3", "gemma", "gemma3", "gemma2"]
NEW = ["attention_inputs", "gemms", "gemms_attention"]
# GEMM sites per layer (q/k/v projection included; the last linear counts once per layer but the replay of a
# segment's last layer skips it anyway: GPT-2 and the decoders stop before it, BERT replays from its pre-norm
# boundary, which stops before its output linear too)
SITES = {"bert": 4, "gpt2": 4}
# Gemma 2 and 3: five sites, but its MLP output is normalised before the residual sum: no last linear, the replay runs
# its segment's last layer whole (its down projection included, kept at "gemms")
LAST_LINEAR = {"bert": True, "gpt2": True, "gemma3": False, "gemma2": False}


def _sites(family):
    return SITES.get(family, 5), LAST_LINEAR.get(family, True)


def _dropout(family, p):
    if family == "bert":
        return {"hidden_dropout_prob": p, "attention_probs_dropout_prob": 0.0}
    if family == "gpt2":
        return {"resid_pdrop": p, "attn_pdrop": 0.0}
    return {"attention_dropout": 0.0}


def _segments(model, every, keep):
    """Checkpoints the fused layers in groups of `every` through run_segment at keep level `keep` ("boundaries":
    the full-recompute replay)."""
    attention, gemms = LEVELS[keep]
    layers = list(layers_of(model))
    for start in range(0, len(layers), every):
        group = layers[start:start + every]

        def first(*args, _group=group, **kwargs):
            out = run_segment(_group, args, kwargs, keep_attention=attention, gemms=gemms)
            assert out is not NotImplemented
            return out

        group[0].forward = first
        for later in group[1:]:
            later.forward = lambda hidden, *a, _layer=later, **kw: _layer._as_returned(hidden)
    return model


def _step(model, family, kw, autocast, grad_seed=5):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        torch.manual_seed(7)
        emb, out = embeds_call(model, family, kw)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed), dtype=out.dtype)
    with CountKernels() as counts:
        out.backward(g)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), emb.grad.clone(), grads, (counts.gemms, counts.attention)


def _assert_same(a, b):
    assert torch.equal(a[0], b[0])
    assert torch.equal(a[1], b[1])
    assert a[2].keys() == b[2].keys()
    for name in a[2]:
        assert torch.equal(a[2][name], b[2][name]), name


@pytest.fixture(params=["off", "nt"])
def layout(request):
    before = _C.cpu_gemm_layout(request.param)
    yield request.param
    _C.cpu_gemm_layout(before)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast"])
@pytest.mark.parametrize("hidden_p", [0.0, 0.2], ids=["nodrop", "dropout"])
@pytest.mark.parametrize("keep", NEW)
@pytest.mark.parametrize("family", FAMILIES)
def test_levels_bit_identical_and_replay_skips_the_kept_gemms(family, keep, hidden_p, autocast, layout):
    if family in DECODERS and hidden_p:
        pytest.skip("Llama and its relatives have no hidden dropout")
    every, layers = 2, 3  # a segment of two layers and one of one
    model = fuse(make_model(family, layers=layers, **_dropout(family, hidden_p))).train()
    kw = inputs_for(family, padding=True)
    plain = _step(model, family, kw, autocast)
    full = _step(_segments(copy.deepcopy(model), every, "boundaries"), family, kw, autocast)
    kept = _step(_segments(copy.deepcopy(model), every, keep), family, kw, autocast)
    _assert_same(full, plain)
    _assert_same(kept, plain)
    # the backward's GEMMs: the full replay's less the kept ones (every site of every layer, but the last linear of
    # a segment's last layer, which the full replay skips too; "attention_inputs": the q/k/v projections)
    sites, last_linear = _sites(family)
    segments = [min(every, layers - s) for s in range(0, layers, every)]
    if LEVELS[keep][1] == "all":
        skipped = sum(sites * k - last_linear for k in segments)
    else:
        skipped = layers
    assert kept[3][0] == full[3][0] - skipped, (kept[3], full[3])
    # the attention forward: kept ("attention_inputs", "gemms_attention") or run again ("gemms")
    attention_kept = LEVELS[keep][0]
    fused_attention = full[3][1] - plain[3][1]  # the full replay's attention forwards (CPU flash kernel)
    assert kept[3][1] == plain[3][1] + (0 if attention_kept else fused_attention)


@pytest.mark.parametrize("keep", NEW)
def test_levels_bf16_weights_exactly(keep):
    model = fuse(make_model("llama-gqa", layers=2, **_dropout("llama", 0.0))).train().bfloat16()
    kw = inputs_for("llama", padding=False)
    plain = _step(model, "llama", kw, False)
    kept = _step(_segments(copy.deepcopy(model), 2, keep), "llama", kw, False)
    _assert_same(kept, plain)


def test_levels_two_steps_and_a_second_backward_is_refused():
    """A second step with new dropout seeds; the node's kept tensors are freed by its backward (retain_graph=False)."""
    model = fuse(make_model("bert", layers=2, **_dropout("bert", 0.2))).train()
    ck = _segments(copy.deepcopy(model), 2, "gemms")
    kw = inputs_for("bert", padding=True)
    for seed in (1, 2):
        torch.manual_seed(seed)
        for m in (model, ck):
            m.zero_grad(set_to_none=True)
        _assert_same(_step(ck, "bert", kw, False, seed), _step(model, "bert", kw, False, seed))


def test_reports_kept_bytes_per_layer():
    """run_segment's report_gemms: per layer, the bytes of the GEMM outputs it keeps (the tensors the GEMMs
    returned, storages counted once), and what the node holds: they are freed by its backward."""
    model = fuse(make_model("llama", layers=2, **_dropout("llama", 0.0))).train()
    layers = list(layers_of(model))
    kw = inputs_for("llama", padding=False)
    seen = {}
    for level, gemms in (("all", "all"), ("before", "before")):
        def first(*args, _g=gemms, **kwargs):
            return run_segment(layers, args, kwargs, gemms=_g, report_gemms=lambda i, n, why: seen.__setitem__(i, (n, why)))

        layers[0].forward = first
        layers[1].forward = lambda hidden, *a, _l=layers[1], **k: _l._as_returned(hidden)
        seen.clear()
        emb, out = embeds_call(model, "llama", kw)
        cfg = model.config
        T, H = out.shape[0] * out.shape[1], cfg.hidden_size
        hd = H // cfg.num_attention_heads
        qkv = T * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd * 4
        if gemms == "before":
            expected = [qkv, qkv]
        else:
            mlp = T * cfg.intermediate_size * 4
            # q/k/v, o, gate, up and (not the last layer's) down
            expected = [qkv + T * H * 4 + 2 * mlp + T * H * 4, qkv + T * H * 4 + 2 * mlp]
        assert [seen[i] for i in range(2)] == [(n, None) for n in expected], (level, seen)
        out.sum().backward()


def test_lora_layers_keep_no_gemms_and_say_why():
    """A layer with LoRA adapters keeps no GEMM output (the kept nodes know the base GEMMs only): run_segment reports
    0 bytes and the reason, and the step is the full replay's, bit for bit."""
    peft = pytest.importorskip("peft")
    from ckpt_ext.fused import FusedTransformerLayer
    base = make_model("llama", layers=2, **_dropout("llama", 0.0))
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.2)
    fuse(model)
    model.train()
    ref = copy.deepcopy(model)
    fused = [m for m in model.modules() if isinstance(m, FusedTransformerLayer)]
    assert len(fused) == 2
    seen = {}

    def first(*args, **kwargs):
        return run_segment(fused, args, kwargs, gemms="all",
                           report_gemms=lambda i, n, why: seen.__setitem__(i, (n, why)))

    fused[0].forward = first
    fused[1].forward = lambda hidden, *a, _l=fused[1], **k: _l._as_returned(hidden)
    kw = inputs_for("llama", padding=False)

    def step(m):
        out = m(**kw).last_hidden_state
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3)))
        return out.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    a, b = step(model), step(ref)
    assert torch.equal(a[0], b[0]) and a[1].keys() == b[1].keys() and a[1]
    for n in a[1]:
        assert torch.equal(a[1][n], b[1][n]), n
    assert sorted(seen) == [0, 1] and all(n == 0 and "LoRA" in why for n, why in seen.values()), seen


def test_bad_gemms_argument():
    model = fuse(make_model("bert", layers=1)).train()
    layer = layers_of(model)[0]
    with pytest.raises(ValueError, match="gemms must be None, 'before' or 'all'"):
        run_segment([layer], (torch.randn(1, 4, model.config.hidden_size),), {}, gemms="most")


def test_fused_level_keeps_the_levels():
    assert [fused_level(k) for k in ("boundaries", "attention") + tuple(NEW)] == ["boundaries", "attention"] + NEW


@requires_cuda
@pytest.mark.parametrize("keep", NEW)
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama-gqa"])
@pytest.mark.parametrize("dtype", ["bf16", "autocast"])
def test_cuda_levels_bit_identical(family, keep, dtype):
    model = fuse(make_model(family, layers=3, **_dropout(family, 0.0 if family in DECODERS else 0.1))).train().cuda()
    if dtype == "bf16":
        model.bfloat16()
    kw = inputs_for(family, padding=False, device="cuda")

    def step(m):
        m.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "autocast"):
            torch.manual_seed(7)
            emb, out = embeds_call(m, family, kw)
        out.backward(torch.randn(out.shape, generator=torch.Generator("cuda").manual_seed(3), device="cuda",
                                 dtype=out.dtype))
        return out.detach(), emb.grad.clone(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    plain = step(model)
    _assert_same(step(_segments(copy.deepcopy(model), 2, "boundaries")), plain)
    _assert_same(step(_segments(copy.deepcopy(model), 2, keep)), plain)


@pytest.mark.parametrize("keep", ["attention", "attention_inputs", "gemms", "gemms_attention"])
def test_compiled_fused_levels_run_as_boundaries_with_one_warning(keep):
    """Under torch.compile a fused group is the ckpt_ext::fused_segment operator (keeps only its input): every level
    runs as keep="boundaries" there, warned once (at trace time: no graph break), never fails
    the step; gradients as the eager step's; explain() says so."""
    from torch._dynamo.utils import counters
    import ckpt_ext.keep as keep_mod
    torch._dynamo.reset()
    keep_mod._warned.discard(("compiled fused level", keep))
    family = "llama"
    model = fuse(make_model(family, layers=2, **_dropout(family, 0.0))).train()
    eager = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ckpt_ext.enable_checkpointing(model, every=2, keep=keep)
        ckpt_ext.enable_checkpointing(eager, every=2, keep=keep)
    kw = inputs_for(family, padding=False)
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(3)
            compiled(**kw).last_hidden_state.sum().backward()
    notices = [w for w in seen if "runs as keep='boundaries'" in str(w.message) or
               "run as keep='boundaries'" in str(w.message)]
    assert len(notices) == 1, [str(w.message) for w in seen]
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.manual_seed(3)
    eager(**kw).last_hidden_state.sum().backward()
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)
    assert "runs as keep='boundaries' there" in ckpt_ext.explain(model)
    torch._dynamo.reset()
