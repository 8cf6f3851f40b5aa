"""The work model: what one training step costs on an H100/H200, predicted on a machine without a GPU.

One step (forward, loss = mean of the squared last hidden state, backward with every replay) of the models and
variants of `side_by_side.py` (the H200 table, ../shared/gpu/results/2026-11-27-h200/) runs on CPU under a
`TorchDispatchMode` (WorkMode) that sees every ATen op after autograd -- Hugging Face's, torch checkpoint's
replays, and the fused layers' own: the C++ layer code calls ATen and ckpt_ext::* through the dispatcher, and
the segment replay in backward runs in the autograd engine, which carries the mode along (ThreadLocalState).
The mode does not compute: each op runs on meta copies of its arguments (ATen's meta functions; ckpt_ext's
ops through their registered fake kernels, ckpt_ext/ops.py) and returns uninitialized CPU tensors of the
result's shape and strides (views, allocations and integer-only ops -- ids, positions -- run for real, so the
C++ code that needs storage, the boundary pool, works). So a BERT-large step costs seconds, not the hours
its 30 TFLOP would take on this CPU, and the fused kernels never run (they are counted, not executed).

Per op it counts
  * FLOPs: torch.utils.flop_counter's registered formulas (GEMMs, SDPA forward and backward; the CPU flash
    kernels that stand in for CUDA's are counted with the same sdpa formulas; a causal attention at half,
    since the CUDA kernels skip the masked half, which flop_counter does not);
  * bytes: every tensor argument read and every tensor result written (broadcast dims counted once; a
    tensor an op only writes -- copy_, fill_ -- not read); ckpt_ext's ops the same, from their inputs and
    outputs (their kernels re-read nothing at these widths: the norm kernels keep a row in registers);
  * kernel launches: one per op that moves data (none for views, allocations, detach), three for a flash
    attention backward (its preprocess, main and dq-convert kernels), two for the norm backwards (the
    rows, then the weight-gradient column sum, csrc/kernels/cuda/norms.cu), three when
    bias_dropout_add_layer_norm_backward also sums the dense bias's gradient (grad_bias=True), two for
    bias_gelu_backward with grad_bias (its pass, then the column sum of its partials).

Prediction per op = max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth) + launches x launch cost,
summed over the step. The achieved rates: bf16 GEMM FLOP/s, attention FLOP/s (forward, backward),
the bandwidth of ATen's memory-bound kernels, the launch cost -- FITTED once to the H200 table
(`--fit` refits and prints them; FIT below is that output) -- and the bandwidth of each ckpt_ext kernel
MEASURED on the same H200 (kernel_bandwidth.txt, CKPT_OP_GBPS below: the op's bytes at the measured time).

What differs from the GPU run, and how it is handled:
  * size: counts are exact affine functions of the batch (activations and FLOPs scale with it, weights do
    not) and of the layer count (identical layers). Each variant is traced at batch 2 and 3 (batch 1 drops
    a reduction) and at 1 and 2
    layers; per op (the traces align op by op) the counts are extrapolated to the table's batch, and the
    step's time to the table's layers from the 2- and 3-layer models (linear in L; 1 layer is special for
    keep="attention"). The batch traces check that they align.
  * attention: CPU SDPA with dropout takes its math path (scores materialized); CUDA runs flash with the
    dropout inside. The traces run with attention dropout 0 (CPU's flash kernel, the same op structure as
    CUDA's flash/cuDNN: one forward, one backward op) -- attention dropout changes no count on the GPU.
  * dropout: CPU's F.dropout is bernoulli_ + div_ + mul (three kernels); CUDA's is native_dropout (one).
    The traces patch F.dropout to native_dropout, as CUDA dispatches it.
  * the fused layers' CPU GEMM layout policy (transposed operand copies for CPUs without bf16 GEMMs) is off
    (`_C.cpu_gemm_layout("off")`), as on CUDA; the norm ops' CPU keep bits (a CPU-only output) are not
    produced (the fake kernels see meta tensors and give CUDA's empty one).
  * autocast runs as CPU autocast (bf16); its op lists differ from CUDA's for a few ops (none of them in these
    models' hot path: the layer norms take an fp32 sum either way).
  * host-side cost (Python, hooks, the dispatcher) is not modelled except through the launch cost, and
    for torch's selective checkpointing (torch-sac), whose Python dispatch mode handles every op of the
    forward and the replay on the host: python_mode_us per op it sees (fitted; only that row informs it).

The budget planner's plans at these rates (`--variants fused+budget=2.0`, BUDGET_VARIANTS): the planner's measuring
step runs traced, its probe timed by a PredictedClock (ckpt_ext.stack_plan.probe_clock: each layer's forward and
backward, SDPA and GEMM calls cost the predicted H200 seconds of the ops they ran; bytes measured as always); the
plan for the budget (a number: that many times the planner's need of the full checkpoint, every layer checkpointed
alone keeping only its input -- its predicted activation peak (docs/planner.md), the units of
budget=; a size: the budget itself) is made from those costs (StackPlanner.replan), and the planned step is traced
at the config's own layers and batch (no extrapolation: the plan depends on both) and predicted as the others. The
plan is printed (explain()), with the bytes the layer stack held from forward to backward in the traced step next to
the plan's prediction; `--peak CONFIG:fused+budget=2.0` gives its traced peak.

LoRA (`llama-lora`, `bert-large-lora`; docs/lora-work.md): the model wrapped by peft LoRA as suite.py --lora wraps it
(variants.add_lora, LoraSpec's defaults) before the variant's setup; predicted only (no H200 row: no error column, and
the calibration line stays over the measured rows).

Usage: python benchmarks/bench_work.py [--models bert-large-bf16,...] [--fit] [--per-op VARIANT] [--json PATH]
Prints per model and variant predicted ms, the H200's measured ms, the error; the last line is
`calibration: max |error| X% over N rows`.
"""
import argparse
import collections
import contextlib
import functools
import json
import math
import os
import pickle
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import flop_registry, sdpa_flop_count, sdpa_backward_flop_count

import ckpt_ext
from ckpt_ext import _C

aten = torch.ops.aten

