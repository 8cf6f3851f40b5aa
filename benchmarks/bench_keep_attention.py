"""Keep-attention against full recompute (issue 23): step time of a checkpointed model that keeps each layer's
attention output and log-sum-exp, relative to the same model recomputing everything, next to torch's own
selective checkpoint (saving the attention kernel's outputs) relative to torch's full recompute.

    PYTHONPATH=. python benchmarks/bench_keep_attention.py [--rounds 15] [--warmup 3] [--device cpu]

The issue's CPU configuration: Llama 4 layers x hidden 256 (4 heads, intermediate 1024), seq 1024, batch 1,
float32, attention dropout 0; loss = mean square of the last hidden state. Every variant trains its own copy
of the same weights in one process; the steps are timed in interleaved rounds (common.interleaved: each
round runs every variant once, in a rotated order), medians. Target: keep / full of the fused layers <= torch
selective / torch full on plain Hugging Face layers.

Variants are functions `fresh -> model` (fresh() returns a new copy of the Hugging Face model on the
device), listed per group in VARIANTS; a group's ratio is its keep variant over its full-recompute one.
"""
import argparse
import functools
import statistics
import time
from typing import Callable, Dict, List

import torch
from torch import nn

import ckpt_ext
from common import env_info, env_line, finish_env, hf_checkpointing_enable, interleaved, ms
from variants import ModelSpec, build_model

SPEC = ModelSpec("llama-4x256", "llama", layers=4, hidden=256, heads=4, seq=1024, intermediate=1024, vocab=1000)
BATCH = 1


# ---- fused layers: ckpt_ext.fuse, each layer a checkpointed C++ segment (ckpt_ext.fused.run_segment) ------------
def _fused_segments(model: nn.Module, keep_attention: bool) -> nn.Module:
    """Every fused layer checkpointed alone through run_segment, the seam enable_checkpointing uses."""
    from ckpt_ext.fused import run_segment
    for layer in model.layers:
        layer.forward = functools.partial(lambda layer, *a, **kw: run_segment([layer], a, kw, keep_attention),
                                          layer)
    return model


def fused_full_recompute(fresh: Callable[[], nn.Module]) -> nn.Module:
    return _fused_segments(ckpt_ext.fuse(fresh()), keep_attention=False)


def fused_keep_attention(fresh: Callable[[], nn.Module]) -> nn.Module:
    return _fused_segments(ckpt_ext.fuse(fresh()), keep_attention=True)


# ---- torch's checkpoint on plain Hugging Face layers (the yardstick) --------------------------------------------
_ATTENTION_KERNELS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                      "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")


def _save_attention_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy
    name = getattr(op, "__name__", "").split(".")[0]
    return CheckpointPolicy.MUST_SAVE if name in _ATTENTION_KERNELS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    return create_selective_checkpoint_contexts(_save_attention_policy)


def torch_full_recompute(fresh: Callable[[], nn.Module]) -> nn.Module:
    model = fresh()
    hf_checkpointing_enable(model, use_reentrant=False)
    return model


def torch_selective_attention(fresh: Callable[[], nn.Module]) -> nn.Module:
    model = fresh()
    hf_checkpointing_enable(model, use_reentrant=False, context_fn=_selective_context)
    return model


# group -> (full recompute, keep attention)
VARIANTS: Dict[str, List[Callable[[Callable[[], nn.Module]], nn.Module]]] = {
    "fused": [fused_full_recompute, fused_keep_attention],
    "torch": [torch_full_recompute, torch_selective_attention],
}


def _cpu_times(steps: Dict[str, Callable[[], None]], rounds: int, warmup: int) -> Dict[str, List[float]]:
    """common.interleaved's rounds (order rotated every round), timed by process CPU time."""
    names, out = list(steps), {k: [] for k in steps}
    for r in range(warmup + rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.process_time()
            steps[k]()
            if r >= warmup:
                out[k].append(time.process_time() - t0)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--groups", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="CPU: time each step by the process's CPU time instead of wall time (less sensitive to "
                         "other processes on a shared machine; with --threads 1 it is the step's work)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    info = env_info(device)
    base = build_model(SPEC, "fp32")
    for m in base.modules():  # attention dropout 0 (Llama's default; said explicitly)
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0
    fresh = lambda: __import__("copy").deepcopy(base).to(device)  # noqa: E731
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SPEC.vocab, (BATCH, SPEC.seq), generator=g).to(device)

    models = {f.__name__: f(fresh) for group in args.groups for f in VARIANTS[group]}

    def step(model):
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, use_cache=False).last_hidden_state.pow(2).mean().backward()

    steps = {k: functools.partial(step, m) for k, m in models.items()}
    if args.cpu_time:
        times = _cpu_times(steps, args.rounds, args.warmup)
        stats = {k: {"median": statistics.median(v), "p20": sorted(v)[len(v) // 5],
                     "p80": sorted(v)[(4 * len(v)) // 5]} for k, v in times.items()}
    else:
        stats, times = interleaved(steps, device, args.rounds, args.warmup)
    info = finish_env(info)
    print(f"{SPEC.describe()}, batch {BATCH}, fp32, {device} ({info['device_name']})")
    print(env_line(info))
    clock = "process CPU time" if args.cpu_time else "wall time"
    print(f"{'variant':28s} step ms ({clock}): median (p20-p80), {args.rounds} interleaved rounds")
    for k, s in stats.items():
        print(f"{k:28s} {ms(s)}")
    for group in args.groups:
        full, keep = (f.__name__ for f in VARIANTS[group])
        paired = statistics.median(k / f for k, f in zip(times[keep], times[full]))  # same round, side by side
        print(f"{group}: {keep} / {full} = {stats[keep]['median'] / stats[full]['median']:.3f}x (ratio of medians), "
              f"{paired:.3f}x (median of the per-round ratios)")


if __name__ == "__main__":
    main()
