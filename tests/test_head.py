"""The LM head and its loss as one chunked operation (ckpt_ext/head.py, ckpt_ext/hf/head.py) against Hugging
Face's lm_head + ForCausalLMLoss: the loss and every gradient, fp32 and autocast, both orders (gradients in
forward, recomputed in backward), soft cap, bias, ignore_index, num_items_in_batch, shift_labels, bad labels,
no trained token; memory (nothing of B x S x V saved for backward, one chunk of logits at a time); fused
models end to end (tied and untied, checkpointed, compiled, peft LoRA, gradient accumulation, Gemma 2)."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import ckpt_ext
from ckpt_ext import head as head_mod
from ckpt_ext.head import _lce_impl, chunk_rows, linear_cross_entropy
from tests.helpers import benchmarks  # noqa: F401  (puts benchmarks/ on sys.path)
from tests.helpers.devices import DEVICES

pytest.importorskip("transformers")
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

from bench_head import LiveBytes  # noqa: E402

V = 301


def close(a, b, rtol=1e-5, what=""):
    """|a - b| <= rtol * max|b| (+ a denormal floor): gradients compared per tensor at its own scale."""
    scale = b.abs().max().item()
    err = (a.double() - b.double()).abs().max().item()
    assert err <= rtol * scale + 1e-12, f"{what}: max error {err:.3g}, scale {scale:.3g}"


def hf_loss(h, w, b, labels, softcap=None, **kw):
    logits = F.linear(h, w, b)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return ForCausalLMLoss(logits, labels, w.shape[0], **kw)


def inputs(device, dtype=torch.float32, bias=False, B=2, S=37, H=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, S, H, generator=g, dtype=dtype).to(device).requires_grad_()
    w = (torch.randn(V, H, generator=g, dtype=dtype) * H ** -0.5 * 3).to(device).requires_grad_()
    b = torch.randn(V, generator=g, dtype=dtype).to(device).requires_grad_() if bias else None
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, :5] = -100
    labels[1, 20] = -100
    return h, w, b, labels.to(device)


def grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


# --------------------------------------------------------------------------------------------- the operator
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recompute", [False, True], ids=["grads-in-forward", "recompute"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("softcap", [None, 2.5], ids=["nocap", "softcap"])
@pytest.mark.parametrize("chunk", [7, 64, None])
def test_matches_hf_fp32(device, recompute, bias, softcap, chunk):
    h, w, b, labels = inputs(device, bias=bias)
    ref = hf_loss(h, w, b, labels, softcap)
    ours = linear_cross_entropy(h, w, b, labels, softcap=softcap, chunk=chunk, recompute=recompute)
    close(ours, ref, what="loss")
    for name, x, y in zip("hwb", grads(ours, (h, w, b)), grads(ref, (h, w, b))):
        close(x, y, what=f"grad {name}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recompute", [False, True])
def test_num_items_and_shift_labels(device, recompute):
    h, w, _, labels = inputs(device)
    n = torch.tensor(123, device=device)
    for kw in (dict(num_items_in_batch=n), dict(num_items_in_batch=77),
               dict(shift_labels=labels.roll(-3, 1)), dict(ignore_index=7)):
        lab = labels.masked_fill(labels == -100, kw["ignore_index"]) if "ignore_index" in kw else labels
        ref = hf_loss(h, w, None, lab, **kw)
        ours = linear_cross_entropy(h, w, None, lab, chunk=16, recompute=recompute, **kw)
        close(ours, ref, what=f"loss {kw}")
        for x, y in zip(grads(ours, (h, w)), grads(ref, (h, w))):
            close(x, y, what=f"grads {kw}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["autocast", "bf16-weights"])
@pytest.mark.parametrize("accumulate", ["weight", "float32"])
def test_low_precision_within_hf_error(device, mode, accumulate, monkeypatch):
    """bfloat16: the error against a float64 reference at most a small multiple of Hugging Face's own, with the
    weight's gradient summed over the chunks in its own dtype (the default) or in float32."""
    monkeypatch.setattr(head_mod, "ACCUMULATE", accumulate)
    h, w, _, labels = inputs(device, S=200, H=64)
    ref_t = [t.detach().double().requires_grad_() for t in (h, w)]
    ref = hf_loss(*ref_t[:2], None, labels)
    ref_g = grads(ref, ref_t)
    if mode == "autocast":
        ctx, args = torch.autocast(device, dtype=torch.bfloat16), (h, w)
    else:
        ctx, args = torch.autocast(device, enabled=False), [t.detach().bfloat16().requires_grad_() for t in (h, w)]
    with ctx:
        hf = hf_loss(*args, None, labels)
        ours = linear_cross_entropy(*args, None, labels, chunk=48)
    assert ours.dtype == hf.dtype == torch.float32
    hf_g, ours_g = grads(hf, args), grads(ours, args)
    err = lambda x, y: (x.double() - y.double()).abs().max().item()  # noqa: E731
    assert err(ours, ref) <= 3 * err(hf, ref) + 1e-6 * ref.abs().item()
    for name, o, f, r in zip("hw", ours_g, hf_g, ref_g):
        assert o.dtype == f.dtype
        assert err(o, r) <= 3 * err(f, r) + 1e-3 * r.abs().max().item(), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recompute", [False, True])
