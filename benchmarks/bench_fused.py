"""Fused layers against Hugging Face, with the speed targets the fused layers must meet on a GPU.

Per (model, mode, variant): median step time (p20-p80), ratio to HF eager, and peak memory. The same
measurement as the GPU yardstick (shared/gpu/side_by_side.py): one process, every variant on its own copy
of the same weights, a trial and a memory step per variant, then interleaved rounds; medians. Variants:
none (HF eager), hf-torch-nonreentrant (HF + torch.utils.checkpoint), ckpt_ext (HF layers +
enable_checkpointing), fused (ckpt_ext.fuse), ckpt_ext-fused (fuse + enable_checkpointing).

Configurations, dropout as in the configs (0.1 in BERT and GPT-2 attention, none in the Llama family):
  CUDA: BERT-large s512 b32 bf16 and autocast, GPT-2 medium s1024 b16 bf16, Llama 16x2048 s2048 b4 bf16;
        Llama's relatives: Qwen3 1.7B-like (28x2048, 16/8 heads, head dim 128, ffn 6144) s2048 b4, Mistral
        (Llama's shape, window 4096) s8192 b1, Qwen2 (Llama's shape, q/k/v biases) s2048 b4, Gemma 2B-like
        (18x2048, 8/1 heads, head dim 256, GeGLU 16384) s2048 b4, Gemma 3 1B-like widths (12x1152, 4/1 heads,
        head dim 256, GeGLU 6912, window 512, every sixth layer full) s2048 b4, all bf16
  CPU:  the same families and modes, shrunk (4 layers, hidden 256, seq 128; head dim 64, window 64; --tiny:
        2 layers, hidden 64, seq 32)
Peak on CUDA: allocated above the weights during a step (the yardstick's "peak over weights"); on CPU,
which has no allocator statistics, the activation bytes held from forward to backward.

    python benchmarks/bench_fused.py                               # every configuration on the best device
    python benchmarks/bench_fused.py --configs bert-large-bf16     # one of them
    python benchmarks/bench_fused.py --configs qwen3-1.7b-bf16 --mode fp32  # in another mode than its own
    python benchmarks/bench_fused.py --device cuda --save-results  # into benchmarks/results/<device>/
"""
import argparse
import sys
import warnings
from typing import List, Optional

import torch

from common import (Progress, add_output_args, env_info, env_line, finish_env, mib, ms, noise_flags, output_dir,
                    write_results)
from suite import Suite, empty_row, run_cases
from variants import ModelSpec, Workload

