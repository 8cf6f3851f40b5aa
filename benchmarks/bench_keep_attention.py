"""keep="attention" against full recompute, ckpt_ext's and torch's side by side.

The issue-23 target: ckpt_ext keep-attention / ckpt_ext full <= torch selective (SDPA kept) / torch full, on
Hugging Face Llama 4 layers x hidden 256, seq 1024, batch 1, fp32, attention dropout 0 (CPU). Variants
(benchmarks/variants.py), each on its own copy of the same weights, one process, interleaved rounds, medians:

  none                       no checkpointing
  ckpt_ext                   ckpt_ext.enable_checkpointing(model): full recompute
  ckpt_ext-keep-attention    ckpt_ext.enable_checkpointing(model, keep="attention")
  hf-torch-nonreentrant      Hugging Face's checkpointing: torch.utils.checkpoint, full recompute
  torch-selective-attention  the same with torch's selective checkpointing saving the fused SDPA kernels
  ckpt_ext-fused             ckpt_ext.fuse(model) + enable_checkpointing: C++ segments, full recompute
  ckpt_ext-fused-keep-attention   the same with keep="attention" (kept output/LSE in pool slots)

The ratios are medians of per-round ratios (the two variants of a ratio run in the same round), with their
p20-p80 spread over the rounds and the number of rounds. The target is judged on the per-round difference of the
savings, (1 - ours/our full recompute) - (1 - torch SAC/torch full), all four from the same round: its median
and p20-p80, and in how many rounds ours saved at least as much. "met" when the median difference is >= 0,
"met in >= 80% of rounds" when its p20 is too, "MISSED" when its p80 is below 0, else "within the noise". A run
on a machine shared with other work moves by several percent: read the spread, and add rounds to narrow it.
Memory: the activation bytes held from forward to backward (saved tensors, the kept outputs/LSEs and torch's SAC
cache).

    python benchmarks/bench_keep_attention.py                      # the target configuration (CPU or CUDA)
    python benchmarks/bench_keep_attention.py --configs llama-s1024,llama-s128 --rounds 15
    python benchmarks/bench_keep_attention.py --save-results       # into benchmarks/results/<device>/
"""
import argparse
import functools
import statistics
import sys
import time
import warnings
from typing import Dict, List

import torch

from common import (Progress, add_output_args, env_info, env_line, finish_env, interleaved, mib, ms, noise_flags,
                    output_dir, quantiles, write_results)
from suite import Suite, empty_row, run_cases
from variants import ModelSpec, Workload

VARIANTS = ["none", "ckpt_ext", "ckpt_ext-keep-attention", "hf-torch-nonreentrant", "torch-selective-attention",
            "ckpt_ext-fused", "ckpt_ext-fused-keep-attention"]
# (kept variant, its full-recompute reference): the ratios the target compares.
RATIOS = [("ckpt_ext-keep-attention", "ckpt_ext"), ("torch-selective-attention", "hf-torch-nonreentrant"),
          ("ckpt_ext-fused-keep-attention", "ckpt_ext-fused")]
TORCH = "torch-selective-attention"
TARGETS = ("ckpt_ext-keep-attention", "ckpt_ext-fused-keep-attention")  # each one's ratio <= torch's
# name -> (spec, batch, mode). llama-s128: a short sequence, where attention is cheap and what the
# interception costs shows.
CONFIGS = {
    "llama-s1024": (ModelSpec("llama-4x256", "llama", 4, 256, 4, 1024, 1024, 1000), 1, "fp32"),
    "llama-s128": (ModelSpec("llama-4x256", "llama", 4, 256, 4, 128, 1024, 1000), 1, "fp32"),
    "llama-tiny": (ModelSpec("llama-2x64", "llama", 2, 64, 2, 64, 128, 100), 2, "fp32"),  # the tests' smoke run
}