def test_bad_label_names_value_and_position(device, recompute):
    h, w, _, labels = inputs(device)
    for bad in (V, -1, 10 ** 6):
        lab = labels.clone()
        lab[1, 6] = bad
        with pytest.raises(ValueError, match=rf"labels\[1, 6\] = {bad} is outside the vocabulary \[0, {V}\)"):
            linear_cross_entropy(h, w, None, lab, recompute=recompute)
    lab = labels.clone()
    lab[1, 0] = V  # the first label is never a target after the shift: HF ignores it too
    close(linear_cross_entropy(h, w, None, lab), hf_loss(h, w, None, lab), what="unshifted first label")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recompute", [False, True])
def test_no_trained_token_as_hf(device, recompute):
    h, w, _, labels = inputs(device)
    labels = torch.full_like(labels, -100)
    for kw in ({}, dict(num_items_in_batch=5)):
        ref = hf_loss(h, w, None, labels, **kw)
        ours = linear_cross_entropy(h, w, None, labels, recompute=recompute, **kw)
        torch.testing.assert_close(ours, ref, equal_nan=True)
        for x, y in zip(grads(ours, (h, w)), grads(ref, (h, w))):
            torch.testing.assert_close(x, y, equal_nan=True)


@pytest.mark.parametrize("recompute", [False, True])
def test_nothing_of_logits_size_saved(recompute):
    """Saved-tensor hooks: what the loss keeps for backward is at most hidden/weight-sized, never N x V."""
    h, w, b, labels = inputs("cpu", bias=True, S=300, H=16)
    n = labels.numel()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        loss = linear_cross_entropy(h, w, b, labels, chunk=32, recompute=recompute)
    loss.backward()
    assert saved and max(saved) <= max(V * 16, n * 16) < n * V


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_peak_is_one_chunk_of_logits(softcap):
    """The operator's peak (every tensor it creates, counted while alive): its gradients plus a few
    chunk-sized buffers, far below one full set of logits."""
    h, w, _, labels = inputs("cpu", S=500, H=16)
    hh, t = h.detach().reshape(-1, 16), torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
    n, chunk = hh.shape[0], 40
    with LiveBytes() as lb:
        _lce_impl(hh, w.detach(), None, t, -100, softcap or 0.0, chunk, True, True, False, 500, True)
    grads_bytes = 4 * (n * 16 + V * 16) * 2 + 64 * n  # gh (and its compacted copy), gw, masks and indices
    # one chunk of float32 logits (two with the cap: the tanh is kept for its derivative), plus row vectors
    assert 4 * chunk * V < lb.peak <= grads_bytes + (2 if softcap else 1) * 4 * chunk * V + 64 * chunk
    assert lb.peak < 4 * n * V / 4
    with LiveBytes() as full:
        F.cross_entropy(F.linear(hh, w.detach()), t)
    assert full.peak >= 4 * n * V  # the measure sees HF's logits


