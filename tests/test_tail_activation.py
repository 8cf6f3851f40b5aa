"""The activation of a checkpointed segment's last layer moved into its backward (issues 32/33).

The replay of a segment's last layer stops before the activation that computes the last linear's input (SwiGLU /
GeGLU for the Llama family, bias-GELU for GPT-2 and BERT), and its backward runs the activation's backward with an
op that also writes the activation's output (the ``*_backward_act_`` ops, over the incoming gradient), from which
the last linear's weight gradient comes. Tested here: the ops (the forward's bits, the backward's bits, odd sizes
and every dtype; CUDA-marked twins), that the replay runs no activation forward for the last layer (a dispatch
mode counting the activation ops; fails with the switch off), that the replay holds one [tokens, intermediate]
tensor less at the backward's peak (CPU allocator events), and that the gradients stay bit-identical to the layer
not checkpointed and to the switch off (fp32, bf16, autocast, dropout on and off, every=1 and all, keep levels,
LoRA on the last linear, which keeps the replay before the last linear).
"""
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ckpt_ext
from ckpt_ext import _C, ops

transformers = pytest.importorskip("transformers")
from helpers.devices import DEVICES  # noqa: E402
from helpers.fused import _checkpointed_pair, _seed, assert_switch_defaults_on, switched  # noqa: E402,F401
from helpers.hf_models import embeds_call, inputs_for, layers_of  # noqa: E402
from helpers.pool import allocator_peak  # noqa: E402

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# Odd sizes: vector-loop tails (8 / 16 float lanes, 2 x that per step), rows that are not a multiple of 4 (CUDA's
# groups of four, its column kernel), more than one CPU block (2048 elements) per row.
SHAPES = [(1, 1), (3, 37), (5, 1029), (2, 3, 4099), (7, 2050)]


def _inputs(shape, dtype, device, n=3):
    g = torch.Generator().manual_seed(sum(shape))
    return [(torch.randn(shape, generator=g, dtype=torch.float32) * 3).to(dtype).to(device) for _ in range(n)]


