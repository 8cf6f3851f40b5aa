"""Tiny Hugging Face models (random weights, odd sizes on purpose) for the fused-layer tests, their
inputs, and the float32 comparisons with the Hugging Face module.

Tolerances (float32): |fused - hf| <= 1e-5 * |hf| + 1e-6 * scale, scale = the largest magnitude of the
quantity compared (per tensor; per model for gradients, because some gradients -- BERT's key bias -- are
zero in exact arithmetic and pure rounding noise in both implementations).
"""
import copy

import pytest
import torch

from ckpt_ext import fuse

pytest.importorskip("transformers")
from transformers import BertConfig, BertModel, GPT2Config, GPT2Model, LlamaConfig, LlamaModel  # noqa: E402
from transformers import RobertaConfig, RobertaModel  # noqa: E402

B, S, H, VOCAB = 2, 37, 72, 61
RTOL, ATOL = 1e-5, 1e-6
# Gemma 3's per-head q/k norms and the norms of the attention's and the MLP's outputs amplify float32 rounding: the
# fused and Hugging Face's float32 runs each differ from a float64 run by about 1e-6 of a gradient's scale, the
# fused run no more than Hugging Face's (test_gemma_fused checks that against float64), so the two differ from
# each other by up to about twice that.
FP32_ATOL = {"gemma3": 3e-6, "gemma2": 3e-6}
# Gemma 2's attention logit cap in the tests: the tiny models' scores are about 0.03, so a cap of 0.02 bends them
# (Gemma 2's own 50 would leave tanh the identity here).
GEMMA2_SOFTCAP = 0.02



def _quiet(cfg):
    # Small vocabularies trip transformers' token-id sanity messages; they do not matter here.
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(cfg, name, None) is not None and getattr(cfg, name) >= VOCAB:
            setattr(cfg, name, None)
    return cfg


def make_model(family, dropout=0.0, layers=2, attn="sdpa", **overrides):
    """A small model with random weights; odd sizes on purpose."""
    if family in ("bert", "roberta"):
        kw = dict(hidden_size=H, num_attention_heads=3, intermediate_size=100, num_hidden_layers=layers,
                  vocab_size=VOCAB, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                  attn_implementation=attn)
        kw.update(overrides)
        if family == "bert":
            return BertModel(_quiet(BertConfig(**kw)), add_pooling_layer=False)
        kw.setdefault("max_position_embeddings", 80)
        return RobertaModel(_quiet(RobertaConfig(**kw)), add_pooling_layer=False)
    if family == "gpt2":
        kw = dict(n_embd=H, n_head=3, n_layer=layers, vocab_size=VOCAB, resid_pdrop=dropout, attn_pdrop=dropout,
                  embd_pdrop=0.0, attn_implementation=attn)
        kw.update(overrides)
        return GPT2Model(_quiet(GPT2Config(**kw)))
    if family in ("llama", "llama-gqa"):
        kv = 1 if family == "llama-gqa" else 3
        kw = dict(hidden_size=H, num_attention_heads=3, num_key_value_heads=kv, intermediate_size=100,
                  num_hidden_layers=layers, vocab_size=VOCAB, attention_dropout=dropout, attn_implementation=attn)
        kw.update(overrides)
        return LlamaModel(_quiet(LlamaConfig(**kw)))
    if family in RELATIVES:
        return _relative(family, dropout, layers, attn, overrides)
    raise ValueError(family)


FAMILIES = ["bert", "roberta", "gpt2", "llama", "llama-gqa"]
# Llama's relatives (fused on its machinery): Qwen2 (q/k/v biases), Mistral (a sliding window shorter than
# the test sequence), Qwen3 (per-head q/k RMSNorm, head_dim set apart from hidden / heads), Gemma (GeGLU with
# tanh GELU, RMSNorm scaled by 1 + weight, head_dim set apart), Gemma 3 (Gemma's, with Gemma-style per-head q/k
# norms, the sandwich norms, query_pre_attn_scalar; sliding layers with a window shorter than the test sequence --
# both layers sliding by default, so that groups of layers share their mask and rotary tables), Gemma 2 (Gemma 3's
# layer without q/k norms, with attention logit softcapping small enough to matter here; eager attention: the
# implementation that applies the cap). Their configs: grouped-query attention.
RELATIVES = ["qwen2", "mistral", "qwen3", "gemma", "gemma3", "gemma2"]
DECODERS = ("llama", "llama-gqa", *RELATIVES)


def _relative(family, dropout, layers, attn, overrides):
    import transformers
    cls = {"qwen2": "Qwen2", "mistral": "Mistral", "qwen3": "Qwen3", "gemma": "Gemma", "gemma3": "Gemma3Text",
           "gemma2": "Gemma2"}[family]
    if not hasattr(transformers, cls + "Model"):
        pytest.skip(f"transformers {transformers.__version__} has no {cls}Model")
    kw = dict(hidden_size=H, num_attention_heads=3, num_key_value_heads=1 if family == "qwen3" else 3,
              intermediate_size=100, num_hidden_layers=layers, vocab_size=VOCAB, attention_dropout=dropout,
              attn_implementation=attn)
    if family in ("qwen3", "gemma", "gemma3", "gemma2"):
        kw["head_dim"] = 16  # 3 x 16 != 72: head_dim apart from hidden / heads
    if family in ("mistral", "gemma3", "gemma2"):
        kw["sliding_window"] = 11  # < S: the window masks keys
    if family in ("gemma3", "gemma2"):
        kw["query_pre_attn_scalar"] = 20  # a scale other than head_dim ** -0.5
        kw.setdefault("layer_types", ["sliding_attention"] * layers)
    if family == "gemma2":
        kw["attn_logit_softcapping"] = GEMMA2_SOFTCAP
        kw["final_logit_softcapping"] = None
        kw["attn_implementation"] = "eager"
    kw.update(overrides)
    model = getattr(transformers, cls + "Model")(_quiet(getattr(transformers, cls + "Config")(**kw)))
    # Norm weights start at 1 (Gemma: 0, scaled by 1 + weight); random ones make a wrong scale visible.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


