"""Side-by-side benchmark of checkpointing tools (``make bench``).

Variants: no checkpointing, torch.utils.checkpoint (non-reentrant and reentrant), ckpt_ext.checkpoint.
Three workloads on the best device present (CUDA if available, else CPU):
  * per-call cost: a stack of many tiny blocks, every block checkpointed -- what a checkpointed call
    costs beyond the computation it replays;
  * blocks that end in a GEMM (fc2(gelu(fc1(x))), and the same plus a residual add), every block
    checkpointed: the replay's early stop must skip the last GEMM as torch's does (step time vs torch);
  * a small BERT encoder (Hugging Face, random weights): median step time and the bytes held from
    forward to backward (saved tensors plus the ckpt_ext pool; on CUDA also peak allocated/reserved).
Timings are medians over interleaved rounds (each round runs every variant once), with 20th/80th
percentiles. Results: a markdown table on stdout and engine.{md,json} in bench-out/<device>/ (or --out;
--save-results writes the committed benchmarks/results/<device>/). The model-level suite is
benchmarks/suite.py.
"""
import argparse
import functools
import statistics
import sys
import time

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import ckpt_ext
from common import (Progress, add_output_args, env_info, env_line, finish_env, held_bytes, hf_checkpointing_disable,
                    hf_checkpointing_enable, interleaved, mib, ms, noise_flags, output_dir, write_results)

VARIANTS = {
    "none": None,
    "torch.utils.checkpoint (non-reentrant)": functools.partial(torch_checkpoint, use_reentrant=False),
    "torch.utils.checkpoint (reentrant)": functools.partial(torch_checkpoint, use_reentrant=True),
    "ckpt_ext.checkpoint": functools.partial(ckpt_ext.checkpoint, use_reentrant=False),
}


# ------------------------------------------------------------------------------------------- workloads
class Tiny(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.fc(x))


def time_stack(blocks, x, variants, device, rounds, warmup, progress=None):
    """Interleaved step times of `blocks` run in turn on x, each block called through each variant's
    checkpoint (None: plainly), then backward. Returns (stats by variant, median process CPU time per step
    by variant: robust to other load on the machine; warmup rounds left out)."""
    cpu_times = {k: [] for k in variants}

    def step(name, ckpt):
        def run():
            t0 = time.process_time()
            h = x
            for b in blocks:
                h = b(h) if ckpt is None else ckpt(b, h)
            h.sum().backward()
            cpu_times[name].append(time.process_time() - t0)
        return run

    stats, _ = interleaved({k: step(k, v) for k, v in variants.items()}, device, rounds, warmup=warmup, progress=progress)
    return stats, {k: statistics.median(v[warmup:]) for k, v in cpu_times.items()}


def bench_per_call(device, n_blocks, width, rounds, progress=None):
    torch.manual_seed(0)
    blocks = nn.ModuleList(Tiny(width) for _ in range(n_blocks)).to(device)
    x = torch.randn(4, width, device=device, requires_grad=True)

    stats, cpu = time_stack(blocks, x, VARIANTS, device, rounds, warmup=5, progress=progress)
    base = stats["none"]["median"]
    rows = []
    for k, s in stats.items():
        rows.append({"variant": k, "step_s": s, "per_call_us": (s["median"] - base) / n_blocks * 1e6 if k != "none" else 0.0,
                     "per_call_cpu_us": (cpu[k] - cpu["none"]) / n_blocks * 1e6 if k != "none" else 0.0,
                     "flags": noise_flags(s, stats["none"], recomputes=k != "none")})
    return rows


class GemmEnded(nn.Module):
    def __init__(self, d, residual):
        super().__init__()
        self.fc1, self.fc2, self.residual = nn.Linear(d, d), nn.Linear(d, d), residual

    def forward(self, x):
        y = self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        return x + y if self.residual else y


def bench_gemm_ended(device, n_blocks, width, rows, rounds, progress=None):
    """Step time of n_blocks GemmEnded blocks, each checkpointed, without and with a residual add."""
    out = []
    for residual in (False, True):
        torch.manual_seed(0)
        blocks = nn.ModuleList(GemmEnded(width, residual) for _ in range(n_blocks)).to(device)
        x = torch.randn(rows, width, device=device, requires_grad=True)

        variants = {k: v for k, v in VARIANTS.items() if "(reentrant)" not in k}
        stats, cpu = time_stack(blocks, x, variants, device, rounds, warmup=3, progress=progress)
        torch_name = "torch.utils.checkpoint (non-reentrant)"
        ref = stats[torch_name]["median"]
        out.append({"residual": residual, "rows": [
            {"variant": k, "step_s": s, "vs_torch": s["median"] / ref, "cpu_s": cpu[k],
             "vs_torch_cpu": cpu[k] / cpu[torch_name],
             "flags": noise_flags(s, stats["none"], recomputes=k != "none")} for k, s in stats.items()]})
    return out


