"""A training step's peak activation memory with the fused head (issue 37), accounted exactly on a machine
without a GPU, and the same step's memory and time on a GPU.

Issue 37's step targets, for a Llama-3-8B-shaped ``LlamaForCausalLM`` (hidden 4096, 32 layers, 32 heads, 8 KV
heads, intermediate 14336, vocabulary 128256, bf16 weights) with ``fuse`` + ``enable_checkpointing`` + the fused
head:

* memory, s8192 b1: the step's peak activation memory <= (the layers' boundaries + one layer's working set) x 1.1;
* time (GPU only), s4096 b2: the step <= 0.95x of the same step with Hugging Face's head, and its peak below
  Liger-Kernel's with Hugging Face's checkpointing (where ``liger_kernel`` is importable).

How memory is accounted (the same on CPU and CUDA): every allocation and free of the step's device allocator,
with its address and size, from ``torch.profiler`` (``profile_memory=True``) -- allocation-exact, including what
C++ allocates (the boundary pool's chunks, the autograd engine's buffers). "Activation" bytes are the
allocations made during the step that do not end as a parameter's ``.grad`` (those are the gradients, which
every step computes: excluded, and reported apart). Parameters exist before the step and are not counted.

On CPU nothing is computed (``--compute`` to compute): bench_work.py's dispatch mode runs every floating-point
op on meta copies of its arguments and returns an uninitialized CPU tensor of the result's shape and strides
(views, allocations and integer ops run for real), and ckpt_ext's head operator is run as its Python
implementation under the mode, so its chunks are allocated as they are on a GPU. The model is built on the
meta device and given uninitialized CPU storage (``to_empty``), so an 8B model costs address space, not RAM.
What this cannot see: memory a kernel allocates for itself beneath the allocator's view of tensors (CPU GEMM
packing buffers, cuBLAS workspaces); ``--validate`` compares against a computed CPU run at a small shape.

Layers are identical, so the step's memory is affine in their count: the step is traced at ``--trace-layers``
(1, 2, 3; the increments must agree exactly) and extrapolated to ``--layers`` (32); ``--check-layers`` (4)
traces one more count and compares it with the extrapolation (exact), ``--direct`` traces the full count too
(on CPU about 35 GB of untouched address space at the 8B shape; on a GPU it is what the memory holds).

"One layer's working set": one fused layer (not checkpointed) run forward and backward on its input with a
given output gradient (input and output gradient not counted, its input's gradient counted), accounted the
same way. "The layers' boundaries": layers x batch x seq x hidden x 2 bytes (each layer's input kept).

    python benchmarks/bench_step_memory.py                      # CPU: the 8B shape, s8192 b1, no compute
    python benchmarks/bench_step_memory.py --validate           # CPU: accounting vs a computed run, small shape
    python benchmarks/bench_step_memory.py --device cuda --time  # GPU: memory check + s4096 b2 step times
"""
import argparse
import contextlib
import os
import sys
from typing import Callable, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_work  # noqa: E402
import common  # noqa: E402

import ckpt_ext  # noqa: E402
from ckpt_ext import head as head_mod  # noqa: E402

LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=14336, vocab_size=128256)
TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=160, vocab_size=1000)
TARGET_RATIO = 1.10  # peak <= (boundaries + one layer's working set) x 1.1
TIME_TARGET = 0.95   # fused head step <= 0.95x the step with Hugging Face's head
VARIANTS = ("fused-head", "hf-head")  # fuse + enable_checkpointing, with the fused head / with HF's head


