"""ckpt_ext under torch.compile and CUDA graph capture.

torch.compile: ckpt_ext.checkpoint, checkpoint_sequential and enable_checkpointing (every=, budget=, plain
and fused) are traced without a graph break (fullgraph=True where torch's checkpoint allows it): a
checkpointed call becomes torch's activation-checkpoint higher-order op, a fused layer or checkpointed
group of fused layers the ckpt_ext::fused_segment operator (ckpt_ext/_compiler.py, compiled.py). Each test
checks the graph (the number of those nodes), that the eager engine did not run (no silent eager
fallback), the gradients against eager execution, and that a second step does not recompile. Most tests
use the aot_eager backend (Dynamo and AOTAutograd, no code generation); two use inductor, which compiles
C++ per graph on CPU.

With dropout on, the equalities stay exact: the partitioner's recompute replays the forward's random
numbers (functionalised RNG), and aot_eager draws them from the default generator as eager does. The
fused operators draw their seeds in the graph (other numbers than the eager C++ draw), so a compiled
fused model with dropout is compared with the same operators run eagerly (compiled.USE_OPS_EAGERLY), and
without dropout with the eager fused model itself.

CUDA graphs: what the engine cannot capture raises a clear error (checked on CPU by faking the capture
query, and on a GPU); dropout-free fused ops and fused layers capture and replay correctly (GPU).
"""
import copy
import functools
import warnings

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import ckpt_ext
import ckpt_ext._compiler
import ckpt_ext.compiled
import ckpt_ext.fused
from ckpt_ext import ops
from ckpt_ext.stack import _ATTR
from reference import assert_grads_close, leaf_inputs, make_block, make_stack, run_step
from helpers.hf_models import inputs_for, layers_of, make_model  # noqa: E402  (tiny Hugging Face models)

from helpers.compiling import Recorder  # noqa: E402
from helpers.devices import requires_cuda  # noqa: E402

CHECKPOINT_OP = "tag_activation_checkpoint"  # torch's activation-checkpoint higher-order op
SEGMENT_OP = "ckpt_ext.fused_segment"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


NOT_CHECKPOINTED_NOTICE = "that is not checkpointed runs as"  # fused._compiled_not_checkpointed's warning


def compiled_step(fn, inputs, params, seed=0, kwargs=None, notice=False):
    """run_step of a compiled function: no warning may be emitted (`notice`: except, exactly once, the one that a
    fused layer compiled without checkpointing replays, when it is not yet said), no graph may break and the eager
    engine (the C++ checkpoint frame) must not run."""
    frames = ckpt_ext._C.checkpoint_frames_created()
    if notice:
        ckpt_ext.fused._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message=".*torch.jit", category=DeprecationWarning)  # inductor's import
        result = run_step(fn, inputs, params=params, seed=seed, kwargs=kwargs)
    said = [str(w.message) for w in caught if NOT_CHECKPOINTED_NOTICE in str(w.message)]
    if notice:
        assert len(said) == 1 and "enable_checkpointing" in said[0], said
    caught = [w for w in caught if not notice or NOT_CHECKPOINTED_NOTICE not in str(w.message)]
    assert not caught, [str(w.message) for w in caught]
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert ckpt_ext._C.checkpoint_frames_created() == frames, "the eager engine ran under torch.compile"
    return result


def second_step_does_not_recompile(fn, inputs, params, seed=0, kwargs=None):
    with torch.compiler.set_stance("fail_on_recompile"):
        return run_step(fn, inputs, params=params, seed=seed, kwargs=kwargs)


class Net(nn.Module):
    """inp -> two checkpointed MLP blocks (dropout inside) -> out."""

    def __init__(self, p=0.3, checkpointed=True, **options):
        super().__init__()
        self.inp = nn.Linear(7, 19)
        self.blocks = make_stack(2, p=p)
        self.out = nn.Linear(19, 5)
        self.checkpointed = checkpointed
        self.options = options

    def forward(self, x):
        h = self.inp(x)
        if self.checkpointed:
            h = ckpt_ext.checkpoint(self.blocks[0], h, use_reentrant=False, **self.options)
            h = ckpt_ext.checkpoint(self.blocks[1], h, use_reentrant=False, **self.options)
        else:
            h = self.blocks[1](self.blocks[0](h))
        return self.out(h)


def _plain(model):
    plain = copy.deepcopy(model)
    plain.checkpointed = False
    return plain


# ---- ckpt_ext.checkpoint, checkpoint_sequential, enable_checkpointing: torch's higher-order op ----------------------


@pytest.mark.parametrize("p", [0.0, 0.3], ids=["no-dropout", "dropout"])
def test_checkpoint_compiles_fullgraph_and_equals_eager(p):
    model = Net(p)
    x = leaf_inputs((4, 7))
    eager = run_step(_plain(model), x, seed=0)
    params = dict(model.named_parameters())
    backend = Recorder()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    assert_grads_close(compiled_step(compiled, x, params), eager, exact=True)
    assert backend.count(CHECKPOINT_OP) == 2 and len(backend.graphs) == 1
    assert_grads_close(second_step_does_not_recompile(compiled, x, params), eager, exact=True)


