"""Every fused op (torch.ops.ckpt_ext, see ckpt_ext/ops.py) against its torch eager equivalent.

Per op, forward and backward: median time per call over interleaved rounds (ours and eager alternate),
with 20th/80th percentiles, and effective bandwidth = bytes the op must move (each input read once,
each output written once; per-row statistics and vectors of length hidden ignored) / time. Forwards run
as in training, both sides on inputs that require grad: eager's autograd keeps what its backward needs
(layer_norm's input x + r, mean and rstd; dropout's mask; gelu's input), as ours returns or saves what
its backward needs (add_layer_norm's sum, mean, rstd) -- without grad, eager frees x + r at once while
ours hands it back, an unequal amount of work (--no-grad-forward measures that way all the same). The
eager backward is autograd through the eager forward (retain_graph), what a model without the fused op
runs; the LayerNorm's weight and bias both require grad there, as ours returns both gradients. Our
bias_dropout_add_layer_norm_backward is handed the keep bits its forward returned, as the op's autograd
does (on CPU: the mask, one bit per element, read instead of regenerated; on CUDA there are none).
The device's copy bandwidth is measured in the same run (y.copy_(x), read + write) and every row says what
fraction of it the op reaches (`of copy`): the ceiling a memory-bound kernel is judged against.

    python benchmarks/bench_ops.py                       # best device: CUDA bf16 rows 16384, else CPU fp32 + bf16 rows 2048
    python benchmarks/bench_ops.py --hidden 1024,4096,8192 --dtype bfloat16,float16
"""
import argparse
import sys
from typing import Callable, List

import torch
import torch.nn.functional as F

from ckpt_ext import ops
from common import Progress, Timer, add_output_args, env_info, env_line, finish_env, noise_flags, output_dir, quantiles, write_results

P, EPS, SEED = 0.1, 1e-5, 1234


