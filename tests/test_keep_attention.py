"""keep="attention": checkpointed layers keep their attention kernel's output and log-sum-exp, and the replay
skips the attention forward (ckpt_ext/keep.py).

Every test compares with training without checkpointing on fresh random inputs, bitwise (torch.equal) for
every parameter's gradient: the same ops run in the same order on the same values. That the replay really
skips the attention forward is checked by counting the fused kernel's runs (a dispatch mode outside
ckpt_ext's sees only the kernels that run). Memory: the tensors alive after the forward (a dispatch mode
records every tensor the forward creates, weakly) are the boundaries plus the kept outputs and LSEs, nothing
else.
"""
import contextlib
import copy
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import ckpt_ext
from ckpt_ext.keep import LSE_OPS, check_keep

from helpers.hf_models import inputs_for, layers_of, make_model  # noqa: E402  (skips without transformers)

FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


class CountKernels(TorchDispatchMode):
    """Counts the fused attention kernels that run (ckpt_ext's own modes sit inside this one: a kernel handed
    back by the replay never reaches it)."""

    def __init__(self):
        super().__init__()
        self.runs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in LSE_OPS:
            self.runs += 1
        return func(*args, **(kwargs or {}))


def _grads(model, call, seed=1, autocast=False, count=True):
    """One seeded training step: the output, every parameter's gradient, and the fused kernel runs (None with
    count=False: torch.compile refuses a dispatch mode)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    kernels = CountKernels() if count else None
    with kernels or contextlib.nullcontext(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        out = call(model)
        g = torch.Generator().manual_seed(seed + 100)
        (out.float() * torch.randn(out.shape, generator=g)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert len(grads) == len(list(model.parameters()))
    return out.detach(), grads, kernels.runs if count else None


def _assert_equal(a, b):
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


def _hf_call(kw):
    return lambda m: m(**kw).last_hidden_state


def _quiet_enable(model, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return ckpt_ext.enable_checkpointing(model, **options)


# ---- Hugging Face models: bit-identical, attention forward not replayed --------------------------------------------
@pytest.mark.parametrize("family", ["llama", "llama-gqa", "gpt2"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("every", [1, 2])
def test_hugging_face_bit_identical_and_attention_not_replayed(family, dropout, every):
    """GPT-2 with residual/embedding dropout (attention dropout 0, so SDPA still takes the flash kernel);
    Llama has no hidden dropout (its attention dropout is the math-path test below). Padding included."""
    over = {"attn_pdrop": 0.0, "embd_pdrop": dropout} if family == "gpt2" else {"attention_dropout": 0.0}
    model = make_model(family, dropout=dropout, layers=4, **over).train()
    n = len(layers_of(model))
    for padding in (False, True):
        torch.manual_seed(7 + padding)
        kw = inputs_for(family, padding=padding)
        ref = _grads(copy.deepcopy(model), _hf_call(kw))
        assert ref[2] == n  # every layer's attention runs the CPU flash kernel
        keep = _quiet_enable(copy.deepcopy(model), every=every, keep="attention")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "keeps nothing" warning
            got = _grads(keep, _hf_call(kw))
        _assert_equal(got, ref)
        assert got[2] == n  # forward only: the replay handed the kept outputs back
        full = _grads(_quiet_enable(copy.deepcopy(model), every=every), _hf_call(kw))
        _assert_equal(full, ref)
        assert full[2] == 2 * n  # full recompute runs the attention forward again
        # Second step on the same model: new inputs, still identical
        kw2 = inputs_for(family, padding=padding)
        _assert_equal(_grads(keep, _hf_call(kw2), seed=3), _grads(copy.deepcopy(model), _hf_call(kw2), seed=3))


def test_hugging_face_autocast_bf16_bit_identical():
    """CPU autocast bfloat16: SDPA runs the flash kernel in bfloat16; kept and handed back as is."""
    model = make_model("llama", layers=3).train()
    kw = inputs_for("llama", padding=True)
    ref = _grads(copy.deepcopy(model), _hf_call(kw), autocast=True)
    got = _grads(_quiet_enable(copy.deepcopy(model), keep="attention"), _hf_call(kw), autocast=True)
    _assert_equal(got, ref)
    assert ref[2] == got[2] == 3


def test_gpt2_in_bfloat16_bit_identical():
    model = make_model("gpt2", dropout=0.1, layers=3, attn_pdrop=0.0).to(torch.bfloat16).train()
    kw = inputs_for("gpt2", padding=True)
    ref = _grads(copy.deepcopy(model), _hf_call(kw))
    got = _grads(_quiet_enable(copy.deepcopy(model), keep="attention"), _hf_call(kw))
    _assert_equal(got, ref)
    assert got[2] == 3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("forced", [False, True], ids=["default-settings", "sdpa_kernel-cudnn"])
def test_cuda_cudnn_attention_kept_bit_identical(forced):
    """Hugging Face Llama in bfloat16 on CUDA (head dim 64): where SDPA picks cuDNN attention (torch's default on
    Hopper), keep="attention" keeps cuDNN's output and log-sum-exp: bit-identical, one cuDNN forward per layer."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = make_model("llama", layers=2, hidden_size=128, num_attention_heads=2,
                       num_key_value_heads=2).cuda().bfloat16().train()
    kw = inputs_for("llama", padding=False, device="cuda")
    q = torch.randn(2, 2, 37, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step(m):
        m.zero_grad(set_to_none=True)
        with CountKernels() as kernels:
            out = m(**kw).last_hidden_state
            (out.float() * torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}, kernels.runs

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]) if forced else contextlib.nullcontext():
        if torch._fused_sdp_choice(q, q, q, None, 0.0, True, None, False) != 3:
            pytest.skip("SDPA does not pick cuDNN attention here (GPU, cuDNN version or settings)")
        ref = step(copy.deepcopy(model))
        keep = _quiet_enable(copy.deepcopy(model), keep="attention")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing falls back
            got = step(keep)
    _assert_equal(got, ref)
    assert ref[2] == got[2] == 2


