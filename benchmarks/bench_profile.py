"""Where a training step's time goes: one step per variant under torch.profiler.

Per (model, variant): the step time (timed without the profiler, after warm-up steps), then one profiled
step and the top kernels by self time with their call counts and share of the step's kernel time (on CUDA
the CUDA kernels, whose self times add up to the time the GPU was busy; on CPU the ATen ops by self CPU
time, the same table for a machine without a GPU). Variants: none (Hugging Face eager), fused
(ckpt_ext.fuse), ckpt_ext-fused (fuse + enable_checkpointing); models and steps as in benchmarks/variants.py
(loss = mean square of the last hidden state).

    python benchmarks/bench_profile.py                          # CUDA: BERT-large s512 b32 and Llama s2048 b4, bf16
    python benchmarks/bench_profile.py --models llama --top 40
    python benchmarks/bench_profile.py --tiny                   # CPU: the same families, tiny (2 layers, hidden 64)
    python benchmarks/bench_profile.py --models bert-large --variants hf-torch-nonreentrant,ckpt_ext-fused \
        --memory hf-torch-nonreentrant,ckpt_ext-fused           # CUDA: also what is live at each step's peak

--memory VARIANTS: after its profiled step, one more step of each of those variants with the allocator's history
recorded (peak_snapshot.py): the step's peak, the blocks live at it grouped by the line that allocated them, the
largest blocks. CUDA only (on CPU the rows say so).
"""
import argparse
import sys
import warnings
from typing import List

import torch

import peak_snapshot
from common import Timer, add_output_args, env_info, env_line, finish_env, free_memory, output_dir, short_error, write_results
from variants import MODELS, ModelSpec, Workload, make_variant

VARIANTS = ["none", "fused", "ckpt_ext-fused"]
# name -> (spec, batch, mode): the GPU yardstick's shapes (shared/gpu/side_by_side.py).
CONFIGS = {"bert-large": (MODELS["bert-large"], 32, "bf16"), "llama": (MODELS["llama"], 4, "bf16")}
TINY = {"bert-large": (ModelSpec("bert-tiny", "bert", 2, 64, 4, 32, 256, 1000), 2, "fp32"),
        "llama": (ModelSpec("llama-tiny", "llama", 2, 64, 4, 32, 256, 1000, kv_heads=2), 2, "fp32")}


def _self_time_us(evt, cuda: bool) -> float:
    if cuda:  # torch >= 2.4 calls it device time; older releases cuda time
        t = getattr(evt, "self_device_time_total", None)
        return float(t if t is not None else evt.self_cuda_time_total)
    return float(evt.self_cpu_time_total)


