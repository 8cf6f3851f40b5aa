"""torch.compile against eager, per checkpointing variant: compile cost, Dynamo's counters, steady-state step.

Variants (each its own copy of the same BERT weights): none (Hugging Face, no checkpointing), hf-torch (Hugging
Face's checkpointing, torch.utils.checkpoint non-reentrant), ckpt_ext (enable_checkpointing), fused+ckpt (fuse,
then enable_checkpointing); optionally fused (fuse alone). Each runs eagerly and under torch.compile (inductor,
default options unless --mode). Per (variant, compiled or eager):

* first step seconds (compiled: Dynamo + AOTAutograd + inductor for forward and backward, the compile cost);
* Dynamo's counters (torch._dynamo.utils.counters) over the whole run: unique graphs compiled in the first step
  and after it (a recompile: it should be 0), graph breaks;
* steady state: after --warmup untimed steps (>= 3, so that lazy backward compiles and one-time allocations are
  behind), --rounds interleaved rounds over every (variant, compiled/eager) pair, the median with p20-p80;
* on CUDA the peak memory allocated above the weights in one step.

`fused` (fuse alone) is measured after the others, in a phase of its own from a reset Dynamo: compiled, its fused
layers run eagerly between graphs (docs/compile.md), and a model that breaks its graph there changes what Dynamo
does with transformers' shared frames for the models compiled beside it.

    python benchmarks/bench_compile.py --layers 6 --out DIR    # BERT-large width (hidden 1024, 16 heads), s512 b32,
                                                               # bf16 on CUDA, attention dropout 0.1
    python benchmarks/bench_compile.py --tiny --out DIR        # a CPU-sized config: the whole run in about a minute
    python benchmarks/bench_compile.py --layers 24 --profile   # also a profile of one steady step per pair

From a checkout built in place, run it as the other benchmarks, with PYTHONPATH=. (else `import ckpt_ext` finds
whatever is installed; the table names the folder it imported).

Writes DIR/compile.json and DIR/compile.md (default bench-out/<device>/). The model, loss and step are those of
the H200 probe (shared/gpu/results/2026-11-27-h200/compile_probe.py), so the two can be compared; unlike the
probe, the timing starts after the warm-up steps and every pair is timed in the same rounds.
"""
import argparse
import copy
import os
import sys
import time
import warnings
from typing import Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt_ext  # noqa: E402
from common import (add_output_args, env_info, env_line, finish_env, interleaved, ms, noise_flags,  # noqa: E402
                    output_dir, write_results, hf_checkpointing_enable)

VARIANTS = ["none", "hf-torch", "ckpt_ext", "fused+ckpt"]
OPTIONAL = ["fused"]
BREAKING = ("fused",)  # compiled with graph breaks (fused layers not checkpointed run eagerly): measured last, alone
SUMMARY = {"none": "Hugging Face, no checkpointing",
           "hf-torch": "Hugging Face's checkpointing (torch.utils.checkpoint, use_reentrant=False)",
           "ckpt_ext": "ckpt_ext.enable_checkpointing(model)",
           "fused+ckpt": "ckpt_ext.fuse(model), then enable_checkpointing",
           "fused": "ckpt_ext.fuse(model), no checkpointing"}
LARGE = dict(hidden=1024, heads=16, intermediate=4096, seq=512, batch=32)  # BERT-large width, the probe's shape
TINY = dict(layers=2, hidden=64, heads=4, intermediate=128, seq=32, batch=2, vocab=1000)


def make_base(layers: int, hidden: int, heads: int, intermediate: int, seq: int, vocab: int, dropout: float,
              device, dtype):
    import transformers
    cfg = transformers.BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                  intermediate_size=intermediate, max_position_embeddings=max(512, seq),
                                  vocab_size=vocab, attn_implementation="sdpa", attention_probs_dropout_prob=dropout,
                                  hidden_dropout_prob=dropout)
    torch.manual_seed(0)
    return transformers.BertModel(cfg, add_pooling_layer=False).to(device=device, dtype=dtype).train()