# ------------------------------------------------------------------------------------------- no compute
class NoCompute(bench_work.WorkMode):
    """bench_work's mode without its op records: floating-point ops run on meta copies, results are
    uninitialized tensors; ckpt_ext's head operators run their Python implementation under the mode (their
    chunk buffers are allocated, as on a GPU)."""

    _IMPLS = None

    def __init__(self):
        super().__init__()
        if NoCompute._IMPLS is None:
            NoCompute._IMPLS = {
                torch.ops.ckpt_ext.linear_cross_entropy.default: head_mod._lce_impl,
                torch.ops.ckpt_ext.linear_cross_entropy_recompute.default: head_mod._lce_rc_impl,
                torch.ops.ckpt_ext.linear_cross_entropy_backward.default: head_mod._lce_rc_bwd_impl}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        impl = self._IMPLS.get(func)
        if impl is not None:
            with self:
                return impl(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _record(self, *args):
        pass


@contextlib.contextmanager
def _executing(compute: bool, device: torch.device):
    """Compute for real (CUDA, or a CPU check) or account only (CPU: NoCompute, CUDA-like dropout and GEMM
    layout, as bench_work traces)."""
    if compute:
        with bench_work._cuda_like() if device.type == "cpu" else contextlib.nullcontext():
            yield
        return
    with bench_work._cuda_like(), NoCompute():
        yield


# ------------------------------------------------------------------------------------------ accounting
Event = Tuple[int, int, int, str]  # (time ns, address, bytes: + allocated / - freed, the allocating op)


def allocations(fn: Callable[[], None], device: torch.device) -> List[Event]:
    """Every allocation and free of `device`'s allocator while fn() runs, in order."""
    from torch.profiler import ProfilerActivity, profile
    from torch._C._profiler import _EventType
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts, profile_memory=True) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events: List[Event] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag != _EventType.Allocation or e.extra_fields.device.type != device.type:
            continue
        ops, p = [], e.parent
        while p is not None and len(ops) < 6:
            if p.name not in ops and not p.name.startswith(("PythonDispatchMode", "aten::empty")):
                ops.append(p.name)
            p = p.parent
        events.append((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size,
                       " < ".join(ops[:3]) or "(no op above it: C++, e.g. the boundary pool's chunks)"))
    events.sort(key=lambda ev: ev[0])
    if not events:
        raise RuntimeError(f"bench_step_memory: the profiler reported no {device.type} allocation (this torch's "
                           "profiler does not record the allocator's events)")
    return events


def timeline(events: List[Event], grad_spans: List[Tuple[int, int]], top: int = 12) -> dict:
    """Peak of the live bytes over the events (allocations made before them are not in them), with and
    without the allocations that hold a parameter's gradient at the end (`grad_spans`: (address, bytes) of
    each .grad), and what is alive at the activation peak (largest first, grouped by op and size)."""
    live: Dict[int, int] = {}
    for k, (_, ptr, size, _) in enumerate(events):
        if size > 0:
            live[ptr] = k
        else:
            live.pop(ptr, None)
    grads = {k for ptr, k in live.items()
             if any(ptr <= g < ptr + events[k][2] for g, _ in grad_spans)}
    live, act, total, peak_act, peak_total, at_peak = {}, 0, 0, 0, 0, {}
    for k, (_, ptr, size, _) in enumerate(events):
        if size > 0:
            live[ptr] = k
            counted = k not in grads
        else:
            k0 = live.pop(ptr, None)
            counted = k0 is not None and k0 not in grads
            if k0 is None:  # freed, allocated before the events: not ours
                continue
        total += size
        if counted:
            act += size
        peak_total = max(peak_total, total)
        if act > peak_act:
            peak_act, at_peak = act, dict(live)
    groups: Dict[Tuple[str, int], int] = {}
    for ptr, k in at_peak.items():
        if k not in grads:
            key = (events[k][3], events[k][2])
            groups[key] = groups.get(key, 0) + 1
    alive = sorted(((size * n, n, size, op) for (op, size), n in groups.items()), reverse=True)
    return {"peak_bytes": peak_act, "peak_with_grads_bytes": peak_total,
            "grad_bytes": sum(events[k][2] for k in grads),
            "at_peak": [{"bytes": b, "count": n, "each": s, "op": op} for b, n, s, op in alive[:top]]}


# ------------------------------------------------------------------------------------------ the models
def build(shape: dict, layers: int, device: torch.device, compute: bool, seed: int = 0):
    """A Llama-shaped LlamaForCausalLM in bf16 (untied head), on `device`: initialized (compute) or with
    uninitialized storage (accounting only)."""
    import transformers
    cfg = transformers.LlamaConfig(**dict(shape, num_hidden_layers=layers), max_position_embeddings=8192,
                                   attn_implementation="sdpa", tie_word_embeddings=False, use_cache=False)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        torch.manual_seed(seed)
        with torch.device(device if compute else "meta"):
            model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    if not compute:
        model = model.to_empty(device=device)
    return model.train()