def _rms_norm(x, w, eps):
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _grad(fn, *inputs):
    """The eager backward: autograd through fn's graph, built once, replayed with retain_graph."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    g = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, leaves, g, retain_graph=True)


def _and_bf16(out):
    """A float32 result and its bfloat16 copy (what autocast's cast of a GEMM input made)."""
    return out, out.to(torch.bfloat16)


def _fwd(fn, *inputs, grad: bool = True):
    """A forward as in training: fn on copies of inputs that require grad (None, ints: passed as they are)."""
    if grad:
        inputs = [t.detach().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                  for t in inputs]
    return lambda: fn(*inputs)


# The autocast joins (docs/autocast.md): a bfloat16/float16 GEMM output x read beside autocast's float32 stream,
# against what the layers did before (x cast to float32, then the float32 op; the backward's float32 grad_x cast back).
MIXED = ("autocast_bias_dropout_add_layer_norm", "autocast_bias_dropout_add_layer_norm_backward",
         "autocast_bias_dropout_add")


def _autocast_cases(x, rows: int, hidden: int, device, fwd) -> List[tuple]:
    """(op, ours, before, bytes moved) of the mixed-dtype ops, for a 16-bit x (none for float32/float64)."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return []
    f32 = {"device": device, "dtype": torch.float32}
    r, g, w, b = torch.randn(rows, hidden, **f32), torch.randn(rows, hidden, **f32), torch.randn(hidden, **f32), \
        torch.randn(hidden, **f32)
    _, pre, mean, rstd, bits = ops.bias_dropout_add_layer_norm(x.float(), b, r, w, b, P, EPS, SEED, 0)
    bits = bits if bits.numel() else None
    n, e = x.numel(), x.element_size()

    def norm(t, u, v, ww, bb):
        return ops.bias_dropout_add_layer_norm(t, u, v, ww, bb, P, EPS, SEED, 0)

    def backward_before():
        return ops.bias_dropout_add_layer_norm_backward(g, None, pre, w, mean, rstd, P, SEED, 0, bits)[0].to(x.dtype)

    return [
        # reads x (16-bit) and the residual, writes out and pre_norm (float32)
        ("autocast_bias_dropout_add_layer_norm", fwd(norm, x, b, r, w, b),
         fwd(lambda t, *rest: norm(t.float(), *rest), x, b, r, w, b), n * (e + 12)),
        # reads grad_out and pre_norm (float32), writes grad_residual (float32) and grad_x (16-bit)
        ("autocast_bias_dropout_add_layer_norm_backward",
         lambda: ops.bias_dropout_add_layer_norm_backward(g, None, pre, w, mean, rstd, P, SEED, 0, bits,
                                                         x_dtype=x.dtype),
         backward_before, n * (12 + e)),
        # reads x (16-bit) and the residual, writes the float32 result
        ("autocast_bias_dropout_add", fwd(lambda t, u, v: ops.bias_dropout_add(t, u, v, P, SEED, 0), x, b, r),
         fwd(lambda t, u, v: ops.bias_dropout_add(t.float(), u, v, P, SEED, 0), x, b, r), n * (e + 8)),
    ]


def _both(a: Callable, b: Callable) -> Callable:
    return lambda: (a(), b())


def cases(rows: int, hidden: int, dtype, device, grad_forward: bool = True) -> List[tuple]:
    """(op, ours, eager, bytes moved)."""
    fwd = lambda fn, *inputs: _fwd(fn, *inputs, grad=grad_forward)  # noqa: E731
    kw = {"device": device, "dtype": dtype}
    inter = 4 * hidden
    x, r, g = (torch.randn(rows, hidden, **kw) for _ in range(3))
    w, b = torch.randn(hidden, **kw), torch.randn(hidden, **kw)
    xi, gi, ui = (torch.randn(rows, inter, **kw) for _ in range(3))
    bi = torch.randn(inter, **kw)
    e, n, ni = x.element_size(), x.numel(), xi.numel()
    heads, head_dim = max(1, hidden // 128), min(128, hidden)
    seq = max(1, rows // 4)
    xq = torch.randn(4, heads, seq, head_dim, **kw)
    cos, sin = torch.randn(1, seq, head_dim, **kw), torch.randn(1, seq, head_dim, **kw)
    nq = xq.numel()
    mask = ops.dropout_mask(n, P, SEED, 0, device).view(rows, hidden)
    _, pre, mean, rstd, keep_bits = ops.bias_dropout_add_layer_norm(x, b, r, w, b, P, EPS, SEED, 0)
    _, s_ln, m_ln, r_ln = ops.add_layer_norm(x, r, w, b, EPS)
    _, s_rms, r_rms = ops.add_rms_norm(x, r, w, EPS)
    r32, w32, b32 = r.float(), w.float(), b.float()
    return _autocast_cases(x, rows, hidden, device, fwd) + [
        ("bias_gelu", fwd(ops.bias_gelu, xi, bi), fwd(lambda t, u: F.gelu(t + u), xi, bi), 2 * ni * e),
        ("bias_gelu_backward", lambda: ops.bias_gelu_backward(gi, xi, bi), _grad(lambda t: F.gelu(t + bi), xi),
         3 * ni * e),
        ("bias_dropout_add", fwd(lambda t, u, v: ops.bias_dropout_add(t, u, v, P, SEED, 0), x, b, r),
         fwd(lambda t, u, v: F.dropout(t + u, P) + v, x, b, r), 3 * n * e),
        ("dropout", fwd(lambda t: ops.dropout(t, P, SEED, 0), g), fwd(lambda t: t * mask / (1 - P), g), 2 * n * e),
        ("dropout_mask", lambda: ops.dropout_mask(n, P, SEED, 0, device),
         lambda: torch.rand(n, device=device) >= P, n),
        ("bias_dropout_add_layer_norm",
         fwd(lambda t, u, v, ww, bb: ops.bias_dropout_add_layer_norm(t, u, v, ww, bb, P, EPS, SEED, 0), x, b, r, w, b),
         fwd(lambda t, u, v, ww, bb: F.layer_norm(F.dropout(t + u, P) + v, (hidden,), ww, bb, EPS), x, b, r, w, b),
         4 * n * e),
        ("bias_dropout_add_layer_norm_backward",
         lambda: ops.bias_dropout_add_layer_norm_backward(g, None, pre, w, mean, rstd, P, SEED, 0, keep_bits),
         _grad(lambda t, u, v, lb: F.layer_norm(F.dropout(t + b, P) + u, (hidden,), v, lb, EPS), x, r, w, b),
         4 * n * e),
        # BERT's h1 under autocast (docs/autocast.md): out in float32 and bfloat16, beside a float32 stream; reads x
        # and the residual, writes out, pre_norm (float32) and out2 (bfloat16)
        ("bias_dropout_add_layer_norm_dual",
         fwd(lambda t, u, v, ww, bb: ops.bias_dropout_add_layer_norm_dual(t, u, v, ww, bb, P, EPS, SEED, 0,
                                                                          torch.bfloat16), x, b32, r32, w32, b32),
         fwd(lambda t, u, v, ww, bb: _and_bf16(F.layer_norm(F.dropout(t.float() + u, P) + v, (hidden,), ww, bb, EPS)),
             x, b32, r32, w32, b32), n * (e + 14)),
        ("add_layer_norm", fwd(lambda t, u, ww, bb: ops.add_layer_norm(t, u, ww, bb, EPS), x, r, w, b),
         fwd(lambda t, u, ww, bb: F.layer_norm(t + u, (hidden,), ww, bb, EPS), x, r, w, b), 4 * n * e),
        ("add_layer_norm_backward", lambda: ops.add_layer_norm_backward(g, None, s_ln, w, m_ln, r_ln),
         _grad(lambda t, v, lb: F.layer_norm(t, (hidden,), v, lb, EPS), s_ln, w, b), 3 * n * e),
        ("add_rms_norm", fwd(lambda t, u, ww: ops.add_rms_norm(t, u, ww, EPS), x, r, w),
         fwd(lambda t, u, ww: _rms_norm(t + u, ww, EPS), x, r, w), 4 * n * e),
        ("add_rms_norm_backward", lambda: ops.add_rms_norm_backward(g, None, s_rms, w, r_rms),
         _grad(lambda t, v: _rms_norm(t, v, EPS), s_rms, w), 3 * n * e),
        ("swiglu", fwd(ops.swiglu, xi, ui), fwd(lambda t, u: F.silu(t) * u, xi, ui), 3 * ni * e),
        ("swiglu_backward", lambda: ops.swiglu_backward(gi, xi, ui), _grad(lambda t, u: F.silu(t) * u, xi, ui),
         5 * ni * e),
        ("geglu", fwd(ops.geglu, xi, ui), fwd(lambda t, u: F.gelu(t, approximate="tanh") * u, xi, ui), 3 * ni * e),
        ("geglu_backward", lambda: ops.geglu_backward(gi, xi, ui),
         _grad(lambda t, u: F.gelu(t, approximate="tanh") * u, xi, ui), 5 * ni * e),
        # issue 33: the backwards that also write the forward's output, in place -- timed on fresh copies of their
        # inputs (the copies' passes included: an upper bound); eager: autograd's backward and the forward
        ("swiglu_backward_act_", lambda: ops.swiglu_backward_act_(gi.clone(), xi.clone(), ui.clone()),
         _both(_grad(lambda t, u: F.silu(t) * u, xi, ui), fwd(lambda t, u: F.silu(t) * u, xi, ui)), 6 * ni * e),
        ("geglu_backward_act_", lambda: ops.geglu_backward_act_(gi.clone(), xi.clone(), ui.clone()),
         _both(_grad(lambda t, u: F.gelu(t, approximate="tanh") * u, xi, ui),
               fwd(lambda t, u: F.gelu(t, approximate="tanh") * u, xi, ui)), 6 * ni * e),
        ("bias_gelu_backward_act_", lambda: ops.bias_gelu_backward_act_(gi.clone(), xi.clone(), bi),
         _both(_grad(lambda t: F.gelu(t + bi), xi), fwd(lambda t, u: F.gelu(t + u), xi, bi)), 4 * ni * e),
        ("rotary", fwd(lambda t: ops.rotary(t, cos, sin), xq), fwd(lambda t: t * cos + _rotate_half(t) * sin, xq),
         2 * nq * e),
        ("rotary_backward", lambda: ops.rotary_backward(xq, cos, sin),
         _grad(lambda t: t * cos + _rotate_half(t) * sin, xq), 2 * nq * e),
    ]


def time_pair(ours: Callable, eager: Callable, device, rounds: int, inner: int):
    """Per-call times of ours and eager, alternating every round (a load change hits both alike)."""
    timer = Timer(device)
    loop = lambda fn: (lambda: [fn() for _ in range(inner)])  # noqa: E731
    t = {"ours": [], "eager": []}
    for r in range(rounds + 1):  # round 0 warms up
        for k, fn in (("ours", ours), ("eager", eager)) if r % 2 else (("eager", eager), ("ours", ours)):
            elapsed = timer(loop(fn)) / inner
            if r:
                t[k].append(elapsed)
    return quantiles(t["ours"]), quantiles(t["eager"])


def copy_bandwidth(rows: int, hiddens: List[int], dtype, device, rounds: int, inner: int) -> dict:
    """The device's copy bandwidth in this run, the ceiling the ops' GB/s is read against: y.copy_(x) of the
    largest tensor the ops touch (rows x 4 x the widest hidden), bytes = read + write."""
    x = torch.randn(rows, 4 * max(hiddens), device=device, dtype=dtype)
    y = torch.empty_like(x)
    stats, _ = time_pair(lambda: y.copy_(x), lambda: y.copy_(x), device, rounds, inner)
    nbytes = 2 * x.numel() * x.element_size()
    return {"dtype": str(dtype).replace("torch.", ""), "elements": x.numel(), "bytes": nbytes, "s": stats,
            "gbps": nbytes / stats["median"] / 1e9}


def run(device, dtypes, rows: int, hiddens: List[int], rounds: int, inner: int, only=None,
        grad_forward: bool = True, progress: Progress = None) -> List[dict]:
    out = []
    for dtype, hidden in ((d, h) for d in dtypes for h in hiddens):
        for name, ours, eager, nbytes in cases(rows, hidden, dtype, device, grad_forward):
            if only and name not in only:
                continue
            if progress:
                progress.plan(1)
                progress.describe(f"{name} {str(dtype).replace('torch.', '')}")
            row = {"op": name, "rows": rows, "hidden": hidden, "dtype": str(dtype).replace("torch.", ""),
                   "bytes": nbytes, "status": "ok", "ours_s": None, "eager_s": None, "flags": []}
            try:
                row["ours_s"], row["eager_s"] = time_pair(ours, eager, device, rounds, inner)
            except Exception as e:  # an op without a kernel for this dtype/device: reported, not fatal
                row["status"] = f"error: {type(e).__name__}: {' '.join(str(e).split())[:120]}"
            if row["ours_s"]:
                row["ours_gbps"] = nbytes / row["ours_s"]["median"] / 1e9
                row["eager_gbps"] = nbytes / row["eager_s"]["median"] / 1e9
                row["speedup"] = row["eager_s"]["median"] / row["ours_s"]["median"]
                row["flags"] = noise_flags(row["ours_s"]) + [f"eager {f}" for f in noise_flags(row["eager_s"])]
            out.append(row)
            if progress:
                progress()
    return out


def to_markdown(info: dict, rows: List[dict], cfg: dict) -> str:
    lines = [f"# ckpt_ext fused ops against torch eager: {info['device_name']} ({info['device']})", "",
             env_line(info), "", f"{cfg['rounds']} rounds of {cfg['inner']} calls each, ours and eager alternating.",
             "", "| op | rows x hidden | dtype | status | ours µs (p20-p80) | ours GB/s | of copy | eager µs | "
             "eager GB/s | eager / ours | flags |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["ours_s"]:
            lines.append(f"| {r['op']} | {r['rows']}x{r['hidden']} | {r['dtype']} | {r['status']} | - | - | - | - | - | - "
                         "| |")
            continue
        o, e = r["ours_s"], r["eager_s"]
        of_copy = f"{r['of_copy']:.0%}" if r.get("of_copy") else "-"
        lines.append(f"| {r['op']} | {r['rows']}x{r['hidden']} | {r['dtype']} | ok | {o['median'] * 1e6:.1f} "
                     f"({o['p20'] * 1e6:.1f}-{o['p80'] * 1e6:.1f}) | {r['ours_gbps']:.1f} | {of_copy} | "
                     f"{e['median'] * 1e6:.1f} | {r['eager_gbps']:.1f} | {r['speedup']:.2f}x | {'; '.join(r['flags'])} |")
    for c in cfg.get("copy", []):
        lines.append(f"\nCopy bandwidth in this run ({c['dtype']}, y.copy_(x) of {c['elements']} elements, read + "
                     f"write): {c['gbps']:.1f} GB/s; `of copy` is the op's GB/s over it.")
    lines += ["", "- GB/s: bytes the op must move (inputs read once, outputs written once; vectors of length hidden "
              "and per-row statistics ignored) / median time. GELU, SwiGLU and GeGLU run on the intermediate width "
              "(4 x hidden); rotary on [4, hidden/128 heads, rows/4, 128].",
              "- forwards: " + ("both on inputs that require grad, as in training (eager's autograd keeps what its "
                                "backward needs, ours returns it)" if cfg.get("grad_forward", True) else
                                "--no-grad-forward: no autograd (eager frees its intermediates at once)") + ".",
              "- eager backward: autograd through the eager forward's graph (retain_graph). "
              "bias_dropout_add_layer_norm_backward (ours) reads the keep bits its forward returned, as the op's "
              "autograd does (CPU: the dropout mask, one bit per element; CUDA: none, the mask is regenerated)."]
    if cfg.get("warm_heap"):
        lines.append("- CPU allocator: glibc's heap kept warm for both sides (mallopt: no trimming, mmap only from "
                     "32 MiB), as in a training loop's steady state; with glibc's defaults a benchmark loop that frees "
                     "every output returns the heap's top to the OS and each call faults fresh pages in "
                     "(`--fresh-pages` measures that way).")
    return "\n".join(lines) + "\n"


def _keep_heap_warm() -> bool:
    """glibc: no heap trimming, mmap only for blocks of 32 MiB and more (the most mallopt allows), so that a
    loop freeing its outputs every call does not fault fresh pages in on the next (True where set)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_trim_threshold, 1 << 30)) and bool(libc.mallopt(m_mmap_threshold, 32 << 20))
    except (OSError, AttributeError):  # not glibc
        return False


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_ops.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None,
                   help="comma list of float32, bfloat16, float16 (default bfloat16 on CUDA, float32,bfloat16 on CPU)")
    p.add_argument("--rows", type=int, default=None, help="default 16384 on CUDA (b32 x s512), 2048 on CPU")
    p.add_argument("--hidden", default=None, help="comma list (default CUDA 1024,4096,8192; CPU 1024)")
    p.add_argument("--rounds", type=int, default=None, help="default CUDA 20, CPU 7")
    p.add_argument("--inner", type=int, default=None, help="calls per timing (default CUDA 20, CPU 3)")
    p.add_argument("--ops", default=None, help="comma list of op names (default: every op)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (CPU; default torch's). 1 keeps OpenMP's barriers out of the "
                        "comparison on a machine shared with other work")
    p.add_argument("--no-grad-forward", action="store_true",
                   help="forwards on inputs without grad (eager then frees what its backward would keep)")
    p.add_argument("--fresh-pages", action="store_true",
                   help="CPU: glibc's allocator defaults, under which a call's fresh outputs often fault their "
                        "pages in (the default keeps the heap warm, as a training loop's steady state does)")
    p.add_argument("--no-progress", action="store_true")
    add_output_args(p)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    warm_heap = device.type == "cpu" and not args.fresh_pages and _keep_heap_warm()
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = device.type == "cuda"
    names = (args.dtype or ("bfloat16" if cuda else "float32,bfloat16")).split(",")
    if not names or any(n not in ("float32", "bfloat16", "float16") for n in names):
        p.error("--dtype: a comma list of float32, bfloat16, float16")
    dtypes = [getattr(torch, n) for n in names]
    rows = args.rows or (16384 if cuda else 2048)
    hiddens = [int(h) for h in (args.hidden or ("1024,4096,8192" if cuda else "1024")).split(",")]
    rounds, inner = args.rounds or (20 if cuda else 7), args.inner or (20 if cuda else 3)
    only = set(args.ops.split(",")) if args.ops else None
    info = env_info(device)
    print(f"fused ops on {device}: rows {rows}, hidden {hiddens}, {', '.join(names)} ...", file=sys.stderr)
    progress = Progress(enabled=not args.no_progress)
    try:
        result_rows = run(device, dtypes, rows, hiddens, rounds, inner, only, not args.no_grad_forward, progress)
    finally:
        progress.close()
    copy = [copy_bandwidth(rows, hiddens, d, device, rounds, inner) for d in dtypes]
    for r in result_rows:
        ceiling = next(c["gbps"] for c in copy if c["dtype"] == r["dtype"])
        r["of_copy"] = r["ours_gbps"] / ceiling if r.get("ours_gbps") else None
    covered = {r["op"] for r in result_rows}
    cfg = {"copy": copy, "not_benchmarked": [] if only else sorted(set(ops.__all__) - covered), "rows": rows, "hidden": hiddens, "dtype": ",".join(names), "rounds": rounds, "inner": inner,
           "grad_forward": not args.no_grad_forward, "warm_heap": warm_heap,
           "argv": list(sys.argv[1:] if argv is None else argv)}
    md = to_markdown(finish_env(info), result_rows, cfg)
    print(md)
    result = {"env": info, "config": cfg, "rows": result_rows}
    result["files"] = write_results(output_dir(args, info), "ops", result, md)
    print("wrote " + ", ".join(result["files"]), file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
