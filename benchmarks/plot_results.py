"""Step time against peak memory, per model and variant: one PNG and a summary table from results JSON.

Reads the two kinds of results that compare whole training steps of Hugging Face models:
  - the GPU yardstick's `side_by_side_<model>_a<attention dropout>_b<batch>_<mode>.json` (shared/gpu/side_by_side.py;
    the H200 run of 2026-11-27 is committed in benchmarks/results/h200/), peak = max allocated minus the weights;
  - `benchmarks/bench_fused.py`'s `fused*.json` (any device), peak = its `peak_bytes` (CUDA: allocated above the
    weights; CPU: activations held from forward to backward, as CPU has no allocator statistics).
One panel per model configuration; x = peak memory, y = step time (median), one marker per variant.

    python benchmarks/plot_results.py benchmarks/results/h200 --out benchmarks/results/h200/step_vs_memory.png
    python benchmarks/plot_results.py bench-out/cpu/fused.json        # what `make bench` measured
"""
import argparse
import glob
import json
import math
import os
import re
import sys
from typing import List, Optional

# One name per variant, whichever script measured it (side_by_side.py's keys, bench_fused.py's / suite's names).
LABELS = {
    "none": "HF eager",
    "hf-gc": "HF + torch checkpoint", "hf-torch-nonreentrant": "HF + torch checkpoint",
    "torch-sac": "torch selective (GEMMs + SDPA kept)",
    "ckpt_ext": "ckpt_ext.enable_checkpointing",
    "ckpt_ext-keep": 'enable_checkpointing(keep="attention")',
    "ckpt_ext-keep-attention": 'enable_checkpointing(keep="attention")',
    "fused": "ckpt_ext.fuse",
    "fused+ckpt": "fuse + enable_checkpointing", "ckpt_ext-fused": "fuse + enable_checkpointing",
    "fused+keep": 'fuse + keep="attention"',
}
# Marker and colour per label, so one legend serves every panel.
STYLE = {
    "HF eager": ("o", "#444444"),
    "HF + torch checkpoint": ("s", "#1f77b4"),
    "torch selective (GEMMs + SDPA kept)": ("P", "#17becf"),
    "ckpt_ext.enable_checkpointing": ("^", "#2ca02c"),
    'enable_checkpointing(keep="attention")': ("v", "#bcbd22"),
    "ckpt_ext.fuse": ("D", "#ff7f0e"),
    "fuse + enable_checkpointing": ("*", "#d62728"),
    'fuse + keep="attention"': ("X", "#9467bd"),
}
MODELS = {"bert-large": "BERT-large", "gpt2": "GPT-2 medium", "llama": "Llama 16x2048 GQA"}


def _side_by_side_title(path: str, data: dict) -> str:
    m = re.match(r"side_by_side_(.+?)_a([\d.]+)_b(\d+)_([a-z0-9]+)(?:_(.+))?\.json$", os.path.basename(path))
    if not m:
        return os.path.basename(path)
    model, drop, batch, mode, extra = m.groups()
    title = f"{MODELS.get(model, model)} s{data['seq']} b{batch}, {mode}"
    if float(drop):
        title += f", attn dropout {drop}"
    return title + (f" ({extra})" if extra else "")


def load(path: str) -> List[dict]:
    """Panels from one results file: [{title, device, torch, rows: [{variant, label, step_ms, peak_mib, error}]}]."""
    with open(path) as f:
        data = json.load(f)
    if "res" in data:  # side_by_side.py
        rows = []
        for key, r in data["res"].items():
            rows.append({"variant": key, "label": LABELS.get(key, key), "step_ms": r.get("median_ms"),
                         "peak_mib": r.get("peak_over_base_MiB"), "error": r.get("error")})
        return [{"title": _side_by_side_title(path, data), "device": data["device"], "torch": data["torch"],
                 "peak": "peak allocated over weights", "rows": rows}]
    if "rows" in data and "env" in data:  # bench_fused.py
        env = data["env"]
        cuda = env["device"].startswith("cuda")
        panels = {}
        for r in data["rows"]:
            p = panels.setdefault(r["config"], {
                "title": f"{r['model']} s{r['seq']} b{r['batch']}, {r['mode']}", "device": env["device_name"],
                "torch": env["torch"], "rows": [],
                "peak": "peak allocated over weights" if cuda else "activations held fwd→bwd"})
            ok = r["status"] == "ok" and r["step_s"]
            p["rows"].append({"variant": r["variant"], "label": LABELS.get(r["variant"], r["variant"]),
                              "step_ms": r["step_s"]["median"] * 1e3 if ok else None,
                              "peak_mib": r["peak_bytes"] / 2**20 if ok and r["peak_bytes"] is not None else None,
                              "error": None if ok else r["status"]})
        return list(panels.values())
    raise ValueError(f"{path}: neither side_by_side.py's nor bench_fused.py's results (no 'res', no 'rows')")


