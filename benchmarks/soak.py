"""Soak: many CPU training steps with a batch size and sequence length that change every step, each
model checkpointed by ckpt_ext and trained in lockstep with an identical copy that is not checkpointed.

Models (small on purpose: the run is about the engine's state over time, not about speed):
  stack  a plain layer stack (pre-norm attention + MLP blocks, dropout) under
         ckpt_ext.enable_checkpointing(every=2), with its head MLP run through ckpt_ext.checkpoint
  bert   a tiny Hugging Face BertForMaskedLM, ckpt_ext.fuse + enable_checkpointing(every=2)
         (C++ SegmentFunction), dropout 0.1, padded batches
  gpt2   a tiny Hugging Face GPT2LMHeadModel, ckpt_ext.fuse + enable_checkpointing(every=1), dropout 0.1

Every step draws (batch, seq) from a seeded generator and trains each checkpointed model and its
reference (SGD with momentum, same seed for dropout). What is measured:
  * results: the loss and every parameter's gradient of the checkpointed model are compared with the
    reference's at every step, bit for bit (torch.equal). Bit-identity is the right criterion, not a
    tolerance: checkpointing runs the same operators in the same order with the same random numbers
    (the fused reference is the same fused model without checkpointing), so any difference is a bug --
    and once one appeared the two copies would drift apart. Final parameters are compared too.
  * the pool: after every step (graph gone, before any gc.collect) in_use_bytes must be back at its
    value at the start; reserved_bytes over time (must reach a plateau), grows, peak in use per step.
  * process memory: resident set size (/proc/self/statm) at intervals; growth from the end of the
    warm-up to the end of the run, and over the second half. The script sets
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 unless it is set: oneDNN's per-shape kernel cache grows with every
    new shape, with or without ckpt_ext, and would hide a leak.
  * faults (--fault-every N): three in the warm-up, then one every N steps, to each model in turn: a
    KeyboardInterrupt at a random Python call of its forward (where a real Ctrl-C lands), one at a random
    computing operator of its backward (often inside a replay, the fused C++ one included), or its graph
    dropped after the loss without backward. Then the pool must be back at its start, grad mode,
    is_recomputing() and autocast as before, and the step is run again: the lockstep comparison shows that
    nothing of the fault remains.

    python benchmarks/soak.py                       # 2000 steps, results in bench-out/cpu/soak.{json,md}
    python benchmarks/soak.py --save-results        # ... into the committed benchmarks/results/cpu/
    python benchmarks/soak.py --steps 200 --out /tmp/soak

The pool's chunk size is set small (--chunk-kib, default 64 KiB, where the default on CPU is 4 MiB) so
that the varying boundaries exercise growth, out-of-order frees and outsize chunks instead of fitting
in one chunk.

The models are in soak_models.py, the measurements and the fault injection in soak_faults.py.
"""
import os

if __name__ == "__main__":
    # Before torch loads oneDNN: its primitive cache keeps up to 1024 JIT-compiled kernels, one per shape it
    # met, which with shapes varying every step grows RSS by tens of MiB over the run and would hide a leak.
    # Set the variable yourself to measure with the cache on.
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "0")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Callable, List, Optional, Sequence, Tuple  # noqa: E402

import torch  # noqa: E402

import ckpt_ext  # noqa: E402
from common import add_output_args, env_info, finish_env, output_dir  # noqa: E402
from soak_faults import _first_difference, drain_autograd_queue, inject_fault, rss_bytes  # noqa: E402
from soak_models import MODELS, VOCAB, build_pair  # noqa: E402