def test_take_over_hf_checkpointing_keeps_attention():
    model = make_model("llama", layers=3).train()
    kw = inputs_for("llama", padding=False)
    ref = _grads(copy.deepcopy(model), _hf_call(kw))
    ckpt_ext.take_over_hf_checkpointing(model, keep="attention")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()
    assert "keep='attention'" in ckpt_ext.explain(model)
    got = _grads(model, _hf_call(kw))
    _assert_equal(got, ref)
    assert got[2] == 3
    with pytest.raises(ValueError, match="'boundaries'.*'attention'"):
        ckpt_ext.take_over_hf_checkpointing(model, keep="everything")


# ---- plain nn.Module stack calling SDPA -----------------------------------------------------------------------------
class Block(nn.Module):
    """A pre-norm transformer block whose attention is F.scaled_dot_product_attention, residual dropout p."""

    def __init__(self, d=48, heads=3, p=0.1, attn_p=0.0):
        super().__init__()
        self.heads, self.attn_p = heads, attn_p
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x, mask=None):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           dropout_p=self.attn_p if self.training else 0.0)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, s, d)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm2(x)))))


class Stack(nn.Module):
    def __init__(self, n=4, **kw):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Block(**kw) for _ in range(n))

    def forward(self, x, mask=None):
        for layer in self.layers:
            x = layer(x, mask)
        return x


@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize("with_mask", [False, True])
def test_plain_stack_bit_identical(p, with_mask):
    model = Stack(p=p).train()
    x = torch.randn(2, 29, 48)
    mask = torch.randn(2, 1, 29, 29) if with_mask else None
    call = lambda m: m(x, mask)  # noqa: E731
    ref = _grads(copy.deepcopy(model), call)
    for every in (1, 2, 4):
        got = _grads(ckpt_ext.enable_checkpointing(copy.deepcopy(model), every=every, keep="attention"), call)
        _assert_equal(got, ref)
        assert got[2] == ref[2] == 4


