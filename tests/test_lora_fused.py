"""peft LoRA through ckpt_ext.fuse() (issue 15 item 2): the fused layers compute the adapter terms.

* Parity with peft's unfused model (fp32, lora_dropout 0 and 1e-9 -- the dropout path with a mask that
  keeps everything): outputs and the gradient of every adapter weight, rtol 1e-5; base weights get none.
* lora_dropout > 0 (masks differ from peft's by design): fused vs fused + enable_checkpointing are
  bit-identical (the replay draws the same masks), the masks change with the seed, and the mean output
  over many seeds approaches the no-dropout output (dropout rate and 1/(1-p) scaling).
* Merged adapters, disabled adapters, adapters added after fuse (handled), unsupported adapters (DoRA,
  lora_bias, an adapter on the embeddings, several active adapters: refused at fuse or at the call).
* CPU bfloat16 autocast vs peft under autocast, both against the fp32 reference; a bfloat16 model with
  peft's float32 adapters (autocast_adapter_dtype) vs peft.
* q/k/v adapters without adapter dropout (lora_dropout 0, or not training) share their first GEMM: the
  parity tests above run that path; the number of matrix products shows it is taken.
"""
import copy

import pytest
import torch

import ckpt_ext
from ckpt_ext.fused import FusedTransformerLayer

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

H, VOCAB, B, S = 48, 97, 2, 11
from helpers.devices import DEVICES  # noqa: E402  (cuda: marked `cuda`, skipped without a GPU)
TARGETS = {
    "bert": ["query", "key", "value", "dense"],  # dense: attention.output, intermediate, output
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
FAMILIES = list(TARGETS)
# Llama's relatives (same projections): in the parity and replay tests.
RELATIVES = ["qwen2", "mistral", "qwen3", "gemma", "gemma3", "gemma2"]
for _name in RELATIVES:
    TARGETS[_name] = TARGETS["llama"]


def make_model(family, dropout=0.0, layers=2):
    """A tiny model with random weights (sdpa attention)."""
    t = transformers
    if family == "bert":
        cfg = t.BertConfig(hidden_size=H, num_attention_heads=3, intermediate_size=100, num_hidden_layers=layers,
                           vocab_size=VOCAB, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                           attn_implementation="sdpa")
        return t.BertModel(cfg, add_pooling_layer=False)
    if family == "gpt2":
        cfg = t.GPT2Config(n_embd=H, n_head=3, n_layer=layers, vocab_size=VOCAB, resid_pdrop=dropout,
                           attn_pdrop=dropout, embd_pdrop=0.0, attn_implementation="sdpa", use_cache=False)
        return t.GPT2Model(cfg)
    name = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral", "qwen3": "Qwen3", "gemma": "Gemma",
            "gemma3": "Gemma3Text", "gemma2": "Gemma2"}[family]
    if not hasattr(t, name + "Model"):
        pytest.skip(f"transformers {t.__version__} has no {name}Model")
    extra = {"head_dim": 8} if family in ("qwen3", "gemma") else {"sliding_window": 5} if family == "mistral" else {}
    if family == "gemma3":  # sliding layers (one mask and rotary table for all: groups of layers) shorter than S
        extra = {"head_dim": 8, "sliding_window": 5, "query_pre_attn_scalar": 12,
                 "layer_types": ["sliding_attention"] * layers}
    if family == "gemma2":  # (eager: the implementation that applies the attention logit cap)
        extra = {"head_dim": 8, "sliding_window": 5, "query_pre_attn_scalar": 12, "attn_logit_softcapping": 0.02,
                 "layer_types": ["sliding_attention"] * layers}
    cfg = getattr(t, name + "Config")(hidden_size=H, num_attention_heads=3, num_key_value_heads=1,
                                      intermediate_size=100, num_hidden_layers=layers, vocab_size=VOCAB,
                                      attention_dropout=dropout, use_cache=False,
                                      attn_implementation="eager" if family == "gemma2" else "sdpa", **extra)
    return getattr(t, name + "Model")(cfg)


def lora_config(family, lora_dropout=0.0, **kw):
    kw.setdefault("r", 4)
    kw.setdefault("lora_alpha", 8)
    kw.setdefault("target_modules", TARGETS[family])
    return peft.LoraConfig(lora_dropout=lora_dropout,
                           fan_in_fan_out=family == "gpt2", **kw)