# ---------------------------------------------------------------------------------------------- the H200 table
H200_SOURCE = "../shared/gpu/results/2026-11-27-h200 (side_by_side.py, median of interleaved rounds)"
# (model config, variant) -> median step ms on the NVIDIA H200, torch 2.11.0+cu130, project at bdb3e6e.
H200_MS = {
    "bert-large-bf16": {"none": 84.99, "hf-gc": 118.82, "ckpt_ext": 109.80, "fused": 79.27, "fused+ckpt": 107.03},
    "bert-large-autocast": {"none": 100.2, "hf-gc": 141.5, "ckpt_ext": 133.0, "fused": 93.9, "fused+ckpt": 127.2},
    "gpt2-bf16": {"none": 119.8, "hf-gc": 151.7, "ckpt_ext": 151.5, "fused": 83.0, "fused+ckpt": 105.5},
    "llama-bf16": {"none": 130.1, "hf-gc": 167.8, "torch-sac": 161.8, "ckpt_ext": 162.1, "ckpt_ext-keep": 158.2,
                   "fused": 94.6, "fused+ckpt": 124.8},
}


@dataclass(frozen=True)
class Config:
    name: str
    family: str
    layers: int
    batch: int
    mode: str  # bf16 | autocast | bf16-autocast+lora | autocast+lora (MODES)
    variants: Tuple[str, ...]
    attn_dropout: float  # the table's attention dropout (the traces run with 0; see the docstring)


BASE_VARIANTS = ("none", "hf-gc", "ckpt_ext", "fused", "fused+ckpt")
CONFIGS = {
    "bert-large-bf16": Config("bert-large-bf16", "bert", 24, 32, "bf16", BASE_VARIANTS, 0.1),
    "bert-large-autocast": Config("bert-large-autocast", "bert", 24, 32, "autocast", BASE_VARIANTS, 0.1),
    "gpt2-bf16": Config("gpt2-bf16", "gpt2", 24, 16, "bf16", BASE_VARIANTS, 0.1),
    "llama-bf16": Config("llama-bf16", "llama", 16, 4, "bf16",
                         ("none", "hf-gc", "torch-sac", "ckpt_ext", "ckpt_ext-keep", "fused", "fused+ckpt"), 0.0),
    # Predicted only (no H200 row): the decoders under autocast, float32 master weights (docs/autocast.md).
    "gpt2-autocast": Config("gpt2-autocast", "gpt2", 24, 16, "autocast", BASE_VARIANTS, 0.1),
    "llama-autocast": Config("llama-autocast", "llama", 16, 4, "autocast",
                             ("none", "hf-gc", "ckpt_ext", "fused", "fused+ckpt"), 0.0),
    # Predicted only (no H200 row): LoRA as most users train it (docs/lora-work.md) -- peft LoRA (variants.py's
    # LoraSpec: r=16, alpha 32, dropout 0.05, on every attention and MLP projection, LORA_TARGETS; float32 adapters,
    # peft's default) under Trainer(bf16=True)'s autocast bf16. Llama loaded in bfloat16 (its checkpoints' dtype);
    # BERT in float32 (its checkpoints' dtype: float32 master weights under autocast).
    "llama-lora": Config("llama-lora", "llama", 16, 4, "bf16-autocast+lora", BASE_VARIANTS, 0.0),
    "bert-large-lora": Config("bert-large-lora", "bert", 24, 32, "autocast+lora", BASE_VARIANTS, 0.1),
}
# A config's mode: the weights' dtype (bf16: the model cast to bfloat16), autocast bf16 on or off, peft LoRA or not.
MODES = ("bf16", "autocast", "bf16-autocast+lora", "autocast+lora")


def _autocast(mode: str) -> bool:
    return "autocast" in mode


def _bf16_weights(mode: str) -> bool:
    return mode.startswith("bf16")


def _lora(mode: str) -> bool:
    return mode.endswith("+lora")

# ------------------------------------------------------------------------------------------------- the rates
# Fitted once to H200_MS (`--fit`), the four tables together.
FIT = {"gemm_tflops": 679.566, "attn_fwd_tflops": 150.0, "attn_bwd_tflops": 438.154, "attn_dropout_cost": 1.278,
       "simple_gbps": 4141.882, "mem_gbps": 2137.997, "launch_us": 4.038, "python_mode_us": 17.981}
# Read them as fitted, not measured: GEMMs at 69% of the bf16 peak, the copy-like ATen kernels near the copy
# rate, the others (norms, dropout, GELU, reductions) at 2.1 TB/s (kernel_bandwidth's torch eager rows: 2.4),
# a launch 4.0 us (kernel gaps and tails). The attention forward is the least determined rate: its share of
# every row is small and moves with the backward's, so the fit leaves it at its lower bound.
# ckpt_ext's kernels, measured (kernel_bandwidth.txt, H200, bf16, 16384 rows; time / the bytes this model
# counts for the same call): bytes per second achieved. Ops without a row take the closest measured kernel.
_R, _H, _I = 16384, 1024, 4096
_KB = 2  # bf16
_ROW = _R * _H * _KB
_ROWI = _R * _I * _KB
_STAT = _R * 4  # a float row statistic
CKPT_OP_GBPS = {
    # op: (bytes this model counts for the measured call) / (measured us)
    # reads x, residual, bias, weight, ln bias; writes out, pre-norm sum, mean, rstd (CUDA: no keep bits)
    "bias_dropout_add_layer_norm": (2 * _ROW + 3 * _H * _KB + 2 * _ROW + 2 * _STAT) / 61.9e-6 / 1e9,
    # reads grad, pre-norm sum, weight, mean, rstd; writes the gradients of x and of the residual, weight, bias
    "bias_dropout_add_layer_norm_backward": (2 * _ROW + 2 * _STAT + _H * _KB + 2 * _ROW + 2 * _H * _KB) / 67.2e-6
    / 1e9,
    # unmeasured: BERT's h1 written twice (float32 and the GEMM's dtype), as the single-output kernel's rate
    "bias_dropout_add_layer_norm_dual": (2 * _ROW + 3 * _H * _KB + 2 * _ROW + 2 * _STAT) / 61.9e-6 / 1e9,
    "add_layer_norm": (2 * _ROW + 2 * _H * _KB + 2 * _ROW + 2 * _STAT) / 52.7e-6 / 1e9,
    "add_layer_norm_backward": (2 * _ROW + 2 * _STAT + _H * _KB + _ROW + 2 * _H * _KB) / 52.7e-6 / 1e9,
    "bias_gelu": (_ROWI + _I * _KB + _ROWI) / 136.6e-6 / 1e9,
    "bias_gelu_backward": (2 * _ROWI + _I * _KB + _ROWI) / 204.3e-6 / 1e9,
    "bias_dropout_add": (2 * _ROW + _H * _KB + _ROW) / 51.0e-6 / 1e9,
    "dropout": (2 * _ROW + _H * _KB + _ROW) / 51.0e-6 / 1e9,  # as bias_dropout_add
    "swiglu": 3 * _ROWI / 95.6e-6 / 1e9,
    "swiglu_backward": 3 * _ROWI / 95.6e-6 / 1e9,  # unmeasured: as the forward
    # unmeasured (issue 33): the backwards that also write the activation, at their backward's rate
    "swiglu_backward_act_": 3 * _ROWI / 95.6e-6 / 1e9,
    "geglu_backward_act_": 3 * _ROWI / 95.6e-6 / 1e9,
    "bias_gelu_backward_act_": (2 * _ROWI + _I * _KB + _ROWI) / 204.3e-6 / 1e9,
    "add_rms_norm": (2 * _ROW + _H * _KB + 2 * _ROW + _STAT) / 42.4e-6 / 1e9,
    "add_rms_norm_backward": (2 * _ROW + _STAT + _H * _KB + _ROW + _H * _KB) / 39.5e-6 / 1e9,
    "rotary": 3 * _ROW / 51.0e-6 / 1e9,  # unmeasured: as bias_dropout_add
    "rotary_backward": 3 * _ROW / 51.0e-6 / 1e9,
}

