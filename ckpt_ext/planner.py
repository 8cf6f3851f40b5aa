"""The memory-budget planner: which layers of a chain to checkpoint, how to group them, and what each
checkpointed group keeps.

Each layer i of a chain has
  act_bytes[i]       bytes its forward keeps for backward when it is not checkpointed,
  boundary_bytes[i]  bytes of its input (what a checkpointed segment starting at i keeps),
  compute[i]         the cost of its forward (what replaying it costs),
and, where it can keep its attention (keep="attention": an SDPA kernel with a log-sum-exp),
  attn_bytes[i]      bytes of its attention kernel's output and log-sum-exp (None: it cannot keep them),
  attn_compute[i]    the cost of its attention forward (what a keep-attention replay skips),
and per further keep level it can be checkpointed at (levels[i]: "attention_inputs", "gemms", "gemms_attention",
ckpt_ext/keep.py) the bytes it keeps, the bytes of its saved tensors among them and the compute its replay skips.
A plan splits the chain into consecutive segments, each either *kept* (ordinary autograd),
*checkpointed* (only its input boundary is kept; replayed in backward) or *checkpointed keeping
attention* (its input boundary and its layers' attention outputs and LSEs are kept; replayed in backward
without the attention forwards), or checkpointed at another keep level (keeping what that level keeps, the replay
skipping what computed it). Its memory is

  need = max(held, the largest of a segment's replay + the bytes held by it and the segments before it) + working set
  held    = sum of act_bytes over kept layers + boundary_bytes of each checkpointed segment's first layer
            (+ the bytes its layers keep at its level: attn_bytes when it keeps attention)
  replay  = act_bytes of a checkpointed segment, rebuilt while that segment's backward runs (less the kept
            bytes among them: the replay is handed the kept tensors, already counted),
  working = the largest work_bytes of any layer: what a layer has alive on top of those in its forward or backward
            (temporaries, its output's and input's gradients), the same for every plan,

and its cost is the recompute: the compute of every checkpointed layer (less its attn_compute in a
segment keeping attention, less what its level skips at another level). A plan's segments are (start, end, how):
how is False (kept), True (checkpointed, boundary only) or a level name ("attention": checkpointed keeping
attention; "attention_inputs", "gemms", "gemms_attention"). `plan_chain` finds the plan
of least recompute whose need fits the budget (within 1%, certified; exact on small integer computes:
a dynamic program over (layers, recompute units) whose value is the least bytes held by a prefix,
explained below), in well under a second for 128 layers (seconds with every keep level: one option per level per segment); `sqrt_plan` is Chen et al.'s sqrt(n)
schedule. Both are pure functions of the costs, tested against brute force.

BERT's pre-norm boundary (issue 32; LayerCost.pre_norm, measured for fused BERT/RoBERTa layers): a segment
checkpointed boundary-only or keeping attention may run with it (Plan.boundaries, a choice per segment). Ending at a
layer that has one, it then also holds that layer's second norm's input and row statistics (PreNorm.kept_bytes) and
its replay skips the layer's output linear and norm (PreNorm.skipped); called on the output of a segment that holds
one (the layer chained), it holds no input of its own (the sum is held already) and its replay recomputes the input
(PreNorm.input_compute of the layer before). A chain of k such segments holds its first input, k sums and k
statistics instead of k inputs. The search tracks whether the plan so far ends with a segment holding a sum.
"""
import math
import re
import sys
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

__all__ = ["LayerCost", "PreNorm", "Plan", "plan_chain", "sqrt_plan", "parse_bytes"]


ATTENTION = "attention"  # a plan segment's `how`: checkpointed keeping attention
# The other ways a checkpointed segment can keep (ckpt_ext/keep.py's levels), by what they keep besides the input:
# the attention output + LSE and the GEMM outputs before it (the q/k/v projections); all GEMM outputs; both.
LEVELS = (ATTENTION, "attention_inputs", "gemms", "gemms_attention")
_WITH_ATTENTION = (ATTENTION, "attention_inputs", "gemms_attention")
# The ways of checkpointing a segment that may run with BERT's pre-norm boundary (the levels keeping GEMM outputs run
# without it: their kept output GEMM and the boundary's skipped one are not accounted together)
BOUNDARY_HOWS = (True, ATTENTION)


@dataclass(frozen=True)
class Level:
    """A layer checkpointed at a keep level above "attention": the bytes it keeps, the bytes of its saved tensors
    among them (its replay does not rebuild them), the compute its replay skips; whole: False when part of it
    cannot be kept (the layer's attention, which then is recomputed): measured so, the planner chooses it only
    when keep= names it."""
    name: str
    kept_bytes: int
    saved_kept_bytes: int
    skipped: float
    whole: bool = True
    # of kept_bytes, what the layer does not keep when it is the last of its segment (a fused layer's last linear:
    # the segment's replay skips it anyway, so its output is not kept)
    tail_bytes: int = 0


