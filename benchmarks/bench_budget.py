"""The budget planner's predictions against measurement: enable_checkpointing(model, budget=...) on a model, the
plan's predicted bytes held and step time next to the measured ones (issue 23: within 10%).

    python benchmarks/bench_budget.py                       # CPU target: Llama 4 x 256, seq 1024, batch 1, fp32
    python benchmarks/bench_budget.py --budget 60MiB --rounds 15 --threads 2

Variants, each on its own copy of the same weights (attention dropout 0), one process, interleaved rounds:

  none        no checkpointing: the reference step time and bytes
  planned     enable_checkpointing(model, budget=B): the planner chooses per group among keeping the layers whole,
              checkpointing them at a keep level (attention, attention_inputs, gemms, gemms_attention), and
              boundary-only recompute
  boundaries  enable_checkpointing(model, budget=B, keep="boundaries"): the same budget, boundaries only

B (unless --budget): from the layers' measured costs, the smallest budget on a grid between the least achievable
and keeping everything whose plan mixes choices (some layers kept whole, some at a level beyond attention; else
some keeping attention).

Predictions, read from the plan after its measuring step: bytes held from forward to backward by the layer stack
(plan.held_bytes) and the peak (plan.need_bytes: docs/planner.md "The predicted peak"); the recompute a step adds
(plan.recompute: the layers' measured forward times, less the calls -- attention forwards, GEMMs -- a group's level
skips).
The planner does not time the rest of a step, so the predicted step time is the measured step without
checkpointing plus the predicted recompute; the ratio predicted / measured is taken per round (both in the same
round) and its median reported, wall and CPU time (time.process_time; the CPU prediction uses the process CPU
time of the planner's probe runs). Measured bytes: the storages the layer stack
created or received that are still alive after the forward (its last output excepted) plus the pool slots it took
(a dispatch mode records them; a separate, untimed step).
"""
import argparse
import statistics
import sys
import time
import warnings
import weakref
from typing import Dict, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import ckpt_ext
from ckpt_ext.planner import ATTENTION, LEVELS, fmt_bytes, parse_bytes, plan_chain
from ckpt_ext.stack_plan import recompute_cpu_seconds
from common import add_output_args, env_info, env_line, finish_env, interleaved, output_dir, quantiles, write_results
from variants import ModelSpec, Variant, Workload

CONFIGS = {
    "llama-s1024": (ModelSpec("llama-4x256", "llama", 4, 256, 4, 1024, 1024, 1000), 1),
    "llama-s256": (ModelSpec("llama-4x256", "llama", 4, 256, 4, 256, 1024, 1000), 1),
    "llama-tiny": (ModelSpec("llama-4x64", "llama", 4, 64, 2, 64, 128, 100), 2),  # the tests' smoke run
}