# --------------------------------------------------------------------------------------------- the counting
GEMMS = {aten.mm, aten.addmm, aten.addmm_, aten.bmm, aten.baddbmm, aten._addmm_activation}
# In-place GEMMs counted with their out-of-place formula (flop_counter registers only the latter).
FLOPS_AS = {aten.addmm_: aten.addmm}
ATTN_FWD = {aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention,
            aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_cudnn_attention}
ATTN_BWD = {aten._scaled_dot_product_flash_attention_for_cpu_backward,
            aten._scaled_dot_product_flash_attention_backward,
            aten._scaled_dot_product_efficient_attention_backward, aten._scaled_dot_product_cudnn_attention_backward}
# Memory-bound ATen ops that stream their operands once with little arithmetic (copies, casts, pointwise
# arithmetic): these run near the copy rate (simple_gbps); the others (norms, softmax, dropout, GELU,
# reductions) at mem_gbps.
SIMPLE = {f"aten.{n}" for n in ("add", "add_", "mul", "mul_", "div", "div_", "sub", "neg", "pow", "tanh", "copy_",
                                "clone", "_to_copy", "cat", "fill_", "zero_", "where", "rsqrt", "silu", "sigmoid",
                                "cos", "sin", "expand_copy", "ones_like", "zeros_like", "full", "zeros", "ones")}
# No kernel: allocations and metadata. (Views are found from their schemas.)
NO_KERNEL = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided, aten.detach,
             aten.alias, aten._unsafe_view, aten.lift_fresh, aten.set_, aten.resize_, aten._local_scalar_dense,
             aten.is_nonzero, aten.sym_size, aten.sym_stride, aten.sym_numel, aten._fused_sdp_choice}
WRITE_ONLY = {aten.copy_, aten.fill_, aten.zero_, aten.bernoulli_, aten.normal_, aten.uniform_}
LAUNCHES = {aten._scaled_dot_product_flash_attention_backward: 3,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: 3,
            aten._scaled_dot_product_efficient_attention_backward: 2,
            aten._scaled_dot_product_cudnn_attention_backward: 2}
CKPT_LAUNCHES = {"bias_dropout_add_layer_norm_backward": 2, "add_layer_norm_backward": 2, "add_rms_norm_backward": 2}


def _arg(args, kwargs, i, name, default=None):
    return args[i] if len(args) > i else kwargs.get(name, default)


@dataclass
class Op:
    name: str     # e.g. aten.mm, ckpt_ext.bias_gelu
    kind: str     # gemm | attn_fwd | attn_bwd | mem | ckpt
    flops: float
    bytes: float
    launches: int
    shapes: str = ""  # argument and result shapes, for reading a trace