def test_checkpoint_options_under_compile():
    """A selective-checkpointing context_fn (honoured by the partitioner), the function's own keywords
    and preserve_rng_state pass through to torch's checkpoint."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    policy = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    block = make_block(p=0.3)
    x = leaf_inputs((4, 19))
    params = dict(block.named_parameters())
    expected = run_step(lambda h: block(h) * 2, x, params=params, seed=2)

    def fn(h):
        return ckpt_ext.checkpoint(lambda h, scale: block(h) * scale, h, scale=2, context_fn=policy,
                                   determinism_check="none", use_reentrant=False)

    backend = Recorder()
    got = compiled_step(torch.compile(fn, backend=backend, fullgraph=True), x, params, seed=2)
    assert_grads_close(got, expected, exact=True)
    assert backend.count(CHECKPOINT_OP) == 1


def test_checkpoint_sequential_compiles_fullgraph():
    stack = make_stack(4, p=0.3)
    x = leaf_inputs((4, 19))
    eager = run_step(copy.deepcopy(stack), x, seed=1)
    backend = Recorder()
    compiled = torch.compile(lambda h: ckpt_ext.checkpoint_sequential(stack, 3, h, use_reentrant=False), backend=backend,
                             fullgraph=True)
    params = dict(stack.named_parameters())
    assert_grads_close(compiled_step(compiled, x, params, seed=1), eager, exact=True)
    assert backend.count(CHECKPOINT_OP) == 2
    second_step_does_not_recompile(compiled, x, params, seed=1)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = make_stack(4, p=0.3)
        self.head = nn.Linear(19, 3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize("every", [1, 2])
def test_enable_checkpointing_on_a_layer_stack_compiles_fullgraph(every):
    model = Stack()
    x = leaf_inputs((4, 19))
    eager = run_step(copy.deepcopy(model), x, seed=0)
    ckpt_ext.enable_checkpointing(model, every=every)
    params = dict(model.named_parameters())
    backend = Recorder()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    assert_grads_close(compiled_step(compiled, x, params), eager, exact=True)
    assert backend.count(CHECKPOINT_OP) == 4 // every
    assert_grads_close(second_step_does_not_recompile(compiled, x, params), eager, exact=True)


def test_enable_checkpointing_budget_compiles_its_plan():
    """budget=: the plan is made in eager training steps (the planner measures real runs); compiled
    afterwards, its groups are traced (kept layers plain, the others as the higher-order op)."""
    model = Stack()
    x = leaf_inputs((4, 19))
    eager = run_step(copy.deepcopy(model), x, seed=0)
    ckpt_ext.enable_checkpointing(model, budget="6KiB")  # all checkpointed: 3.3 KiB
    params = dict(model.named_parameters())
    for _ in range(2):  # the first step measures and plans, the second installs the plan
        assert_grads_close(run_step(model, x, params=params, seed=0), eager, exact=True)
    assert "plan in use" in ckpt_ext.explain(model)
    backend = Recorder()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    assert_grads_close(compiled_step(compiled, x, params), eager, exact=True)
    # One higher-order op per checkpointed group of the plan, kept layers plain. Which layers the plan keeps
    # depends on the times the planner measured (usually some kept: 1-3 ops; a loaded machine may plan otherwise).
    plan = model.layers[0].__dict__[_ATTR].planner.plan
    groups = sum(1 for _start, _end, how in plan.segments if how)
    assert backend.count(CHECKPOINT_OP) == groups >= 1, plan.describe()
    second_step_does_not_recompile(compiled, x, params)


def test_inference_compiles_without_graph_breaks():
    """Without grad nothing is checkpointed: checkpoint(), checkpoint_sequential() and checkpointed layers
    are traced like the plain model (fullgraph=True)."""
    model = Net(p=0.3)
    stack = make_stack(4, dim=5, hidden=7, p=0.0)  # left in training mode: no_grad alone turns checkpointing off
    ckpt_ext.enable_checkpointing(stack, every=2)
    x = torch.randn(4, 7)

    def infer(x):
        return ckpt_ext.checkpoint_sequential(stack, 2, stack(model(x)), use_reentrant=False)

    model.eval()
    with torch.no_grad():
        expected = infer(x)
        got = torch.compile(infer, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("budget", [0.5, 0.0])
def test_compiled_dropout_gradients_with_a_memory_budget(budget):
    """torch's compiled recompute with activation_memory_budget < 1 may redraw dropout masks (pytorch
    issue 190717: the partitioner recomputes random ops it chose to recompute itself, outside any
    checkpoint, with fresh random numbers). ckpt_ext's checkpointed regions are the higher-order op,
    whose random ops the partitioner replays with the forward's RNG state: eager's gradients."""
    model = Net(p=0.3)
    x = leaf_inputs((4, 7))
    eager = run_step(_plain(model), x, seed=0)
    params = dict(model.named_parameters())
    with torch._functorch.config.patch(activation_memory_budget=budget):
        got = compiled_step(torch.compile(model, backend="aot_eager", fullgraph=True), x, params)
    assert_grads_close(got, eager, exact=True)


# ---- Hugging Face models -------------------------------------------------------------------------------------------


def _hf(family, dropout, layers=2):
    model = make_model(family, dropout=dropout, layers=layers).train()
    kw = inputs_for(family, padding=True)
    if family != "bert":
        kw["use_cache"] = False
    return model, kw


def _hf_step(model, kw, seed, compiled=None):
    target = compiled if compiled is not None else model
    return run_step(lambda: target(**kw).last_hidden_state, [], params=dict(model.named_parameters()), seed=seed)


def _autocast_step(target, model, kw, seed):
    """run_step of `target` (the model, or its compiled form) under CPU autocast (bfloat16), `model`'s parameters."""
    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return target(**kw).last_hidden_state.float()
    return run_step(forward, [], params=dict(model.named_parameters()), seed=seed)