class _Created(TorchDispatchMode):
    """Records (weakly) the tensors the ops create while `on`, but for the CPU pool's chunks: a chunk is the byte
    tensor of an aten.empty after which the pool counts one more growth (BoundaryPool::grow); its slots in use are
    counted by held_by_stack from the pool's statistics. (A slot larger than a quarter of the chunk size gets a
    chunk of its own, allocated during the forward: it was counted twice.) The pool's statistics are read at the
    other ops only: the chunk's aten.empty runs under the pool's lock."""

    _EMPTY = (torch.ops.aten.empty.memory_format,)

    def __init__(self):
        super().__init__()
        self.on, self.refs = False, []
        self.grows, self.pending = None, 0  # the pool's growths seen at the last other op; refs of a byte empty

    def flush(self):
        """Drops the refs of the byte aten.empty just before if the pool has grown since: its chunk."""
        grows = ckpt_ext.pool_stats("cpu")["grows"]
        if self.pending and grows != self.grows:
            del self.refs[-self.pending:]
        self.grows, self.pending = grows, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        chunk = func in self._EMPTY and kwargs.get("dtype") == torch.uint8 and len(args[0]) == 1
        if self.on and not chunk:
            self.flush()
        out = func(*args, **kwargs)
        if self.on:
            new = [weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            self.refs.extend(new)
            if chunk:
                self.pending = len(new)
        return out


def held_by_stack(model, layers, call):
    """Runs call(model) (a forward); returns (its output, bytes held from forward to backward by the layer stack
    `layers`): the storages still alive after the forward among those the stack's layers created (parameters -- a
    weight's transpose -- and the last layer's output, which the model goes on with, excepted) and those the stack
    received (the first layer's arguments: its input, a mask, rotary tables), plus the pool slots the stack took
    (fused segments' outputs, their kept attention). tests/test_planner.py uses it too."""
    created, received, window, last, inputs = _Created(), [], [], [], []

    def pre(module, args, kwargs):
        received.extend(t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        window.append(ckpt_ext.pool_stats("cpu")["in_use_bytes"])
        created.grows, created.pending = ckpt_ext.pool_stats("cpu")["grows"], 0
        created.on = True

    def post(module, args, out):
        created.flush()
        created.on = False
        window.append(ckpt_ext.pool_stats("cpu")["in_use_bytes"])
        last.extend(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        # The last layer's pooled input is still referenced by the stack's loop here; the stack holds it from forward
        # to backward only where something saved it (not where BERT's pre-norm boundary recomputes it): counted
        # below only if it outlives the forward.
        inputs.extend((weakref.ref(t), -(-t.untyped_storage().nbytes() // 256) * 256)
                      for t in tree_leaves(args) if isinstance(t, torch.Tensor) and ckpt_ext.is_pooled(t))

    hooks = [layers[0].register_forward_pre_hook(pre, with_kwargs=True), layers[-1].register_forward_hook(post)]
    try:
        with created:
            out = call(model)
    finally:
        for h in hooks:
            h.remove()
    params = {q.untyped_storage().data_ptr() for q in model.parameters()}
    storages = {}
    for t in received + [r() for r in created.refs]:
        if t is not None and not ckpt_ext.is_pooled(t) and t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    pooled = window[-1] - window[0]
    for ref, slot in inputs:
        if ref() is None:  # (an input that is also the output is taken off below)
            pooled -= slot
    for t in last:
        storages.pop(t.untyped_storage().data_ptr(), None)
        if ckpt_ext.is_pooled(t):  # a slot of 256-byte multiples
            pooled -= -(-t.untyped_storage().nbytes() // 256) * 256
    received.clear()
    last.clear()
    return out, sum(storages.values()) + pooled


_MARKS = (1000003, 1000033, 1000037, 1000039)  # byte sizes of the window markers (primes: no tensor has them)


def step_peak(model, layers, call, backward) -> Dict[str, int]:
    """The layer stack's activation peak in one training step, measured exactly from the CPU allocator's events
    (torch.profiler, profile_memory=True; deterministic, whatever the machine's load). Runs out = call(model) (the
    forward) and backward(out) under the profiler, `layers` being the stack (model.layers).

    Counted: every allocation made during the step that is alive at a moment of the stack's forward (from its first
    layer's start to its last layer's end) or of the stack's backward (from its output's gradient to its input's),
    except (a) the parameters' gradients (the allocations that end as a parameter's .grad: the budget is of
    activations) and (b) what was allocated before the stack's forward and is not passed to its first layer (the
    embeddings' own saved tensors, outside the stack). So it counts what the planner's held bytes count (the stack's
    input, the tensors every layer receives, what the layers keep from forward to backward) plus everything the
    layers allocate and free on the way: each layer's forward temporaries, the replayed saved tensors, the
    gradients flowing between layers (the stack's output gradient included) and the layers' backward temporaries.
    Not counted: the rest of the model between the stack's forward and backward (the head and the loss), and
    memory below the allocator's view of tensors (none on CPU; a GPU library's workspace).

    Returns {"peak": the larger of the two, "forward": the forward window's peak, "backward": the backward's,
    "held": counted bytes alive when the backward window opens less the stack's output gradient, "output_grad"}."""
    received, outs, inputs = [], [], []

    def mark(k):
        torch.empty(_MARKS[k], dtype=torch.uint8)

    def pre(module, args, kwargs):
        received.extend(t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        inputs.extend(t for t in tree_leaves(args)[:1] if isinstance(t, torch.Tensor) and t.requires_grad)
        mark(0)

    def post(module, args, out):
        mark(1)
        for t in tree_leaves(out)[:1]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                outs.append(t.untyped_storage().nbytes())
                t.register_hook(lambda g: mark(2))
        for t in inputs[:1]:
            t.register_hook(lambda g: mark(3))
        inputs.clear()

    def run():
        out = call(model)
        backward(out)

    from bench_step_memory import allocations
    hooks = [layers[0].register_forward_pre_hook(pre, with_kwargs=True), layers[-1].register_forward_hook(post)]
    # The boundary pool's slots as allocations of their own: chunks of the least size, so each slot (256-byte
    # aligned) takes a chunk of exactly its size, returned to the allocator when the slot is freed; none left over.
    chunk = ckpt_ext.pool_chunk_bytes("cpu")
    ckpt_ext.set_pool_chunk_bytes(ckpt_ext.pool_min_chunk_bytes(), "cpu")
    ckpt_ext.empty_pool("cpu")
    try:
        events = [ev[1:] for ev in allocations(run, torch.device("cpu"))]
    finally:
        for h in hooks:
            h.remove()
        ckpt_ext.set_pool_chunk_bytes(chunk, "cpu")
        ckpt_ext.empty_pool("cpu")
    grads = {q.grad.untyped_storage().data_ptr() for q in model.parameters() if q.grad is not None}
    recv = {t.untyped_storage().data_ptr() for t in received}
    received.clear()
    # the allocation that ends as a parameter's gradient: the last one at its address
    last = {}
    for k, (ptr, size, _) in enumerate(events):
        if size > 0:
            last[ptr] = k
    grad_events = {last[p] for p in grads if p in last}
    live: Dict[int, int] = {}  # counted allocations alive: address -> bytes
    alive_all: Dict[int, int] = {}
    counted, window, marks = 0, None, []
    peaks = {"forward": 0, "backward": 0}
    held = None
    for k, (ptr, size, _) in enumerate(events):
        if size in _MARKS:
            continue
        if -size in _MARKS:
            m = _MARKS.index(-size)
            marks.append(m)
            if m == 0:  # the stack's forward starts: what is alive and not passed to it is the embeddings'
                window = "forward"
                live = {p: n for p, n in alive_all.items() if p in recv}
                counted = sum(live.values())
            elif m == 1:
                window = None
            elif m == 2:
                window = "backward"
                held = counted
            elif m == 3:
                window = None
            if window:
                peaks[window] = max(peaks[window], counted)
            continue
        if size > 0:
            alive_all[ptr] = size
            if marks and k not in grad_events:
                live[ptr] = size
                counted += size
        else:
            alive_all.pop(ptr, None)
            counted -= live.pop(ptr, 0)
        if window:
            peaks[window] = max(peaks[window], counted)
    if marks[:2] != [0, 1]:
        raise RuntimeError(f"the stack's forward was not seen whole (markers {marks})")
    if 2 not in marks:
        raise RuntimeError("the stack's output got no gradient: no backward window")
    out_grad = outs[0] if outs else 0
    return {"peak": max(peaks.values()), "forward": peaks["forward"], "backward": peaks["backward"],
            "held": held - out_grad, "output_grad": out_grad}


def stack_held(model, forward, layers=None) -> int:
    """Bytes the layer stack holds from forward to backward (see the module's docstring); runs forward() (returns
    the loss) and the backward."""
    loss, held = held_by_stack(model, model.layers if layers is None else layers, lambda _: forward())
    loss.backward()
    return held


def planner_of(model):
    return next(m.__dict__["_ckpt_ext_group"].planner for m in model.modules() if "_ckpt_ext_group" in m.__dict__)


def mixed_budget(costs, shared: int) -> int:
    """The smallest budget on a grid of 200 between the least achievable and keeping everything whose plan keeps
    some layers whole and checkpoints others at a level beyond attention (else: keeping attention; else: mixes any two
    choices; else the middle)."""
    least = plan_chain(costs, None, shared_bytes=shared).need_bytes
    total = plan_chain(costs, 1 << 50, shared_bytes=shared).need_bytes  # keeping everything (+ the working set)
    grid = [least + (total - least) * k // 200 for k in range(1, 200)]
    kinds = {b: {how for *_, how in plan_chain(costs, b, shared_bytes=shared).segments} for b in grid}
    beyond = set(LEVELS) - {ATTENTION}
    for want in (lambda k: False in k and bool(k & beyond), lambda k: False in k and ATTENTION in k,
                 lambda k: len(k) >= 2):
        found = [b for b in grid if want(kinds[b])]
        if found:
            return found[0]
    return grid[len(grid) // 2]


def run(config: str, budget, rounds: int, warmup: int, device) -> dict:
    spec, batch = CONFIGS[config]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        work = Workload(spec, "fp32", device)
        plain = Variant()
        models = {"none": work.fresh()}
        if budget is None:  # measure once to choose a budget that mixes choices
            probe = ckpt_ext.enable_checkpointing(work.fresh(), budget="1TiB")
            work.step(plain, probe, batch)
            p = planner_of(probe)
            budget = mixed_budget(p.costs, sum(p.shared.values()))
            del probe, p
        models["planned"] = ckpt_ext.enable_checkpointing(work.fresh(), budget=budget)
        models["boundaries"] = ckpt_ext.enable_checkpointing(work.fresh(), budget=budget, keep="boundaries")
        for name in ("planned", "boundaries"):  # the first step measures and plans, the second runs the plan
            for _ in range(2):
                work.step(plain, models[name], batch)
        plans = {name: planner_of(models[name]).plan for name in ("planned", "boundaries")}
        cpu_recompute = {name: recompute_cpu_seconds(planner_of(models[name]), plans[name]) for name in plans}
        explain = str(ckpt_ext.explain(models["planned"]))
        held = {name: stack_held(m, lambda m=m: work.forward(plain, m, batch)) for name, m in models.items()}
        peak = {name: step_peak(m, m.layers, lambda m: work.forward(plain, m, batch), lambda loss: loss.backward())
                for name, m in models.items()}
        cpu: Dict[str, List[float]] = {name: [] for name in models}

        def timed(name):
            start = time.process_time()
            work.step(plain, models[name], batch)
            cpu[name].append(time.process_time() - start)

        stats, raw = interleaved({name: (lambda name=name: timed(name)) for name in models}, device, rounds, warmup)
        cpu = {name: t[warmup:] for name, t in cpu.items()}
    rows = []
    for name, m in models.items():
        plan = plans.get(name)
        row = {"variant": name, "step_s": stats[name], "cpu_s": quantiles(cpu[name]), "held_bytes": held[name],
               "peak_bytes": peak[name]["peak"]}
        if plan is not None:
            rc, rc_cpu = plan.recompute, cpu_recompute[name]
            row.update(
                segments=plan.segments, predicted_held=plan.held_bytes, predicted_peak=plan.need_bytes,
                predicted_recompute_s=rc, predicted_recompute_cpu_s=rc_cpu, base_time_s=plan.base_time,
                held_ratio=plan.held_bytes / held[name] if held[name] else None,
                peak_ratio=plan.need_bytes / peak[name]["peak"],
                step_ratio=statistics.median((n + rc) / x for n, x in zip(raw["none"], raw[name])),
                cpu_step_ratio=statistics.median((n + rc_cpu) / x for n, x in zip(cpu["none"], cpu[name])),
                measured_overhead_s=statistics.median(x - n for n, x in zip(raw["none"], raw[name])),
                measured_cpu_overhead_s=statistics.median(x - n for n, x in zip(cpu["none"], cpu[name])))
        rows.append(row)
    return {"config": config, "model": spec.describe(), "batch": batch, "budget": budget, "rows": rows,
            "explain": explain}


# --peaks: (spec, batch, fused, keep) per case; the CPU target's shapes (BERT at seq 512, its positions' limit)
PEAK_CASES = {
    "llama-plain": (CONFIGS["llama-s1024"][0], 1, False, None),
    "llama-fused": (CONFIGS["llama-s1024"][0], 1, True, None),
    "bert-fused": (ModelSpec("bert-4x256", "bert", 4, 256, 4, 512, 1024, 1000), 1, True, None),
    "bert-fused-boundaries": (ModelSpec("bert-4x256", "bert", 4, 256, 4, 512, 1024, 1000), 1, True, "boundaries"),
    "llama-tiny-plain": (CONFIGS["llama-tiny"][0], 2, False, None),  # the tests' smoke run
}


def peak_sweep(cases, points: int, device) -> List[dict]:
    """Per case: one measuring step, then plans at `points` budgets from the least achievable to keeping every layer
    (StackPlanner.replan, one set of measured costs), each distinct plan installed by a step and its step measured
    (step_peak: the layer stack's activation peak from the allocator's events; bytes only, no timing)."""
    rows = []
    for case in cases:
        spec, batch, fused, keep = PEAK_CASES[case]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            work = Workload(spec, "fp32", device)
            plain = Variant()
            model = work.fresh()
            if fused:
                model = ckpt_ext.fuse(model)
            layers = model.layers if hasattr(model, "layers") else model.encoder.layer
            options = {} if keep is None else {"keep": keep}
            ckpt_ext.enable_checkpointing(model, budget="1TiB", **options)
            work.step(plain, model, batch)  # measures
            p = planner_of(model)
            shared = sum(p.shared.values())
            least = plan_chain(p.costs, None, p.chained, keep=keep or "auto", shared_bytes=shared).need_bytes
            top = plan_chain(p.costs, 1 << 50, p.chained, keep=keep or "auto", shared_bytes=shared).need_bytes
            seen = set()
            for k in range(points):
                budget = least + (top - least) * k // max(1, points - 1)
                plan = p.replan(budget)
                key = (tuple(plan.segments), plan.boundaries)
                if key in seen:
                    continue
                seen.add(key)
                work.step(plain, model, batch)  # installs the plan
                held = stack_held(model, lambda: work.forward(plain, model, batch), layers)
                r = step_peak(model, layers, lambda m: work.forward(plain, m, batch), lambda loss: loss.backward())
                rows.append({"case": case, "model": spec.describe(), "fused": fused, "keep": keep, "batch": batch,
                             "budget": budget, "segments": plan.segments, "boundaries": sorted(plan.boundaries),
                             "predicted_held": plan.held_bytes, "held": held, "replay_peak": plan.replay_bytes,
                             "working": plan.working_bytes, "predicted_peak": plan.need_bytes,
                             "peak": r["peak"], "forward_peak": r["forward"], "backward_peak": r["backward"],
                             "ratio": plan.need_bytes / r["peak"]})
            ckpt_ext.disable_checkpointing(model)
    return rows


def peaks_markdown(info: dict, rows: List[dict], cfg: dict) -> str:
    lines = [f"# budget= planner: predicted peak vs measured ({info['device_name']}, {info['device']})", "",
             env_line(info), "",
             "Predicted peak = held from forward to backward + the replay at the peak (a segment's replay beside the "
             "bytes held by it and the segments before it, less the bytes held) + the largest layer's working set "
             "(Plan.need_bytes, what explain() prints). Measured: the layer stack's activation peak over one training "
             "step from the CPU allocator's events (bench_budget.step_peak: allocations alive during the stack's "
             "forward or backward, parameters' gradients and the embeddings' own tensors apart; gradients set to None "
             "before the step). fp32; plans from one measuring step per case at "
             f"{cfg['points']} budgets from the least to keeping every layer (distinct plans only).", "",
             "| case | budget | plan (layer: choice) | pre-norm boundary at | held pred / meas | replay at peak | "
             "working set | predicted peak | measured peak (fwd; bwd) | pred / meas |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {fmt_bytes(r['budget'])} | {_segments(r['segments'])} | "
                     f"{','.join(map(str, r['boundaries'])) or '-'} | {fmt_bytes(r['predicted_held'])} / "
                     f"{fmt_bytes(r['held'])} | {fmt_bytes(r['replay_peak'])} | {fmt_bytes(r['working'])} | "
                     f"{fmt_bytes(r['predicted_peak'])} | {fmt_bytes(r['peak'])} ({fmt_bytes(r['forward_peak'])}; "
                     f"{fmt_bytes(r['backward_peak'])}) | **{r['ratio']:.3f}** |")
    ratios = [r["ratio"] for r in rows]
    if ratios:
        lines += ["", f"{len(rows)} plans; predicted / measured peak {min(ratios):.3f} - {max(ratios):.3f}."]
    return "\n".join(lines + [""])


def _segments(segments) -> str:
    word = {False: "kept", True: "boundaries", **{lv: lv for lv in LEVELS}}
    return ", ".join(f"{s}-{e - 1}:{word[how]}" if e - s > 1 else f"{s}:{word[how]}" for s, e, how in segments)


def to_markdown(info: dict, res: dict, cfg: dict) -> str:
    ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
    lines = [f"# budget= planner: predicted vs measured ({info['device_name']}, {info['device']})", "", env_line(info),
             "", f"{res['model']}, batch {res['batch']}, fp32; budget {fmt_bytes(res['budget'])} ({res['budget']} "
             f"bytes); {cfg['rounds']} interleaved rounds after {cfg['warmup']} warm-up round(s).", "",
             "| variant | plan (layer: choice) | step ms median (p20-p80) | CPU ms | held fwd→bwd, measured | predicted "
             "held (pred/meas) | peak, measured | predicted peak (pred/meas) | predicted recompute ms (wall; CPU) | "
             "measured overhead ms (wall; CPU) | predicted step / measured (wall; CPU) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        s = r["step_s"]
        head = (f"| {r['variant']} | {_segments(r['segments']) if 'segments' in r else '-'} | {ms(s['median'])} "
                f"({ms(s['p20'])}-{ms(s['p80'])}) | {ms(r['cpu_s']['median'])} | {fmt_bytes(r['held_bytes'])} |")
        if "segments" not in r:
            lines.append(head + f" - | {fmt_bytes(r['peak_bytes'])} | - | - | - | - |")
            continue
        lines.append(head + f" {fmt_bytes(r['predicted_held'])} ({r['held_ratio']:.3f}) | {fmt_bytes(r['peak_bytes'])} | "
                     f"{fmt_bytes(r['predicted_peak'])} ({r['peak_ratio']:.3f}) | {ms(r['predicted_recompute_s'])}; "
                     f"{ms(r['predicted_recompute_cpu_s'])} | {ms(r['measured_overhead_s'])}; "
                     f"{ms(r['measured_cpu_overhead_s'])} | {r['step_ratio']:.3f}; {r['cpu_step_ratio']:.3f} |")
    for r in res["rows"]:
        if r.get("base_time_s"):
            lines.append(f"- {r['variant']}: the planner's own measurement of the layers' forward + backward without "
                         f"checkpointing (its measuring step) was {ms(r['base_time_s'])} ms; the whole step without "
                         f"checkpointing measured {ms(res['rows'][0]['step_s']['median'])} ms here.")
    lines += ["", "- predicted step = the measured step without checkpointing (same round) + the plan's predicted "
              "recompute (wall: the planner's own prediction; CPU: the process CPU time of the same probe runs); "
              "ratios are medians of per-round ratios.", "",
              "explain() of the planned model:", "", "```", res["explain"], "```", ""]
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_budget.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="llama-s1024", choices=list(CONFIGS))
    p.add_argument("--budget", default=None, help="e.g. 60MiB (default: chosen to mix choices, see above)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--peaks", default=None, metavar="CASES",
                   help="instead of the timed run: predicted against measured step peaks over a sweep of budgets for "
                        f"these cases (comma-separated: {', '.join(PEAK_CASES)}; 'all')")
    p.add_argument("--points", type=int, default=8, help="--peaks: budgets per case")
    add_output_args(p)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    info = env_info(device)
    if args.peaks:
        cases = list(PEAK_CASES) if args.peaks == "all" else args.peaks.split(",")
        bad = [c for c in cases if c not in PEAK_CASES]
        if bad:
            p.error(f"unknown --peaks case(s) {bad}: choose from {', '.join(PEAK_CASES)}")
        rows = peak_sweep(cases, args.points, device)
        cfg = {"points": args.points, "argv": list(sys.argv[1:] if argv is None else argv)}
        md = peaks_markdown(finish_env(info), rows, cfg)
        print(md)
        result = {"env": info, "config": cfg, "rows": rows}
        result["files"] = write_results(output_dir(args, info), "budget_peaks", result, md)
        print("wrote " + ", ".join(result["files"]), file=sys.stderr)
        return result
    budget = parse_bytes(args.budget) if args.budget else None
    res = run(args.config, budget, args.rounds, args.warmup, device)
    cfg = {"rounds": args.rounds, "warmup": args.warmup, "argv": list(sys.argv[1:] if argv is None else argv)}
    md = to_markdown(finish_env(info), res, cfg)
    print(md)
    result = {"env": info, "config": cfg, "result": res}
    result["files"] = write_results(output_dir(args, info), "budget", result, md)
    print("wrote " + ", ".join(result["files"]), file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
