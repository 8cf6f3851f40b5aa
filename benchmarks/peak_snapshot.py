"""What is live at a CUDA training step's memory peak, and who allocated it (issue 32: fuse + ckpt's peak).

The caching allocator's history (`torch.cuda.memory._record_memory_history`) records every allocation and free
of a step with the Python stack that made it. `record_step` runs one step under it and `peak_from_trace` replays
the trace: the running total of allocated bytes, its maximum, and the blocks live at that moment, grouped by the
first stack frame outside torch (a line of transformers, ckpt_ext or the benchmark). Blocks allocated before the
step (parameters, gradients, the pool's chunks kept from the previous step) are not in the trace: they are the
`base`, `torch.cuda.memory_allocated()` when recording starts.

The bytes are the allocator's block sizes (requests rounded up to 512 bytes; a large block not worth splitting is
counted whole), so the trace's peak is `torch.cuda.max_memory_allocated()` of the same step; the difference
between two variants' peaks is then read block by block, which live-tensor accounting
(`bench_work.py --peak`) cannot do for workspaces, rounding and blocks freed around the peak.

Used by `bench_profile.py --memory VARIANTS` (the GPU report's section d). CUDA only; `peak_from_trace` is plain
Python over the trace's dicts and is tested on CPU with synthetic traces (tests/test_bench_tools.py).
"""
from collections import defaultdict
from typing import Callable, Dict, List, Optional

_TORCH_PARTS = ("/torch/", "\\torch\\")


def site(frames: Optional[List[dict]]) -> str:
    """The first frame (innermost first, as the allocator records them) that is not torch's own: 'file:line
    (function)', the file shortened to its last two path components; '?' when no frame is recorded."""
    if not frames:
        return "?"
    chosen = next((f for f in frames if not any(p in (f.get("filename") or "") for p in _TORCH_PARTS)
                   and f.get("filename") not in ("??", "")), frames[0])
    name = (chosen.get("filename") or "?").replace("\\", "/").split("/")
    return f"{'/'.join(name[-2:])}:{chosen.get('line', '?')} ({chosen.get('name', '?')})"


def peak_from_trace(trace: List[dict], base: int = 0, top: int = 12) -> dict:
    """Replays an allocator trace (one device's list of `{'action', 'addr', 'size', 'frames'}` entries).

    Returns {'peak_bytes' (base + the running total's maximum), 'base_bytes', 'events', 'at_event' (index of the
    event that reached the peak), 'live_at_peak' (bytes the trace allocated and had not freed at the peak),
    'reserved_at_peak' (segment bytes the trace mapped, net, at the peak; None without segment events),
    'groups' (the live blocks at the peak by allocation site, largest first: site, bytes, blocks),
    'largest' (the `top` largest live blocks: size, site)}. A block is freed at 'free_completed' (when a
    stream's use of it has ended, as the allocated-bytes statistic counts), or at 'free_requested' in a trace
    without completions."""
    frees = {"free_completed"} if any(e.get("action") == "free_completed" for e in trace) else {"free_requested"}
    live: Dict[int, dict] = {}
    total = peak = 0
    at = -1
    peak_live: Dict[int, dict] = {}
    segments = 0
    seen_segments = False
    reserved_at_peak = 0
    for i, e in enumerate(trace):
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > peak:
                peak, at = total, i
                peak_live = dict(live)
                reserved_at_peak = segments
        elif action in frees:
            block = live.pop(e["addr"], None)
            if block is not None:
                total -= block["size"]
        elif action in ("segment_alloc", "segment_map"):
            seen_segments = True
            segments += e["size"]
        elif action in ("segment_free", "segment_unmap"):
            seen_segments = True
            segments -= e["size"]
    groups: Dict[str, List[int]] = defaultdict(lambda: [0, 0])
    for block in peak_live.values():
        g = groups[site(block.get("frames"))]
        g[0] += block["size"]
        g[1] += 1
    ordered = sorted(groups.items(), key=lambda kv: -kv[1][0])
    largest = sorted(peak_live.values(), key=lambda b: -b["size"])[:top]
    return {"peak_bytes": base + peak, "base_bytes": base, "events": len(trace), "at_event": at,
            "live_at_peak": peak, "reserved_at_peak": reserved_at_peak if seen_segments else None,
            "groups": [{"site": s, "bytes": b, "blocks": n} for s, (b, n) in ordered[:top]],
            "other_groups_bytes": sum(b for _, (b, _n) in ordered[top:]),
            "largest": [{"bytes": b["size"], "site": site(b.get("frames"))} for b in largest]}


def record_step(step: Callable[[], None], device, top: int = 12, max_entries: int = 200_000) -> dict:
    """Runs `step` once with the allocator's history recorded (Python stacks) and returns peak_from_trace's
    summary plus 'max_allocated_bytes' (the allocator's own peak of the same step, which the trace's must equal)."""
    import torch

    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        step()
        torch.cuda.synchronize(device)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    index = torch.device(device).index
    traces = snap.get("device_traces") or []
    trace = traces[index if index is not None else torch.cuda.current_device()] if traces else []
    out = peak_from_trace(trace, base=base, top=top)
    out["max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    out["truncated"] = len(trace) >= max_entries
    return out


def to_markdown_lines(label: str, r: dict) -> List[str]:
    """The summary as Markdown lines (MiB)."""
    m = 2.0 ** 20
    reserved = "-" if r.get("reserved_at_peak") is None else f"{r['reserved_at_peak'] / m:.1f}"
    lines = [f"**{label}**: peak {r['peak_bytes'] / m:.1f} MiB (allocator's max {r.get('max_allocated_bytes', 0) / m:.1f}"
             f"), of which before the step {r['base_bytes'] / m:.1f}, allocated in the step and live at the peak "
             f"{r['live_at_peak'] / m:.1f}; segments mapped in the step, net, at the peak {reserved} MiB; "
             f"{r['events']} events{' (TRUNCATED)' if r.get('truncated') else ''}", "",
             "| live at the peak, by site | MiB | blocks |", "|---|---|---|"]
    lines += [f"| `{g['site']}` | {g['bytes'] / m:.1f} | {g['blocks']} |" for g in r["groups"]]
    if r.get("other_groups_bytes"):
        lines.append(f"| (other sites) | {r['other_groups_bytes'] / m:.1f} | |")
    lines += ["", "largest live blocks: " + ", ".join(f"{b['bytes'] / m:.1f} MiB `{b['site']}`" for b in r["largest"])]
    return lines