@pytest.mark.parametrize("accumulate", ["weight", "float32"])
def test_weight_gradient_sum_memory(accumulate, monkeypatch):
    """bfloat16 weights: summed in their own dtype, the operator holds no V x H tensor besides the gradient it
    returns; in float32, the float32 sum (4 V H bytes) and its rounding (2 V H), never a V x H product per chunk
    (the products are added a block of vocabulary rows at a time). Ignored rows: no copy of all hidden states."""
    monkeypatch.setattr(head_mod, "ACCUMULATE", accumulate)
    n, H, vocab, chunk = 256, 256, 2000, 16  # V x H well above a chunk's logits
    g = torch.Generator().manual_seed(0)
    hh = torch.randn(n, H, generator=g).bfloat16()
    w = (torch.randn(vocab, H, generator=g) * 0.2).bfloat16()
    t = torch.randint(0, vocab, (n,), generator=g)
    t[::7] = -100  # some rows ignored: the trained rows are picked per chunk
    with LiveBytes() as lb:
        out = _lce_impl(hh, w, None, t, -100, 0.0, chunk, True, True, False, 0, False)
    vh = vocab * H
    chunk_bytes = chunk * vocab * (4 + 2 + 2) + chunk * H * 2 * 2 + 64 * n  # logits fp32 + bf16, g bf16, rows
    gh = n * H * 2
    if accumulate == "weight":
        assert out[3].dtype == torch.bfloat16 and lb.peak <= 2 * vh + gh + chunk_bytes
    else:
        assert 6 * vh <= lb.peak <= 6 * vh + gh + chunk_bytes + chunk * vocab * 2  # + one block's product
    ref = _lce_impl(hh.float(), w.float(), None, t, -100, 0.0, chunk, True, True, False, 0, False)
    for name, a, b in zip(("loss", "count", "grad h", "grad w"), out[:4], ref[:4]):
        close(a.float(), b, 2e-2, what=name)


def test_chunk_rows():
    assert chunk_rows(128256) == 1024 and chunk_rows(32000) == 1024 and chunk_rows(256000) == 512
    assert chunk_rows(10 ** 9, 1000) == 1 and chunk_rows(1000, 4 * 1000 * 100) == 64 and chunk_rows(10, rows=5) == 5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recompute", [False, True])
def test_compiled_without_graph_breaks(device, recompute):
    h, w, b, labels = inputs(device, bias=True)
    torch._dynamo.reset()
    fn = torch.compile(lambda h, w, b, lab: linear_cross_entropy(h, w, b, lab, chunk=16, recompute=recompute),
                       fullgraph=True, backend="aot_eager")
    ours, ref = fn(h, w, b, labels), hf_loss(h, w, b, labels)
    close(ours, ref, what="loss")
    for x, y in zip(grads(ours, (h, w, b)), grads(ref, (h, w, b))):
        close(x, y, what="grad")


# --------------------------------------------------------------------------------------------- fused models
transformers = pytest.importorskip("transformers")
MV = 257


def causal_lm(family, tie=False, layers=2, **over):
    torch.manual_seed(0)
    quiet = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None, use_cache=False)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_embd=48, n_head=3, n_layer=layers, vocab_size=MV, resid_pdrop=0.0,
                                      attn_pdrop=0.0, embd_pdrop=0.0, tie_word_embeddings=tie, **quiet, **over)
        return transformers.GPT2LMHeadModel(cfg)
    if family == "gemma2":
        cfg = transformers.Gemma2Config(hidden_size=48, num_attention_heads=3, num_key_value_heads=3, head_dim=16,
                                        intermediate_size=64, num_hidden_layers=layers, vocab_size=MV,
                                        final_logit_softcapping=2.0, attn_implementation="eager", **quiet, **over)
        return transformers.Gemma2ForCausalLM(cfg)
    cfg = transformers.LlamaConfig(hidden_size=48, num_attention_heads=3, num_key_value_heads=1, intermediate_size=64,
                                   num_hidden_layers=layers, vocab_size=MV, tie_word_embeddings=tie, **quiet, **over)
    return transformers.LlamaForCausalLM(cfg)


