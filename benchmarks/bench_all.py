"""`make bench`: the default benchmark set, one process per part, then a summary table and a plot.

Parts (each its own script, run in its own process so that one part's settings -- threads, the CPU heap
policy of bench_ops -- do not leak into the next; results in bench-out/<device>/ unless --out):
  engine  benchmarks/bench_checkpoint.py  per-call cost of a checkpointed call, GEMM-ended blocks (CPU: its BERT
                                          workload is left out: bench_fused measures whole models)
  ops     benchmarks/bench_ops.py         every fused op against torch eager: µs, GB/s
  fused   benchmarks/bench_fused.py       BERT-large, GPT-2 medium, Llama: HF eager, HF + torch checkpoint,
                                          enable_checkpointing, fuse, fuse + checkpointing (CPU: shrunk models,
                                          bf16 only, 5 rounds)
Sized for a 2-core CPU: 52 s for the three parts, measured 2026-11-27 (engine 17 s, ops 16 s, fused 18 s;
docs/benchmarks.md); `make bench` adds the venv and the build, about 3 minutes on a fresh clone. On a GPU the parts run at their full, GPU-sized
defaults (every configuration of bench_fused, as in README's H200 table).
At the end: one table (step time, × HF eager, peak memory per model and variant; per-call overhead against
torch; the fused ops' speed-ups) and bench-out/<device>/step_vs_memory.png (benchmarks/plot_results.py).

    python benchmarks/bench_all.py                     # what make bench runs
    python benchmarks/bench_all.py --parts fused       # one part
    python benchmarks/bench_all.py --quick             # fewer rounds, only to see that everything runs (~4 min CPU)
"""
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from common import DEFAULT_OUT, device_dir_name, env_info, env_line, finish_env
import plot_results

HERE = os.path.dirname(os.path.abspath(__file__))
# name -> (script, what it measures, CPU options, CUDA options, --quick options (override the others), results stem,
#          expected seconds on the 2-core CPU machine, quiet). An option with the value None is a flag.
PARTS = {
    "engine": ("bench_checkpoint.py", "per-call cost of a checkpointed call",
               {"--skip-bert": None}, {}, {"--rounds": "20", "--gemm-rounds": "10"}, "engine", 40),
    "ops": ("bench_ops.py", "fused ops against torch eager", {}, {}, {"--rounds": "3", "--dtype": "float32"}, "ops", 60),
    # CPU: BERT-large autocast left out (on CPU it measures what bf16 does, at the same cost: ~100 s)
    "fused": ("bench_fused.py", "fused layers and checkpointing against Hugging Face",
              {"--configs": "bert-large-bf16,gpt2-medium-bf16,llama-bf16", "--rounds": "5", "--warmup": "1"}, {},
              {"--rounds": "2", "--warmup": "1"}, "fused", 330),
}


def part_argv(name: str, device: str, out: str, quick: bool) -> list:
    script, _, cpu_opts, cuda_opts, quick_opts = PARTS[name][:5]
    opts = {"--device": device, "--out": out, **(cuda_opts if device.startswith("cuda") else cpu_opts),
            **(quick_opts if quick else {})}
    argv = [sys.executable, os.path.join(HERE, script)]
    for k, v in opts.items():
        argv += [k] if v is None else [k, v]
    return argv


def run_part(name: str, device: str, out: str, quick: bool, index: int, count: int) -> dict:
    script, what, stem, expected = PARTS[name][0], PARTS[name][1], PARTS[name][5], PARTS[name][6]
    argv = part_argv(name, device, out, quick)
    hint = "" if device.startswith("cuda") else f"; about {expected // 60 or 1} min on 2 quiet cores"
    print(f"\n=== [{index}/{count}] {name}: {what} ({script} {' '.join(argv[2:])}{hint})", file=sys.stderr, flush=True)
    start, wall_start = time.monotonic(), time.time()
    proc = subprocess.run(argv, cwd=os.path.dirname(HERE))
    took = time.monotonic() - start
    print(f"=== {name}: {'done' if proc.returncode == 0 else f'FAILED (exit {proc.returncode})'} in {took:.0f} s",
          file=sys.stderr, flush=True)
    # <stem>.json, or <stem>-<configs>.json for a subset (bench_fused): the newest one this run wrote
    written = [p for p in glob.glob(os.path.join(out, stem + "*.json")) if os.path.getmtime(p) >= wall_start - 1]
    if proc.returncode != 0 or not written:
        return {"name": name, "ok": False, "seconds": took, "path": None}
    return {"name": name, "ok": True, "seconds": took, "path": max(written, key=os.path.getmtime)}


