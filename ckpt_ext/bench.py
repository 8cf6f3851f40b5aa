"""Benchmark suite: checkpointing variants on Hugging Face models, side by side.

    python -m ckpt_ext.bench                                  # bert-large on the best device present
    python -m ckpt_ext.bench --model llama --batch max        # largest batch per variant
    python -m ckpt_ext.bench --device cpu --model bert-base   # CPU: shrunk model (4 layers, seq 128, batch 2)

Models are built from transformers configs with random weights (nothing is downloaded): the base models
BertModel / GPT2Model / LlamaModel; loss = mean of the squared last hidden state. Variants:

  none                    no checkpointing
  hf-torch-nonreentrant   Hugging Face's own checkpointing (torch.utils.checkpoint, use_reentrant=False)
  hf-torch-reentrant      the same with use_reentrant=True
  torch-selective         Hugging Face's checkpointing with context_fn=create_selective_checkpoint_contexts
                          saving the matmul outputs (mm, addmm, bmm, baddbmm)
  ckpt_ext                ckpt_ext.enable_checkpointing(model)
  ckpt_ext-fused          ckpt_ext.fuse(model), then enable_checkpointing (where ckpt_ext has fuse)
  ckpt_ext-budget         enable_checkpointing(model, budget=...): half the activation bytes of `none` at
                          that batch, or --budget
  compile-budget          torch.compile of the model without checkpointing, with
                          torch._functorch.config.activation_memory_budget = 0.5

Every variant runs in one process, in interleaved rounds (each round runs every variant once, so a
change in machine load hits all of them alike), after untimed warm-up steps (the first of which checks
that the variant runs: compiles, fits in memory). Step time: median with 20th/80th percentiles (CUDA
events on a GPU). Memory: the activation bytes held from forward to backward, counted alike on every
device (unique storages saved for backward, parameters excluded, plus what a variant keeps outside
autograd and ckpt_ext's pool slots); on CUDA also the peak allocated and reserved of a step.

Output: a markdown table on stdout, and benchmarks/results/<device>/<model>.{md,json,png} (or --out):
the JSON holds the environment (device, versions, commit, load average), the configuration and one row
per (variant, batch); the PNG plots memory against step time; with --batch max a second PNG
(<model>-max-batch.png) shows the largest batch per variant.

The measurement helpers at the top (Timer, interleaved, held_bytes, env_info, ...) are shared with
benchmarks/bench_checkpoint.py.
"""
import argparse
import copy
import datetime
import functools
import gc
import inspect
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, Dict, Iterable, List, Optional

import torch
from torch import nn

import ckpt_ext

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


# ==================================================================================================
# Measurement helpers (shared with benchmarks/bench_checkpoint.py)
# ==================================================================================================
class Timer:
    """Wall time of one call: CUDA events on a GPU, perf_counter elsewhere."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def __call__(self, fn):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def quantiles(xs):
    xs = sorted(xs)
    q = lambda f: xs[min(len(xs) - 1, int(round(f * (len(xs) - 1))))]  # noqa: E731
    return {"median": statistics.median(xs), "p20": q(0.2), "p80": q(0.8)}


def is_oom(exc: BaseException) -> bool:
    """True for an out-of-memory error: torch.OutOfMemoryError, or a RuntimeError saying so (older
    torch, custom kernels, the CPU allocator)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    msg = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in msg or "can't allocate memory" in msg)