def bench_bert(device, layers, hidden, heads, seq, batch, rounds, dtype, progress=None):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=4 * hidden, max_position_embeddings=max(512, seq), vocab_size=1000)
    model = BertModel(cfg, add_pooling_layer=False).to(device).train()
    ids = torch.randint(0, 1000, (batch, seq), device=device)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def configure(variant):
        ckpt_ext.disable_checkpointing(model)
        hf_checkpointing_disable(model)
        if variant == "ckpt_ext.checkpoint":
            ckpt_ext.enable_checkpointing(model)
        elif variant != "none":
            hf_checkpointing_enable(model, use_reentrant="non-reentrant" not in variant)

    def forward():
        with autocast:
            return model(input_ids=ids).last_hidden_state.float().pow(2).mean()

    def step():
        model.zero_grad(set_to_none=True)
        forward().backward()

    stats, _ = interleaved({k: step for k in VARIANTS}, device, rounds, warmup=2, setup=configure, progress=progress)
    rows = []
    for k in VARIANTS:
        configure(k)
        model.zero_grad(set_to_none=True)
        mem = held_bytes(forward, list(model.parameters()), device)
        rows.append({"variant": k, "step_s": stats[k], "flags": noise_flags(stats[k], stats["none"], k != "none"),
                     **mem})
    configure("none")
    return rows


