"""Tests of the fused transformer layers (ckpt_ext.fuse, FusedTransformerLayer, csrc/layers/) with dropout on:
reproducible under torch.manual_seed, the observed drop rate within statistical bounds, attention dropout
changing only the attention and leaving the generator as it was."""
import math

import pytest
import torch

from ckpt_ext import FusedTransformerLayer, fuse

transformers = pytest.importorskip("transformers")
from helpers.devices import DEVICES  # noqa: E402
from helpers.hf_models import B, H, RELATIVES, S, inputs_for, make_model  # noqa: E402
from helpers.fused import _seed  # noqa: E402,F401  (an autouse fixture)


# ---- dropout -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"] + RELATIVES)
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
    """Attention-probability dropout is applied (seeded from the layer's seed: on CPU the Philox dropout op,
    on CUDA SDPA's), reproducibly."""
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