def _checkpointing(model, every):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' is_gradient_checkpointing rename
        ckpt_ext.enable_checkpointing(model, every=every)
    return model


def _compiled_checkpointed_step(model, kw):
    """(compiled model, its Recorder backend, the parameters, one compiled step at seed 4) of `model` checkpointed
    every 2 layers and compiled with fullgraph=True."""
    _checkpointing(model, every=2)
    backend = Recorder()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    params = dict(model.named_parameters())
    return compiled, backend, params, compiled_step(lambda: compiled(**kw).last_hidden_state, [], params, seed=4)


def _eager_fused_reference(model, kw, dropout):
    """One step of a copy of the fused `model` run eagerly, the reference of its compiled run: without dropout
    the eager fused model; with dropout the checkpointed copy through the same operators run eagerly
    (compiled.USE_OPS_EAGERLY), which draw the same seeds in the same order."""
    if not dropout:
        return _hf_step(copy.deepcopy(model), kw, seed=4)
    ckpt_ext.compiled.USE_OPS_EAGERLY = True
    try:
        return _hf_step(_checkpointing(copy.deepcopy(model), every=2), kw, seed=4)
    finally:
        ckpt_ext.compiled.USE_OPS_EAGERLY = False


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_hugging_face_model_checkpointed_compiles_fullgraph(family):
    model, kw = _hf(family, dropout=0.2, layers=4)
    eager = _hf_step(copy.deepcopy(model), kw, seed=3)
    _checkpointing(model, every=2)
    backend = Recorder()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    got = compiled_step(lambda: compiled(**kw).last_hidden_state, [], dict(model.named_parameters()), seed=3)
    assert_grads_close(got, eager, exact=True)
    assert backend.count(CHECKPOINT_OP) == 2
    second_step_does_not_recompile(lambda: compiled(**kw).last_hidden_state, [], dict(model.named_parameters()), 3)


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama", "qwen2", "mistral", "qwen3", "gemma", "gemma3", "gemma2"])
def test_fused_hugging_face_model_compiles_to_fused_segment_ops(family):
    """fuse + enable_checkpointing(every=2): one ckpt_ext::fused_segment per group (BERT:
    ckpt_ext::fused_segment_boundary, which carries the pre-norm boundary; test_compile_boundary.py), no graph
    break. Without dropout the compiled model equals the eager fused model; with dropout, the same operators run
    eagerly (same seeds drawn in the same order)."""
    for dropout in (0.0, 0.2):
        torch._dynamo.reset()
        model, kw = _hf(family, dropout=dropout, layers=4)
        ckpt_ext.fuse(model)
        eager = _eager_fused_reference(model, kw, dropout)
        ckpt_ext.fused._warned.clear()  # checkpointed: no notice (compiled_step accepts no warning)
        compiled, backend, params, got = _compiled_checkpointed_step(model, kw)
        assert_grads_close(got, eager, exact=True)
        op = SEGMENT_OP + "_boundary" if family == "bert" else SEGMENT_OP
        assert backend.count(op) == 2 and backend.count(CHECKPOINT_OP) == 0
        second_step_does_not_recompile(lambda: compiled(**kw).last_hidden_state, [], params, seed=5)


def test_fused_segment_under_autocast_equals_eager():
    """CPU autocast (bfloat16): the operator runs and replays the layers under the forward's autocast state
    (passed as its autocast_dtype), as SegmentFunction does: the eager fused model's outputs and gradients."""
    model, kw = _hf("llama", dropout=0.0, layers=2)
    ckpt_ext.fuse(model)
    reference = copy.deepcopy(model)
    eager = _autocast_step(reference, reference, kw, seed=0)
    _checkpointing(model, every=2)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    assert_grads_close(_autocast_step(compiled, model, kw, seed=0), eager, exact=True)
    assert not counters["graph_break"]


