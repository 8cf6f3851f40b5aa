"""Bad input to every public function of ckpt_ext.

Each case checks three things: the exception type, a message that names what was wrong (and, where
there is one, what to do), and that nothing was left behind -- the pool holds what it held before, no
replay is marked as running, the global RNG did not move, and a model keeps the checkpointing setup it
had before the failed call (see the autouse fixture and `_setup_of`). Cases that are not errors (a
non-contiguous input, a no-op) check that they give the right answer instead.
"""
import gc
import math

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import ckpt_ext
from ckpt_ext import ops
from reference import leaf_inputs, make_block, make_stack

transformers = pytest.importorskip("transformers")
from helpers.hf_models import B, H, S, inputs_for, layers_of, make_model  # noqa: E402

from helpers.devices import HAS_CUDA, requires_cuda  # noqa: E402
_ATTR = "_ckpt_ext_group"


@pytest.fixture(autouse=True)
def nothing_left_behind():
    gc.collect()
    before = ckpt_ext.pool_stats("cpu")
    rng = torch.get_rng_state()
    grad_mode = torch.is_grad_enabled()
    yield
    gc.collect()
    after = ckpt_ext.pool_stats("cpu")
    assert after["in_use_bytes"] == before["in_use_bytes"], "a failed call left slots in the pool"
    assert after["live_slots"] == before["live_slots"]
    assert not ckpt_ext.is_recomputing()
    assert torch.is_grad_enabled() == grad_mode


def _same_rng(before):
    assert torch.equal(torch.get_rng_state(), before), "a failed call moved the global RNG"


def _setup_of(model: nn.Module):
    """What enable_checkpointing installed: per module, its group's layers and the patched forward."""
    out = []
    for name, m in model.named_modules():
        g = m.__dict__.get(_ATTR)
        out.append((name, None if g is None else tuple(id(x) for x in g.layers), "forward" in m.__dict__))
    return out


def _raises(exc, match, fn, *args, **kwargs):
    rng = torch.get_rng_state()
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)
    _same_rng(rng)


# ---- ckpt_ext.checkpoint --------------------------------------------------------------------------------------------
BLOCK = make_block(p=0.1, seed=3)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(use_reentrant="yes"), TypeError, "use_reentrant must be None, True or False"),
    (dict(determinism_check="bogus"), ValueError, r"determinism_check must be one of \['default', 'none'\]"),
    (dict(debug=1), TypeError, "debug must be True or False"),
    (dict(preserve_rng_state="yes"), TypeError, "preserve_rng_state must be True or False"),
    (dict(early_stop=None), TypeError, "early_stop must be True or False"),
])
def test_checkpoint_bad_options(kwargs, exc, match):
    x, = leaf_inputs((4, 19), seed=1)
    _raises(exc, match, ckpt_ext.checkpoint, BLOCK, x, **kwargs)


def test_checkpoint_function_not_callable():
    x, = leaf_inputs((4, 19), seed=1)
    _raises(TypeError, "function must be callable, got Tensor", ckpt_ext.checkpoint, x, x)


def test_checkpoint_context_fn_accepted_and_checked():
    # Selective checkpointing works (tests/test_conformance.py); a context_fn that is not callable is refused.
    x, = leaf_inputs((4, 19), seed=2)
    _raises(TypeError, "context_fn must be callable", ckpt_ext.checkpoint, BLOCK, x, context_fn=3)
    out = ckpt_ext.checkpoint(BLOCK, x, context_fn=torch_checkpoint.noop_context_fn)
    assert out.requires_grad


def test_checkpoint_arguments_the_function_does_not_take():
    x, = leaf_inputs((4, 19), seed=3)
    # The user's own TypeError, unchanged, and nothing kept.
    _raises(TypeError, "positional argument", ckpt_ext.checkpoint, BLOCK, x, x)


def _same_as_torch(fn, *inputs):
    """Once limitations of the old pooled design (refused with an error); now as torch.utils.checkpoint."""
    results = []
    for ckpt in (ckpt_ext.checkpoint, torch_checkpoint.checkpoint):
        xs = [t.detach().requires_grad_() for t in inputs]
        out = ckpt(fn, *xs, use_reentrant=False)
        out.sum().backward()
        results.append([t.grad for t in xs])
    for a, b in zip(*results):
        assert torch.equal(a.to_dense(), b.to_dense())


def test_checkpoint_sparse_input_and_output_work():
    _same_as_torch(lambda a: (a * 2).to_dense().sin(), torch.randn(5, 5).to_sparse())


