"""Gemma 3 and Gemma 2 under ckpt_ext.fuse, beyond what the family lists of the shared tests cover (test_fused_parity,
test_fused_dropout, test_fused_segment, test_keep_*_fused, test_lora_fused, test_compile, test_hf_zoo run Gemma 3
as Llama's relatives): the float32 error of the fused layers against a float64 run (no worse than Hugging
Face's own), layers of both types (sliding and full attention: their own masks and their own rotary tables, local
and global) checkpointed one at a time exactly and refused as a group, EmbeddingGemma's bidirectional attention
left to Hugging Face, the causal LM with labels (final logit softcapping included) and the multimodal model's text
layers; Gemma 2's attention logit softcapping (it matters in these configs; keep="attention" replays such layers'
attention in full and says why; an implementation that does not apply the cap is left to Hugging Face) and its
causal LM."""
import copy
import warnings

import pytest
import torch

import ckpt_ext
from ckpt_ext import FusedTransformerLayer

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Gemma3TextModel"):
    pytest.skip(f"transformers {transformers.__version__} has no Gemma 3", allow_module_level=True)
from helpers.fused import _seed  # noqa: E402,F401  (autouse seed)
from helpers.hf_models import (assert_training_parity, embeds_call, fused_copy, inputs_for, layers_of,  # noqa: E402
                               lm_step, make_model, skip_if_eager_differs_from_sdpa_on_padding)

MIXED = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def _errors(model, kw, dtype, family="gemma3"):
    """(output, {name: gradient}) of `model` in `dtype` from fixed inputs and cotangent, as float64."""
    model = model.to(dtype)
    e, out = embeds_call(model, family, kw)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(dtype)
    out.backward(g)
    return out.detach().double(), {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family,layer_types", [("gemma3", None), ("gemma3", MIXED), ("gemma2", MIXED)],
                         ids=["gemma3-sliding", "gemma3-mixed", "gemma2-mixed"])
def test_float32_error_against_float64_is_hugging_faces(family, layer_types):
    """The fused float32 layers are as close to a float64 run of Hugging Face's model as Hugging Face's float32 run
    is (at most 2x its error, per output and per gradient, as the autocast tests bound theirs). Gemma 2/3's q/k and
    sandwich norms amplify rounding: the shared parity tests compare the two float32 runs with a looser atol for these
    families (hf_models.FP32_ATOL); this is the check that the looser bound hides no error of the fused layers."""
    over = {} if layer_types is None else {"layer_types": layer_types}
    model = make_model(family, layers=len(layer_types or [0, 0]), **over).train()
    # (Gemma 2 runs eager attention, whose float64 run gives NaN on fully masked rows -- left padding: no padding)
    kw = inputs_for(family, padding=family != "gemma2")
    ref = _errors(copy.deepcopy(model), kw, torch.float64, family)
    hf = _errors(copy.deepcopy(model), kw, torch.float32, family)
    fused = _errors(fused_copy(model), kw, torch.float32, family)
    scale_out = ref[0].abs().max().item()
    assert (fused[0] - ref[0]).abs().max() <= 2 * (hf[0] - ref[0]).abs().max() + 1e-7 * scale_out
    assert fused[1].keys() == ref[1].keys()
    for name, g in ref[1].items():
        err_hf = (hf[1][name] - g).abs().max().item()
        err_fused = (fused[1][name] - g).abs().max().item()
        # + 1e-6 of the scale: the norm weights' gradients (a reduction over batch x sequence, x heads for q/k_norm)
        # are summed by the norm op's kernel, about 2e-6 of the scale from float64 where torch's sum is about 1e-6
        assert err_fused <= 2 * err_hf + 1e-6 * g.abs().max().item(), (name, err_fused, err_hf)