def test_fused_layers_without_checkpointing_compile_and_take_dynamic_shapes():
    """A fused layer not checkpointed is a one-layer fused_segment; with dynamic=True a new sequence length
    and new dropout seeds reuse the graph."""
    model, kw = _hf("bert", dropout=0.0, layers=2)
    ckpt_ext.fuse(model)
    eager = _hf_step(copy.deepcopy(model), kw, seed=0)
    backend = Recorder()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    params = dict(model.named_parameters())
    # Said once (at trace time, no graph break): the operator replays the layer, a checkpoint in all but name.
    got = compiled_step(lambda: compiled(**kw).last_hidden_state, [], params, notice=True)
    assert_grads_close(got, eager, exact=True)
    assert backend.count(SEGMENT_OP) == 2
    shorter = {k: v[:, :-2].contiguous() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    eager = _hf_step(model, shorter, seed=0)
    with torch.compiler.set_stance("fail_on_recompile"):
        assert_grads_close(_hf_step(model, shorter, seed=0, compiled=compiled), eager, exact=True)


EAGER_LAYER = "fused_layer_runs_eagerly_under_compile"  # the function a not-checkpointed fused layer breaks the graph at


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama", "qwen3", "gemma", "gemma3", "gemma2"])
@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["nodrop", "dropout"])
def test_fused_layers_not_checkpointed_run_eagerly_between_graphs(family, dropout):
    """fuse alone, compiled without fullgraph=True, in training: each fused layer runs as the eager fused layer
    between two graphs (its C++ autograd keeps the activations; no ckpt_ext::fused_segment, which would replay the
    layer in backward), so the step is eager fuse's: outputs and every gradient bit-identical to the eager fused
    model, dropout included (aot_eager draws the graphs' random numbers from the default generator as eager does,
    and the eager layer draws its seed there). No notice, no recompile at the next step; the graph breaks are at
    that function (and Hugging Face's own code around it)."""
    model, kw = _hf(family, dropout=dropout, layers=3)
    ckpt_ext.fuse(model)
    eager = _hf_step(copy.deepcopy(model), kw, seed=4)
    backend = Recorder()
    compiled = torch.compile(model, backend=backend)
    params = dict(model.named_parameters())
    ckpt_ext.fused._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message=".*torch.jit", category=DeprecationWarning)
        got = _hf_step(model, kw, seed=4, compiled=compiled)
    assert not [str(w.message) for w in caught if "ckpt_ext" in str(w.message)]
    assert_grads_close(got, eager, exact=True)
    assert backend.count(SEGMENT_OP) == 0
    assert any(EAGER_LAYER in reason for reason in counters["graph_break"]), dict(counters["graph_break"])
    graphs = len(backend.graphs)
    with torch.compiler.set_stance("fail_on_recompile"):
        again = _hf_step(model, kw, seed=5, compiled=compiled)
    assert len(backend.graphs) == graphs
    assert_grads_close(again, _hf_step(copy.deepcopy(model), kw, seed=5), exact=True)


def test_fused_layers_not_checkpointed_under_compile_autocast_lora_and_eval():
    """The eager-between-graphs path under CPU autocast (the autocast state reaches the eager layer across the graph
    break) and with peft LoRA adapters (read per call, as eagerly): bit-identical to the eager fused model. In eval
    (no backward) and under fullgraph=True the layers stay the ckpt_ext::fused_segment operator: no graph break."""
    model, kw = _lora("llama", lora_dropout=0.1, layers=2)
    ckpt_ext.fuse(model)
    reference = copy.deepcopy(model)
    eager = _autocast_step(reference, reference, kw, seed=2)
    backend = Recorder()
    compiled = torch.compile(model, backend=backend)
    assert_grads_close(_autocast_step(compiled, model, kw, seed=2), eager, exact=True)
    assert backend.count(SEGMENT_OP) == 0
    assert any(EAGER_LAYER in reason for reason in counters["graph_break"])

    torch._dynamo.reset()
    counters.clear()
    model.eval()
    backend = Recorder()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        torch.testing.assert_close(compiled(**kw).last_hidden_state, reference.eval()(**kw).last_hidden_state,
                                   rtol=0, atol=0)
    assert backend.count(SEGMENT_OP) == 2 and not counters["graph_break"], dict(counters["graph_break"])


def test_graph_breaks_allowed_reads_dynamo_s_flags():
    """fused._graph_breaks_allowed (read while Dynamo traces, a constant of the graph): True in a frame traced
    without fullgraph, False with fullgraph=True and outside tracing -- what decides between the eager layer
    behind a graph break and the replaying operator."""
    seen = []

    def probe(x):
        seen.append(ckpt_ext.fused._graph_breaks_allowed())
        return x + 1

    torch.compile(probe, backend="eager")(torch.ones(1))
    torch._dynamo.reset()
    torch.compile(probe, backend="eager", fullgraph=True)(torch.ones(1))
    assert seen == [True, False]
    assert ckpt_ext.fused._graph_breaks_allowed() is False


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
def test_fused_segment_opcheck(lora):
    """The operator's schema, fake kernel and autograd registration (torch.library.opcheck), with peft LoRA
    adapters (on some projections: absent adapters are -1 layout entries) and without."""
    if lora:  # adapters on 3 of the 7 projections, adapter dropout only
        model, _ = _lora("llama", layers=2, lora_dropout=0.1, targets=["q_proj", "v_proj", "down_proj"])
    else:
        model, _ = _hf("llama", dropout=0.1, layers=2)
    ckpt_ext.fuse(model)
    layers = [m for m in model.modules() if isinstance(m, ckpt_ext.fused.FusedTransformerLayer)]
    hidden = torch.randn(2, 5, 72, requires_grad=True)
    cos, sin = model.get_base_model().rotary_emb(hidden, torch.arange(5)[None]) if lora else \
        model.rotary_emb(hidden, torch.arange(5)[None])
    ids, weights, layout, dropout = ckpt_ext.compiled.operator_args(layers)
    assert dropout and (ids == [layer.spec_id for layer in layers]) != lora
    slots = [w for layer in layers for w in layer.fused_weights()]
    # with adapters: A and B of 3 projections in each layer are weights; all 7 projections have layout entries
    assert len(weights) == sum(w is not None for w in slots) + lora * 2 * 3 * 2
    assert len(layout) == len(slots) + lora * 2 * 7 * 2
    args = (ids, hidden, None, cos, sin, weights, layout, True, torch.tensor([3, 4]), None)
    torch.library.opcheck(torch.ops.ckpt_ext.fused_segment.default, args)
    grad = torch.randn(2, 5, 72)
    needs = [1] + [int(i % 2 == 0) for i in range(len(weights))]
    backward_args = (args[0], grad, hidden.detach(), None, cos, sin, [w.detach() for w in weights], *args[6:], needs)
    torch.library.opcheck(torch.ops.ckpt_ext.fused_segment_backward.default, backward_args)