# ---- the ops -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["swiglu", "geglu-tanh", "geglu-none"])
def test_glu_backward_act_writes_the_forward_bits(kind, shape, dtype, device):
    """In place: grad becomes the forward's output, gate and up the backward op's gradients, bit for bit."""
    grad, gate, up = _inputs(shape, dtype, device)
    act, g, u = grad.clone(), gate.clone(), up.clone()
    if kind == "swiglu":
        fwd, bwd = ops.swiglu(gate, up), ops.swiglu_backward(grad, gate, up)
        assert ops.swiglu_backward_act_(act, g, u) is None
    else:
        approx = kind.split("-")[1]
        fwd, bwd = ops.geglu(gate, up, approx), ops.geglu_backward(grad, gate, up, approx)
        ops.geglu_backward_act_(act, g, u, approx)
    assert torch.equal(act, fwd)
    assert torch.equal(g, bwd[0]) and torch.equal(u, bwd[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("grad_bias", [True, False], ids=["grad_bias", "no_grad_bias"])
@pytest.mark.parametrize("approx", ["tanh", "none"])
def test_bias_gelu_backward_act_writes_the_forward_bits(approx, grad_bias, bias, shape, dtype, device):
    """In place: grad becomes x's gradient, x the forward's output; the bias's gradient returned; bit for bit."""
    grad, x, b = _inputs(shape, dtype, device)
    b = b.reshape(-1, shape[-1])[0].contiguous() if bias else None
    fwd = ops.bias_gelu(x, b, approx)
    bwd = torch.ops.ckpt_ext.bias_gelu_backward(grad, x, b, approx, grad_bias)
    d, xx = grad.clone(), x.clone()
    gb = ops.bias_gelu_backward_act_(d, xx, b, approx, grad_bias)
    assert torch.equal(xx, fwd)
    assert torch.equal(d, bwd[0]) and torch.equal(gb, bwd[1])


def test_backward_act_ops_refuse_what_they_cannot_write():
    gate, up = torch.randn(4, 6), torch.randn(4, 6)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        ops.swiglu_backward_act_(torch.randn(6, 4).t(), gate, up)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.swiglu_backward_act_(torch.randn(4, 6, dtype=torch.float64), gate, up)
    with pytest.raises(RuntimeError, match="must not share memory"):
        ops.geglu_backward_act_(torch.randn(4, 6), gate, gate)
    with pytest.raises(RuntimeError, match="shape"):
        ops.bias_gelu_backward_act_(torch.randn(4, 5), gate, None, "none")
    with pytest.raises(RuntimeError, match="must not share memory"):
        ops.bias_gelu_backward_act_(gate, gate, None, "none")


def test_the_switch_defaults_on():
    assert_switch_defaults_on(_C.tail_activation_in_backward)


# ---- the replay ----------------------------------------------------------------------------------------------------

_ACT_FWD = {"swiglu", "geglu", "bias_gelu"}
_ACT_BWD_ACT = {"swiglu_backward_act_", "geglu_backward_act_", "bias_gelu_backward_act_"}


class CountActivations(TorchDispatchMode):
    """Counts the ckpt_ext activation ops (forward, and the backwards writing the activation) under the mode."""

    def __init__(self):
        super().__init__()
        self.fwd = self.bwd_act = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "ckpt_ext":
            name = func._overloadpacket.__name__
            self.fwd += name in _ACT_FWD
            self.bwd_act += name in _ACT_BWD_ACT
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("every", [1, 3], ids=["every1", "all"])
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama", "gemma"])
def test_the_replay_runs_no_activation_forward_for_the_last_layer(family, every):
    """3 layers: every=1 replays each layer as a segment's last (no activation forward in backward at all), all
    replays two layers whole and the third from before its activation. With the switch off, the replays run one
    activation forward per segment more and no _act_ op."""
    counts = {}
    for on in (True, False):
        _, ck = _checkpointed_pair(family, every, layers=3)
        out = ck(**inputs_for(family, padding=False)).last_hidden_state
        with switched(_C.tail_activation_in_backward, on), CountActivations() as c:
            out.pow(2).mean().backward()
        counts[on] = (c.fwd, c.bwd_act)
    segments = 3 if every == 1 else 1
    assert counts[True] == (3 - segments, segments)
    assert counts[False] == (3, 0)


def _step(model, family, kw, autocast=False):
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        warnings.simplefilter("ignore", FutureWarning)
        torch.manual_seed(7)
        emb, out = embeds_call(model, family, kw)
    out.float().pow(2).mean().backward()
    return out.detach(), emb.grad.clone(), {n: p.grad.clone() for n, p in model.named_parameters()
                                            if p.grad is not None}


def _assert_same(a, b):
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[2].keys() == b[2].keys() and len(a[2]) > 0
    for n in a[2]:
        assert a[2][n].dtype == b[2][n].dtype and torch.equal(a[2][n], b[2][n]), n


@pytest.mark.parametrize("mode", ["fp32", "bf16", "autocast"])
@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["nodrop", "drop"])
@pytest.mark.parametrize("every", [1, 3], ids=["every1", "all"])
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama", "qwen3", "gemma"])
def test_gradients_are_those_of_the_layer_not_checkpointed(family, every, dropout, mode):
    """Checkpointed with the activation in the backward == fused, not checkpointed == checkpointed with the switch
    off, bit for bit: the output, the input's gradient, every parameter's."""
    model, ck = _checkpointed_pair(family, every, layers=3, dropout=dropout)
    if mode == "bf16":
        model.to(torch.bfloat16)
        ck.to(torch.bfloat16)
    kw = inputs_for(family, padding=True)
    ref = _step(model, family, kw, autocast=mode == "autocast")
    got = _step(ck, family, kw, autocast=mode == "autocast")
    _assert_same(got, ref)
    with switched(_C.tail_activation_in_backward, False):
        before = _step(ck, family, kw, autocast=mode == "autocast")
    _assert_same(got, before)


@pytest.mark.parametrize("keep", ["attention_inputs", "gemms"])
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_keep_levels_with_the_activation_in_the_backward(family, keep):
    """A level keeping only the q/k/v projection (attention_inputs) replays from before the activation; one keeping
    the activation's input GEMMs (gemms) keeps the replay before the last linear (the backward writes the
    activation's inputs in place, which must not be the kept ones). The same gradients as not checkpointed."""
    model, ck = _checkpointed_pair(family, 1, layers=2, dropout=0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt_ext.enable_checkpointing(ck, every=1, keep=keep)
    kw = inputs_for(family, padding=True)
    ref = _step(model, family, kw)
    with CountActivations() as c:
        got = _step(ck, family, kw)
    _assert_same(got, ref)
    if keep == "gemms":
        assert (c.fwd, c.bwd_act) == (4, 0)  # the two forwards' activations, the two replays'
    else:
        assert (c.fwd, c.bwd_act) == (2, 2)  # the two forwards' activations; none replayed


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_lora_on_the_last_linear_keeps_the_replay_before_it(family):
    """An adapter on the last linear reads the activation's output: that layer's replay runs the activation forward
    (today's path); an adapter elsewhere does not stop the new one. Gradients as not checkpointed either way."""
    peft = pytest.importorskip("peft")
    from helpers.hf_models import make_model
    last = {"gpt2": "mlp.c_proj", "llama": "down_proj", "bert": "output.dense"}[family]
    other = {"gpt2": "c_attn", "llama": "q_proj", "bert": "query"}[family]
    for targets, replayed_fwd in (([last], 2), ([other], 0)):
        model = make_model(family, dropout=0.1, layers=2)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                           fan_in_fan_out=family == "gpt2"))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.2)
        fused = ckpt_ext.fuse(model).train()
        import copy
        ck = copy.deepcopy(fused)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ckpt_ext.enable_checkpointing(ck, every=1)
        kw = inputs_for(family, padding=False)
        ref = _step(fused, family, kw)
        torch.manual_seed(7)
        out = ck(**kw).last_hidden_state
        with CountActivations() as c:
            out.float().pow(2).mean().backward()
        assert (c.fwd, c.bwd_act) == (replayed_fwd, 2 - replayed_fwd), targets
        got = _step(ck, family, kw)
        _assert_same(got, ref)