def free_memory(device) -> None:
    """Returns what a failed or finished step left behind: Python cycles, ckpt_ext's empty pool chunks
    and, on CUDA, the caching allocator's unused blocks."""
    device = torch.device(device)
    gc.collect()
    ckpt_ext.empty_pool(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def interleaved(steps: Dict[str, Callable[[], None]], device, rounds: int, warmup: int,
                setup: Optional[Callable[[str], None]] = None,
                on_error: Optional[Callable[[str, BaseException], None]] = None,
                progress: Optional[Callable[[], None]] = None):
    """Times the steps (name -> function) in interleaved rounds: each round runs every step once.
    `warmup` untimed rounds come first. setup(name), if given, runs untimed before each step;
    progress(), if given, after each step. A step that raises is re-raised, or, when on_error is
    given, reported to on_error(name, exc) and left out of the remaining rounds (the memory it held is
    freed). Returns name -> quantiles of the timed runs, for the steps that never failed."""
    timer = Timer(device)
    times: Dict[str, List[float]] = {k: [] for k in steps}
    failed = set()
    for r in range(warmup + rounds):
        for k, fn in steps.items():
            if k in failed:
                continue
            if setup:
                setup(k)
            elapsed = None
            try:
                elapsed = timer(fn)
            except Exception as e:
                if on_error is None:
                    raise
                on_error(k, e)
                failed.add(k)
            if elapsed is None:  # outside the except clause: the exception and its frames are gone
                free_memory(device)
            elif r >= warmup:
                times[k].append(elapsed)
            if progress:
                progress()
    return {k: quantiles(v) for k, v in times.items() if k not in failed and v}


def held_bytes(step_forward: Callable[[], torch.Tensor], params: Iterable[torch.Tensor], device,
               extra_saved: Optional[Callable[[], Iterable[torch.Tensor]]] = None):
    """Bytes that live from forward to backward, counted alike on every device: the unique storages
    saved for backward (saved-tensor hooks; parameters and pooled tensors excluded), tensors a variant
    keeps outside autograd (``extra_saved()`` after the forward, e.g. a selective-checkpointing cache)
    and ckpt_ext's pool slots taken during the forward. Runs step_forward() (returns the loss) and the
    backward. Keys: held_bytes = saved_bytes + pool_bytes; on CUDA also peak_allocated (above what was
    allocated before the step), peak_reserved, base_allocated, base_reserved, allocated_after_forward
    (above the base)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    storages: Dict[int, int] = {}

    def count(t):
        s = t.untyped_storage()
        if s.data_ptr() not in param_ptrs and not ckpt_ext.is_pooled(t):
            storages[s.data_ptr()] = s.nbytes()

    def pack(t):
        count(t)
        return t

    if cuda:
        # Pool chunks left from earlier steps would sit in the base and hide the pool's growth.
        free_memory(device)
        base_allocated = torch.cuda.memory_allocated(device)
        base_reserved = torch.cuda.memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
    pool_before = ckpt_ext.pool_stats(device)["in_use_bytes"]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step_forward()
    for t in (extra_saved() if extra_saved else ()):
        count(t)
    pool = ckpt_ext.pool_stats(device)["in_use_bytes"] - pool_before
    if cuda:
        torch.cuda.synchronize(device)
        after_forward = torch.cuda.memory_allocated(device) - base_allocated
    loss.backward()
    saved = sum(storages.values())
    out = {"held_bytes": saved + pool, "saved_bytes": saved, "pool_bytes": pool}
    if cuda:
        torch.cuda.synchronize(device)
        out.update(peak_allocated=torch.cuda.max_memory_allocated(device) - base_allocated,
                   peak_reserved=torch.cuda.max_memory_reserved(device), base_allocated=base_allocated,
                   base_reserved=base_reserved, allocated_after_forward=after_forward)
    return out


def find_max_batch(step: Callable[[int], None], cap: int, free: Callable[[], None] = gc.collect) -> int:
    """Largest batch in [1, cap] for which step(batch) does not run out of memory: doubling from 1,
    then bisection between the last batch that fitted and the first that did not. step raises an
    out-of-memory error (see is_oom) when a batch does not fit; any other exception propagates.
    free() runs after each try that ran out of memory (a try that fitted leaves nothing behind but
    cached blocks, which the next try reuses). Returns 0 when batch 1 does not fit."""
    if cap < 1:
        raise ValueError(f"cap must be at least 1, got {cap}")

    def fits(batch):
        ok = True
        try:
            step(batch)
        except Exception as e:
            if not is_oom(e):
                raise
            ok = False
        if not ok:
            free()  # outside the except clause, so the tensors the failed step's frames held can go
        return ok

    fitted, failed = 0, None
    batch = 1
    while failed is None:
        if fits(batch):
            fitted = batch
            if batch == cap:
                return cap
            batch = min(2 * batch, cap)
        else:
            failed = batch
    while failed - fitted > 1:
        mid = (fitted + failed) // 2
        if fits(mid):
            fitted = mid
        else:
            failed = mid
    return fitted


def hf_checkpointing_enable(model: nn.Module, **checkpoint_kwargs) -> None:
    """Hugging Face's own checkpointing: torch.utils.checkpoint with these keyword arguments, under
    the transformers 5.x name or the older one."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)


def hf_checkpointing_disable(model: nn.Module) -> None:
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    # Enabling registers a hook that makes the embeddings' output require grad, one more per call.
    if getattr(model, "_require_grads_hooks", None) and hasattr(model, "disable_input_require_grads"):
        model.disable_input_require_grads()


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=PACKAGE_DIR,
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def env_info(device) -> dict:
    """Where and with what a result was measured."""
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    return {"device": str(device), "device_name": name, "torch": torch.__version__, "cuda": torch.version.cuda,
            "ckpt_ext": ckpt_ext.__version__, "git_commit": _git_commit(), "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def device_dir_name(info: dict) -> str:
    """`cpu`, or `cuda-<device name with underscores>`: the results folder of a device."""
    if not info["device"].startswith("cuda"):
        return "cpu"
    return "cuda-" + re.sub(r"[^A-Za-z0-9.-]+", "_", info["device_name"]).strip("_")


def mib(b):
    return f"{b / 2**20:.2f}"


def ms(s):
    return f"{s['median'] * 1e3:.2f} ({s['p20'] * 1e3:.2f}-{s['p80'] * 1e3:.2f})"


# ==================================================================================================
# Models
# ==================================================================================================
@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # bert | gpt2 | llama
    layers: int
    hidden: int
    heads: int
    seq: int
    intermediate: int
    vocab: int
    kv_heads: Optional[int] = None

    def describe(self) -> str:
        kv = f" ({self.kv_heads} KV heads)" if self.kv_heads else ""
        return (f"{self.family} {self.layers} layers, hidden {self.hidden}, {self.heads} heads{kv}, "
                f"intermediate {self.intermediate}, vocab {self.vocab}, seq {self.seq}")


MODELS = {
    "bert-large": ModelSpec("bert-large", "bert", 24, 1024, 16, 512, 4096, 30522),
    "bert-base": ModelSpec("bert-base", "bert", 12, 768, 12, 512, 3072, 30522),
    "gpt2-medium": ModelSpec("gpt2-medium", "gpt2", 24, 1024, 16, 1024, 4096, 50257),
    # Llama-3.2-1B's layer geometry (grouped-query attention) with a Llama-2-sized vocabulary.
    "llama": ModelSpec("llama", "llama", 16, 2048, 32, 2048, 8192, 32000, kv_heads=8),
}
CUSTOM_DEFAULTS = {"layers": 4, "hidden": 256, "heads": 4, "seq": 128}
CPU_SMALL = {"layers": 4, "seq": 128, "batch": "2"}  # the CPU scaling (off with --full)


def build_model(spec: ModelSpec) -> nn.Module:
    """The Hugging Face base model of the spec, random weights (seeded), in training mode, on CPU."""
    torch.manual_seed(0)
    if spec.family == "bert":
        from transformers import BertConfig, BertModel
        cfg = BertConfig(hidden_size=spec.hidden, num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                         intermediate_size=spec.intermediate, vocab_size=spec.vocab,
                         max_position_embeddings=max(512, spec.seq))
        model = BertModel(cfg, add_pooling_layer=False)
    elif spec.family == "gpt2":
        from transformers import GPT2Config, GPT2Model
        cfg = GPT2Config(n_embd=spec.hidden, n_layer=spec.layers, n_head=spec.heads, n_inner=spec.intermediate,
                         vocab_size=spec.vocab, n_positions=max(1024, spec.seq))
        model = GPT2Model(cfg)
    elif spec.family == "llama":
        from transformers import LlamaConfig, LlamaModel
        cfg = LlamaConfig(hidden_size=spec.hidden, num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                          num_key_value_heads=spec.kv_heads or spec.heads, intermediate_size=spec.intermediate,
                          vocab_size=spec.vocab, max_position_embeddings=max(2048, spec.seq))
        model = LlamaModel(cfg)
    else:
        raise ValueError(f"unknown model family {spec.family!r}")
    return model.train()


# ==================================================================================================
# Variants
# ==================================================================================================
VARIANTS = ("none", "hf-torch-nonreentrant", "hf-torch-reentrant", "torch-selective", "ckpt_ext",
            "ckpt_ext-fused", "ckpt_ext-budget", "compile-budget")
# Variants with their own copy of the model: their state cannot be switched off and on between steps
# (a fused model, a budget plan measured on the first step, a compiled graph).
OWN_MODEL = ("ckpt_ext-fused", "ckpt_ext-budget", "compile-budget")
SELECTIVE_SAVE = ("mm", "addmm", "bmm", "baddbmm")
COMPILE_MEMORY_BUDGET = 0.5


class SelectiveContexts:
    """context_fn for torch.utils.checkpoint: selective checkpointing that saves the outputs of the
    given ATen ops (and recomputes the rest). While `recording` is a list, the caches it creates are
    appended to it, so the benchmark can count what they hold (they live outside autograd's saved
    tensors)."""

    def __init__(self, op_names=SELECTIVE_SAVE):
        self.ops = [getattr(torch.ops.aten, n).default for n in op_names]
        self.recording: Optional[list] = None

    def __call__(self):
        from torch.utils.checkpoint import create_selective_checkpoint_contexts
        forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(self.ops)
        if self.recording is not None:
            self.recording.append(getattr(forward_ctx, "storage", None))
        return forward_ctx, recompute_ctx

    def cached_tensors(self) -> List[torch.Tensor]:
        out = []
        for storage in self.recording or ():
            for per_op in (storage or {}).values():
                for entry in per_op.values():
                    for leaf in torch.utils._pytree.tree_leaves(entry):
                        leaf = getattr(leaf, "val", leaf)  # torch wraps each cached output
                        if isinstance(leaf, torch.Tensor):
                            out.append(leaf)
        return out


class Unavailable(Exception):
    """A variant that does not apply here (the reason is its message)."""


def _failure(exc: BaseException) -> str:
    return "oom" if is_oom(exc) else f"error: {type(exc).__name__}"


def _short(exc: BaseException) -> str:
    msg = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {msg[:300]}"


class Suite:
    """One base model shared by the variants that can be switched on and off between steps, and a copy
    for each variant that cannot (OWN_MODEL)."""

    def __init__(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype, variants: List[str],
                 budget: Optional[int], notes: List[str]):
        self.spec, self.device, self.dtype, self.budget = spec, device, dtype, budget
        self.notes = notes
        cuda = device.type == "cuda"
        self.autocast = cuda and dtype != torch.float32
        base = build_model(spec)
        if not cuda:  # plain low precision on CPU; CUDA keeps fp32 weights under autocast
            base = base.to(dtype)
        self.base = base.to(device)
        self.selective = SelectiveContexts()
        self.models: Dict[str, nn.Module] = {}
        self.unavailable: Dict[str, str] = {}  # variant -> "unavailable: ..." or "error: ..."
        self.budget_batch: Optional[int] = None  # batch the budget variant's plan was made for
        self.budget_used: Optional[int] = None
        self.scale_budget = False
        self.none_held: Dict[int, int] = {}  # batch -> activation bytes of `none`
        self.ids: Dict[int, torch.Tensor] = {}
        self.current: Optional[str] = None
        for v in variants:
            try:
                self.models[v] = self._prepare(v)
            except Unavailable as e:
                self.unavailable[v] = f"unavailable: {e}"
            except Exception as e:
                self.unavailable[v] = _failure(e)
                notes.append(f"{v}: setting up failed with {_short(e)}")
        self.base_param_bytes = sum(p.numel() * p.element_size() for p in self.base.parameters())

    # ------------------------------------------------------------------------------------ set-up
    def _prepare(self, v: str) -> nn.Module:
        if v in ("none", "hf-torch-nonreentrant", "hf-torch-reentrant", "ckpt_ext"):
            return self.base
        if v == "torch-selective":
            hf_checkpointing_enable(self.base, use_reentrant=False, context_fn=self.selective)
            funcs = [m._gradient_checkpointing_func for m in self.base.modules()
                     if getattr(m, "_gradient_checkpointing_func", None) is not None]
            hf_checkpointing_disable(self.base)
            if not any(getattr(f, "keywords", {}).get("context_fn") is self.selective for f in funcs):
                raise Unavailable("this transformers version does not pass context_fn on to torch.utils.checkpoint")
            return self.base
        if v == "ckpt_ext-fused":
            if not hasattr(ckpt_ext, "fuse"):
                raise Unavailable("ckpt_ext.fuse is not in this build")
            model = copy.deepcopy(self.base)
            fused = ckpt_ext.fuse(model)
            model = fused if isinstance(fused, nn.Module) else model
            ckpt_ext.enable_checkpointing(model)
            return model
        if v == "ckpt_ext-budget":
            if "budget" not in inspect.signature(ckpt_ext.enable_checkpointing).parameters:
                raise Unavailable("ckpt_ext.enable_checkpointing has no budget argument in this build")
            return copy.deepcopy(self.base)
        if v == "compile-budget":
            if not hasattr(torch._functorch.config, "activation_memory_budget"):
                raise Unavailable(f"torch {torch.__version__} has no activation_memory_budget")
            return torch.compile(copy.deepcopy(self.base))
        raise ValueError(f"unknown variant {v!r}")

    def none_bytes(self, batch: int) -> int:
        """Activation bytes of `none` at this batch: measured there, or scaled linearly from batch 1
        where that does not fit or while `scale_budget` is set (the max-batch search)."""
        if batch in self.none_held:
            return self.none_held[batch]
        fitted = False
        if not self.scale_budget:
            try:
                self.activate("none", batch)
                self.measure("none", batch)
                fitted = True
            except Exception as e:
                if not is_oom(e):
                    raise
            if not fitted:
                free_memory(self.device)
        if fitted:
            return self.none_held[batch]
        if 1 not in self.none_held:
            self.activate("none", 1)
            self.measure("none", 1)
        return self.none_held[1] * batch

    def budget_for(self, batch: int) -> int:
        """--budget, or half the activation bytes of `none` at this batch."""
        return self.budget if self.budget is not None else max(1, self.none_bytes(batch) // 2)

    def activate(self, v: str, batch: int) -> None:
        """Puts the model of variant v in its state for this batch (untimed)."""
        for model in {id(m): m for m in self.models.values()}.values():
            model.zero_grad(set_to_none=True)
        if v == "ckpt_ext-budget" and self.budget_batch != batch:
            self.budget_used = self.budget_for(batch)
            ckpt_ext.enable_checkpointing(self.models[v], budget=self.budget_used)  # the next step probes and plans
            self.budget_batch = batch
        if self.model(v) is not self.base or self.current == v:
            return
        ckpt_ext.disable_checkpointing(self.base)
        hf_checkpointing_disable(self.base)
        if v == "hf-torch-nonreentrant":
            hf_checkpointing_enable(self.base, use_reentrant=False)
        elif v == "hf-torch-reentrant":
            hf_checkpointing_enable(self.base, use_reentrant=True)
        elif v == "torch-selective":
            hf_checkpointing_enable(self.base, use_reentrant=False, context_fn=self.selective)
        elif v == "ckpt_ext":
            ckpt_ext.enable_checkpointing(self.base)
        self.current = v

    # ----------------------------------------------------------------------------------- a step
    def model(self, v: str) -> nn.Module:
        return self.models.get(v, self.base)  # `none` is measured for the budget even when not benchmarked

    def input_ids(self, batch: int) -> torch.Tensor:
        if batch not in self.ids:
            g = torch.Generator().manual_seed(batch)
            self.ids[batch] = torch.randint(0, self.spec.vocab, (batch, self.spec.seq), generator=g).to(self.device)
        return self.ids[batch]

    def forward(self, v: str, batch: int) -> torch.Tensor:
        ids = self.input_ids(batch)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.autocast):
            if v == "compile-budget":
                with torch._functorch.config.patch(activation_memory_budget=COMPILE_MEMORY_BUDGET):
                    hidden = self.model(v)(input_ids=ids).last_hidden_state
            else:
                hidden = self.model(v)(input_ids=ids).last_hidden_state
        return hidden.float().pow(2).mean()

    def step(self, v: str, batch: int) -> None:
        self.forward(v, batch).backward()

    def measure(self, v: str, batch: int) -> dict:
        """One step of variant v (already activated) with its memory counted; see held_bytes."""
        params = list(self.model(v).parameters())
        extra = None
        if v == "torch-selective":
            self.selective.recording = []
            extra = self.selective.cached_tensors
        try:
            mem = held_bytes(lambda: self.forward(v, batch), params, self.device, extra)
        finally:
            self.selective.recording = None
        if self.device.type == "cuda":
            # As if this model were alone on the device: the other variants' copies (and the inputs)
            # sit in the base; this model's parameters are added back.
            own = sum(p.numel() * p.element_size() for p in params)
            mem["peak_allocated_bytes"] = own + mem["peak_allocated"]
            mem["peak_reserved_bytes"] = mem["peak_reserved"] - mem["base_reserved"] + own
        if v == "none":
            self.none_held[batch] = mem["held_bytes"]
        return mem


# ==================================================================================================
# Running the suite
# ==================================================================================================
class Progress:
    """tqdm bar on stderr whose total grows as work is planned."""

    def __init__(self, enabled: bool = True):
        from tqdm.auto import tqdm
        self.bar = tqdm(total=0, unit="step", file=sys.stderr, disable=not enabled, dynamic_ncols=True)

    def plan(self, n: int):
        self.bar.total += n
        self.bar.refresh()

    def describe(self, text: str):
        self.bar.set_description(text, refresh=False)

    def settle(self):  # work planned but dropped (a variant failed): the bar ends where the work did
        self.bar.total = self.bar.n
        self.bar.refresh()

    def __call__(self):
        self.bar.update(1)

    def close(self):
        self.bar.close()


def _row(v: str, batch: int, seq: int, status: str, note: str = "") -> dict:
    return {"variant": v, "batch": batch, "tokens": batch * seq if batch else 0, "status": status, "step_s": None,
            "tokens_per_s": None, "activation_bytes": None, "saved_bytes": None, "pool_bytes": None,
            "peak_allocated_bytes": None, "peak_reserved_bytes": None, "budget_bytes": None, "note": note}


def run_cases(suite: Suite, cases: Dict[str, int], repeat: int, warmup: int, progress: Progress) -> List[dict]:
    """Measures variant -> batch: a trial step (the first warm-up step: does it run, does it fit), a step
    with memory accounting, then warmup - 1 untimed and `repeat` timed interleaved rounds."""
    seq = suite.spec.seq
    rows = {v: _row(v, b, seq, "ok") for v, b in cases.items()}
    live = list(cases)
    progress.plan(len(live) * (warmup + 1 + repeat))

    def fail(v, exc, stage):
        rows[v]["status"] = _failure(exc)
        if not is_oom(exc):
            suite.notes.append(f"{v} (batch {cases[v]}): {stage} failed with {_short(exc)}")
        live.remove(v)

    for v in list(live):  # trial: compiles, probes (budget plan), checks the batch fits
        progress.describe(f"{v} b={cases[v]} trial")
        ok = True
        try:
            suite.activate(v, cases[v])
            suite.step(v, cases[v])
        except Exception as e:
            fail(v, e, "the first step")
            progress.plan(-(warmup + repeat))
            ok = False
        if not ok:
            free_memory(suite.device)
        progress()
    for v in list(live):  # memory
        progress.describe(f"{v} b={cases[v]} memory")
        mem = None
        try:
            suite.activate(v, cases[v])
            mem = suite.measure(v, cases[v])
        except Exception as e:
            fail(v, e, "the memory-accounting step")
            progress.plan(-(warmup - 1 + repeat))
        if mem is None:
            free_memory(suite.device)
        else:
            r = rows[v]
            r.update(activation_bytes=mem["held_bytes"], saved_bytes=mem["saved_bytes"], pool_bytes=mem["pool_bytes"],
                     peak_allocated_bytes=mem.get("peak_allocated_bytes"),
                     peak_reserved_bytes=mem.get("peak_reserved_bytes"))
        progress()
    if "ckpt_ext-budget" in live:
        rows["ckpt_ext-budget"]["budget_bytes"] = suite.budget_used

    def on_error(v, exc):
        rows[v]["status"] = _failure(exc)
        if not is_oom(exc):
            suite.notes.append(f"{v} (batch {cases[v]}): a timed step failed with {_short(exc)}")

    def setup(v):
        progress.describe(f"timing b={cases[v]}")
        suite.activate(v, cases[v])

    steps = {v: functools.partial(suite.step, v, cases[v]) for v in live}
    stats = interleaved(steps, suite.device, repeat, max(0, warmup - 1), setup=setup, on_error=on_error,
                        progress=progress)
    for v, s in stats.items():
        rows[v].update(step_s=s, tokens_per_s=cases[v] * seq / s["median"])
    progress.settle()
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
    has no out-of-memory error to search against, only the OOM killer): its activations per sample
    (measured at batch 1) twice over, plus parameters and gradients."""
    avail = _mem_available()
    if avail is None:
        return max_batch
    per_sample = suite.none_bytes(1)
    room = avail // 2 - 2 * suite.base_param_bytes
    return max(1, min(max_batch, room // max(1, 2 * per_sample)))


def run_max(suite: Suite, variants: List[str], cap: int, progress: Progress) -> Dict[str, int]:
    """Largest batch per variant (find_max_batch); 0 where batch 1 does not fit."""
    found = {}
    for v in variants:
        progress.describe(f"{v} max batch")
        tries = []

        def step(batch, v=v):
            tries.append(batch)
            progress.plan(1)
            try:
                suite.activate(v, batch)
                suite.step(v, batch)
            finally:
                progress()

        try:
            found[v] = find_max_batch(step, cap, free=lambda: free_memory(suite.device))
        except Exception as e:
            suite.unavailable[v] = _failure(e)
            suite.notes.append(f"{v}: the max-batch search failed with {_short(e)}")
        if v not in found:
            free_memory(suite.device)
            continue
        suite.notes.append(f"{v}: max-batch search tried {', '.join(map(str, tries))} -> {found[v]}")
    return found


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
    p = argparse.ArgumentParser(prog="python -m ckpt_ext.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bert-large", choices=[*MODELS, "custom"])
    p.add_argument("--layers", type=int, help="layers (custom; also overrides a named model's count)")
    p.add_argument("--hidden", type=int, help=f"custom only (default {CUSTOM_DEFAULTS['hidden']})")
    p.add_argument("--heads", type=int, help=f"custom only (default {CUSTOM_DEFAULTS['heads']})")
    p.add_argument("--seq", type=int, help="sequence length (default: the model's; CPU: 128)")
    p.add_argument("--batch", type=parse_batches, default=None,
                   help="comma list of batch sizes, or 'max' (default CUDA 8,16,32; CPU 2)")
    p.add_argument("--max-batch", type=int, default=None, help="upper bound of --batch max (default CUDA 4096, CPU 8)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default bfloat16 on CUDA (autocast), float32 on CPU (low precision on CPU: plain, no autocast)")
    p.add_argument("--repeat", type=int, default=None, help="timed rounds (default CUDA 20, CPU 5)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps per variant before timing, the first being the trial step (default CUDA 3, CPU 1)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--budget", default=None,
                   help="memory budget of ckpt_ext-budget ('2GiB', bytes); default half the activations of none")
    p.add_argument("--full", action="store_true", help="CPU: the model's real size (default: shrunk, see CPU_SMALL)")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/<device>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _results_root() -> str:
    repo = os.path.dirname(PACKAGE_DIR)  # a source checkout (editable install) keeps results in the repo
    root = repo if os.path.isdir(os.path.join(repo, "benchmarks")) else os.getcwd()
    return os.path.join(root, "benchmarks", "results")


def resolve_config(args, parser) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    cuda = device.type == "cuda"
    small = not cuda and not args.full
    if args.model == "custom":
        spec = ModelSpec("custom", "bert", args.layers or CUSTOM_DEFAULTS["layers"],
                         args.hidden or CUSTOM_DEFAULTS["hidden"], args.heads or CUSTOM_DEFAULTS["heads"],
                         args.seq or CUSTOM_DEFAULTS["seq"], 4 * (args.hidden or CUSTOM_DEFAULTS["hidden"]), 30522)
        if spec.hidden % spec.heads:
            parser.error(f"--hidden {spec.hidden} is not a multiple of --heads {spec.heads}")
    else:
        if args.hidden or args.heads:
            parser.error("--hidden and --heads apply to --model custom only")
        spec = MODELS[args.model]
        if small:
            spec = replace(spec, layers=min(spec.layers, CPU_SMALL["layers"]), seq=min(spec.seq, CPU_SMALL["seq"]))
        if args.layers:
            spec = replace(spec, layers=args.layers)
        if args.seq:
            spec = replace(spec, seq=args.seq)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        parser.error(f"--variants: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(VARIANTS)}")
    budget = None
    if args.budget is not None:
        from .planner import parse_bytes
        try:
            budget = parse_bytes(int(args.budget) if args.budget.isdigit() else args.budget)
        except (TypeError, ValueError) as e:
            parser.error(f"--budget: {e}")
    batch = args.batch or (parse_batches(CPU_SMALL["batch"]) if not cuda else [8, 16, 32])
    cfg = {"model": args.model, "spec": spec, "device": device,
           "dtype": args.dtype or ("bfloat16" if cuda else "float32"), "batch": batch,
           "max_batch": args.max_batch or (4096 if cuda else 8), "repeat": args.repeat or (20 if cuda else 5),
           "warmup": args.warmup if args.warmup is not None else (3 if cuda else 1), "variants": variants,
           "budget": budget, "cpu_small": small and args.model != "custom"}
    if cfg["repeat"] < 1 or cfg["warmup"] < 1 or cfg["max_batch"] < 1:
        parser.error("--repeat, --warmup and --max-batch must be at least 1 (the first warm-up step is the trial)")
    return cfg


# ==================================================================================================
# Reporting
# ==================================================================================================
def to_markdown(result: dict) -> str:
    info, cfg, rows = result["env"], result["config"], result["rows"]
    cuda = info["device"].startswith("cuda")
    load = result["load_average"]
    lines = [f"# ckpt_ext benchmark suite: {cfg['model']} on {info['device_name']} ({info['device']})", "",
             f"{info['date']}, torch {info['torch']}, CUDA {info['cuda']}, commit {info['git_commit']}, "
             f"{info['threads']} threads; load average (1/5/15 min) {' '.join(f'{x:.2f}' for x in load['start'])} "
             f"at the start, {' '.join(f'{x:.2f}' for x in load['end'])} at the end.", "",
             f"Model: {cfg['model_description']}{' (shrunk for CPU; --full for the real size)' if cfg['cpu_small'] else ''}; "
             f"{cfg['dtype']}{' autocast' if cuda and cfg['dtype'] != 'float32' else ''}; batch {cfg['batch']}; "
             f"{cfg['repeat']} timed rounds after {cfg['warmup']} warm-up step(s) per variant.", ""]
    head = "| variant | batch | status | step ms, median (p20-p80) | time/token vs none | tokens/s | activations MiB |"
    sep = "|---|---|---|---|---|---|---|"
    if cuda:
        head += " peak allocated MiB | peak reserved MiB |"
        sep += "---|---|"
    lines += [head, sep]
    none_tps = {r["batch"]: r["tokens_per_s"] for r in rows if r["variant"] == "none" and r["tokens_per_s"]}
    for r in rows:
        ref = none_tps.get(r["batch"]) or (next(iter(none_tps.values())) if cfg["batch"] == "max" and none_tps else None)
        ok = r["step_s"] is not None
        cells = [r["variant"], str(r["batch"] or "-"), r["status"], ms(r["step_s"]) if ok else "-",
                 f"{ref / r['tokens_per_s']:.2f}x" if ok and ref else "-",
                 f"{r['tokens_per_s']:.0f}" if ok else "-",
                 mib(r["activation_bytes"]) if r["activation_bytes"] is not None else "-"]
        if cuda:
            cells += [mib(r[k]) if r[k] is not None else "-" for k in ("peak_allocated_bytes", "peak_reserved_bytes")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "- activations: bytes held from forward to backward (unique storages saved for backward, "
              "parameters excluded, the selective-checkpointing cache and ckpt_ext's pool slots included).",
              "- time/token vs none: time per token relative to `none` at the same batch (with --batch max: at "
              "none's largest batch)."]
    if cuda:
        lines.append("- peak allocated/reserved: during one step, as if the model were alone on the device "
                     "(copies held by other variants subtracted); parameters and gradients included.")
    budgets = [r for r in rows if r["budget_bytes"]]
    for r in budgets:
        lines.append(f"- ckpt_ext-budget at batch {r['batch']}: budget {mib(r['budget_bytes'])} MiB.")
    lines.append(f"- torch-selective saves the outputs of aten {', '.join(SELECTIVE_SAVE)}; compile-budget: "
                 f"torch.compile with activation_memory_budget = {COMPILE_MEMORY_BUDGET}.")
    for n in result["notes"]:
        lines.append(f"- {n}")
    return "\n".join(lines) + "\n"


def _figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(8, 5))
    FigureCanvasAgg(fig)
    return fig


def plot_memory_vs_time(result: dict, path: str) -> None:
    cuda = result["env"]["device"].startswith("cuda")
    key, label = (("peak_allocated_bytes", "peak allocated, MiB") if cuda
                  else ("activation_bytes", "activations held forward→backward, MiB"))
    fig = _figure()
    ax = fig.add_subplot()
    for v in dict.fromkeys(r["variant"] for r in result["rows"]):
        pts = sorted((r for r in result["rows"] if r["variant"] == v and r["step_s"] and r[key] is not None),
                     key=lambda r: r["batch"])
        if not pts:
            continue
        x = [r["step_s"]["median"] * 1e3 for r in pts]
        y = [r[key] / 2**20 for r in pts]
        err = [[r["step_s"]["median"] * 1e3 - r["step_s"]["p20"] * 1e3 for r in pts],
               [r["step_s"]["p80"] * 1e3 - r["step_s"]["median"] * 1e3 for r in pts]]
        ax.errorbar(x, y, xerr=err, marker="o", capsize=3, label=v)
        for r, xi, yi in zip(pts, x, y):
            ax.annotate(f"b{r['batch']}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
    cfg = result["config"]
    ax.set_title(f"{cfg['model']} on {result['env']['device_name']}: memory against step time", fontsize=10)
    ax.set_xlabel("step time, ms (median, p20-p80)")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    if ax.has_data():
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_max_batch(result: dict, path: str) -> None:
    fig = _figure()
    ax = fig.add_subplot()
    names = list(result["max_batch"])
    values = [result["max_batch"][n] for n in names]
    ax.barh(names, values)
    for i, val in enumerate(values):
        ax.annotate(str(val), (val, i), textcoords="offset points", xytext=(4, -3), fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"largest batch (seq {result['config']['seq']}, cap {result['config']['max_batch']})")
    ax.set_title(f"{result['config']['model']} on {result['env']['device_name']}: largest batch per variant", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ==================================================================================================
def main(argv=None) -> dict:
    parser = make_parser()
    args = parser.parse_args(argv)
    cfg = resolve_config(args, parser)
    spec, device = cfg["spec"], cfg["device"]
    load_start = os.getloadavg()
    notes: List[str] = []
    progress = Progress(enabled=not args.no_progress)
    progress.describe(f"building {spec.name}")
    suite = Suite(spec, device, getattr(torch, cfg["dtype"]), cfg["variants"], cfg["budget"], notes)
    runnable = [v for v in cfg["variants"] if v not in suite.unavailable]
    rows: List[dict] = []
    max_batch = None
    try:
        if cfg["batch"] == "max":
            suite.scale_budget = True  # no step of `none` at the batches it cannot reach
            cap = cfg["max_batch"] if device.type == "cuda" else cpu_batch_cap(suite, cfg["max_batch"])
            if cap < cfg["max_batch"]:
                notes.append(f"--batch max capped at {cap} by the memory estimate (CPU)")
            cfg["max_batch"] = cap
            max_batch = run_max(suite, runnable, cap, progress)
            cases = {v: b for v, b in max_batch.items() if b > 0}
            measured = {r["variant"]: r for r in run_cases(suite, cases, cfg["repeat"], cfg["warmup"], progress)}
            for v in cfg["variants"]:
                if v in measured:
                    rows.append(measured[v])
                elif v in suite.unavailable:
                    rows.append(_row(v, 0, spec.seq, suite.unavailable[v]))
                else:
                    rows.append(_row(v, 0, spec.seq, "oom", "batch 1 does not fit"))
        else:
            for b in cfg["batch"]:
                cases = {v: b for v in runnable}
                measured = {r["variant"]: r for r in run_cases(suite, cases, cfg["repeat"], cfg["warmup"], progress)}
                rows += [measured.get(v) or _row(v, b, spec.seq, suite.unavailable[v]) for v in cfg["variants"]]
    finally:
        progress.close()

    config = {"model": cfg["model"], "model_description": spec.describe(), "layers": spec.layers,
              "hidden": spec.hidden, "heads": spec.heads, "kv_heads": spec.kv_heads, "seq": spec.seq,
              "intermediate": spec.intermediate, "vocab": spec.vocab, "dtype": cfg["dtype"],
              "batch": cfg["batch"], "max_batch": cfg["max_batch"], "repeat": cfg["repeat"], "warmup": cfg["warmup"],
              "variants": cfg["variants"], "budget_bytes": cfg["budget"], "cpu_small": cfg["cpu_small"],
              "argv": list(sys.argv[1:] if argv is None else argv)}
    result = {"env": env_info(device), "load_average": {"start": list(load_start), "end": list(os.getloadavg())},
              "config": config, "rows": rows, "max_batch": max_batch, "notes": notes}
    md = to_markdown(result)
    print(md)
    out = args.out or os.path.join(_results_root(), device_dir_name(result["env"]))
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, cfg["model"])
    with open(stem + ".md", "w") as f:
        f.write(md)
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    written = [stem + ".md", stem + ".json"]
    try:
        plot_memory_vs_time(result, stem + ".png")
        written.append(stem + ".png")
        if max_batch is not None:
            plot_max_batch(result, stem + "-max-batch.png")
            written.append(stem + "-max-batch.png")
    except ImportError as e:
        print(f"no plots: {e} (pip install matplotlib)", file=sys.stderr)
    print("wrote " + ", ".join(written), file=sys.stderr)
    result["files"] = written
    return result


if __name__ == "__main__":
    main()