def randomise_adapters(model, seed=0):
    """peft initialises B to zero; non-zero B makes every adapter gradient informative."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def peft_model(family, lora_dropout=0.0, dropout=0.0, seed=0, layers=2, **kw):
    torch.manual_seed(seed)
    model = peft.get_peft_model(make_model(family, dropout, layers), lora_config(family, lora_dropout, **kw))
    randomise_adapters(model, seed)
    return model.train()


def fused_layers(model):
    return [m for m in model.modules() if isinstance(m, FusedTransformerLayer)]


def inputs(device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(3, VOCAB, (B, S), generator=g).to(device)}


def step(model, batch, seed=0):
    """Forward + backward of a fixed projection of the output; (output, {name: grad} of trainable params)."""
    torch.manual_seed(seed)
    out = model(**batch).last_hidden_state
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.device, out.dtype)
    (out * w).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


def assert_close_step(a, b, rtol=1e-5, atol=1e-5):
    """rtol, and atol relative to the tensor's largest value (GEMMs fused differently round differently)."""
    torch.testing.assert_close(a[0], b[0], rtol=rtol, atol=atol * b[0].abs().max().item())
    assert a[1].keys() == b[1].keys()
    for n in a[1]:
        torch.testing.assert_close(a[1][n], b[1][n], rtol=rtol, atol=atol * b[1][n].abs().max().item(),
                                   msg=lambda m: f"{n}: {m}")


def assert_identical(a, b):
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for n in a[1]:
        assert torch.equal(a[1][n], b[1][n]), n


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lora_dropout", [0.0, 1e-9])
@pytest.mark.parametrize("family", FAMILIES + RELATIVES)
def test_parity_with_peft(family, lora_dropout, device):
    ref = peft_model(family, lora_dropout).to(device)
    fused = ckpt_ext.fuse(copy.deepcopy(ref))
    assert len(fused_layers(fused)) == 2
    batch = inputs(device)
    r, f = step(ref, batch), step(fused, batch)
    assert f[1] and all("lora_" in n for n in f[1])  # only adapter weights are trainable
    for n, p in fused.named_parameters():
        assert (p.grad is None) and (("lora_" in n) == p.requires_grad), n
    assert_close_step(f, r, atol=3e-5 if family in ("gemma3", "gemma2") else 1e-5)  # (hf_models.FP32_ATOL: Gemma 3's norms)


@pytest.mark.parametrize("family", FAMILIES)
def test_rslora_and_ranks_per_module(family):
    ref = peft_model(family, use_rslora=True, rank_pattern={TARGETS[family][0]: 2}, alpha_pattern={})
    fused = ckpt_ext.fuse(copy.deepcopy(ref))
    batch = inputs()
    assert_close_step(step(fused, batch), step(ref, batch))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lora_dropout", [0.0, 0.2])
@pytest.mark.parametrize("family", FAMILIES + RELATIVES)
def test_dropout_checkpointing_replays_bit_identical(family, lora_dropout, device):
    base = peft_model(family, lora_dropout=lora_dropout, dropout=0.1).to(device)
    fused = ckpt_ext.fuse(copy.deepcopy(base))
    ck = ckpt_ext.enable_checkpointing(ckpt_ext.fuse(copy.deepcopy(base)), every=2)
    batch = inputs(device)
    a, b = step(fused, batch, seed=3), step(ck, batch, seed=3)
    assert_identical(a, b)
    assert not torch.equal(a[0], step(fused, batch, seed=4)[0])  # the masks follow the seed


def test_lora_dropout_rate_and_scaling():
    """The mean over seeds of the fused output with lora_dropout 0.5 (no other dropout, one layer, one
    adapter on its last projection, no final norm: the output is linear in the dropped input) tends to
    the no-dropout output."""
    ref = peft_model("llama", lora_dropout=0.5, layers=1, target_modules=["down_proj"])
    ref.base_model.model.norm = torch.nn.Identity()
    fused = ckpt_ext.fuse(copy.deepcopy(ref))
    batch = inputs()
    with torch.no_grad():
        fused.eval()
        clean = fused(**batch).last_hidden_state
        assert torch.allclose(clean, ref.eval()(**batch).last_hidden_state, rtol=1e-5, atol=1e-6)
        fused.train()
        runs = []
        for seed in range(400):
            torch.manual_seed(seed)
            runs.append(fused(**batch).last_hidden_state - clean)
    runs = torch.stack(runs)
    assert runs.abs().amax() > 1e-3  # dropout is active
    # Per element, the mean's error over 400 draws is ~std/20; 6 sigma, over all elements at once.
    err = (runs.mean(0).abs() / (runs.std(0) / 20 + 1e-6)).amax()
    assert err < 6, err