def hf_enable(model, **kwargs):
    """Hugging Face's checkpointing switch under either name: activation_checkpointing_enable (newer 5.x) or
    gradient_checkpointing_enable (5.0-5.17, the GPU image's), whose keyword is gradient_checkpointing_kwargs."""
    if hasattr(model, "activation_checkpointing_enable"):
        return model.activation_checkpointing_enable(**kwargs)
    renamed = {"activation_checkpointing_kwargs": "gradient_checkpointing_kwargs"}
    return model.gradient_checkpointing_enable(**{renamed.get(k, k): v for k, v in kwargs.items()})


def hf_disable(model):
    return getattr(model, "activation_checkpointing_disable", model.gradient_checkpointing_disable)()


def layers_of(model):
    for attr in ("encoder.layer", "h", "layers"):
        try:
            return model.get_submodule(attr)
        except AttributeError:
            pass
    raise AttributeError(type(model).__name__)


def inputs_for(family, padding, device="cpu", batch=B, seq=S):
    ids = torch.randint(3, VOCAB, (batch, seq), device=device)
    kw = {"input_ids": ids}
    if padding:
        mask = torch.ones(batch, seq, dtype=torch.long, device=device)
        mask[-1, seq - 7:] = 0  # right padding in the last sequence
        if batch > 1 and family != "bert":
            mask[0, :3] = 0  # left padding in the first (decoders)
        kw["attention_mask"] = mask
    if family.startswith(("gpt2", "llama")) or family in RELATIVES:
        kw["use_cache"] = False
    return kw


def embeds_call(model, family, kw):
    """Runs the model from inputs_embeds that require grad, so the stack's input gradient is observable."""
    emb = model.get_input_embeddings()(kw["input_ids"]).detach().requires_grad_()
    rest = {k: v for k, v in kw.items() if k != "input_ids"}
    return emb, model(inputs_embeds=emb, **rest).last_hidden_state


def close(actual, expected, scale=None, rtol=RTOL, atol=ATOL):
    scale = expected.abs().max().item() if scale is None else scale
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol * max(scale, 1e-30))


def grads_close(ref_model, fused_model, rtol=RTOL, atol=ATOL):
    ref = dict(ref_model.named_parameters())
    got = dict(fused_model.named_parameters())
    assert ref.keys() == got.keys()
    scale = max(p.grad.abs().max().item() for p in ref.values() if p.grad is not None)
    for name, p in ref.items():
        assert (p.grad is None) == (got[name].grad is None), name
        if p.grad is not None:
            try:
                close(got[name].grad, p.grad, scale=max(scale * 1e-2, p.grad.abs().max().item()), rtol=rtol,
                      atol=atol)
            except AssertionError as e:
                raise AssertionError(f"gradient of {name}: {e}") from None


def assert_training_parity(model, fused, family, kw):
    """Outputs, the stack's input gradient and every parameter's gradient of `fused` match `model`."""
    atol = FP32_ATOL.get(family, ATOL)
    e_ref, out_ref = embeds_call(model, family, kw)
    e_fus, out_fus = embeds_call(fused, family, kw)
    close(out_fus, out_ref, atol=atol)
    g = torch.randn_like(out_ref)
    out_ref.backward(g)
    out_fus.backward(g)
    close(e_fus.grad, e_ref.grad, atol=atol)
    grads_close(model, fused, atol=atol)


def fused_copy(model):
    return fuse(copy.deepcopy(model))


def skip_if_eager_differs_from_sdpa_on_padding(model, family, kw):
    """The fused layers compute fully masked query rows (left padding) as Hugging Face's SDPA path does. On
    releases whose eager attention computes those rows otherwise (transformers 5.0's GPT-2: its eager and
    SDPA paths disagree there by O(1)), an eager model cannot be matched row for row: skipped, saying so."""
    if getattr(model.config, "_attn_implementation", None) != "eager" or "attention_mask" not in kw:
        return
    if family == "gemma2":  # eager only (SDPA has no softcap); the fused layer writes its attention out as eager does
        return
    sdpa = copy.deepcopy(model)
    sdpa.config._attn_implementation = "sdpa"
    for m in sdpa.modules():
        if hasattr(m, "config"):
            m.config._attn_implementation = "sdpa"
    with torch.no_grad():
        a = model.eval()(**kw).last_hidden_state
        b = sdpa.eval()(**kw).last_hidden_state
    model.train()
    if not torch.allclose(a, b, rtol=1e-4, atol=1e-4):
        pytest.skip(f"transformers' own eager and SDPA {family} attention disagree on fully masked (padding) rows "
                    "in this release; the fused layer follows SDPA there (docs/known-differences.md)")


def lm_step(model, kw):
    """One fine-tuning step of a *ForCausalLM: the loss Hugging Face computes from labels (padding -100); returns the
    loss and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    labels = kw["input_ids"].masked_fill(kw["attention_mask"] == 0, -100)
    out = model(**kw, labels=labels, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