def _elements(t: torch.Tensor) -> int:
    """Elements an op touches in `t`: broadcast (stride 0) dims once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n


def _nbytes(ts) -> int:
    seen, total = set(), 0
    for t in ts:
        key = (id(t),)
        if key in seen:
            continue
        seen.add(key)
        total += _elements(t) * t.element_size()
    return total


def _is_view(func) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def _meta(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, torch.device) and x.type == "cpu":
        return torch.device("meta")
    return x


def _like_cpu(m):
    if isinstance(m, torch.Tensor) and m.device.type == "meta":
        return torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device="cpu")
    return m


def _attention_flops(func, args, kwargs, out, causal: bool) -> float:
    packet = func._overloadpacket
    if packet in flop_registry:
        f = flop_registry[packet](*args, **kwargs, out_val=out)
    elif func._overloadpacket is aten._scaled_dot_product_flash_attention_for_cpu:
        f = sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape)
    else:  # _scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, ...)
        f = sdpa_backward_flop_count(args[0].shape, args[1].shape, args[2].shape, args[3].shape)
    return f * (0.5 if causal else 1.0)


def _is_causal(func, args, kwargs) -> bool:
    try:
        bound = {a.name: v for a, v in zip(func._schema.arguments, args)}
        bound.update(kwargs)
    except Exception:
        return False
    return bool(bound.get("is_causal", False))


class PredictedClock:
    """A clock (seconds) that a WorkMode advances by each op's predicted seconds at `rates` as it counts the op:
    passed to ckpt_ext.stack_plan.probe_clock, the budget planner's probe then measures each layer's forward and
    backward, its SDPA and GEMM calls at the predicted GPU time of the ops they ran (the budget variants)."""

    def __init__(self, rates: Dict[str, float], attn_dropout: float = 0.0):
        self.rates, self.attn_dropout, self.now = rates, attn_dropout, 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, op: "Op"):
        self.now += one_op_seconds(op.name, op.kind, op.flops, op.bytes, op.launches, self.rates, self.attn_dropout)


class WorkMode(TorchDispatchMode):
    """Counts every op (Op records in self.ops) and computes none: results are empty tensors of the right
    shapes (see the module's docstring)."""

    def __init__(self, clock: Optional["PredictedClock"] = None):
        super().__init__()
        self.ops: List[Op] = []
        self.clock = clock  # advanced by each op's predicted seconds (the budget variants' measuring step)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func._overloadpacket
        schema = func._schema
        # (ckpt_ext's in-place ops returning nothing -- the _act_ backwards -- move data all the same)
        if packet in NO_KERNEL or _is_view(func) or (func.namespace != "ckpt_ext" and not any(
                str(r.type) in ("Tensor", "Tensor[]", "Optional[Tensor]") for r in schema.returns)):
            return func(*args, **kwargs)
        tensors_in = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not any(t.is_floating_point() for t in tensors_in) and func.namespace == "aten" and not any(
                isinstance(a, torch.dtype) and a.is_floating_point for a in pytree.tree_leaves((args, kwargs))):
            return func(*args, **kwargs)  # ids, positions, masks: tiny, and their values may be read
        margs, mkwargs = pytree.tree_map(_meta, (args, kwargs))
        mout = func(*margs, **mkwargs)
        # Results that are written arguments (in-place, out=) are those arguments.
        written = {}
        for a, v in zip(schema.arguments, list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]]):
            if a.alias_info is not None and a.alias_info.is_write:
                written[frozenset(a.alias_info.before_set)] = v
        results = []
        mouts = mout if isinstance(mout, tuple) else (mout,)
        for r, m in zip(schema.returns, mouts):
            if r.alias_info is not None and r.alias_info.is_write and frozenset(r.alias_info.before_set) in written:
                results.append(written[frozenset(r.alias_info.before_set)])
            else:
                results.append(pytree.tree_map(_like_cpu, m))
        out = tuple(results) if isinstance(mout, tuple) else results[0] if results else None
        self._record(func, args, kwargs, out, tensors_in, written)
        if self.clock is not None:
            self.clock.advance(self.ops[-1])
        return out

    def _record(self, func, args, kwargs, out, tensors_in, written):
        packet = func._overloadpacket
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        reads = tensors_in
        if packet in WRITE_ONLY and args:
            reads = [t for t in tensors_in if t is not args[0]]
        nbytes = _nbytes(reads) + _nbytes(outs)
        if func.namespace == "ckpt_ext":
            # The arguments the op also writes (the _act_ backwards, in place): their bytes again.
            nbytes += _nbytes([t for t in written.values() if isinstance(t, torch.Tensor)])
        name = f"{func.namespace}.{packet.__name__}"
        shapes = (",".join("x".join(map(str, t.shape)) for t in tensors_in) + " -> " +
                  ",".join("x".join(map(str, t.shape)) for t in outs))
        if func.namespace == "ckpt_ext":
            op = packet.__name__
            launches = CKPT_LAUNCHES.get(op, 1)
            if (op == "bias_dropout_add_layer_norm_backward" and _arg(args, kwargs, 10, "grad_bias", False)) or \
                    (op in ("bias_gelu_backward", "bias_gelu_backward_act_") and
                     _arg(args, kwargs, 4, "grad_bias", False)):
                launches += 1  # the bias's gradient: one more column-sum kernel
            self.ops.append(Op(name, "ckpt", 0.0, nbytes, launches, shapes))
        elif packet in GEMMS:
            flops = flop_registry[FLOPS_AS.get(packet, packet)](*args, **kwargs, out_val=out)
            self.ops.append(Op(name, "gemm", float(flops), nbytes, 1, shapes))
        elif packet in ATTN_FWD or packet in ATTN_BWD:
            causal = _is_causal(func, args, kwargs)
            self.ops.append(Op(name, "attn_fwd" if packet in ATTN_FWD else "attn_bwd",
                               _attention_flops(func, args, kwargs, out, causal), nbytes, LAUNCHES.get(packet, 1),
                               shapes))
        else:
            self.ops.append(Op(name, "mem", 0.0, nbytes, 1, shapes))


# ------------------------------------------------------------------------------------------------ the models
def _build(family: str, layers: int, attn_dropout: float):
    import transformers
    if family == "bert":
        cfg = transformers.BertConfig(hidden_size=1024, num_hidden_layers=layers, num_attention_heads=16,
                                      intermediate_size=4096, max_position_embeddings=512, attn_implementation="sdpa",
                                      attention_probs_dropout_prob=attn_dropout)
        return transformers.BertModel(cfg, add_pooling_layer=False), cfg, 512
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_embd=1024, n_layer=layers, n_head=16, n_positions=1024,
                                      attn_implementation="sdpa", attn_pdrop=attn_dropout)
        return transformers.GPT2Model(cfg), cfg, 1024
    if family == "llama":
        cfg = transformers.LlamaConfig(hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32,
                                       num_key_value_heads=8, intermediate_size=8192, vocab_size=32000,
                                       max_position_embeddings=2048, attn_implementation="sdpa")
        return transformers.LlamaModel(cfg), cfg, 2048
    raise ValueError(f"unknown family {family!r}")


def _setup(m, variant: str):
    """side_by_side.py's make(), variant for variant."""
    if variant == "hf-gc":
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif variant == "ckpt_ext":
        ckpt_ext.enable_checkpointing(m)
    elif variant == "ckpt_ext-keep":
        ckpt_ext.enable_checkpointing(m, keep="attention")
    elif variant == "fused":
        ckpt_ext.fuse(m)
    elif variant == "fused+ckpt":
        ckpt_ext.fuse(m)
        ckpt_ext.enable_checkpointing(m)
    elif variant == "fused+keep":
        ckpt_ext.fuse(m)
        ckpt_ext.enable_checkpointing(m, keep="attention")
    elif variant.startswith("fused+keep="):  # a recompute level of the fused layers ("fused+keep=gemms", ...)
        ckpt_ext.fuse(m)
        ckpt_ext.enable_checkpointing(m, keep=variant.split("=", 1)[1])
    elif budget_of(variant) is not None:  # planned: the measuring step and the plan in _model_and_ids
        if variant.startswith("fused+"):
            ckpt_ext.fuse(m)
        ckpt_ext.enable_checkpointing(m, budget=_UNPLANNED)
    elif variant == "torch-sac":
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
        keep = {aten.mm.default, aten.addmm.default, aten.bmm.default}
        keep |= {p.default for p in ATTN_FWD}

        def policy(ctx, op, *a, **k):
            if _ACTIVE:  # SAC's Python dispatch mode runs on the host for every op it sees (forward and replay)
                _ACTIVE[-1].ops.append(Op("host.selective_checkpoint_mode", "host", 0.0, 0.0, 0))
            return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
            "use_reentrant": False, "context_fn": functools.partial(create_selective_checkpoint_contexts, policy)})
    elif variant != "none":
        raise ValueError(f"unknown variant {variant!r}")
    return m


