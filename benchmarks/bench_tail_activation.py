"""fuse + enable_checkpointing with the last layer's activation in the backward (issue 33) against without it.

`_C.tail_activation_in_backward` on: the replay of each segment's last layer stops before the activation that computes
the last linear's input, whose backward writes that input (the *_backward_act_ ops); off: the replay runs the
activation forward, as before. The same model, the same step (bench_fused's: loss = mean square of the last hidden
state), the switch set before each step, the two interleaved round by round in one process; medians and p20-p80 of
the step time, and their ratio. Shapes: bench_fused's CPU shrink of a configuration (--tiny: its tiny one) on CPU,
the configuration itself on CUDA. Gradients of the two are checked bit-identical once before timing.

    OMP_NUM_THREADS=1 python benchmarks/bench_tail_activation.py --configs bert-large-bf16,llama-bf16
"""
import argparse
import statistics
import sys
import time

import torch

import ckpt_ext
from ckpt_ext import _C

from bench_fused import CONFIGS, shrink
from common import env_info, env_line, finish_env
from variants import Variant, Workload


def _quantiles(xs):
    q = statistics.quantiles(xs, n=5) if len(xs) > 1 else [xs[0]] * 4
    return statistics.median(xs), q[0], q[3]


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def run(name: str, device: torch.device, rounds: int, tiny: bool, every: int):
    spec, batch, mode = CONFIGS[name]
    if device.type == "cpu":
        spec = shrink(spec, tiny)
    work = Workload(spec, mode, device)
    model = ckpt_ext.enable_checkpointing(ckpt_ext.fuse(work.fresh()), every=every)
    plain = Variant()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step(on: bool) -> float:
        _C.tail_activation_in_backward(on)
        sync()
        start = time.perf_counter()
        torch.manual_seed(0)
        work.step(plain, model, batch)
        sync()
        return time.perf_counter() - start

    before = _C.tail_activation_in_backward()
    try:
        grads = {}
        for on in (True, False):
            torch.manual_seed(0)
            work.forward(plain, model, batch, probe=True).backward()
            grads[on] = _grads(model)
        same = grads[True].keys() == grads[False].keys() and all(
            torch.equal(grads[True][k], grads[False][k]) for k in grads[True])
        for on in (True, False, True, False):  # warm-up
            step(on)
        times = {True: [], False: []}
        for r in range(rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                times[on].append(step(on))
    finally:
        _C.tail_activation_in_backward(before)
    on_m, on_lo, on_hi = _quantiles(times[True])
    off_m, off_lo, off_hi = _quantiles(times[False])
    print(f"{name} ({spec.describe()}, batch {batch}, {mode}, every={every}): gradients bit-identical: {same}")
    print(f"  activation in backward (on):  {on_m * 1e3:8.2f} ms (p20-p80 {on_lo * 1e3:.2f}-{on_hi * 1e3:.2f})")
    print(f"  as before (off):              {off_m * 1e3:8.2f} ms (p20-p80 {off_lo * 1e3:.2f}-{off_hi * 1e3:.2f})")
    print(f"  on / off: {on_m / off_m:.3f} over {rounds} interleaved rounds")
    return same


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="bert-large-bf16,llama-bf16", help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--every", type=int, default=1, help="enable_checkpointing(every=...) (default 1)")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args(argv)
    info = env_info(args.device)
    ok = all([run(n, torch.device(args.device), args.rounds, args.tiny, args.every) for n in args.configs.split(",")])
    finish_env(info)
    print(env_line(info))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
