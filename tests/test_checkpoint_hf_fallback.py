"""Fused layers falling back to Hugging Face's forward, and under autocast, checkpointed with every
family's default config: gradients as without checkpointing (issue 13 item 7)."""

import pytest
import torch
from torch import nn

import ckpt_ext


# ------------------------------------------------------------------------------------------------
# Fused layers falling back to Hugging Face's forward, every family with its default config (use_cache
# left on): the KV cache must not be written in forward and again in the replay (issue 13 item 7).
# ------------------------------------------------------------------------------------------------
class _Wrap(nn.Module):
    """Replaces a projection after fuse(), so that the fused layer falls back to Hugging Face's forward."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def _default_model(family):
    transformers = pytest.importorskip("transformers")
    small = dict(vocab_size=97)
    if family == "bert":
        cfg = transformers.BertConfig(hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, **small)
        return transformers.BertModel(cfg, add_pooling_layer=False), ("attention", "self", "query")
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_embd=48, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0, **small)
        return transformers.GPT2Model(cfg), ("attn", "c_attn")
    cfg = transformers.LlamaConfig(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                   attention_dropout=0.1, **small)
    return transformers.LlamaModel(cfg), ("self_attn", "q_proj")


def _replace(model, path):
    for layer in model.modules():
        if type(layer).__name__ in ("BertLayer", "GPT2Block", "LlamaDecoderLayer", "FusedTransformerLayer"):
            parent = layer
            for name in path[:-1]:
                parent = getattr(parent, name)
            setattr(parent, path[-1], _Wrap(getattr(parent, path[-1])))


@pytest.mark.parametrize("fallback", ["replaced", "autocast"])
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_fused_fallback_default_config_matches_no_checkpointing(family, fallback):
    import copy
    import logging
    import warnings
    from ckpt_ext import fused as fused_module
    warned = set(fused_module._warned)  # fused warnings are once per process: leave them to test_fused
    torch.manual_seed(0)
    ref, path = _default_model(family)
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt_ext.fuse(model)
        if fallback == "autocast":
            # Autocast runs the fused path itself since issue 10 (no fallback): the reference is the same
            # fused model not checkpointed, which draws the same dropout masks, so the KV-cache bug would show.
            ref = copy.deepcopy(model)
        if fallback == "replaced":
            _replace(ref, path)
            _replace(model, path)
        logging.getLogger("ckpt_ext").setLevel(logging.ERROR)
        ckpt_ext.enable_checkpointing(model)
        ids = torch.randint(1, 97, (2, 12))
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[1, 8:] = 0  # padding
        results = []
        for m in (ref, model):
            m.train()
            torch.manual_seed(1)
            losses = []
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            for _ in range(2):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=fallback == "autocast"):
                    out = m(input_ids=ids, attention_mask=mask).last_hidden_state
                loss = out.float().pow(2).mean()
                loss.backward()
                losses.append(loss.detach())
                grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
                opt.step()
            results.append((losses, grads))
    fused_module._warned.clear()
    fused_module._warned.update(warned)
    (l_ref, g_ref), (l_ck, g_ck) = results
    assert g_ref.keys() == g_ck.keys()
    for a, b in zip(l_ref, l_ck):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for n in g_ref:
        torch.testing.assert_close(g_ck[n], g_ref[n], rtol=1e-5, atol=1e-6, msg=n)