@dataclass(frozen=True)
class PreNorm:
    """A fused BERT/RoBERTa layer's pre-norm boundary (csrc/layers/layer.h, PreNormBoundary). A segment run with the
    boundary and ending at the layer keeps kept_bytes (the layer's second norm's input and row statistics) and its
    replay skips `skipped` (that layer's output linear and norm); a segment run with it, called on the output of such
    a segment, keeps no input (the sum is held already) and its replay adds input_compute (the norm recomputing the
    input from the sum). keeps: False where the layer keeps no boundary as a segment's last (an adapter on its output
    linear); it still takes one as its input."""
    kept_bytes: int
    skipped: float
    input_compute: float
    keeps: bool = True
    # of the segment's replay bytes, what a segment ending at the layer with the boundary does not rebuild: its
    # output linear's input (the activation's output, written in place by the activation's backward)
    replay_bytes: int = 0


@dataclass(frozen=True)
class LayerCost:
    act_bytes: int
    boundary_bytes: int
    compute: float
    attn_bytes: Optional[int] = None  # None: the layer cannot keep its attention
    attn_compute: float = 0.0
    levels: Tuple[Level, ...] = ()  # the levels beyond "attention" it can be checkpointed at (measured)
    pre_norm: Optional[PreNorm] = None  # a fused BERT/RoBERTa layer's pre-norm boundary (None: the layer has none)
    # of compute, what the replay does not run when the layer is the last of its segment: a fused GPT-2/Llama layer's
    # last linear and the activation computing its input (the segment's replay stops before both, the activation's
    # backward writing that input: _C.tail_activation_in_backward, issue 33; tail_time)
    tail_compute: float = 0.0
    # the layer's working set: the most bytes it has alive on top of what it keeps for backward -- in its forward
    # (temporaries and its output, beyond act_bytes) or in its backward (its output's gradient, the gradients and
    # temporaries of its backward, its input's gradient; less the saved tensors it frees on the way) --, measured
    # (stack_plan._working_set). Every layer runs forward and backward in every plan, so a plan's peak counts the
    # largest of them once (Plan.working_bytes).
    work_bytes: int = 0
    # of act_bytes, what the replay does not rebuild when the layer is the last of its segment: a fused GPT-2/Llama
    # layer's last linear's input (the activation's output, which the activation's backward writes in place:
    # _C.tail_activation_in_backward; tail_replay)
    tail_replay_bytes: int = 0

    @property
    def keeps_attention(self) -> bool:
        return self.attn_bytes is not None

    def level(self, how, strict: bool = True) -> Optional[Tuple[int, int, float]]:
        """(bytes kept besides the boundary, replay bytes, recompute) of the layer in a segment checkpointed `how`
        (True: boundary only; a level name). None when strict and the layer cannot keep that way; not strict, a
        level the layer lacks falls back as fused layers do: to "attention" where it keeps attention, else to
        the boundary only."""
        if how is True:
            return 0, self.act_bytes, self.compute
        found = next((lv for lv in self.levels if lv.name == how), None)
        if found is not None and (found.whole or not strict):
            return (found.kept_bytes, max(0, self.act_bytes - found.saved_kept_bytes),
                    max(0.0, self.compute - found.skipped))
        if how == ATTENTION or (not strict and found is None and how in _WITH_ATTENTION):
            if self.attn_bytes is not None:
                return self.attn_bytes, max(0, self.act_bytes - self.attn_bytes), max(0.0, self.compute -
                                                                                      self.attn_compute)
        return None if strict else (0, self.act_bytes, self.compute)

    def tail(self, how, strict: bool = True) -> int:
        """Of level(how)'s kept bytes, those the layer does not keep as the last layer of its segment."""
        if how is True:
            return 0
        found = next((lv for lv in self.levels if lv.name == how), None)
        return found.tail_bytes if found is not None and (found.whole or not strict) else 0

    def tail_time(self, how) -> float:
        """Of recompute(how), what the layer's replay skips as the last layer of its segment (tail_compute): nothing
        where its level skips that GEMM anyway (a level keeping GEMM outputs: Level.tail_bytes, its skipped time
        counting every GEMM)."""
        if how is True:
            return min(self.tail_compute, self.compute)
        found = next((lv for lv in self.levels if lv.name == how), None)
        if found is not None and found.tail_bytes:
            return 0.0
        return min(self.tail_compute, self.recompute(how))

    def tail_replay(self, how) -> int:
        """Of level(how)'s replay bytes, those the layer's replay does not rebuild as the last layer of its segment
        (tail_replay_bytes): none at the levels keeping GEMM outputs (their replay runs the activation forward)."""
        if how in ("gemms", "gemms_attention"):
            return 0
        return min(self.tail_replay_bytes, self.level(how, strict=False)[1])

    def recompute(self, how) -> float:
        """What replaying the layer costs in a segment checkpointed `how` (True or a level)."""
        return self.level(how, strict=False)[2]