# ---------------------------------------------------------------------------------------- the budget variants
# "fused+budget=2.0" (or "ckpt_ext+budget=2.0"): fuse(model), then enable_checkpointing(model, budget=B), planned
# from costs at the work model's H200 rates. A number B = that many times the full-checkpoint need: the planner's own
# measure of what checkpointing every layer alone, boundary only (enable_checkpointing(model), what fused+ckpt runs)
# needs -- its activation bytes held from forward to backward (the boundaries, the tensors every layer receives) plus
# the last layer's replay beside them and a layer's working set, as the planner counts them for budget= (not
# parameters, gradients or optimizer state). A size ("fused+budget=5291MiB") is the budget itself.
BUDGET_VARIANTS = ("fused+budget=", "ckpt_ext+budget=")
_UNPLANNED = 1 << 60  # the measuring step's budget (the plan it makes is replaced by _plan_predicted's)


def budget_of(variant: str) -> Optional[str]:
    """The B of a budget variant ("2.0", "5291MiB"), or None for another variant."""
    for prefix in BUDGET_VARIANTS:
        if variant.startswith(prefix):
            return variant[len(prefix):]
    return None


def full_checkpoint_need(planner) -> int:
    """The planner's need (its predicted peak: docs/planner.md; shared tensors included) of every layer checkpointed
    alone, boundary only, from the costs `planner` (a StackPlanner) measured."""
    from ckpt_ext.planner import _finish
    plan = _finish(planner.costs, [(i, i + 1, True) for i in range(len(planner.costs))], None)
    return plan.need_bytes + sum(planner.shared.values())


def _plan_predicted(m, ids, mode: str, value: str, rates: Dict[str, float], info: Optional[dict]):
    """The measuring step of a budget variant, traced (nothing computed) with the planner's probe timed by a
    PredictedClock (ckpt_ext.stack_plan.probe_clock): the layers' times are the predicted H200 times of their ops,
    their bytes measured as always. Then the plan for budget `value` (budget_of) from those costs, installed at the
    next step. `info` gets the budget, the full-checkpoint need, the plan and explain()'s text."""
    import bench_budget  # noqa: E402  (benchmarks/ is on sys.path when this runs)
    from ckpt_ext.planner import parse_bytes
    from ckpt_ext.stack_plan import probe_clock
    clock = PredictedClock(rates)
    with _cuda_like(), WorkMode(clock), probe_clock(clock):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=_autocast(mode)):
            loss = m(input_ids=ids).last_hidden_state.float().pow(2).mean()
        loss.backward()
    m.zero_grad(set_to_none=True)
    planner = bench_budget.planner_of(m)
    full = full_checkpoint_need(planner)
    try:
        budget = int(float(value) * full)
    except ValueError:
        budget = parse_bytes(value)
    plan = planner.replan(budget)
    if info is not None:
        info.update(budget=budget, full_need=full, plan=plan, explain=str(ckpt_ext.explain(m)))


_ACTIVE: List["WorkMode"] = []  # the trace running now (torch-sac's policy counts its calls into it)


def _native_dropout(input, p=0.5, training=True, inplace=False):
    """F.dropout as CUDA dispatches it (one native_dropout kernel), for the traces."""
    if not training or p == 0:
        return input
    return torch.native_dropout(input, p, True)[0]


@contextlib.contextmanager
def _cuda_like():
    old_dropout, old_layout = F.dropout, _C.cpu_gemm_layout("off")
    F.dropout = _native_dropout
    try:
        yield
    finally:
        F.dropout = old_dropout
        _C.cpu_gemm_layout(old_layout)


def _model_and_ids(family: str, mode: str, variant: str, layers: int, batch: int, seq: Optional[int], model_fn,
                   info: Optional[dict] = None, rates: Optional[Dict[str, float]] = None):
    """The model of a traced step, set up as `variant` in `mode`'s dtype, and its input ids (seed 0); a budget
    variant's model planned (_plan_predicted at `rates`, FIT by default)."""
    torch.manual_seed(0)
    if model_fn is None:
        m, cfg, s = _build(family, layers, attn_dropout=0.0)
        vocab = cfg.vocab_size
    else:
        m, vocab, s = model_fn(layers)
    m = m.train()
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if _bf16_weights(mode):
        m = m.to(torch.bfloat16)
    if _lora(mode):  # peft's LoRA as suite.py --lora wraps the model (variants.add_lora), before any variant
        import variants  # noqa: E402  (benchmarks/ is on sys.path when this runs)
        m = variants.add_lora(m, family, variants.LoraSpec())
    _setup(m, variant)
    ids = torch.randint(0, vocab, (batch, seq or s))
    if budget_of(variant) is not None:
        _plan_predicted(m, ids, mode, budget_of(variant), FIT if rates is None else rates, info)
    return m, ids


def trace(family: str, mode: str, variant: str, layers: int, batch: int, seq: Optional[int] = None,
          model_fn=None, info: Optional[dict] = None) -> List[Op]:
    """The ops of one training step (see the module's docstring). `model_fn(layers)` -> (model, vocab, seq)
    replaces the Hugging Face configs (the tests' tiny models). A budget variant's step is the planned one, after
    its measuring step; `info` (a dict) then also gets the plan (_plan_predicted) and `held`: the bytes the layer
    stack held from forward to backward in the traced step (bench_budget.held_by_stack)."""
    m, ids = _model_and_ids(family, mode, variant, layers, batch, seq, model_fn, info)
    work = WorkMode()
    _ACTIVE.append(work)
    with _cuda_like(), work, contextlib.ExitStack() as stack:
        stack.callback(_ACTIVE.pop)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=_autocast(mode)):
            if info is not None and budget_of(variant) is not None:
                import bench_budget  # noqa: E402
                out, info["held"] = bench_budget.held_by_stack(
                    m, bench_budget.planner_of(m).layers, lambda mm: mm(input_ids=ids).last_hidden_state)
            else:
                out = m(input_ids=ids).last_hidden_state
            loss = out.float().pow(2).mean()
        loss.backward()
    return work.ops


