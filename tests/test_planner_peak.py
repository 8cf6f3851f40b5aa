"""The budget planner's predicted peak against the measured one (issue 33: explain()'s predicted peak within 10% of
measured). Predicted: Plan.need_bytes -- the bytes held from forward to backward, the replay at the peak (the
largest of a segment's replay beside the bytes held by it and the segments before it) and the largest layer's
working set. Measured: the layer stack's activation peak over a training step from the CPU allocator's events
(benchmarks/bench_budget.step_peak: every allocation of the step alive during the stack's forward or backward, the
parameters' gradients and what the embeddings hold apart; exact, whatever the machine's load). Tiny Hugging Face
models, plain and fused Llama and fused BERT (its pre-norm boundary chains), plans at budgets across the range so
that several keep levels are chosen. No timing is asserted (the plans' choices between levels follow measured
times: which plans come up varies, each is checked)."""
import warnings

import pytest
import torch

import ckpt_ext
from ckpt_ext.planner import LEVELS, plan_chain

pytest.importorskip("transformers")
from helpers import benchmarks  # noqa: E402,F401  (puts benchmarks/ on sys.path)
from helpers import hf_models as hf  # noqa: E402

import bench_budget  # noqa: E402

TOLERANCE = 0.10


def _planner(model):
    return next(m.__dict__["_ckpt_ext_group"].planner for m in model.modules() if "_ckpt_ext_group" in m.__dict__)


def _peaks(family, fused, keep=None, points=6):
    """[(plan, predicted peak, measured)] for the distinct plans at `points` budgets from the least achievable to
    keeping every layer, all planned from one measuring step."""
    torch.manual_seed(0)
    model = hf.make_model(family, layers=4).train()
    if fused:
        model = ckpt_ext.fuse(model)
    kw = hf.inputs_for(family, padding=False)

    def call(m):  # (the loss: the model's output is not held through the backward by the caller)
        m.zero_grad(set_to_none=True)  # (accumulating into .grad adds the weight gradients' temporaries)
        return m(**kw).last_hidden_state.pow(2).mean()

    def backward(loss):
        loss.backward()

    options = {} if keep is None else {"keep": keep}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt_ext.enable_checkpointing(model, budget="1TiB", **options)
        backward(call(model))  # measures
        p = _planner(model)
        shared = sum(p.shared.values())
        least = plan_chain(p.costs, None, p.chained, keep=keep or "auto", shared_bytes=shared).need_bytes
        top = plan_chain(p.costs, 1 << 50, p.chained, keep=keep or "auto", shared_bytes=shared).need_bytes
        out, seen = [], set()
        for k in range(points):
            plan = p.replan(least + (top - least) * k // (points - 1))
            key = (tuple(plan.segments), plan.boundaries)
            if key in seen:
                continue
            seen.add(key)
            backward(call(model))  # installs the plan
            measured = bench_budget.step_peak(model, hf.layers_of(model), call, backward)
            out.append((plan, plan.need_bytes, measured))
    ckpt_ext.disable_checkpointing(model)
    return out


def _check(results):
    for plan, predicted, measured in results:
        ratio = predicted / measured["peak"]
        assert abs(ratio - 1) <= TOLERANCE, (plan.segments, sorted(plan.boundaries), predicted, measured, ratio)
    # without the layers' working set the prediction falls short of the measured peak: it is what makes it fit
    assert any((predicted - plan.working_bytes) / measured["peak"] < 1 - TOLERANCE
               for plan, predicted, measured in results), [(r[1], r[2]["peak"], r[0].working_bytes) for r in results]


@pytest.mark.parametrize("family,fused", [("llama", False), ("llama", True), ("bert", True)],
                         ids=["llama-plain", "llama-fused", "bert-fused"])
def test_predicted_peak_within_ten_percent_of_measured(family, fused):
    results = _peaks(family, fused)
    _check(results)
    hows = {how for plan, *_ in results for *_, how in plan.segments}
    assert True in hows or hows & set(LEVELS), hows  # some plan checkpoints
    assert len(hows & set(LEVELS)) >= 2, hows  # at least two keep levels among the plans checked
    if family == "bert":
        assert any(plan.boundaries for plan, *_ in results)  # BERT's pre-norm boundary chain


@pytest.mark.parametrize("family,fused,keep", [("llama", True, "boundaries"), ("bert", True, "boundaries"),
                                               ("llama", False, "attention")],
                         ids=["llama-fused-boundaries", "bert-fused-boundaries", "llama-plain-attention"])
def test_predicted_peak_with_keep_restricted(family, fused, keep):
    results = _peaks(family, fused, keep=keep, points=4)
    _check(results)


def test_measuring_step_under_a_profiler_plans_without_the_working_set():
    """Profilers do not nest: a measuring step run under the user's torch.profiler measures no working set (0, the
    prediction as without it) instead of failing, and the user's profiler still records the step."""
    from torch.profiler import ProfilerActivity, profile
    torch.manual_seed(0)
    model = hf.make_model("llama", layers=2).train()
    kw = hf.inputs_for("llama", padding=False)
    ckpt_ext.enable_checkpointing(model, budget="1TiB")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(**kw).last_hidden_state.pow(2).mean().backward()  # measures and plans
    plan = _planner(model).plan
    assert plan is not None and plan.working_bytes == 0 and all(c.work_bytes == 0 for c in plan.costs)
    assert any(e.name == "aten::mm" for e in prof.events())
    text = ckpt_ext.explain(model)
    assert "predicted peak" in text and "working set" not in text, text
    # measured again without a profiler: the working set counts
    ckpt_ext.disable_checkpointing(model)
    ckpt_ext.enable_checkpointing(model, budget="1TiB")
    model(**kw).last_hidden_state.pow(2).mean().backward()
    assert _planner(model).plan.working_bytes > 0
    assert "for a layer's forward or backward working set" in ckpt_ext.explain(model)
    ckpt_ext.disable_checkpointing(model)