VARIANTS = ["none", "hf-torch-nonreentrant", "ckpt_ext", "fused", "ckpt_ext-fused"]
# name -> (CUDA spec, batch, mode); the CPU shapes are the same families, shrunk.
CONFIGS = {
    "bert-large-bf16": (ModelSpec("bert-large", "bert", 24, 1024, 16, 512, 4096, 30522), 32, "bf16"),
    "bert-large-autocast": (ModelSpec("bert-large", "bert", 24, 1024, 16, 512, 4096, 30522), 32, "autocast"),
    "gpt2-medium-bf16": (ModelSpec("gpt2-medium", "gpt2", 24, 1024, 16, 1024, 4096, 50257), 16, "bf16"),
    "llama-bf16": (ModelSpec("llama", "llama", 16, 2048, 32, 2048, 8192, 32000, kv_heads=8), 4, "bf16"),
    # Llama's relatives (issue 34). Qwen3 at a 1.7B-like shape (head dim 128 set apart from 2048 / 16).
    "qwen3-1.7b-bf16": (ModelSpec("qwen3-1.7b", "qwen3", 28, 2048, 16, 2048, 6144, 151936, kv_heads=8,
                                  head_dim=128), 4, "bf16"),
    # Mistral: Llama's shape, a 4096 window over 8192 tokens (the window's mask through SDPA).
    "mistral-bf16": (ModelSpec("mistral", "mistral", 16, 2048, 32, 8192, 8192, 32000, kv_heads=8, window=4096), 1,
                     "bf16"),
    # Qwen2: Llama's shape with the q/k/v biases.
    "qwen2-bf16": (ModelSpec("qwen2", "qwen2", 16, 2048, 32, 2048, 8192, 32000, kv_heads=8), 4, "bf16"),
    # Gemma (1) at a 2B-like shape: one KV head, head dim 256, GeGLU 16384 wide, a 256k vocabulary.
    "gemma-2b-bf16": (ModelSpec("gemma-2b", "gemma", 18, 2048, 8, 2048, 16384, 256000, kv_heads=1, head_dim=256), 4,
                      "bf16"),
    # Gemma 3 at Gemma-3-1B's widths (hidden 1152, 4 heads of 256, one KV head, GeGLU 6912, a 262k vocabulary) with
    # 12 layers instead of 26: five sliding layers (window 512 over 2048 tokens) to each full one.
    "gemma3-1b-bf16": (ModelSpec("gemma3-1b", "gemma3", 12, 1152, 4, 2048, 6912, 262144, kv_heads=1, head_dim=256,
                                 window=512), 4, "bf16"),
}
CPU_SHRINK = {"layers": 4, "hidden": 256, "heads": 4, "seq": 128, "intermediate": 1024, "vocab": 1000}
# --tiny (CPU): the smallest shapes that still run every code path (the GPU report's dry run).
CPU_TINY = {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "intermediate": 256, "vocab": 1000}
# The GPU targets (GPU shapes): (fused / HF eager, fused + ckpt / HF eager). The relatives: issue 34's (set for
# Qwen3 and Mistral, the same for Qwen2 and Gemma).
TARGETS = {"bert-large-bf16": (0.85, 1.10), "bert-large-autocast": (0.90, 1.15), "gpt2-medium-bf16": (0.85, 1.10),
           "llama-bf16": (0.74, 0.95), "qwen3-1.7b-bf16": (0.75, 0.96), "mistral-bf16": (0.75, 0.96),
           "qwen2-bf16": (0.75, 0.96), "gemma-2b-bf16": (0.75, 0.96), "gemma3-1b-bf16": (0.75, 0.96)}


def shrink(spec: ModelSpec, tiny: bool = False) -> ModelSpec:
    """The CPU shape of a configuration: CPU_SHRINK (CPU_TINY with tiny), 2 KV heads for grouped-query attention,
    the head dim hidden / heads where the family sets it apart, a window of half the sequence where it has one."""
    shape = CPU_TINY if tiny else CPU_SHRINK
    kv = 2 if spec.kv_heads else None
    head_dim = shape["hidden"] // shape["heads"] if spec.head_dim else None
    window = shape["seq"] // 2 if spec.window else None
    return ModelSpec(spec.name + ("-tiny" if tiny else "-small"), spec.family, kv_heads=kv, head_dim=head_dim,
                     window=window, **shape)


def run_config(name: str, device, rounds: int, warmup: int, progress: Progress, notes: List[str],
               tiny: bool = False, mode: Optional[str] = None) -> List[dict]:
    spec, batch, own_mode = CONFIGS[name]
    mode = mode or own_mode
    cuda = torch.device(device).type == "cuda"
    if not cuda:
        spec, batch = shrink(spec, tiny), 2 if tiny else 4
    progress.describe(f"{name}: building")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' is_gradient_checkpointing rename
        suite = Suite(Workload(spec, mode, device), VARIANTS, None, notes)
        for v in list(suite.variants):
            suite.build(v)
        measured = {r["variant"]: r for r in run_cases(suite, {v: batch for v in suite.models}, rounds, warmup,
                                                        progress)}
        for v in list(suite.models):
            suite.drop(v)
    rows = [measured.get(v) or empty_row(v, batch, spec.seq, suite.status[v]) for v in VARIANTS]
    eager = measured.get("none", {}).get("step_s")
    for r in rows:
        variant = suite.variants.get(r["variant"])
        r.update(config=name, model=spec.name, mode=mode, seq=spec.seq,
                 flags=noise_flags(r["step_s"], eager, recomputes=bool(variant and variant.recomputes)),
                 ratio_to_eager=r["step_s"]["median"] / eager["median"] if r["step_s"] and eager else None,
                 peak_bytes=r["peak_over_weights_bytes"] if cuda else r["activation_bytes"])
    _check_targets(name, rows, cuda)
    return rows


