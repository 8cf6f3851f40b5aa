"""The models the benchmarks train and the checkpointing variants they compare.

Models are Hugging Face base models (BertModel / GPT2Model / LlamaModel) built from configs with random
weights (nothing is downloaded), SDPA attention, the configs' dropout (attention dropout 0.1 for BERT and
GPT-2, none in Llama); loss = mean of the squared last hidden state. Modes: `fp32`; `bf16` (weights cast
to bfloat16); `autocast` (fp32 weights under torch.autocast bfloat16, what Trainer(bf16=True) does).

A variant is an object with its own set-up and tear-down: `setup(fresh)` receives a function that returns
a fresh copy of the base model on the device and returns the model to train; nothing outside the
variant knows what it does to the model. `unavailable()` gives the reason a variant does not apply
here (the run reports it and goes on).

With a LoRA spec (suite.py --lora), the base model is wrapped by peft LoRA before any variant sees it:
adapters on the attention and MLP projections (LORA_TARGETS), base weights frozen, B initialised at
random (peft's zeros would leave every A without gradient), so every variant trains the adapters only
(fuse(peft model) computes them in the fused layers).
"""
import contextlib
import copy
import functools
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

import ckpt_ext
from ckpt_ext.keep import LSE_OPS, recording_kept
from common import hf_checkpointing_disable, hf_checkpointing_enable

# bf16-autocast: bfloat16 weights under autocast (a Llama checkpoint loaded in bfloat16 and trained with
# Trainer(bf16=True); with --lora, peft's float32 adapters run their GEMMs in bfloat16, as users run LoRA)
MODES = ("fp32", "bf16", "autocast", "bf16-autocast")


# ---------------------------------------------------------------------------------------------- models
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
    head_dim: Optional[int] = None  # qwen3, gemma: set apart from hidden / heads (None: hidden / heads)
    window: Optional[int] = None    # mistral, gemma3: the sliding attention window (None: the config's default)

    def describe(self) -> str:
        kv = f" ({self.kv_heads} KV heads)" if self.kv_heads else ""
        hd = f", head dim {self.head_dim}" if self.head_dim else ""
        win = f", window {self.window}" if self.window else ""
        return (f"{self.family} {self.layers} layers, hidden {self.hidden}, {self.heads} heads{kv}{hd}, "
                f"intermediate {self.intermediate}, vocab {self.vocab}, seq {self.seq}{win}")


MODELS = {
    "bert-large": ModelSpec("bert-large", "bert", 24, 1024, 16, 512, 4096, 30522),
    "bert-base": ModelSpec("bert-base", "bert", 12, 768, 12, 512, 3072, 30522),
    "gpt2-medium": ModelSpec("gpt2-medium", "gpt2", 24, 1024, 16, 1024, 4096, 50257),
    # Llama-3.2-1B's layer geometry (grouped-query attention) with a Llama-2-sized vocabulary.
    "llama": ModelSpec("llama", "llama", 16, 2048, 32, 2048, 8192, 32000, kv_heads=8),
}


