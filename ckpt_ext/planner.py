"""The memory-budget planner: which layers of a chain to checkpoint, and how to group them.

Each layer i of a chain has
  act_bytes[i]       bytes its forward keeps for backward when it is not checkpointed,
  boundary_bytes[i]  bytes of its input (what a checkpointed segment starting at i keeps),
  compute[i]         the cost of its forward (what replaying it costs).
A plan splits the chain into consecutive segments, each either *kept* (ordinary autograd) or
*checkpointed* (only its input boundary is kept; replayed in backward). Its memory is

  need = held + largest replay
  held    = sum of act_bytes over kept layers + boundary_bytes of each checkpointed segment's first layer
  replay  = act_bytes of a checkpointed segment, rebuilt while that segment's backward runs,

and its cost is the recompute: the compute of every checkpointed layer. `plan_chain` finds the plan
of least recompute whose need fits the budget (an exact dynamic program over segment ends with Pareto
fronts of (held, recompute), for each bound on the largest replay); `sqrt_plan` is Chen et al.'s
sqrt(n) schedule. Both are pure functions of the costs, tested against brute force.
"""
import math
import re
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

__all__ = ["LayerCost", "Plan", "plan_chain", "sqrt_plan", "min_need_bytes", "parse_bytes"]


@dataclass(frozen=True)
class LayerCost:
    act_bytes: int
    boundary_bytes: int
    compute: float


@dataclass
class Plan:
    segments: List[Tuple[int, int, bool]]  # (start, end exclusive, checkpointed)
    held_bytes: int
    replay_bytes: int
    recompute: float
    total_compute: float = 0.0
    budget: Optional[int] = None
    costs: List[LayerCost] = field(default_factory=list, repr=False)

    @property
    def need_bytes(self) -> int:
        return self.held_bytes + self.replay_bytes

    def checkpointed_layers(self) -> List[int]:
        return [i for s, e, c in self.segments if c for i in range(s, e)]

    def describe(self) -> str:
        lines = []
        if self.budget is not None:
            lines.append(f"budget {fmt_bytes(self.budget)}")
        lines.append(f"predicted: {fmt_bytes(self.held_bytes)} held from forward to backward + "
                     f"{fmt_bytes(self.replay_bytes)} for the largest replay = {fmt_bytes(self.need_bytes)}")
        share = self.recompute / self.total_compute if self.total_compute else 0.0
        lines.append(f"predicted recompute: {share:.0%} of one forward ({len(self.checkpointed_layers())} of "
                     f"{sum(e - s for s, e, _ in self.segments)} layers replayed)")
        for s, e, c in self.segments:
            name = f"layers {s}-{e - 1}" if e - s > 1 else f"layer {s}"
            if c:
                held = self.costs[s].boundary_bytes if self.costs else 0
                lines.append(f"  {name}: checkpointed as one segment (keeps {fmt_bytes(held)})")
            else:
                held = sum(c_.act_bytes for c_ in self.costs[s:e]) if self.costs else 0
                lines.append(f"  {name}: kept (keeps {fmt_bytes(held)})")
        return "\n".join(lines)


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(size: Union[int, str]) -> int:
    """'20GiB', '1.5 GB', '512MiB', 123456 -> bytes."""
    if isinstance(size, bool):
        raise TypeError(f"a memory budget must be a size such as '20GiB' or a number of bytes, got {size!r}")
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"a memory budget must be positive, got {size}")
        return size
    if isinstance(size, float):
        if not math.isfinite(size) or size <= 0:
            raise ValueError(f"a memory budget must be a positive finite number of bytes, got {size}")
        return int(size)
    if not isinstance(size, str):
        raise TypeError(f"a memory budget must be a size such as '20GiB' or a number of bytes, got {type(size).__name__}")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", size)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read the memory budget {size!r}: use a number with a unit such as "
                         "'20GiB', '512MiB', '1.5GB', or a number of bytes")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"a memory budget must be positive, got {size!r}")
    return int(value)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def _check_costs(costs: Sequence[LayerCost]):
    if not costs:
        raise ValueError("a plan needs at least one layer")
    for c in costs:
        if c.act_bytes < 0 or c.boundary_bytes < 0 or c.compute < 0:
            raise ValueError(f"layer costs must be non-negative, got {c}")