def peak_live_bytes(family: str, mode: str, variant: str, layers: int, batch: int, model_fn=None,
                    steps: int = 2) -> Tuple[int, Dict[int, int]]:
    """Memory, not time: the peak bytes of live tensors over a training step, as the traced step (CUDA-like
    ops, nothing computed, real shapes) allocates them -- bench_head.LiveBytes inside the trace, every storage
    made during the step counted from the op that made it until its last tensor is gone (Python's garbage
    collection decides that moment for tensors in reference cycles: a few MiB of noise at full size).
    Kernels' internal workspaces (flash attention's float dq accumulator, cuBLAS's) and the caching
    allocator (rounding, fragmentation, cached blocks) are not seen. The last of `steps` steps counts (the
    first warms the boundary pool up). Returns (peak, {storage bytes: count} live at the peak)."""
    import bench_head  # noqa: E402  (benchmarks/ is on sys.path when this runs)

    class Peak(bench_head.LiveBytes):
        def __init__(self):
            super().__init__()
            self.at_peak: Dict[int, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = self.peak
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if self.peak > before:
                self.at_peak = dict(collections.Counter(e[0] for e in self.live.values()))
            return out
    m, ids = _model_and_ids(family, mode, variant, layers, batch, None, model_fn)
    for _ in range(steps):
        m.zero_grad(set_to_none=True)
        work, live = WorkMode(), Peak()
        _ACTIVE.append(work)
        with _cuda_like(), work, live, contextlib.ExitStack() as stack:
            stack.callback(_ACTIVE.pop)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=_autocast(mode)):
                loss = m(input_ids=ids).last_hidden_state.float().pow(2).mean()
            loss.backward()
    return live.peak, live.at_peak


# ---------------------------------------------------------------------------------------------- the scaling
@dataclass
class Counts:
    """Per-op counts at a target batch, as arrays (kind per op)."""
    names: List[str]
    kinds: List[str]
    flops: List[float]
    bytes: List[float]
    launches: List[int]


# Batch 1 differs in structure (a broadcast over the batch needs no reduction in its backward), so 2 and 3.
TRACE_BATCHES = (2, 3)


def at_batch(ops1: List[Op], ops2: List[Op], batch: int) -> Counts:
    """Per-op counts at `batch` from the traces at TRACE_BATCHES (affine in the batch, op by op)."""
    if [o.name for o in ops1] != [o.name for o in ops2]:
        raise RuntimeError("the traces at two batches do not align op by op; the batch extrapolation needs them to")
    b0, b1 = TRACE_BATCHES
    ex = lambda a, b: a + (batch - b0) / (b1 - b0) * (b - a)  # noqa: E731
    return Counts([o.name for o in ops1], [o.kind for o in ops1], [ex(a.flops, b.flops) for a, b in zip(ops1, ops2)],
                  [ex(a.bytes, b.bytes) for a, b in zip(ops1, ops2)], [o.launches for o in ops1])


def op_seconds(c: Counts, rates: Dict[str, float], attn_dropout: float = 0.0,
               ckpt_gbps: Optional[Dict[str, float]] = None) -> List[float]:
    """Predicted seconds per op. Attention with dropout costs attn_dropout_cost times as much compute (the
    flash kernels draw Philox numbers per score inside the tile loop). `ckpt_gbps`: ckpt_ext's kernels'
    bandwidths (CKPT_OP_GBPS when None; what-if scenarios change them)."""
    return [one_op_seconds(name, kind, fl, by, la, rates, attn_dropout, ckpt_gbps)
            for name, kind, fl, by, la in zip(c.names, c.kinds, c.flops, c.bytes, c.launches)]


def one_op_seconds(name: str, kind: str, fl: float, by: float, la: int, rates: Dict[str, float],
                   attn_dropout: float = 0.0, ckpt_gbps: Optional[Dict[str, float]] = None) -> float:
    """Predicted seconds of one op (op_seconds)."""
    attn = rates["attn_dropout_cost"] if attn_dropout > 0 else 1.0
    ckpt_gbps = CKPT_OP_GBPS if ckpt_gbps is None else ckpt_gbps
    if kind == "gemm":
        compute = fl / (rates["gemm_tflops"] * 1e12)
        bw = rates["mem_gbps"]
    elif kind == "attn_fwd":
        compute, bw = attn * fl / (rates["attn_fwd_tflops"] * 1e12), rates["mem_gbps"]
    elif kind == "attn_bwd":
        compute, bw = attn * fl / (rates["attn_bwd_tflops"] * 1e12), rates["mem_gbps"]
    elif kind == "ckpt":
        compute, bw = 0.0, ckpt_gbps.get(name.split(".", 1)[1], rates["mem_gbps"])
    elif kind == "host":
        return rates["python_mode_us"] * 1e-6
    elif name in SIMPLE:
        compute, bw = 0.0, rates["simple_gbps"]
    else:
        compute, bw = 0.0, rates["mem_gbps"]
    return max(compute, by / (bw * 1e9)) + la * rates["launch_us"] * 1e-6


@dataclass
class Step:
    """One variant of one config: the counts of the TRACE_LAYERS-layer models at the config's batch."""
    one: Counts
    two: Counts
    layers: int
    attn_dropout: float = 0.0
    plan: Optional[str] = None  # a budget variant's plan (explain()'s text); its counts are the whole model's

    def seconds(self, rates, ckpt_gbps=None, keep=None) -> float:
        """Predicted step seconds; `keep(counts, i)` False drops op i (what-if scenarios)."""
        def total(c):
            secs = op_seconds(c, rates, self.attn_dropout, ckpt_gbps)
            return sum(s for i, s in enumerate(secs) if keep is None or keep(c, i))
        return self._extrapolate(total(self.one), total(self.two))

    def _extrapolate(self, a, b):
        l0, l1 = TRACE_LAYERS
        return a + (self.layers - l0) / (l1 - l0) * (b - a)

    def totals(self) -> Dict[str, float]:
        """FLOPs, bytes and launches of the whole step (all layers)."""
        out = {}
        for key in ("flops", "bytes", "launches"):
            out[key] = self._extrapolate(sum(getattr(self.one, key)), sum(getattr(self.two, key)))
        return out

    def per_op(self, rates) -> Dict[str, List[float]]:
        """name -> [count, seconds, flops, bytes, launches] over the whole step (the layer part x layers)."""
        agg = collections.defaultdict(lambda: [0.0] * 5)
        l0, l1 = TRACE_LAYERS
        w1 = (self.layers - l0) / (l1 - l0)
        for counts, w in ((self.one, 1 - w1), (self.two, w1)):
            secs = op_seconds(counts, rates, self.attn_dropout)
            for n, s, fl, by, la in zip(counts.names, secs, counts.flops, counts.bytes,
                                        counts.launches):
                for i, v in enumerate((1, s, fl, by, la)):
                    agg[n][i] += w * v
        return dict(agg)


# A 1-layer model is special for some variants (keep="attention" keeps no attention there), so 2 and 3.
TRACE_LAYERS = (2, 3)


