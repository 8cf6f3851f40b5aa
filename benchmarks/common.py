"""What every benchmark here shares: timing (medians with 20th/80th percentiles over interleaved rounds),
memory accounting, the record of where a result was measured, noise flags, and where results are written.

Results go to `bench-out/<device>/` (untracked, see .gitignore) or to --out; the committed folder
`benchmarks/results/<device>/` is written only with --save-results.
"""
import argparse
import contextlib
import datetime
import gc
import json
import logging
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import warnings
from typing import Callable, Dict, Iterable, List, Optional

import torch
from torch import nn

import ckpt_ext

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
DEFAULT_OUT = os.path.join(REPO, "bench-out")
RESULTS = os.path.join(BENCH_DIR, "results")

# A row whose p20-p80 range is wider than this fraction of its median is flagged as noisy.
NOISY_SPREAD = 0.25
# A variant that recomputes on the same kernels as `none` cannot be faster than `none`: beyond this
# margin its row is flagged as implausible (the machine's load changed under the measurement).
IMPLAUSIBLE_MARGIN = 0.05


# ---------------------------------------------------------------------------------------------- timing
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
    return {"median": statistics.median(xs), "p20": q(0.2), "p80": q(0.8), "min": xs[0], "n": len(xs)}


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
    """Times the steps (name -> function) in interleaved rounds: each round runs every step once, in an
    order rotated by one every round (no step always runs first), so a change in machine load hits all
    alike. `warmup` untimed rounds come first. setup(name), if given, runs untimed before each step;
    progress() after each. A step that raises is re-raised, or, when on_error is given, reported to
    on_error(name, exc) and left out of the remaining rounds. Returns name -> quantiles of the timed
    runs (for the steps that never failed) and name -> the raw times."""
    timer = Timer(device)
    names = list(steps)
    times: Dict[str, List[float]] = {k: [] for k in names}
    failed = set()
    for r in range(warmup + rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            if k in failed:
                continue
            if setup:
                setup(k)
            elapsed = None
            try:
                elapsed = timer(steps[k])
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
    return {k: quantiles(v) for k, v in times.items() if k not in failed and v}, times


# ---------------------------------------------------------------------------------------------- memory
def held_bytes(step_forward: Callable[[], torch.Tensor], params: Iterable[torch.Tensor], device,
               extra_saved: Optional[Callable[[], Iterable[torch.Tensor]]] = None):
    """Bytes that live from forward to backward, counted alike on every device: the unique storages
    saved for backward (saved-tensor hooks; parameters and pooled tensors excluded), tensors a variant
    keeps outside autograd (``extra_saved()`` after the forward, e.g. a selective-checkpointing cache)
    and ckpt_ext's pool slots taken during the forward. Runs step_forward() (returns the loss) and the
    backward. Keys: held_bytes = saved_bytes + pool_bytes; on CUDA also peak_allocated (above what was
    allocated before the step), peak_reserved, base_allocated, base_reserved, fragmentation_at_peak
    (reserved minus allocated at their peaks)."""
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
        free_memory(device)  # pool chunks left from earlier steps would sit in the base and hide its growth
        base_allocated = torch.cuda.memory_allocated(device)
        base_reserved = torch.cuda.memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
    pool_before = ckpt_ext.pool_stats(device)["in_use_bytes"]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step_forward()
    for t in (extra_saved() if extra_saved else ()):
        count(t)
    pool = ckpt_ext.pool_stats(device)["in_use_bytes"] - pool_before
    loss.backward()
    saved = sum(storages.values())
    out = {"held_bytes": saved + pool, "saved_bytes": saved, "pool_bytes": pool}
    if cuda:
        torch.cuda.synchronize(device)
        peak_alloc, peak_res = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        out.update(peak_allocated=peak_alloc - base_allocated, peak_reserved=peak_res, base_allocated=base_allocated,
                   base_reserved=base_reserved, fragmentation_at_peak=peak_res - peak_alloc)
    return out


def find_max_batch(step: Callable[[int], None], cap: int, free: Callable[[], None] = gc.collect,
                   precision: float = 0.0) -> int:
    """Largest batch in [1, cap] for which step(batch) does not run out of memory: doubling from 1,
    then bisection between the last batch that fitted and the first that did not. step raises an
    out-of-memory error (see is_oom) when a batch does not fit; any other exception propagates.
    free() runs after each try that ran out of memory. Returns 0 when batch 1 does not fit.
    precision > 0 stops the bisection once the first batch that did not fit is within that fraction of
    the last that did (0.125: the answer is at most 12.5% below the true largest batch, in fewer tries)."""
    if cap < 1:
        raise ValueError(f"cap must be at least 1, got {cap}")
    if not 0 <= precision < 1:
        raise ValueError(f"precision must be in [0, 1), got {precision}")

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

    fitted, failed, batch = 0, None, 1
    while failed is None:
        if fits(batch):
            fitted = batch
            if batch == cap:
                return cap
            batch = min(2 * batch, cap)
        else:
            failed = batch
    while failed - fitted > max(1, int(fitted * precision)):
        mid = (fitted + failed) // 2
        if fits(mid):
            fitted = mid
        else:
            failed = mid
    return fitted


# ------------------------------------------------------------------------------- Hugging Face toggles
def hf_checkpointing_enable(model: nn.Module, **checkpoint_kwargs) -> None:
    """Hugging Face's own checkpointing: torch.utils.checkpoint with these keyword arguments, under
    the transformers 5.x name or the older one."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)


def hf_checkpointing_disable(model: nn.Module) -> None:
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    # Enabling registers a hook that makes the embeddings' output require grad, one more per call:
    # without this they pile up every time a benchmark toggles checkpointing.
    if getattr(model, "_require_grads_hooks", None) and hasattr(model, "disable_input_require_grads"):
        model.disable_input_require_grads()


# ----------------------------------------------------------------------------------- the environment
def git_commit() -> str:
    """The checkout's commit, `-dirty` when a tracked file outside the benchmarks' own outputs differs
    (so a run that saved results into benchmarks/results/ does not mark the next run dirty)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "--short=7", "HEAD")
        if head.returncode:
            return ""
        status = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results",
                     ":(exclude)bench-out")
    except (OSError, subprocess.SubprocessError):
        return ""
    return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> Optional[List[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def env_info(device) -> dict:
    """Where and with what a result was measured."""
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    try:
        import transformers
        tf = transformers.__version__
    except ImportError:
        tf = None
    return {"device": str(device), "device_name": name, "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": tf, "ckpt_ext": ckpt_ext.__version__, "git_commit": git_commit(),
            "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "load_average_start": load_average()}


def finish_env(info: dict) -> dict:
    """Records the load average at the end of the run, and a note when the machine was busier than its
    cores (every timing of the run is then suspect)."""
    info["load_average_end"] = load_average()
    loads = [la[0] for la in (info["load_average_start"], info["load_average_end"]) if la]
    info["overloaded"] = bool(loads) and max(loads) > (info["cpu_count"] or 1)
    return info


def env_line(info: dict) -> str:
    fmt = lambda la: "n/a" if la is None else " ".join(f"{x:.2f}" for x in la)  # noqa: E731
    line = (f"{info['date']}, torch {info['torch']}, CUDA {info['cuda']}, transformers {info['transformers']}, "
            f"commit {info['git_commit'] or 'unknown'}, {info['threads']} threads; load average (1/5/15 min) "
            f"{fmt(info['load_average_start'])} at the start, {fmt(info.get('load_average_end'))} at the end.")
    if info.get("overloaded"):
        line += f" **The load exceeded the {info['cpu_count']} cores: every timing here is suspect.**"
    return line


def device_dir_name(info: dict) -> str:
    """`cpu`, or `cuda-<device name with underscores>`: the results folder of a device."""
    if not info["device"].startswith("cuda"):
        return "cpu"
    return "cuda-" + re.sub(r"[^A-Za-z0-9.-]+", "_", info["device_name"]).strip("_")


# ------------------------------------------------------------------------------------------ noise flags
def noise_flags(stats: Optional[dict], none_stats: Optional[dict] = None, recomputes: bool = False) -> List[str]:
    """Why a timing should not be trusted: a p20-p80 range wider than NOISY_SPREAD of the median, or,
    for a variant that recomputes on the same kernels as `none` (recomputes=True), a median below
    none's."""
    if not stats:
        return []
    flags = []
    if stats.get("n", 3) < 3:
        flags.append(f"{stats['n']} timed round(s): spread unknown")
    spread = (stats["p80"] - stats["p20"]) / stats["median"]
    if spread > NOISY_SPREAD:
        flags.append(f"noisy: p20-p80 spread {spread:.0%} of the median")
    if recomputes and none_stats and stats["median"] < (1 - IMPLAUSIBLE_MARGIN) * none_stats["median"]:
        flags.append(f"implausible: {stats['median'] / none_stats['median']:.2f}x the time of no checkpointing")
    return flags


# ---------------------------------------------------------------------------------------------- output
def add_output_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--out", default=None, help="results folder (default bench-out/<device>, untracked)")
    g.add_argument("--save-results", action="store_true",
                   help="write into the committed benchmarks/results/<device>/ (on purpose only)")


def output_dir(args, info: dict) -> str:
    if args.out:
        return args.out
    return os.path.join(RESULTS if args.save_results else DEFAULT_OUT, device_dir_name(info))


def write_results(out: str, stem: str, result: dict, markdown: str) -> List[str]:
    """Writes <out>/<stem>.json and .md; returns the paths."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, stem + ".json"), os.path.join(out, stem + ".md")]
    with open(paths[0], "w") as f:
        json.dump(result, f, indent=2, default=str)
    with open(paths[1], "w") as f:
        f.write(markdown)
    return paths


def mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.2f}"


def ms(s) -> str:
    return "-" if not s else f"{s['median'] * 1e3:.2f} ({s['p20'] * 1e3:.2f}-{s['p80'] * 1e3:.2f})"


def short_error(exc: BaseException) -> str:
    msg = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {msg[:300]}"


class Progress:
    """tqdm bar on stderr whose total grows as work is planned (no bar without tqdm or when disabled).
    While the bar is shown, Python warnings and the console logging of the root, transformers and
    ckpt_ext loggers go through tqdm.write (whole lines above the bar, not in the middle of it); close()
    puts the previous handlers and warnings.showwarning back."""

    def __init__(self, enabled: bool = True):
        self.bar = None
        self._redirect = contextlib.ExitStack()
        if enabled:
            try:
                from tqdm.auto import tqdm
                self.bar = tqdm(total=0, unit="step", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                print("no progress bar: tqdm is not installed (pip install '.[bench]')", file=sys.stderr)
        if self.bar is not None:
            self._redirect.enter_context(_output_through_tqdm(type(self.bar), sys.stderr))

    def plan(self, n: int):
        if self.bar is not None:
            self.bar.total += n
            self.bar.refresh()

    def describe(self, text: str):
        if self.bar is not None:
            self.bar.set_description(text, refresh=False)

    def __call__(self):
        if self.bar is not None:
            self.bar.update(1)

    def close(self):
        self._redirect.close()
        if self.bar is not None:
            self.bar.total = self.bar.n
            self.bar.close()


@contextlib.contextmanager
def _output_through_tqdm(tqdm_class, stream):
    """Warnings and console logging written with tqdm_class.write to `stream` (the bar's: tqdm clears only
    the bars on the stream it writes to), restored on exit."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    # The root logger (ckpt_ext's logger propagates to it), plus the loggers that print on their own
    # (transformers' library logger does not propagate).
    loggers = [logging.root] + [logging.getLogger(n) for n in ("transformers", "ckpt_ext")
                                if logging.getLogger(n).handlers]
    before = {id(h) for logger in loggers for h in logger.handlers}
    shown = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if file is not None:  # an explicit stream is the caller's choice
            return shown(message, category, filename, lineno, file, line)
        text = warnings.formatwarning(message, category, filename, lineno, line)
        tqdm_class.write(text.rstrip("\n"), file=stream)

    with logging_redirect_tqdm(loggers, tqdm_class=tqdm_class):
        for logger in loggers:
            for h in logger.handlers:
                if id(h) not in before:  # tqdm's handler keeps the replaced handler's stream otherwise
                    h.stream = stream
        warnings.showwarning = showwarning
        try:
            yield
        finally:
            warnings.showwarning = shown