def make_variant(base, name: str):
    model = copy.deepcopy(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' gradient_checkpointing_* renames
        if name == "hf-torch":
            hf_checkpointing_enable(model, use_reentrant=False)
        elif name == "ckpt_ext":
            ckpt_ext.enable_checkpointing(model)
        elif name in ("fused", "fused+ckpt"):
            ckpt_ext.fuse(model)
            if name == "fused+ckpt":
                ckpt_ext.enable_checkpointing(model)
    return model


class Counted:
    """What Dynamo did in one pair's steps: the deltas of torch._dynamo.utils.counters across each of its calls
    (the counters are global; the pairs run one at a time). Dynamo counts a unique graph per graph it compiles."""

    def __init__(self):
        self.steps = 0
        self.first_graphs = 0
        self.later_graphs = 0
        self.graph_breaks = 0

    def around(self, step: Callable[[], None]) -> Callable[[], None]:
        from torch._dynamo.utils import counters

        def run():
            graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
            step()
            new = counters["stats"]["unique_graphs"] - graphs
            if self.steps == 0:
                self.first_graphs += new
            else:
                self.later_graphs += new
            self.graph_breaks += sum(counters["graph_break"].values()) - breaks
            self.steps += 1
        return run


def measure_phase(names: List[str], base, ids, device, args, warmup: int, out: str, pairs: Dict[str, dict]) -> dict:
    """Builds the (compiled, eager) pairs of `names` into `pairs`, times their first steps, the CUDA peak of one step,
    then the interleaved rounds; fills each pair's row. Returns the raw times."""
    added: Dict[str, dict] = {}
    for name in names:
        for compiled in ((True, False) if args.only == "both" else ((args.only == "compiled"),)):
            key = f"{'compiled' if compiled else 'eager'} {name}"
            model = make_variant(base, name)
            counted = Counted() if compiled else None
            target = torch.compile(model, mode=args.mode) if compiled else model

            def step(target=target, model=model):
                target(input_ids=ids).last_hidden_state.float().pow(2).mean().backward()
                for q in model.parameters():
                    q.grad = None
            added[key] = {"variant": name, "compiled": compiled, "model": model,
                          "step": counted.around(step) if counted is not None else step,
                          "counted": counted, "row": {"variant": name, "compiled": compiled}}
    pairs.update(added)
    # First steps, one pair at a time: the compile cost (and eager's first step, for scale).
    for key, pair in added.items():
        t0 = time.perf_counter()
        pair["step"]()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        pair["row"]["first_step_s"] = time.perf_counter() - t0
        print(f"{key}: first step {pair['row']['first_step_s']:.2f} s", flush=True)
    # Peak memory of one step (CUDA), then the timed rounds after `warmup` untimed ones.
    if device.type == "cuda":
        for pair in added.values():
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            pair["step"]()
            torch.cuda.synchronize(device)
            pair["row"]["peak_over_start_mib"] = (torch.cuda.max_memory_allocated(device) - before) / 2**20
    stats, raw = interleaved({k: p["step"] for k, p in added.items()}, device, rounds=args.rounds, warmup=warmup)
    for key, pair in added.items():
        row = pair["row"]
        row["step"] = stats.get(key)
        row["flags"] = noise_flags(stats.get(key))
        c = pair["counted"]
        if c is not None:
            row.update(graphs_first_step=c.first_graphs, graphs_after_first_step=c.later_graphs,
                       graph_breaks=c.graph_breaks)
        if args.profile:
            row["profile"] = profile_step(pair["step"], device, os.path.join(out, f"profile-{key.replace(' ', '-')}.txt"))
    return raw


def main(argv: Optional[List[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=None, help="BERT layers (default 6; --tiny: 2)")
    p.add_argument("--tiny", action="store_true", help="a CPU-sized config (hidden 64, seq 32, batch 2, fp32)")
    p.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None, help="override the width (then set --heads, --intermediate)")
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--dropout", type=float, default=0.1, help="attention and hidden dropout (the probe: 0.1)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"of {VARIANTS + OPTIONAL}")
    p.add_argument("--only", choices=["both", "compiled", "eager"], default="both")
    p.add_argument("--mode", default=None, help="torch.compile mode (default: inductor's default)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the first (at least 3)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--profile", action="store_true", help="write a torch.profiler table of one steady step per pair")
    add_output_args(p)
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = dict(TINY) if args.tiny else dict(LARGE, layers=6, vocab=30522)
    for k in ("layers", "seq", "batch", "hidden", "heads", "intermediate"):
        if getattr(args, k) is not None:
            shape[k] = getattr(args, k)
    default_dtype = "bf16" if device.type == "cuda" and not args.tiny else "fp32"
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or default_dtype]
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANTS + OPTIONAL]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {VARIANTS + OPTIONAL}")
    warmup = max(3, args.warmup)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)  # several copies, one code
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 512)

    info = env_info(device)
    info["ckpt_ext_imported_from"] = os.path.dirname(os.path.abspath(ckpt_ext.__file__))
    base = make_base(shape["layers"], shape["hidden"], shape["heads"], shape["intermediate"], shape["seq"],
                     shape["vocab"], args.dropout, device, dtype)
    ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), device=device)
    weights = sum(p.numel() * p.element_size() for p in base.parameters())

    out = output_dir(args, info)
    pairs: Dict[str, dict] = {}
    raw: dict = {}
    # Phases: a model whose compiled forward breaks its graph (`fused`: each layer runs eagerly between graphs)
    # makes Dynamo give up on some of transformers' shared frames (its output-capturing code), for every model
    # of the class compiled in the process after it: measured with the others it would change their graphs
    # (recompiles, graph breaks they do not have alone). So it is measured in a phase of its own, after the others,
    # from a reset Dynamo; within a phase the pairs are interleaved.
    phases = [[n for n in names if n not in BREAKING], [n for n in names if n in BREAKING]]
    for phase in [ph for ph in phases if ph]:
        if pairs:
            for pair in pairs.values():
                pair.pop("model", None), pair.pop("step", None)
            torch._dynamo.reset()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        phase_raw = measure_phase(phase, base, ids, device, args, warmup, out, pairs)
        raw.update(phase_raw)
    for key, pair in pairs.items():
        e = pairs.get(f"eager {pair['variant']}")
        if pair["compiled"] and e is not None and pair["row"]["step"] and e["row"]["step"]:
            pair["row"]["compiled_over_eager"] = pair["row"]["step"]["median"] / e["row"]["step"]["median"]
    info = finish_env(info)
    rows = [p["row"] for p in pairs.values()]
    result = {"env": info, "shape": shape, "dtype": str(dtype), "dropout": args.dropout, "mode": args.mode,
              "warmup": warmup, "rounds": args.rounds, "weights_mib": weights / 2**20, "rows": rows,
              "raw_times_s": raw, "targets": targets(pairs)}
    md = markdown(result)
    print(md)
    for path in write_results(out, "compile", result, md):
        print("wrote", path)
    return result


