"""The model suite: checkpointing variants on Hugging Face models, side by side.

    python benchmarks/suite.py                                  # bert-large on the best device present
    python benchmarks/suite.py --model llama --batch max        # largest batch per variant
    python benchmarks/suite.py --device cpu --model bert-base   # CPU: shrunk model (4 layers, seq 128, batch 2)
    python benchmarks/suite.py --batch max --memory-cap 16      # largest batch per variant as on a 16 GiB GPU
    python benchmarks/suite.py --model llama --mode bf16 --lora --variants none,hf-torch-nonreentrant,ckpt_ext,fused,ckpt_ext-fused
                                                                # peft LoRA (r=16, alpha 32, dropout 0.05) on every variant

Variants (benchmarks/variants.py): none, hf-torch-nonreentrant, hf-torch-reentrant, torch-selective,
torch-selective-attention, ckpt_ext, ckpt_ext-keep-attention, fused, ckpt_ext-fused, ckpt_ext-budget, compile-budget, and torch.compile (inductor) of five of
them: compiled-none, compiled-hf-torch-nonreentrant, compiled-ckpt_ext, compiled-fused,
compiled-ckpt_ext-fused (their first step compiles, untimed; the table counts its graph breaks; compiled-fused runs
its fused layers eagerly between graphs, which changes the graphs of the other compiled copies in the process:
their rows are flagged, docs/compile.md). Each has
its own copy of the model; one
that does not apply here is reported as `not applicable: <reason>`, one that fails as `error: ...` or `oom`.
--lora wraps the model with peft LoRA first (variants.LORA_TARGETS, base frozen): every variant then trains
the adapters, `fused` being ckpt_ext.fuse(peft model).

Parity: before timing, each variant runs one step at the smallest batch on its own dropout-free copy
(--no-parity skips it); its loss and every trainable parameter's gradient are compared with no
checkpointing's, and the largest difference relative to each tensor's largest magnitude (at least a
thousandth of the largest one's) is reported, and flagged above PARITY_TOLERANCE.

Every variant runs in one process, in interleaved rounds after untimed warm-up steps (the first checks
that the variant runs and fits). Step time: median with 20th/80th percentiles; rows whose spread is wide
or that are faster than no checkpointing while recomputing are flagged. Memory: the activation bytes held
from forward to backward, counted alike on every device; on CUDA also peak allocated and reserved of a
step as if the model were alone on the device. With --batch max each variant is searched and then timed
alone (the others' copies freed): largest batch, tokens/s there, and reserved minus allocated at peak.

Output: a markdown table on stdout, and <model>[-max-batch].{md,json,png} in bench-out/<device>/ (or
--out; --save-results writes the committed benchmarks/results/<device>/).
"""
import argparse
import os
import sys
import warnings
from dataclasses import replace
from typing import Dict, List, Optional

import torch

import ckpt_ext
import report
from common import (Progress, add_output_args, env_info, finish_env, free_memory, interleaved, is_oom, held_bytes,
                    find_max_batch, noise_flags, output_dir, short_error, write_results)
from variants import MODELS, MODES, VARIANTS, ModelSpec, NotApplicable, Variant, Workload, make_variant, parse_lora

CUSTOM_DEFAULTS = {"layers": 4, "hidden": 256, "heads": 4, "seq": 128}
CPU_SMALL = {"layers": 4, "seq": 128, "batch": "2"}  # the CPU scaling (off with --full)
# Parity step: the largest difference from `none` (relative to each tensor's largest magnitude) that passes.
# Fused GEMMs and a different order of additions round differently; bfloat16 keeps ~3 significant digits.
PARITY_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2, "autocast": 5e-2, "bf16-autocast": 5e-2}


def _failure(exc: BaseException) -> str:
    return "oom" if is_oom(exc) else f"error: {type(exc).__name__}"


def empty_row(v: str, batch: int, seq: int, status: str = "ok", note: str = "") -> dict:
    return {"variant": v, "batch": batch, "tokens": batch * seq, "status": status, "step_s": None,
            "tokens_per_s": None, "activation_bytes": None, "saved_bytes": None, "pool_bytes": None,
            "peak_allocated_bytes": None, "peak_reserved_bytes": None, "peak_over_weights_bytes": None,
            "fragmentation_bytes": None,
            "budget_bytes": None, "graph_breaks": None, "parity": None, "flags": [], "note": note}


