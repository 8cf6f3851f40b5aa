"""BERT's pre-norm boundary under budget= (issues 32/33): the same fused BERT and the same measured layer costs, planned
with the boundary (LayerCost.pre_norm; the default) and without it (the costs' pre_norm dropped: every group keeps
its input, as before), at a few budgets between the least achievable and keeping everything. Per budget: the plans'
predicted held bytes and recompute, the bytes measured held from forward to backward (bench_budget.held_by_stack, an
untimed step) and the step time (medians of interleaved rounds, both variants in one process).

    python benchmarks/bench_plan_boundary.py                 # CPU: BERT 4 x 256, s512, batch 1, fp32, dropout 0.1
    python benchmarks/bench_plan_boundary.py --fracs 0.05,0.2 --rounds 5
"""
import argparse
import copy
import dataclasses
import statistics
import time
import warnings

import torch

import ckpt_ext
from ckpt_ext.planner import fmt_bytes, plan_chain
from ckpt_ext.stack import _ATTR
from bench_budget import held_by_stack
from common import load_average
from variants import ModelSpec, build_model

SPEC = ModelSpec("bert-4x256", "bert", 4, 256, 4, 512, 1024, 1000)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fracs", default="0.0,0.05,0.15,0.3", help="budgets: least + f x (everything - least)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("load average at the start:", load_average())
    base = ckpt_ext.fuse(build_model(SPEC, "fp32")).train()
    ids = torch.randint(3, SPEC.vocab, (1, SPEC.seq), generator=torch.Generator().manual_seed(0))
    layers = list(base.encoder.layer)

    def step(model):
        torch.manual_seed(1)
        model(input_ids=ids).last_hidden_state.sum().backward()
        model.zero_grad(set_to_none=True)

    def enable(model, budget):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ckpt_ext.enable_checkpointing(model, budget=budget)
        step(model)  # measures, plans
        return model.encoder.layer[0].__dict__[_ATTR].planner

    probe = copy.deepcopy(base)
    p = enable(probe, "1GiB")
    costs, chained, shared = p.costs, p.chained, sum(p.shared.values())
    plain = [dataclasses.replace(c, pre_norm=None) for c in costs]
    least = plan_chain(plain, None, chained, shared_bytes=shared).need_bytes
    top = plan_chain(plain, 1 << 50, chained, shared_bytes=shared).need_bytes  # keeping every layer (+ working set)
    rows = []
    for frac in [float(f) for f in args.fracs.split(",")]:
        budget = int(least + frac * (top - least))
        variants = {}
        for name, use in (("with boundary", costs), ("without", plain)):
            model = copy.deepcopy(base)
            planner = enable(model, budget)
            # the same measured costs for both variants (the probe's), planned with or without the boundary
            planner.costs = list(use)
            planner.plan = plan_chain(use, budget, chained, planner.keep, shared)
            planner.plans = {planner.shape: planner.plan}
            planner.install_plan()
            step(model)
            _, held = held_by_stack(model, model.encoder.layer, lambda m: m(input_ids=ids).last_hidden_state.sum())
            model.zero_grad(set_to_none=True)
            variants[name] = (model, planner.plan, held)
        times = {name: [] for name in variants}
        for r in range(args.rounds):
            for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                start = time.perf_counter()
                step(variants[name][0])
                times[name].append(time.perf_counter() - start)
        for name, (model, plan, held) in variants.items():
            rows.append((fmt_bytes(budget), name, len(plan.boundaries), fmt_bytes(plan.held_bytes), fmt_bytes(held),
                         plan.recompute * 1e3, statistics.median(times[name]) * 1e3))
    print("| budget | plan | segments with the boundary | predicted held | measured held | predicted recompute ms | "
          "step ms (median) |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print("| {} | {} | {} | {} | {} | {:.1f} | {:.1f} |".format(*row))
    print("load average at the end:", load_average())


if __name__ == "__main__":
    main()