def run_config(name: str, device, rounds: int, warmup: int, parity: bool, progress: Progress,
               notes: List[str]) -> List[dict]:
    spec, batch, mode = CONFIGS[name]
    progress.describe(f"{name}: building")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' is_gradient_checkpointing rename
        suite = Suite(Workload(spec, mode, device), VARIANTS, None, notes)
        for v in list(suite.variants):
            suite.build(v)
        if parity:
            suite.parity(batch, progress)
        rows_by = {r["variant"]: r for r in run_cases(suite, {v: batch for v in suite.models}, 0, 1, progress)}
        # Timing: interleaved rounds over every variant (run_cases' own timing, kept here to get the raw
        # per-round times for the per-round ratios).
        cpu: Dict[str, List[float]] = {v: [] for v in suite.models}

        def timed(v):
            start = time.process_time()
            suite.step(v, batch)
            cpu[v].append(time.process_time() - start)

        steps = {v: functools.partial(timed, v) for v in suite.models}
        progress.plan(len(steps) * (rounds + warmup))
        progress.describe(f"{name}: timing")
        stats, raw = interleaved(steps, device, rounds, warmup, progress=progress)
        cpu = {v: t[warmup:] for v, t in cpu.items()}
        for v in list(suite.models):
            suite.drop(v)
    rows = [rows_by.get(v) or empty_row(v, batch, spec.seq, suite.status.get(v, "ok")) for v in VARIANTS]
    none = stats.get("none")
    for r in rows:
        v = r["variant"]
        variant = suite.variants.get(v)
        r.update(step_s=stats.get(v), config=name, model=spec.describe(), mode=mode, seq=spec.seq,
                 parity=suite.parity_results.get(v),
                 flags=noise_flags(stats.get(v), none, recomputes=bool(variant and variant.recomputes)))
        r["ratio_to_none"] = _ratio(raw, v, "none")
        r["cpu_s"] = quantiles(cpu[v]) if cpu.get(v) else None
    for kept, full in RATIOS:
        row = next(r for r in rows if r["variant"] == kept)
        row["ratio_to_full"] = _ratio(raw, kept, full)
        row["cpu_ratio_to_full"] = _ratio(cpu, kept, full)
        row["ratio_to_full_q"] = _ratio_q(raw, kept, full)
        row["cpu_ratio_to_full_q"] = _ratio_q(cpu, kept, full)
        row["full_variant"] = full
    # ours against torch's selective checkpointing, round by round: the difference of the savings
    torch_full = dict(RATIOS)[TORCH]
    for ours in TARGETS:
        row = next(r for r in rows if r["variant"] == ours)
        row["saving_vs_torch"] = _saving_difference(raw, ours, dict(RATIOS)[ours], TORCH, torch_full)
        row["cpu_saving_vs_torch"] = _saving_difference(cpu, ours, dict(RATIOS)[ours], TORCH, torch_full)
    return rows


def _per_round(raw: Dict[str, List[float]], a: str, b: str):
    """The per-round ratios a/b (None when either did not run every round)."""
    if not raw.get(a) or not raw.get(b) or len(raw[a]) != len(raw[b]):
        return None
    return [x / y for x, y in zip(raw[a], raw[b])]


def _ratio(raw: Dict[str, List[float]], a: str, b: str):
    """Median of the per-round ratios a/b (None when either did not run)."""
    r = _per_round(raw, a, b)
    return statistics.median(r) if r else None


def _ratio_q(raw: Dict[str, List[float]], a: str, b: str):
    """Quantiles (median, p20, p80, n) of the per-round ratios a/b."""
    r = _per_round(raw, a, b)
    return quantiles(r) if r else None


def _saving_difference(raw: Dict[str, List[float]], ours: str, ours_full: str, theirs: str, theirs_full: str):
    """Per round: ours's saving against its full recompute minus torch's against its own (positive: ours saves
    more). Quantiles of the differences, plus `at_least` (rounds where ours saved at least as much)."""
    a, b = _per_round(raw, ours, ours_full), _per_round(raw, theirs, theirs_full)
    if not a or not b:
        return None
    diffs = [(1 - x) - (1 - y) for x, y in zip(a, b)]
    q = quantiles(diffs)
    q["at_least"] = sum(d >= 0 for d in diffs)
    return q


def _judge(q) -> str:
    if q["median"] < 0 and q["p80"] < 0:
        return "MISSED"
    if q["median"] >= 0 and q["p20"] >= 0:
        return "met in >= 80% of rounds"
    if q["median"] >= 0:
        return "met (median; within the noise)"
    return "within the noise (median below)"


def _pct(q) -> str:
    return f"{q['median'] * 100:+.1f} pp (p20 {q['p20'] * 100:+.1f}, p80 {q['p80'] * 100:+.1f})"


def _qx(q) -> str:
    return f"{q['median']:.3f}x ({q['p20']:.3f}-{q['p80']:.3f}, n={q['n']})"


