"""The model suite's report: the markdown tables (per batch, and the largest batch per variant) and
the plots (matplotlib, optional)."""
import sys
from typing import List

from common import env_line, mib, ms


def _ratio(r, ref):
    return f"{ref / r['tokens_per_s']:.2f}x" if r["step_s"] and ref else "-"


def _frag(r) -> str:
    if r["fragmentation_bytes"] is None or not r["peak_reserved_bytes"]:
        return "-"
    return f"{mib(r['fragmentation_bytes'])} ({r['fragmentation_bytes'] / r['peak_reserved_bytes']:.1%})"


def _parity(r) -> str:
    p = r.get("parity")
    if not p:
        return "-"
    return f"{p['max_rel_err']:.1e}" + ("" if p["ok"] else " FAILED")


def batch_table(rows: List[dict], cuda: bool) -> List[str]:
    head = ("| variant | batch | status | step ms, median (p20-p80) | time/token vs none | tokens/s | activations MiB "
            "| parity vs none | graph breaks |")
    sep = "|---|---|---|---|---|---|---|---|---|"
    if cuda:
        head += " peak allocated MiB | peak reserved MiB |"
        sep += "---|---|"
    lines = [head + " flags |", sep + "---|"]
    none_tps = {r["batch"]: r["tokens_per_s"] for r in rows if r["variant"] == "none" and r["tokens_per_s"]}
    for r in rows:
        cells = [r["variant"], str(r["batch"] or "-"), r["status"], ms(r["step_s"]),
                 _ratio(r, none_tps.get(r["batch"])), f"{r['tokens_per_s']:.0f}" if r["step_s"] else "-",
                 mib(r["activation_bytes"]), _parity(r),
                 "-" if r.get("graph_breaks") is None else str(r["graph_breaks"])]
        if cuda:
            cells += [mib(r["peak_allocated_bytes"]), mib(r["peak_reserved_bytes"])]
        lines.append("| " + " | ".join(cells + ["; ".join(r["flags"])]) + " |")
    return lines


