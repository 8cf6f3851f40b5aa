"""The budget planner and BERT's pre-norm boundary (issues 32/33): the search's accounting of segments run with the
boundary (planner.PreNorm) against brute force over every plan, every choice of boundary per segment; the per-call
switch (run_segment(..., pre_norm_boundary=False)) against the process-wide one; budget= plans on fused BERT and
RoBERTa holding exactly the bytes predicted, gradients bitwise those without checkpointing."""
import copy
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_ext.planner import ATTENTION, BOUNDARY_HOWS, LayerCost, PreNorm, _finish, plan_chain, segment_costs


def _all_plans(costs, hows, chained, strict):
    """Every plan: a partition into segments (checkpointed ones only over chained layers), each kept or checkpointed
    `how`, each checkpointed segment whose layers all have a pre-norm boundary with or without it."""
    n = len(costs)
    for cuts in itertools.product([False, True], repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        segs = list(zip(bounds, bounds[1:]))
        for flags in itertools.product((False,) + tuple(hows), repeat=len(segs)):
            if any(f and any(not chained[k] for k in range(s + 1, e)) for (s, e), f in zip(segs, flags)):
                continue
            if strict and any(f == ATTENTION and not all(c.keeps_attention for c in costs[s:e])
                              for (s, e), f in zip(segs, flags)):
                continue
            able = [s for (s, e), f in zip(segs, flags)
                    if f in BOUNDARY_HOWS and all(c.pre_norm is not None for c in costs[s:e])]
            for use in itertools.product([False, True], repeat=len(able)):
                yield _finish(costs, [(s, e, f) for (s, e), f in zip(segs, flags)], None,
                              {s for s, u in zip(able, use) if u}, chained)


_pre_norm = st.builds(lambda k, sk, ic, keeps: PreNorm(k, float(sk), float(ic), keeps),
                      st.integers(0, 300), st.integers(0, 20), st.integers(0, 5), st.booleans())
_layer = st.builds(lambda a, b, c, k, ac, pn: LayerCost(a, b, float(c), None if k is None else min(k, a),
                                                        float(min(ac, c)) if k is not None else 0.0,
                                                        pre_norm=pn),
                   st.integers(0, 1000), st.integers(0, 200), st.integers(0, 50), st.none() | st.integers(0, 300),
                   st.integers(0, 50), st.none() | _pre_norm | _pre_norm)


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(costs=st.lists(_layer, min_size=1, max_size=5), frac=st.floats(0.0, 1.2),
       keep=st.sampled_from(["auto", "boundaries", "attention"]), data=st.data())
def test_boundary_plans_match_brute_force(costs, frac, keep, data):
    chained = [True] + data.draw(st.lists(st.booleans(), min_size=len(costs) - 1, max_size=len(costs) - 1))
    hows = {"auto": (True, ATTENTION), "boundaries": (True,), "attention": (ATTENTION,)}[keep]
    plans = list(_all_plans(costs, hows, chained, strict=keep == "auto"))
    least = min(p.need_bytes for p in plans)
    total = sum(c.act_bytes for c in costs)
    budget = int(least + frac * max(0, total - least))
    plan = plan_chain(costs, budget, chained, keep=keep)
    assert plan.need_bytes <= budget
    assert plan.recompute == min(p.recompute for p in plans if p.need_bytes <= budget)
    again = _finish(costs, plan.segments, budget, plan.boundaries, chained)
    assert (again.held_bytes, again.replay_bytes, again.recompute) == \
        (plan.held_bytes, plan.replay_bytes, plan.recompute)
    assert plan_chain(costs, None, chained, keep=keep).need_bytes == least
    plan.describe()


def _bert_layer(pn=PreNorm(110, 3.0, 1.0)):
    return LayerCost(act_bytes=1000, boundary_bytes=100, compute=10.0, pre_norm=pn)


def test_chain_accounting():
    """Three segments run with the boundary: the first keeps its input and its sum, the others the sum each, no
    input; the replays skip 3 and add 1 per taken input."""
    costs = [_bert_layer() for _ in range(6)]
    segs = [(0, 2, True), (2, 4, True), (4, 6, True)]
    per = segment_costs(costs, segs, {0, 2, 4})
    assert [p[0] for p in per] == [100 + 110, 110, 110]
    assert [p[2] for p in per] == [17.0, 18.0, 18.0]
    assert [p[3:] for p in per] == [(True, False), (True, True), (True, True)]
    # without it: each keeps its input
    assert [p[0] for p in segment_costs(costs, segs)] == [100, 100, 100]
    # a kept layer between: the next segment keeps its input; the sum before is held all the same
    per = segment_costs(costs, [(0, 2, True), (2, 3, False), (3, 6, True)], {0, 3})
    assert [p[0] for p in per] == [210, 1000, 210] and not per[2][4]
    # not chained: no input taken
    per = segment_costs(costs, segs, {0, 2, 4}, chained=[True, True, False, True, True, True])
    assert [p[4] for p in per] == [False, False, True]
    # a layer whose output linear has an adapter keeps none, but takes one
    costs[3] = _bert_layer(PreNorm(0, 0.0, 1.0, keeps=False))
    per = segment_costs(costs, segs, {0, 2, 4})
    assert [p[3:] for p in per] == [(True, False), (False, True), (True, False)]
    with pytest.raises(ValueError, match="cannot run with the pre-norm boundary"):
        segment_costs([LayerCost(10, 1, 1.0)] * 2, [(0, 2, True)], {0})
    with pytest.raises(ValueError, match="cannot run with the pre-norm boundary"):
        segment_costs(costs, [(0, 2, "gemms")], {0})


def test_planner_chooses_the_boundary_where_it_pays():
    """Alike BERT layers whose sum costs what an input does plus a little: at the least budget of a plan without
    boundaries, the boundary lets the same memory replay less (chains of segments: one input, sums); the plan
    describes it."""
    costs = [_bert_layer() for _ in range(8)]
    plain = [LayerCost(c.act_bytes, c.boundary_bytes, c.compute) for c in costs]
    for budget in (plan_chain(plain, None).need_bytes, 3000, 5000):
        without, with_ = plan_chain(plain, budget), plan_chain(costs, budget)
        assert with_.need_bytes <= budget and with_.recompute <= without.recompute
    plan = plan_chain(costs, 3000)
    assert plan.boundaries and plan.recompute < plan_chain(plain, 3000).recompute
    text = plan.describe()
    assert "pre-norm boundary" in text and "keeping no input" in text, text


# ---- fused BERT / RoBERTa under budget= ------------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")
import warnings  # noqa: E402

import ckpt_ext  # noqa: E402
from ckpt_ext import _C, fuse  # noqa: E402
from ckpt_ext.stack import _ATTR  # noqa: E402
from helpers.fused import assert_same_step, held_step  # noqa: E402
from helpers.hf_models import inputs_for, layers_of, make_model  # noqa: E402


def _enable(model, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return ckpt_ext.enable_checkpointing(model, **options)


def _planner(model):
    return layers_of(model)[0].__dict__[_ATTR].planner


def _held_step(model, kw, autocast=False, seed=1):
    return held_step(model, kw, seed=seed, autocast=autocast)


_assert_equal = assert_same_step


def _fused(family, mode, layers=4):
    model = make_model(family, dropout=0.1, layers=layers, attention_probs_dropout_prob=0.0).train()
    if mode == "bf16":
        model = model.to(torch.bfloat16)
    return fuse(model)


@pytest.mark.parametrize("family,mode,keep", [("bert", "fp32", "auto"), ("bert", "fp32", "boundaries"),
                                             ("bert", "bf16", "auto"), ("bert", "autocast", "boundaries"),
                                             ("roberta", "fp32", "boundaries"), ("roberta", "bf16", "auto")])
def test_budget_plans_with_the_boundary_hold_as_predicted(family, mode, keep):
    """A sweep of budgets from the least to keeping everything: each plan fits, the bytes held from forward to backward
    equal the prediction exactly where every layer is checkpointed (within a boundary per layer kept whole, as the
    planner tests allow), the gradients are bitwise those of the fused model without checkpointing, the boundary is
    chosen somewhere (and then explain() says what each group keeps), and the process-wide switch is untouched."""
    autocast = mode == "autocast"
    model = _fused(family, mode)
    kw = inputs_for(family, padding=True)
    ref = _held_step(copy.deepcopy(model), kw, autocast)
    option = None if keep == "auto" else keep  # (budget= without keep=: the planner chooses)
    _enable(model, budget="1GiB", keep=option)
    _held_step(model, kw, autocast)
    p = _planner(model)
    assert all(c.pre_norm is not None and c.pre_norm.keeps and c.pre_norm.kept_bytes > c.boundary_bytes // 2
               for c in p.costs), p.costs
    shared = sum(p.shared.values())
    least = plan_chain(p.costs, None, p.chained, keep=keep, shared_bytes=shared).need_bytes
    top = plan_chain(p.costs, 1 << 50, p.chained, keep=keep, shared_bytes=shared).need_bytes  # keeping every layer
    used = 0
    for frac in (0.0, 0.1, 0.3, 0.6):
        budget = int(least + frac * (top - least))
        _enable(model, budget=budget, keep=option)
        _held_step(model, kw, autocast)  # measures, plans
        out, grads, held = _held_step(model, kw, autocast)
        assert _C.pre_norm_boundaries()
        plan = _planner(model).plan
        assert plan.need_bytes <= budget
        whole = sum(e - s for s, e, how in plan.segments if how is False)
        boundary = max(c.boundary_bytes for c in plan.costs)
        assert abs(held - plan.held_bytes) <= whole * boundary, (frac, held, plan.held_bytes, plan.segments)
        if not whole:
            assert held == plan.held_bytes, (frac, held, plan.held_bytes, plan.segments, plan.boundaries)
        _assert_equal((out, grads), ref[:2])
        if plan.boundaries:
            used += 1
            text = ckpt_ext.explain(model)
            assert "pre-norm boundary" in text, text
    assert used, "no plan ran with the boundary"
    ckpt_ext.disable_checkpointing(model)


def test_the_per_call_argument_leaves_the_process_wide_switch_alone(monkeypatch):
    """run_segment(..., pre_norm_boundary=False) keeps that segment's input and takes no sum from the segment before,
    while the process-wide switch stays on and is never called with an argument; the segments around it keep theirs;
    gradients bitwise those of the un-checkpointed fused layers."""
    from ckpt_ext.fused import run_segment
    model = _fused("bert", "fp32", layers=4)
    layers = layers_of(model)
    torch.manual_seed(0)
    x = torch.randn(2, 9, model.config.hidden_size, requires_grad=True)
    calls = []
    real = _C.pre_norm_boundaries

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    seen = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    def step(flags, checkpointed=True):
        for p in model.parameters():
            p.grad = None
        x.grad = None
        torch.manual_seed(5)
        h = x
        for layer, flag in zip(layers, flags):
            h = run_segment([layer], (h,), {}, pre_norm_boundary=flag) if checkpointed else layer(h)
            h = h[0] if isinstance(h, tuple) else h
        seen.clear()
        with Spy():
            h.sum().backward()
        return [h.detach(), x.grad.clone()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

    monkeypatch.setattr(_C, "pre_norm_boundaries", spy)
    assert real()
    with torch.random.fork_rng():
        ref = step([True] * 4, checkpointed=False)
    norms = {}
    for flags in ([True] * 4, [True, False, True, True], [False] * 4, [True, True, False, False]):
        got = step(flags)
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), flags
        # a segment taking the sum before recomputes its input with one add_layer_norm in its replay
        norms[tuple(flags)] = seen.count(torch.ops.ckpt_ext.add_layer_norm.default)
        assert real()
    assert norms == {(True,) * 4: 3, (True, False, True, True): 1, (False,) * 4: 0, (True, True, False, False): 1}
    assert all(not a and not k for a, k in calls), calls  # read, never set


def test_only_tests_turn_the_process_wide_switch_off():
    """The library and the benchmarks never set _C.pre_norm_boundaries (a process-wide switch: another thread's
    segments would see it); a call's own choice is run_segment's pre_norm_boundary."""
    import pathlib
    import re
    root = pathlib.Path(ckpt_ext.__file__).resolve().parent.parent
    setters = [f"{path.relative_to(root)}:{n}" for folder in ("ckpt_ext", "benchmarks", "tools")
               for path in sorted((root / folder).rglob("*.py"))
               for n, line in enumerate(path.read_text().splitlines(), 1)
               if re.search(r"pre_norm_boundaries\(\s*[^)\s]", line)]
    assert not setters, setters