def batch(seed=1, B=2, S=23):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MV, (B, S), generator=g)
    labels = ids.clone()
    labels[0, :6] = -100
    return ids, labels


def fused_pair(family, tie=False, fuse=ckpt_ext.fuse, **over):
    ref = causal_lm(family, tie, **over)
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fuse(model)
    return ref.train(), model.train()


def compare_grads(model, ref, rtol=1e-5):
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is None:
            assert ref_params[name].grad is None, name
            continue
        close(p.grad, ref_params[name].grad, rtol, what=name)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_fused_model_matches_hf(family, tie):
    ref, model = fused_pair(family, tie)
    assert type(model.lm_head).__name__ == "FusedLMHead"
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tie
    assert model.state_dict().keys() == ref.state_dict().keys()
    ids, labels = batch()
    out_ref, out = ref(input_ids=ids, labels=labels), model(input_ids=ids, labels=labels)
    assert out.logits is None and "logits" not in out.keys()
    close(out.loss, out_ref.loss, what="loss")
    out.loss.backward()
    out_ref.loss.backward()
    compare_grads(model, ref)
    # logits asked for: HF's path (eval, no labels, skip_logits=False)
    ref.eval(), model.eval()
    with torch.no_grad():
        a, b = ref(input_ids=ids, labels=labels), model(input_ids=ids, labels=labels)
        close(b.logits, a.logits, what="eval logits")
        close(b.loss, a.loss, what="eval loss")
    model.train()
    assert model(input_ids=ids).logits.shape == (2, 23, MV)
    kept = model(input_ids=ids, labels=labels, skip_logits=False)
    assert kept.logits is not None and kept.loss is not None
    tup = model(input_ids=ids, labels=labels, return_dict=False)
    close(tup[0], out_ref.loss, what="tuple loss")
    assert all(t is None or t.shape[-1] != MV for t in tup[1:] if isinstance(t, torch.Tensor))


def test_skip_logits_true_needs_labels():
    _, model = fused_pair("llama")
    with pytest.raises(ValueError, match="skip_logits=True needs labels"):
        model(input_ids=batch()[0], skip_logits=True)
    assert not model.lm_head._fused_call  # the forward hook ran despite the error


def test_gradient_accumulation_num_items():
    """Trainer's accumulation: two micro-batches, each loss = sum / num_items_in_batch of both."""
    ref, model = fused_pair("llama", tie=True)
    micro = [batch(seed=s) for s in (1, 2)]
    n = torch.tensor(sum(int((lab[:, 1:] != -100).sum()) for _, lab in micro))
    for m in (ref, model):
        for ids, labels in micro:
            m(input_ids=ids, labels=labels, num_items_in_batch=n).loss.backward()
    compare_grads(model, ref)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_fused_checkpointed_end_to_end(family):
    """fuse + enable_checkpointing, with labels, against Hugging Face without ckpt_ext; nothing of B x S x V is
    saved for backward (the issue's reproduction)."""
    ref, model = fused_pair(family)
    ckpt_ext.enable_checkpointing(model)
    ids, labels = batch(B=2, S=40)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    ref(input_ids=ids, labels=labels).loss.backward()
    assert max(saved) < 2 * 40 * MV
    compare_grads(model, ref)


def test_compiled_model_matches_hf():
    ref, model = fused_pair("llama")
    ids, labels = batch()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(input_ids=ids, labels=labels)
    assert out.logits is None
    out.loss.backward()
    ref(input_ids=ids, labels=labels).loss.backward()
    compare_grads(model, ref)


