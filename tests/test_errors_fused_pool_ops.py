"""Bad input to ckpt_ext's fused layers (fuse, FusedTransformerLayer), pool functions and ops. What each
case checks: tests/helpers/errors.py."""
import pytest
import torch
from torch import nn

import ckpt_ext
from ckpt_ext import ops

transformers = pytest.importorskip("transformers")
from helpers.hf_models import B, H, S, inputs_for, layers_of, make_model  # noqa: E402

from helpers.devices import HAS_CUDA, requires_cuda  # noqa: E402
from helpers.errors import _raises, nothing_left_behind  # noqa: E402,F401  (an autouse fixture)


# ---- fuse / FusedTransformerLayer -----------------------------------------------------------------------------------
def test_fuse_bad_models():
    _raises(ValueError, "no supported layer in Sequential.*BertLayer", ckpt_ext.fuse,
            nn.Sequential(nn.Linear(3, 3)))
    model = ckpt_ext.fuse(make_model("bert"))
    with pytest.warns(UserWarning, match="already fused"):  # fused again: left as it is (tests/test_lifecycle.py)
        assert ckpt_ext.fuse(model) is model
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
    (lambda: ops.geglu(X, X[:, :7]), RuntimeError, "up must have the shape of gate"),
    (lambda: ops.geglu(X, X, "sigmoid"), RuntimeError, "approximate"),
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
                                  "geglu", "rotary"])
def test_ops_non_contiguous_inputs_equal_contiguous(name):
    x, r = _r(8, 5, 6).transpose(0, 2), _r(6, 8, 5).transpose(1, 2)  # [6, 5, 8], not contiguous
    calls = {
        "bias_gelu": lambda c: ops.bias_gelu(c(x), W),
        "bias_dropout_add": lambda c: ops.bias_dropout_add(c(x), W, c(r), 0.3, 5, 7),
        "add_layer_norm": lambda c: ops.add_layer_norm(c(x), c(r), W, W, 1e-5),
        "add_rms_norm": lambda c: ops.add_rms_norm(c(x), c(r), W, 1e-6),
        "swiglu": lambda c: ops.swiglu(c(x), c(r)),
        "geglu": lambda c: ops.geglu(c(x), c(r)),
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