def test_checkpoint_tensor_subclass_output_works():
    from torch.testing._internal.two_tensor import TwoTensor

    seen = []
    for ckpt in (ckpt_ext.checkpoint, torch_checkpoint.checkpoint):
        x, = leaf_inputs((3, 4), seed=5)
        out = ckpt(lambda a: TwoTensor(a * 2, a.sin()), x, use_reentrant=False)
        out.a.sum().backward()
        seen.append((type(out), x.grad))
    (t1, g1), (t2, g2) = seen
    assert t1 is t2 is TwoTensor and torch.equal(g1, g2)


def test_checkpoint_non_contiguous_and_mixed_dtype_inputs_work():
    big, other = leaf_inputs((19, 8), (4, 19), seed=6)
    other64 = other.detach().double().requires_grad_()

    def fn(a, b):
        return BLOCK(a) * b.float().sum()

    x = big.t()  # non-contiguous view of a leaf
    assert not x.is_contiguous()
    torch.manual_seed(7)
    out = ckpt_ext.checkpoint(fn, x, other64)
    out.square().sum().backward()
    got = (big.grad.clone(), other64.grad.clone(), [p.grad.clone() for p in BLOCK.parameters()])
    for t in (big, other64, *BLOCK.parameters()):
        t.grad = None
    torch.manual_seed(7)
    fn(big.t(), other64).square().sum().backward()
    assert torch.equal(got[0], big.grad) and torch.equal(got[1], other64.grad)
    for a, p in zip(got[2], BLOCK.parameters()):
        assert torch.equal(a, p.grad)
        p.grad = None


@requires_cuda
@pytest.mark.cuda
def test_checkpoint_mixed_cpu_and_cuda_inputs_match_plain():
    block = make_block(p=0.0, seed=8).cuda()
    a, = leaf_inputs((4, 19), seed=8, device="cuda")
    scale, = leaf_inputs((1,), seed=9)  # on CPU

    def fn(x, s):
        return block(x) * s.cuda()

    ckpt_ext.checkpoint(fn, a, scale).sum().backward()
    got = a.grad.clone(), scale.grad.clone()
    a.grad = scale.grad = None
    fn(a, scale).sum().backward()
    torch.testing.assert_close(got[0], a.grad)
    torch.testing.assert_close(got[1], scale.grad)


# ---- checkpoint_sequential ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("functions,segments,exc,match", [
    (5, 1, TypeError, "functions must be an nn.Sequential or a list of callables, got int"),
    ([BLOCK, 3], 2, TypeError, r"functions\[1\] is not callable \(got int\)"),
    ([], 1, ValueError, r"segments must be between 1 and the number of functions \(0\), got 1"),
    ("stack", 0, ValueError, r"segments must be between 1 and the number of functions \(5\), got 0"),
    ("stack", -1, ValueError, "got -1"),
    ("stack", 6, ValueError, "got 6"),
    ("stack", "2", TypeError, "segments must be an int, got str"),
    ("stack", 2.0, TypeError, "segments must be an int, got float"),
    ("stack", True, TypeError, "segments must be an int, got bool"),
])
def test_checkpoint_sequential_bad_arguments(functions, segments, exc, match):
    if functions == "stack":
        functions = make_stack(5, p=0.0, seed=22)
    x, = leaf_inputs((3, 19), seed=22)
    _raises(exc, match, ckpt_ext.checkpoint_sequential, functions, segments, x)


def test_checkpoint_sequential_unknown_keyword():
    x, = leaf_inputs((3, 19), seed=23)
    _raises(ValueError, "unexpected keyword arguments: foo", ckpt_ext.checkpoint_sequential, make_stack(2), 1, x,
            foo=1)


def test_is_recomputing_takes_no_arguments():
    with pytest.raises(TypeError):
        ckpt_ext.is_recomputing(True)


# ---- enable_checkpointing / disable_checkpointing / explain ---------------------------------------------------------
class Net(nn.Module):
    def __init__(self, n=4, d=19):
        super().__init__()
        self.blocks = make_stack(n, dim=d, p=0.0, seed=31)
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        return self.head(self.blocks(x))


