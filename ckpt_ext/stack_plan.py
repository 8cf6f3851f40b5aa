"""enable_checkpointing(budget=...) on one layer stack: measures each layer during a training step, plans
with ckpt_ext.planner, and plans again when a larger input comes (stack.py installs the groups)."""
import contextlib
import logging
import time
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ._layout import BERT, FAMILIES
from .fused import _C, FusedTransformerLayer
from .hf.layers import LORA_PROJECTIONS
from . import keep as _keep
from .keep import LevelProbe, keeps_gemms, probe_time
from .planner import Level, LayerCost, Plan, PreNorm, plan_chain, segment_costs
from .pool import is_pooled

__all__ = ["StackPlanner", "probe_clock"]

logger = logging.getLogger("ckpt_ext")


@contextlib.contextmanager
def probe_clock(clock: Callable[[], float]):
    """For benchmarks: while the block runs, the budget planner's probe reads its seconds from `clock()` instead of
    time.perf_counter -- every time it takes (each layer's forward and backward, each SDPA and GEMM call, BERT's
    pre-norm parts), so a plan made then follows `clock`'s costs. Bytes are measured as always. A plan is made when
    the measuring step ends, so that step must run inside the block; the plan made then is kept as made.
    benchmarks/bench_work.py passes a clock that advances by the work model's predicted GPU seconds of each op it
    counts (a plan at H200 rates on a machine without a GPU). Restored on leaving, also on an error; not set (the
    default), the planner times with time.perf_counter, as it always has. Process-wide: not for concurrent use."""
    if not callable(clock):
        raise TypeError(f"probe_clock needs a callable returning seconds, got {type(clock).__name__}")
    before = _keep._PROBE_CLOCK
    _keep._PROBE_CLOCK = clock
    try:
        yield
    finally:
        _keep._PROBE_CLOCK = before