LORA_TARGETS = {"bert": ["query", "key", "value", "dense"], "gpt2": ["c_attn", "c_proj", "c_fc"],
                "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def _lora(family, dropout=0.0, lora_dropout=0.0, layers=4, targets=None):
    """A tiny Hugging Face model with peft LoRA adapters on `targets` (default: every projection the fused
    layers take), B not zero (peft initialises it to zero: every adapter gradient informative)."""
    peft = pytest.importorskip("peft")
    model, kw = _hf(family, dropout=dropout, layers=layers)
    config = peft.LoraConfig(r=2, lora_alpha=5, lora_dropout=lora_dropout,
                             target_modules=targets or LORA_TARGETS[family], fan_in_fan_out=family == "gpt2")
    model = peft.get_peft_model(model, config).train()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model, kw


def _close_to_peft(got, expected, tol=1e-4):
    """Fused vs peft's own forward, which rounds differently (other GEMM groupings; adapters large against the
    tiny base weights): the output within `tol` of its largest value, each gradient within `tol` of the
    largest gradient of the model (as tests/helpers/hf_models.grads_close scales)."""
    torch.testing.assert_close(got.outputs, expected.outputs, rtol=tol, atol=tol * expected.outputs.abs().max().item())
    assert got.param_grads.keys() == expected.param_grads.keys()
    scale = max(g.abs().max().item() for g in expected.param_grads.values() if g is not None)
    for name, g in expected.param_grads.items():
        assert (g is None) == (got.param_grads[name] is None), name
        if g is not None:
            torch.testing.assert_close(got.param_grads[name], g, rtol=tol, atol=tol * scale,
                                       msg=lambda m: f"gradient of {name}: {m}")


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_fused_layers_with_lora_compile_to_fused_segment_ops(family):
    """peft LoRA on fused layers under torch.compile: the adapters (A, B, scaling, adapter dropout) are inputs of
    ckpt_ext::fused_segment, so no graph break. Without dropout: peft's own eager model's output and the
    gradient of every parameter (the adapters'; the base weights are frozen and get none), and the eager fused
    model's bit for bit; with dropout (adapter, and hidden but for Llama), the same operators run eagerly. No
    recompilation at step 2; disabling the adapters is followed (guarded), not a stale graph."""
    # Llama: adapter dropout alone (then the LoRA spec, not the layer's own, says the operator draws seeds).
    for dropout, lora_dropout in ((0.0, 0.0), (0.0, 0.2) if family == "llama" else (0.2, 0.2)):
        torch._dynamo.reset()
        counters.clear()
        model, kw = _lora(family, dropout=dropout, lora_dropout=lora_dropout)
        peft_eager = _hf_step(copy.deepcopy(model), kw, seed=4)
        ckpt_ext.fuse(model)
        eager = _eager_fused_reference(model, kw, lora_dropout)
        if not lora_dropout:
            _close_to_peft(eager, peft_eager)
        compiled, backend, params, got = _compiled_checkpointed_step(model, kw)
        assert_grads_close(got, eager, exact=True)
        trainable = {n for n, p in params.items() if p.requires_grad}
        assert trainable and all("lora_" in n for n in trainable)
        assert {n for n, g in got.param_grads.items() if g is not None} == trainable
        if not lora_dropout:
            _close_to_peft(got, peft_eager)
        assert backend.count(SEGMENT_OP) == 2 and backend.count(CHECKPOINT_OP) == 0
        second_step_does_not_recompile(lambda: compiled(**kw).last_hidden_state, [], params, seed=5)
        if not lora_dropout:
            model.get_input_embeddings().weight.requires_grad_(True)  # a gradient through the fused layers
            with model.disable_adapter():
                plain = _hf_step(model, kw, seed=4)  # eager fused, no adapter terms
                assert_grads_close(_hf_step(model, kw, seed=4, compiled=compiled), plain, exact=True)


def test_fused_lora_layers_not_checkpointed_compile_with_a_trainable_base():
    """Fused LoRA layers not checkpointed (one-layer segments), every parameter trainable (base weights and
    biases too): the gradient of every parameter equals peft's eager one; zero graph breaks, no recompilation."""
    model, kw = _lora("llama", layers=2)
    for p in model.parameters():
        p.requires_grad_(True)
    peft_eager = _hf_step(copy.deepcopy(model), kw, seed=0)
    ckpt_ext.fuse(model)
    backend = Recorder()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    params = dict(model.named_parameters())
    got = compiled_step(lambda: compiled(**kw).last_hidden_state, [], params, notice=True)
    assert all(g is not None for g in got.param_grads.values())
    _close_to_peft(got, peft_eager)
    assert backend.count(SEGMENT_OP) == 2
    second_step_does_not_recompile(lambda: compiled(**kw).last_hidden_state, [], params)


class _FixedRotary(nn.Module):
    """Llama's rotary embedding replaced by given tables (which may require grad)."""

    def __init__(self, cos, sin):
        super().__init__()
        self.cos, self.sin = cos, sin

    def forward(self, *args, **kwargs):
        return self.cos, self.sin



def _assert_compile_refuses(model, kw, fullgraph, match):
    """The compiled model's call raises the refusal `match` (NotImplementedError, or with fullgraph=True Dynamo's
    own error carrying the message) and never runs the eager engine instead (no checkpoint frame created)."""
    compiled = torch.compile(model, backend="aot_eager", fullgraph=fullgraph)
    frames = ckpt_ext._C.checkpoint_frames_created()
    with pytest.raises(Exception, match=match) as raised:
        compiled(**kw)
    if not fullgraph:
        assert raised.type is NotImplementedError
    assert ckpt_ext._C.checkpoint_frames_created() == frames

@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph-breaks-allowed", "fullgraph"])
def test_fused_layer_whose_rotary_tables_require_grad_under_compile_raises_a_clear_error(fullgraph):
    """The operator does not differentiate the mask or rotary tables: said under torch.compile, never run
    eagerly instead. torch 2.15's Dynamo gives up on the frame after the raise in traced code and runs it
    eagerly; that eager run (in_compile_fallback) refuses too. With fullgraph=True Dynamo raises its own error
    carrying the message."""
    model, kw = _hf("llama", dropout=0.0, layers=2)
    ckpt_ext.fuse(model)
    with torch.no_grad():
        cos, sin = model.rotary_emb(torch.ones(1), torch.arange(kw["input_ids"].shape[1])[None])
    model.rotary_emb = _FixedRotary(cos.requires_grad_(), sin)
    _assert_compile_refuses(model, kw, fullgraph, "does not differentiate its attention mask or rotary tables")
    assert not ckpt_ext._compiler.in_compile_fallback()


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph-breaks-allowed", "fullgraph"])
def test_keep_attention_of_fused_layers_under_compile_runs_as_boundaries(fullgraph):
    """keep="attention" on checkpointed fused layers under torch.compile: the operator keeps only its input, so the
    groups run as keep="boundaries" (one warning at trace time), never failing the step and never running the eager
    engine; gradients as the eager keep="attention" step's."""
    import ckpt_ext.keep as keep_mod
    torch._dynamo.reset()
    keep_mod._warned.discard(("compiled fused level", "attention"))
    model, kw = _hf("bert", dropout=0.0, layers=2)
    ckpt_ext.fuse(model)
    eager = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ckpt_ext.enable_checkpointing(model, every=2, keep="attention")
        ckpt_ext.enable_checkpointing(eager, every=2, keep="attention")
    compiled = torch.compile(model, backend="aot_eager", fullgraph=fullgraph)
    frames = ckpt_ext._C.checkpoint_frames_created()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compiled(**kw).last_hidden_state.sum().backward()
    assert ckpt_ext._C.checkpoint_frames_created() == frames
    assert [str(w.message) for w in seen if "run as keep='boundaries'" in str(w.message)], \
        [str(w.message) for w in seen]
    eager(**kw).last_hidden_state.sum().backward()
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)
    torch._dynamo.reset()