def max_batch_table(rows: List[dict], cuda: bool) -> List[str]:
    lines = ["| variant | status | largest batch | tokens/s at it | step ms, median (p20-p80) | peak allocated MiB | "
             "peak reserved MiB | reserved − allocated at peak, MiB (of reserved) | parity vs none | flags |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        frag = _frag(r) if cuda else "n/a (CPU)"
        cells = [r["variant"], r["status"], str(r["batch"]) if r["status"] == "ok" or r["batch"] else "-",
                 f"{r['tokens_per_s']:.0f}" if r["step_s"] else "-", ms(r["step_s"]),
                 mib(r["peak_allocated_bytes"]) if cuda else "n/a (CPU)",
                 mib(r["peak_reserved_bytes"]) if cuda else "n/a (CPU)", frag, _parity(r), "; ".join(r["flags"])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def to_markdown(result: dict) -> str:
    info, cfg, rows = result["env"], result["config"], result["rows"]
    cuda = info["device"].startswith("cuda")
    shrunk = " (shrunk for CPU; --full for the real size)" if cfg["cpu_small"] else ""
    lines = [f"# ckpt_ext benchmark suite: {cfg['model']} on {info['device_name']} ({info['device']})", "",
             env_line(info), "",
             f"Model: {cfg['model_description']}{shrunk}; mode {cfg['mode']}; batch {cfg['batch']}; "
             f"{cfg['repeat']} timed rounds after {cfg['warmup']} warm-up step(s) per variant.", ""]
    if cfg.get("lora"):
        lines += [f"Adapters: {cfg['lora']['description']}; every variant runs on the peft model "
                        "(`fused` = ckpt_ext.fuse(peft model)).", ""]
    if cfg["batch"] == "max":
        lines += max_batch_table(rows, cuda)
        lines += ["", f"- largest batch: doubling then bisection up to {cfg['max_batch']}, each variant alone on "
                  "the device; then timed alone at that batch."]
        if not cuda:
            lines.append("- CPU: no out-of-memory error to search against; the cap comes from an estimate of the "
                         "available memory, and allocator fragmentation does not apply.")
    else:
        lines += batch_table(rows, cuda)
        lines += ["", "- activations: bytes held from forward to backward (unique storages saved for backward, "
                  "parameters excluded, the selective-checkpointing cache and ckpt_ext's pool slots included).",
                  "- time/token vs none: time per token relative to `none` at the same batch."]
        if cuda:
            lines.append("- peak allocated/reserved: during one step, as if the model were alone on the device; "
                         "parameters and gradients included.")
    lines.append("- parity vs none: one seeded step per variant at the smallest batch on a dropout-free copy; the "
                 "largest difference of the loss and of every trainable parameter's gradient from `none`'s, relative "
                 "to that tensor's largest magnitude, at least 1/1000 of the largest (FAILED above the mode's tolerance, also flagged).")
    lines.append("- flags: `noisy` when the p20-p80 range exceeds 25% of the median; `implausible` when a variant "
                 "that recomputes on none's kernels is faster than none.")
    for r in rows:
        if r["budget_bytes"]:
            lines.append(f"- ckpt_ext-budget at batch {r['batch']}: budget {mib(r['budget_bytes'])} MiB.")
    for v, s in result.get("variant_summaries", {}).items():
        lines.append(f"- `{v}`: {s}.")
    for n in result["notes"]:
        lines.append(f"- {n}")
    return "\n".join(lines) + "\n"


def _figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(8, 5))
    FigureCanvasAgg(fig)
    return fig


def plot_memory_vs_time(result: dict, path: str) -> None:
    cuda = result["env"]["device"].startswith("cuda")
    key, label = (("peak_allocated_bytes", "peak allocated, MiB") if cuda
                  else ("activation_bytes", "activations held forward→backward, MiB"))
    fig = _figure()
    ax = fig.add_subplot()
    for v in dict.fromkeys(r["variant"] for r in result["rows"]):
        pts = sorted((r for r in result["rows"] if r["variant"] == v and r["step_s"] and r[key] is not None),
                     key=lambda r: r["batch"])
        if not pts:
            continue
        x = [r["step_s"]["median"] * 1e3 for r in pts]
        y = [r[key] / 2**20 for r in pts]
        err = [[(r["step_s"]["median"] - r["step_s"]["p20"]) * 1e3 for r in pts],
               [(r["step_s"]["p80"] - r["step_s"]["median"]) * 1e3 for r in pts]]
        ax.errorbar(x, y, xerr=err, marker="o", capsize=3, label=v)
        for r, xi, yi in zip(pts, x, y):
            ax.annotate(f"b{r['batch']}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_title(f"{result['config']['model']} on {result['env']['device_name']}: memory against step time",
                 fontsize=10)
    ax.set_xlabel("step time, ms (median, p20-p80)")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    if ax.has_data():
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_max_batch(result: dict, path: str) -> None:
    fig = _figure()
    ax = fig.add_subplot()
    names = list(result["max_batch"])
    values = [result["max_batch"][n] for n in names]
    ax.barh(names, values)
    for i, val in enumerate(values):
        ax.annotate(str(val), (val, i), textcoords="offset points", xytext=(4, -3), fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"largest batch (seq {result['config']['seq']}, cap {result['config']['max_batch']})")
    ax.set_title(f"{result['config']['model']} on {result['env']['device_name']}: largest batch per variant",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plots(result: dict, stem: str) -> List[str]:
    """<stem>.png (memory against time, or the largest batches); [] without matplotlib."""
    try:
        if result["max_batch"] is not None:
            plot_max_batch(result, stem + ".png")
        else:
            plot_memory_vs_time(result, stem + ".png")
    except ImportError as e:
        print(f"no plots: {e} (pip install '.[bench]')", file=sys.stderr)
        return []
    return [stem + ".png"]