def profile_variant(workload: Workload, name: str, batch: int, warmup: int, top: int, memory: bool = False) -> dict:
    """Step time and the top kernels (or ops) of one profiled step of variant `name`; with `memory`, what is
    live at the peak of one more step (CUDA)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    device = workload.device
    cuda = device.type == "cuda"
    variant = make_variant(name)
    row = {"variant": name, "status": "ok", "step_ms": None, "total_self_ms": None, "kernels": [], "events": 0}
    model = None
    try:
        model = variant.setup(workload.fresh)
        variant.prepare(model, batch, workload, lambda b: 0)
        for _ in range(warmup):
            workload.step(variant, model, batch)
        row["step_ms"] = Timer(device)(lambda: workload.step(variant, model, batch)) * 1e3
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            workload.step(variant, model, batch)
            if cuda:
                torch.cuda.synchronize(device)
        want = DeviceType.CUDA if cuda else DeviceType.CPU
        events = [e for e in prof.key_averages() if e.device_type == want and _self_time_us(e, cuda) > 0]
        total = sum(_self_time_us(e, cuda) for e in events)
        events.sort(key=lambda e: _self_time_us(e, cuda), reverse=True)
        row.update(total_self_ms=total / 1e3, events=len(events), kernels=[
            {"name": e.key, "calls": e.count, "self_ms": _self_time_us(e, cuda) / 1e3,
             "share": _self_time_us(e, cuda) / total if total else None,
             "of_step": _self_time_us(e, cuda) / 1e3 / row["step_ms"] if row["step_ms"] else None}
            for e in events[:top]])
        if memory:
            row["memory"] = (peak_snapshot.record_step(lambda: workload.step(variant, model, batch), device) if cuda
                             else "the allocator's history is CUDA only")
    except Exception as e:
        row["status"] = f"error: {short_error(e)}"
    finally:
        if model is not None:
            variant.teardown(model)
        del model
        free_memory(device)
    return row


def to_markdown(info: dict, runs: List[dict], cfg: dict) -> str:
    cuda = info["device"].startswith("cuda")
    what = "CUDA kernels by self time" if cuda else "CPU ops (ATen) by self CPU time"
    lines = [f"# Where the step goes: {info['device_name']} ({info['device']})", "", env_line(info), "",
             f"One profiled step per variant after {cfg['warmup']} warm-up step(s); top {cfg['top']} {what}. "
             "share = self time / the self time of every kernel of the step (on CUDA: the time the GPU was busy); "
             "of step = self time / the step's time (one step timed without the profiler)."]
    for run in runs:
        for r in run["rows"]:
            head = f"\n## {run['config']} ({run['model']}, batch {run['batch']}, {run['mode']}): {r['variant']}"
            if r["status"] != "ok":
                lines += [head, "", r["status"]]
                continue
            lines += [head, "", f"step {r['step_ms']:.2f} ms; kernel self time {r['total_self_ms']:.2f} ms over "
                      f"{r['events']} distinct kernels", "", "| # | kernel | calls | self ms | share | of step |",
                      "|---|---|---|---|---|---|"]
            for i, k in enumerate(r["kernels"], 1):
                name = k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "..."
                of_step = f"{k['of_step']:.1%}" if k["of_step"] is not None else "-"
                lines.append(f"| {i} | `{name}` | {k['calls']} | {k['self_ms']:.3f} | {k['share']:.1%} | {of_step} |")
            mem = r.get("memory")
            if mem is not None:
                lines += ["", "### At the memory peak of one step", ""]
                lines += ([f"not recorded: {mem}"] if isinstance(mem, str) else
                          peak_snapshot.to_markdown_lines(r["variant"], mem))
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_profile.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list (default {', '.join(VARIANTS)})")
    p.add_argument("--top", type=int, default=25, help="kernels listed per run (default 25)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before the timed and the profiled one")
    p.add_argument("--memory", default="", help="comma list of variants whose step peak is also recorded (CUDA)")
    p.add_argument("--tiny", action="store_true", help="tiny models (2 layers, hidden 64, seq 32, batch 2, fp32)")
    add_output_args(p)
    args = p.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    if not names or any(m not in CONFIGS for m in names):
        p.error(f"--models: choose from {', '.join(CONFIGS)}")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    memory = [v.strip() for v in args.memory.split(",") if v.strip()]
    if any(v not in variants for v in memory):
        p.error("--memory: every variant named must also be in --variants")
    if args.top < 1 or args.warmup < 0:
        p.error("--top must be at least 1 and --warmup at least 0")
    device = torch.device(args.device)
    info = env_info(device)
    cfg = {"models": names, "variants": variants, "memory": memory, "top": args.top, "warmup": args.warmup, "tiny": args.tiny,
           "argv": list(sys.argv[1:] if argv is None else argv)}
    out = output_dir(args, info)
    runs: List[dict] = []
    result = {"env": info, "config": cfg, "runs": runs}
    for name in names:
        spec, batch, mode = (TINY if args.tiny else CONFIGS)[name]
        print(f"profiling {name}: {spec.describe()}, batch {batch}, {mode} on {device}", file=sys.stderr)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            workload = Workload(spec, mode, device)
            run = {"config": name, "model": spec.describe(), "batch": batch, "mode": mode, "rows": []}
            runs.append(run)
            for v in variants:  # written after each variant: a run cut off keeps what finished
                run["rows"].append(profile_variant(workload, v, batch, args.warmup, args.top, memory=v in memory))
                write_results(out, "profile", result, to_markdown(info, runs, cfg))
        del workload
        free_memory(device)
    md = to_markdown(finish_env(info), runs, cfg)
    print(md)
    result["files"] = write_results(out, "profile", result, md)
    print("wrote " + ", ".join(result["files"]), file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