def test_eager_run_inside_a_compiled_region_refuses_what_compile_refuses(monkeypatch):
    """The eager run of an entry point while Dynamo's frame hook is set (a frame Dynamo gave up on) is marked
    (in_compile_fallback), for the call and what it calls, and the fused layers' compile-only refusals apply
    there; what compile accepts runs eagerly as before. Faked here (frame hook reported set) so that every
    torch checks it, not only 2.15, whose Dynamo takes this path after an exception in traced code."""
    model, kw = _hf("llama", dropout=0.0, layers=2)
    ckpt_ext.fuse(model)
    layer = layers_of(model)[0]
    x = torch.randn(2, 5, model.config.hidden_size, requires_grad=True)
    with torch.no_grad():
        cos, sin = model.rotary_emb(x, torch.arange(5)[None])
    expected = layer(x, position_embeddings=(cos, sin))
    monkeypatch.setattr(ckpt_ext._compiler, "_frame_hook_active", lambda: True)
    seen = []
    monkeypatch.setattr(type(layer), "_check_compilable",
                        lambda self, call: seen.append(ckpt_ext._compiler.in_compile_fallback()))
    assert torch.equal(layer(x, position_embeddings=(cos, sin)), expected)  # accepted: the eager fused path
    assert seen == [True] and not ckpt_ext._compiler.in_compile_fallback()
    monkeypatch.undo()
    monkeypatch.setattr(ckpt_ext._compiler, "_frame_hook_active", lambda: True)
    with pytest.raises(NotImplementedError, match="does not differentiate its attention mask or rotary tables"):
        layer(x, position_embeddings=(cos.detach().requires_grad_(), sin))
    assert not ckpt_ext._compiler.in_compile_fallback()
    with torch.no_grad():  # nothing is differentiated: accepted
        layer(x, position_embeddings=(cos.detach().requires_grad_(), sin))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ckpt_ext.enable_checkpointing(model, every=2, keep="attention")
    model(**kw).last_hidden_state.sum().backward()  # the eager run keeps the attention, as eager steps do


def test_compiled_block_inside_checkpoint_keeps_its_dropout_masks():
    """ckpt_ext.checkpoint(torch.compile(block), x), called eagerly: the eager engine runs the compiled
    block in forward and in its replay, with the same random numbers."""
    block = make_block(p=0.3)
    compiled_block = torch.compile(block, backend="aot_eager")
    x = leaf_inputs((4, 19))
    params = dict(block.named_parameters())
    expected = run_step(compiled_block, x, params=params, seed=5)
    frames = ckpt_ext._C.checkpoint_frames_created()
    got = run_step(lambda h: ckpt_ext.checkpoint(compiled_block, h, use_reentrant=False), x, params=params, seed=5)
    assert ckpt_ext._C.checkpoint_frames_created() == frames + 1
    assert_grads_close(got, expected, exact=True)
    assert counters["stats"]["unique_graphs"] == 1  # forward and replay both run with grad (torch's design)
    second_step_does_not_recompile(lambda h: ckpt_ext.checkpoint(compiled_block, h, use_reentrant=False), x, params,
                                   seed=5)