def segment_bytes(costs: Sequence[LayerCost], s: int, e: int, how) -> Tuple[int, int]:
    """(held, replay) bytes of segment [s, e) checkpointed `how` (True or a level)."""
    parts = [c.level(how, strict=False) for c in costs[s:e]]
    return (costs[s].boundary_bytes + sum(p[0] for p in parts) - costs[e - 1].tail(how, strict=False),
            sum(p[1] for p in parts) - costs[e - 1].tail_replay(how))


def segment_costs(costs: Sequence[LayerCost], segments, boundaries=frozenset(),
                  chained: Optional[Sequence[bool]] = None) -> List[Tuple[int, int, float, bool, bool]]:
    """Per segment of a plan: (held bytes, replay bytes, recompute, whether it keeps a pre-norm boundary, whether it
    takes the one before as its input instead of keeping its input). boundaries: the starts of the segments run with
    the pre-norm boundary (Plan.boundaries)."""
    out = []
    before = False  # the segment before keeps a pre-norm boundary
    for s, e, how in segments:
        if not how:
            out.append((sum(c.act_bytes for c in costs[s:e]), 0, 0.0, False, False))
            before = False
            continue
        held, replay = segment_bytes(costs, s, e, how)
        rc = max(0.0, sum(c.recompute(how) for c in costs[s:e]) - costs[e - 1].tail_time(how))
        keeps = takes = False
        if s in boundaries:
            if how not in BOUNDARY_HOWS or any(c.pre_norm is None for c in costs[s:e]):
                raise ValueError(f"segment {s}-{e - 1} ({how!r}) cannot run with the pre-norm boundary")
            last = costs[e - 1].pre_norm
            keeps = last.keeps
            takes = before and s > 0 and (chained is None or chained[s])
            if keeps:
                held += last.kept_bytes
                replay = max(0, replay - last.replay_bytes)
                rc = max(0.0, rc - last.skipped)
            if takes:
                held -= costs[s].boundary_bytes
                rc += costs[s - 1].pre_norm.input_compute
        out.append((held, replay, rc, keeps, takes))
        before = keeps
    return out


