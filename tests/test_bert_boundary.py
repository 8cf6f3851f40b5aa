"""BERT's checkpointed segment boundary at its second norm's input (issue 32): a fused BERT/RoBERTa segment keeps
its last layer's pre-norm sum and row statistics, its replay stops before that layer's output linear and norm,
and the next segment recomputes its input from that sum instead of keeping it (_C.pre_norm_boundaries).

Checked: gradients bit-identical to the same model without checkpointing and to the checkpointed path without
the boundary (fp32, bf16, CPU autocast; dropout on and off; every=1, 2, all; keep="attention"; LoRA; RoBERTa);
the recomputed input is the forward's output bit for bit (the norm kernel run again on the stored sum); the
replay runs neither the last layer's output GEMM nor its norm forward; the segment outputs between segments are
freed after forward, the boundaries as backward passes them, and at once when a graph is dropped (the step's
peak: docs/bert-work.md -- a traced peak moves by several [B, S, H] run to run with Python's garbage collection,
too much for a test); what falls back (an adapter on the output linear, an input modified in place, GPT-2)
falls back correctly."""
import contextlib
import copy
import re
import time
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ckpt_ext
from ckpt_ext import _C, fuse, stack_plan

transformers = pytest.importorskip("transformers")
from helpers.devices import DEVICES, requires_cuda  # noqa: E402
from helpers.hf_models import embeds_call, inputs_for, layers_of, make_model  # noqa: E402
from helpers.fused import _seed, switched  # noqa: E402,F401  (_seed: an autouse fixture)


def boundaries(on):
    return switched(_C.pre_norm_boundaries, on)


def _ckpt(model, every, keep="boundaries"):
    ck = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ckpt_ext.enable_checkpointing(ck, every=every, keep=keep)
    return ck