# peft target_modules per family: every attention and MLP projection (BERT's "dense" is the attention
# output, intermediate and output linears).
LORA_TARGETS = {"bert": ["query", "key", "value", "dense"], "gpt2": ["c_attn", "c_proj", "c_fc"],
                "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
# Llama's relatives (fused on its machinery): transformers' class prefix.
RELATIVES = {"qwen2": "Qwen2", "mistral": "Mistral", "qwen3": "Qwen3", "gemma": "Gemma", "gemma3": "Gemma3Text"}
for _family in RELATIVES:
    LORA_TARGETS[_family] = LORA_TARGETS["llama"]


@dataclass(frozen=True)
class LoraSpec:
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.05

    def describe(self, family: str) -> str:
        return (f"peft LoRA r={self.r}, alpha {self.alpha:g}, dropout {self.dropout:g} on "
                f"{', '.join(LORA_TARGETS[family])}; base weights frozen")


def parse_lora(text: str) -> LoraSpec:
    """'r=16,alpha=32,dropout=0.05' (any subset; the rest default) -> LoraSpec."""
    kw = {}
    for item in filter(None, (i.strip() for i in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in ("r", "alpha", "dropout"):
            raise ValueError(f"expected r=, alpha= or dropout= items, got {item!r}")
        kw[key] = int(value) if key == "r" else float(value)
    spec = LoraSpec(**kw)
    if spec.r < 1 or not 0 <= spec.dropout < 1:
        raise ValueError(f"r must be at least 1 and dropout in [0, 1), got {spec}")
    return spec


def add_lora(model: nn.Module, family: str, lora: LoraSpec) -> nn.Module:
    """The model wrapped by peft LoRA (peft's defaults otherwise: float32 adapters on a bfloat16 model)."""
    import peft
    cfg = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=LORA_TARGETS[family], fan_in_fan_out=family == "gpt2")
    model = peft.get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model.train()


def without_dropout(model: nn.Module) -> nn.Module:
    """Every dropout of the model set to 0 in place (nn.Dropout modules, adapters' included, and Llama's
    attention_dropout), before fuse reads them: the suite's parity step compares variants without the
    random numbers they draw differently."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0
    return model


def build_model(spec: ModelSpec, mode: str) -> nn.Module:
    """The Hugging Face base model of the spec, random weights (seeded), training mode, on CPU; no KV cache
    (use_cache=False, as in training: Hugging Face's checkpointing and the fused layers would warn and drop
    it)."""
    torch.manual_seed(0)
    if spec.family == "bert":
        from transformers import BertConfig, BertModel
        cfg = BertConfig(hidden_size=spec.hidden, num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                         intermediate_size=spec.intermediate, vocab_size=spec.vocab,
                         max_position_embeddings=max(512, spec.seq), attn_implementation="sdpa", use_cache=False)
        model = BertModel(cfg, add_pooling_layer=False)
    elif spec.family == "gpt2":
        from transformers import GPT2Config, GPT2Model
        cfg = GPT2Config(n_embd=spec.hidden, n_layer=spec.layers, n_head=spec.heads, n_inner=spec.intermediate,
                         vocab_size=spec.vocab, n_positions=max(1024, spec.seq), attn_implementation="sdpa",
                         use_cache=False)
        model = GPT2Model(cfg)
    elif spec.family == "llama":
        from transformers import LlamaConfig, LlamaModel
        cfg = LlamaConfig(hidden_size=spec.hidden, num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                          num_key_value_heads=spec.kv_heads or spec.heads, intermediate_size=spec.intermediate,
                          vocab_size=spec.vocab, max_position_embeddings=max(2048, spec.seq),
                          attn_implementation="sdpa", use_cache=False)
        model = LlamaModel(cfg)
    elif spec.family in RELATIVES:
        import transformers
        prefix = RELATIVES[spec.family]
        extra = {"head_dim": spec.head_dim or spec.hidden // spec.heads}
        if spec.family in ("mistral", "gemma3"):  # (Gemma 3: its sliding layers' window; every sixth is full)
            extra["sliding_window"] = spec.window
        cfg = getattr(transformers, prefix + "Config")(
            hidden_size=spec.hidden, num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
            num_key_value_heads=spec.kv_heads or spec.heads, intermediate_size=spec.intermediate,
            vocab_size=spec.vocab, max_position_embeddings=max(2048, spec.seq), attn_implementation="sdpa",
            use_cache=False, **extra)
        model = getattr(transformers, prefix + "Model")(cfg)
    else:
        raise ValueError(f"unknown model family {spec.family!r}")
    if mode in ("bf16", "bf16-autocast"):
        model = model.to(torch.bfloat16)
    return model.train()


class Workload:
    """A model spec in a mode on a device: fresh copies of the base model, inputs per batch, a step."""

    def __init__(self, spec: ModelSpec, mode: str, device, lora: Optional[LoraSpec] = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.spec, self.mode, self.device, self.lora = spec, mode, torch.device(device), lora
        self.base = build_model(spec, mode)  # stays on CPU: every variant gets its own copy on the device
        if lora is not None:
            self.base = add_lora(self.base, spec.family, lora)
        self.ids: Dict[int, torch.Tensor] = {}

    def fresh(self) -> nn.Module:
        return copy.deepcopy(self.base).to(self.device)

    def fresh_without_dropout(self) -> nn.Module:
        return without_dropout(self.fresh())

    def input_ids(self, batch: int) -> torch.Tensor:
        if batch not in self.ids:
            g = torch.Generator().manual_seed(batch)
            self.ids[batch] = torch.randint(0, self.spec.vocab, (batch, self.spec.seq), generator=g).to(self.device)
        return self.ids[batch]

    def forward(self, variant: "Variant", model: nn.Module, batch: int, probe: bool = False) -> torch.Tensor:
        """The loss: mean of the squared last hidden state, or with `probe` its mean product with fixed
        random weights (a model ending in a LayerNorm makes the mean square ~1 whatever the weights, and
        its gradients mere rounding noise: the parity step compares gradients)."""
        model.zero_grad(set_to_none=True)
        ids = self.input_ids(batch)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.mode in ("autocast", "bf16-autocast")):
            with variant.context():
                hidden = model(input_ids=ids).last_hidden_state.float()
            if probe:
                g = torch.Generator().manual_seed(2)
                return (hidden * torch.randn(hidden.shape, generator=g).to(hidden.device)).mean()
            return hidden.pow(2).mean()

    def step(self, variant: "Variant", model: nn.Module, batch: int) -> None:
        self.forward(variant, model, batch).backward()


# -------------------------------------------------------------------------------------------- variants
class Variant:
    """No checkpointing: the reference every other variant is compared with."""
    name = "none"
    summary = "no checkpointing (Hugging Face eager)"
    # True for a variant that runs none's kernels plus a recompute: it cannot be faster than `none`, and
    # a row saying it is gets flagged as implausible.
    recomputes = False

    def unavailable(self) -> Optional[str]:
        return None

    def setup(self, fresh: Callable[[], nn.Module]) -> nn.Module:
        return fresh()

    def teardown(self, model: nn.Module) -> None:
        pass

    def prepare(self, model: nn.Module, batch: int, workload: Workload, none_bytes: Callable[[int], int]) -> None:
        """Untimed, before the first step at a new batch."""

    def context(self):
        return contextlib.nullcontext()

    def extra_saved(self) -> List[torch.Tensor]:
        """Tensors the variant keeps outside autograd's saved tensors during the last forward."""
        return []


class HFCheckpointing(Variant):
    recomputes = True

    def __init__(self, reentrant: bool):
        self.reentrant = reentrant
        self.name = "hf-torch-reentrant" if reentrant else "hf-torch-nonreentrant"
        self.summary = f"Hugging Face's checkpointing (torch.utils.checkpoint, use_reentrant={reentrant})"

    def setup(self, fresh):
        model = fresh()
        hf_checkpointing_enable(model, use_reentrant=self.reentrant)
        return model

    def teardown(self, model):
        hf_checkpointing_disable(model)


SELECTIVE_SAVE = ("mm", "addmm", "bmm", "baddbmm")


class TorchSelective(Variant):
    """Hugging Face's checkpointing with torch's selective checkpointing saving matmul outputs. The
    caches torch creates live outside autograd; they are recorded so their bytes are counted."""
    name = "torch-selective"
    summary = f"Hugging Face's checkpointing, context_fn saving aten {', '.join(SELECTIVE_SAVE)} outputs"
    recomputes = True
    saves = SELECTIVE_SAVE  # aten op names whose outputs the policy saves

    def __init__(self):
        self.recording: List[object] = []

    def _context_fn(self):
        from torch.utils.checkpoint import create_selective_checkpoint_contexts
        ops = [getattr(torch.ops.aten, n).default for n in self.saves if hasattr(torch.ops.aten, n)]
        forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(ops)
        self.recording.append(getattr(forward_ctx, "storage", None))
        return forward_ctx, recompute_ctx

    def setup(self, fresh):
        model = fresh()
        hf_checkpointing_enable(model, use_reentrant=False, context_fn=self._context_fn)
        funcs = [m._gradient_checkpointing_func for m in model.modules()
                 if getattr(m, "_gradient_checkpointing_func", None) is not None]
        if not any(getattr(f, "keywords", {}).get("context_fn") == self._context_fn for f in funcs):
            hf_checkpointing_disable(model)
            raise NotApplicable("this transformers version does not pass context_fn on to torch.utils.checkpoint")
        return model

    def teardown(self, model):
        hf_checkpointing_disable(model)

    @contextlib.contextmanager
    def context(self):
        self.recording = []  # only the caches of the current forward
        yield

    def extra_saved(self):
        out = []
        for storage in self.recording:
            for per_op in (storage or {}).values():
                # torch <= 2.11 keeps a list of outputs per op, later versions a dict index -> output.
                entries = per_op.values() if isinstance(per_op, dict) else per_op
                for entry in entries:
                    for leaf in torch.utils._pytree.tree_leaves(entry):
                        leaf = getattr(leaf, "val", leaf)  # torch wraps each cached output
                        if isinstance(leaf, torch.Tensor):
                            out.append(leaf)
        return out


class TorchSelectiveAttention(TorchSelective):
    """torch's selective checkpointing saving the fused SDPA kernels' outputs (output, log-sum-exp, ...): what
    ckpt_ext's keep="attention" keeps, the way torch offers it."""
    name = "torch-selective-attention"
    saves = tuple(op.name().split("::")[1] for op in sorted(LSE_OPS, key=str))
    summary = "Hugging Face's checkpointing, context_fn saving the fused SDPA kernels' outputs (MUST_SAVE)"


class EngineCheckpointing(Variant):
    name = "ckpt_ext"
    summary = "ckpt_ext.enable_checkpointing(model)"
    recomputes = True

    def setup(self, fresh):
        return ckpt_ext.enable_checkpointing(fresh())

    def teardown(self, model):
        ckpt_ext.disable_checkpointing(model)


class EngineKeepAttention(EngineCheckpointing):
    """enable_checkpointing(model, keep="attention"): the kept attention outputs and LSEs live outside
    autograd's saved tensors; they are recorded so their bytes are counted."""
    name = "ckpt_ext-keep-attention"
    summary = 'ckpt_ext.enable_checkpointing(model, keep="attention")'

    def __init__(self):
        self.kept: list = []

    def setup(self, fresh):
        return ckpt_ext.enable_checkpointing(fresh(), keep="attention")

    @contextlib.contextmanager
    def context(self):
        with recording_kept() as refs:
            self.kept = refs  # only the current forward's
            yield

    def extra_saved(self):
        return [t for t in (r() for r in self.kept) if t is not None]


class Fused(Variant):
    name = "fused"
    summary = "ckpt_ext.fuse(model), no checkpointing"

    def setup(self, fresh):
        return ckpt_ext.fuse(fresh())


class FusedCheckpointing(Variant):
    name = "ckpt_ext-fused"
    summary = "ckpt_ext.fuse(model), then enable_checkpointing"

    def setup(self, fresh):
        return ckpt_ext.enable_checkpointing(ckpt_ext.fuse(fresh()))

    def teardown(self, model):
        ckpt_ext.disable_checkpointing(model)


class FusedKeepAttention(FusedCheckpointing):
    """fuse, then enable_checkpointing(keep="attention"): each fused segment keeps its layers' attention output
    and log-sum-exp in pool slots (saved variables of the segment's node) next to its boundary."""
    name = "ckpt_ext-fused-keep-attention"
    summary = 'ckpt_ext.fuse(model), then enable_checkpointing(keep="attention")'

    def setup(self, fresh):
        return ckpt_ext.enable_checkpointing(ckpt_ext.fuse(fresh()), keep="attention")


class EngineBudget(Variant):
    """enable_checkpointing(model, budget=...): --budget, or half the activation bytes of `none` at the
    batch; re-planned whenever the batch changes. The planner may keep attention in some groups: those kept
    outputs and LSEs live outside autograd's saved tensors and are recorded, as for ckpt_ext-keep-attention."""
    name = "ckpt_ext-budget"
    summary = "ckpt_ext.enable_checkpointing(model, budget=...)"
    recomputes = True

    def __init__(self, budget: Optional[int] = None):
        self.budget, self.batch, self.used = budget, None, None
        self.kept: list = []

    @contextlib.contextmanager
    def context(self):
        with recording_kept() as refs:
            self.kept = refs  # only the current forward's
            yield

    def extra_saved(self):
        return [t for t in (r() for r in self.kept) if t is not None]

    def prepare(self, model, batch, workload, none_bytes):
        if batch != self.batch:
            self.used = self.budget if self.budget is not None else max(1, none_bytes(batch) // 2)
            # the next step probes and plans (disabled first: enabling again with the same budget keeps the plan)
            ckpt_ext.disable_checkpointing(model)
            ckpt_ext.enable_checkpointing(model, budget=self.used)
            self.batch = batch

    def teardown(self, model):
        ckpt_ext.disable_checkpointing(model)


COMPILE_MEMORY_BUDGET = 0.5


class CompileBudget(Variant):
    name = "compile-budget"
    summary = f"torch.compile, activation_memory_budget = {COMPILE_MEMORY_BUDGET}"

    def setup(self, fresh):
        return torch.compile(fresh())

    def context(self):
        return torch._functorch.config.patch(activation_memory_budget=COMPILE_MEMORY_BUDGET)


class Compiled(Variant):
    """torch.compile (inductor, default options) of another variant's model. The first step, untimed, compiles;
    Dynamo's graph breaks in it are counted (`graph_breaks`, a column of the table)."""

    def __init__(self, inner: Variant):
        self.inner = inner
        self.name = f"compiled-{inner.name}"
        self.summary = f"torch.compile of: {inner.summary}"
        self.recomputes = inner.recomputes
        self.graph_breaks: Optional[int] = None

    def unavailable(self):
        return self.inner.unavailable()

    def setup(self, fresh):
        # Every compiled variant (and its parity copy) adds an entry to the cache of the same code objects.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit,
                                                                512)
        return torch.compile(self.inner.setup(fresh))

    def teardown(self, model):
        self.inner.teardown(model._orig_mod)

    def prepare(self, model, batch, workload, none_bytes):
        self.inner.prepare(model._orig_mod, batch, workload, none_bytes)
        if self.graph_breaks is None:
            from torch._dynamo.utils import counters
            before = sum(counters["graph_break"].values())
            workload.step(self, model, batch)
            self.graph_breaks = sum(counters["graph_break"].values()) - before

    def context(self):
        return self.inner.context()

    def extra_saved(self):
        return self.inner.extra_saved()


class NotApplicable(Exception):
    """Raised by a variant's setup when it cannot apply here (the message says why)."""


VARIANTS: Dict[str, Callable[..., Variant]] = {
    "none": Variant,
    "hf-torch-nonreentrant": functools.partial(HFCheckpointing, reentrant=False),
    "hf-torch-reentrant": functools.partial(HFCheckpointing, reentrant=True),
    "torch-selective": TorchSelective,
    "torch-selective-attention": TorchSelectiveAttention,
    "ckpt_ext": EngineCheckpointing,
    "ckpt_ext-keep-attention": EngineKeepAttention,
    "fused": Fused,
    "ckpt_ext-fused": FusedCheckpointing,
    "ckpt_ext-fused-keep-attention": FusedKeepAttention,
    "ckpt_ext-budget": EngineBudget,
    "compile-budget": CompileBudget,
}
# The compiled variants: torch.compile of no checkpointing, Hugging Face + torch's checkpoint, ckpt_ext, fuse,
# and fuse + ckpt_ext checkpointing.
for _name in ("none", "hf-torch-nonreentrant", "ckpt_ext", "fused", "ckpt_ext-fused"):
    VARIANTS[f"compiled-{_name}"] = (lambda inner: lambda: Compiled(inner()))(VARIANTS[_name])


def make_variant(name: str, budget: Optional[int] = None) -> Variant:
    return VARIANTS[name](budget) if name == "ckpt_ext-budget" else VARIANTS[name]()