def load_all(paths: List[str]) -> List[dict]:
    files = []
    for p in paths:
        if os.path.isdir(p):
            # bf16 before autocast, a variant run (suffix) after its default run
            found = sorted(glob.glob(os.path.join(p, "side_by_side_*.json")) + glob.glob(os.path.join(p, "fused*.json")),
                           key=lambda f: f.replace("autocast", "~"))
            if not found:
                raise SystemExit(f"{p}: no side_by_side_*.json or fused*.json in it")
            files += found
        else:
            files.append(p)
    panels = [panel for f in files for panel in load(f)]
    if not panels:
        raise SystemExit("no results to plot")
    return panels


def summary_table(panels: List[dict]) -> str:
    """Markdown: per panel and variant, step ms, × HF eager, peak MiB (an error as its first words)."""
    lines = ["| model | variant | step ms | × HF eager | peak MiB |", "|---|---|---|---|---|"]
    for p in panels:
        eager = next((r["step_ms"] for r in p["rows"] if r["variant"] == "none" and r["step_ms"]), None)
        first = True
        for r in p["rows"]:
            model = p["title"] if first else ""
            first = False
            if r["step_ms"] is None:
                err = (r["error"] or "no result").split(":")[0].split("(")[0]
                lines.append(f"| {model} | {r['label']} | {err} | | |")
                continue
            ratio = f"{r['step_ms'] / eager:.3f}" if eager else "-"
            peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}" if r["peak_mib"] >= 100 else f"{r['peak_mib']:.1f}"
            lines.append(f"| {model} | {r['label']} | {r['step_ms']:.1f} | {ratio} | {peak} |")
    return "\n".join(lines) + "\n"


def plot(panels: List[dict], path: str, caption: Optional[str] = None) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = len(panels) + 1  # the last cell holds the legend
    cols = n if n <= 4 else 3
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(4.2 * cols, 3.4 * rows))
    FigureCanvasAgg(fig)
    seen = {}
    for i, p in enumerate(panels):
        ax = fig.add_subplot(rows, cols, i + 1)
        peaks = [r["peak_mib"] for r in p["rows"] if r["step_ms"] is not None and r["peak_mib"] is not None]
        unit, scale = ("GiB", 1024) if peaks and max(peaks) >= 1024 else ("MiB", 1)
        for r in p["rows"]:
            if r["step_ms"] is None or r["peak_mib"] is None:
                continue
            marker, color = STYLE.get(r["label"], ("o", None))
            h = ax.scatter([r["peak_mib"] / scale], [r["step_ms"]], marker=marker, color=color, s=70,
                           edgecolors="black", linewidths=0.5, zorder=3)
            seen.setdefault(r["label"], h)
        eager = next((r for r in p["rows"] if r["variant"] == "none" and r["step_ms"]), None)
        if eager:
            ax.axhline(eager["step_ms"], color="#999999", lw=0.8, ls="--", zorder=1)
        failed = [r["label"] for r in p["rows"] if r["step_ms"] is None]
        if failed:
            ax.text(0.02, 0.02, "failed: " + ", ".join(failed), transform=ax.transAxes, fontsize=7, color="#9467bd")
        ax.set_title(p["title"], fontsize=9)
        ax.set_xlabel(f"{p['peak']}, {unit}", fontsize=8)
        ax.set_ylabel("step ms (median)", fontsize=8)
        ax.set_xlim(left=0)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    legend_ax = fig.add_subplot(rows, cols, n)
    legend_ax.axis("off")
    legend_ax.legend(list(seen.values()), list(seen), loc="center", fontsize=8, frameon=False,
                     title="lower left is better; dashed: HF eager", title_fontsize=8)
    devices = sorted({f"{p['device']}, torch {p['torch']}" for p in panels})
    fig.suptitle(caption or "; ".join(devices), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/plot_results.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="results JSON files, or folders holding them")
    ap.add_argument("--out", default=None, help="PNG to write (default: step_vs_memory.png beside the first input)")
    ap.add_argument("--caption", default=None, help="figure title (default: the devices and torch versions)")
    args = ap.parse_args(argv)
    panels = load_all(args.results)
    print(summary_table(panels))
    first = args.results[0]
    out = args.out or os.path.join(first if os.path.isdir(first) else os.path.dirname(first) or ".",
                                   "step_vs_memory.png")
    try:
        print(f"wrote {plot(panels, out, args.caption)}", file=sys.stderr)
    except ImportError as e:
        print(f"no plot: {e} (pip install '.[bench]')", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