def _layer_kwargs(model, kw):
    """The keyword arguments each decoder layer receives in one forward (recorded by pre-hooks)."""
    seen = []
    hooks = [layer.register_forward_pre_hook(lambda m, a, k: seen.append(k), with_kwargs=True)
             for layer in layers_of(model)]
    try:
        with torch.no_grad():
            model(**kw)
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["nodrop", "dropout"])
def test_sliding_and_full_layers_use_their_own_masks_and_tables(attn, dropout):
    """Sliding (window 11 < S) and full layers: each fused layer applies the mask and the rotary tables (local base,
    global base) its model passes it -- float32 parity with Hugging Face (padding); checkpointed one layer at a time
    bit-identical to the fused model (dropout on and off); a group of layers (every=2) refused, naming the
    arguments that differ."""
    model = make_model("gemma3", layers=4, attn=attn, layer_types=MIXED, dropout=dropout).train()
    kw = inputs_for("gemma3", padding=True)
    skip_if_eager_differs_from_sdpa_on_padding(model, "gemma3", kw)
    seen = _layer_kwargs(model, kw)
    assert seen[0]["position_embeddings"] is not seen[1]["position_embeddings"]
    assert not torch.equal(seen[0]["position_embeddings"][0], seen[1]["position_embeddings"][0])  # local vs global
    assert seen[0]["position_embeddings"] is seen[2]["position_embeddings"]
    fused = fused_copy(model)
    if dropout == 0.0:
        assert_training_parity(model, fused, "gemma3", kw)
    ck = ckpt_ext.enable_checkpointing(copy.deepcopy(fused), every=1)
    outs = []
    for m in (fused, ck):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(4)
        e, out = embeds_call(m, "gemma3", kw)
        out.backward(torch.ones_like(out))
        outs.append((out.detach(), e.grad, {n: p.grad for n, p in m.named_parameters()}))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert sum(g is not None for g in outs[0][2].values()) > 0
    for name, g in outs[0][2].items():
        other = outs[1][2][name]
        assert (g is None) == (other is None) and (g is None or torch.equal(g, other)), name
    grouped = ckpt_ext.enable_checkpointing(copy.deepcopy(fused), every=2)
    with pytest.raises(RuntimeError, match=r"layer 1 \(FusedTransformerLayer\) receives different arguments than "
                                           r"layer 0 \(.*position_embeddings"):
        grouped(**kw)


def test_group_with_the_same_mask_but_other_rotary_tables_is_refused():
    """Without padding and with a window longer than the sequence, SDPA's sliding and full layers get the same
    mask argument (none: causal); only their rotary tables differ. A group must still be refused: run with the
    first layer's tables, the full layer would silently use the local rotary base."""
    model = make_model("gemma3", layers=2, layer_types=MIXED[:2], sliding_window=64).train()
    kw = inputs_for("gemma3", padding=False)
    seen = _layer_kwargs(model, kw)
    assert seen[0].get("attention_mask") is seen[1].get("attention_mask")
    assert not torch.equal(seen[0]["position_embeddings"][0], seen[1]["position_embeddings"][0])
    fused = fused_copy(model)
    assert_training_parity(model, fused, "gemma3", kw)
    grouped = ckpt_ext.enable_checkpointing(copy.deepcopy(fused), every=2)
    with pytest.raises(RuntimeError, match=r"receives different arguments than layer 0 \(position_embeddings\)"):
        grouped(**kw)


def test_bidirectional_attention_is_left_to_hugging_face():
    """EmbeddingGemma (use_bidirectional_attention=True): non-causal attention, which the fused layer does not
    compute; fuse() warns, naming it, and leaves the layers to Hugging Face (here: no layer left to fuse)."""
    model = make_model("gemma3", layers=2, use_bidirectional_attention=True)
    with pytest.warns(UserWarning, match="use_bidirectional_attention"):
        with pytest.raises(ValueError, match="could be fused"):
            ckpt_ext.fuse(model)


