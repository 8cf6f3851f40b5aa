"""The LM head and its loss: Hugging Face's (F.linear + ForCausalLMLoss) against ckpt_ext's chunked
linear cross-entropy (gradients in forward, the default; and recomputed in backward), and Liger-Kernel's
fused linear cross-entropy on CUDA where it is installed.

Per vocabulary (32000 / 128256 / 256000 by default): median step time (forward + backward of head and loss,
interleaved rounds, p20-p80) and peak memory above what existed before the step (CUDA: the allocator's
peak; CPU: the peak of the bytes of live tensors created during the step, counted by a dispatch mode that
also looks inside ckpt_ext's operators). Same process, same inputs, device named in the result.

    python benchmarks/bench_head.py    # CUDA when there is one: Llama-3 width, 8192 tokens, bf16 autocast
    python benchmarks/bench_head.py --device cpu --tokens 1024 --hidden 512 --rounds 5
"""
import argparse
import os
import sys
import weakref
from typing import Callable, Dict, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import ckpt_ext  # noqa: E402
from ckpt_ext import head as head_mod  # noqa: E402


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensors created while active (CPU or any device): each new storage is counted from
    the op that made it until the last Python tensor viewing it is gone. ckpt_ext's linear cross-entropy
    operators run their Python implementation under the mode, so their chunks are counted too."""

    _IMPLS = None

    def __init__(self):
        super().__init__()
        self.live: Dict[int, list] = {}
        self.seen = set()  # storages that existed before (inputs, parameters): their views are not new bytes
        self.current = self.peak = 0
        if LiveBytes._IMPLS is None:
            LiveBytes._IMPLS = {torch.ops.ckpt_ext.linear_cross_entropy.default: head_mod._lce_impl,
                                torch.ops.ckpt_ext.linear_cross_entropy_recompute.default: head_mod._lce_rc_impl,
                                torch.ops.ckpt_ext.linear_cross_entropy_backward.default: head_mod._lce_rc_bwd_impl}

    def _release(self, ptr):
        entry = self.live.get(ptr)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.current -= entry[0]
                del self.live[ptr]

    def _track(self, t):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        s = t.untyped_storage()
        if s.data_ptr() == 0:
            return
        ptr = s._cdata  # the storage itself (views share it); data pointers are reused by the allocator
        entry = self.live.get(ptr)
        if entry is None:
            if ptr in self.seen:  # a storage made before the mode (an input, a parameter) or its view
                return
            entry = self.live[ptr] = [s.nbytes(), 0]
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        weakref.finalize(t, self._release, ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for a in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor) and a.untyped_storage()._cdata not in self.live:
                self.seen.add(a.untyped_storage()._cdata)
        impl = self._IMPLS.get(func)
        if impl is not None:
            with self:  # the operator's own ops, counted too
                out = impl(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            self._track(t)
        return out



def hf_head_loss(hidden, weight, labels, num_items_in_batch=None):
    from transformers.loss.loss_utils import ForCausalLMLoss
    logits = torch.nn.functional.linear(hidden, weight)
    return ForCausalLMLoss(logits, labels, weight.shape[0], num_items_in_batch=num_items_in_batch)


def variants(device) -> Dict[str, Callable]:
    out = {
        "hf": hf_head_loss,
        "ckpt_ext": lambda h, w, lab: ckpt_ext.linear_cross_entropy(h, w, None, lab),
        "ckpt_ext-recompute": lambda h, w, lab: ckpt_ext.linear_cross_entropy(h, w, None, lab, recompute=True),
    }
    if device.type == "cuda":
        try:
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        except ImportError:
            pass
        else:
            def liger(h, w, lab):
                lab = torch.nn.functional.pad(lab, (0, 1), value=-100)[..., 1:]
                if torch.is_autocast_enabled():  # as HF's lm_head under autocast (and ckpt_ext): bf16 operands
                    dtype = torch.get_autocast_gpu_dtype()
                    h, w = h.to(dtype), w.to(dtype)
                out = liger_fused_linear_cross_entropy(h.reshape(-1, h.shape[-1]), w, lab.reshape(-1))
                return out[0] if isinstance(out, tuple) else out
            out["liger"] = liger
    return out


def run(args) -> dict:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    info = common.env_info(device)
    torch.manual_seed(0)
    amp = (torch.autocast(device.type, dtype=torch.bfloat16) if args.autocast
           else torch.autocast(device.type, enabled=False))
    results = []
    for vocab in args.vocab:
        w = (torch.randn(vocab, args.hidden, device=device) * args.hidden ** -0.5).requires_grad_()
        h = torch.randn(args.batch, args.tokens, args.hidden, device=device, requires_grad=True)
        lab = torch.randint(0, vocab, (args.batch, args.tokens), device=device)
        fns = variants(device)

        def step(fn):
            def go():
                h.grad = w.grad = None
                with amp:
                    loss = fn(h, w, lab)
                loss.backward()
            return go

        rows: Dict[str, dict] = {}
        for name, fn in fns.items():  # peak memory, one step each, before the timing
            h.grad = w.grad = None
            common.free_memory(device)
            try:
                if cuda:
                    torch.cuda.synchronize(device)
                    base = torch.cuda.memory_allocated(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    step(fn)()
                    torch.cuda.synchronize(device)
                    peak = torch.cuda.max_memory_allocated(device) - base
                else:
                    with LiveBytes() as lb:
                        step(fn)()
                    peak = lb.peak
                rows[name] = {"peak_bytes": peak}
            except Exception as e:  # noqa: BLE001 (an OOM of one variant is a result)
                rows[name] = {"error": common.short_error(e)}
        timed = {k: step(fns[k]) for k in fns if "error" not in rows[k]}
        stats, _ = common.interleaved(timed, device, rounds=args.rounds, warmup=1)
        for k, st in stats.items():
            rows[k]["step_s"] = st
        for k, r in rows.items():
            results.append(dict(vocab=vocab, variant=k, **r))
        del w, h, lab
    info = common.finish_env(info)
    lines = [common.env_line(info), "",
             f"tokens {args.batch} x {args.tokens}, hidden {args.hidden}, "
             f"{'bf16 autocast' if args.autocast else 'fp32'}; peak: "
             f"{'CUDA allocator above the step start' if cuda else 'live tensors created in the step (LiveBytes)'}",
             "", "| vocab | variant | step ms, median (p20-p80) | vs hf | peak MiB | vs hf |",
             "|---|---|---|---|---|---|"]
    for vocab in args.vocab:
        by = {r["variant"]: r for r in results if r["vocab"] == vocab}
        ref = by.get("hf", {})
        for k, r in by.items():
            if "error" in r:
                lines.append(f"| {vocab} | {k} | {r['error']} | | | |")
                continue
            t = r.get("step_s")
            ratio = f"{t['median'] / ref['step_s']['median']:.2f}x" if t and ref.get("step_s") else ""
            mratio = f"{r['peak_bytes'] / ref['peak_bytes']:.3f}x" if ref.get("peak_bytes") else ""
            lines.append(f"| {vocab} | {k} | {common.ms(t) if t else ''} | {ratio} | {common.mib(r['peak_bytes'])} "
                         f"| {mratio} |")
    return {"env": info, "args": vars(args), "results": results, "markdown": "\n".join(lines)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256, 256000])
    p.add_argument("--hidden", type=int, default=None, help="default 4096 on CUDA, 512 on CPU")
    p.add_argument("--tokens", type=int, default=None, help="per sequence; default 8192 on CUDA, 1024 on CPU")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=None, help="default 10 on CUDA, 3 on CPU")
    p.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast (default on CUDA; off on CPU)")
    common.add_output_args(p)
    args = p.parse_args(argv)
    on_cuda = args.device.startswith("cuda")
    args.hidden = args.hidden or (4096 if on_cuda else 512)
    args.tokens = args.tokens or (8192 if on_cuda else 1024)
    args.rounds = args.rounds or (10 if on_cuda else 3)
    args.autocast = on_cuda if args.autocast is None else args.autocast
    result = run(args)
    print(result["markdown"])
    if args.out or args.save_results:
        out = common.output_dir(args, result["env"])
        common.write_results(out, "bench_head", result, result["markdown"])
    return result


if __name__ == "__main__":
    main()