def targets(pairs: Dict[str, dict]) -> Dict[str, Optional[float]]:
    """Issue 35's ratios: compiled fuse + ckpt against compiled HF + torch checkpoint and against itself eager,
    compiled ckpt_ext against compiled HF + torch checkpoint, and the compile seconds of fuse + ckpt against
    HF + torch checkpoint's."""
    def med(key):
        s = pairs.get(key, {}).get("row", {}).get("step")
        return s["median"] if s else None

    def first(key):
        return pairs.get(key, {}).get("row", {}).get("first_step_s")

    def ratio(a, b):
        return a / b if a is not None and b else None

    return {"compiled fused+ckpt / compiled hf-torch": ratio(med("compiled fused+ckpt"), med("compiled hf-torch")),
            "compiled fused+ckpt / eager fused+ckpt": ratio(med("compiled fused+ckpt"), med("eager fused+ckpt")),
            "compiled ckpt_ext / compiled hf-torch": ratio(med("compiled ckpt_ext"), med("compiled hf-torch")),
            "compile s fused+ckpt / compile s hf-torch": ratio(first("compiled fused+ckpt"),
                                                               first("compiled hf-torch"))}


def profile_step(step: Callable[[], None], device, path: str) -> str:
    """One steady step under torch.profiler; the table of the 30 most expensive ops goes to `path`."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=30)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(table)
    return path


def markdown(result: dict) -> str:
    env, shape = result["env"], result["shape"]
    lines = [f"# torch.compile against eager: BERT on {env['device_name']} ({env['device']})", "",
             env_line(env) + f" ckpt_ext imported from {env.get('ckpt_ext_imported_from')}.", "",
             f"Model: BERT {shape['layers']} layers, hidden {shape['hidden']}, {shape['heads']} heads, intermediate "
             f"{shape['intermediate']}, seq {shape['seq']}, batch {shape['batch']}, {result['dtype']}, dropout "
             f"{result['dropout']}; torch.compile mode {result['mode'] or 'default'} (inductor); {result['warmup']} "
             f"untimed steps after the first, then {result['rounds']} interleaved rounds.", "",
             "| variant | | first step s | graphs (first step) | graphs after it | graph breaks "
             "| step ms, median (p20-p80) | compiled / eager | peak MiB | flags |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        g = lambda k: "-" if r.get(k) is None else str(r[k])  # noqa: E731
        ratio = f"{r['compiled_over_eager']:.3f}" if r.get("compiled_over_eager") else "-"
        peak = f"{r['peak_over_start_mib']:.0f}" if r.get("peak_over_start_mib") is not None else "-"
        lines.append(f"| {r['variant']} | {'compiled' if r['compiled'] else 'eager'} | {r['first_step_s']:.2f} | "
                     f"{g('graphs_first_step')} | {g('graphs_after_first_step')} | {g('graph_breaks')} | "
                     f"{ms(r['step'])} | {ratio} | {peak} | {'; '.join(r['flags'])} |")
    lines += ["", "Targets (issue 35, on a GPU): compiled fused+ckpt <= 0.9x compiled hf-torch and <= eager fused+ckpt; "
              "compiled never slower than the same variant eager; compile seconds at 24 layers <= 1.5x hf-torch's.", ""]
    for k, v in result["targets"].items():
        lines.append(f"- {k}: {'-' if v is None else f'{v:.3f}'}")
    lines += ["", "- first step s: wall seconds of the first step (compiled: the compile of forward and backward).",
              "- graphs: Dynamo's unique graphs compiled in the first step, and in every later step (recompiles: "
              "should be 0); graph breaks: Dynamo's count over every step of the pair.",
              "- peak MiB: CUDA only, the most allocated above what was allocated before the step, in one step."]
    for v in dict.fromkeys(r["variant"] for r in result["rows"]):
        lines.append(f"- `{v}`: {SUMMARY[v]}.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