def test_checkpoint_with_keep_attention_context_fn():
    """ckpt_ext.checkpoint(..., context_fn=ckpt_ext.keep_attention), and the same context_fn given to torch's
    non-reentrant checkpoint; checkpoint_sequential(keep=)."""
    model = Stack(p=0.1).train()
    x = torch.randn(2, 17, 48)
    ref = _grads(copy.deepcopy(model), lambda m: m(x))

    def chained(checkpoint):
        def call(m):
            h = x
            for layer in m.layers:
                h = checkpoint(layer, h, use_reentrant=False, context_fn=ckpt_ext.keep_attention)
            return h
        return call

    for checkpoint in (ckpt_ext.checkpoint, torch.utils.checkpoint.checkpoint):
        got = _grads(copy.deepcopy(model), chained(checkpoint))
        _assert_equal(got, ref)
        assert got[2] == 4
    got = _grads(copy.deepcopy(model), lambda m: ckpt_ext.checkpoint_sequential(m.layers, 2, x, keep="attention", use_reentrant=False))
    _assert_equal(got, ref)
    assert got[2] == 4  # two layers checkpointed (attention kept), the last two run plainly
    with pytest.raises(ValueError, match="'boundaries'.*'attention'"):
        ckpt_ext.checkpoint_sequential(model.layers, 2, x, keep="attn", use_reentrant=False)


def test_retain_graph_second_backward_recomputes_attention():
    """A second backward through the same graph (retain_graph=True): the kept outputs were handed back once and
    freed, so its replay runs the attention forward; the gradients are the same."""
    model = ckpt_ext.enable_checkpointing(Stack(p=0.1).train(), keep="attention")
    x = torch.randn(2, 17, 48)
    torch.manual_seed(0)
    y = model(x).sum()
    with CountKernels() as first:
        g1 = torch.autograd.grad(y, list(model.parameters()), retain_graph=True)
    with CountKernels() as second:
        g2 = torch.autograd.grad(y, list(model.parameters()))
    assert first.runs == 0 and second.runs == 4
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


# ---- memory: what is held from forward to backward ------------------------------------------------------------------
class Alive(TorchDispatchMode):
    """Records (weakly) every tensor the forward creates."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.refs.extend(weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def _held(model, call):
    """Bytes of the storages created by the forward that are still alive after it, the output's excepted."""
    model.zero_grad(set_to_none=True)
    with Alive() as alive:
        out = call(model)
    storages = {}
    for ref in alive.refs:
        t = ref()
        if t is not None:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    storages.pop(out.untyped_storage().data_ptr(), None)
    held = sum(storages.values())
    out.sum().backward()
    return held