def test_inductor_with_checkpoint():
    """Inductor draws dropout masks with its own RNG unless fallback_random: with it, the masks (forward
    and recompute) are eager's."""
    model = Net(p=0.3)
    x = leaf_inputs((4, 7))
    params = dict(model.named_parameters())
    eager = run_step(_plain(model), x, seed=0)
    with torch._inductor.config.patch(fallback_random=True):
        got = compiled_step(torch.compile(model, fullgraph=True), x, params)
    assert_grads_close(got, eager, rtol=1e-5, atol=1e-6)  # inductor's linear layers round differently


# ---- fused ops: no graph break ---------------------------------------------------------------------------------------


def fused_ops_program(x, res, b, w, lb, gate, up, cos, sin, seed: int):
    """Every forward op, chained; its backward runs every *_backward op."""
    h = ops.bias_gelu(x, b, "tanh")
    h = ops.bias_dropout_add(h, b, res, 0.1, seed, 0)
    out, pre, _, _, _ = ops.bias_dropout_add_layer_norm(h, b, res, w, lb, 0.1, 1e-5, seed, 4)
    out, pre, _, _ = ops.add_layer_norm(out, pre, w, lb, 1e-5)
    out, pre, _ = ops.add_rms_norm(out, pre, w, 1e-6)
    act = ops.swiglu(gate, up)
    rot = ops.rotary(act.view(2, 3, 4, 8).transpose(1, 2), cos, sin)
    keep = ops.dropout_mask(out.numel(), 0.5, seed, 8, out.device)
    return out * keep.view_as(out) + ops.dropout(pre, 0.2, seed, 12), rot


def fused_ops_inputs(seq=4):
    *grads, cos, sin = leaf_inputs((2, seq, 24), (2, seq, 24), (24,), (24,), (24,), (2, 3, 32), (2, 3, 32),
                                   (3, 8), (3, 8), requires_grad=[True] * 7 + [False] * 2)
    return [*grads, cos, sin]


def test_fused_ops_compile_fullgraph_with_dynamic_seeds_and_shapes():
    compiled = torch.compile(fused_ops_program, backend="aot_eager", fullgraph=True, dynamic=True)
    for seq, seed in [(4, 5), (4, 6), (6, 7)]:
        inputs = fused_ops_inputs(seq)
        expected = run_step(fused_ops_program, inputs, kwargs={"seed": seed})
        assert_grads_close(run_step(compiled, inputs, kwargs={"seed": seed}), expected, exact=True)
    assert counters["stats"]["unique_graphs"] == 1  # one graph for every seed and sequence length


def test_fused_ops_compile_fullgraph_with_inductor():
    inputs = fused_ops_inputs()
    expected = run_step(fused_ops_program, inputs, kwargs={"seed": 7})
    got = run_step(torch.compile(fused_ops_program, fullgraph=True), inputs, kwargs={"seed": 7})
    assert_grads_close(got, expected, rtol=1e-5, atol=1e-5)


# ---- CUDA graph capture: errors, checked on CPU by faking the capture query -----------------------------------------


@pytest.fixture
def capturing(monkeypatch):
    monkeypatch.setattr(ckpt_ext._compiler, "_stream_capturing", lambda: True)


CAPTURE_ERROR = "cannot be captured in a CUDA graph"


def test_capture_errors_for_the_checkpoint_engine(capturing):
    block = make_block()
    x = leaf_inputs((4, 19))[0]
    before = ckpt_ext.pool_stats("cpu")["in_use_bytes"]
    with pytest.raises(RuntimeError, match=f"checkpointing `MLPBlock` .* {CAPTURE_ERROR}.*disable_checkpointing"):
        ckpt_ext.checkpoint(block, x, use_reentrant=False)
    with pytest.raises(RuntimeError, match=CAPTURE_ERROR):
        ckpt_ext.checkpoint_sequential(make_stack(2), 2, x, use_reentrant=False)
    assert ckpt_ext.pool_stats("cpu")["in_use_bytes"] == before
    with torch.no_grad():  # nothing is checkpointed: allowed
        ckpt_ext.checkpoint(block, x, use_reentrant=False)


def test_capture_errors_for_fused_layers_only_where_they_draw_seeds_or_pool(capturing):
    hidden = torch.randn(2, 5, 72)
    with_dropout = layers_of(ckpt_ext.fuse(make_model("bert", dropout=0.1))).train()
    with pytest.raises(RuntimeError, match=f"fused BertLayer with dropout in training {CAPTURE_ERROR}.*model.eval"):
        with_dropout[0](hidden)
    with_dropout.eval()
    with_dropout[0](hidden)  # eval: no dropout, no seed
    no_dropout = layers_of(ckpt_ext.fuse(make_model("bert", dropout=0.0))).train()
    no_dropout[0](hidden.requires_grad_()).sum().backward()  # training without dropout: plain ops
    ckpt_ext.enable_checkpointing(no_dropout)
    with pytest.raises(RuntimeError, match=f"checkpointed fused layers .* {CAPTURE_ERROR}"):
        no_dropout[0](hidden)  # the segment's output would live in the BoundaryPool
    x, res, b = leaf_inputs((3, 8), (3, 8), (8,))
    ops.bias_dropout_add(x, b, res, 0.5, 1, 0)  # the ops are pure functions of (seed, offset): allowed