def _foreign_layers():
    return [make_block(), make_block()]


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(every=0), ValueError, "every must be at least 1, got 0"),
    (dict(every=-2), ValueError, "every must be at least 1, got -2"),
    (dict(every=1.5), TypeError, "every must be a positive int, got 1.5"),
    (dict(every="2"), TypeError, "every must be a positive int, got '2'"),
    (dict(every=True), TypeError, "every must be a positive int, got True"),
    (dict(every=5), ValueError, "every=5 is larger than the 4 layers"),
    (dict(every=2, budget="1GiB"), ValueError, r"either every= \(fixed groups\) or budget= \(planned groups\)"),
    (dict(budget=-1), ValueError, "budget must be positive, got -1"),
    (dict(budget=0), ValueError, "budget must be positive, got 0"),
    (dict(budget="lots"), ValueError, "cannot read the memory budget 'lots'.*'20GiB'"),
    (dict(budget="-3GiB"), ValueError, "cannot read the memory budget '-3GiB'"),
    (dict(budget="3 parsecs"), ValueError, "cannot read the memory budget"),
    (dict(budget=math.nan), ValueError, "positive finite number of bytes, got nan"),
    (dict(budget=math.inf), ValueError, "positive finite number of bytes, got inf"),
    (dict(budget=True), TypeError, "memory budget must be a size such as '20GiB'"),
    (dict(budget=[1]), TypeError, "memory budget must be a size such as '20GiB'.*got list"),
    (dict(layers="blocks"), TypeError, "layers must be an nn.ModuleList, an nn.Sequential or a non-empty list"),
    (dict(layers=[]), TypeError, "non-empty list of modules"),
    (dict(layers=[1, 2]), TypeError, "non-empty list of modules"),
    (dict(layers=_foreign_layers()), ValueError, "layers must be modules of the model given"),
])
@pytest.mark.parametrize("already", [None, 2], ids=["fresh", "enabled-every-2"])
def test_enable_checkpointing_bad_arguments_leave_the_model_as_it_was(kwargs, exc, match, already):
    model = Net()
    if already:
        ckpt_ext.enable_checkpointing(model, every=already)
    before = _setup_of(model)
    _raises(exc, match, ckpt_ext.enable_checkpointing, model, **kwargs)
    assert _setup_of(model) == before
    # The model still trains, with the setup it had.
    x, = leaf_inputs((3, 19), seed=32)
    model(x).sum().backward()


def test_enable_checkpointing_models_without_a_layer_stack():
    for model in (nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3), nn.ReLU()), nn.ModuleList()):
        _raises(ValueError, "found no layer stack.*Pass the stack explicitly, e.g. "
                r"enable_checkpointing\(model, layers=model.encoder.layer\)", ckpt_ext.enable_checkpointing, model)
        assert all(_ATTR not in m.__dict__ for m in model.modules())