def test_held_bytes_are_boundaries_plus_kept_output_and_lse():
    n, b, s, d, heads = 4, 2, 64, 48, 3
    model = Stack(n=n, p=0.1).train()
    x = torch.randn(b, s, d)
    call = lambda m: m(x)  # noqa: E731
    boundary = b * s * d * 4  # each layer's input but the first (the user's x)
    kept = b * s * d * 4 + b * heads * s * 4  # attention output + log-sum-exp (float32)
    plain = _held(copy.deepcopy(model), call)
    full = _held(ckpt_ext.enable_checkpointing(copy.deepcopy(model)), call)
    keep = _held(ckpt_ext.enable_checkpointing(copy.deepcopy(model), keep="attention"), call)
    assert full == (n - 1) * boundary
    assert keep == (n - 1) * boundary + n * kept
    assert keep < plain / 3
    grouped = _held(ckpt_ext.enable_checkpointing(copy.deepcopy(model), every=2, keep="attention"), call)
    assert grouped == (n // 2 - 1) * boundary + n * kept


def test_held_bytes_hugging_face_llama():
    """The kept bytes are the attention outputs and LSEs (B x S x H and B x heads x S per layer), and nothing
    else is held beyond what boundary-only checkpointing holds; explain() states them."""
    model = make_model("llama", layers=3).train()
    kw = inputs_for("llama", padding=True, batch=2, seq=40)
    call = _hf_call(kw)
    full = _held(_quiet_enable(copy.deepcopy(model)), call)
    kept_model = _quiet_enable(copy.deepcopy(model), keep="attention")
    keep = _held(kept_model, call)
    cfg = model.config
    per_layer = 2 * 40 * cfg.hidden_size * 4 + 2 * cfg.num_attention_heads * 40 * 4
    assert keep - full == 3 * per_layer
    text = ckpt_ext.explain(kept_model)
    assert text.count(ckpt_ext.planner.fmt_bytes(per_layer)) == 3, text


# ---- what cannot keep attention: said, never silently different -----------------------------------------------------
def test_bad_keep_values():
    model = Stack()
    for bad in ("attn", "all", "", 1, True, ["attention"]):
        with pytest.raises(ValueError, match="keep must be one of 'boundaries'.*'attention'"):
            ckpt_ext.enable_checkpointing(model, keep=bad)
        assert not ckpt_ext.stack.is_enabled(model)
    assert check_keep(None) == "boundaries"
    for bad in ("attn", "auto"):  # with budget= too (budget= alone lets the planner choose per layer)
        with pytest.raises(ValueError, match="keep must be one of 'boundaries'.*'attention'"):
            ckpt_ext.enable_checkpointing(model, budget="1GiB", keep=bad)
    assert not ckpt_ext.stack.is_enabled(model)
    ckpt_ext.enable_checkpointing(model, keep="boundaries")
    assert "keeps only its input" in ckpt_ext.explain(model)


def test_eager_attention_refused_at_enable_time():
    model = make_model("llama", layers=2, attn="eager")
    with pytest.raises(ValueError, match=r"LlamaDecoderLayer.*'eager'.*attn_implementation='sdpa'"):
        _quiet_enable(model, keep="attention")
    assert not ckpt_ext.stack.is_enabled(model)
    _quiet_enable(model)  # keep='boundaries' is fine with eager attention


class HandWritten(Block):
    """Attention written out (softmax(QK^T)V): no SDPA call, so nothing to keep."""

    def forward(self, x, mask=None):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, -1) @ v
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, s, d)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm2(x)))))


def _not_kept_warnings(caught):
    return [str(w.message) for w in caught if "keeps no attention output" in str(w.message)]


def test_layers_without_an_lse_warn_once_naming_layer_and_reason_and_stay_exact(monkeypatch):
    monkeypatch.setattr(ckpt_ext.keep, "_warned", set())  # warned once per process: as in a fresh one
    # attention dropout on CPU: SDPA's math path
    model = Stack(n=3, p=0.1, attn_p=0.1).train()
    x = torch.randn(2, 17, 48)
    ref = _grads(copy.deepcopy(model), lambda m: m(x))
    keep = ckpt_ext.enable_checkpointing(copy.deepcopy(model), keep="attention")
    with pytest.warns(UserWarning, match=r"layers\.0 \(Block\) keeps no attention output, because attention "
                                         r"dropout p=0\.1 on CPU.*explain\(model\) lists them") as caught:
        got = _grads(keep, lambda m: m(x))
    _assert_equal(got, ref)
    assert len(_not_kept_warnings(caught)) == 1  # one warning for the three layers
    text = ckpt_ext.explain(keep)
    for i in range(3):
        assert f"layers.{i} (Block): keeps its input only: its attention keeps nothing, because attention dropout" \
            in text, text
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        _assert_equal(_grads(keep, lambda m: m(x), seed=2), _grads(copy.deepcopy(model), lambda m: m(x), seed=2))
    # a layer with no SDPA call at all
    torch.manual_seed(0)
    hand = Stack(n=2)
    hand.layers = nn.ModuleList(HandWritten() for _ in range(2))
    ref = _grads(copy.deepcopy(hand), lambda m: m(x))
    keep = ckpt_ext.enable_checkpointing(copy.deepcopy(hand), keep="attention")
    with pytest.warns(UserWarning, match=r"layers\.0 \(HandWritten\) keeps no attention output, because it called no "
                                         r"torch\.nn\.functional\.scaled_dot_product_attention") as caught:
        got = _grads(keep, lambda m: m(x))
    _assert_equal(got, ref)
    assert len(_not_kept_warnings(caught)) == 1