def _check_targets(name: str, rows: List[dict], cuda: bool) -> None:
    """Writes the GPU target and whether it was met into the fused rows (judged on GPU shapes only)."""
    by = {r["variant"]: r for r in rows}
    fused_t, ckpt_t = TARGETS[name]
    for v, t in (("fused", fused_t), ("ckpt_ext-fused", ckpt_t)):
        r = by[v]
        r["target"] = f"<= {t:.2f}x"
        if cuda and r["ratio_to_eager"] is not None:
            r["target"] += " met" if r["ratio_to_eager"] <= t else " MISSED"
            peak, ref = r["peak_bytes"], by["hf-torch-nonreentrant"]["peak_bytes"]
            if v == "ckpt_ext-fused" and peak is not None and ref is not None:
                r["target"] += f"; peak <= HF + torch ckpt {'met' if peak <= ref else 'MISSED'}"
        elif not cuda:
            r["target"] += " (not judged: CPU shapes)"


def to_markdown(info: dict, rows: List[dict], cfg: dict) -> str:
    cuda = info["device"].startswith("cuda")
    peak = "peak over weights MiB" if cuda else "held fwd→bwd MiB"
    lines = [f"# ckpt_ext fused layers against Hugging Face: {info['device_name']} ({info['device']})", "",
             env_line(info), "", f"{cfg['rounds']} interleaved rounds after {cfg['warmup']} warm-up step(s) per variant.",
             "", f"| model | mode | batch | variant | status | step ms, median (p20-p80) | vs HF eager | {peak} | "
             "GPU target (fused / HF eager) | flags |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['ratio_to_eager']:.2f}x" if r["ratio_to_eager"] is not None else "-"
        lines.append(f"| {r['model']} s{r['seq']} | {r['mode']} | {r['batch']} | {r['variant']} | {r['status']} | "
                     f"{ms(r['step_s'])} | {ratio} | {mib(r['peak_bytes'])} | {r.get('target', '')} | "
                     f"{'; '.join(r['flags'])} |")
    lines += ["", "- variants: none = HF eager; hf-torch-nonreentrant = HF + torch.utils.checkpoint (non-reentrant); "
              "ckpt_ext = HF layers + ckpt_ext.enable_checkpointing; fused = ckpt_ext.fuse; ckpt_ext-fused = fuse + "
              "enable_checkpointing.",
              "- modes: bf16 = weights in bfloat16; autocast = fp32 weights under torch.autocast(bfloat16).",
              "- flags: `noisy` when the p20-p80 range exceeds 25% of the median; `implausible` when a variant that "
              "recomputes on HF eager's kernels is faster than HF eager."]
    lines += [f"- {n}" for n in cfg["notes"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_fused.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--rounds", type=int, default=15, help="timed interleaved rounds (default 15, as the yardstick)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant, the first being the trial")
    p.add_argument("--mode", default=None, choices=["fp32", "bf16", "autocast"],
                   help="run every configuration in this mode instead of its own (e.g. fp32 on CPU)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--tiny", action="store_true",
                   help="CPU: tiny shapes (2 layers, hidden 64, seq 32, batch 2) instead of the CPU shapes")
    add_output_args(p)
    args = p.parse_args(argv)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not names or any(c not in CONFIGS for c in names):
        p.error(f"--configs: choose from {', '.join(CONFIGS)}")
    if args.rounds < 1 or args.warmup < 1:
        p.error("--rounds and --warmup must be at least 1")
    device = torch.device(args.device)
    if args.tiny and device.type == "cuda":
        p.error("--tiny is for CPU runs (the GPU runs the configs' own shapes)")
    info = env_info(device)
    notes: List[str] = []
    progress = Progress(enabled=not args.no_progress)
    rows = []
    try:
        for name in names:
            rows += run_config(name, device, args.rounds, args.warmup, progress, notes, args.tiny, args.mode)
    finally:
        progress.close()
    cfg = {"configs": names, "rounds": args.rounds, "warmup": args.warmup, "variants": VARIANTS, "notes": notes,
           "argv": list(sys.argv[1:] if argv is None else argv)}
    md = to_markdown(finish_env(info), rows, cfg)
    print(md)
    stem = "fused" if names == list(CONFIGS) else "fused-" + "+".join(names)
    if args.mode:
        stem += "-" + args.mode
    result = {"env": info, "config": cfg, "rows": rows}
    result["files"] = write_results(output_dir(args, info), stem, result, md)
    print("wrote " + ", ".join(result["files"]), file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