def test_autocast_model():
    ref, model = fused_pair("llama")
    ids, labels = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = ref(input_ids=ids, labels=labels).loss, model(input_ids=ids, labels=labels).loss
    a.backward()
    b.backward()
    assert b.dtype == a.dtype == torch.float32
    close(b, a, 1e-2, what="autocast loss")
    close(model.lm_head.weight.grad, ref.lm_head.weight.grad, 5e-2, what="autocast head grad")


@pytest.mark.parametrize("order", ["fuse-then-peft", "peft-then-fuse"])
def test_peft_lora_neighbours(order):
    peft = pytest.importorskip("peft")
    ref = causal_lm("llama")
    model = copy.deepcopy(ref)
    if order == "fuse-then-peft":
        ckpt_ext.fuse(model)
    cfg = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(3)
    ref = peft.get_peft_model(ref, peft.LoraConfig(**cfg)).train()
    torch.manual_seed(3)
    model = peft.get_peft_model(model, peft.LoraConfig(**cfg)).train()
    if order == "peft-then-fuse":
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the head of the peft model's base is found, no warning
            ckpt_ext.fuse(model)
    ids, labels = batch()
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None
    out.loss.backward()
    ref(input_ids=ids, labels=labels).loss.backward()
    compare_grads(model, ref)


def test_gemma2_softcap():
    ref, model = fused_pair("gemma2", fuse=ckpt_ext.fuse_lm_head)
    ids, labels = batch()
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None and model.config.final_logit_softcapping == 2.0
    out.loss.backward()
    out_ref = ref(input_ids=ids, labels=labels)
    out_ref.loss.backward()
    close(out.loss, out_ref.loss, what="loss")
    compare_grads(model, ref)
    model.eval()
    with torch.no_grad():
        close(model(input_ids=ids).logits, ref.eval()(input_ids=ids).logits, what="eval logits (capped)")


def test_refused_and_undone():
    ref = causal_lm("llama")
    ref.config.logit_scale = 0.5  # a forward that scales its logits (Cohere) keeps HF's head
    with pytest.warns(UserWarning, match="scales the logits"):
        assert not ckpt_ext.fuse_lm_head(copy.deepcopy(ref))
    ref.config.logit_scale = None
    model = copy.deepcopy(ref)
    assert ckpt_ext.fuse_lm_head(model) and ckpt_ext.fuse_lm_head(model)
    clone = copy.deepcopy(model)
    ids, labels = batch()
    assert clone.train()(input_ids=ids, labels=labels).logits is None
    ckpt_ext.unfuse_lm_head(model)
    assert type(model.lm_head) is torch.nn.Linear
    assert model.train()(input_ids=ids, labels=labels).logits is not None


def test_replaced_head_or_loss_falls_back():
    _, model = fused_pair("llama")
    ids, labels = batch()
    model.resize_token_embeddings(MV + 3)  # a new, plain nn.Linear head
    with pytest.warns(UserWarning, match="lm_head was replaced"):
        assert model(input_ids=ids, labels=labels).logits.shape[-1] == MV + 3
    assert ckpt_ext.fuse_lm_head(model) and model(input_ids=ids, labels=labels).logits is None
    model.loss_function = ForCausalLMLoss
    with pytest.warns(UserWarning, match="loss_function was replaced"):
        assert model(input_ids=ids, labels=labels).logits is not None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peak_and_model():
    """CUDA: the allocator's peak of the op is a few chunks, HF's is several full logits; a fused model under
    bf16 autocast matches HF's within bf16 error."""
    n, H, vocab, chunk = 4096, 64, 32000, 256
    h = torch.randn(1, n, H, device="cuda", requires_grad=True)
    w = (torch.randn(vocab, H, device="cuda") * 0.1).requires_grad_()
    labels = torch.randint(0, vocab, (1, n), device="cuda")

    def peak(fn):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn().backward()
        torch.cuda.synchronize()
        h.grad = w.grad = None
        return torch.cuda.max_memory_allocated() - base

    ours = peak(lambda: linear_cross_entropy(h, w, None, labels, chunk=chunk))
    hf = peak(lambda: hf_loss(h, w, None, labels))
    assert hf >= 4 * n * vocab and ours <= 4 * (2 * n * H + 2 * vocab * H) + 4 * 4 * chunk * vocab
    ref, model = fused_pair("llama")
    ref, model = ref.cuda(), model.cuda()
    ids, labels = (t.cuda() for t in batch())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        a, b = ref(input_ids=ids, labels=labels).loss, model(input_ids=ids, labels=labels).loss
    a.backward()
    b.backward()
    close(b, a, 1e-2, what="loss")
    close(model.lm_head.weight.grad, ref.lm_head.weight.grad, 5e-2, what="head grad")