def _finish(costs, segments, budget) -> Plan:
    held = replay = 0
    recompute = 0.0
    for s, e, ckpt in segments:
        acts = sum(c.act_bytes for c in costs[s:e])
        if ckpt:
            held += costs[s].boundary_bytes
            replay = max(replay, acts)
            recompute += sum(c.compute for c in costs[s:e])
        else:
            held += acts
    return Plan(list(segments), held, replay, recompute, sum(c.compute for c in costs), budget, list(costs))


def min_need_bytes(costs: Sequence[LayerCost]) -> int:
    """The least memory any plan needs (what the smallest achievable budget is)."""
    return plan_chain(costs, None).need_bytes


def plan_chain(costs: Sequence[LayerCost], budget: Optional[int]) -> Plan:
    """The plan of least recompute whose need fits `budget` (ties: least need). budget=None gives the
    plan of least need. Raises ValueError when no plan fits, stating the minimum."""
    _check_costs(costs)
    n = len(costs)
    prefix_act = [0]
    prefix_cmp = [0.0]
    for c in costs:
        prefix_act.append(prefix_act[-1] + c.act_bytes)
        prefix_cmp.append(prefix_cmp[-1] + c.compute)

    def work(i, j):
        return prefix_act[j] - prefix_act[i]

    best: Optional[Tuple[float, int, List]] = None  # (recompute, need, segments)
    bounds = sorted({work(i, j) for i in range(n) for j in range(i + 1, n + 1)} | {0})
    for bound in bounds:
        if budget is not None and bound > budget:
            break
        # fronts[j]: non-dominated (held, recompute, segments) for the prefix of j layers, every
        # checkpointed segment's replay within `bound`.
        fronts: List[List[Tuple[int, float, Tuple]]] = [[] for _ in range(n + 1)]
        fronts[0] = [(0, 0.0, ())]
        for j in range(1, n + 1):
            cand = []
            for held, rc, segs in fronts[j - 1]:  # layer j-1 kept
                cand.append((held + costs[j - 1].act_bytes, rc, segs + ((j - 1, j, False),)))
            for i in range(j - 1, -1, -1):  # layers i..j-1 checkpointed as one segment
                if work(i, j) > bound:
                    break
                for held, rc, segs in fronts[i]:
                    cand.append((held + costs[i].boundary_bytes, rc + prefix_cmp[j] - prefix_cmp[i],
                                 segs + ((i, j, True),)))
            cand.sort(key=lambda t: (t[0], t[1]))
            front = []
            for t in cand:
                if budget is not None and t[0] + bound > budget:
                    break
                if not front or t[1] < front[-1][1]:
                    front.append(t)
            fronts[j] = front
        for held, rc, segs in fronts[n]:
            plan = _finish(costs, _merge_kept(segs), budget)
            if budget is not None and plan.need_bytes > budget:
                continue
            key = (plan.recompute, plan.need_bytes) if budget is not None else (plan.need_bytes, plan.recompute)
            if best is None or key < best[0]:
                best = (key, plan)
    if best is None:
        least = plan_chain(costs, None).need_bytes
        raise ValueError(f"the memory budget {fmt_bytes(budget)} is below the least achievable for this model "
                         f"and input: {fmt_bytes(least)} ({least} bytes) of activations")
    return best[1]


def _merge_kept(segs) -> List[Tuple[int, int, bool]]:
    out: List[Tuple[int, int, bool]] = []
    for s, e, c in segs:
        if out and not c and not out[-1][2] and out[-1][1] == s:
            out[-1] = (out[-1][0], e, False)
        else:
            out.append((s, e, c))
    return out


def sqrt_plan(costs: Sequence[LayerCost]) -> Plan:
    """Chen et al. (2016): segments of about sqrt(n) layers, every segment checkpointed."""
    _check_costs(costs)
    n = len(costs)
    size = max(1, int(round(math.sqrt(n))))
    return _finish(costs, [(s, min(n, s + size), True) for s in range(0, n, size)], None)