def setup(model, variant: str):
    """fuse + enable_checkpointing with the fused head ("fused-head") or Hugging Face's ("hf-head"); "liger":
    Liger-Kernel's Llama kernels (its fused linear cross-entropy included) + Hugging Face's checkpointing."""
    if variant == "liger":
        import types
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        cls = type(model)
        saved = cls.forward
        apply_liger_kernel_to_llama(model=model)  # its causal-LM forward is patched on the class: this model only
        patched, cls.forward = cls.forward, saved
        if patched is not saved:
            model.forward = types.MethodType(patched, model)
        common.hf_checkpointing_enable(model, use_reentrant=False)
        return model
    if not any(isinstance(m, ckpt_ext.FusedTransformerLayer) for m in model.modules()):
        ckpt_ext.fuse(model)
        ckpt_ext.enable_checkpointing(model)
    if variant == "fused-head":
        ckpt_ext.fuse_lm_head(model)
    elif variant == "hf-head":
        ckpt_ext.unfuse_lm_head(model)
    else:
        raise ValueError(f"unknown variant {variant!r}")
    return model


def liger_missing() -> Optional[str]:
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"liger_kernel is not importable here ({type(e).__name__}): the Liger + HF checkpointing row is skipped"
    return None


def _grad_spans(model) -> List[Tuple[int, int]]:
    return [(p.grad.data_ptr(), p.grad.untyped_storage().nbytes()) for p in model.parameters() if p.grad is not None]