FAULTS = ("backward-interrupt", "forward-interrupt", "graph-dropped")


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------
def run(steps: int = 2000, models=MODELS, max_batch: int = 6, max_seq: int = 48, seed: int = 0,
        warmup: Optional[int] = None, rss_every: int = 25, fault_every: int = 50, chunk_kib: int = 64,
        threads: Optional[int] = None, progress: bool = True, shape_set: Optional[Sequence[Tuple[int, int]]] = None,
        step_hook: Optional[Callable] = None) -> dict:
    """Runs the soak and returns its result (see the module docstring).

    Each step's (batch, seq) is drawn uniformly from 1..max_batch x 2..max_seq, or, with `shape_set`, from
    those pairs (the first steps run each pair once, so a warm-up at least that long has seen them all).
    `step_hook(step, name, pair, ids, mask)`, when given, is called after each step of each model with the
    pair's models (pair["ck"], pair["ref"]) and loss function (pair["loss"]): the tests use it to plant leaks."""
    device = torch.device("cpu")
    saved = torch.get_num_threads(), ckpt_ext._C.pool_chunk_bytes(device)  # restored at the end (tests)
    if threads:
        torch.set_num_threads(threads)
    ckpt_ext.set_pool_chunk_bytes(chunk_kib << 10, device)
    try:
        return _run(steps, models, max_batch, max_seq, seed, warmup, rss_every, fault_every, chunk_kib, progress,
                    shape_set, step_hook)
    finally:
        torch.set_num_threads(saved[0])
        ckpt_ext.set_pool_chunk_bytes(saved[1], device)


def _make_pairs(models, seed) -> dict:
    pairs = {}
    for i, name in enumerate(models):
        ck, ref, loss_fn = build_pair(name, seed + i)
        # SGD with momentum: the weights change every step at little cost (AdamW costs as much as a step of
        # these tiny models).
        pairs[name] = dict(ck=ck, ref=ref, loss=loss_fn,
                           opt_ck=torch.optim.SGD(ck.parameters(), lr=0.02, momentum=0.9),
                           opt_ref=torch.optim.SGD(ref.parameters(), lr=0.02, momentum=0.9))
    return pairs