def engine_summary(path: str) -> list:
    with open(path) as f:
        data = json.load(f)
    rows = {r["variant"]: r for r in data["per_call"]["rows"]}
    torch_row = next((r for v, r in rows.items() if "non-reentrant" in v), None)
    ours = next((r for v, r in rows.items() if v.startswith("ckpt_ext")), None)
    lines = []
    if torch_row and ours and torch_row["per_call_us"] > 0:
        lines.append(f"- per checkpointed call: ckpt_ext.checkpoint {ours['per_call_us']:.1f} µs, torch.utils.checkpoint "
                     f"(non-reentrant) {torch_row['per_call_us']:.1f} µs: **{ours['per_call_us'] / torch_row['per_call_us']:.2f}x**")
    for case in data["gemm_ended"]["cases"]:
        mine = next((r for r in case["rows"] if r["variant"].startswith("ckpt_ext")), None)
        if mine:
            lines.append(f"- blocks ending in a GEMM{' + residual' if case['residual'] else ''}: ckpt_ext step "
                         f"**{mine['vs_torch']:.2f}x** torch non-reentrant's (early stop skips the last GEMM)")
    return lines


def ops_summary(path: str) -> list:
    with open(path) as f:
        data = json.load(f)
    ok = [r for r in data["rows"] if r.get("speedup")]
    if not ok:
        return ["- fused ops: no op measured"]
    by_dtype = {}
    for r in ok:
        by_dtype.setdefault(r["dtype"], []).append(r)
    lines = []
    for dtype, rows in by_dtype.items():
        s = [r["speedup"] for r in rows]
        slow = [f"{r['op']} {r['speedup']:.2f}x" for r in rows if r["speedup"] < 1]
        lines.append(f"- fused ops, {dtype}: eager / ours median **{statistics.median(s):.2f}x** over {len(rows)} ops "
                     f"(range {min(s):.2f}x-{max(s):.2f}x)" + (f"; below eager: {', '.join(slow)}" if slow else ""))
    failed = [r["op"] for r in data["rows"] if not r.get("speedup")]
    if failed:
        lines.append(f"- fused ops not measured here: {', '.join(sorted(set(failed)))}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_all.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--quick", action="store_true", help="fewer rounds: checks that everything runs, not a measurement")
    p.add_argument("--out", default=None, help="results folder (default bench-out/<device>, untracked)")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.parts.split(",") if n.strip()]
    if not names or any(n not in PARTS for n in names):
        p.error(f"--parts: choose from {', '.join(PARTS)}")
    info = env_info(args.device)
    out = args.out or os.path.join(DEFAULT_OUT, device_dir_name(info))
    start = time.monotonic()
    done = [run_part(n, args.device, out, args.quick, i + 1, len(names)) for i, n in enumerate(names)]
    finish_env(info)

    lines = [f"# ckpt_ext benchmark summary: {info['device_name']} ({info['device']})", "", env_line(info), ""]
    if args.quick:
        lines += ["**--quick: too few rounds to be a measurement.**", ""]
    by = {d["name"]: d for d in done}
    plot_path = None
    if by.get("fused", {}).get("path"):
        panels = plot_results.load(by["fused"]["path"])
        cuda = info["device"].startswith("cuda")
        lines += ["## Whole training steps (bench_fused.py; " + ("peak = allocated above the weights" if cuda else
                  "CPU: shrunk models -- 4 layers, hidden 256, seq 128; peak = activations held from forward to "
                  "backward") + ")", "", plot_results.summary_table(panels)]
        try:
            plot_path = plot_results.plot(panels, os.path.join(out, "step_vs_memory.png"),
                                          f"ckpt_ext on {info['device_name']}, torch {info['torch']}, "
                                          f"transformers {info['transformers']}, commit {info['git_commit'] or '?'}, "
                                          f"{info['date'][:10]}")
        except ImportError as e:
            lines.append(f"(no plot: {e}; pip install '.[bench]')")
    other = []
    if by.get("engine", {}).get("path"):
        other += engine_summary(by["engine"]["path"])
    if by.get("ops", {}).get("path"):
        other += ops_summary(by["ops"]["path"])
    if other:
        lines += ["## Checkpoint engine and fused ops", ""] + other + [""]
    failed = [d["name"] for d in done if not d["ok"]]
    lines.append("Parts: " + ", ".join(f"{d['name']} {d['seconds']:.0f} s{'' if d['ok'] else ' FAILED'}" for d in done)
                 + f"; {time.monotonic() - start:.0f} s in all. Full tables: {out}/*.md")
    if plot_path:
        lines.append(f"Plot: {plot_path}")
    summary = "\n".join(lines) + "\n"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(summary)
    print("\n" + summary)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