def step_of(cfg: Config, variant: str, model_fn=None, seq=None, info: Optional[dict] = None) -> Step:
    """The variant's Step: traced at TRACE_LAYERS x TRACE_BATCHES and extrapolated; a budget variant (whose plan
    depends on the layer count and the batch) traced once at the config's own layers and batch (`info`: trace's)."""
    if budget_of(variant) is not None:
        info = {} if info is None else info
        ops = trace(cfg.family, cfg.mode, variant, cfg.layers, cfg.batch, seq=seq, model_fn=model_fn, info=info)
        counts = at_batch(ops, ops, cfg.batch)
        mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
        head = (f"budget {mib(info['budget'])} = {info['budget'] / info['full_need']:.3f} x the full-checkpoint need "
                f"{mib(info['full_need'])}; held from forward to backward in the traced step {mib(info['held'])} "
                f"(planned {mib(info['plan'].held_bytes)})")
        return Step(counts, counts, cfg.layers, cfg.attn_dropout, plan=head + "\n" + info["explain"])
    per_layers = []
    for layers in TRACE_LAYERS:
        ops = [trace(cfg.family, cfg.mode, variant, layers, b, seq=seq, model_fn=model_fn) for b in TRACE_BATCHES]
        per_layers.append(at_batch(ops[0], ops[1], cfg.batch))
    return Step(per_layers[0], per_layers[1], cfg.layers, cfg.attn_dropout)


# ----------------------------------------------------------------------------------------------- what-if
# out.float().pow(2).mean() and its backward (the casts only where the output is bf16: not under autocast)
LOSS = ["aten.pow", "aten.mean", "aten.ones_like", "aten.div", "aten.pow", "aten.mul", "aten.mul"]


def _in_layers(c: Counts, i: int) -> bool:
    """Op i is the layers' (not the embeddings' or the loss's): between the first and the last GEMM, outside
    the loss's ops."""
    gemms = [j for j, k in enumerate(c.kinds) if k == "gemm"]
    start = next(j for j in range(len(c.names)) if c.names[j:j + len(LOSS)] == LOSS)
    end = start + len(LOSS)
    if c.names[start - 1] == "aten._to_copy" and c.names[end] == "aten._to_copy":
        start, end = start - 1, end + 1
    return gemms[0] <= i <= gemms[-1] and not start <= i < end


def what_if(step: Step, rates) -> List[Tuple[str, float]]:
    """The step's predicted ms with the layers' work beyond GEMMs and attention removed or sped up, part by
    part, cumulatively (docs/bert-work.md)."""
    fast = {k: max(v, 2500.0 if k.endswith("backward") else 3000.0) for k, v in CKPT_OP_GBPS.items()}
    gone: set = set()
    names = {"sum": "aten.sum", "cat": "aten.cat", "add": "aten.add", "cast": "aten._to_copy"}

    def keep(c, i):
        return not (c.names[i] in {names[g] for g in gone} and _in_layers(c, i))
    out = [("as traced", step.seconds(rates) * 1e3),
           ("ckpt_ext kernels at >= 3.0 TB/s forward, >= 2.5 TB/s backward", step.seconds(rates, fast, keep) * 1e3)]
    for what, label in (("sum", "+ bias-gradient column sums folded into the backward kernels"),
                        ("cat", "+ no cat (Q/K/V weights kept as one; dq, dk, dv written into one buffer)"),
                        ("add", "+ no gradient adds (x's and h1's two uses summed in a kernel or GEMM epilogue)"),
                        ("cast", "+ no autocast casts in the layers (bf16 weights copy cached per step)")):
        gone.add(what)
        out.append((label, step.seconds(rates, fast, keep) * 1e3))
    out.append(("floor: GEMMs and attention only (their launches included)",
                step.seconds(rates, keep=lambda c, i: c.kinds[i] in ("gemm", "attn_fwd", "attn_bwd")) * 1e3))
    return out


# -------------------------------------------------------------------------------------------------- the fit
RATE_KEYS = ("gemm_tflops", "attn_fwd_tflops", "attn_bwd_tflops", "attn_dropout_cost", "simple_gbps", "mem_gbps",
             "launch_us", "python_mode_us")
# The fit stays within what an H200 can do (bf16 dense peak 989 TFLOP/s, copy 4.3 TB/s): an unbounded fit
# trades one rate against another (GEMMs above peak paid for by launches at 10 us) to shave a percent.
RATE_BOUNDS = {"gemm_tflops": (300, 850), "attn_fwd_tflops": (150, 650), "attn_bwd_tflops": (100, 550),
               "attn_dropout_cost": (1.0, 2.5), "simple_gbps": (2500, 4300), "mem_gbps": (1500, 3000),
               "launch_us": (1.0, 8.0), "python_mode_us": (0.0, 40.0)}


def fit(steps: Dict[Tuple[str, str], Step]) -> Dict[str, float]:
    """Rates within RATE_BOUNDS minimizing the largest |log(predicted / measured)| over the table (a smooth
    max, Nelder-Mead on log rates from a few starts)."""
    import numpy as np
    from scipy.optimize import minimize
    rows = [(k, H200_MS[k[0]][k[1]] / 1e3) for k in steps]
    lo = np.log([RATE_BOUNDS[k][0] for k in RATE_KEYS])
    hi = np.log([RATE_BOUNDS[k][1] for k in RATE_KEYS])

    def err(logr, p=10):
        r = dict(zip(RATE_KEYS, np.exp(np.clip(logr, lo, hi))))
        e = np.array([math.log(steps[k].seconds(r) / ms) for k, ms in rows])
        out_of_bounds = np.sum(np.maximum(0, logr - hi) + np.maximum(0, lo - logr))
        return float(np.sum(np.abs(e) ** p) ** (1 / p)) + 10 * out_of_bounds
    best = None
    for start in ([700, 400, 280, 1.3, 3500, 2400, 4, 10], [600, 300, 200, 1.1, 3000, 2000, 2, 5],
                  [800, 500, 350, 1.6, 4000, 2800, 6, 20]):
        res = minimize(err, np.log(start), method="Nelder-Mead", options={"maxiter": 8000, "xatol": 1e-5,
                                                                          "fatol": 1e-9})
        if best is None or res.fun < best.fun:
            best = res
    return {k: float(round(v, 3)) for k, v in zip(RATE_KEYS, np.exp(np.clip(best.x, lo, hi)))}


# ------------------------------------------------------------------------------------------------ reporting
def rank_check(table: Dict[str, float], pred: Dict[str, float], tie: float = 0.02) -> List[str]:
    """Pairs of variants the prediction orders otherwise than the measurement (pairs measured within `tie`
    of each other are ties: the table's own noise)."""
    bad = []
    vs = [v for v in table if v in pred]
    for i, a in enumerate(vs):
        for b in vs[i + 1:]:
            if abs(table[a] / table[b] - 1) <= tie:
                continue
            if (table[a] < table[b]) != (pred[a] < pred[b]):
                bad.append(f"{a} vs {b}")
    return bad


