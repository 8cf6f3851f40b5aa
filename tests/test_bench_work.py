"""The work model (benchmarks/bench_work.py): its counts against hand-computed ones, its batch extrapolation
against a direct trace, and what it sees of the fused layers and their replay."""
import pytest
import torch

pytest.importorskip("transformers")
import helpers.benchmarks  # noqa: E402,F401  (puts benchmarks/ on sys.path)
import bench_work  # noqa: E402

L, H, HEADS, I, S, VOCAB = 2, 32, 2, 64, 16, 50


def tiny_bert(layers):
    import transformers
    cfg = transformers.BertConfig(hidden_size=H, num_hidden_layers=layers, num_attention_heads=HEADS,
                                  intermediate_size=I, max_position_embeddings=S, vocab_size=VOCAB,
                                  attn_implementation="sdpa", attention_probs_dropout_prob=0.0)
    return transformers.BertModel(cfg, add_pooling_layer=False), VOCAB, S


def _trace(variant, batch=2, layers=L, mode="bf16"):
    return bench_work.trace("bert", mode, variant, layers, batch, model_fn=tiny_bert)


def test_linear_counts_by_hand():
    """One nn.Linear forward and backward: addmm (bias) then the two mm of its backward, 2*M*N*K FLOPs each,
    the bias gradient a sum; bytes of the forward: x, W, b read, y written."""
    M, K, N = 6, 40, 24
    lin = torch.nn.Linear(K, N)
    x = torch.randn(M, K, requires_grad=True)
    work = bench_work.WorkMode()
    with work:
        lin(x).sum().backward()
    gemms = [o for o in work.ops if o.kind == "gemm"]
    assert [o.name for o in gemms] == ["aten.addmm", "aten.mm", "aten.mm"]
    assert [o.flops for o in gemms] == [2 * M * N * K] * 3
    assert gemms[0].bytes == 4 * (M * K + N * K + N + M * N)
    assert sum(o.flops for o in work.ops) == 3 * 2 * M * N * K
    assert x.grad is not None and x.grad.shape == x.shape  # counted, not computed: shapes only


@pytest.mark.parametrize("variant, passes", [("none", 3), ("hf-gc", 4), ("ckpt_ext", 4), ("fused", 3),
                                             ("fused+ckpt", 4)])
def test_bert_gemm_flops_by_hand(variant, passes):
    """A BERT layer's GEMMs: Q, K, V, attention output (H x H each), intermediate and output (H x I): a
    forward of 2*T*(4H^2 + 2HI) FLOPs; backward twice that; a checkpointed layer's replay once more -- but for
    the output GEMM of a fused segment's last layer, whose replay stops at the pre-norm boundary (every=1: every
    layer's)."""
    batch = 2
    ops = _trace(variant, batch)
    tokens = batch * S
    per_forward = 2 * tokens * (4 * H * H + 2 * H * I)
    skipped = L * 2 * tokens * H * I if variant == "fused+ckpt" else 0
    assert sum(o.flops for o in ops if o.kind == "gemm") == passes * L * per_forward - skipped
    attn = [o for o in ops if o.kind.startswith("attn")]
    assert len([o for o in attn if o.kind == "attn_fwd"]) == L * (passes - 2)
    assert len([o for o in attn if o.kind == "attn_bwd"]) == L


def test_fused_layers_are_seen_inside():
    """The fused layers' ATen calls and ckpt_ext ops reach the mode, in the forward and in the segment's
    replay in backward."""
    fused = [o.name for o in _trace("fused")]
    replayed = [o.name for o in _trace("fused+ckpt")]
    assert fused.count("ckpt_ext.bias_gelu") == L
    # each segment's last layer replays from before its activation, whose backward writes it (issue 33)
    assert replayed.count("ckpt_ext.bias_gelu") == L and replayed.count("ckpt_ext.bias_gelu_backward_act_") == L
    assert fused.count("ckpt_ext.bias_dropout_add_layer_norm_backward") == 2 * L
    assert fused.count("aten.native_layer_norm") == 1  # the embeddings' only: the layers' norms are ckpt_ext's