def _step(model, family, kw, autocast=False, seed=7):
    """Forward (under CPU autocast when asked) and backward of a fixed gradient: (output, input grad, grads)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        torch.manual_seed(seed)
        e, out = embeds_call(model, family, kw)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.device, out.dtype)
    out.backward(g)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), e.grad, grads


def _assert_identical(a, b):
    assert torch.equal(a[0], b[0])
    assert torch.equal(a[1], b[1])
    assert a[2].keys() == b[2].keys()
    for n in a[2]:
        assert torch.equal(a[2][n], b[2][n]), n


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["fp32", "bf16", "autocast"])
@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["nodrop", "dropout"])
@pytest.mark.parametrize("every", [1, 2, 3], ids=["every1", "every2", "all"])
@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_boundary_gradients_bit_identical(family, every, dropout, mode, device):
    """Against the fused model without checkpointing and the checkpointed one without the boundary."""
    if device == "cuda" and mode == "autocast":
        pytest.skip("CPU autocast (the CUDA run: tests/test_bert_boundary.py::test_cuda_*)")
    model = fuse(make_model(family, dropout=dropout, layers=3)).train().to(device)
    if mode == "bf16":
        model.bfloat16()
    ck = _ckpt(model, every)
    kw = inputs_for(family, padding=True, device=device)
    ac = mode == "autocast"
    ref = _step(model, family, kw, ac)
    with boundaries(True):
        new = _step(ck, family, kw, ac)
    with boundaries(False):
        old = _step(ck, family, kw, ac)
    _assert_identical(new, ref)
    _assert_identical(old, ref)


@pytest.mark.parametrize("every", [1, 3], ids=["every1", "all"])
def test_boundary_with_keep_attention(every):
    """Hidden dropout only (CPU keeps no attention with attention dropout): the last layer's replay runs without
    its attention forward and stops before its output linear."""
    model = fuse(make_model("bert", layers=3, hidden_dropout_prob=0.2)).train()
    ck = _ckpt(model, every, keep="attention")
    kw = inputs_for("bert", padding=True)
    ref = _step(model, "bert", kw)
    with boundaries(True), warnings.catch_warnings():
        warnings.simplefilter("error")  # a layer keeping no attention warns
        _assert_identical(_step(ck, "bert", kw), ref)


@pytest.mark.parametrize("targets", [["query", "value"], ["query", "value", "dense"]],
                         ids=["qv", "with-output-dense"])
def test_boundary_with_lora(targets):
    """Adapters on q and v: the boundary path (frozen base weights, the adapters' gradients through the replay);
    one on the output linear too: that layer falls back to replaying its output linear."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = make_model("bert", dropout=0.1, layers=3)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.2, target_modules=targets))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    model = fuse(model.train())
    ck = _ckpt(model, 1)
    kw = inputs_for("bert", padding=True)
    ref = _step(model, "bert", kw)
    with boundaries(True):
        new = _step(ck, "bert", kw)
    _assert_identical(new, ref)
    assert new[2] and all("lora_" in n for n in new[2])


class _Ops(TorchDispatchMode):
    """Counts ops by name, and the products reading `weight` in its forward orientation."""

    def __init__(self, weight=None):
        super().__init__()
        self.names = []
        self.weight = weight
        self.forward_products = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        if self.weight is not None and func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            w = args[-1]
            if w.data_ptr() == self.weight.data_ptr() and w.stride() == self.weight.t().stride():
                self.forward_products += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("on", [True, False], ids=["boundary", "old"])
def test_replay_skips_the_last_output_gemm_and_norm(on):
    """every=1, three layers: each segment's replay runs its layer's first norm only (the second, and the output
    GEMM x W^T, not at all), and the second and third segments recompute their input with one add_layer_norm."""
    model = fuse(make_model("bert", dropout=0.2, layers=3)).train()
    ck = _ckpt(model, 1)
    kw = inputs_for("bert", padding=True)
    weights = [layers_of(ck)[i].output.dense.weight for i in range(3)]
    with boundaries(on):
        out = ck(**kw).last_hidden_state
        counts = [_Ops(w) for w in weights]
        with contextlib.ExitStack() as stack:
            for c in counts:
                stack.enter_context(c)
            out.sum().backward()
    names = counts[0].names
    norms = names.count("ckpt_ext.bias_dropout_add_layer_norm")
    if on:
        assert norms == 3 and names.count("ckpt_ext.add_layer_norm") == 2
        assert [c.forward_products for c in counts] == [0, 0, 0]
    else:
        assert norms == 6 and names.count("ckpt_ext.add_layer_norm") == 0
        assert [c.forward_products for c in counts] == [1, 1, 1]
    assert names.count("ckpt_ext.bias_dropout_add_layer_norm_backward") == 6


def test_recomputed_input_is_the_forward_output():
    """The second segment's replay input (recomputed from the first segment's pre-norm sum) equals the first
    segment's output bit for bit: checked through a hook on what the replay's first layer receives."""
    for mode in ("fp32", "bf16"):
        model = fuse(make_model("bert", dropout=0.2, layers=2)).train()
        if mode == "bf16":
            model.bfloat16()
        ck = _ckpt(model, 1)
        kw = inputs_for("bert", padding=True)
        seen = {}

        class Spy(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if str(func.overloadpacket) == "ckpt_ext.add_layer_norm":
                    seen["recomputed"] = out[0].clone()
                return out

        with boundaries(True):
            hs = []
            h = layers_of(ck)[0].register_forward_hook(lambda m, a, o: hs.append(o[0] if isinstance(o, tuple) else o))
            out = ck(**kw).last_hidden_state
            h.remove()
            first = hs[0].detach().clone()
            with Spy():
                out.sum().backward()
        assert torch.equal(seen["recomputed"], first), mode


def test_outputs_between_segments_are_freed_after_forward():
    """With the boundary, a segment keeps its input's pre-norm sum (outside the pool) and not the input: the
    pooled outputs of the earlier segments are freed when the loop moves on (only the last stays)."""
    model = fuse(make_model("bert", dropout=0.2, layers=4)).train()
    ck = _ckpt(model, 1)
    kw = inputs_for("bert", padding=True)
    live = {}
    for on in (False, True):
        with boundaries(on):
            before = ckpt_ext.pool_stats("cpu")["live_slots"]
            out = ck(**kw).last_hidden_state
            live[on] = ckpt_ext.pool_stats("cpu")["live_slots"] - before
            out.sum().backward()
            del out
            assert ckpt_ext.pool_stats("cpu")["live_slots"] == before
    assert live == {False: 4, True: 1}


def _tiny_bert(layers):
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                                  intermediate_size=128, max_position_embeddings=16, vocab_size=50,
                                  attn_implementation="sdpa", attention_probs_dropout_prob=0.0)
    return transformers.BertModel(cfg, add_pooling_layer=False), 50, 16


@contextlib.contextmanager
def _own_chunks():
    """Every pool slot in a chunk of its own (as BERT-large's 32 MiB slots are), so that the live-bytes accounting
    sees the pooled outputs come and go."""
    cpu = torch.device("cpu")
    chunk = _C.pool_chunk_bytes(cpu)
    _C.set_pool_chunk_bytes(cpu, 256)
    ckpt_ext.empty_pool(cpu)  # no spare chunk from earlier tests to put slots in
    try:
        yield
    finally:
        _C.set_pool_chunk_bytes(cpu, chunk)


def test_boundaries_released_as_backward_reaches_them():
    """Live tensors at the start of each segment's backward (every=1, 4 layers): the row statistics of the
    boundaries of segments 1..k only (those of later segments freed by their backward, with their pre-norm sums),
    and no pooled output (the old path keeps segments 1..k-1's as their successors' inputs)."""
    import helpers.benchmarks  # noqa: F401
    import bench_head
    import collections
    model = fuse(_tiny_bert(4)[0].train().bfloat16())
    ckpt_ext.enable_checkpointing(model, every=1)
    ids = torch.randint(0, 50, (8, 16))
    txh, stats = 8 * 16 * 32 * 2, 8 * 16 * 4
    seen = {}
    with _own_chunks():
        for on in (False, True):
            with boundaries(on):
                live = bench_head.LiveBytes()
                counts = []
                with live:
                    out = model(input_ids=ids).last_hidden_state
                    node, k = out.grad_fn, 4
                    while node is not None:
                        node.register_prehook(lambda g, k=k: counts.append(
                            (k, collections.Counter(e[0] for e in live.live.values()))))
                        nxt = [f for f, _ in node.next_functions if f is not None and "Segment" in f.name()]
                        node, k = (nxt[0] if nxt else None), k - 1
                    loss = out.float().pow(2).mean()
                    del out
                    loss.backward()
                seen[on] = counts
    assert [k for k, _ in seen[True]] == [4, 3, 2, 1]
    for (k, old), (_, new) in zip(seen[False], seen[True]):
        assert new[stats] == 2 * k and old[stats] == 0, k
        # the pooled outputs: segments 1..k-1's kept as inputs in the old path; none in the new (freed in forward)
        assert sum(n for b, n in old.items() if txh < b <= txh + 1024) == k - 1, k
        assert sum(n for b, n in new.items() if txh < b <= txh + 1024) == 0, k


def test_forward_without_backward_frees_the_boundaries():
    """A graph dropped without backward frees the pre-norm sums and statistics at once (the thread's offer of the
    last segment holds weak references only)."""
    import helpers.benchmarks  # noqa: F401
    import bench_head
    model = fuse(_tiny_bert(3)[0].train())
    ckpt_ext.enable_checkpointing(model, every=1)
    ids = torch.randint(0, 50, (8, 16))
    with boundaries(True), _own_chunks():
        live = bench_head.LiveBytes()
        with live:
            out = model(input_ids=ids).last_hidden_state
            during = live.current
            del out
        assert during > 0 and live.current == 0


def _call(layer, x):
    out = layer(x)
    return out[0] if isinstance(out, tuple) else out


def test_input_modified_in_place_is_refused():
    """The first segment's output changed in place after the second segment took it (as autograd refuses a saved
    input changed in place): the replay would recompute the unchanged one."""
    model = fuse(make_model("bert", dropout=0.0, layers=2)).train()
    layers = layers_of(_ckpt(model, 1))
    x = torch.randn(2, 5, 72, requires_grad=True)
    with boundaries(True):
        h = _call(layers[0], x)
        out = _call(layers[1], h)
        with torch.no_grad():
            h.add_(1.0)
        with pytest.raises(RuntimeError, match="modified in place"):
            out.sum().backward()


def test_input_changed_before_the_next_segment_falls_back():
    """An input changed in place between two segments is not the first segment's output any more: the second
    keeps its input as before, and the gradients are those of the changed input."""
    model = fuse(make_model("bert", dropout=0.2, layers=2)).train()
    results = []
    for on in (False, True):
        ck = _ckpt(model, 1)
        layers = layers_of(ck)
        x = torch.randn(2, 5, 72, generator=torch.Generator().manual_seed(1)).requires_grad_()
        with boundaries(on):
            torch.manual_seed(3)
            h = _call(layers[0], x) * 1.0  # a new tensor: not the segment's output
            out = _call(layers[1], h)
            out.sum().backward()
        results.append((x.grad, [p.grad for p in ck.parameters() if p.grad is not None]))
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)


