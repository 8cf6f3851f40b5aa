"""ckpt_ext under torch.compile and CUDA graph capture.

torch.compile: models using ckpt_ext.checkpoint, checkpoint_sequential, enable_checkpointing (a plain
stack, a Hugging Face BERT) and fuse + enable_checkpointing compile and give the outputs and gradients
of eager execution, with no warning and no recompilation on the second step. The engine is one quiet
graph break (ckpt_ext/_compiler.py); what runs without grad compiles without any; the fused ops compile
with fullgraph=True. Most tests use the aot_eager backend (Dynamo and AOTAutograd, no code generation);
two use inductor, which compiles C++ per graph on CPU.

With dropout on, the equalities stay exact because a checkpointed call runs eagerly in forward and in
its replay: the compiled model with ckpt_ext equals the eager model without checkpointing under the same
seed (the compiled parts around it draw no random numbers), and ckpt_ext.checkpoint of a compiled block
equals that compiled block without checkpointing.

CUDA graphs: what the engine cannot capture raises a clear error (checked on CPU by faking the capture
query, and on a GPU); dropout-free fused ops and fused layers capture and replay correctly (GPU).
"""
import copy
import warnings

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import ckpt_ext
import ckpt_ext._compiler
from ckpt_ext import ops
from reference import assert_grads_close, leaf_inputs, make_block, make_stack, run_step
from helpers.hf_models import inputs_for, layers_of, make_model  # noqa: E402  (tiny Hugging Face models)

from helpers.devices import requires_cuda  # noqa: E402

# The functions through which the engine is entered (ckpt_ext/_compiler.py: eager_under_compile): the only
# graph breaks ckpt_ext may cause in a model without fused layers.
ENGINE_ENTRIES = ("_checkpoint_with_grad", "_checkpoint_segments", "_training_layer_forward")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


def engine_runs():
    """Checkpointed calls so far: frames of ckpt_ext.checkpoint plus fused segments (each stores its output
    in the BoundaryPool)."""
    return ckpt_ext._C.checkpoint_frames_created() + ckpt_ext.pool_stats("cpu")["allocations"]


def compiled_step(fn, inputs, params, seed=0, checkpointed_calls=None):
    """run_step of a compiled function: no warning may be emitted, and the engine must have run
    `checkpointed_calls` times."""
    allocations = engine_runs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_step(fn, inputs, params=params, seed=seed)
    assert not caught, [str(w.message) for w in caught]
    if checkpointed_calls is not None:
        assert engine_runs() - allocations == checkpointed_calls
    return result


def second_step_does_not_recompile(fn, inputs, params, seed=0):
    with torch.compiler.set_stance("fail_on_recompile"):
        return run_step(fn, inputs, params=params, seed=seed)


def assert_breaks_only_at_the_engine():
    assert counters["graph_break"], "expected graph breaks at the engine"
    for reason in counters["graph_break"]:
        assert any(f"`{name}`" in reason for name in ENGINE_ENTRIES), reason


class Net(nn.Module):
    """inp -> two checkpointed MLP blocks (dropout inside) -> out. The compiled parts draw no random numbers."""

    def __init__(self, p=0.3, checkpointed=True):
        super().__init__()
        self.inp = nn.Linear(7, 19)
        self.blocks = make_stack(2, p=p)
        self.out = nn.Linear(19, 5)
        self.checkpointed = checkpointed

    def forward(self, x):
        h = self.inp(x)
        if self.checkpointed:
            h = ckpt_ext.checkpoint(self.blocks[0], h)
            h = ckpt_ext.checkpoint(self.blocks[1], h)
        else:
            h = self.blocks[1](self.blocks[0](h))
        return self.out(h)


# ---- models using the engine ----------------------------------------------------------------------------------------


def _plain(model):
    plain = copy.deepcopy(model)
    plain.checkpointed = False
    return plain


@pytest.mark.parametrize("p", [0.0, 0.3], ids=["no-dropout", "dropout"])
def test_checkpoint_compiles_and_equals_eager(p):
    model = Net(p)
    x = leaf_inputs((4, 7))
    eager = run_step(_plain(model), x, seed=0)
    params = dict(model.named_parameters())
    compiled = torch.compile(model, backend="aot_eager")
    assert_grads_close(compiled_step(compiled, x, params, checkpointed_calls=2), eager, exact=True)
    assert counters["stats"]["unique_graphs"] >= 2  # the layers around the blocks were compiled
    assert_breaks_only_at_the_engine()
    assert_grads_close(second_step_does_not_recompile(compiled, x, params), eager, exact=True)


def test_checkpoint_sequential_compiles_and_equals_eager():
    stack = make_stack(4, p=0.3)
    x = leaf_inputs((4, 19))
    eager = run_step(copy.deepcopy(stack), x, seed=1)
    compiled = torch.compile(lambda h: ckpt_ext.checkpoint_sequential(stack, 3, h), backend="aot_eager")
    params = dict(stack.named_parameters())
    assert_grads_close(compiled_step(compiled, x, params, seed=1, checkpointed_calls=2), eager, exact=True)
    assert_breaks_only_at_the_engine()
    second_step_does_not_recompile(compiled, x, params, seed=1)