@dataclass
class Plan:
    segments: List[Tuple[int, int, Union[bool, str]]]  # (start, end exclusive, False | True | a level name)
    held_bytes: int
    # what the replays add to held_bytes at the peak: the largest of a segment's replay + the bytes held by it and
    # the segments before it (those after it have freed theirs when it replays), less held_bytes; 0 if none exceeds
    replay_bytes: int
    recompute: float
    total_compute: float = 0.0
    budget: Optional[int] = None
    costs: List[LayerCost] = field(default_factory=list, repr=False)
    # seconds the layers' forward and backward took without checkpointing, when measured (explain's step time)
    base_time: Optional[float] = None
    shared_bytes: int = 0  # of held_bytes: tensors every layer receives (a mask, rotary tables), counted once
    # the starts of the segments run with BERT's pre-norm boundary (LayerCost.pre_norm), and the chain's `chained`
    boundaries: frozenset = frozenset()
    chained: Optional[List[bool]] = field(default=None, repr=False)
    # the layers' working set (the largest LayerCost.work_bytes): alive on top of held + replay at the peak
    working_bytes: int = 0

    @property
    def need_bytes(self) -> int:
        return self.held_bytes + self.replay_bytes + self.working_bytes

    def checkpointed_layers(self) -> List[int]:
        return [i for s, e, c in self.segments if c for i in range(s, e)]

    def describe(self) -> str:
        """The plan in words: the budget, the predicted peak and overhead, and each segment's choice (computes
        in seconds, as the stack planner measures them)."""
        lines = []
        if self.budget is not None:
            lines.append(f"budget {fmt_bytes(self.budget)}")
        shared = (f" (of which {fmt_bytes(self.shared_bytes)} the tensors every layer receives)"
                  if self.shared_bytes else "")
        working = (f" + {fmt_bytes(self.working_bytes)} for a layer's forward or backward working set"
                   if self.working_bytes else "")
        lines.append(f"predicted peak: {fmt_bytes(self.held_bytes)} held from forward to backward{shared} + "
                     f"{fmt_bytes(self.replay_bytes)} for the replay at the peak (the segments after it freed)"
                     f"{working} = {fmt_bytes(self.need_bytes)}")
        share = self.recompute / self.total_compute if self.total_compute else 0.0
        n = sum(e - s for s, e, _ in self.segments)
        replayed = len(self.checkpointed_layers())
        per_level = {lv: sum(e - s for s, e, how in self.segments if how == lv) for lv in LEVELS}
        overhead = (f"predicted overhead: +{self.recompute * 1e3:.1f} ms of recompute per training step = {share:.0%} "
                    f"of one forward of the layers")
        if self.base_time:
            overhead += (f"; the layers' forward and backward without checkpointing took "
                         f"{self.base_time * 1e3:.1f} ms, so {self.base_time * 1e3:.1f} -> "
                         f"{(self.base_time + self.recompute) * 1e3:.1f} ms (+{self.recompute / self.base_time:.1%})")
        lines.append(overhead)
        per_segment = segment_costs(self.costs, self.segments, self.boundaries, self.chained) if self.costs else None
        levels = ", ".join(f"{k} {_LEVEL_WORDS[lv][0]}" for lv, k in per_level.items() if k)
        if replayed:
            rest = "" if not levels or sum(per_level.values()) == replayed else ", the others only their input"
            lines.append(f"{replayed} of {n} layers replayed ({levels or 'each keeping only its input'}{rest}), "
                         f"{n - replayed} kept whole")
        else:
            lines.append(f"0 of {n} layers replayed, {n} kept whole")
        chains = sum(1 for k, (s, *_) in enumerate(self.segments)
                     if s in self.boundaries and per_segment and not per_segment[k][4])
        if self.boundaries:
            lines.append(f"{len(self.boundaries)} segments run with BERT's pre-norm boundary ({chains} chain(s) of "
                         "them: each segment keeps its last layer's norm input and row statistics instead of the next "
                         "one's input, and replays without that layer's output linear and norm)")
        for k, (s, e, how) in enumerate(self.segments):
            name = f"layers {s}-{e - 1}" if e - s > 1 else f"layer {s}"
            if how:
                held, replay, rc = per_segment[k][:3] if per_segment else (0, 0, 0.0)
                what = _LEVEL_WORDS[how][1] if how in _LEVEL_WORDS else "keeping only its input"
                if per_segment and per_segment[k][4]:
                    taken = ("not its input (recomputed in its replay from the segment before's pre-norm sum with one "
                             "add_layer_norm)")
                    if what == "keeping only its input":
                        what = f"keeping no input ({taken[len('not its input ('):]}"
                    else:
                        rest = what.split("its input", 1)[1].lstrip(" ,")
                        what = f"keeping {rest[4:] if rest.startswith('and ') else rest}, {taken}"
                if per_segment and per_segment[k][3]:
                    what += (", and its last layer's norm input and row statistics (BERT's pre-norm boundary: the "
                             "replay skips that layer's output linear and norm)")
                lines.append(f"  {name}: checkpointed as one segment, {what} (holds {fmt_bytes(held)}; replay "
                             f"{fmt_bytes(replay)}, {rc * 1e3:.1f} ms)")
            else:
                held = sum(c_.act_bytes for c_ in self.costs[s:e]) if self.costs else 0
                lines.append(f"  {name}: not checkpointed, keeps everything (holds {fmt_bytes(held)})")
        return "\n".join(lines)


# per level: (how describe() counts the layers, what a segment keeps)
_LEVEL_WORDS = {
    ATTENTION: ("keeping attention", "keeping its input and attention outputs + LSEs"),
    "attention_inputs": ("keeping attention and its inputs",
                         "keeping its input, attention outputs + LSEs and the q/k/v projections' outputs "
                         "(keep='attention_inputs')"),
    "gemms": ("keeping GEMM outputs", "keeping its input and every GEMM output (keep='gemms'; the attention is "
                                      "replayed)"),
    "gemms_attention": ("keeping GEMM and attention outputs",
                        "keeping its input, every GEMM output and attention outputs + LSEs (keep='gemms_attention')"),
}

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
        if c.act_bytes < 0 or c.boundary_bytes < 0 or c.compute < 0 or c.attn_compute < 0 or \
                (c.attn_bytes is not None and c.attn_bytes < 0) or c.tail_compute < 0 or \
                any(lv.kept_bytes < 0 or lv.saved_kept_bytes < 0 or lv.skipped < 0 or lv.name not in LEVELS[1:] or
                    not 0 <= lv.tail_bytes <= lv.kept_bytes
                    for lv in c.levels) or \
                c.work_bytes < 0 or c.tail_replay_bytes < 0 or (c.pre_norm is not None and c.pre_norm.replay_bytes < 0) or (c.pre_norm is not None and (c.pre_norm.kept_bytes < 0 or c.pre_norm.skipped < 0 or
                                             c.pre_norm.input_compute < 0)):
            raise ValueError(f"layer costs must be non-negative, got {c}")