def test_fused_bert_backward_cuts():
    """Issue 32's cuts, as the trace sees them: Q/K/V one GEMM forward over the concatenated weights and biases
    (two small cats a layer) and no [B, S, 3H] gradient concatenated in backward (csrc/layers/qkv.cpp); the
    addmm_ that accumulates dx counted as a GEMM; the norms' dense-bias gradients summed by their backward
    kernels (grad_bias: a third launch, the column sum) instead of an aten.sum, and so is bias_gelu's."""
    for variant, forwards in (("fused", 1), ("fused+ckpt", 2)):
        ops = _trace(variant)
        cats = [o.shapes.split(" -> ")[1] for o in ops if o.name == "aten.cat"]
        assert sorted(cats) == sorted([f"{3 * H}x{H}", f"{3 * H}"] * (forwards * L)), cats
        assert sum(o.kind == "gemm" for o in ops if o.name == "aten.addmm_") == 2 * L
        norms = [o for o in ops if o.name == "ckpt_ext.bias_dropout_add_layer_norm_backward"]
        assert [o.launches for o in norms] == [3] * (2 * L)
        assert all(o.shapes.split(" -> ")[1].endswith(f",{H}") for o in norms)  # grad_bias [H] is an output
        # (fused+ckpt: the replay's bias_gelu_backward_act_, issue 33, which sums the bias's gradient the same way)
        gelus = [o for o in ops if o.name in ("ckpt_ext.bias_gelu_backward", "ckpt_ext.bias_gelu_backward_act_")]
        assert [o.launches for o in gelus] == [2] * L
        assert all(o.shapes.split(" -> ")[1].split(",")[-1] == str(I) for o in gelus)  # grad_bias [I] is an output
        # per layer only the q, k and v bias gradients remain sums ([T, H] each); none over [T, I]
        sums = [o.shapes for o in ops if o.name == "aten.sum" and o.shapes.endswith(f" -> {H}")]
        assert len(sums) == 3 * L, sums
        assert not [o for o in ops if o.name == "aten.sum" and o.shapes.endswith(f" -> {I}")]


def test_batch_extrapolation_is_exact():
    """Counts at batch 5 extrapolated from the traces at 2 and 3 equal a trace at 5, op by op."""
    for variant in ("none", "fused+ckpt"):
        got = bench_work.at_batch(_trace(variant, 2), _trace(variant, 3), 5)
        want = _trace(variant, 5)
        assert got.names == [o.name for o in want]
        assert got.flops == pytest.approx([o.flops for o in want], rel=0, abs=1e-6)
        assert got.bytes == pytest.approx([o.bytes for o in want], rel=0, abs=1e-6)


@pytest.mark.parametrize("variant", ["fused+ckpt", "fused+keep"])
def test_layer_extrapolation_is_exact(variant):
    """The step's time at 4 layers from the 2- and 3-layer traces equals the 4-layer trace's."""
    cfg = bench_work.Config("tiny", "bert", 4, 4, "bf16", (variant,), 0.0)
    step = bench_work.step_of(cfg, variant, model_fn=tiny_bert)
    direct = bench_work.at_batch(_trace(variant, 2, 4), _trace(variant, 3, 4), 4)
    want = sum(bench_work.op_seconds(direct, bench_work.FIT))
    assert step.totals()["flops"] == pytest.approx(sum(direct.flops), rel=1e-12)
    assert step.seconds(bench_work.FIT) == pytest.approx(want, rel=1e-12)


def test_rank_check():
    table = {"a": 100.0, "b": 110.0, "c": 111.0}
    assert bench_work.rank_check(table, {"a": 1.0, "b": 2.0, "c": 1.5}) == []  # b, c: a tie
    assert bench_work.rank_check(table, {"a": 3.0, "b": 2.0, "c": 2.5}) == ["a vs b", "a vs c"]


def test_peak_live_bytes_sees_checkpointing():
    """The memory side (--peak): checkpointing lowers the traced step's peak of live tensor bytes to well
    under half of the same model's without (4 layers, batch 8: the saved activations dominate), for Hugging
    Face's layers and the fused ones alike, and [B, S, H] activations are among what is live at the peak."""
    peaks = {v: bench_work.peak_live_bytes("bert", "bf16", v, 4, 8, model_fn=tiny_bert)
             for v in ("none", "hf-gc", "fused", "fused+ckpt")}
    assert peaks["hf-gc"][0] < peaks["none"][0] / 2
    assert peaks["fused+ckpt"][0] < peaks["fused"][0] / 2
    assert peaks["none"][1].get(8 * S * H * 2, 0) >= 4  # bf16 [8, S, H]: at least one per layer


# ------------------------------------------------------------------------- budget= planned at the work model's rates
def tiny_llama(layers):
    import transformers
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=256, vocab_size=VOCAB,
                                   max_position_embeddings=64, attn_implementation="sdpa")
    return transformers.LlamaModel(cfg), VOCAB, 64


