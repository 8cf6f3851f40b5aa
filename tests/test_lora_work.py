"""The fused LoRA step's work (docs/lora-work.md): op counts per layer of a peft-LoRA model through ckpt_ext.fuse, as
users run it (float32 adapters, peft's default, on a bfloat16 model or a float32 one, under autocast bf16), so that
the cuts cannot silently regress.

* Counts per layer (3 layers less 2), forward and backward apart: matrix products (mm/addmm; the backward's
  minimum: each base projection's input gradient -- frozen base weights get no weight-gradient GEMM -- and four per
  adapter, A's and B's weight and input gradients), and the token-sized ([B, S, ...]) casts, adapter dropouts,
  multiplies and adds. Before the cuts (main at ffde522), Llama, bfloat16 model, autocast, lora_dropout 0.1: per layer
  forward 14 casts + 7 dropouts (float32) + 7 scaling multiplies, backward 14 casts + 8 dropouts (7 float32 + the last
  linear's p = 0 copy) + 7 multiplies; now 0 casts, 7 dropouts (bfloat16) each way, no multiply (scaling 2, a power
  of two) and no copy.
* Bits: the adapter input in the GEMM's dtype (dropout of a bfloat16 x in bfloat16; of a float32 x rounded to
  bfloat16 in the same pass) against peft's order (cast to float32, dropout, cast), values and gradients.
"""
import copy
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ckpt_ext

from helpers.devices import DEVICES

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
import test_lora_fused as lf  # noqa: E402  (the tiny models and peft configs)

B, S = lf.B, 11
TOKENS = B * S