def test_enable_checkpointing_a_layer_twice_in_the_stack():
    block = make_block()
    model = nn.Sequential(block, block, make_block())
    _raises(ValueError, "a layer appears twice", ckpt_ext.enable_checkpointing, model, layers=model)
    assert all(_ATTR not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("fn", [ckpt_ext.enable_checkpointing, ckpt_ext.disable_checkpointing, ckpt_ext.explain,
                                ckpt_ext.fuse])
@pytest.mark.parametrize("bad", ["model", None, 3, [nn.Linear(2, 2)]])
def test_model_functions_want_a_module(fn, bad):
    _raises(TypeError, "expects an nn.Module, got", fn, bad)


def test_enable_checkpointing_on_top_of_hugging_face_checkpointing():
    model = make_model("gpt2")
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    before = _setup_of(model)
    _raises(ValueError, r"activation_checkpointing_disable\(\)", ckpt_ext.enable_checkpointing, model)
    assert _setup_of(model) == before


def test_budget_below_least_achievable_fails_every_step_until_changed():
    model = Net().train()
    ckpt_ext.enable_checkpointing(model, budget=1000)
    x, = leaf_inputs((64, 19), seed=33)
    start = ckpt_ext.pool_stats("cpu")["in_use_bytes"]
    for _ in range(2):  # the same clear error each time, nothing kept
        with pytest.raises(ValueError, match=r"least achievable.*[0-9]"):
            model(x).sum().backward()
        gc.collect()
        assert ckpt_ext.pool_stats("cpu")["in_use_bytes"] == start
    ckpt_ext.enable_checkpointing(model, budget="1GiB")
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_disable_checkpointing_on_a_model_without_it_is_a_no_op():
    model = Net()
    before = _setup_of(model)
    assert ckpt_ext.disable_checkpointing(model) is model
    assert _setup_of(model) == before
    assert "not enabled" in ckpt_ext.explain(model)


# ---- fuse / FusedTransformerLayer -----------------------------------------------------------------------------------
def test_fuse_bad_models():
    _raises(ValueError, "no supported layer in Sequential.*BertLayer", ckpt_ext.fuse,
            nn.Sequential(nn.Linear(3, 3)))
    model = ckpt_ext.fuse(make_model("bert"))
    _raises(ValueError, "already fused", ckpt_ext.fuse, model)
    _raises(ValueError, r"single layer use FusedTransformerLayer\(layer\)", ckpt_ext.fuse, make_model("gpt2").h[0])


@pytest.mark.parametrize("layer,exc,match", [
    (nn.Linear(3, 3), ValueError, r"Linear is not a supported layer \(BertLayer"),
    ("layer", TypeError, "expects a Hugging Face layer module.*got str"),
    (None, TypeError, "got NoneType"),
])
def test_fused_layer_of_something_else(layer, exc, match):
    _raises(exc, match, ckpt_ext.FusedTransformerLayer, layer)


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    model = make_model("llama", layers=1).train()
    fused = ckpt_ext.FusedTransformerLayer(model.layers[0])
    x = torch.randn(B, S, H)
    cos, sin = model.rotary_emb(x, torch.arange(S)[None])
    return fused, x, cos, sin


@pytest.fixture(scope="module")
def bert():
    torch.manual_seed(0)
    model = make_model("bert", layers=1).train()
    return ckpt_ext.FusedTransformerLayer(model.encoder.layer[0]), torch.randn(B, S, H)


def test_fused_llama_layer_bad_calls(llama):
    fused, x, cos, sin = llama
    pe = (cos, sin)
    _raises(ValueError, r"position_embeddings=\(cos, sin\) is required", fused, x)
    _raises(RuntimeError, r"hidden_states must be \[batch, seq, 72\], got \[37, 72\]", fused, x[0],
            position_embeddings=pe)
    _raises(RuntimeError, r"hidden_states must be \[batch, seq, 72\], got \[2, 37, 71\]", fused, x[..., :71],
            position_embeddings=pe)
    _raises(RuntimeError, "weight 0 is Float on cpu but the hidden states are Double.*model.to\\(dtype\\)", fused,
            x.double(), position_embeddings=(cos.double(), sin.double()))
    _raises(RuntimeError, r"position_embeddings \(cos, sin\) are Double on cpu but the hidden states are Float", fused,
            x, position_embeddings=(cos.double(), sin.double()))
    _raises(RuntimeError, r"cos must be \[1 or batch=2, seq=36", fused, x[:, :36], position_embeddings=pe)
    _raises(TypeError, "hidden_states must be a Tensor", fused, x.tolist(), position_embeddings=pe)
    _raises(TypeError, "hidden_states must be a Tensor.*got NoneType", fused, None, position_embeddings=pe)
    _raises(ValueError, "hidden_states are on meta; the fused layers run on CPU and CUDA only", fused,
            torch.empty(B, S, H, device="meta"), position_embeddings=pe)
    _raises(TypeError, "got multiple values for argument 'hidden_states'", fused, x, hidden_states=x,
            position_embeddings=pe)


def test_fused_layer_bad_masks(bert):
    fused, x = bert
    _raises(RuntimeError, r"attention_mask of shape \[2, 1, 1, 7\] does not fit hidden states of shape "
            r"\[2, 37, 72\] with 3 heads.*the last must be 37", fused, x, attention_mask=torch.zeros(2, 1, 1, 7))
    _raises(RuntimeError, r"attention_mask of shape \[3, 1, 37, 37\] does not fit", fused, x,
            attention_mask=torch.zeros(3, 1, S, S))
    _raises(RuntimeError, "attention_mask must be bool or have the dtype of the hidden states \\(Float\\), got Long",
            fused, x, attention_mask=torch.ones(2, 1, 1, S, dtype=torch.long))
    _raises(RuntimeError, r"attention_mask must be the 4-D mask.*got shape \[2, 37\]", fused, x,
            attention_mask=torch.ones(2, S))
    _raises(RuntimeError, "attention_mask is on meta but the hidden states are on cpu; move the mask", fused, x,
            attention_mask=torch.zeros(2, 1, 1, S, device="meta"))


def test_fused_layer_spec_checks():
    def spec(**kw):
        args = dict(family=2, hidden=72, num_heads=3, num_kv_heads=3, head_dim=24, scaling=1.0, attn_p=0.0,
                    hidden_p=0.0, eps=1e-6, gelu_tanh=False)
        args.update(kw)
        return ckpt_ext._C.LayerSpec(**args)

    _raises(RuntimeError, r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)", spec, num_kv_heads=2)
    _raises(RuntimeError, "dropout probabilities must be in", spec, attn_p=1.0)
    _raises(RuntimeError, "rotary needs an even head_dim", spec, head_dim=23)
    _raises(RuntimeError, "unknown family", spec, family=7)


def test_fused_layer_non_contiguous_hidden_states_work(bert):
    fused, x = bert
    fused.eval()
    try:
        strided = x.transpose(0, 1).contiguous().transpose(0, 1)
        assert not strided.is_contiguous()
        with torch.no_grad():
            assert torch.equal(fused(strided), fused(x.contiguous()))
    finally:
        fused.train()


def test_failed_fused_segment_call_leaves_the_model_usable():
    torch.manual_seed(1)
    model = ckpt_ext.fuse(make_model("bert", dropout=0.1, layers=2)).train()
    ckpt_ext.enable_checkpointing(model, every=2)
    kw = inputs_for("bert", padding=True)
    with pytest.raises(RuntimeError, match="attention_mask"):
        layers_of(model)[0](torch.randn(B, S, H), attention_mask=torch.zeros(B, 1, 1, S + 1))
    model(**kw).last_hidden_state.sum().backward()


# ---- pool functions -------------------------------------------------------------------------------------------------
POOL_FUNCTIONS = [ckpt_ext.pool_stats, ckpt_ext.reset_peak_stats, ckpt_ext.empty_pool]


@pytest.mark.parametrize("fn", POOL_FUNCTIONS + [lambda d: ckpt_ext.set_pool_chunk_bytes(1 << 20, d)])
@pytest.mark.parametrize("device,exc,match", [
    ("gpu", TypeError, "expected a device such as 'cpu', 'cuda:0' or torch.device, got 'gpu'"),
    (1.5, TypeError, "got 1.5"),
    ([], TypeError, r"got \[\]"),
    ("meta", ValueError, "pools exist for CPU and CUDA devices only, got meta"),
    (torch.device("meta"), ValueError, "CPU and CUDA devices only"),
])
def test_pool_functions_bad_devices(fn, device, exc, match):
    chunk = ckpt_ext.pool_chunk_bytes("cpu")
    _raises(exc, match, fn, device)
    assert ckpt_ext.pool_chunk_bytes("cpu") == chunk


@pytest.mark.skipif(HAS_CUDA, reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0])
def test_pool_functions_cuda_without_cuda(device):
    for fn in POOL_FUNCTIONS:
        _raises(ValueError, "CUDA is not available here.*use device='cpu'", fn, device)