def _finish(costs, segments, budget, boundaries=frozenset(), chained=None) -> Plan:
    per = segment_costs(costs, segments, boundaries, chained)
    held = sum(p[0] for p in per)
    # the backward runs the segments last first, each freeing what it held: a segment replays beside the bytes held
    # by it and the segments before it
    prefix, top = 0, 0
    for (_, _, how), p in zip(segments, per):
        prefix += p[0]
        if how:
            top = max(top, prefix + p[1])
    return Plan(list(segments), held, max(0, top - held), sum(p[2] for p in per),
                sum(c.compute for c in costs), budget, list(costs), boundaries=frozenset(boundaries),
                chained=None if chained is None else list(chained), working_bytes=working_bytes(costs))


def working_bytes(costs: Sequence[LayerCost]) -> int:
    """The working set every plan adds to its held bytes and largest replay: the largest layer's (LayerCost.work_bytes;
    a layer runs forward and backward whatever the plan)."""
    return max((c.work_bytes for c in costs), default=0)


# ------------------------------------------------------------------------------------------------
# The search. A plan fits a budget (less the working set and the shared tensors, the same for every plan) when the
# bytes it holds fit and each checkpointed segment's replay fits beside the bytes held by it and the segments before
# it (the backward runs the segments last first, each freeing what it held). Both constraints grow with the bytes
# held by a prefix of the plan, so of two prefixes with the same recompute the one holding less is never worse:
# a DP over (layers, recompute units) whose value is the least held bytes of the prefixes fitting so far, a
# segment taken only where it fits beside them, is exact in bytes. The least need (budget=None, and the
# minimum a budget must reach) is the least budget some plan fits, by bisection over the bytes.
#
# The least recompute is a knapsack over segments (NP-hard with arbitrary costs), so recompute is counted in
# units of delta: the DP above, exact in bytes.
# Rounding each checkpointed segment's compute down, a plan P with segments S has
#   delta*U(P) <= true(P) < delta*(U(P) + |S|).
# The DP's plan P^ has the fewest units of all plans that fit, so OPT >= delta*U(P*) >= delta*U(P^):
# when true(P^) <= 1.01*delta*U(P^), P^ is within 1% of optimal -- a certificate checked on every
# answer. Passes refine delta until it holds (true(P^) - delta*U(P^) < delta*n, so it does once
# delta*n <= 1% of OPT): a coarse pass finds the scale, the next usually certifies. Computes that are
# integers summing to few units are counted exactly (delta = 1, nothing rounded): the plan is then
# optimal, which the brute-force tests check. Units stop refining at 1e-12 of the total compute (what
# float sums resolve): a plan whose recompute is below that is within it of the optimum, absolutely.
# Plans without recompute are found first and exactly
# (segments of zero compute only), so a budget that needs no recompute gets none.
# ------------------------------------------------------------------------------------------------
_CERTIFIED = 1.01    # the plan's recompute is at most this times the least possible
_COARSE_UNITS = 20   # units per layer in the first pass (which only finds the scale)
_RESOLUTION = 1e-12  # the finest unit, relative to the total compute (float sums resolve no finer)
_INF = 1 << 62
_ANY = -1  # an option's source state: the plan before it may end either way (else 0, or 1: a segment keeping a sum)