def step_memory(model, ids, device: torch.device, compute: bool) -> dict:
    """One training step (forward with labels, backward) accounted; on CUDA also the allocator's own peak above
    the step's start (gradients included)."""
    model.zero_grad(set_to_none=True)
    cuda = device.type == "cuda"
    common.free_memory(device)  # the pool's spare chunk too: the step's boundaries are counted whole
    if cuda:
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)

    def step():
        with _executing(compute, device):
            model(input_ids=ids, labels=ids).loss.backward()

    out = timeline(allocations(step, device), _grad_spans(model))
    if cuda:
        out["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(device) - base
    model.zero_grad(set_to_none=True)
    return out


class _Stop(Exception):
    pass


def layer_working_set(shape: dict, batch: int, seq: int, device: torch.device, compute: bool) -> dict:
    """One fused layer's forward + backward (not checkpointed) on its input, accounted like the step."""
    model = build(shape, 1, device, compute)
    ckpt_ext.fuse(model)
    layer = model.model.layers[0]
    seen = {}

    def grab(module, args, kwargs):
        seen["args"], seen["kwargs"] = args, kwargs
        raise _Stop

    handle = layer.register_forward_pre_hook(grab, with_kwargs=True)
    ids = torch.randint(0, shape["vocab_size"], (batch, seq), device=device)
    try:
        with torch.no_grad(), _executing(compute, device):
            model(input_ids=ids)
    except _Stop:
        pass
    finally:
        handle.remove()
    args, kwargs = seen["args"], seen["kwargs"]
    x = args[0].detach().requires_grad_()
    dy = torch.randn_like(x) if compute else torch.empty_like(x)

    def run():
        with _executing(compute, device):
            out = layer(x, *args[1:], **kwargs)
            (out[0] if isinstance(out, tuple) else out).backward(dy)

    return timeline(allocations(run, device), _grad_spans(layer))


# ------------------------------------------------------------------------------------------- the check
def peak_check(args, device: torch.device) -> dict:
    """Issue 37's memory target: traced layer counts, extrapolated, against boundaries + one layer x 1.1."""
    shape, compute = args.shape, args.compute
    ids = torch.randint(0, shape["vocab_size"], (args.batch, args.seq), device=device)
    boundary = args.batch * args.seq * shape["hidden_size"] * 2
    out = {"shape": shape, "batch": args.batch, "seq": args.seq, "layers": args.layers, "boundary_bytes": boundary,
           "compute": compute, "variants": {}}
    if args.tiny:  # each boundary in a chunk of its own, as at full size (a 64 MiB slot fills a chunk)
        old_chunk = ckpt_ext.pool_chunk_bytes(device)
        ckpt_ext.set_pool_chunk_bytes(max(ckpt_ext.pool_min_chunk_bytes(), boundary), device)
    try:
        out["layer"] = layer_working_set(shape, args.batch, args.seq, device, compute)
        _trace_variants(args, device, ids, boundary, out)
    finally:
        if args.tiny:
            ckpt_ext.set_pool_chunk_bytes(old_chunk, device)
    return out


def _trace_variants(args, device: torch.device, ids, boundary: int, out: dict):
    shape, compute = args.shape, args.compute
    counts = sorted(set(args.trace_layers + ([args.check_layers] if args.check_layers else [])
                        + ([args.layers] if args.direct else [])))
    for variant in args.variants:
        traced = {}
        for n in counts:
            model = setup(build(shape, n, device, compute), variant)
            traced[n] = step_memory(model, ids, device, compute)
            del model
            common.free_memory(device)
        t = sorted(args.trace_layers)
        v = {"traced": {str(n): r for n, r in traced.items()}}
        if len(t) >= 2:
            first, last = traced[t[0]], traced[t[-1]]
            slope = lambda key: (last[key] - first[key]) / (t[-1] - t[0])  # noqa: E731
            extrapolate = lambda n, key="peak_bytes": first[key] + (n - t[0]) * slope(key)  # noqa: E731
            steps = {traced[b]["peak_bytes"] - traced[a]["peak_bytes"] for a, b in zip(t, t[1:])}
            v.update(per_layer_bytes=slope("peak_bytes"), affine=len(steps) == 1 if len(t) > 2 else None,
                     extrapolated_peak_bytes=extrapolate(args.layers),
                     extrapolated_peak_with_grads_bytes=extrapolate(args.layers, "peak_with_grads_bytes"))
            if args.check_layers:
                v["check"] = {"layers": args.check_layers, "extrapolated": extrapolate(args.check_layers),
                              "traced": traced[args.check_layers]["peak_bytes"]}
            if device.type == "cuda":
                v["extrapolated_cuda_max_allocated_bytes"] = extrapolate(args.layers, "cuda_max_allocated_bytes")
        full = traced.get(args.layers)  # traced at the full count (--direct, or a small model): measured
        if full is None and "extrapolated_peak_bytes" not in v:
            raise SystemExit("bench_step_memory: trace at least two layer counts, or --direct")
        v["measured_at_full"] = full is not None
        v["peak_bytes"] = full["peak_bytes"] if full else v["extrapolated_peak_bytes"]
        v["peak_with_grads_bytes"] = (full["peak_with_grads_bytes"] if full
                                      else v["extrapolated_peak_with_grads_bytes"])
        if device.type == "cuda":
            v["cuda_max_allocated_bytes"] = (full["cuda_max_allocated_bytes"] if full
                                             else v["extrapolated_cuda_max_allocated_bytes"])
        bound = args.layers * boundary + out["layer"]["peak_bytes"]
        v["bound_bytes"] = bound
        v["ratio"] = v["peak_bytes"] / bound
        v["met"] = v["ratio"] <= TARGET_RATIO
        out["variants"][variant] = v


# ------------------------------------------------------------------------------------------ the times
def time_check(args, device: torch.device) -> dict:
    """GPU: fuse + ckpt step time and peak with the fused head vs Hugging Face's head (one model, the head
    switched between the two), and Liger + HF checkpointing where importable."""
    shape, L = args.shape, args.time_layers
    ids = torch.randint(0, shape["vocab_size"], (args.time_batch, args.time_seq), device=device)
    model = setup(build(shape, L, device, True), "fused-head")
    models = {"fused-head": model, "hf-head": model}
    why_no_liger = liger_missing() if device.type == "cuda" else "Liger-Kernel runs on CUDA only"
    if why_no_liger is None:
        models["liger"] = setup(build(shape, L, device, True), "liger")

    def step(name):
        m = models[name]
        if name in VARIANTS:
            setup(m, name)  # switches the head (fuse_lm_head / unfuse_lm_head): no copy

        def go():
            m.zero_grad(set_to_none=True)
            m(input_ids=ids, labels=ids).loss.backward()
        return go

    steps = {name: step(name) for name in models}
    rows = {}
    for name, go in steps.items():  # peaks, one step each, before the timing
        common.free_memory(device)
        try:
            if name in VARIANTS:
                setup(models[name], name)
            go()  # warm-up (kernels chosen, pool chunks, caches)
            rows[name] = step_memory(models[name], ids, device, compute=True)
        except Exception as e:  # noqa: BLE001 (an OOM of one variant is a result)
            rows[name] = {"error": common.short_error(e)}
    timed = {k: (lambda k=k: (setup(models[k], k) if k in VARIANTS else None, steps[k]())) for k in steps
             if "error" not in rows[k]}
    stats, _ = common.interleaved(timed, device, rounds=args.rounds, warmup=1)
    for k, st in stats.items():
        rows[k]["step_s"] = st
    out = {"layers": L, "batch": args.time_batch, "seq": args.time_seq, "rows": rows, "liger_skipped": why_no_liger}
    f, h = rows.get("fused-head", {}), rows.get("hf-head", {})
    if f.get("step_s") and h.get("step_s"):
        out["time_ratio"] = f["step_s"]["median"] / h["step_s"]["median"]
    lg = rows.get("liger", {})
    if f.get("peak_bytes") and lg.get("peak_bytes"):
        out["peak_vs_liger"] = f["peak_bytes"] / lg["peak_bytes"]
    return out


# ------------------------------------------------------------------------------------------- output
def _gib(b) -> str:
    return "-" if b is None else f"{b / 2**30:.3f}"


def to_markdown(result: dict) -> str:
    lines = [common.env_line(result["env"]), ""]
    pc = result.get("peak")
    if pc:
        s = pc["shape"]
        how = "computed" if pc["compute"] else "accounted without computing (meta execution, CPU allocator)"
        v0 = next(iter(pc["variants"].values()))
        got = (f"traced at {pc['layers']} layers" if v0["measured_at_full"] else
               f"layers traced {', '.join(v0['traced'])} and extrapolated to {pc['layers']} (affine in layers)")
        lines += [f"Peak activation memory of one training step, Llama shape hidden {s['hidden_size']}, "
                  f"{pc['layers']} layers, {s['num_attention_heads']}/{s['num_key_value_heads']} heads, intermediate "
                  f"{s['intermediate_size']}, vocab {s['vocab_size']}, bf16, s{pc['seq']} b{pc['batch']}, fuse + "
                  f"enable_checkpointing; {how}; {got}. GiB (2^30 bytes); gradients excluded (the 'with grads' "
                  "column has them).", "",
                  f"- boundaries: {pc['layers']} x {_gib(pc['boundary_bytes'])} = {_gib(pc['layers'] * pc['boundary_bytes'])}; "
                  f"one layer's working set (forward + backward, not checkpointed): {_gib(pc['layer']['peak_bytes'])}",
                  "", "| head | peak | with grads | per layer | bound (boundaries + layer) | ratio | target <= 1.10 |",
                  "|---|---|---|---|---|---|---|"]
        for name, v in pc["variants"].items():
            lines.append(f"| {name} | {_gib(v['peak_bytes'])} | {_gib(v['peak_with_grads_bytes'])} | "
                         f"{_gib(v.get('per_layer_bytes'))} | {_gib(v['bound_bytes'])} | {v['ratio']:.3f} | "
                         f"{'met' if v['met'] else 'NOT met'} |")
        for name, v in pc["variants"].items():
            notes = []
            if v.get("affine") is False:
                notes.append("the traced counts' increments differ: the extrapolation is not exact")
            if "check" in v:
                c = v["check"]
                notes.append(f"check at {c['layers']} layers: traced {_gib(c['traced'])}, extrapolated "
                             f"{_gib(c['extrapolated'])}")
            if v["measured_at_full"] and "extrapolated_peak_bytes" in v:
                notes.append(f"extrapolated to {pc['layers']} layers: {_gib(v['extrapolated_peak_bytes'])}")
            if "cuda_max_allocated_bytes" in v:
                notes.append(f"CUDA max_memory_allocated above the start (grads included): "
                             f"{_gib(v['cuda_max_allocated_bytes'])}")
            shown = str(pc["layers"]) if v["measured_at_full"] else next(iter(v["traced"]))
            alive = "; ".join(f"{a['count']} x {a['each'] / 2**20:.1f} MiB {a['op']}"
                              for a in v["traced"][shown]["at_peak"][:8])
            lines.append("")
            lines.append(f"- {name}: " + ("; ".join(notes) + ". " if notes else "") +
                         f"Alive at the peak ({shown} layer(s), largest first): {alive}")
    tc = result.get("time")
    if tc:
        lines += ["", f"Step time and peak, fuse + enable_checkpointing, {tc['layers']} layers of hidden "
                      f"{result['shape']['hidden_size']}, s{tc['seq']} b{tc['batch']} bf16 "
                      "(Liger: its Llama kernels + Hugging Face's checkpointing):", "",
                  "| variant | step ms, median (p20-p80) | peak GiB (activations) | with grads | CUDA max allocated |",
                  "|---|---|---|---|---|"]
        for name, r in tc["rows"].items():
            if "error" in r:
                lines.append(f"| {name} | {r['error']} | | | |")
                continue
            lines.append(f"| {name} | {common.ms(r.get('step_s'))} | {_gib(r['peak_bytes'])} | "
                         f"{_gib(r['peak_with_grads_bytes'])} | {_gib(r.get('cuda_max_allocated_bytes'))} |")
        if "time_ratio" in tc:
            lines += ["", f"- fused head / HF head step time: {tc['time_ratio']:.3f} (target <= {TIME_TARGET})"]
        if tc.get("liger_skipped"):
            lines += [f"- {tc['liger_skipped']}"]
    return "\n".join(lines) + "\n"


def validate(args) -> dict:
    """The accounting (no compute) against a computed CPU run of the same step, small shape: the two peaks,
    and the difference (what CPU kernels allocate for themselves)."""
    device = torch.device("cpu")
    shape = dict(TINY)
    ids = torch.randint(0, shape["vocab_size"], (1, 96))
    out = {}
    for variant in VARIANTS:
        got = {}
        for compute in (False, True):
            model = setup(build(shape, 2, device, compute), variant)
            got["computed" if compute else "accounted"] = step_memory(model, ids, device, compute)
        out[variant] = got
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--tiny", action="store_true", help="a tiny Llama (tests, the GPU report's dry run)")
    p.add_argument("--layers", type=int, default=None, help="the model's layers (default 32; tiny 4)")
    p.add_argument("--seq", type=int, default=None, help="default 8192 (tiny 128)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--trace-layers", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--check-layers", type=int, default=4, help="one more count traced to check the extrapolation "
                                                               "(0: none)")
    p.add_argument("--direct", action="store_true", help="trace the full layer count too")
    p.add_argument("--compute", action=argparse.BooleanOptionalAction, default=None,
                   help="compute (default on CUDA) or only account (default on CPU)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--time", action="store_true", help="also the step times (GPU): fused head vs HF's head")
    p.add_argument("--no-peak", action="store_true", help="skip the memory check")
    p.add_argument("--time-layers", type=int, default=2)
    p.add_argument("--time-seq", type=int, default=4096)
    p.add_argument("--time-batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--validate", action="store_true", help="accounting vs a computed CPU run (small shape)")
    common.add_output_args(p)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    args.shape = dict(TINY if args.tiny else LLAMA3_8B)
    args.layers = args.layers or args.shape["num_hidden_layers"]
    args.seq = args.seq or (128 if args.tiny else 8192)
    args.compute = device.type == "cuda" if args.compute is None else args.compute
    if args.tiny:
        args.time_seq, args.time_batch = min(args.time_seq, 64), min(args.time_batch, 2)
    info = common.env_info(device)
    result = {"env": info, "args": {k: v for k, v in vars(args).items() if k != "shape"}, "shape": args.shape}
    if args.validate:
        result["validate"] = validate(args)
        for variant, got in result["validate"].items():
            a, c = got["accounted"], got["computed"]
            print(f"validate {variant}: accounted peak {a['peak_bytes']} B (with grads {a['peak_with_grads_bytes']}), "
                  f"computed {c['peak_bytes']} B (with grads {c['peak_with_grads_bytes']})")
    if not args.no_peak:
        result["peak"] = peak_check(args, device)
    if args.time:
        result["time"] = time_check(args, device)
    result["env"] = common.finish_env(info)
    result["markdown"] = to_markdown(result)
    print(result["markdown"])
    if args.out or args.save_results:
        common.write_results(common.output_dir(args, result["env"]), "bench_step_memory", result, result["markdown"])
    return result


if __name__ == "__main__":
    main()