def test_retain_graph_second_backward():
    model = fuse(make_model("bert", dropout=0.2, layers=3)).train()
    ck = _ckpt(model, 1)
    kw = inputs_for("bert", padding=True)
    with boundaries(True):
        torch.manual_seed(1)
        out = ck(**kw).last_hidden_state
        g1 = torch.autograd.grad(out.sum(), list(ck.parameters()), retain_graph=True)
        g2 = torch.autograd.grad(out.sum(), list(ck.parameters()))
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_second_backward_without_retain_graph_is_refused():
    model = fuse(make_model("bert", dropout=0.2, layers=2)).train()
    ck = _ckpt(model, 1)
    with boundaries(True):
        out = ck(**inputs_for("bert", padding=True)).last_hidden_state
        node = out.grad_fn
        g = torch.ones_like(out)
        out.backward(g)
        with pytest.raises(RuntimeError, match="second time"):
            torch.autograd.backward(out, g)


def test_explain_says_what_is_kept_and_budget_plans_use_it_where_planned():
    """explain() names the pre-norm boundary where it is used (not "only its input"); a budget's planned groups run
    with it only where the plan accounts for it (Plan.boundaries; held bytes as predicted: tests/test_plan_boundary.py),
    and explain() says so for them too; the switch off gives the plain wording back."""
    from ckpt_ext.planner import plan_chain, segment_costs
    model = fuse(make_model("bert", dropout=0.1, layers=3)).train()
    kw = inputs_for("bert", padding=True)
    with boundaries(True):
        ck = _ckpt(model, 1)
        embeds_call(ck, "bert", kw)[1].sum().backward()
        assert "pre-norm boundary" in ckpt_ext.explain(ck)
        with boundaries(False):
            assert "every group keeps only its input" in ckpt_ext.explain(ck)
        planned = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ckpt_ext.enable_checkpointing(planned, budget=1000, keep="boundaries")
        with pytest.raises(ValueError, match="least achievable") as err:  # the minimum: every layer checkpointed
            embeds_call(planned, "bert", kw)[1].sum().backward()
        least = int(re.search(r"\((\d+) bytes\)", str(err.value)).group(1))
        seen = []

        class Spy(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                seen.append(func)
                return func(*args, **(kwargs or {}))

        def plan_for(budget):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ckpt_ext.enable_checkpointing(planned, budget=budget, keep="boundaries")
            # The probe timed in this process's CPU seconds on one thread (stack_plan.probe_clock), not wall time: on
            # a loaded machine wall time moves the measured costs, and with them the plans below, from run to run.
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                with stack_plan.probe_clock(time.process_time):
                    for _ in range(2):  # measures, plans; then runs the plan
                        _, out = embeds_call(planned, "bert", kw)
                        seen.clear()
                        with Spy():
                            out.sum().backward()
            finally:
                torch.set_num_threads(threads)
            p = layers_of(planned)[0].__dict__["_ckpt_ext_group"].planner
            return p, p.plan, ckpt_ext.explain(planned)

        p, plan, text = plan_for(least)
        assert ("pre-norm boundary" in text) == bool(plan.boundaries), text
        # a budget whose plan has a segment take the sum before as its input
        # The budget is found from the costs measured so far; each plan_for measures them again, and the plan for the
        # same budget may differ when the times do (a loaded machine): found again from the new costs, up to 3 times.
        for _ in range(3):
            shared = sum(p.shared.values())
            top = plan_chain(p.costs, 1 << 50, p.chained, "boundaries", shared).need_bytes  # keeping every layer
            budget = next(b for b in range(least, top, max(1, (top - least) // 100))
                          if any(x[4] for x in segment_costs(p.costs, *(lambda q: (q.segments, q.boundaries, q.chained))(
                              plan_chain(p.costs, b, p.chained, "boundaries", shared)))))
            p, plan, text = plan_for(budget)
            takes = [x[4] for x in segment_costs(plan.costs, plan.segments, plan.boundaries, plan.chained)]
            if any(takes):
                break
        assert any(takes), plan
        assert "pre-norm boundary" in text and "no input of its own" in text, text
        # the inputs recomputed from kept sums (the boundary's replay starts with add_layer_norm on it)
        assert seen.count(torch.ops.ckpt_ext.add_layer_norm.default) == sum(takes)


def test_gpt2_is_unchanged():
    """GPT-2 has no pre-norm boundary: each segment keeps its input (three pooled slots after forward), the same
    gradients."""
    model = fuse(make_model("gpt2", dropout=0.2, layers=3)).train()
    ck = _ckpt(model, 1)
    kw = inputs_for("gpt2", padding=True)
    ref = _step(model, "gpt2", kw)
    with boundaries(True):
        _assert_identical(_step(ck, "gpt2", kw), ref)
        before = ckpt_ext.pool_stats("cpu")["live_slots"]
        out = ck(**kw).last_hidden_state
        assert ckpt_ext.pool_stats("cpu")["live_slots"] - before == 3
        del out


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "autocast"])
def test_cuda_boundary_bit_identical(autocast):
    """CUDA: the recompute of a segment's input by the norm kernel (rowwise, 16-byte and element paths) equals
    the forward's output, and the gradients equal the un-checkpointed fused model's and the old path's."""
    model = fuse(make_model("bert", dropout=0.2, layers=3)).train().cuda()
    if not autocast:
        model.bfloat16()
    ck = _ckpt(model, 1)
    kw = inputs_for("bert", padding=True, device="cuda")

    def step(m):
        m.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            torch.manual_seed(7)
            e, out = embeds_call(m, "bert", kw)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.device, out.dtype)
        out.backward(g)
        return out.detach(), e.grad, {n: p.grad for n, p in m.named_parameters() if p.grad is not None}

    ref = step(model)
    with boundaries(True):
        _assert_identical(step(ck), ref)
    with boundaries(False):
        _assert_identical(step(ck), ref)
    # The norm kernel run again on a stored pre-norm sum gives the stored output, at an unaligned offset too.
    for dt in (torch.float32, torch.bfloat16):
        for hidden in (72, 1024, 8200):
            x = torch.randn(64, hidden, device="cuda", dtype=dt)
            r = torch.randn(64, hidden, device="cuda", dtype=dt)
            w = torch.randn(hidden, device="cuda", dtype=dt)
            b = torch.randn(hidden, device="cuda", dtype=dt)
            out, pre, mean, rstd, _ = torch.ops.ckpt_ext.bias_dropout_add_layer_norm(x, b, r, w, b, 0.1, 1e-12, 5, 2)
            again = torch.ops.ckpt_ext.add_layer_norm(pre, None, w, b, 1e-12)
            assert torch.equal(again[0], out) and torch.equal(again[2], mean) and torch.equal(again[3], rstd)
            shifted = torch.empty(pre.numel() + 1, device="cuda", dtype=dt)[1:].view_as(pre).copy_(pre)
            assert torch.equal(torch.ops.ckpt_ext.add_layer_norm(shifted, None, w, b, 1e-12)[0], out)
