"""The CPU attention with dropout alone, forward + backward: fused (mask + softmax + dropout in one row pass, one
autograd node) against the written-out ATen ops it replaced, in one process, interleaved rounds, medians.

    OMP_NUM_THREADS=1 python benchmarks/bench_cpu_attention.py                 # BERT-base-like: B 4, heads 12, D 64
    OMP_NUM_THREADS=1 python benchmarks/bench_cpu_attention.py --seq 128,512 --mode fp32,autocast

q comes as the projection's transposed view (as the layers hand it over), the mask is BERT's padding mask
[B, 1, 1, S] (float32), p = 0.1."""
import argparse
import statistics
import time

import torch

from ckpt_ext import _C


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--seq", default="128,512", help="comma list")
    ap.add_argument("--mode", default="fp32,autocast", help="comma list of fp32, bf16, autocast")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--p", type=float, default=0.1)
    a = ap.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    print("| mode | B x heads x S x D | written-out ms | fused ms | fused / written-out |")
    print("|---|---|---|---|---|")
    for mode in a.mode.split(","):
        for S in (int(s) for s in a.seq.split(",")):
            B, H, D = a.batch, a.heads, a.head_dim
            dt = torch.bfloat16 if mode == "bf16" else torch.float32
            q = torch.randn(B, S, H, D).to(dt).transpose(1, 2).requires_grad_()
            k = torch.randn(B, H, S, D).to(dt).requires_grad_()
            v = torch.randn(B, H, S, D).to(dt).requires_grad_()
            mask = torch.zeros(B, 1, 1, S)
            mask[0, ..., S // 2:] = -1e30
            if mode == "bf16":
                mask = mask.to(dt)
            grad = torch.randn(B, H, S, D)

            def step(fused, seed):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
                    out = _C._attention_philox_dropout_cpu(q, k, v, mask, False, D ** -0.5, a.p, seed, 0, fused)
                out.backward(grad.to(out.dtype))
                q.grad = k.grad = v.grad = None

            times = {True: [], False: []}
            for fused in (True, False):  # warm-up
                step(fused, 0)
                step(fused, 1)
            for r in range(a.rounds):
                for fused in ((True, False) if r % 2 == 0 else (False, True)):
                    t0 = time.perf_counter()
                    step(fused, r)
                    times[fused].append(time.perf_counter() - t0)
            old, new = statistics.median(times[False]) * 1e3, statistics.median(times[True]) * 1e3
            print(f"| {mode} | {B} x {H} x {S} x {D} | {old:.2f} | {new:.2f} | {new / old:.3f} |", flush=True)


if __name__ == "__main__":
    main()