class StackPlanner:
    """enable_checkpointing(budget=...) on one layer stack. The first training step checkpoints every
    layer and probes each one first (its saved-tensor bytes, input bytes and forward time, measured on
    a throw-away run with the RNG forked, so the step's results are unchanged) and whether it is called
    on the output of the layer before (only such layers are grouped: a model may transform the hidden
    state between its layers); the plan is made as soon as every layer is measured and installed when
    the next step starts."""

    def __init__(self, name: str, layers: List[nn.Module], budget: int, attach: Callable, keep: str = "auto"):
        self.name = name
        self.keep = keep  # "auto" (the planner chooses per segment), "boundaries" or a keep level
        self.attach = attach  # attach(planner, segments): installs (start, end, checkpointed) groups
        self.layers = layers
        self.budget = budget
        self.index = {id(m): i for i, m in enumerate(layers)}
        self.costs: List[Optional[LayerCost]] = [None] * len(layers)
        self.why: List[Optional[str]] = [None] * len(layers)  # why a layer cannot keep its attention (measured)
        self.shared: Dict[int, int] = {}  # while measuring: storages the layers receive besides the hidden state
        # (forward CPU seconds, {level: CPU seconds its replay skips})
        self.cpu_costs: List[Tuple[float, Dict[str, float]]] = [(0.0, {})] * len(layers)
        # fused BERT layers: (CPU seconds the pre-norm boundary's replay skips, CPU seconds recomputing an input)
        self.cpu_pre_norm: List[Tuple[float, float]] = [(0.0, 0.0)] * len(layers)
        self.backward: List[Optional[float]] = [None] * len(layers)  # measuring: each layer's replay + backward
        self.chained: List[bool] = [True] * len(layers)  # layer i is called on layer i-1's output
        self.outputs: List[Optional[weakref.ref]] = [None] * len(layers)  # while measuring: what each passed on
        # per layer measured: what its working set was measured for (the same kind of layer and input: measured once)
        self.work_keys: List[Optional[tuple]] = [None] * len(layers)
        self.plan: Optional[Plan] = None
        self.installed = False
        self.shape = None  # input shape the plan was made for
        self.plans: Dict[Optional[Tuple[int, ...]], Plan] = {}  # plans made so far, by input shape

    def __getstate__(self):
        # Pickled with the model: the plans and the measurements they came from. What holds this process's
        # tensors (the outputs seen while measuring, storages by address) is dropped; a measurement under way is
        # started again at the next training step.
        state = dict(self.__dict__)
        del state["index"]  # ids of this process's layer objects
        state["outputs"] = [None] * len(self.layers)
        state["shared"] = {}
        if self.plan is None:
            state["costs"] = [None] * len(self.layers)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.__dict__.setdefault("work_keys", [None] * len(self.layers))  # (pickled before it existed)
        self.index = {id(m): i for i, m in enumerate(self.layers)}

    def replan(self, budget: int) -> Plan:
        """For benchmarks: a plan for `budget` (bytes) from the costs measured in the measuring step (one measuring
        step, several budgets), installed when the next step starts; the plans made for other input sizes are
        forgotten. Raises ValueError as planning does (a budget below the least achievable), RuntimeError before
        the costs are measured."""
        if self.plan is None:
            raise RuntimeError("the layers are not measured yet: run a training step first")
        plan = plan_chain(self.costs, budget, self.chained, self.keep, sum(self.shared.values()))
        plan.base_time = self.plan.base_time
        self.budget, self.plan, self.plans, self.installed = budget, plan, {self.shape: plan}, False
        return plan

    def begin_step(self, args: Tuple):
        """At the first layer of a training step: keeps the plan when it was made for an input at least as
        large in every dimension (its tensors are no larger, so it still fits the budget); else installs
        such a plan made earlier, or starts measuring again to plan for this input."""
        if self.plan is None:
            return  # measuring (the first step, or a new input size)
        shape = _shape_of(args)
        if self.installed and _covers(self.shape, shape):
            return
        known = next((s for s in reversed(list(self.plans)) if _covers(s, shape)), None)
        if known is not None:
            self.shape, self.plan = known, self.plans[known]
            self.install_plan()
            return
        logger.info("ckpt_ext: %s receives input of shape %s, larger than the %s its plan was made for; "
                    "measuring again to plan for it during this step", self.name or "layers", shape, self.shape)
        self.costs = [None] * len(self.layers)
        self.shared = {}
        self.plan, self.shape, self.installed = None, None, False
        self.install_probe_groups()

    def passed_on(self, layer: nn.Module, hidden, received=None):
        """While measuring: the hidden state `layer` returned (the next layer is chained to it if called on it).
        Its backward is timed too: from its output's gradient to its input's (the layer is checkpointed alone in
        the measuring step, so that is its replay and its backward: what its forward and backward take without
        checkpointing); the sum over the layers is the plan's base_time (explain's step time)."""
        i = self.index[id(layer)]
        self.outputs[i] = weakref.ref(hidden) if isinstance(hidden, torch.Tensor) else None
        if i == 0:
            self.backward = [None] * len(self.layers)
        if not (isinstance(hidden, torch.Tensor) and hidden.requires_grad) or torch.compiler.is_compiling():
            return
        # An input that needs no gradient (the first layer's, under frozen embeddings): the layer's backward
        # ends with the backward pass (what runs after it in the pass is not the stack's, and little).
        to_end = isinstance(received, torch.Tensor) and received.requires_grad
        device, times = hidden.device, self.backward
        start: List[float] = []

        def now():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return probe_time()

        def began(_):
            start.append(now())
            if not to_end:
                torch.autograd.Variable._execution_engine.queue_callback(lambda: ended(None))

        def ended(_):
            if start and times[i] is None:
                times[i] = now() - start[0]
                if all(t is not None for t in times) and self.plan is not None:
                    self.plan.base_time = sum(times)

        hidden.register_hook(began)
        if to_end:
            received.register_hook(ended)

    def install_probe_groups(self):
        """Every layer checkpointed alone (and probed), until a plan is made."""
        self.attach(self, [(i, i + 1, True) for i in range(len(self.layers))])

    def install_plan(self):
        self.attach(self, self.plan.segments)
        self.installed = True

    def probe(self, layer: nn.Module, args: Tuple, kwargs: Dict):
        i = self.index[id(layer)]
        if self.costs[i] is not None:
            return
        hidden = args[0] if args and isinstance(args[0], torch.Tensor) else None
        before = self.outputs[i - 1]() if i > 0 and self.outputs[i - 1] is not None else None
        self.chained[i] = i == 0 or (hidden is not None and hidden is before)
        device = hidden.device if hidden is not None else torch.device("cpu")
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
        fused = isinstance(layer, FusedTransformerLayer)
        attention = self.keep != "boundaries"
        # the GEMMs are timed and their outputs measured where a level keeping them can be chosen (plain layers)
        gemms = self.keep == "auto" or keeps_gemms(self.keep) is not None
        # The tensors the layer receives besides its hidden state (a mask, rotary tables): held once while any
        # layer holds them, whatever the plan (a checkpointed segment keeps them as inputs, a kept layer saves
        # them), so counted once for the stack and in no layer's bytes.
        shared = {st.data_ptr(): st.nbytes() for st in _storages((args[1:], kwargs))
                  if hidden is None or st.data_ptr() != hidden.untyped_storage().data_ptr()}
        # Two runs, the faster one's times kept: the first forward of a layer pays one-time costs (the
        # allocator's first blocks, kernels' set-up) that training steps do not. A plain layer's runs also
        # time its SDPA calls and measure what keep="attention" would keep; a fused layer's attention is
        # C++, so its Hugging Face layer runs the same attention through SDPA for that.
        # The levels' kept bytes are matched against the saved storages of the same run (the probe holds what it
        # saw until then); each level's skipped time is the fastest run's.
        saved, elapsed, probe, cpu, levels = None, None, None, 0.0, {}
        tail = (0.0, 0.0)  # (seconds, CPU seconds) of a fused layer's last linear (LayerCost.tail_compute)
        tail_replay = 0  # the bytes of its input (LayerCost.tail_replay_bytes)
        for _ in range(_PROBE_RUNS):
            spy = LevelProbe(sync, gemms=gemms) if attention and not fused else None
            storages, seconds, cpu_seconds = _measure(layer, args, kwargs, device, sync, spy)
            if elapsed is None or seconds < elapsed:
                elapsed, probe, cpu = seconds, spy, cpu_seconds
                if spy is not None:
                    levels = spy.levels({p: n for p, n in storages.items() if p not in shared})
            if saved is None:
                saved = sum(n for ptr, n in storages.items() if ptr not in shared)
            if spy is not None and spy is not probe:
                spy.clear()  # (the storages it holds)
        self.shared.update(shared)
        attn_bytes, attn_seconds = None, 0.0
        if attention:
            if fused:
                # the attention's time from the Hugging Face layer's run (the fused layer's is a C++ call no function
                # mode sees); the levels' GEMM bytes and times from runs of the fused layer itself (_fused_levels)
                for _ in range(_PROBE_RUNS):
                    spy = LevelProbe(sync, gemms=False)
                    _measure(layer, args, kwargs, device, sync, spy, hf=True)
                    if probe is None or _probe_seconds(spy) < _probe_seconds(probe):
                        if probe is not None:
                            probe.clear()
                        probe = spy
                    else:
                        spy.clear()
                levels = _fused_levels(layer, args, kwargs, device, sync, probe, shared) if gemms else {}
                tail = levels.pop(_TAIL, (0.0, 0.0))
                tail_replay = levels.pop(_TAIL_BYTES, 0)
            # a fused segment keeps them in pool slots (whole multiples of the pool's alignment)
            attn_bytes, attn_seconds, self.why[i] = probe.result(_POOL_ALIGNMENT if fused else 1)
        if fused and not (attention and gemms):  # (else _fused_levels measured it)
            tail_replay = _tail_input(layer, args, kwargs, device, sync, shared)
        boundary = hidden.untyped_storage().nbytes() if hidden is not None else 0
        if hidden is not None and is_pooled(hidden):  # the output of a fused segment before: a pool slot
            boundary = -(-boundary // _POOL_ALIGNMENT) * _POOL_ALIGNMENT
        extra = tuple(Level(name, v[0], v[1], v[2], v[4], v[5] if len(v) > 5 else 0) for name, v in levels.items()
                      if name != "attention")
        # (the levels keeping GEMM outputs run without BERT's pre-norm boundary: planner.BOUNDARY_HOWS)
        pre_norm, self.cpu_pre_norm[i] = _pre_norm(layer, args, kwargs, hidden, device, sync) \
            if fused and self.keep in ("auto", "boundaries", "attention") else (None, (0.0, 0.0))
        # the working set, measured once per kind of layer and input (identical layers have the same)
        key = (type(layer).__name__, tuple((tuple(q.shape), q.dtype, q.requires_grad) for q in layer.parameters()),
               None if hidden is None else (tuple(hidden.shape), hidden.dtype, hidden.requires_grad), saved)
        work = next((c.work_bytes for c, k in zip(self.costs, self.work_keys) if c is not None and k == key), None)
        if work is None:
            work = _working_set(layer, args, kwargs, hidden, device, saved, max(0, saved - tail_replay))
        self.work_keys[i] = key
        self.costs[i] = LayerCost(saved, boundary, elapsed, attn_bytes, attn_seconds if attn_bytes is not None else 0.0,
                                  extra, pre_norm, tail[0], work, tail_replay)
        # the same runs' process CPU time (the benchmarks compare it on a shared machine)
        skipped = {name: v[3] for name, v in levels.items()}
        skipped["attention"] = probe.cpu_seconds if attn_bytes is not None else 0.0
        skipped[_TAIL] = tail[1]
        self.cpu_costs[i] = (cpu, skipped)
        if probe is not None:
            probe.clear()
        if i == 0:
            self.shape = _shape_of(args)
        if all(c is not None for c in self.costs):
            self.outputs = [None] * len(self.layers)
            try:
                self.plan = plan_chain(self.costs, self.budget, self.chained, self.keep, sum(self.shared.values()))
                self.plans[self.shape] = self.plan
                while len(self.plans) > _MAX_PLANS:
                    del self.plans[next(iter(self.plans))]
            except ValueError:
                # No plan fits the budget (the error states the minimum). Forget the measurements, so the
                # next step measures again -- and raises again, unless its inputs are smaller.
                self.costs = [None] * len(self.layers)
                self.shared = {}
                self.shape = None
                raise


def recompute_cpu_seconds(planner: "StackPlanner", plan: Plan) -> float:
    """The recompute of `plan` in process CPU seconds, from the planner's measurements (the benchmarks)."""
    total = 0.0
    per = segment_costs(plan.costs, plan.segments, plan.boundaries, plan.chained)
    for (s, e, how), (_, _, _, keeps, takes) in zip(plan.segments, per):
        if how:
            for k in range(s, e):
                forward, skipped = planner.cpu_costs[k]
                # as LayerCost.level: a level the layer lacks falls back to "attention" or to the boundary only
                fallback = "attention" if how in ("attention_inputs", "gemms_attention") else None
                total += forward - (skipped.get(how, skipped.get(fallback, 0.0)) if how is not True else 0.0)
            # the last layer's last linear, which the replay does not run (LayerCost.tail_time)
            last = plan.costs[e - 1]
            if last.tail_compute and last.tail_time(how):
                total -= planner.cpu_costs[e - 1][1].get(_TAIL, 0.0)
            # BERT's pre-norm boundary (planner.segment_costs)
            total += (planner.cpu_pre_norm[s - 1][1] if takes else 0.0) - \
                (planner.cpu_pre_norm[e - 1][0] if keeps else 0.0)
    return total


def _probe_seconds(probe: LevelProbe) -> float:
    return sum(c[2] for c in probe.calls)


_TAIL = "tail"  # in _fused_levels' answer: (seconds, CPU seconds) of the layer's last linear (LayerCost.tail_compute)
_TAIL_BYTES = "tail_bytes"  # ... and the bytes of its input a segment's replay does not rebuild (tail_replay_bytes)

# The GEMMs of one fused layer call that the recompute levels keep (layers::KeptGemms sites), per family: their
# number, and whether the last is the layer's last linear (its output is not kept in a segment's last layer).
# Llama and its relatives: (5, True); Gemma 2 and 3 have five GEMM sites but no last linear (their MLP output is
# normalised before the residual sum: the replay never stops before it).
_FUSED_SITES = {"bert": (4, False), "gpt2": (4, True), "gemma3": (5, False), "gemma2": (5, False)}


class _FusedGemms(TorchDispatchMode):
    """One run of a fused layer: the 2-D mm/addmm calls below its linears (the GEMM sites of the recompute levels, in
    call order), each call's output storage (address, bytes; held until the run's saved tensors are matched against
    them), its seconds and its process CPU seconds (the kernel alone: the time is taken around the call)."""

    _OPS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    # The activation computing the last linear's input, which a segment's replay of its last layer skips too (its
    # backward writes that input; _C.tail_activation_in_backward, issue 33): timed into `act`.
    _ACT = ("swiglu", "geglu", "bias_gelu")

    def __init__(self, sync):
        super().__init__()
        self.sync = sync or (lambda: None)
        self.calls: List[Tuple[torch.UntypedStorage, float, float]] = []
        self.numels: List[int] = []  # per call, its output's elements
        self.inputs: List[Tuple[int, int]] = []  # per call, its input operand's storage (address, bytes)
        self.act = (0.0, 0.0)  # (seconds, CPU seconds) of the last activation op of the run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "ckpt_ext" and func._overloadpacket.__name__ in self._ACT:
            self.sync()
            start, cpu = probe_time(), time.process_time()
            out = func(*args, **(kwargs or {}))
            self.sync()
            self.act = (probe_time() - start, time.process_time() - cpu)
            return out
        if func not in self._OPS:
            return func(*args, **(kwargs or {}))
        self.sync()
        start, cpu = probe_time(), time.process_time()
        out = func(*args, **(kwargs or {}))
        self.sync()
        self.calls.append((out.untyped_storage(), probe_time() - start, time.process_time() - cpu))
        self.numels.append(out.numel())
        x = (args[0] if func is self._OPS[0] else args[1]).untyped_storage()
        self.inputs.append((x.data_ptr(), x.nbytes()))
        return out


def _pre_norm(layer: FusedTransformerLayer, args: Tuple, kwargs: Dict, hidden: Optional[torch.Tensor],
              device: torch.device, sync) -> Tuple[Optional[PreNorm], Tuple[float, float]]:
    """A fused BERT/RoBERTa layer's pre-norm boundary (planner.PreNorm; csrc/layers/bert.cpp) and its CPU seconds
    (skipped, recomputing an input): the bytes of the second norm's input (the layer's output's shape and dtype) and
    row statistics (2 float32 a row; float64 in float64); the seconds of the output linear's GEMM (the layer's last
    GEMM giving an output of the hidden state's size, caught by a dispatch mode as _fused_levels does) and of the norm,
    timed as one add_layer_norm on the hidden state with the layer's second norm's weights -- what recomputing the
    next segment's input runs, and taken for the forward's bias_dropout_add_layer_norm the replay skips (the same
    pass over a row). The faster of two runs each. (None, zeros) for other families, with
    _C.pre_norm_boundaries() off or without a hidden state."""
    if layer.family != BERT or hidden is None or not _C.pre_norm_boundaries():
        return None, (0.0, 0.0)
    from . import ops
    key, extra = layer._adapter_terms()
    out = LORA_PROJECTIONS[BERT].index("output.dense")
    keeps = key is None or extra[2 * out] is None
    rows = hidden.numel() // max(1, hidden.shape[-1])
    kept = hidden.numel() * hidden.element_size() + 2 * rows * (8 if hidden.dtype == torch.float64 else 4)
    gemm = None
    for _ in range(_PROBE_RUNS):
        spy = _FusedGemms(sync)
        saved, _, _ = _measure(layer, args, kwargs, device, sync, spy)
        found = [(sec, cpu) for (_, sec, cpu), n in zip(spy.calls, spy.numels) if n == hidden.numel()]
        # the output GEMM's input (the activation's output): not rebuilt by a replay ending with the boundary where
        # the activation's backward writes it (saved by the layer: else its bytes are in no replay)
        inp = [x for x, n in zip(spy.inputs, spy.numels) if n == hidden.numel()]
        replay = inp[-1][1] if inp and inp[-1][0] in saved and _C.tail_activation_in_backward() else 0
        spy.calls.clear()
        if found and _C.tail_activation_in_backward():  # the replay skips the activation before that GEMM too
            found[-1] = (found[-1][0] + spy.act[0], found[-1][1] + spy.act[1])
        if found and (gemm is None or found[-1][0] < gemm[0]):
            gemm = found[-1]
    gemm = gemm or (0.0, 0.0)
    slots = FAMILIES["bert"][1]
    weights = layer.fused_weights()
    w, b = weights[slots.index("ln2_weight")], weights[slots.index("ln2_bias")]
    norm = None
    with torch.no_grad():
        x = hidden.detach()
        for _ in range(_PROBE_RUNS + 1):  # (the first pays one-time costs)
            if sync is not None:
                sync()
            start, cpu = probe_time(), time.process_time()
            r = ops.add_layer_norm(x, None, w, b, 1e-12)
            if sync is not None:
                sync()
            seconds = (probe_time() - start, time.process_time() - cpu)
            del r
            if norm is None or seconds[0] < norm[0]:
                norm = seconds
    pre_norm = PreNorm(kept if keeps else 0, gemm[0] + norm[0] if keeps else 0.0, norm[0], keeps,
                       replay if keeps else 0)
    return pre_norm, ((gemm[1] + norm[1]) if keeps else 0.0, norm[1])


def _tail_input(layer: nn.Module, args: Tuple, kwargs: Dict, device: torch.device, sync, shared: Dict[int, int]) -> int:
    """LayerCost.tail_replay_bytes of fused layer `layer` where _fused_levels does not run (keep="boundaries" or
    "attention"): the bytes of its last linear's input, which a segment's replay of it as its last layer does not
    rebuild (the activation's backward writes it: _C.tail_activation_in_backward), as _fused_levels finds them; 0
    for a family without a last linear, a call with LoRA adapters (it runs as before) or the switch off."""
    from ._layout import FAMILY_NAMES
    count, last_linear = _FUSED_SITES.get(FAMILY_NAMES[layer.family], (5, True))
    if not last_linear or layer._adapter_terms()[0] is not None or not _C.tail_activation_in_backward():
        return 0
    gemms = _FusedGemms(sync)
    saved, _, _ = _measure(layer, args, kwargs, device, sync, gemms)
    gemms.calls.clear()
    if len(gemms.inputs) != count:
        return 0
    ptr = gemms.inputs[-1][0]
    return saved.get(ptr, 0) if ptr not in shared else 0


def _fused_levels(layer: nn.Module, args: Tuple, kwargs: Dict, device: torch.device, sync, probe: LevelProbe,
                  shared: Dict[int, int]) -> Dict[str, tuple]:
    """The recompute levels of fused layer `layer` as StackPlanner.probe records them: {level: (kept bytes, bytes of
    the layer's saved tensors among them, seconds and CPU seconds its replay skips, whole, bytes not kept as the
    last layer of a segment)}, and under _TAIL the (seconds, CPU seconds) of the layer's last linear (GPT-2, Llama).
    The GEMMs' bytes and times from runs of the fused layer itself (its GEMMs' outputs
    caught by a dispatch mode, in call order: the q/k/v projection first; the faster run's times), the attention's
    from `probe` (the Hugging Face layer's SDPA, the kernel the fused layer calls). {} for a call with LoRA adapters
    (its layers keep no GEMM output) or one whose GEMMs are not the family's sites."""
    from .keep import LEVELS
    from ._layout import FAMILY_NAMES
    if layer._adapter_terms()[0] is not None:
        return {}
    count, last_linear = _FUSED_SITES.get(FAMILY_NAMES[layer.family], (5, True))
    best = None
    for _ in range(_PROBE_RUNS):
        gemms = _FusedGemms(sync)
        saved, _, _ = _measure(layer, args, kwargs, device, sync, gemms)
        if len(gemms.calls) != count:
            return {}
        sites = [(st.data_ptr(), st.nbytes(), sec, cpu) for st, sec, cpu in gemms.calls]
        saved = {p: n for p, n in saved.items() if p not in shared}
        overlaps = [saved.get(ptr, 0) for ptr, *_ in sites]
        # the last linear's input, where the layer saves it (LayerCost.tail_replay_bytes)
        tail_input = saved.get(gemms.inputs[-1][0], 0)
        gemms.calls.clear()
        if best is None or sum(x[2] for x in sites) < sum(x[2] for x in best[0]):
            best = (sites, overlaps, gemms.act, tail_input)
    sites, overlaps, act, tail_input = best
    attn_kept, attn_seconds, _ = probe.result(_POOL_ALIGNMENT)
    attn_cpu = probe.cpu_seconds if attn_kept is not None else 0.0
    out = {}
    for level, (attention, gemms) in LEVELS.items():
        if gemms is None:
            continue
        n = 1 if gemms == "before" else len(sites)
        kept = sum(x[1] for x in sites[:n])
        overlap = sum(overlaps[:n])
        seconds = sum(x[2] for x in sites[:n])
        cpu = sum(x[3] for x in sites[:n])
        whole = not attention or attn_kept is not None
        if attention and attn_kept is not None:
            kept += attn_kept
            overlap += attn_kept  # (the fused layer saves its attention's output and LSE, as LayerCost.level counts)
            seconds += attn_seconds
            cpu += attn_cpu
        tail = sites[-1][1] if gemms == "all" and last_linear else 0
        out[level] = (kept, overlap, seconds, cpu, whole, tail)
    if last_linear:  # the segment's replay stops before its last layer's last linear (LayerCost.tail_compute), and
        # before the activation computing its input where _C.tail_activation_in_backward is on (issue 33)
        on = _C.tail_activation_in_backward()
        act = act if on else (0.0, 0.0)
        out[_TAIL] = (sites[-1][2] + act[0], sites[-1][3] + act[1])
        # nor does it rebuild that linear's input, which the activation's backward writes in place (switch on)
        out[_TAIL_BYTES] = tail_input if on else 0
    return out


_MARKS = (1000003, 1000033, 1000037)  # byte sizes of _working_set's markers (primes: no tensor of its run has them)


def _working_set(layer: nn.Module, args: Tuple, kwargs: Dict, hidden: torch.Tensor, device: torch.device,
                 saved: int, replay: int) -> int:
    """LayerCost.work_bytes of `layer`: throw-away forwards and backwards (RNG forked; the parameters' gradients
    returned, not accumulated), their allocations read from the allocator's events (torch.profiler,
    profile_memory=True: exact, C++ temporaries included). The largest of: the forward's peak of live bytes above
    what was live before it (its saved tensors, temporaries, output) less `saved` (its act_bytes, counted by the
    plan); its backward's peak above what was live before it (its saved tensors freed on the way count negative)
    plus its output's gradient, the parameters' gradients not counted (a plan's budget is of activations); and, for
    a fused layer, the same for its backward as a checkpointed one-layer segment (a C++ replay, then the replayed
    graph's backward: other kernels, other temporaries) less `replay` (its replay bytes there, counted by the plan).
    0 where it cannot be measured: no floating-point hidden state, an output that needs no gradient, a profiler
    already running (profilers do not nest), under torch.compile."""
    if hidden is None or not hidden.is_floating_point() or torch.autograd._profiler_enabled() or \
            torch.compiler.is_compiling():
        return 0
    x = hidden.detach().requires_grad_(hidden.requires_grad)
    forward, backward = _alloc_peaks(layer, lambda: type(layer).forward(layer, x, *args[1:], **kwargs), x, device)
    work = max(forward - saved, backward, 0)
    if isinstance(layer, FusedTransformerLayer):
        from .fused import run_segment

        def segment():
            out = run_segment([layer], (x,) + tuple(args[1:]), kwargs, pre_norm_boundary=False)
            return None if out is NotImplemented else out
        _, backward = _alloc_peaks(layer, segment, x, device)
        work = max(work, backward - replay)
    return work


def _alloc_peaks(layer: nn.Module, forward: Callable, x: torch.Tensor, device: torch.device) -> Tuple[int, int]:
    """(peak of live bytes during forward() above those live before it; peak during the backward of its first output
    from a gradient of ones above those live before it, plus that gradient's bytes, the parameters' gradients not
    counted), from the allocator's events; (0, 0) where forward() returns None."""
    from torch.profiler import ProfilerActivity, profile
    from torch._C._profiler import _EventType
    params = [q for q in layer.parameters() if q.requires_grad]
    leaves = [t for t in [x] + params if t.requires_grad]
    grads: List[int] = []
    found = [0]  # its output gradient's bytes

    def run():
        torch.empty(_MARKS[0], dtype=torch.uint8)
        out = forward()
        first = next((t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)), None)
        torch.empty(_MARKS[1], dtype=torch.uint8)
        if first is None or not first.requires_grad or not leaves:
            return
        g = torch.ones_like(first)
        found[0] = g.untyped_storage().nbytes()
        torch.empty(_MARKS[2], dtype=torch.uint8)
        got = torch.autograd.grad(first, leaves, g, allow_unused=True)
        grads.extend(t.untyped_storage().data_ptr() for t in got[1 if x.requires_grad else 0:] if t is not None)
        torch.empty(_MARKS[0], dtype=torch.uint8)

    # CPU activity only: the allocators (CPU and CUDA's caching allocator) report their events to the profiler
    # whatever activities it traces, and tracing CUDA kernels would initialise CUPTI in the user's first step
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
            profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == device.type:
            events.append((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size))
    events.sort(key=lambda ev: ev[0])
    last = {ptr: k for k, (_, ptr, size) in enumerate(events) if size > 0}
    skip = {last[p] for p in grads if p in last}  # the allocations that end as a parameter's gradient
    counted, live, phase, peaks = 0, {}, None, {1: 0, 3: 0}
    for k, (_, ptr, size) in enumerate(events):
        if abs(size) in _MARKS:
            if size < 0:  # a marker is freed at once: its free marks the moment
                phase = {0: 1 if phase is None else None, 1: 2, 2: 3}[_MARKS.index(-size)]
                if phase in peaks:
                    counted = 0  # bytes above those live when the forward / the backward starts
            continue
        if size > 0:
            if k not in skip:
                live[ptr] = size
                counted += size
        elif ptr in live:
            counted -= live.pop(ptr)
        elif phase == 3:  # freed in the backward, allocated before the run (none) or uncounted: a release
            counted += size
        if phase in peaks:
            peaks[phase] = max(peaks[phase], counted)
    return peaks[1], (peaks[3] + found[0] if found[0] else 0)