def test_bench_head_smoke(tmp_path):
    import bench_head
    result = bench_head.main(["--device", "cpu", "--vocab", "500", "--tokens", "64", "--hidden", "16", "--rounds",
                              "1", "--out", str(tmp_path)])
    rows = {r["variant"]: r for r in result["results"]}
    assert set(rows) == {"hf", "ckpt_ext", "ckpt_ext-recompute"} and all("error" not in r for r in rows.values())
    assert rows["ckpt_ext"]["peak_bytes"] < rows["hf"]["peak_bytes"]
    assert (tmp_path / "bench_head.md").exists()


def test_logits_to_keep():
    """logits_to_keep slices the hidden states before the head, as in HF: with labels, HF's loss fails on the
    mismatch and so does the fused one (clearly); without labels or in eval, HF's path serves it."""
    ref, model = fused_pair("llama")
    ids, labels = batch()
    with pytest.raises(ValueError):
        ref(input_ids=ids, labels=labels, logits_to_keep=1)
    with pytest.raises(ValueError, match="logits_to_keep must keep every position"):
        model(input_ids=ids, labels=labels, logits_to_keep=1)
    assert not model.lm_head._fused_call and model.lm_head._fused_hidden is None
    close(model(input_ids=ids, logits_to_keep=1).logits, ref(input_ids=ids, logits_to_keep=1).logits, what="kept")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    """torch.library.opcheck of the three operators: schema, fake kernels, autograd registration, AOT dispatch."""
    from ckpt_ext.head import _lce, _lce_rc, _lce_rc_bwd
    h, w, b, labels = inputs(device, bias=True, S=23, H=8)
    hh = h.detach().reshape(-1, 8).requires_grad_()  # 46 rows, some ignored
    t = labels.reshape(-1)
    torch.library.opcheck(_lce, (hh, w, b, t, -100, 0.0, 5, True, True, True, 23, True))
    torch.library.opcheck(_lce, (hh, w, None, t, -100, 2.0, 64, False, True, False, 23, True))
    torch.library.opcheck(_lce_rc, (hh, w, b, t, -100, 2.0, 5, 23, True))
    lse = _lce_rc(hh.detach(), w.detach(), b.detach(), t, -100, 0.0, 5, 23, True)[2]
    g = torch.tensor(0.5, device=device)
    torch.library.opcheck(_lce_rc_bwd, (g, hh.detach(), w.detach(), b.detach(), t, lse, -100, 0.0, 5, True, True, True))


def test_second_backward_through_the_same_graph_is_refused():
    """Backward scales the forward's gradients in place (the weight's gradient is not held twice): a second
    backward through a retained graph gets autograd's in-place error rather than gradients scaled twice."""
    h, w, _, labels = inputs("cpu")
    loss = linear_cross_entropy(h, w, None, labels) * 3
    loss.backward(retain_graph=True)
    close(w.grad, torch.autograd.grad(hf_loss(h, w, None, labels) * 3, [w])[0], what="weight grad")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    loss2 = linear_cross_entropy(h, w, None, labels, recompute=True) * 3
    loss2.backward(retain_graph=True)
    loss2.backward()  # the recompute order keeps no gradient: any number of backwards
