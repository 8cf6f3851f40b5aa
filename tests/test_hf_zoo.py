"""Hugging Face's model zoo under ckpt_ext checkpointing: the common architectures (decoder LLMs, encoders,
encoder-decoders, a vision model), tiny random configs with their defaults otherwise (use_cache=True where
the model has a cache), a padding mask, dropout on. Every parameter's gradient and the stack input's
gradient must equal those of the same model trained without checkpointing (same seed: ckpt_ext replays the
dropout masks), through ``enable_checkpointing`` and through Hugging Face's own switch taken over
(``take_over_hf_checkpointing`` + ``activation_checkpointing_enable``), and Hugging Face's own checkpointing
is run as the control. Part of the tests run against several transformers releases (``make test-compat``)."""
import copy
import warnings

import pytest
import torch

import ckpt_ext

transformers = pytest.importorskip("transformers")
from helpers.hf_models import hf_enable, lm_step  # noqa: E402

H, HEADS, FF, LAYERS, VOCAB, B, S = 32, 4, 48, 2, 97, 2, 11

# model_type -> config keywords (each family names its sizes its own way)
ZOO = {
    "gpt2": dict(n_embd=H, n_head=HEADS, n_layer=LAYERS, n_inner=FF),
    "llama": dict(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=2, intermediate_size=FF,
                  num_hidden_layers=LAYERS),
    "mistral": dict(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=2, intermediate_size=FF,
                    num_hidden_layers=LAYERS),
    "qwen2": dict(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=2, intermediate_size=FF,
                  num_hidden_layers=LAYERS),
    "qwen3": dict(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=2, intermediate_size=FF,
                  num_hidden_layers=LAYERS, head_dim=8),
    "gemma": dict(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=2, intermediate_size=FF,
                  num_hidden_layers=LAYERS, head_dim=8),
    "opt": dict(hidden_size=H, num_attention_heads=HEADS, ffn_dim=FF, num_hidden_layers=LAYERS,
                word_embed_proj_dim=H, max_position_embeddings=64),
    "gpt_neox": dict(hidden_size=H, num_attention_heads=HEADS, intermediate_size=FF, num_hidden_layers=LAYERS),
    "falcon": dict(hidden_size=H, num_attention_heads=HEADS, num_hidden_layers=LAYERS),
    "bert": dict(hidden_size=H, num_attention_heads=HEADS, intermediate_size=FF, num_hidden_layers=LAYERS),
    "roberta": dict(hidden_size=H, num_attention_heads=HEADS, intermediate_size=FF, num_hidden_layers=LAYERS),
    "electra": dict(hidden_size=H, embedding_size=H, num_attention_heads=HEADS, intermediate_size=FF,
                    num_hidden_layers=LAYERS),
    "distilbert": dict(dim=H, n_heads=HEADS, hidden_dim=FF, n_layers=LAYERS),
    "deberta-v2": dict(hidden_size=H, num_attention_heads=HEADS, intermediate_size=FF, num_hidden_layers=LAYERS),
    "t5": dict(d_model=H, d_kv=8, num_heads=HEADS, d_ff=FF, num_layers=LAYERS, num_decoder_layers=LAYERS),
    "bart": dict(d_model=H, encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FF,
                 decoder_ffn_dim=FF, encoder_layers=LAYERS, decoder_layers=LAYERS, max_position_embeddings=64),
    "vit": dict(hidden_size=H, num_attention_heads=HEADS, intermediate_size=FF, num_hidden_layers=LAYERS,
                image_size=16, patch_size=4),
}
DROPOUT_KEYS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop", "attn_pdrop", "embd_pdrop",
                "attention_dropout", "hidden_dropout", "dropout", "dropout_rate", "activation_dropout",
                "seq_classif_dropout", "qa_dropout")
ENCODER_DECODER = ("t5", "bart")


def make(model_type: str, dropout: float):
    cfg = transformers.AutoConfig.for_model(model_type, vocab_size=VOCAB, **ZOO[model_type])
    for key in DROPOUT_KEYS:
        if isinstance(getattr(cfg, key, None), float):
            setattr(cfg, key, dropout)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        if getattr(cfg, key, None) is not None and getattr(cfg, key) >= VOCAB:
            setattr(cfg, key, 1)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModel.from_config(cfg)
    return model.train()