@requires_cuda
@pytest.mark.cuda
def test_pool_functions_cuda_device_that_does_not_exist():
    n = torch.cuda.device_count()
    for fn in POOL_FUNCTIONS:
        _raises(ValueError, f"does not exist: this machine has {n} CUDA device", fn, f"cuda:{n}")


def test_is_pooled_and_record_stream_bad_arguments():
    _raises(TypeError, "expected a Tensor, got list", ckpt_ext.is_pooled, [1.0])
    x = torch.randn(3)
    _raises(TypeError, "expected a torch.Stream.*got int", ckpt_ext.record_stream, x, 0)
    _raises(ValueError, r"not in a ckpt_ext pool; use tensor.record_stream\(stream\)", ckpt_ext.record_stream, x,
            torch.Stream("cpu"))


# ---- ops ------------------------------------------------------------------------------------------------------------
_GEN = torch.Generator().manual_seed(12)


def _r(*shape):  # inputs from a local generator: the global RNG is checked to stay put
    return torch.randn(*shape, generator=_GEN)


X = _r(4, 8)
W = _r(8)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: ops.bias_gelu(X, None, "fast"), RuntimeError, "approximate must be 'none' or 'tanh', got 'fast'"),
    (lambda: ops.bias_gelu(X, _r(7)), RuntimeError, r"bias must be 1-D of size 8 \(the last dimension of x"),
    (lambda: ops.bias_gelu(X, _r(8).half()), RuntimeError,
     r"bias must have the dtype of x.*cast it with .to\(x.dtype\)"),
    (lambda: ops.bias_gelu(X, W.to("meta")), RuntimeError, r"bias must be on the device of x \(cpu\), got meta"),
    (lambda: ops.bias_gelu(X.to("meta"), W), RuntimeError, r"bias must be on the device of x \(meta\), got cpu"),
    (lambda: ops.bias_gelu(torch.tensor(1.0)), RuntimeError, "x must have at least one dimension"),
    (lambda: ops.bias_gelu([1.0]), RuntimeError, "Expected a value of type 'Tensor' for argument 'x'"),
    (lambda: ops.bias_gelu(X.long()), RuntimeError, "CPU kernels support float32, float64, float16 and bfloat16"),
    (lambda: ops.bias_dropout_add(X, None, X, 1.5, 0, 0), RuntimeError, r"p must be in \[0, 1\], got 1.5"),
    (lambda: ops.bias_dropout_add(X, None, X, -0.1, 0, 0), RuntimeError, r"p must be in \[0, 1\]"),
    (lambda: ops.bias_dropout_add(X, None, _r(4, 7), 0.1, 0, 0), RuntimeError,
     "residual must have the shape of x"),
    (lambda: ops.bias_dropout_add(X, None, X.to("meta"), 0.1, 0, 0), RuntimeError,
     "residual must be on the device of x"),
    (lambda: ops.dropout(X, 2.0, 0, 0), RuntimeError, r"p must be in \[0, 1\]"),
    (lambda: ops.add_layer_norm(X, _r(4, 7), W, None, 1e-5), RuntimeError,
     "residual must have the shape of x"),
    (lambda: ops.add_layer_norm(X, None, W, None, -1.0), RuntimeError, "eps must be >= 0, got -1"),
    (lambda: ops.add_layer_norm(X, None, W.double(), None, 1e-5), RuntimeError, "weight must have the dtype of x"),
    (lambda: ops.add_rms_norm(X, None, _r(9), 1e-6), RuntimeError, "weight must be 1-D of size 8"),
    (lambda: ops.add_rms_norm(X, None, W.to("meta"), 1e-6), RuntimeError, "weight must be on the device of x"),
    (lambda: ops.swiglu(torch.ones(3, dtype=torch.int32), torch.ones(3, dtype=torch.int32)), RuntimeError,
     "CPU kernels support"),
    (lambda: ops.swiglu(X, X[:, :7]), RuntimeError, "up must have the shape of gate"),
    (lambda: ops.rotary(_r(1, 2, 3, 5), _r(3, 5), _r(3, 5)), RuntimeError,
     "head_dim must be even, got 5"),
    (lambda: ops.rotary(_r(2, 2, 3, 4), _r(3, 3, 4), _r(3, 3, 4)), RuntimeError,
     r"cos must be \[1 or batch=2, seq=3, head_dim=4\]"),
    (lambda: ops.rotary(_r(2, 3, 4), _r(3, 4), _r(3, 4)), RuntimeError,
     r"x must be \[batch, heads, seq, head_dim\]"),
    (lambda: ops.add_rms_norm_backward(X, None, X, W, ops.add_rms_norm(X, None, W, 1e-6)[2].double()), RuntimeError,
     "rstd must be the Float tensor"),
])
def test_ops_bad_arguments(call, exc, match):
    _raises(exc, match, call)