def _measure(layer: nn.Module, args: Tuple, kwargs: Dict, device: torch.device, sync, spy, hf: bool = False):
    """One throw-away forward of `layer` (its Hugging Face layer's with `hf`) with the RNG forked: ({address: bytes}
    of the storages it saves for backward, parameters excluded; seconds; process CPU seconds), under `spy` when
    given."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    storages: Dict[int, torch.UntypedStorage] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            # The storage is held until the probe ends: freed, its address could be handed to a later
            # saved tensor, which would then count as the same one (the allocator decides, so the
            # measured bytes -- and the least achievable budget -- varied from run to run).
            storages[st.data_ptr()] = st
        # The graph keeps nothing: it is measured, never differentiated (and a pack hook returning a
        # saved output would tie it to its own grad_fn in a cycle that outlives the probe).
        return None

    if sync is not None:
        sync()
    start, cpu = probe_time(), time.process_time()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
            torch.autograd.graph.saved_tensors_hooks(pack, _never_unpacked), \
            (spy if spy is not None else contextlib.nullcontext()):
        out = layer._hf_forward(args, kwargs) if hf else type(layer).forward(layer, *args, **kwargs)
    if sync is not None:
        sync()
    elapsed, cpu = probe_time() - start, time.process_time() - cpu
    del out
    saved = {ptr: st.nbytes() for ptr, st in storages.items()}
    storages.clear()
    return saved, elapsed, cpu


def _storages(tree) -> List[torch.UntypedStorage]:
    out = []
    for leaf in torch.utils._pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            out.append(leaf.untyped_storage())
    return out


_POOL_ALIGNMENT = 256  # BoundaryPool slots are whole multiples of it (csrc/pool/boundary_pool.h kAlignment)
_PROBE_RUNS = 2  # forwards per layer when measuring (the faster one counts)
_MAX_PLANS = 8  # plans kept per stack (inputs whose size varies from step to step re-plan once per size)


def _shape_of(args: Tuple) -> Optional[Tuple[int, ...]]:
    return tuple(args[0].shape) if args and isinstance(args[0], torch.Tensor) else None


def _covers(planned: Optional[Tuple[int, ...]], shape: Optional[Tuple[int, ...]]) -> bool:
    """Whether a plan made for input `planned` serves input `shape`: no dimension is larger."""
    if planned is None or shape is None or len(planned) != len(shape):
        return planned == shape
    return all(p >= s for p, s in zip(planned, shape))


def _never_unpacked(_):
    raise RuntimeError("ckpt_ext: the planner's probe graph cannot be differentiated")