class _Chain:
    def __init__(self, costs: Sequence[LayerCost], chained: Optional[Sequence[bool]] = None,
                 hows: Sequence = (True, ATTENTION)):
        self.costs = list(costs)
        self.n = len(costs)
        self.chained = None if chained is None else list(chained)
        # first[j]: the first layer a segment ending before layer j may start at -- a segment (one
        # checkpointed call running its layers in turn) only spans layers each called on the output of the
        # one before (chained[k]: layer k is; None: every layer is)
        self.first = [0] * (self.n + 1)
        for j in range(2, self.n + 1):
            self.first[j] = self.first[j - 1] if chained is None or chained[j - 1] else j - 1
        self.act = [c.act_bytes for c in costs]
        self.bnd = [c.boundary_bytes for c in costs]
        # Per way of checkpointing a segment (True: boundary only; "attention": keeping attention), prefix sums
        # over the layers of: replay bytes, extra bytes held besides the boundary, recompute, layers with any
        # recompute (whether a segment is free must not depend on float sums: a tiny compute after a large one
        # vanishes in the prefix sum) and layers that cannot checkpoint that way (a segment must have none).
        # One level forced (keep="attention" alone: hows == ("attention",)): a layer that cannot keep that way is
        # checkpointed in such a segment anyway, keeping what it can (LayerCost.level's fallback), as
        # enable_checkpointing(keep=...) does; when the planner chooses, a segment at a level holds only layers
        # that can keep that way (as measured).
        strict = True in hows
        self.hows = [h for h in hows if h is True or not strict or any(c.level(h) is not None for c in costs)]
        self.pw, self.pk, self.pc, self.paid, self.bad = {}, {}, {}, {}, {}
        # per how, per layer: the bytes it does not keep as the last layer of a segment (LayerCost.tail)
        self.tail = {how: [c.tail(how, strict) if c.level(how, strict) is not None else 0 for c in costs]
                     for how in self.hows}
        # per how, per layer: its recompute, and what its replay skips as the last layer of a segment (tail_time)
        self.rc = {how: [c.recompute(how) for c in costs] for how in self.hows}
        self.tailc = {how: [c.tail_time(how) for c in costs] for how in self.hows}
        # per how, per layer: the replay bytes it does not rebuild as the last layer of a segment (tail_replay)
        self.tailr = {how: [c.tail_replay(how) for c in costs] for how in self.hows}
        for how in self.hows:
            pw, pk, pc, paid, bad = [0], [0], [0.0], [0], [0]
            for c in costs:
                got = c.level(how, strict)
                kept, work, rc = got if got is not None else (0, c.act_bytes, c.compute)
                pw.append(pw[-1] + work)
                pk.append(pk[-1] + kept)
                pc.append(pc[-1] + rc)
                paid.append(paid[-1] + (rc != 0))
                bad.append(bad[-1] + (got is None))
            self.pw[how], self.pk[how], self.pc[how], self.paid[how], self.bad[how] = pw, pk, pc, paid, bad
        # BERT's pre-norm boundary: the ways of checkpointing that may run with it, where any layer has one
        self.pre_norm = [c.pre_norm for c in costs]
        self.boundary_hows = [h for h in self.hows if h in BOUNDARY_HOWS] if any(self.pre_norm) else []

    def variants(self, j: int):
        """Every way of checkpointing a segment ending before layer j: (how, runs with the pre-norm boundary, state
        after it (1: it keeps a sum the next segment may take), monotone (its recomputes grow as the start falls),
        its options as options() yields them, each with its source state (_ANY, 0 or 1) appended)."""
        for how in self.hows:
            yield how, False, 0, True, (o + (_ANY,) for o in self.options(j, how))
            if how in self.boundary_hows and self.pre_norm[j - 1] is not None:
                keeps = self.pre_norm[j - 1].keeps
                if keeps:
                    yield how, True, 1, True, self.boundary_options(j, how, False)
                yield how, True, int(keeps), False, self.boundary_options(j, how, True)

    def boundary_options(self, j: int, how, takes: bool):
        """options(j, how) run with the pre-norm boundary (every layer has one), not taking the sum before as the
        input (source state 0 where the segment would take it, else _ANY) or, with `takes`, taking it (source 1)."""
        last = self.pre_norm[j - 1]
        kept, skipped, fewer = (last.kept_bytes, last.skipped, last.replay_bytes) if last.keeps else (0, 0.0, 0)
        for i, work, held, rc, free in self.options(j, how):
            work = max(0, work - fewer)
            if self.pre_norm[i] is None:
                return
            before = self.pre_norm[i - 1] if i > 0 and (self.chained is None or self.chained[i]) else None
            can = before is not None and before.keeps
            rc = max(0.0, rc - skipped)
            if not takes:
                yield i, work, held + kept, rc, free, 0 if can else _ANY
            elif can:
                yield (i, work, held + kept - self.bnd[i], rc + before.input_compute,
                       free and before.input_compute == 0, 1)

    def options(self, j: int, how):
        """The segments [i, j) checkpointed `how`, nearest start first: (i, replay bytes, held bytes, recompute,
        free). Their replay and recompute grow as i falls."""
        pw, pk, pc, paid, bad = self.pw[how], self.pk[how], self.pc[how], self.paid[how], self.bad[how]
        tail, tailc, tailr = self.tail[how][j - 1], self.tailc[how][j - 1], self.tailr[how][j - 1]
        last_free = self.rc[how][j - 1] - tailc <= 0  # the last layer recomputes nothing but what it skips there
        for i in range(j - 1, self.first[j] - 1, -1):
            if bad[j] != bad[i]:
                return
            yield (i, pw[j] - pw[i] - tailr, self.bnd[i] + pk[j] - pk[i] - tail, max(0.0, pc[j] - pc[i] - tailc),
                   paid[j - 1] == paid[i] and last_free)

    def least_held(self, cap: int, free_only: bool) -> int:
        """Least bytes held by a plan that fits `cap` (each checkpointed segment's replay on top of the bytes held
        by it and the segments before it <= cap, and the bytes held <= cap; with free_only, segments of no
        compute only), recompute unlimited; _INF where none does."""
        act = self.act
        h = [(0, _INF)] + [None] * self.n  # per state: the plan so far ends without / with a kept sum
        for j in range(1, self.n + 1):
            kept = min(h[j - 1]) + act[j - 1]
            v = [kept if kept <= cap else _INF, _INF]
            for _, _, dst, _, opts in self.variants(j):
                for i, work, held, _, free, src in opts:
                    if free_only and not free:
                        break
                    total = (min(h[i]) if src == _ANY else h[i][src]) + held
                    if total + work <= cap:
                        v[dst] = min(v[dst], total)
            h[j] = tuple(v)
        return min(h[-1])

    def least_need(self, free_only: bool = False) -> int:
        """The least need of any plan (with free_only: of any plan without recompute), exact: the least cap
        that some plan fits (least_held(cap) <= cap; a plan fitting a cap fits any larger one), by bisection
        between 0 and keeping every layer."""
        lo, hi = -1, sum(self.act)  # (keeping every layer fits its own held bytes)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.least_held(mid, free_only) <= mid:
                hi = mid
            else:
                lo = mid
        return hi