def _fault_schedule(steps, models, warmup, fault_every) -> dict:
    """{step: (fault kind, model)}. One of each kind early in the warm-up (so that one-time costs, such as
    the first use of a dispatch mode, fall in it), then every fault_every steps; kinds and models rotate
    through every pair."""
    fault_steps = ([s for s in (1, 2, 3) if s < warmup] + list(range(fault_every, steps, fault_every))
                   if fault_every else [])
    return {s: (FAULTS[i % len(FAULTS)], models[(i + i // len(FAULTS)) % len(models)]) for i, s in enumerate(fault_steps)}


def _draw_step(step, shapes, shape_set, max_batch, max_seq):
    """(batch, seq, ids, mask, step_seed) of one step, drawn from the `shapes` generator."""
    if shape_set:
        i = step if step < len(shape_set) else int(torch.randint(len(shape_set), (1,), generator=shapes))
        batch, seq = shape_set[i]
    else:
        batch = int(torch.randint(1, max_batch + 1, (1,), generator=shapes))
        seq = int(torch.randint(2, max_seq + 1, (1,), generator=shapes))
    ids = torch.randint(0, VOCAB, (batch, seq), generator=shapes)
    lengths = torch.randint(1, seq + 1, (batch,), generator=shapes)
    lengths[0] = seq  # at least one full row
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    step_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=shapes))
    return batch, seq, ids, mask, step_seed


def _global_state():
    return dict(grad_enabled=torch.is_grad_enabled(), recomputing=ckpt_ext.is_recomputing(),
                autocast=torch.is_autocast_enabled("cpu"))


def _progress_bar(progress, steps):
    if not progress:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=steps, unit="step", file=sys.stderr, dynamic_ncols=True, desc="soak")


class _Log:
    """What a soak run records, and the checks made after every step and fault."""

    def __init__(self, device, base_in_use):
        self.device, self.base_in_use = device, base_in_use
        self.clean_state = _global_state()
        self.steps: List[dict] = []
        self.rss: List[List[int]] = []
        self.mismatches: List[str] = []
        self.leaks: List[str] = []
        self.problems: List[str] = []  # thread state left behind by a fault (grad mode, recomputing flag, autocast)
        self.faults: List[dict] = []
        self.step_seconds: List[float] = []

    def check_pool(self, step, what):
        in_use = ckpt_ext.pool_stats(self.device)["in_use_bytes"]
        if in_use != self.base_in_use:
            self.leaks.append(f"step {step}, {what}: in_use_bytes {in_use} != {self.base_in_use} at the start")
        return in_use

    def fault(self, step, name, kind, pair, n, ids, mask, step_seed):
        record = inject_fault(pair, kind, n, ids, mask, step_seed)
        record.update(step=step, model=name)
        pair["opt_ck"].zero_grad(set_to_none=True)  # a partial backward may have left gradients
        record["in_use_before_drain"] = ckpt_ext.pool_stats(self.device)["in_use_bytes"]
        drain_autograd_queue()
        record["in_use_after"] = self.check_pool(step, f"{name} after fault {kind}")
        state = _global_state()
        if state != self.clean_state:
            self.problems.append(f"step {step}, {name} after fault {kind}: state {state} != {self.clean_state}")
        self.faults.append(record)


def _train_pair(step, name, p, ids, mask, step_seed, log, step_hook):
    """One step of the checkpointed model and of its reference, compared bitwise."""
    torch.manual_seed(step_seed)
    loss_ck = p["loss"](p["ck"], ids, mask)
    loss_ck.backward()
    torch.manual_seed(step_seed)
    loss_ref = p["loss"](p["ref"], ids, mask)
    loss_ref.backward()
    diff = _first_difference(loss_ck, loss_ref, p["ck"], p["ref"])
    if diff is not None:
        log.mismatches.append(f"step {step}, {name}: {diff}")
    p["opt_ck"].step()
    p["opt_ref"].step()
    p["opt_ck"].zero_grad(set_to_none=True)
    p["opt_ref"].zero_grad(set_to_none=True)
    if step_hook is not None:
        step_hook(step, name, p, ids, mask)
    del loss_ck, loss_ref
    log.check_pool(step, name)


def _run(steps, models, max_batch, max_seq, seed, warmup, rss_every, fault_every, chunk_kib, progress, shape_set,
         step_hook) -> dict:
    warmup = max(1, steps // 10) if warmup is None else warmup
    device = torch.device("cpu")
    gc.collect()
    ckpt_ext.empty_pool(device)  # chunks left by earlier work in this process would hide growth
    pairs = _make_pairs(models, seed)
    shapes = torch.Generator().manual_seed(seed)
    fault_at = _fault_schedule(steps, models, warmup, fault_every)
    gc.collect()
    start = ckpt_ext.pool_stats(device)
    log = _Log(device, start["in_use_bytes"])
    bar = _progress_bar(progress, steps)
    for step in range(steps):
        batch, seq, ids, mask, step_seed = _draw_step(step, shapes, shape_set, max_batch, max_seq)
        fault_kind, fault_model = fault_at.get(step, (None, None))
        # Where the interrupt lands: the n-th Python call of a forward (hundreds per step) or the n-th computing
        # operator of a backward (a hundred or more per step, most of them in replays).
        fault_n = int(torch.randint(1, 120, (1,), generator=shapes)) if fault_kind else 0
        ckpt_ext.reset_peak_stats(device)
        t0 = time.perf_counter()
        for name in models:
            if name == fault_model:
                log.fault(step, name, fault_kind, pairs[name], fault_n, ids, mask, step_seed)
            _train_pair(step, name, pairs[name], ids, mask, step_seed, log, step_hook)
        log.step_seconds.append(time.perf_counter() - t0)
        s = ckpt_ext.pool_stats(device)
        log.steps.append({"step": step, "batch": batch, "seq": seq, "reserved_bytes": s["reserved_bytes"],
                          "in_use_bytes": s["in_use_bytes"], "peak_in_use_bytes": s["peak_in_use_bytes"],
                          "chunks": s["chunks"], "grows": s["grows"]})
        if step % rss_every == 0 or step == steps - 1 or step == warmup - 1:
            log.rss.append([step, rss_bytes()])
        if bar is not None:
            bar.update(1)
            if step % 50 == 0:
                bar.set_postfix(reserved_kib=s["reserved_bytes"] >> 10, mismatches=len(log.mismatches),
                                leaks=len(log.leaks), refresh=False)
    if bar is not None:
        bar.close()
    final_diff = [f"{name}: {n}" for name in models
                  for (n, a), b in zip(pairs[name]["ck"].named_parameters(), pairs[name]["ref"].parameters())
                  if not torch.equal(a, b)]
    return summarize(dict(
        config=dict(steps=steps, models=list(models), max_batch=max_batch, max_seq=max_seq,
                    onednn_primitive_cache_capacity=os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY"),
                    shape_set=[list(x) for x in shape_set] if shape_set else None, seed=seed,
                    warmup=warmup, rss_every=rss_every, fault_every=fault_every, chunk_bytes=chunk_kib << 10,
                    threads=torch.get_num_threads()),
        pool_start=start, steps=log.steps, rss=log.rss, mismatches=log.mismatches, leaks=log.leaks,
        problems=log.problems, faults=log.faults, final_parameters_differ=final_diff, step_seconds=log.step_seconds))


def summarize(result: dict) -> dict:
    cfg, log = result["config"], result["steps"]
    warmup = min(cfg["warmup"], len(log)) - 1
    reserved = [r["reserved_bytes"] for r in log]
    last_growth = max((i for i in range(1, len(reserved)) if reserved[i] > reserved[i - 1]), default=0)
    peak = max(r["peak_in_use_bytes"] for r in log)
    rss = [(s, b) for s, b in result["rss"] if b is not None]
    rss_warm = next((b for s, b in rss if s >= warmup), None)
    secs = sorted(result["step_seconds"])
    result["summary"] = dict(
        reserved_max_bytes=max(reserved), reserved_end_bytes=reserved[-1],
        reserved_after_warmup_bytes=reserved[warmup], last_growth_step=last_growth,
        grows=log[-1]["grows"], chunks_end=log[-1]["chunks"], peak_in_use_max_bytes=peak,
        reserved_over_peak=(max(reserved) / peak) if peak else None,
        in_use_back_to_start_every_step=not result["leaks"], in_use_end_bytes=log[-1]["in_use_bytes"],
        rss_start_bytes=rss[0][1] if rss else None, rss_after_warmup_bytes=rss_warm,
        rss_end_bytes=rss[-1][1] if rss else None, rss_max_bytes=max(b for _, b in rss) if rss else None,
        rss_growth_after_warmup_bytes=(rss[-1][1] - rss_warm) if rss and rss_warm is not None else None,
        rss_growth_second_half_bytes=(rss[-1][1] - next(b for st, b in rss if st >= len(log) // 2)) if rss else None,
        steps_compared=len(log) * len(cfg["models"]), mismatching_steps=len(result["mismatches"]),
        final_parameters_identical=not result["final_parameters_differ"],
        faults_injected=len(result["faults"]),
        faults_raised=sum(1 for f in result["faults"] if f.get("raised")),
        faults_in_replay=sum(1 for f in result["faults"] if f.get("in_replay")),
        faults_held_until_next_backward=sum(
            1 for f in result["faults"] if f.get("in_use_before_drain", 0) != result["pool_start"]["in_use_bytes"]),
        state_problems=len(result["problems"]),
        step_ms_median=1e3 * secs[len(secs) // 2] if secs else None, total_s=sum(secs))
    return result


def passed(result: dict) -> bool:
    """The pass criteria: results bit-identical, the pool back at its start after every step and fault,
    no thread state left behind. (Bounds on reserved bytes and RSS are judged by the reader or the test.)"""
    return not (result["mismatches"] or result["leaks"] or result["problems"] or result["final_parameters_differ"])


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------
def _kib(b):
    return "-" if b is None else f"{b / 1024:,.0f} KiB"


def _mib(b):
    return "-" if b is None else f"{b / 2**20:,.1f} MiB"


def to_markdown(result: dict, command: str) -> str:
    env, cfg, s = result["env"], result["config"], result["summary"]
    shapes = (f"batch x seq from {', '.join(f'{b}x{q}' for b, q in cfg['shape_set'])}" if cfg["shape_set"] else
              f"batch 1-{cfg['max_batch']} and sequence length 2-{cfg['max_seq']}")
    ok = lambda flag: "yes" if flag else "**NO**"  # noqa: E731
    lines = [
        f"# ckpt_ext soak — {env['device_name']} ({env['device']})",
        "",
        f"{env['date']}, torch {env['torch']}, commit {env['git_commit']}, {cfg['threads']} threads; `{command}`",
        "",
        f"{cfg['steps']} steps of {', '.join(cfg['models'])} (each checkpointed, in lockstep with an identical copy "
        f"without checkpointing), {shapes} drawn per step (seed {cfg['seed']}), pool chunk "
        f"{_kib(cfg['chunk_bytes'])}, warm-up {cfg['warmup']} steps, a fault every {cfg['fault_every'] or '-'} "
        f"steps. Median step (all models, both copies): "
        f"{s['step_ms_median']:.1f} ms; total {s['total_s']:.0f} s.",
        "",
        "| check | result |",
        "|---|---|",
        f"| results: loss and every gradient bit-identical to the reference | {ok(not s['mismatching_steps'])} "
        f"({s['steps_compared']} model-steps compared, {s['mismatching_steps']} differ) |",
        f"| final parameters bit-identical | {ok(s['final_parameters_identical'])} |",
        f"| pool in_use_bytes back to its start after every step and fault | "
        f"{ok(s['in_use_back_to_start_every_step'])} (end: {s['in_use_end_bytes']} B) |",
        f"| pool reserved_bytes: after warm-up / max / end | {_kib(s['reserved_after_warmup_bytes'])} / "
        f"{_kib(s['reserved_max_bytes'])} / {_kib(s['reserved_end_bytes'])} |",
        f"| last growth of the pool | step {s['last_growth_step']} ({s['grows']} chunks added in all, "
        f"{s['chunks_end']} held at the end) |",
        f"| largest peak in use in one step | {_kib(s['peak_in_use_max_bytes'])} (reserved max / peak in use = "
        f"{s['reserved_over_peak']:.2f}) |",
        f"| process RSS: start / after warm-up / end / max | {_mib(s['rss_start_bytes'])} / "
        f"{_mib(s['rss_after_warmup_bytes'])} / {_mib(s['rss_end_bytes'])} / {_mib(s['rss_max_bytes'])} |",
        f"| RSS growth from the end of warm-up to the end / over the second half | "
        f"{_mib(s['rss_growth_after_warmup_bytes'])} / {_mib(s['rss_growth_second_half_bytes'])} |",
        f"| faults injected / raised / landed in a replay | {s['faults_injected']} / {s['faults_raised']} / "
        f"{s['faults_in_replay']} |",
        f"| grad mode, is_recomputing(), autocast as before after every fault | {ok(not s['state_problems'])} |",
        f"| faults after which PyTorch's queued autograd tasks held pool slots until the next backward | "
        f"{s['faults_held_until_next_backward']} |",
        "",
        "## Over time",
        "",
        "| step | batch x seq | pool reserved | peak in use (step) | chunks | RSS |",
        "|---|---|---|---|---|---|",
    ]
    rss = dict((st, b) for st, b in result["rss"])
    marks = sorted({st for st, _ in result["rss"]})
    stride = max(1, len(marks) // 20)
    for st in marks[::stride] + ([marks[-1]] if marks[::stride][-1:] != marks[-1:] else []):
        r = result["steps"][st]
        lines.append(f"| {st} | {r['batch']} x {r['seq']} | {_kib(r['reserved_bytes'])} | "
                     f"{_kib(r['peak_in_use_bytes'])} | {r['chunks']} | {_mib(rss.get(st))} |")
    if not passed(result):
        lines += ["", "## Problems", ""]
        lines += [f"- {m}" for m in (result["mismatches"] + result["leaks"] + result["problems"])[:50]]
        lines += [f"- final parameter differs: {m}" for m in result["final_parameters_differ"][:50]]
    cache = cfg.get("onednn_primitive_cache_capacity")
    lines += ["", "RSS: resident set size from /proc/self/statm (Python, torch, the models and the pool's chunks, "
              "which come from PyTorch's CPU allocator). ONEDNN_PRIMITIVE_CACHE_CAPACITY was "
              f"{'unset (oneDNN default, 1024)' if cache is None else cache} in this run: oneDNN keeps "
              "JIT-compiled kernels for each shape it meets, which with shapes varying every step grows RSS for "
              "the whole run, with or without ckpt_ext; the soak sets the capacity to 0 unless the variable is "
              "set. With a few shapes RSS is flat after the warm-up whatever the cache (tests/test_soak.py).",
              "",
              "Faults: after an exception in backward, PyTorch's autograd engine keeps the tasks it had queued "
              "(and the part of the graph they reference, pool slots included) until the next backward on the "
              "thread; the pool is checked after a trivial backward that discards them."]
    return "\n".join(lines) + "\n"


def write_json(result: dict, path: str):
    """One line per key, the per-step records as columns: the full series at a tenth of the size."""
    steps = result["steps"]
    if isinstance(steps, list):
        result = dict(result, steps={k: [r[k] for r in steps] for k in (steps[0] if steps else {})},
                      step_seconds=[round(t, 5) for t in result["step_seconds"]])
    with open(path, "w") as f:
        f.write("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}"
                                    for k, v in result.items()) + "\n}\n")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--max-batch", type=int, default=6)
    parser.add_argument("--max-seq", type=int, default=48)
    parser.add_argument("--shapes", default="random", help="'random' (batch 1..max-batch x seq 2..max-seq) or "
                        "a list of batch x seq pairs, e.g. 1x8,3x17,6x48")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=None, help="steps before RSS growth is measured "
                        "(default: a tenth of --steps)")
    parser.add_argument("--rss-every", type=int, default=25)
    parser.add_argument("--fault-every", type=int, default=50, help="0: no faults")
    parser.add_argument("--chunk-kib", type=int, default=64, help="pool chunk size")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the models are tiny, "
                        "and on a shared machine more threads mostly wait for each other)")
    add_output_args(parser)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    models = tuple(m for m in args.models.split(",") if m)
    shape_set = None
    if args.shapes != "random":
        try:
            shape_set = [tuple(int(v) for v in pair.split("x")) for pair in args.shapes.split(",")]
        except ValueError:
            parser.error(f"--shapes: expected 'random' or pairs such as 1x8,3x17, got {args.shapes!r}")
    env = env_info("cpu")
    result = run(steps=args.steps, models=models, max_batch=args.max_batch, max_seq=args.max_seq, seed=args.seed,
                 shape_set=shape_set, warmup=args.warmup, rss_every=args.rss_every, fault_every=args.fault_every,
                 chunk_kib=args.chunk_kib, threads=args.threads, progress=not args.no_progress)
    result["env"] = finish_env(env)
    result["load_average"] = env["load_average_end"]
    command = "python benchmarks/soak.py" + ("" if argv is None and len(sys.argv) == 1 else
                                              " " + " ".join(sys.argv[1:] if argv is None else argv))
    out = output_dir(args, result["env"])
    os.makedirs(out, exist_ok=True)
    md = to_markdown(result, command)
    write_json(result, os.path.join(out, "soak.json"))
    with open(os.path.join(out, "soak.md"), "w") as f:
        f.write(md)
    print(md)
    if not passed(result):
        print("soak: FAILED (see Problems above)", file=sys.stderr)
    return result


if __name__ == "__main__":
    sys.exit(0 if passed(main()) else 1)