@pytest.mark.parametrize("every", [1, 2])
def test_math_path_forced_by_sdpa_kernel_replays_in_full_exactly(every, monkeypatch):
    """torch.nn.attention.sdpa_kernel(SDPBackend.MATH): no kernel with a log-sum-exp. The step runs (never an
    error), bit-identical to no checkpointing, each layer's attention recomputed, one warning, and explain() says
    which layers and why."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    monkeypatch.setattr(ckpt_ext.keep, "_warned", set())
    model = Stack(n=4).train()
    x = torch.randn(2, 17, 48)
    keep = ckpt_ext.enable_checkpointing(copy.deepcopy(model), every=every, keep="attention")
    with sdpa_kernel(SDPBackend.MATH):
        ref = _grads(copy.deepcopy(model), lambda m: m(x))
        with pytest.warns(UserWarning, match=r"layers\.0 \(Block\) keeps no attention output, because SDPA chose "
                                             r"its math path") as caught:
            got = _grads(keep, lambda m: m(x))
    _assert_equal(got, ref)
    assert ref[2] == got[2] == 0  # no fused kernel anywhere
    assert len(_not_kept_warnings(caught)) == 1
    text = ckpt_ext.explain(keep)
    assert text.count("its attention keeps nothing, because SDPA chose its math path") == 4, text
    # out of the sdpa_kernel block the kernels are fused again and kept
    assert _grads(keep, lambda m: m(x))[2] == 4


def test_hugging_face_attention_dropout_on_cpu_warns():
    model = make_model("llama", dropout=0.1, layers=2).train()
    kw = inputs_for("llama", padding=False)
    ref = _grads(copy.deepcopy(model), _hf_call(kw))
    keep = _quiet_enable(copy.deepcopy(model), keep="attention")
    with pytest.warns(UserWarning, match=r"layers\.\d \(LlamaDecoderLayer\) keeps no attention output, because "
                                         r"attention dropout p=0\.1 on CPU"):
        got = _grads(keep, _hf_call(kw))
    _assert_equal(got, ref)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("every", [1, 2])
def test_fused_layers_through_enable_checkpointing_exactly(family, every):
    """enable_checkpointing(fuse(model), keep="attention"): the fused segments keep their attention (C++),
    gradients bitwise those of the fused model without checkpointing; no attention forward in the replay."""
    model = ckpt_ext.fuse(make_model(family, layers=2)).train()
    kw = inputs_for(family, padding=True)
    ref = _grads(model, _hf_call(kw))
    keep = _quiet_enable(copy.deepcopy(model), every=every, keep="attention")
    got = _grads(keep, _hf_call(kw))
    _assert_equal(got, ref)
    assert ref[2] == 2 and got[2] == 2  # one attention kernel per layer in forward, none replayed
    full = _grads(_quiet_enable(copy.deepcopy(model), every=every), _hf_call(kw))
    _assert_equal(full, ref)
    assert full[2] == 4  # full recompute runs each layer's attention again


@pytest.mark.parametrize("every", [1, 2])
def test_fused_attention_dropout_on_cpu_replays_in_full_through_enable_checkpointing(every, monkeypatch):
    """Fused layers whose attention has no log-sum-exp (attention dropout on CPU): replayed in full, the same
    gradients as the fused model without checkpointing, one warning, explain() naming each layer and why."""
    monkeypatch.setattr(ckpt_ext.keep, "_warned", set())
    model = ckpt_ext.fuse(make_model("gpt2", layers=2, attn_pdrop=0.1)).train()
    kw = inputs_for("gpt2", padding=False)
    ref = _grads(copy.deepcopy(model), _hf_call(kw))
    keep = _quiet_enable(copy.deepcopy(model), every=every, keep="attention")
    with pytest.warns(UserWarning, match=r"h\.0 \(FusedTransformerLayer\) keeps no attention output, because of "
                                         r"attention dropout") as caught:
        got = _grads(keep, _hf_call(kw))
    _assert_equal(got, ref)
    assert len(_not_kept_warnings(caught)) == 1
    text = ckpt_ext.explain(keep)
    assert text.count("its attention keeps nothing, because of attention dropout (p=0.1") == 2, text


def test_explain_and_disable():
    model = ckpt_ext.enable_checkpointing(Stack(n=2), keep="attention")
    text = ckpt_ext.explain(model)
    assert "layers.0 (Block): keeps its input and its attention kernel's output and log-sum-exp (checked at the " \
           "first training step)" in text
    x = torch.randn(2, 17, 48)
    _grads(model, lambda m: m(x))
    assert "the replay skips the attention forward" in ckpt_ext.explain(model)
    ckpt_ext.disable_checkpointing(model)
    assert "not enabled" in ckpt_ext.explain(model)
    plain = _grads(model, lambda m: m(x))
    assert plain[2] == 2  # no mode left behind: the forward's kernels run once, none replayed
    assert all(type(m).forward is m.forward.__func__ for m in model.layers)


# ---- torch.compile: torch's selective checkpointing saving the same kernels -----------------------------------------
def test_compiled_keep_attention_saves_the_kernel_outputs():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = {"forward": [], "backward": []}

    def keeper(kind):
        def compiler(gm, inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm)
        return compiler

    def runs(kind):  # the flash kernel, called directly or through run_with_rng_state
        return sum(n.op == "call_function" and (n.target is FLASH_CPU or FLASH_CPU in n.args)
                   for g in graphs[kind] for sub in g.modules() if isinstance(sub, torch.fx.GraphModule)
                   for n in sub.graph.nodes)

    model = make_model("llama", layers=2).train()
    kw = inputs_for("llama", padding=True)
    results = {}
    for variant in ("none", "boundaries", "attention"):
        torch._dynamo.reset()
        graphs["forward"].clear(), graphs["backward"].clear()
        m = copy.deepcopy(model)
        if variant != "none":
            _quiet_enable(m, keep=variant, every=2)
        compiled = torch.compile(m, fullgraph=True,
                                 backend=aot_autograd(fw_compiler=keeper("forward"), bw_compiler=keeper("backward")))
        results[variant] = _grads(m, lambda _: compiled(**kw).last_hidden_state, count=False)
        results[variant] = (results[variant][0], results[variant][1], (runs("forward"), runs("backward")))
    torch._dynamo.reset()
    assert results["none"][2] == (2, 0)
    assert results["boundaries"][2] == (2, 2)  # full recompute: the backward graph runs attention again
    assert results["attention"][2] == (2, 0)  # kept: the backward graph has no attention forward
    _assert_equal(results["attention"], results["none"])
    _assert_equal(results["boundaries"], results["none"])


def test_hugging_face_model_without_a_uniform_stack_keeps_attention():
    """No uniform layer stack: Hugging Face's own mechanism places the checkpoints with ckpt_ext's checkpoint,
    keeping attention."""
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.modeling_layers import GradientCheckpointingLayer

    from ckpt_ext.hf.trainer import rides_hf

    class AltConfig(PretrainedConfig):
        model_type = "ckpt_ext_alt_attention"

    class A(GradientCheckpointingLayer):
        def __init__(self):
            super().__init__()
            self.block = Block(p=0.1)

        def forward(self, x):
            return self.block(x)

    class B(A):
        def forward(self, x):
            return self.block(x) * 0.5

    class AltModel(PreTrainedModel):
        config_class = AltConfig
        supports_gradient_checkpointing = True

        def __init__(self, config):
            super().__init__(config)
            self.layers = nn.ModuleList([A(), B(), A()])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    model = AltModel(AltConfig()).train()
    x = torch.randn(2, 17, 48)
    ref = _grads(copy.deepcopy(model), lambda m: m(x))
    ckpt_ext.enable_checkpointing(model, keep="attention")
    assert all(rides_hf(layer) for layer in model.layers)
    assert "keep='attention'" in ckpt_ext.explain(model)
    got = _grads(model, lambda m: m(x))
    _assert_equal(got, ref)
    assert got[2] == 3
    ckpt_ext.disable_checkpointing(model)
    assert not any(rides_hf(m) for m in model.modules())