# ---- CUDA graph capture on a GPU -------------------------------------------------------------------------------------


def _capture(fn):
    """Warm-up on a side stream (as torch.cuda.graph's documentation asks), then capture fn()."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@requires_cuda
@pytest.mark.cuda
def test_cuda_graph_errors_for_the_engine():
    block = make_block().cuda()
    x = torch.randn(4, 19, device="cuda", requires_grad=True)
    with pytest.raises(RuntimeError, match=f"checkpointing `MLPBlock` .* {CAPTURE_ERROR}"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            ckpt_ext.checkpoint(block, x, use_reentrant=False)
    layers = layers_of(ckpt_ext.fuse(make_model("bert", dropout=0.1))).cuda().train()
    hidden = torch.randn(2, 5, 72, device="cuda")
    with pytest.raises(RuntimeError, match=f"with dropout in training {CAPTURE_ERROR}"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            layers[0](hidden)
    ckpt_ext.enable_checkpointing(layers)
    with pytest.raises(RuntimeError, match=f"checkpointed fused layers .* {CAPTURE_ERROR}"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            layers[0](hidden.requires_grad_())
    assert not torch.cuda.is_current_stream_capturing()


@requires_cuda
@pytest.mark.cuda
def test_cuda_graph_replays_the_fused_ops():
    inputs = [t.detach().cuda() for t in fused_ops_inputs()]

    def program():  # dropout included: a mask is a function of the (seed, offset) passed, baked into the graph
        return fused_ops_program(*inputs, seed=11)

    graph, outs = _capture(program)
    for step in range(2):
        for t in inputs[:2] + inputs[5:7]:
            t.copy_(torch.randn_like(t))
        graph.replay()
        for got, expected in zip(outs, program()):
            assert torch.equal(got, expected), step


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_cuda_graph_captures_a_dropout_free_fused_layer_forward_and_backward(family):
    model = ckpt_ext.fuse(make_model(family, dropout=0.0, layers=1)).cuda().train()
    layer = layers_of(model)[0]
    hidden = torch.randn(2, 5, 72, device="cuda", requires_grad=True)
    kwargs = {}
    if family == "llama":
        kwargs["position_embeddings"] = model.rotary_emb(hidden, torch.arange(5, device="cuda")[None])
    weights = list(layer.parameters())

    def step():
        for p in weights:
            p.grad = None
        hidden.grad = None
        out = layer(hidden, **kwargs)
        out.square().sum().backward()
        return out.detach(), hidden.grad, [p.grad for p in weights]

    graph, (out, grad, grads) = _capture(step)
    with torch.no_grad():
        hidden.copy_(torch.randn_like(hidden))
    graph.replay()
    replayed = (out.clone(), grad.clone(), [g.clone() for g in grads])
    eager = step()  # same inputs
    assert torch.equal(replayed[0], eager[0])
    # Attention's backward may accumulate in a different order from one run to the next.
    torch.testing.assert_close(replayed[1], eager[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(replayed[2], eager[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_engine_runs_eagerly_from_frames_a_compiled_region_runs_eagerly():
    """eager_under_compile goes around Dynamo in an eager frame of a compiled region (where Dynamo's
    frame hook is set and would compile the checkpointed function), and calls directly where no
    compiled region is active, Dynamo merely imported (the cheap path)."""
    seen = []

    def probe(x):
        seen.append(ckpt_ext._compiler._frame_hook_active())  # not traceable: Dynamo runs it eagerly
        return x

    @torch.compile(backend="eager")
    def f(x):
        return probe(x + 1) * 2

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Dynamo's note about the untraceable builtin
        f(torch.ones(3))
    assert seen == [True]
    assert not ckpt_ext._compiler._frame_hook_active()


@pytest.mark.skipif(not hasattr(getattr(torch.compiler, "config", None), "cache_key_tag"),
                    reason="torch.compiler.config.cache_key_tag is torch >= 2.6")
def test_compile_cache_key_carries_the_operator_schemas(monkeypatch):
    # torch.compile's on-disk caches key a graph on its code, not on the schemas of the custom operators it
    # calls: the tag makes an entry cached by a ckpt_ext with other operator signatures not found.
    config = torch.compiler.config
    part = ckpt_ext._compiler.tag_compile_caches()
    assert part.startswith("ckpt_ext-") and config.cache_key_tag.split("+").count(part) == 1
    monkeypatch.setattr(config, "cache_key_tag", "users-tag+ckpt_ext-000000000000")
    assert ckpt_ext._compiler.tag_compile_caches() == part
    assert config.cache_key_tag == "users-tag+" + part  # the user's tag kept, a stale part of ours replaced
    real = torch._C._jit_get_all_schemas
    assert any(str(s.name) == "ckpt_ext::bias_gelu_backward" for s in real()), "registered at import"
    monkeypatch.setattr(torch._C, "_jit_get_all_schemas",
                        lambda: [s for s in real() if str(s.name) != "ckpt_ext::bias_gelu_backward"])
    assert ckpt_ext._compiler.tag_compile_caches() != part  # another operator set, another key