def inputs(model_type: str, model):
    g = torch.Generator().manual_seed(1)
    if model_type == "vit":
        return {"pixel_values": torch.randn(B, 3, 16, 16, generator=g)}
    ids = torch.randint(2, VOCAB, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[-1, S - 4:] = 0  # padding in the last sequence
    kw = {"input_ids": ids, "attention_mask": mask}
    if model_type in ENCODER_DECODER:
        kw["decoder_input_ids"] = torch.randint(2, VOCAB, (B, S - 3), generator=g)
    return kw


def step(model, model_type: str, kw, reference=False):
    """One training step from fixed inputs and seed; returns (output, {name: grad}). The reference runs
    without a KV cache (use_cache=False), as every checkpointing drops it in training: with a cache some
    models (T5) take another attention path, equal only to rounding. The checkpointed runs keep the
    config's default (use_cache=True), the case where a cache would be written twice."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    if reference and getattr(model.config, "use_cache", None) is not None:
        kw = dict(kw, use_cache=False)
    out = model(**kw)
    loss = out.last_hidden_state.float().pow(2).mean()
    if model_type in ENCODER_DECODER:
        loss = loss + out.encoder_last_hidden_state.float().pow(2).mean()
    loss.backward()
    return out.last_hidden_state.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                            if p.grad is not None}


def assert_same(got, ref, rtol=1e-5, atol=1e-7):
    (out_g, grads_g), (out_r, grads_r) = got, ref
    torch.testing.assert_close(out_g, out_r, rtol=rtol, atol=atol)
    assert grads_g.keys() == grads_r.keys()
    for name in grads_r:
        torch.testing.assert_close(grads_g[name], grads_r[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def _hf_switch(model):
    hf_enable(model, activation_checkpointing_kwargs={"use_reentrant": False})


def _take_over(model):
    ckpt_ext.take_over_hf_checkpointing(model)
    _hf_switch(model)


WAYS = {"enable_checkpointing": ckpt_ext.enable_checkpointing, "take_over": _take_over,
        "hugging_face": _hf_switch}


@pytest.mark.parametrize("model_type", list(ZOO))
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("way", list(WAYS))
def test_zoo_gradients_equal_no_checkpointing(model_type, dropout, way):
    if model_type not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    model = make(model_type, dropout)
    kw = inputs(model_type, model)
    ref = step(copy.deepcopy(model), model_type, kw, reference=True)
    WAYS[way](model)
    # Hugging Face's own checkpointing is the control, not ckpt_ext's claim: on T5 it differs from no
    # checkpointing by rounding (about 5e-7 in the output, dropout off), so it is held to rounding only.
    tol = dict(rtol=1e-4, atol=1e-5) if way == "hugging_face" else {}
    got = step(model, model_type, kw)
    assert_same(got, ref, **tol)
    got2 = step(model, model_type, kw)  # a second step: nothing left over from the first (caches, pending)
    assert_same(got2, ref, **tol)


def _alternating_model(dropout: float):
    """A Hugging Face model ckpt_ext has never seen and finds no uniform stack in: layers of two classes."""
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.modeling_layers import GradientCheckpointingLayer

    class AltConfig(PretrainedConfig):
        model_type = "ckpt_ext_alt"

    class Tanh(GradientCheckpointingLayer):
        def __init__(self):
            super().__init__()
            self.lin, self.drop = torch.nn.Linear(H, H), torch.nn.Dropout(dropout)
            self.calls = []  # ckpt_ext.is_recomputing() at each run of forward

        def forward(self, x, scale=None, **kwargs):
            self.calls.append(ckpt_ext.is_recomputing())
            return self.drop(self.lin(x).tanh()) * scale

    class Sin(Tanh):
        def forward(self, x, scale=None, **kwargs):
            self.calls.append(ckpt_ext.is_recomputing())
            return self.drop(self.lin(x).sin()) + scale

    class AltModel(PreTrainedModel):
        config_class = AltConfig
        supports_gradient_checkpointing = True

        def __init__(self, config):
            super().__init__(config)
            self.layers = torch.nn.ModuleList([Tanh(), Sin(), Tanh(), Sin()])

        def forward(self, x):
            scale = torch.full((1,), 0.5)
            for layer in self.layers:
                x = layer(x, scale=scale)
            return x

    torch.manual_seed(0)
    return AltModel(AltConfig()).train()


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_model_without_a_uniform_stack_rides_hugging_faces_mechanism(dropout):
    """No uniform stack: enable_checkpointing hands the placement to Hugging Face's _set_gradient_checkpointing
    with ckpt_ext's checkpoint; gradients equal no checkpointing's, and disable gives the model back."""
    from ckpt_ext.hf.trainer import rides_hf
    model = _alternating_model(dropout)
    ref_model = copy.deepcopy(model)
    x = torch.randn(B, S, H)

    def run(m):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        xi = x.clone().requires_grad_()
        m(xi).pow(2).sum().backward()
        return xi.grad, {n: p.grad for n, p in m.named_parameters()}

    ref = run(ref_model)
    ckpt_ext.enable_checkpointing(model)
    assert all(rides_hf(layer) for layer in model.layers)
    assert ckpt_ext.stack.is_enabled(model) and "Hugging Face's own checkpointing" in ckpt_ext.explain(model)
    model.layers[1].calls.clear()
    got = run(model)
    assert model.layers[1].calls == [False, True]  # the layer ran once more, in backward, as ckpt_ext's replay
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
    for name in ref[1]:
        torch.testing.assert_close(got[1][name], ref[1][name], rtol=0, atol=0)
    ckpt_ext.disable_checkpointing(model)
    assert not any(rides_hf(m) for m in model.modules()) and not ckpt_ext.stack.is_enabled(model)
    with pytest.raises(ValueError, match="no layer stack"):
        ckpt_ext.enable_checkpointing(model, every=2)  # grouping needs a stack ckpt_ext can see


# ---- fused decoders (ckpt_ext.fuse) across releases -------------------------------------------------------------

FUSED = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3_text", "gemma2")


def _has(model_type: str) -> bool:
    return model_type in transformers.models.auto.configuration_auto.CONFIG_MAPPING


def _causal_lm(model_type: str, dropout: float):
    sizes = ZOO["gemma"] if model_type in ("gemma2", "gemma3_text") else ZOO[model_type]
    if model_type in ("gemma3_text", "gemma2"):  # a window shorter than S on the sliding layer, a full one after it
        sizes = dict(sizes, sliding_window=5, layer_types=["sliding_attention", "full_attention"])
    # Gemma 2: eager attention, which applies its attention logit cap (5.0's SDPA, its default there, drops it)
    extra = {"attn_implementation": "eager"} if model_type == "gemma2" else {}
    cfg = transformers.AutoConfig.for_model(model_type, vocab_size=VOCAB, **sizes)
    for key in DROPOUT_KEYS:
        if isinstance(getattr(cfg, key, None), float):
            setattr(cfg, key, dropout)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(cfg, **extra)
    with torch.no_grad():  # norm weights start at 1 (Gemma: 0): random ones make a wrong scale visible
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model.train()


@pytest.mark.parametrize("model_type", FUSED)
def test_fused_causal_lm_with_labels_matches_and_checkpoints_exactly(model_type):
    """fuse() on the *ForCausalLM users fine-tune: the loss from labels and every parameter's gradient match
    Hugging Face's (float32), and fuse + enable_checkpointing equals fuse alone bit for bit, attention
    dropout on (a second model)."""
    if not _has(model_type):
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    from ckpt_ext import FusedTransformerLayer
    model = _causal_lm(model_type, 0.0)
    kw = inputs(model_type, model)
    kw["attention_mask"][0, :2] = 0  # left padding in the first sequence too
    ref = lm_step(copy.deepcopy(model), kw)
    fused = ckpt_ext.fuse(model)
    assert sum(isinstance(m, FusedTransformerLayer) for m in fused.modules()) == LAYERS
    got = lm_step(fused, kw)
    scale = max(g.abs().max().item() for g in ref[1].values())
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    assert got[1].keys() == ref[1].keys()
    for name in ref[1]:
        torch.testing.assert_close(got[1][name], ref[1][name], rtol=1e-5, atol=1e-6 * scale,
                                   msg=lambda m: f"{name}: {m}")
    dropped = ckpt_ext.fuse(_causal_lm(model_type, 0.2))
    plain = lm_step(dropped, kw)
    # (Gemma 2's and 3's sliding and full layers get their own masks and rotary tables: checkpointed one at a time)
    ckpt_ext.enable_checkpointing(dropped, every=1 if model_type in ("gemma3_text", "gemma2") else 2)
    ck = lm_step(dropped, kw)
    assert torch.equal(ck[0], plain[0])
    for name in plain[1]:
        assert torch.equal(ck[1][name], plain[1][name]), name