class _UnitsDP:
    """Least held bytes per recompute units for prefixes of the chain, plans fitting a cap (_Chain.least_held); a
    segment's compute counts floor(compute / delta) units (None: segments of zero compute only)."""

    def __init__(self, chain: _Chain, delta: Optional[float], length: int):
        self.chain = chain
        # per end j and way of checkpointing: (start i, units, replay bytes, held bytes) of the segments that
        # can count, nearest start first (units and replay grow as the start falls)
        self.segments = []
        for j in range(chain.n + 1):
            per_how = []
            for how, boundary, dst, monotone, opts in (chain.variants(j) if j else ()):
                segs = []
                for i, work, held, c, free, src in opts:
                    w = (0 if free else length) if delta is None else int(c // delta)
                    if w >= length:  # longer segments cost even more units (where monotone)
                        if monotone:
                            break
                        continue
                    segs.append((i, w, work, held, src))
                per_how.append((how, boundary, dst, monotone, segs))
            self.segments.append(per_how)

    def run(self, cap: int, length: int, keep: bool = False):
        """rows[j][u]: least held of the first j layers with at most u units (u < length), of the plans fitting
        `cap` so far (_Chain.least_held; _INF where none); states[j][s][u] the same for plans ending in state s (1:
        with a segment keeping a pre-norm sum; rows = their minimum). Returns the last row, or (rows, states) when
        `keep` (to trace the plan back)."""
        import numpy as np
        act = self.chain.act
        rows = [np.zeros(length, dtype=np.int64)]
        none = np.full(length, _INF, dtype=np.int64)
        states = [(rows[0], none)]
        for j in range(1, self.chain.n + 1):
            kept = rows[j - 1] + act[j - 1]
            row = [np.where(kept <= cap, kept, _INF), None]
            for _, _, dst, monotone, segs in self.segments[j]:
                for i, w, work, held, src in segs:
                    if w >= length:
                        if monotone:
                            break
                        continue
                    if row[dst] is None:
                        row[dst] = none.copy()
                    source = rows[i] if src == _ANY else states[i][src]
                    total = source[:length - w] + held
                    np.minimum(row[dst][w:], np.where(total + work <= cap, total, _INF), out=row[dst][w:])
            for r in row:
                if r is not None:
                    np.minimum(r, _INF, out=r)
            if row[1] is None:
                row[1] = none
                rows.append(row[0])
            else:
                rows.append(np.minimum(row[0], row[1]))
            states.append(tuple(row))
        return (rows, states) if keep else rows[-1]

    def trace(self, cap: int, u: int):
        """The plan the last run took: (segments, the starts of those run with the pre-norm boundary)."""
        act = self.chain.act
        rows, states = self.run(cap, u + 1, keep=True)
        segs: List[Tuple[int, int, Union[bool, str]]] = []
        boundaries = set()
        j, state = self.chain.n, _ANY
        while j > 0:
            v = int(rows[j][u] if state == _ANY else states[j][state][u])
            if state in (_ANY, 0) and int(states[j][0][u]) == v and int(rows[j - 1][u]) + act[j - 1] == v:
                segs.append((j - 1, j, False))
                j, state = j - 1, _ANY
                continue
            # the DP took v from one of these segments
            how, boundary, i, w, src = next(
                (how, boundary, i, w, src) for how, boundary, dst, _, per in self.segments[j] for i, w, work, held, src in per
                if w <= u and v + work <= cap and (state == _ANY or dst == state) and int(states[j][dst][u]) == v and
                int(rows[i][u - w] if src == _ANY else states[i][src][u - w]) + held == v)
            segs.append((i, j, how))
            if boundary:
                boundaries.add(i)
            j, u, state = i, u - w, src
        return segs[::-1], boundaries


def _plan_with(chain: _Chain, budget: int, delta: Optional[float], length: int):
    """The plan of fewest units (ties: least held) that fits `budget`, and its units; (None, 0) where none does."""
    import numpy as np
    dp = _UnitsDP(chain, delta, length)
    last = dp.run(budget, length)
    ok = last <= budget
    if not ok.any():
        return None, 0
    units = int(np.argmax(ok))
    segs, boundaries = dp.trace(budget, units)
    return _finish(chain.costs, _merge_kept(segs), budget, boundaries, chain.chained), units


def _plan_within(chain: _Chain, budget: int) -> Plan:
    """The plan of least recompute (certified within 1%; exact on small integer computes) whose need is
    <= budget, which must be at least the least need."""
    if chain.least_need(free_only=True) <= budget:  # no recompute needed: the least need of those plans
        return _plan_with(chain, budget, None, 1)[0]
    # (a segment taking a pre-norm sum as its input recomputes the input: more than the layers' compute)
    extra = [(p.skipped, p.input_compute) for p in chain.pre_norm if p is not None] if chain.boundary_hows else []
    n, total = chain.n, max(pc[-1] for pc in chain.pc.values()) + sum(x[1] for x in extra)
    if all(float(c).is_integer() for pc in chain.pc.values() for c in pc) and \
            all(float(t).is_integer() for tl in chain.tailc.values() for t in tl) and \
            all(float(x).is_integer() for pair in extra for x in pair) and total <= 100 * n:
        return _plan_with(chain, budget, 1.0, int(total) + 1)[0]  # exact
    floor = max(_RESOLUTION * total, sys.float_info.min)  # no unit finer (and none subnormal: 1 / it overflows)
    scale, delta = total, max(total / (_COARSE_UNITS * n), floor)
    while True:
        plan, units = _plan_with(chain, budget, delta, int(scale // delta) + 1)
        if plan.recompute <= _CERTIFIED * delta * units:
            return plan
        if delta <= floor:
            # Recompute this small is below what sums of these computes resolve (a 1e-313 layer next to
            # a 1.5 one): the plan is within delta * segments of the optimum, absolutely.
            return plan
        # aim at delta * (segments) <= 0.9% of the recompute found (an upper bound of the optimum)
        segments = max(1, sum(1 for *_, c in plan.segments if c))
        scale = min(scale, plan.recompute)
        delta = max(min(delta / 2, 0.009 * scale / segments), floor)


KEEPS = {"auto": (True,) + LEVELS, "boundaries": (True,), **{lv: (lv,) for lv in LEVELS}}


def plan_chain(costs: Sequence[LayerCost], budget: Optional[int], chained: Optional[Sequence[bool]] = None,
               keep: str = "auto", shared_bytes: int = 0) -> Plan:
    """The plan of least recompute whose need fits `budget` (ties: least need). The recompute is within
    1% of the least possible (certified; see the comment above), exact when computes are small integers
    or no recompute is needed. budget=None gives a plan of least need (exact) with the least recompute
    among those. Raises ValueError when no plan fits, stating the minimum. chained[k] (k >= 1) says
    whether layer k is called on layer k-1's output; a segment groups only such layers (None: all are).
    keep: how checkpointed segments may keep ("auto": boundary only, or at any level every layer of the segment
    can keep; "boundaries": boundary only; a level ("attention", "attention_inputs", "gemms", "gemms_attention"):
    every checkpointed segment at that level, a layer that cannot keeping what LayerCost.level falls back to). shared_bytes: held whatever the plan (tensors every layer receives, e.g. a mask or
    rotary tables, counted once and in no layer's costs)."""
    _check_costs(costs)
    if chained is not None and len(chained) != len(costs):
        raise ValueError(f"chained has {len(chained)} entries for {len(costs)} layers")
    if keep not in KEEPS:
        raise ValueError(f"keep must be one of {', '.join(map(repr, KEEPS))}, got {keep!r}")
    if shared_bytes < 0:
        raise ValueError(f"shared_bytes must be non-negative, got {shared_bytes}")
    chain = _Chain(costs, chained, KEEPS[keep])
    fixed = shared_bytes + working_bytes(costs)  # held or alive whatever the plan
    least = chain.least_need() + fixed
    if budget is not None and least > budget:
        raise ValueError(f"the memory budget {fmt_bytes(budget)} is below the least achievable for this model "
                         f"and input: {fmt_bytes(least)} ({least} bytes) of activations")
    plan = _plan_within(chain, (least if budget is None else budget) - fixed)
    plan.budget = budget
    plan.held_bytes += shared_bytes
    plan.shared_bytes = shared_bytes
    return plan


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