def test_enable_checkpointing_on_a_layer_stack_compiles():
    """Layers in a loop: Dynamo runs a frame with a graph break inside a loop eagerly, so this checks
    that compilation does no harm (no error, no warning, no recompilation, same numbers)."""

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = make_stack(4, p=0.3)
            self.head = nn.Linear(19, 3)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    model = Stack()
    x = leaf_inputs((4, 19))
    eager = run_step(copy.deepcopy(model), x, seed=0)
    ckpt_ext.enable_checkpointing(model, every=2)
    params = dict(model.named_parameters())
    compiled = torch.compile(model, backend="aot_eager")
    assert_grads_close(compiled_step(compiled, x, params, checkpointed_calls=2), eager, exact=True)
    assert_breaks_only_at_the_engine()
    second_step_does_not_recompile(compiled, x, params)


def test_inference_compiles_without_graph_breaks():
    """Without grad nothing is checkpointed: checkpoint(), checkpoint_sequential() and checkpointed layers
    are traced like the plain model (fullgraph=True)."""
    model = Net(p=0.3)
    stack = make_stack(4, dim=5, hidden=7, p=0.0)  # left in training mode: no_grad alone turns checkpointing off
    ckpt_ext.enable_checkpointing(stack, every=2)
    x = torch.randn(4, 7)

    def infer(x):
        return ckpt_ext.checkpoint_sequential(stack, 2, stack(model(x)))

    model.eval()
    with torch.no_grad():
        expected = infer(x)
        got = torch.compile(infer, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("variant", ["checkpointed", "fused+checkpointed"])
def test_hugging_face_model_compiles_and_equals_eager(variant):
    model = make_model("bert", dropout=0.2, layers=2).train()
    model.embeddings.dropout.p = 0.0  # the compiled part draws no random numbers: exact comparison
    if variant == "fused+checkpointed":
        ckpt_ext.fuse(model)  # its reference: the fused model, not checkpointed (bit-identical in eager)
    kw = inputs_for("bert", padding=True)
    call = lambda m: (lambda: m(**kw).last_hidden_state)  # noqa: E731
    reference = copy.deepcopy(model)
    eager = run_step(call(reference), [], params=dict(reference.named_parameters()), seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' is_gradient_checkpointing rename
        ckpt_ext.enable_checkpointing(model)
    compiled = torch.compile(model, backend="aot_eager")
    params = dict(model.named_parameters())
    assert_grads_close(compiled_step(call(compiled), [], params, seed=3, checkpointed_calls=2), eager, exact=True)
    second_step_does_not_recompile(call(compiled), [], params, seed=3)


def test_compiled_block_inside_checkpoint_keeps_its_dropout_masks():
    """ckpt_ext.checkpoint(torch.compile(block), x): forward and replay run the compiled block, with the
    same random numbers, so the result equals the compiled block without checkpointing."""
    block = make_block(p=0.3)
    compiled_block = torch.compile(block, backend="aot_eager")
    x = leaf_inputs((4, 19))
    params = dict(block.named_parameters())
    expected = run_step(compiled_block, x, params=params, seed=5)
    got = compiled_step(lambda h: ckpt_ext.checkpoint(compiled_block, h), x, params, seed=5, checkpointed_calls=1)
    assert_grads_close(got, expected, exact=True)
    assert counters["stats"]["unique_graphs"] == 1  # forward and replay both run with grad (torch's design)
    second_step_does_not_recompile(lambda h: ckpt_ext.checkpoint(compiled_block, h), x, params, seed=5)


def test_inductor_with_checkpoint():
    model = Net(p=0.3)
    x = leaf_inputs((4, 7))
    params = dict(model.named_parameters())
    eager = run_step(_plain(model), x, seed=0)
    got = compiled_step(torch.compile(model), x, params)
    # Inductor's linear layers round differently; the dropout masks in the blocks are the eager ones.
    assert_grads_close(got, eager, rtol=1e-5, atol=1e-6)


# ---- fused ops: no graph break ---------------------------------------------------------------------------------------


def fused_ops_program(x, res, b, w, lb, gate, up, cos, sin, seed: int):
    """Every forward op, chained; its backward runs every *_backward op."""
    h = ops.bias_gelu(x, b, "tanh")
    h = ops.bias_dropout_add(h, b, res, 0.1, seed, 0)
    out, pre, _, _ = ops.bias_dropout_add_layer_norm(h, b, res, w, lb, 0.1, 1e-5, seed, 4)
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
        ckpt_ext.checkpoint(block, x)
    with pytest.raises(RuntimeError, match=CAPTURE_ERROR):
        ckpt_ext.checkpoint_sequential(make_stack(2), 2, x)
    assert ckpt_ext.pool_stats("cpu")["in_use_bytes"] == before
    with torch.no_grad():  # nothing is checkpointed: allowed
        ckpt_ext.checkpoint(block, x)


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
            ckpt_ext.checkpoint(block, x)
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