@pytest.mark.parametrize("name", ["bias_gelu", "bias_dropout_add", "add_layer_norm", "add_rms_norm", "swiglu",
                                  "rotary"])
def test_ops_non_contiguous_inputs_equal_contiguous(name):
    x, r = _r(8, 5, 6).transpose(0, 2), _r(6, 8, 5).transpose(1, 2)  # [6, 5, 8], not contiguous
    calls = {
        "bias_gelu": lambda c: ops.bias_gelu(c(x), W),
        "bias_dropout_add": lambda c: ops.bias_dropout_add(c(x), W, c(r), 0.3, 5, 7),
        "add_layer_norm": lambda c: ops.add_layer_norm(c(x), c(r), W, W, 1e-5),
        "add_rms_norm": lambda c: ops.add_rms_norm(c(x), c(r), W, 1e-6),
        "swiglu": lambda c: ops.swiglu(c(x), c(r)),
    }
    if name == "rotary":
        cs = _r(8, 5).t()  # [seq, head_dim], non-contiguous
        for q in (_r(2, 5, 3, 8).transpose(1, 2), _r(2, 3, 8, 5).transpose(2, 3)):  # [B, H, S, D] views
            assert not q.is_contiguous()
            assert torch.equal(ops.rotary(q, cs, cs), ops.rotary(q.contiguous(), cs.contiguous(), cs.contiguous()))
        return
    a, b = calls[name](lambda t: t), calls[name](lambda t: t.contiguous())
    for u, v in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        assert torch.equal(u, v)