def test_conditional_generation_fuses_its_text_layers():
    """Gemma3ForConditionalGeneration: the text model's Gemma3DecoderLayers are fused, the vision tower (SigLIP)
    stays Hugging Face's; the loss from labels (text-only batch) and every gradient match the unfused model. Its
    head is fused where its forward computes the loss through loss_function (head_refusal otherwise)."""
    if not hasattr(transformers, "Gemma3ForConditionalGeneration"):
        pytest.skip("no Gemma3ForConditionalGeneration")
    text = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                num_hidden_layers=2, head_dim=8, vocab_size=300, sliding_window=5, layer_types=MIXED[:2])
    vision = dict(hidden_size=16, num_attention_heads=2, intermediate_size=24, num_hidden_layers=1, image_size=28,
                  patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=299, boi_token_index=297, eoi_token_index=298)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).train()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt_ext.fuse(model)
    text_layers = [m for m in model.modules() if isinstance(m, FusedTransformerLayer)]
    assert len(text_layers) == 2
    assert any(type(m).__name__ == "SiglipEncoderLayer" for m in model.modules())
    ids = torch.randint(2, 290, (2, 11), generator=torch.Generator().manual_seed(1))
    # token_type_ids: 0 for text (transformers 5.0 requires them in training)
    kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids),
          "use_cache": False}
    losses = []
    for m in (ref, model):
        torch.manual_seed(0)
        out = m(**kw, labels=ids)
        out.loss.backward()
        losses.append(out.loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    got = dict(model.named_parameters())
    scale = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
    for name, p in ref.named_parameters():
        assert (p.grad is None) == (got[name].grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(got[name].grad, p.grad, rtol=1e-5, atol=3e-6 * scale,
                                       msg=lambda m: f"{name}: {m}")


def test_head_with_an_inline_loss_is_not_fused():
    """A causal LM whose forward computes its loss itself (transformers 5.0's Gemma3ForConditionalGeneration does)
    keeps Hugging Face's head: handed the hidden states in place of the logits, its loss would be wrong."""
    from ckpt_ext.hf.head import head_refusal

    class InlineLoss(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            logits = self.lm_head(self.model(input_ids=input_ids, **kwargs).last_hidden_state)
            return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

    cfg = transformers.LlamaConfig(hidden_size=16, num_attention_heads=2, intermediate_size=24, num_hidden_layers=1,
                                   vocab_size=50)
    model = InlineLoss(cfg)
    assert "without its loss_function" in head_refusal(model)
    assert head_refusal(transformers.LlamaForCausalLM(cfg)) is None


@pytest.mark.parametrize("bare", [False, True], ids=["output", "bare-loss"])
def test_inline_loss_the_source_check_misses_is_refused_at_the_step(bare):
    """A forward whose source names loss_function but computes its loss inline passes head_refusal; in a fused
    training call its loss would come from the hidden states (the fused head's output): the step raises instead of
    returning it. Eval (the head's logits) and skip_logits=False are unaffected."""
    from ckpt_ext.hf.head import fuse_lm_head
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class NamedButInline(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            logits = self.lm_head(self.model(input_ids=input_ids, **kwargs).last_hidden_state)
            loss = None
            if labels is not None:  # computed here, not by self.loss_function
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
            return loss if bare else CausalLMOutputWithPast(loss=loss, logits=logits)

    cfg = transformers.LlamaConfig(hidden_size=16, num_attention_heads=2, intermediate_size=24, num_hidden_layers=1,
                                   vocab_size=50)
    model = NamedButInline(cfg).train()
    assert fuse_lm_head(model)
    ids = torch.randint(0, 16, (2, 7), generator=torch.Generator().manual_seed(0))  # < hidden: CE on hidden states runs
    with pytest.raises(RuntimeError, match="without its loss_function"):
        model(input_ids=ids, labels=ids)
    assert model(input_ids=ids, labels=ids, skip_logits=False) is not None  # Hugging Face's head: fine
    model.eval()
    assert model(input_ids=ids, labels=ids) is not None


# ---- Gemma 2 ------------------------------------------------------------------------------------------------------

def test_gemma2_softcap_matters_and_is_applied():
    """The tests' cap bends the scores (Hugging Face's output with and without it differ by far more than the
    tolerance), and the fused layers follow the capped model (float32, padding, sliding and full layers)."""
    from helpers.hf_models import GEMMA2_SOFTCAP
    model = make_model("gemma2", layers=2, layer_types=MIXED[:2]).train()
    assert model.config.attn_logit_softcapping == GEMMA2_SOFTCAP
    kw = inputs_for("gemma2", padding=True)
    uncapped = copy.deepcopy(model)
    for m in uncapped.modules():
        if hasattr(m, "attn_logit_softcapping"):
            m.attn_logit_softcapping = None
    with torch.no_grad():
        a = model(**kw).last_hidden_state
        b = uncapped(**kw).last_hidden_state
    assert (a - b).abs().max() > 1e-2 * a.abs().max()
    fused = fused_copy(model)
    assert all(layer.spec.attn_softcap == GEMMA2_SOFTCAP for layer in layers_of(fused))
    assert_training_parity(model, fused, "gemma2", kw)


def test_gemma2_keep_attention_replays_softcapped_attention_and_says_why():
    """keep="attention": a softcapped attention has no log-sum-exp to keep (no SDPA kernel computes it); the layers
    are replayed in full, with a warning naming the reason, and the step equals the unchecked fused model's."""
    model = ckpt_ext.fuse(make_model("gemma2", layers=2).train())
    kw = inputs_for("gemma2", padding=True)
    ck = ckpt_ext.enable_checkpointing(copy.deepcopy(model), keep="attention")
    runs = []
    for m in (model, ck):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = m(**kw).last_hidden_state
        out.pow(2).mean().backward()
        runs.append((out.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}, caught))
    assert any("softcapping" in str(w.message) for w in runs[1][2]), [str(w.message) for w in runs[1][2]]
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[0][1].keys() == runs[1][1].keys()
    for name, g in runs[0][1].items():
        assert torch.equal(g, runs[1][1][name]), name


def test_gemma2_softcap_under_an_implementation_without_it_is_left_to_hugging_face():
    """An attention implementation that does not apply the cap (transformers 5.0's SDPA drops it): the fused layer,
    which applies it, would differ from the model it replaces, so the layer is not fused, saying why."""
    from ckpt_ext.hf.layers import Unsupported, layer_spec
    from ckpt_ext._layout import GEMMA2
    layer = layers_of(make_model("gemma2", layers=1))[0]
    layer.self_attn.config._attn_implementation = "sdpa"
    with pytest.raises(Unsupported, match="attn_logit_softcapping"):
        layer_spec(layer, GEMMA2)


def _causal_lm(family, dropout=0.0, **over):
    """A tiny Gemma3ForCausalLM / Gemma2ForCausalLM (attention logit softcapping, eager attention) of one sliding and
    one full layer, its norm weights made random."""
    sizes = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                 num_hidden_layers=2, head_dim=8, vocab_size=97, sliding_window=5, query_pre_attn_scalar=12,
                 attention_dropout=dropout, pad_token_id=0, bos_token_id=1, eos_token_id=1, layer_types=MIXED[:2])
    if family == "gemma2":
        cfg = transformers.Gemma2Config(**sizes, attn_logit_softcapping=0.05, attn_implementation="eager", **over)
        model_class = transformers.Gemma2ForCausalLM
    else:
        cfg, model_class = transformers.Gemma3TextConfig(**sizes, **over), transformers.Gemma3ForCausalLM
    torch.manual_seed(0)
    model = model_class(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model.train()


@pytest.mark.parametrize("softcap", [None, 0.1], ids=["nocap", "finalcap"])
@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_causal_lm_with_labels_and_final_logit_softcapping(family, softcap):
    """Gemma3ForCausalLM / Gemma2ForCausalLM with labels: the fused layers (Gemma 2's attention softcapping included)
    and the fused head + loss (the final logit softcapping applied inside the chunked loss, forward and gradient)
    match Hugging Face's loss and every gradient (float32); with attention dropout, checkpointed one layer at a time
    equals the fused model bit for bit."""
    model = _causal_lm(family, final_logit_softcapping=softcap)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 97, (2, 13), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    mask[1, -3:] = 0
    kw = {"input_ids": ids, "attention_mask": mask}
    ref = lm_step(copy.deepcopy(model), kw)
    fused = ckpt_ext.fuse(model)
    assert sum(isinstance(m, FusedTransformerLayer) for m in fused.modules()) == 2
    assert type(fused.lm_head).__name__ == "FusedLMHead"
    got = lm_step(fused, kw)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    scale = max(v.abs().max().item() for v in ref[1].values())
    assert got[1].keys() == ref[1].keys()
    for name in ref[1]:
        torch.testing.assert_close(got[1][name], ref[1][name], rtol=1e-5, atol=3e-6 * scale,
                                   msg=lambda m: f"{name}: {m}")
    if softcap is not None:  # the cap matters here: without it the loss differs
        nocap = copy.deepcopy(model)
        nocap.config.final_logit_softcapping = None
        assert not torch.allclose(lm_step(nocap, kw)[0], ref[0], rtol=1e-3)
    dropped = ckpt_ext.fuse(_causal_lm(family, 0.2, final_logit_softcapping=softcap))
    plain = lm_step(dropped, kw)
    ckpt_ext.enable_checkpointing(dropped, every=1)
    ck = lm_step(dropped, kw)
    assert torch.equal(ck[0], plain[0])
    for name in plain[1]:
        assert torch.equal(ck[1][name], plain[1][name]), name
