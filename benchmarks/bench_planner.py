"""Planning time of ckpt_ext.planner.plan_chain on synthetic chains (prints a table).

    python benchmarks/bench_planner.py [--timeout 60] [--repeat 3]

Chains: "varied" layers draw saved bytes, input bytes and compute from a seeded RNG (as in a model of
mixed blocks); "varied+attn" the same layers able to keep their attention (the planner then chooses among
three ways per segment); "identical" layers are all the same (a plain transformer stack). Each chain is planned at
budgets of 15%, 30% and 60% of its activations (everything kept) and with budget=None (least memory).
A case that runs past --timeout seconds is reported as "> timeout".
"""
import argparse
import random
import signal
import statistics
import time

from ckpt_ext.planner import LayerCost, plan_chain


def varied(n, seed=0):
    rng = random.Random(seed)
    return [LayerCost(rng.randint(40, 400) << 20, rng.randint(4, 40) << 20, rng.uniform(1.0, 9.0)) for _ in range(n)]


def with_attention(n, seed=0):
    """varied layers that can also keep their attention: 2-20 MiB kept, 10-50% of the forward skipped."""
    rng = random.Random(seed + 1)
    return [LayerCost(c.act_bytes, c.boundary_bytes, c.compute, rng.randint(2, 20) << 20,
                      c.compute * rng.uniform(0.1, 0.5)) for c in varied(n, seed)]


def identical(n):
    return [LayerCost(320 << 20, 32 << 20, 4.0)] * n


class _Timeout(Exception):
    pass


def _alarm(*_):
    raise _Timeout


def timed(fn, timeout, repeat):
    """Median seconds of fn() over `repeat` runs, or None when one run exceeds `timeout`."""
    signal.signal(signal.SIGALRM, _alarm)
    times = []
    for _ in range(repeat):
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        except _Timeout:
            return None
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sizes", default="24,48,96,128")
    args = ap.parse_args()
    sizes = list(map(int, args.sizes.split(",")))
    chains = ([(f"{n} varied", varied(n)) for n in sizes] + [(f"{sizes[-1]} varied+attn", with_attention(sizes[-1]))]
              + [("80 identical", identical(80))])
    print(f"{'chain':<18} {'budget':<12} {'seconds':>9} {'recompute':>10}")
    for name, costs in chains:
        total = sum(c.act_bytes for c in costs)
        cases = [(f"{f:.0%} of acts", int(f * total)) for f in (0.15, 0.3, 0.6)] + [("least (None)", None)]
        for label, budget in cases:
            try:
                t = timed(lambda: plan_chain(costs, budget), args.timeout, args.repeat)
            except ValueError:  # below the least achievable
                print(f"{name:<18} {label:<12} {'no plan':>9}", flush=True)
                continue
            share = ""
            if t is not None:
                plan = plan_chain(costs, budget)
                share = f"{plan.recompute / plan.total_compute:.1%}"
            shown = f"{t:9.3f}" if t is not None else f"> {args.timeout:g}".rjust(9)
            print(f"{name:<18} {label:<12} {shown} {share:>10}", flush=True)


if __name__ == "__main__":
    main()