class Suite:
    """The variants of one workload and their models; `status` holds why a variant is not runnable."""

    def __init__(self, workload: Workload, names: List[str], budget: Optional[int], notes: List[str]):
        self.workload, self.notes = workload, notes
        self.variants = {}
        self.models: Dict[str, torch.nn.Module] = {}
        self.status: Dict[str, str] = {}
        self.none_held: Dict[int, int] = {}
        self.scale_budget = False  # --batch max: `none`'s bytes scaled from batch 1, not run at every batch
        self.budget = budget
        self.parity_results: Dict[str, dict] = {}
        for n in names:
            v = make_variant(n, budget)
            reason = v.unavailable()
            if reason:
                self.status[n] = f"not applicable: {reason}"
            else:
                self.variants[n] = v

    def build(self, name: str) -> bool:
        try:
            self.models[name] = self.variants[name].setup(self.workload.fresh)
        except NotApplicable as e:
            self.status[name] = f"not applicable: {e}"
        except Exception as e:
            self.status[name] = _failure(e)
            self.notes.append(f"{name}: setting up failed with {short_error(e)}")
        return name in self.models

    def drop(self, name: str) -> None:
        model = self.models.pop(name, None)
        if model is not None:
            self.variants[name].teardown(model)
        del model
        free_memory(self.workload.device)

    def activate(self, name: str, batch: int) -> None:
        self.variants[name].prepare(self.models[name], batch, self.workload, self.none_bytes)

    def step(self, name: str, batch: int) -> None:
        self.workload.step(self.variants[name], self.models[name], batch)

    def measure(self, name: str, batch: int) -> dict:
        """One step with its memory counted (see held_bytes); on CUDA, peaks as if the model were alone."""
        variant, model = self.variants[name], self.models[name]
        params = list(model.parameters())
        mem = held_bytes(lambda: self.workload.forward(variant, model, batch), params, self.workload.device,
                         variant.extra_saved)
        if self.workload.device.type == "cuda":
            own = sum(p.numel() * p.element_size() for p in params)
            mem["peak_allocated_bytes"] = own + mem["peak_allocated"]
            mem["peak_reserved_bytes"] = mem["peak_reserved"] - mem["base_reserved"] + own
        return mem

    def parity_step(self, variant: Variant, batch: int) -> dict:
        """Loss and the gradients of the trainable parameters of one seeded step of `variant` on a fresh
        dropout-free copy of the model (float32, on the CPU), the copy torn down afterwards."""
        model = variant.setup(self.workload.fresh_without_dropout)
        try:
            variant.prepare(model, batch, self.workload, self.none_bytes)
            torch.manual_seed(0)
            out = {"loss": self.workload.forward(variant, model, batch, probe=True)}
            out["loss"].backward()
            for name, p in model.named_parameters():
                if p.requires_grad:
                    name = name.removeprefix("_orig_mod.")  # torch.compile's wrapper
                    out[name] = None if p.grad is None else p.grad.detach().float().cpu()
            out["loss"] = out["loss"].detach().float().cpu()
        finally:
            variant.teardown(model)
            del model
            free_memory(self.workload.device)
        return out

    def parity(self, batch: int, progress: Progress) -> None:
        """Writes each built variant's parity with `none` into self.parity_results (see the module doc)."""
        tol = PARITY_TOLERANCE[self.workload.mode]
        progress.describe("parity: none")
        try:
            ref = self.parity_step(Variant(), batch)
        except Exception as e:
            self.notes.append(f"parity: the reference step (no checkpointing) failed with {short_error(e)}")
            return
        # Gradients that are zero in exact arithmetic (BERT's key bias) are compared against a thousandth of
        # the largest gradient, not their own rounding noise.
        floor = max([t.abs().max().item() for t in ref.values() if t is not None and t.numel()] + [1e-30]) * 1e-3
        for name in self.variants:
            if name == "none":
                continue
            progress.describe(f"parity: {name}")
            try:
                got = self.parity_step(make_variant(name, self.budget), batch)
            except NotApplicable:
                continue
            except Exception as e:
                self.notes.append(f"{name}: the parity step failed with {short_error(e)}")
                continue
            err, why = 0.0, []
            for key in ref.keys() | got.keys():
                a, b = got.get(key), ref.get(key)
                if a is None or b is None:
                    why.append(f"{key}: gradient {'missing' if a is None else 'unexpected'}")
                    err = float("inf")
                    continue
                scale = max(b.abs().max().item(), floor)
                err = max(err, (a - b).abs().max().item() / scale)
            self.parity_results[name] = {"batch": batch, "max_rel_err": err, "tolerance": tol, "ok": err <= tol}
            if why:
                self.notes.append(f"{name}: parity: {len(why)} mismatching gradient(s), e.g. {why[0]}")

    def none_bytes(self, batch: int) -> int:
        """Activation bytes of `none` at this batch (what ckpt_ext-budget's default budget is half of):
        measured on a model without checkpointing, or scaled from batch 1 in the max-batch search."""
        if self.scale_budget and batch != 1:
            return self.none_bytes(1) * batch
        if batch not in self.none_held:
            plain = Variant()
            model = self.models.get("none") or plain.setup(self.workload.fresh)
            mem = held_bytes(lambda: self.workload.forward(plain, model, batch), list(model.parameters()),
                             self.workload.device)
            self.none_held[batch] = mem["held_bytes"]
        return self.none_held[batch]