def main(argv: Optional[Sequence[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(CONFIGS), help="comma list of " + ", ".join(CONFIGS))
    ap.add_argument("--variants", default=None, help="comma list (default: the table's variants)")
    ap.add_argument("--fit", action="store_true", help="refit the rates to the H200 table and print them")
    ap.add_argument("--per-op", default=None, metavar="CONFIG:VARIANT",
                    help="also print the step's ops by predicted time for this config and variant")
    ap.add_argument("--what-if", default=None, metavar="CONFIG:VARIANT",
                    help="also print that step's time with parts of the layers' work removed (docs/bert-work.md)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--cache", default=None, help="keep the traced counts in this pickle (reused when present; "
                    "delete it after changing the code the traces run)")
    ap.add_argument("--peak", default=None, metavar="CONFIG:VARIANT[,VARIANT...]",
                    help="instead of the times: the peak bytes of live tensors over a step (peak_live_bytes)")
    ap.add_argument("--mixed-residual", choices=("on", "off"), default="on",
                    help="autocast: the fused last linear's GEMM output read beside the float32 stream without casts "
                         "(on, the default) or cast as before (off); _C.mixed_dtype_residual, docs/autocast.md. "
                         "A --cache file holds the traces of the setting it was made with")
    ap.add_argument("--tail-activation", choices=("on", "off"), default="on",
                    help="the replay of a checkpointed segment's last layer stops before its activation, whose "
                         "backward writes the last linear's input (on, the default; issue 33) or runs the activation "
                         "forward as before (off); _C.tail_activation_in_backward. A --cache file holds the traces "
                         "of the setting it was made with")
    args = ap.parse_args(argv)
    _C.mixed_dtype_residual(args.mixed_residual == "on")
    _C.tail_activation_in_backward(args.tail_activation == "on")
    if args.peak:
        name, vs = args.peak.split(":")
        cfg = CONFIGS[name]
        print(f"--- {name}: peak bytes of live tensors over a step (traced, not measured; see peak_live_bytes) ---")
        for v in vs.split(","):
            peak, at = peak_live_bytes(cfg.family, cfg.mode, v, cfg.layers, cfg.batch)
            big = ", ".join(f"{n} x {b / 2**20:g}" for b, n in sorted(at.items(), key=lambda kv: -kv[0] * kv[1])[:6])
            print(f"{v:14s} {peak / 2**20:9.1f} MiB   live at the peak (MiB): {big}")
        return {}
    cached = {}
    if args.cache and os.path.exists(args.cache):
        with open(args.cache, "rb") as f:
            cached = pickle.load(f)
    steps: Dict[Tuple[str, str], Step] = {}
    for name in args.models.split(","):
        cfg = CONFIGS[name]
        for v in (args.variants.split(",") if args.variants else cfg.variants):
            if (name, v) in cached:
                steps[(name, v)] = cached[(name, v)]
                steps[(name, v)].attn_dropout = cfg.attn_dropout
                continue
            steps[(name, v)] = step_of(cfg, v)
            print(f"  traced {name} {v}", file=sys.stderr, flush=True)
    if args.cache:
        with open(args.cache, "wb") as f:
            pickle.dump({**cached, **steps}, f)
    rates = dict(FIT)
    if args.fit:
        rates = fit({k: s for k, s in steps.items() if k[1] in H200_MS.get(k[0], {})})
        print("fitted rates (paste into FIT):", json.dumps(rates))
    print(f"work model: rates {json.dumps(rates)}; measured: H200, {H200_SOURCE}")
    print(f"{'config':20s} {'variant':14s} {'TFLOP':>7s} {'GB':>7s} {'launch':>7s} {'pred ms':>8s} {'H200 ms':>8s} "
          f"{'error':>7s}")
    rows, errors = [], []
    by_cfg = collections.defaultdict(dict)
    for (name, v), st in steps.items():
        pred = st.seconds(rates) * 1e3
        tot = st.totals()
        meas = H200_MS.get(name, {}).get(v)
        err = None if meas is None else pred / meas - 1
        if err is not None:
            errors.append(err)
        by_cfg[name][v] = pred
        rows.append({"config": name, "variant": v, "flops": tot["flops"], "bytes": tot["bytes"],
                     "launches": tot["launches"], "predicted_ms": pred, "measured_ms": meas, "error": err})
        print(f"{name:20s} {v:14s} {tot['flops'] / 1e12:7.2f} {tot['bytes'] / 1e9:7.1f} {tot['launches']:7.0f} "
              f"{pred:8.1f} {'' if meas is None else f'{meas:8.1f}':>8s} "
              f"{'' if err is None else f'{err * 100:+6.1f}%':>7s}")
    for name, pred in by_cfg.items():
        bad = rank_check(H200_MS.get(name, {}), pred)
        print(f"rank {name}: {'as measured' if not bad else 'differs: ' + ', '.join(bad)}"
              " (pairs measured within 2% count as ties)")
    for (name, v), st in steps.items():
        if st.plan:
            print(f"--- {name} {v}: the plan (costs at the rates above) ---\n{st.plan}")
    if args.per_op:
        name, v = args.per_op.split(":")
        per = steps[(name, v)].per_op(rates)
        print(f"--- {name} {v}: ops by predicted time (whole step) ---")
        print(f"{'op':52s} {'calls':>6s} {'ms':>8s} {'TFLOP':>7s} {'GB':>7s}")
        for n, (c, s, fl, by, la) in sorted(per.items(), key=lambda kv: -kv[1][1])[:30]:
            print(f"{n:52s} {c:6.0f} {s * 1e3:8.2f} {fl / 1e12:7.2f} {by / 1e9:7.2f}")
    if args.what_if:
        name, v = args.what_if.split(":")
        meas = H200_MS.get(name, {}).get("none")
        print(f"--- {name} {v}: what if (cumulative; x = / H200 HF eager {meas} ms) ---")
        for label, t in what_if(steps[(name, v)], rates):
            print(f"{label:80s} {t:7.1f} ms" + (f"  x{t / meas:.3f}" if meas else ""))
    result = {"rates": rates, "rows": rows,
              "max_abs_error": max((abs(e) for e in errors), default=None), "n": len(errors)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if errors:
        print(f"calibration: max |error| {max(abs(e) for e in errors) * 100:.1f}% over {len(errors)} rows")
    return result


if __name__ == "__main__":
    main()