def verdict(rows: List[dict]) -> str:
    by = {(r["config"], r["variant"]): r for r in rows}
    lines = []
    for config in dict.fromkeys(r["config"] for r in rows):
        for ours_v in TARGETS:
            for what, key, diff in (("wall time", "ratio_to_full_q", "saving_vs_torch"),
                                    ("CPU time", "cpu_ratio_to_full_q", "cpu_saving_vs_torch")):
                ours, theirs = (by[(config, v)].get(key) for v in (ours_v, TORCH))
                d = by[(config, ours_v)].get(diff)
                if ours is None or theirs is None or d is None:
                    lines.append(f"- {config}, {ours_v}, {what}: target not judged (a variant did not run)")
                    continue
                lines.append(f"- {config}, {what}: {ours_v} / its full recompute = {_qx(ours)}, torch selective "
                             f"(SDPA kept) / torch full = {_qx(theirs)}; saving, ours minus torch's, per round: "
                             f"{_pct(d)}, ours >= torch's in {d['at_least']}/{d['n']} rounds: target (ours <= "
                             f"torch's) {_judge(d)}")
    return "\n".join(lines)


def to_markdown(info: dict, rows: List[dict], cfg: dict) -> str:
    lines = [f"# keep=\"attention\" against full recompute: {info['device_name']} ({info['device']})", "",
             env_line(info), "", f"{cfg['rounds']} interleaved rounds after {cfg['warmup']} warm-up round(s).", "",
             "| config | variant | status | step ms, median (p20-p80) | CPU ms, median | vs none | kept / its full "
             "recompute, median (p20-p80), wall; CPU | held fwd→bwd MiB | parity vs none | flags |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        full = (f"{_qx(r['ratio_to_full_q'])}; {_qx(r['cpu_ratio_to_full_q'])} ({r['full_variant']})"
                if r.get("ratio_to_full_q") else "-")
        none = f"{r['ratio_to_none']:.3f}x" if r.get("ratio_to_none") else "-"
        par = r.get("parity")
        par = "-" if not par else f"{par['max_rel_err']:.1e}{'' if par['ok'] else ' FAILED'}"
        cpu_ms = f"{r['cpu_s']['median'] * 1e3:.2f}" if r.get("cpu_s") else "-"
        lines.append(f"| {r['config']} | {r['variant']} | {r['status']} | {ms(r['step_s'])} | {cpu_ms} | {none} | {full} | "
                     f"{mib(r['activation_bytes'])} | {par} | {'; '.join(r['flags'])} |")
    lines += ["", verdict(rows), ""]
    lines += [f"- {c}: {CONFIGS[c][0].describe()}, batch {CONFIGS[c][1]}, {CONFIGS[c][2]}, attention dropout 0"
              for c in cfg["configs"]]
    lines += ["- ratios: medians of per-round ratios (both variants of a ratio run in every round), p20-p80 of the "
              "same, n rounds; the target line: per round, ours's saving against its full recompute minus torch's "
              "(percentage points; positive: ours saves more), its median and p20-p80; CPU time: the process's "
              "(time.process_time), which with --threads 1 measures work rather than the machine's load.",
              "- flags: `noisy` when the p20-p80 range exceeds 25% of the median; `implausible` when a variant that "
              "recomputes is faster than no checkpointing."]
    lines += [f"- {n}" for n in cfg["notes"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_keep_attention.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--configs", default="llama-s1024", help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--rounds", type=int, default=15, help="timed interleaved rounds (default 15)")
    p.add_argument("--warmup", type=int, default=1, help="untimed interleaved rounds first (default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--no-parity", action="store_true", help="skip the seeded parity step per variant")
    p.add_argument("--no-progress", action="store_true")
    add_output_args(p)
    args = p.parse_args(argv)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not names or any(c not in CONFIGS for c in names):
        p.error(f"--configs: choose from {', '.join(CONFIGS)}")
    if args.rounds < 1 or args.warmup < 0:
        p.error("--rounds must be at least 1, --warmup at least 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    info = env_info(device)
    notes: List[str] = []
    progress = Progress(enabled=not args.no_progress)
    rows: List[dict] = []
    try:
        for name in names:
            rows += run_config(name, device, args.rounds, args.warmup, not args.no_parity, progress, notes)
    finally:
        progress.close()
    cfg = {"configs": names, "rounds": args.rounds, "warmup": args.warmup, "variants": VARIANTS, "notes": notes,
           "argv": list(sys.argv[1:] if argv is None else argv)}
    md = to_markdown(finish_env(info), rows, cfg)
    print(md)
    result = {"env": info, "config": cfg, "rows": rows}
    result["files"] = write_results(output_dir(args, info), "keep-attention", result, md)
    print("wrote " + ", ".join(result["files"]), file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