# what each of a plan's choices runs as a variant of its own
_ALONE = {False: "fused", True: "fused+ckpt", "attention": "fused+keep"}


def test_budget_variant_is_planned_at_predicted_costs_and_traced():
    """fused+budget=2.0 on a 4-layer GQA Llama: the plan (made from the work model's predicted costs, so the same
    at every run) mixes choices; its traced step's prediction lies between those of the variants it mixes, each run
    on every layer; the bytes the layer stack held from forward to backward in the traced step are the plan's
    prediction exactly; the budget is twice the planner's need of every layer checkpointed alone."""
    cfg = bench_work.Config("tiny-llama", "llama", 4, 2, "bf16", (), 0.0)
    info = {}
    step = bench_work.step_of(cfg, "fused+budget=2.0", model_fn=tiny_llama, info=info)
    plan = info["plan"]
    hows = {how for *_, how in plan.segments}
    assert len(hows) >= 2, plan.segments  # (if the model's costs change: choose a budget that mixes again)
    assert info["held"] == plan.held_bytes
    assert info["budget"] == int(2.0 * info["full_need"]) and plan.need_bytes <= info["budget"]
    assert "layer 0: " in step.plan and "budget " in step.plan
    alone = {how: bench_work.step_of(cfg, _ALONE.get(how, f"fused+keep={how}"), model_fn=tiny_llama).seconds(
        bench_work.FIT) for how in hows}
    got = step.seconds(bench_work.FIT)
    assert min(alone.values()) < got < max(alone.values()), (got, alone, plan.segments)


def test_budget_variant_full_checkpoint_need_is_the_unplanned_default():
    """budget=1.0 (the full-checkpoint need itself) plans every layer checkpointed alone, boundary only -- what
    fused+ckpt runs -- but for the last, which may keep more at the same need (the peak is its replay beside every
    held byte: what it keeps more it replays less), and its need is the budget; where the plan is fused+ckpt's, its
    traced step is fused+ckpt's, op for op."""
    info = {}
    planned = bench_work.trace("llama", "bf16", "fused+budget=1.0", 3, 2, model_fn=tiny_llama, info=info)
    plan = info["plan"]
    assert plan.segments[:2] == [(0, 1, True), (1, 2, True)] and plan.segments[2][:2] == (2, 3) and plan.segments[2][2]
    assert plan.need_bytes <= info["budget"] == info["full_need"]
    if plan.segments[2][2] is True:
        default = bench_work.trace("llama", "bf16", "fused+ckpt", 3, 2, model_fn=tiny_llama)
        assert [(o.name, o.flops, o.bytes) for o in planned] == [(o.name, o.flops, o.bytes) for o in default]


# -------------------------------------------------------------------------------------- LoRA configs (predicted only)
def test_lora_mode_traces_peft_adapters():
    """llama-lora's mode: bfloat16 weights, peft's LoRA (variants.LoraSpec: r 16 on every projection, float32 adapters,
    dropout 0.05), autocast. GEMM FLOPs by hand: per layer and token, the base projections' forward and input gradient
    (frozen: no weight gradient, fused or not) and the adapters' three products (forward, and the two gradients of A's
    and of B's GEMM); the fused step's equal to peft eager's. Bad modes are refused."""
    pytest.importorskip("peft")
    T, r, hid, kv, inter = 2 * 64, 16, 64, 32, 256
    shapes = [(hid, hid), (hid, kv), (hid, kv), (hid, hid), (hid, inter), (hid, inter), (inter, hid)]
    base = sum(i * o for i, o in shapes)
    adapters = sum(r * (i + o) for i, o in shapes)
    # less the first layer's q/k/v input gradients (base and adapters): its input, the frozen embedding's, needs none
    expected = 2 * 2 * T * (2 * base + 3 * adapters) - 2 * T * (hid * (hid + 2 * kv) + 3 * r * hid)
    for variant in ("none", "fused"):
        ops = bench_work.trace("llama", "bf16-autocast+lora", variant, 2, 2, model_fn=tiny_llama)
        assert sum(o.flops for o in ops if o.kind == "gemm") == expected, variant
    with pytest.raises(ValueError, match="mode must be one of"):
        bench_work.trace("llama", "lora", "none", 2, 2, model_fn=tiny_llama)
    assert bench_work.CONFIGS["llama-lora"].mode == "bf16-autocast+lora"
    assert not set(bench_work.H200_MS) & {n for n, c in bench_work.CONFIGS.items() if bench_work._lora(c.mode)}