# ---------------------------------------------------------------------------------------------- output
def to_markdown(info, per_call, per_call_cfg, bert, bert_cfg, gemm, gemm_cfg):
    lines = [f"# ckpt_ext engine benchmark — {info['device_name']} ({info['device']})", "",
             env_line(info), "",
             f"## Per-call cost: {per_call_cfg['blocks']} tiny blocks (Linear {per_call_cfg['width']} + tanh, batch 4), "
             "every block checkpointed", "",
             "| variant | step ms, median (p20-p80) | per-call overhead µs | vs torch non-reentrant "
             "| per-call CPU time µs | vs torch (CPU time) | flags |",
             "|---|---|---|---|---|---|---|"]
    torch_row = next(r for r in per_call if "non-reentrant" in r["variant"])
    ref, ref_cpu = torch_row["per_call_us"], torch_row["per_call_cpu_us"]
    for r in per_call:
        ratio = f"{r['per_call_us'] / ref:.2f}x" if r["variant"] != "none" and ref > 0 else "-"
        ratio_cpu = f"{r['per_call_cpu_us'] / ref_cpu:.2f}x" if r["variant"] != "none" and ref_cpu > 0 else "-"
        lines.append(f"| {r['variant']} | {ms(r['step_s'])} | {r['per_call_us']:.1f} | {ratio} "
                     f"| {r['per_call_cpu_us']:.1f} | {ratio_cpu} | {'; '.join(r['flags'])} |")
    for case in gemm:
        lines += ["", f"## {gemm_cfg['blocks']} blocks ending in a GEMM: fc2(gelu(fc1(x))){' + x' if case['residual'] else ''}, "
                  f"Linear {gemm_cfg['width']}x{gemm_cfg['width']}, {gemm_cfg['rows']} rows, float32, every block checkpointed", "",
                  "| variant | step ms, median (p20-p80) | vs torch non-reentrant | step CPU time ms | vs torch (CPU time) "
                  "| flags |", "|---|---|---|---|---|---|"]
        for r in case["rows"]:
            lines.append(f"| {r['variant']} | {ms(r['step_s'])} | {r['vs_torch']:.3f}x | {r['cpu_s'] * 1e3:.2f} "
                         f"| {r['vs_torch_cpu']:.3f}x | {'; '.join(r['flags'])} |")
    if bert:
        lines += ["", f"## BERT encoder: {bert_cfg['layers']} layers, hidden {bert_cfg['hidden']}, {bert_cfg['heads']} heads, "
                  f"seq {bert_cfg['seq']}, batch {bert_cfg['batch']}, {bert_cfg['dtype']}", ""]
        cuda = info["device"].startswith("cuda")
        if cuda:
            lines += ["| variant | step ms, median (p20-p80) | vs none | held fwd→bwd MiB | peak allocated MiB | peak reserved MiB "
                      "| flags |", "|---|---|---|---|---|---|---|"]
        else:
            lines += ["| variant | step ms, median (p20-p80) | vs none | held fwd→bwd MiB (saved + pool) | flags |",
                      "|---|---|---|---|---|"]
        base = bert[0]["step_s"]["median"]
        for r in bert:
            row = f"| {r['variant']} | {ms(r['step_s'])} | {r['step_s']['median'] / base:.2f}x | "
            if cuda:
                row += f"{mib(r['held_bytes'])} | {mib(r['peak_allocated'])} | {mib(r['peak_reserved'])} |"
            else:
                row += f"{mib(r['held_bytes'])} ({mib(r['saved_bytes'])} + {mib(r['pool_bytes'])}) |"
            row += f" {'; '.join(r['flags'])} |"
            lines.append(row)
    lines += ["", "per-call overhead = (step time of the variant − step time without checkpointing) / blocks; the CPU "
              "time columns use the process's CPU time instead of wall time (not inflated by other processes; on "
              "CUDA it misses time the host waits for the device).",
              "held fwd→bwd: bytes kept alive between forward and backward (parameters excluded).",
              "flags: `noisy` when the p20-p80 range exceeds 25% of the median; `implausible` when a checkpointed "
              "variant is faster than no checkpointing."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default: 60 CPU / 100 CUDA for per-call)")
    p.add_argument("--gemm-blocks", type=int, default=8)
    p.add_argument("--gemm-width", type=int, default=512)
    p.add_argument("--gemm-rows", type=int, default=None, help="rows of the GEMM-ended blocks' input (default: 256 CPU, 4096 CUDA)")
    p.add_argument("--gemm-rounds", type=int, default=None, help="timed rounds of the GEMM-ended blocks (default: 30)")
    p.add_argument("--skip-bert", action="store_true", help="leave out the BERT encoder workload")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (CPU; 1 makes CPU time a measure of work on a loaded machine)")
    p.add_argument("--bert-layers", type=int, default=None)
    p.add_argument("--bert-hidden", type=int, default=None)
    p.add_argument("--bert-seq", type=int, default=None)
    p.add_argument("--bert-batch", type=int, default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--no-progress", action="store_true")
    add_output_args(p)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    rounds = args.rounds or (100 if cuda else 60)
    bert_cfg = {"layers": args.bert_layers or (12 if cuda else 6), "hidden": args.bert_hidden or (768 if cuda else 256),
                "seq": args.bert_seq or (512 if cuda else 128), "batch": args.bert_batch or (16 if cuda else 4),
                "dtype": args.dtype or ("bfloat16" if cuda else "float32")}
    bert_cfg["heads"] = max(1, bert_cfg["hidden"] // 64)
    per_call_cfg = {"blocks": args.blocks, "width": args.width}

    info = env_info(device)
    gemm_cfg = {"blocks": args.gemm_blocks, "width": args.gemm_width, "rows": args.gemm_rows or (4096 if cuda else 256)}
    gemm_rounds, bert_rounds = args.gemm_rounds or 30, max(5, rounds // 6)
    progress = Progress(enabled=not args.no_progress)
    # steps the bar counts: interleaved rounds (warm-up included) x variants, as each part runs them
    progress.plan((rounds + 5) * len(VARIANTS) + 2 * (gemm_rounds + 3) * (len(VARIANTS) - 1)
                  + (0 if args.skip_bert else (bert_rounds + 2) * len(VARIANTS)))
    try:
        progress.describe(f"per-call: {args.blocks} blocks")
        per_call = bench_per_call(device, args.blocks, args.width, rounds, progress)
        progress.describe("GEMM-ended blocks")
        gemm = bench_gemm_ended(device, gemm_cfg["blocks"], gemm_cfg["width"], gemm_cfg["rows"], gemm_rounds, progress)
        bert = []
        if not args.skip_bert:
            progress.describe(f"BERT {bert_cfg['layers']}x{bert_cfg['hidden']}")
            bert = bench_bert(device, bert_cfg["layers"], bert_cfg["hidden"], bert_cfg["heads"], bert_cfg["seq"],
                              bert_cfg["batch"], bert_rounds, getattr(torch, bert_cfg["dtype"]), progress)
    finally:
        progress.close()
    md = to_markdown(finish_env(info), per_call, per_call_cfg, bert, bert_cfg, gemm, gemm_cfg)
    print(md)
    result = {"env": info, "per_call": {"config": per_call_cfg, "rows": per_call},
              "gemm_ended": {"config": gemm_cfg, "cases": gemm}, "bert": {"config": bert_cfg, "rows": bert}}
    result["files"] = write_results(output_dir(args, info), "engine", result, md)
    print("wrote " + ", ".join(result["files"]), file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