def run_cases(suite: Suite, cases: Dict[str, int], repeat: int, warmup: int, progress: Progress) -> List[dict]:
    """Measures variant -> batch: a trial step (does it run, does it fit), a step with memory accounting,
    then warmup - 1 untimed and `repeat` timed interleaved rounds."""
    seq = suite.workload.spec.seq
    rows = {v: empty_row(v, b, seq) for v, b in cases.items()}
    live = list(cases)
    progress.plan(len(live) * (warmup + 1 + repeat))

    def fail(v, exc, stage):
        rows[v]["status"] = _failure(exc)
        if not is_oom(exc):
            suite.notes.append(f"{v} (batch {cases[v]}): {stage} failed with {short_error(exc)}")
        if v in live:
            live.remove(v)

    for stage in ("the first step", "the memory-accounting step"):
        for v in list(live):
            progress.describe(f"{v} b={cases[v]}: {stage}")
            mem, ok = None, True
            try:
                suite.activate(v, cases[v])
                if stage == "the first step":
                    suite.step(v, cases[v])
                else:
                    mem = suite.measure(v, cases[v])
            except Exception as e:
                fail(v, e, stage)
                ok = False
            if not ok:
                free_memory(suite.workload.device)
            elif mem is not None:
                rows[v].update(activation_bytes=mem["held_bytes"], saved_bytes=mem["saved_bytes"],
                               pool_bytes=mem["pool_bytes"], peak_allocated_bytes=mem.get("peak_allocated_bytes"),
                               peak_reserved_bytes=mem.get("peak_reserved_bytes"),
                               peak_over_weights_bytes=mem.get("peak_allocated"),
                               fragmentation_bytes=mem.get("fragmentation_at_peak"))
            progress()
    for v in live:
        rows[v]["budget_bytes"] = getattr(suite.variants[v], "used", None)
        rows[v]["graph_breaks"] = getattr(suite.variants[v], "graph_breaks", None)  # compiled variants

    def setup(v):
        progress.describe(f"timing b={cases[v]}")
        suite.activate(v, cases[v])

    steps = {v: (lambda v=v: suite.step(v, cases[v])) for v in live}
    stats, _ = interleaved(steps, suite.workload.device, repeat, max(0, warmup - 1), setup=setup,
                           on_error=lambda v, e: fail(v, e, "a timed step"), progress=progress)
    for v, s in stats.items():
        rows[v].update(step_s=s, tokens_per_s=cases[v] * seq / s["median"])
    return [rows[v] for v in cases]