class CountOps(TorchDispatchMode):
    """Counts, by kind, the ops of interest: matrix products, and token-sized casts, dropouts, multiplies, adds."""

    # mm: the projections' products (not bmm: an attention kernel SDPA may pick on a GPU would count its own)
    KINDS = {"mm": (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_),
             "cast": (torch.ops.aten._to_copy,), "dropout": (torch.ops.ckpt_ext.dropout,),
             "mul": (torch.ops.aten.mul, torch.ops.aten.mul_), "add": (torch.ops.aten.add, torch.ops.aten.add_)}

    def __init__(self):
        super().__init__()
        self.n = dict.fromkeys(self.KINDS, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        token_sized = isinstance(out, torch.Tensor) and out.dim() >= 2 and out.shape[:-1].numel() == TOKENS
        for kind, ops in self.KINDS.items():
            if func._overloadpacket in ops and (kind == "mm" or token_sized):
                self.n[kind] += 1
        return out


MODES = {"bf16-autocast": (torch.bfloat16, True), "autocast": (torch.float32, True), "fp32": (torch.float32, False)}


def _counts(family, mode, lora_dropout, layers, device, alpha=8):
    """({kind: n} of the forward, of the backward) of one fused training step."""
    dtype, autocast = MODES[mode]
    torch.manual_seed(0)
    model = peft.get_peft_model(lf.make_model(family, 0.0, layers).to(dtype),
                                lf.lora_config(family, lora_dropout, lora_alpha=alpha))
    model = ckpt_ext.fuse(model.train()).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with CountOps() as fwd, torch.autocast(device, torch.bfloat16, enabled=autocast):
            out = model(**lf.inputs(device)).last_hidden_state
        loss = out.float().pow(2).mean()
        with CountOps() as bwd:
            loss.backward()
    return fwd.n, bwd.n


def per_layer(family, mode, lora_dropout, device="cpu", alpha=8):
    two, three = _counts(family, mode, lora_dropout, 2, device, alpha), _counts(family, mode, lora_dropout, 3, device,
                                                                               alpha)
    return tuple({k: three[i][k] - two[i][k] for k in two[i]} for i in range(2))


def _n(mm, cast=0, dropout=0, mul=0, add=0):
    return {"mm": mm, "cast": cast, "dropout": dropout, "mul": mul, "add": add}


# (forward, backward) per layer, lora_dropout 0.1, scaling 2 (alpha 8, r 4). Llama: 5 base GEMMs (q/k/v as one) and 7
# adapters; BERT: 4 base GEMMs (q/k/v as one) and 6 adapters (query, key, value, and the three "dense"). Products: the
# minimum (base input gradients, 4 per adapter). Adds: the adapter terms joining the base outputs (q/k/v's as one) and,
# in backward, the input gradients of the adapters joining the base GEMMs' (docs/lora-work.md: not cut, they would
# round once instead of twice). Casts: float32 models only -- the norm outputs the adapters read stay float32 (their
# dropout rounds once from float32; docs/lora-work.md (b)), cast for the base GEMMs (but BERT's h1, written twice by
# the dual op: before, forward 2 and backward 6 casts, 8 adds), and the float32 adapter input's dropout backward takes
# its gradient in float32; Llama's backward dropout 8: the last linear's p = 0 cast of the
# bfloat16 term's gradient (bias_dropout_add's mixed path).
EXPECTED = {
    ("llama", "bf16-autocast"): (_n(19, dropout=7, add=5), _n(33, dropout=7, add=8)),
    ("llama", "autocast"): (_n(19, cast=3, dropout=7, add=5), _n(33, cast=9, dropout=8, add=8)),
    ("bert", "autocast"): (_n(16, cast=1, dropout=6, add=4), _n(28, cast=5, dropout=6, add=7)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family, mode", list(EXPECTED))
def test_counts_per_layer(family, mode, device):
    assert per_layer(family, mode, 0.1, device) == EXPECTED[(family, mode)]


def test_backward_products_are_the_minimum():
    """Frozen base weights: no weight-gradient GEMM. Llama, no adapter dropout: the q/k/v adapters share their two
    GEMMs (4 products in backward for the three), the other four adapters 4 each, the 5 base input gradients."""
    fwd, bwd = per_layer("llama", "bf16-autocast", 0.0)
    assert fwd["mm"] == 5 + 2 + 4 * 2 and bwd["mm"] == 5 + 4 + 4 * 4
    assert fwd["cast"] == bwd["cast"] == 0 and fwd["dropout"] == bwd["dropout"] == 0


def test_scaling_not_a_power_of_two_keeps_its_multiply():
    """alpha 12, r 4: scaling 3 multiplies the [T, out] term (forward and backward) as peft does; 2 multiplies B."""
    fwd, bwd = per_layer("llama", "bf16-autocast", 0.1, alpha=12)
    assert fwd["mul"] == 7 and bwd["mul"] == 7


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_adapter_dropout_in_the_gemm_dtype_is_bit_exact(x_dtype, device):
    """What the fused adapter computes, against peft's order (x cast to the float32 adapters' dtype, dropout, the
    GEMM's cast to bfloat16): values and input gradients, bit for bit."""
    g = torch.Generator().manual_seed(0)
    x0 = (torch.randn(5, 37, 70, generator=g) * 3).to(device, x_dtype)
    grad = torch.randn(5, 37, 70, generator=g).to(device, torch.bfloat16)
    p, seed, offset = 0.3, 1234, 7
    x = x0.clone().requires_grad_()
    ref = torch.ops.ckpt_ext.dropout(x.float(), p, seed, offset).to(torch.bfloat16)
    (gref,) = torch.autograd.grad(ref, x, grad)
    x = x0.clone().requires_grad_()
    new = torch.ops.ckpt_ext.dropout(x, p, seed, offset, None if x_dtype == torch.bfloat16 else torch.bfloat16)
    (gnew,) = torch.autograd.grad(new, x, grad)
    assert new.dtype == torch.bfloat16 and torch.equal(new, ref)
    assert gnew.dtype == x_dtype and torch.equal(gnew, gref)
    assert 0.2 < (new == 0).float().mean().item() < 0.4  # the mask drops


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_checkpointed_bit_identical_bf16_autocast(family, device):
    """The cut paths replay as they ran: fused + enable_checkpointing gives the fused step's bits (bfloat16 model,
    float32 adapters, autocast, adapter and hidden dropout on)."""
    torch.manual_seed(0)
    ref = peft.get_peft_model(lf.make_model(family, 0.1).to(torch.bfloat16), lf.lora_config(family, 0.1))
    lf.randomise_adapters(ref)
    fused = ckpt_ext.fuse(ref.train()).to(device)
    ck = ckpt_ext.enable_checkpointing(copy.deepcopy(fused))
    with torch.autocast(device, torch.bfloat16):
        a, b = lf.step(fused, lf.inputs(device)), lf.step(ck, lf.inputs(device))
    lf.assert_identical(a, b)