def embeds_step(model, batch):
    """Output and input-embedding gradient (merged adapters leave no trainable parameter in use)."""
    emb = model.get_input_embeddings()(batch["input_ids"]).detach().requires_grad_()
    out = model(inputs_embeds=emb).last_hidden_state
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(5))).sum().backward()
    return out.detach(), {"inputs_embeds": emb.grad}


@pytest.mark.parametrize("family", FAMILIES)
def test_merged_adapters(family):
    ref = peft_model(family)
    batch = inputs()
    unmerged = embeds_step(ref, batch)
    ref.merge_adapter()
    fused = ckpt_ext.fuse(copy.deepcopy(ref))
    assert all(len(m._call_args()[1]) == len(m.fused_weights()) for m in fused_layers(fused))  # no adapter slots
    merged_ref, merged_fused = embeds_step(ref, batch), embeds_step(fused, batch)
    assert_close_step(merged_fused, merged_ref)
    assert_close_step(merged_fused, unmerged, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_disabled_and_unmerged_later_are_followed(family):
    ref = peft_model(family)
    fused = ckpt_ext.fuse(copy.deepcopy(ref))
    batch = inputs()
    with ref.disable_adapter(), fused.disable_adapter():
        torch.testing.assert_close(fused(**batch).last_hidden_state, ref(**batch).last_hidden_state,
                                   rtol=1e-5, atol=1e-6)
    ref.merge_adapter()
    fused.merge_adapter()
    ref.unmerge_adapter()
    fused.unmerge_adapter()
    assert_close_step(step(fused, batch), step(ref, batch), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_adapters_added_after_fuse_are_computed(family):
    torch.manual_seed(0)
    model = make_model(family).train()
    fused = ckpt_ext.fuse(copy.deepcopy(model))
    ref = peft.get_peft_model(model, lora_config(family))
    fused = peft.get_peft_model(fused, lora_config(family))
    randomise_adapters(ref)
    randomise_adapters(fused)
    batch = inputs()
    assert_close_step(step(fused, batch), step(ref, batch))
    assert fused_layers(fused) and all(m._has_lora for m in fused_layers(fused))


def test_unsupported_adapters_are_refused_at_fuse():
    torch.manual_seed(0)
    dora = peft.get_peft_model(make_model("llama"), lora_config("llama", use_dora=True))
    with pytest.raises(ValueError, match="DoRA"):
        ckpt_ext.fuse(dora)
    biased = peft.get_peft_model(make_model("bert"), lora_config("bert", lora_bias=True))
    with pytest.raises(ValueError, match="lora_bias"):
        ckpt_ext.fuse(biased)
    ia3 = peft.get_peft_model(make_model("llama"), peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                                                                  feedforward_modules=["down_proj"]))
    with pytest.raises(ValueError, match="not a supported peft adapter"):
        ckpt_ext.fuse(ia3)


def test_adapter_on_another_module_is_refused():
    torch.manual_seed(0)
    model = make_model("llama")
    for layer in model.layers:  # a Linear the layer's forward does not use, but LoRA can target
        layer.self_attn.extra = torch.nn.Linear(H, H)
    model = peft.get_peft_model(model, peft.LoraConfig(target_modules=["q_proj", "extra"]))
    with pytest.raises(ValueError, match="no adapter slot for"):
        ckpt_ext.fuse(model)


def test_several_active_adapters_are_refused():
    model = peft_model("gpt2")
    model.add_adapter("second", lora_config("gpt2"))
    model.base_model.set_adapter(["default", "second"])
    with pytest.raises(ValueError, match="2 active LoRA adapters"):
        ckpt_ext.fuse(model)


def test_dora_added_after_fuse_is_refused_at_the_call():
    torch.manual_seed(0)
    fused = ckpt_ext.fuse(make_model("llama"))
    fused = peft.get_peft_model(fused, lora_config("llama", use_dora=True))
    with pytest.raises(RuntimeError, match="DoRA"):
        fused(**inputs())


def test_variant_switched_after_fuse_is_refused_at_the_call():
    fused = ckpt_ext.fuse(peft_model("bert"))
    fused.add_adapter("dora", lora_config("bert", use_dora=True))
    fused.set_adapter("dora")
    with pytest.raises(RuntimeError, match="DoRA"):
        fused(**inputs())


@pytest.mark.parametrize("family", FAMILIES)
def test_cpu_bf16_autocast(family):
    ref = peft_model(family)
    fused = ckpt_ext.fuse(copy.deepcopy(ref))
    batch = inputs()
    exact = step(ref, batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = step(ref, batch)
        f = step(fused, batch)
    assert_no_worse_than_peft(f, r, exact)


def assert_no_worse_than_peft(f, r, exact):
    """Low precision: the fused step's error against the float32 reference is at most a small multiple
    of peft's own (output and every gradient)."""
    err_ref = (r[0].float() - exact[0]).abs().max().item()
    err_fused = (f[0].float() - exact[0]).abs().max().item()
    assert err_fused <= 3 * err_ref + 1e-3, (err_fused, err_ref)
    for n in exact[1]:
        gr = (r[1][n].float() - exact[1][n]).abs().max().item()
        gf = (f[1][n].float() - exact[1][n]).abs().max().item()
        scale = exact[1][n].abs().max().item()
        assert gf <= 3 * gr + 1e-2 * scale, (n, gf, gr)


class _CountMatmuls(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)
        return func(*args, **(kwargs or {}))


def _forward_matmuls(model, batch):
    with torch.no_grad(), _CountMatmuls() as count:
        model(**batch)
    return count.n


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_qkv_adapters_share_their_first_gemm(family):
    """All of q, k, v adapted and no adapter dropout in the call: x [A_q; A_k; A_v]^T and one GEMM against
    the block-diagonal B (2 products) instead of 2 per adapter (6), per layer. Adapter dropout in training,
    or one of the three without adapter, takes the per-adapter path."""
    batch = inputs()
    torch.manual_seed(0)
    base = _forward_matmuls(ckpt_ext.fuse(make_model(family).train()), batch)
    others = len(TARGETS[family]) - 3 if family == "llama" else 3  # bert's "dense" is three projections
    shared = _forward_matmuls(ckpt_ext.fuse(peft_model(family)), batch)
    assert shared == base + 2 * (2 + 2 * others)
    dropped = ckpt_ext.fuse(peft_model(family, lora_dropout=0.1))
    assert _forward_matmuls(dropped, batch) == base + 2 * (6 + 2 * others)
    assert _forward_matmuls(dropped.eval(), batch) == shared  # dropout is the identity outside training
    two = ckpt_ext.fuse(peft_model(family, target_modules=TARGETS[family][:2]))
    assert _forward_matmuls(two, batch) == base + 2 * 4


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_eval_with_adapter_dropout_matches_peft(family):
    """lora_dropout > 0 outside training takes the shared q/k/v path: parity with peft, gradients included."""
    ref = peft_model(family, lora_dropout=0.3).eval()
    fused = ckpt_ext.fuse(copy.deepcopy(ref))
    batch = inputs()
    assert_close_step(step(fused, batch), step(ref, batch))


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_model_with_float32_adapters(family):
    """peft keeps float32 adapters on a bfloat16 model and computes their terms in float32: the fused layer
    does as well (it used to refuse the float32 adapter weights)."""
    torch.manual_seed(0)
    ref = peft.get_peft_model(make_model(family).to(torch.bfloat16), lora_config(family)).train()
    randomise_adapters(ref)
    assert {p.dtype for n, p in ref.named_parameters() if "lora_" in n} == {torch.float32}
    fused = ckpt_ext.fuse(copy.deepcopy(ref))
    batch = inputs()
    exact = step(copy.deepcopy(ref).float(), batch)  # the same values in float32
    r, f = step(ref, batch), step(fused, batch)
    assert f[0].dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in f[1].values())
    assert_no_worse_than_peft(f, r, exact)
