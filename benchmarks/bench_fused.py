"""Fused layers benchmark: a Hugging Face BERT encoder, fused (ckpt_ext.fuse) or not, checkpointed or not.

Variants, all on the same weights, in one process:
  * HF eager                         -- transformers' BertLayer, no checkpointing
  * HF + torch.utils.checkpoint      -- Hugging Face's activation checkpointing, non-reentrant
  * HF + ckpt_ext.enable_checkpointing (the engine alone, no fusion)
  * fused                            -- ckpt_ext.fuse, no checkpointing (C++ layers, C++ autograd ops)
  * fused + ckpt_ext.enable_checkpointing(every=1) -- C++ SegmentFunction per layer
  * fused + ckpt_ext.enable_checkpointing(every=2)

A step is zero_grad + forward + backward of mean(last_hidden_state^2), in training mode with the
config's dropout. Timings are medians over interleaved rounds (each round runs every variant once, in
a rotated order), with 20th/80th percentiles and the minimum. On a shared machine the load drifts
between rounds; the per-round ratio to HF + torch.utils.checkpoint (both measured within the same
round) is robust to that drift, so its median is reported too, with the load average before and after.
Results: a markdown table on stdout and benchmarks/results/<device>/fused.{md,json}.

    python benchmarks/bench_fused.py                      # CPU defaults: 6 layers, hidden 256, seq 256, batch 4
"""
import argparse
import copy
import json
import os
import sys
import warnings

import torch

import ckpt_ext

from ckpt_ext.bench import Timer, env_info, held_bytes, mib, ms, quantiles  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HF_EAGER = "HF eager"
HF_TORCH_CKPT = "HF + torch.utils.checkpoint (non-reentrant)"
HF_CKPT_EXT = "HF + ckpt_ext.enable_checkpointing"
FUSED = "fused"
FUSED_CKPT = "fused + ckpt_ext.enable_checkpointing"
FUSED_CKPT2 = "fused + ckpt_ext.enable_checkpointing(every=2)"
VARIANTS = [HF_EAGER, HF_TORCH_CKPT, HF_CKPT_EXT, FUSED, FUSED_CKPT, FUSED_CKPT2]


def load_average():
    try:
        return os.getloadavg()
    except OSError:
        return None


def hf_checkpointing(model, enable: bool):
    if enable:
        kw = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    elif hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def bench(device, layers, hidden, heads, seq, batch, dropout, rounds, warmup):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=4 * hidden, max_position_embeddings=max(512, seq), vocab_size=1000,
                     hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    hf = BertModel(cfg, add_pooling_layer=False).to(device).train()
    fused = ckpt_ext.fuse(copy.deepcopy(hf)).train()
    ids = torch.randint(0, 1000, (batch, seq), device=device)

    def configure(variant):
        for m in (hf, fused):
            ckpt_ext.disable_checkpointing(m)
        hf_checkpointing(hf, variant == HF_TORCH_CKPT)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers' is_gradient_checkpointing rename
            if variant == HF_CKPT_EXT:
                ckpt_ext.enable_checkpointing(hf)
            elif variant == FUSED_CKPT:
                ckpt_ext.enable_checkpointing(fused, every=1)
            elif variant == FUSED_CKPT2:
                ckpt_ext.enable_checkpointing(fused, every=2)

    def model_of(variant):
        return fused if variant.startswith("fused") else hf

    def step_of(variant):
        model = model_of(variant)

        def step():
            model.zero_grad(set_to_none=True)
            model(input_ids=ids).last_hidden_state.pow(2).mean().backward()

        return step

    steps = {v: step_of(v) for v in VARIANTS}
    timer = Timer(device)
    for _ in range(warmup):
        for v in VARIANTS:
            configure(v)
            steps[v]()
    load_before = load_average()
    times = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]  # no variant always runs first
        for v in order:
            configure(v)
            times[v].append(timer(steps[v]))
    load_after = load_average()
    ref = times[HF_TORCH_CKPT]
    rows = []
    for v in VARIANTS:
        configure(v)
        model = model_of(v)
        model.zero_grad(set_to_none=True)
        mem = held_bytes(lambda: model(input_ids=ids).last_hidden_state.pow(2).mean(), list(model.parameters()),
                         device)
        ratios = [t / r for t, r in zip(times[v], ref)]
        rows.append({"variant": v, "step_s": quantiles(times[v]), "min_s": min(times[v]),
                     "ratio_vs_torch_ckpt": quantiles(ratios), "times_s": times[v], **mem})
    configure(HF_EAGER)
    return rows, {"before": load_before, "after": load_after}


def to_markdown(info, rows, cfg, load):
    cuda = info["device"].startswith("cuda")
    ref = next(r for r in rows if r["variant"] == HF_TORCH_CKPT)["step_s"]["median"]
    eager = next(r for r in rows if r["variant"] == HF_EAGER)["step_s"]["median"]
    fmt_load = lambda la: "n/a" if la is None else ", ".join(f"{x:.2f}" for x in la)  # noqa: E731
    lines = [f"# ckpt_ext fused layers — {info['device_name']} ({info['device']})", "",
             f"{info['date']}, torch {info['torch']}, CUDA {info['cuda']}, commit {info['git_commit']}, "
             f"{info['threads']} threads; load average (1, 5, 15 min) before {fmt_load(load['before'])}, "
             f"after {fmt_load(load['after'])}", "",
             f"## BERT encoder: {cfg['layers']} layers, hidden {cfg['hidden']}, {cfg['heads']} heads, seq {cfg['seq']}, "
             f"batch {cfg['batch']}, dropout {cfg['dropout']}, float32, {cfg['rounds']} interleaved rounds", "",
             "| variant | step ms, median (p20-p80) | min ms | vs HF + torch.utils.checkpoint: per-round ratio, "
             "median (p20-p80) | ratio of medians | vs HF eager (medians) | held fwd→bwd MiB |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        held = mib(r["held_bytes"]) if cuda else f"{mib(r['held_bytes'])} ({mib(r['saved_bytes'])} + {mib(r['pool_bytes'])} pool)"
        q = r["ratio_vs_torch_ckpt"]
        lines.append(f"| {r['variant']} | {ms(r['step_s'])} | {r['min_s'] * 1e3:.2f} | {q['median']:.2f}x "
                     f"({q['p20']:.2f}-{q['p80']:.2f}) | {r['step_s']['median'] / ref:.2f}x | "
                     f"{r['step_s']['median'] / eager:.2f}x | {held} |")
    lines += ["", "held fwd→bwd: bytes kept alive between forward and backward (parameters excluded; CPU: tensors "
              "saved for backward + ckpt_ext pool slots; CUDA: allocated memory + pool slots)."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout (BERT's default 0.1)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None, help="directory for fused.md/json (default benchmarks/results/<device>)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cfg = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "seq", "batch", "dropout", "rounds")}
    print(f"fused BERT benchmark on {device}: {cfg} ...", file=sys.stderr)
    rows, load = bench(device, args.layers, args.hidden, args.heads, args.seq, args.batch, args.dropout, args.rounds,
                       args.warmup)
    info = env_info(device)
    md = to_markdown(info, rows, cfg, load)
    print(md)
    dev_name = "cuda-" + info["device_name"].replace(" ", "_") if device.type == "cuda" else "cpu"
    out = args.out or os.path.join(ROOT, "benchmarks", "results", dev_name)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "fused.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out, "fused.json"), "w") as f:
        json.dump({"env": info, "config": cfg, "load_average": load, "rows": rows}, f, indent=2)
    print(f"wrote {out}/fused.md and fused.json", file=sys.stderr)


if __name__ == "__main__":
    main()