def _mem_available() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cpu_batch_cap(suite: Suite, max_batch: int) -> int:
    """--max-batch, lowered so that a step of `none` surely fits in half the available memory (the CPU
    has no out-of-memory error to search against, only the OOM killer)."""
    avail = _mem_available()
    if avail is None:
        return max_batch
    params = sum(p.numel() * p.element_size() for p in suite.workload.base.parameters())
    room = avail // 2 - 2 * params * (1 + len(suite.variants))
    return max(1, min(max_batch, room // max(1, 2 * suite.none_bytes(1))))


def run_max(suite: Suite, cap: int, repeat: int, warmup: int, progress: Progress,
            precision: float = 0.0) -> Dict[str, dict]:
    """Per variant, alone on the device: the largest batch that fits (find_max_batch, to within `precision`),
    then its row there."""
    rows = {}
    for v in list(suite.variants):
        if not suite.build(v):
            continue
        progress.describe(f"{v} max batch")
        tries = []

        def step(batch, v=v):
            tries.append(batch)
            suite.activate(v, batch)
            suite.step(v, batch)

        found = None
        try:
            found = find_max_batch(step, cap, free=lambda: free_memory(suite.workload.device), precision=precision)
        except Exception as e:
            suite.status[v] = _failure(e)
            suite.notes.append(f"{v}: the max-batch search failed with {short_error(e)}")
        if found:
            suite.notes.append(f"{v}: max-batch search tried {', '.join(map(str, tries))} -> {found}")
            rows[v] = run_cases(suite, {v: found}, repeat, warmup, progress)[0]
        elif found == 0:
            rows[v] = empty_row(v, 0, suite.workload.spec.seq, "oom", "batch 1 does not fit")
        suite.drop(v)
    return rows


def parse_batches(text: str):
    if text.strip().lower() == "max":
        return "max"
    try:
        batches = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        raise argparse.ArgumentTypeError(f"--batch takes a comma list of positive sizes or 'max', got {text!r}")
    return batches


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python benchmarks/suite.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bert-large", choices=[*MODELS, "custom"])
    p.add_argument("--family", default="bert", choices=["bert", "gpt2", "llama"],
                   help="custom only: the Hugging Face model family (default bert; llama: half as many KV heads)")
    p.add_argument("--layers", type=int, help="layers (custom; also overrides a named model's count)")
    p.add_argument("--hidden", type=int, help=f"custom only (default {CUSTOM_DEFAULTS['hidden']})")
    p.add_argument("--heads", type=int, help=f"custom only (default {CUSTOM_DEFAULTS['heads']})")
    p.add_argument("--seq", type=int, help="sequence length (default: the model's; CPU: 128)")
    p.add_argument("--batch", type=parse_batches, default=None,
                   help="comma list of batch sizes, or 'max' (default CUDA 8,16,32; CPU 2)")
    p.add_argument("--max-batch", type=int, default=None, help="upper bound of --batch max (default CUDA 4096, CPU 8)")
    p.add_argument("--max-batch-precision", type=float, default=0.0, metavar="FRACTION",
                   help="--batch max: stop the bisection once within this fraction of the largest batch that "
                        "fitted (default 0: exact; 0.125 saves tries on large batches)")
    p.add_argument("--memory-cap", type=float, default=None, metavar="GiB",
                   help="CUDA: cap this process's memory (torch.cuda.set_per_process_memory_fraction), weights "
                        "included, as on a smaller GPU; with --batch max, the largest batch under the cap")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--mode", default=None, choices=MODES, help="default autocast on CUDA, fp32 on CPU")
    p.add_argument("--repeat", type=int, default=None, help="timed rounds (default CUDA 20, CPU 5)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps per variant before timing, the first being the trial step (default CUDA 3, CPU 1)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--budget", default=None,
                   help="memory budget of ckpt_ext-budget ('2GiB', bytes); default half the activations of none")
    p.add_argument("--lora", nargs="?", const="", default=None, metavar="r=16,alpha=32,dropout=0.05",
                   help="wrap the model with peft LoRA (every attention and MLP projection, base frozen); "
                        "values not given take these defaults")
    p.add_argument("--no-parity", action="store_true", help="skip the parity step (loss, gradients vs none)")
    p.add_argument("--full", action="store_true", help="CPU: the model's real size (default: shrunk, see CPU_SMALL)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plots", action="store_true", help="no PNG plots")
    add_output_args(p)
    return p


def resolve_config(args, parser) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    cuda = device.type == "cuda"
    small = not cuda and not args.full
    if args.model == "custom":
        hidden = args.hidden or CUSTOM_DEFAULTS["hidden"]
        heads = args.heads or CUSTOM_DEFAULTS["heads"]
        kv_heads = heads // 2 if args.family == "llama" and heads % 2 == 0 else None
        spec = ModelSpec("custom", args.family, args.layers or CUSTOM_DEFAULTS["layers"], hidden, heads,
                         args.seq or CUSTOM_DEFAULTS["seq"], 4 * hidden, 30522, kv_heads=kv_heads)
        if spec.hidden % spec.heads:
            parser.error(f"--hidden {spec.hidden} is not a multiple of --heads {spec.heads}")
    else:
        if args.hidden or args.heads or args.family != "bert":
            parser.error("--hidden, --heads and --family apply to --model custom only")
        spec = MODELS[args.model]
        if small:
            spec = replace(spec, layers=min(spec.layers, CPU_SMALL["layers"]), seq=min(spec.seq, CPU_SMALL["seq"]))
        spec = replace(spec, layers=args.layers or spec.layers, seq=args.seq or spec.seq)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        parser.error(f"--variants: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(VARIANTS)}")
    lora = None
    if args.lora is not None:
        try:
            lora = parse_lora(args.lora)
        except (TypeError, ValueError) as e:
            parser.error(f"--lora: {e}")
    if args.memory_cap is not None:
        if not cuda:
            parser.error("--memory-cap applies to CUDA only (the CPU has no allocator cap to set)")
        total = torch.cuda.get_device_properties(device).total_memory
        if not 0 < args.memory_cap * 2**30 <= total:
            parser.error(f"--memory-cap {args.memory_cap:g} GiB: must be positive and at most the device's "
                         f"{total / 2**30:.1f} GiB")
    if not 0 <= args.max_batch_precision < 1:
        parser.error(f"--max-batch-precision must be in [0, 1), got {args.max_batch_precision:g}")
    budget = None
    if args.budget is not None:
        from ckpt_ext.planner import parse_bytes
        try:
            budget = parse_bytes(int(args.budget) if args.budget.isdigit() else args.budget)
        except (TypeError, ValueError) as e:
            parser.error(f"--budget: {e}")
    cfg = {"model": args.model, "spec": spec, "device": device, "mode": args.mode or ("autocast" if cuda else "fp32"),
           "batch": args.batch or ([8, 16, 32] if cuda else parse_batches(CPU_SMALL["batch"])),
           "max_batch": args.max_batch or (4096 if cuda else 8), "repeat": args.repeat or (20 if cuda else 5),
           "warmup": args.warmup if args.warmup is not None else (3 if cuda else 1), "variants": variants,
           "budget": budget, "cpu_small": small and args.model != "custom", "lora": lora,
           "parity": not args.no_parity, "memory_cap": args.memory_cap,
           "max_batch_precision": args.max_batch_precision}
    if cfg["repeat"] < 1 or cfg["warmup"] < 1 or cfg["max_batch"] < 1:
        parser.error("--repeat, --warmup and --max-batch must be at least 1 (the first warm-up step is the trial)")
    return cfg


def flag_rows(rows: List[dict], suite: Suite) -> None:
    """Noise flags (common.noise_flags) against `none` at the same batch."""
    none = {r["batch"]: r["step_s"] for r in rows if r["variant"] == "none" and r["step_s"]}
    for r in rows:
        v = suite.variants.get(r["variant"])
        r["flags"] = noise_flags(r["step_s"], none.get(r["batch"]), recomputes=bool(v and v.recomputes))
        r["parity"] = suite.parity_results.get(r["variant"])
        if r["parity"] and not r["parity"]["ok"]:
            r["flags"].append(f"parity: {r['parity']['max_rel_err']:.2g} from none > {r['parity']['tolerance']:g}")
    # compiled-fused breaks its graph at every fused layer, and Dynamo then gives up on transformers' shared frames for
    # every compiled copy of the model class in the process (docs/compile.md): the other compiled rows are not what
    # they are alone (benchmarks/bench_compile.py measures fuse alone in a phase of its own).
    if any(r["variant"] == "compiled-fused" for r in rows):
        for r in rows:
            if r["variant"].startswith("compiled-") and r["variant"] != "compiled-fused":
                r["flags"].append("beside compiled-fused: its graph breaks change this model's graphs")


def run(cfg: dict, progress: Progress, notes: List[str]) -> dict:
    """Builds the workload and runs the configured measurement: rows (and the max batches)."""
    device = cfg["device"]
    if cfg.get("memory_cap"):
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(cfg["memory_cap"] * 2**30 / total, device)
        notes.append(f"memory capped at {cfg['memory_cap']:g} GiB of the device's {total / 2**30:.1f} GiB, weights "
                     "included (torch.cuda.set_per_process_memory_fraction)")
    progress.describe(f"building {cfg['spec'].name}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' is_gradient_checkpointing rename
        workload = Workload(cfg["spec"], cfg["mode"], device, cfg["lora"])
        suite = Suite(workload, cfg["variants"], cfg["budget"], notes)
        if cfg["parity"]:
            suite.parity(1 if cfg["batch"] == "max" else min(cfg["batch"]), progress)
        rows: List[dict] = []
        max_batch = None
        if cfg["batch"] == "max":
            suite.scale_budget = True
            cap = cfg["max_batch"] if device.type == "cuda" else cpu_batch_cap(suite, cfg["max_batch"])
            if cap < cfg["max_batch"]:
                notes.append(f"--batch max capped at {cap} by the memory estimate (CPU has no out-of-memory error)")
            cfg["max_batch"] = cap
            if cfg.get("max_batch_precision"):
                notes.append(f"--batch max searched to within {cfg['max_batch_precision']:.1%} (the largest batch "
                             "may be that much higher)")
            measured = run_max(suite, cap, cfg["repeat"], cfg["warmup"], progress, cfg.get("max_batch_precision", 0.0))
            max_batch = {v: r["batch"] for v, r in measured.items()}
        else:
            for v in list(suite.variants):
                suite.build(v)
            measured = {}
            for b in cfg["batch"]:
                cases = {v: b for v in suite.models}
                rows_b = {r["variant"]: r for r in run_cases(suite, cases, cfg["repeat"], cfg["warmup"], progress)}
                rows += [rows_b.get(v) or empty_row(v, b, cfg["spec"].seq, suite.status[v]) for v in cfg["variants"]]
            for v in list(suite.models):
                suite.drop(v)
    if max_batch is not None:
        rows = [measured.get(v) or empty_row(v, 0, cfg["spec"].seq, suite.status.get(v, "oom"))
                for v in cfg["variants"]]
    flag_rows(rows, suite)
    return {"rows": rows, "max_batch": max_batch, "summaries": {v: s.summary for v, s in suite.variants.items()}}


def main(argv=None) -> dict:
    parser = make_parser()
    args = parser.parse_args(argv)
    cfg = resolve_config(args, parser)
    spec, device = cfg["spec"], cfg["device"]
    info = env_info(device)
    notes: List[str] = []
    progress = Progress(enabled=not args.no_progress)
    try:
        measured = run(cfg, progress, notes)
    finally:
        progress.close()
    config = {"model": cfg["model"], "model_description": spec.describe(), "layers": spec.layers,
              "hidden": spec.hidden, "heads": spec.heads, "kv_heads": spec.kv_heads, "seq": spec.seq,
              "intermediate": spec.intermediate, "vocab": spec.vocab, "mode": cfg["mode"],
              "batch": cfg["batch"], "max_batch": cfg["max_batch"], "repeat": cfg["repeat"], "warmup": cfg["warmup"],
              "variants": cfg["variants"], "budget_bytes": cfg["budget"], "cpu_small": cfg["cpu_small"],
              "family": spec.family, "memory_cap_gib": cfg["memory_cap"],
              "max_batch_precision": cfg["max_batch_precision"],
              "lora": cfg["lora"] and {**vars(cfg["lora"]), "description": cfg["lora"].describe(spec.family)},
              "argv": list(sys.argv[1:] if argv is None else argv)}
    result = {"env": finish_env(info), "config": config, "rows": measured["rows"],
              "max_batch": measured["max_batch"], "variant_summaries": measured["summaries"], "notes": notes}
    md = report.to_markdown(result)
    print(md)
    out = output_dir(args, info)
    stem = cfg["model"] + ("-lora" if cfg["lora"] else "") + ("-max-batch" if cfg["batch"] == "max" else "")
    written = write_results(out, stem, result, md)
    if not args.no_plots:
        written += report.plots(result, os.path.join(out, stem))
    print("wrote " + ", ".join(written), file=sys.stderr)
    result["files"] = written
    return result


if __name__ == "__main__":
    main()