# ---- the memory ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_the_replay_holds_one_activation_less_at_the_peak(family):
    """One layer, one segment, no dropout: the backward's peak (the allocator's live bytes over the backward) is
    lower by about one [tokens, intermediate] tensor with the activation in the backward than without it (at least
    90% of one: the peak may move to another point of the layer's backward, here the attention's; measured at these
    sizes: GPT-2 and Llama one such tensor less 4 bytes, BERT 98.5%)."""
    peaks = {}
    for on in (True, False):
        _, ck = _checkpointed_pair(family, 1, layers=1, dropout=0.0)
        kw = inputs_for(family, padding=False, batch=4, seq=32)
        out = ck(**kw).last_hidden_state
        g = torch.ones_like(out)
        with switched(_C.tail_activation_in_backward, on):
            peaks[on] = allocator_peak(lambda: out.backward(g))
        inter = layers_of(ck)[0]
        width = {"gpt2": lambda m: m.mlp.c_fc.weight.shape[1], "llama": lambda m: m.mlp.up_proj.weight.shape[0],
                 "bert": lambda m: m.intermediate.dense.weight.shape[0]}[family](inter)
        act_bytes = out.shape[0] * out.shape[1] * width * out.element_size()
    assert peaks[False] - peaks[True] >= 0.9 * act_bytes, (peaks, act_bytes)
