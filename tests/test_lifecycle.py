"""A fused or checkpointed model is still an ordinary nn.Module (issue 38): torch.save/torch.load and pickle
give a model that trains with the same gradients, checkpointed as it was; copies, Hugging Face's own
round trips and switches keep working on it; fuse() and enable_checkpointing() applied twice are harmless."""
import copy
import io
import pickle
import types
import warnings
import weakref

import pytest
import torch
from torch import nn

import ckpt_ext
from ckpt_ext.hf.layers import CapturingHook, _hook_installer
from ckpt_ext.stack import is_enabled
from helpers.hf_models import RELATIVES, VOCAB, hf_disable, hf_enable, inputs_for, layers_of, make_model
from helpers.lifecycle import round_trip, saved_tensor_count, train_in_spawned_process, training_step
from reference import make_stack

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

HOW = ["torch.save", "pickle"]


def _prepare(model, variant):
    if "fused" in variant:
        ckpt_ext.fuse(model)
    if variant.endswith("every2"):
        ckpt_ext.enable_checkpointing(model, every=2)
    elif variant.endswith("budget"):
        ckpt_ext.enable_checkpointing(model, budget="1GiB")
    elif variant.endswith("keep"):
        ckpt_ext.enable_checkpointing(model, keep="attention")
    elif "ckpt" in variant:
        ckpt_ext.enable_checkpointing(model)
    return model


def _assert_same_grads(got, expected):
    assert got.keys() == expected.keys()
    for name, g in expected.items():
        assert torch.equal(got[name], g), name


def _assert_round_trip(model, kw, how, checkpointed):
    """`model` (trained a step already, so that it holds whatever a step leaves) survives `how`: the loaded one
    trains with bit-identical gradients, is checkpointed as it was, and the original is untouched."""
    expected = training_step(model, kw)
    loaded = round_trip(model, how)
    assert loaded is not model
    _assert_same_grads(training_step(loaded, kw), expected)
    assert is_enabled(loaded) == is_enabled(model) == checkpointed
    assert str(ckpt_ext.explain(loaded)) == str(ckpt_ext.explain(model))
    assert saved_tensor_count(loaded, kw) == saved_tensor_count(model, kw)
    _assert_same_grads(training_step(model, kw), expected)  # the original still trains as before
    return loaded


# torch.save is pickle with a zip container: every family and variant through torch.save, plain pickle on the
# family with the most state on its modules (GPT-2: Conv1D, the fused LM head on *LMHeadModel is not here).
ROUND_TRIPS = [(f, v, "torch.save") for f in ("bert", "roberta", "gpt2", "llama")
               for v in ("fused", "ckpt", "fused+ckpt", "fused+ckpt-every2")] + \
              [("gpt2", v, "pickle") for v in ("fused", "ckpt", "fused+ckpt", "fused+ckpt-every2")]
# Llama's relatives (fused on the Llama machinery), fused and checkpointed.
ROUND_TRIPS += [(f, "fused+ckpt", "torch.save") for f in RELATIVES]


@pytest.mark.parametrize("family,variant,how", ROUND_TRIPS)
def test_hf_model_round_trip(family, variant, how):
    torch.manual_seed(0)
    model = _prepare(make_model(family, dropout=0.1, layers=3).train(), variant)
    kw = inputs_for(family, padding=True)
    training_step(model, kw, seed=1)
    loaded = _assert_round_trip(model, kw, how, "ckpt" in variant)
    if "fused" in variant:
        fused = [m for m in loaded.modules() if isinstance(m, ckpt_ext.FusedTransformerLayer)]
        assert len(fused) == 3
        # transformers' output-capturing hooks came back as objects, not closures, and still capture
        hooks = [h for m in fused for h in m._forward_hooks.values()]
        assert all(isinstance(h, CapturingHook) for h in hooks)
        assert hooks or _hook_installer() is None  # (releases before the hook installer patch forwards per call)
        loaded.eval()
        with torch.no_grad():
            ref = model.eval()(**kw, output_hidden_states=True).hidden_states
            got = loaded(**kw, output_hidden_states=True).hidden_states
        assert len(got) == len(ref) == 4 and all(torch.equal(a, b) for a, b in zip(got, ref))


class _Spy(pickle.Pickler):
    """Records what would be pickled that belongs to this process only."""

    def __init__(self, file):
        super().__init__(file)
        self.bound = []

    def reducer_override(self, obj):
        if isinstance(obj, (weakref.ref, types.MethodType)) or \
                (isinstance(obj, types.FunctionType) and "<locals>" in obj.__qualname__) or \
                (isinstance(obj, torch.Tensor) and ckpt_ext.is_pooled(obj)):
            self.bound.append(obj)
        return NotImplemented


@pytest.mark.parametrize("variant", ["fused+ckpt-every2", "ckpt-keep", "ckpt-budget"])
def test_nothing_of_this_process_is_pickled(variant):
    """Pickled between forward and backward (a group's output pending, pool slots alive): no weak reference,
    bound method, closure or pool slot goes into the pickle."""
    torch.manual_seed(0)
    model = _prepare(make_model("bert", dropout=0.0, layers=4).train(), variant)
    kw = inputs_for("bert", padding=True)
    training_step(model, kw)
    training_step(model, kw)
    out = model(**kw).last_hidden_state
    spy = _Spy(io.BytesIO())
    spy.dump(model)
    assert spy.bound == []
    out.sum().backward()


def test_checkpointing_really_still_applies_after_loading():
    """The saved-tensor count that the round-trip tests compare does tell checkpointed from not."""
    torch.manual_seed(0)
    model = make_model("bert", layers=3).train()
    kw = inputs_for("bert", padding=False)
    plain = saved_tensor_count(model, kw)
    loaded = round_trip(ckpt_ext.enable_checkpointing(model), "pickle")
    assert saved_tensor_count(loaded, kw) < plain / 2


@pytest.mark.parametrize("variant", ["ckpt-budget", "ckpt-keep", "fused+ckpt-budget"])
def test_planned_and_keep_attention_round_trip(variant):
    torch.manual_seed(0)
    model = _prepare(make_model("bert", dropout=0.0, layers=3).train(), variant)
    kw = inputs_for("bert", padding=True)
    training_step(model, kw, seed=1)
    training_step(model, kw, seed=2)  # a budget's plan is made in the first step, in use from the second
    loaded = _assert_round_trip(model, kw, "torch.save", True)
    if variant.endswith("budget"):
        planner = next(m._ckpt_ext_group.planner for m in layers_of(loaded))
        assert planner.plan is not None and planner.installed
        assert planner.index == {id(m): i for i, m in enumerate(layers_of(loaded))}


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("every", [1, 2])
def test_plain_layer_stack_round_trip(every, how):
    stack = make_stack(n=4, p=0.1)
    ckpt_ext.enable_checkpointing(stack, every=every)
    x = torch.randn(3, 5, 19, requires_grad=False)
    training_step(stack, x, seed=1)
    _assert_round_trip(stack, x, how, True)


@pytest.mark.parametrize("variant", ["fused", "ckpt", "fused+ckpt"])
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_peft_model_round_trip(family, variant):
    torch.manual_seed(0)
    targets = {"bert": ["query", "value", "dense"], "llama": ["q_proj", "v_proj", "down_proj"]}[family]
    model = peft.get_peft_model(make_model(family, dropout=0.1, layers=2),
                                peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=targets))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)  # peft starts B at zero; non-zero makes every adapter gradient informative
    _prepare(model, variant)
    kw = inputs_for(family, padding=True)
    training_step(model, kw, seed=1)
    loaded = _assert_round_trip(model, kw, "torch.save", "ckpt" in variant)
    assert isinstance(loaded, peft.PeftModel)
    assert {n for n, p in loaded.named_parameters() if p.requires_grad} == \
        {n for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_causal_lm_with_the_fused_head_round_trip(family):
    """A *ForCausalLM after fuse: its LM head and loss are ckpt_ext's chunked operation (hooks on the model,
    the model's loss_function): saved and loaded, it trains with the same loss and gradients, logits None."""
    torch.manual_seed(0)
    base = make_model(family, dropout=0.0, layers=2)
    lm = (transformers.GPT2LMHeadModel if family == "gpt2" else transformers.LlamaForCausalLM)(base.config)
    lm.train()
    _prepare(lm, "fused+ckpt")
    assert type(lm.lm_head).__name__ == "FusedLMHead"
    ids = torch.randint(3, VOCAB, (2, 9))
    kw = {"input_ids": ids, "labels": ids}

    def step(m):
        m.zero_grad(set_to_none=True)
        out = m(**kw)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    step(lm)
    expected_out, expected = step(lm)
    loaded = round_trip(lm, "torch.save")
    assert type(loaded.lm_head).__name__ == "FusedLMHead"
    got_out, got = step(loaded)
    assert got_out.logits is None and expected_out.logits is None
    assert torch.equal(got_out.loss, expected_out.loss)
    _assert_same_grads(got, expected)


# ----------------------------------------------------------------------------------------------------------
# What keeps working on a loaded (fused, checkpointed) model
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture
def bert_pair():
    torch.manual_seed(0)
    model = _prepare(make_model("bert", dropout=0.1, layers=3).train(), "fused+ckpt")
    kw = inputs_for("bert", padding=True)
    training_step(model, kw, seed=1)
    return model, round_trip(model, "torch.save"), kw


def test_loaded_state_dict_and_save_pretrained(bert_pair, tmp_path):
    model, loaded, kw = bert_pair
    ref = model.state_dict()
    got = loaded.state_dict()
    assert list(got) == list(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    loaded.save_pretrained(tmp_path)
    again = transformers.BertModel.from_pretrained(tmp_path, add_pooling_layer=False)
    assert all(torch.equal(again.state_dict()[k], ref[k]) for k in ref)
    _prepare(again.train(), "fused+ckpt")
    _assert_same_grads(training_step(again, kw), training_step(model, kw))


def test_loaded_deepcopy_and_frozen_layers(bert_pair):
    model, loaded, kw = bert_pair
    twin = copy.deepcopy(loaded)
    _assert_same_grads(training_step(twin, kw), training_step(model, kw))
    for m in (model, loaded):
        layers_of(m)[0].requires_grad_(False)
    grads = training_step(loaded, kw)
    assert not any(n.startswith("encoder.layer.0.") for n in grads)
    _assert_same_grads(grads, training_step(model, kw))


def test_loaded_resize_token_embeddings(bert_pair):
    model, loaded, kw = bert_pair
    for m in (model, loaded):
        m.resize_token_embeddings(VOCAB + 5)
    torch.manual_seed(3)
    with torch.no_grad():  # resizing draws the new rows at random: the same ones in both
        loaded.get_input_embeddings().weight[VOCAB:] = model.get_input_embeddings().weight[VOCAB:]
    _assert_same_grads(training_step(loaded, kw), training_step(model, kw))
    assert loaded.get_input_embeddings().weight.shape[0] == VOCAB + 5


def test_loaded_hf_switch_still_means_ckpt_ext(bert_pair):
    model, loaded, kw = bert_pair
    hf_disable(loaded)
    assert not is_enabled(loaded) and is_enabled(model)
    training_step(loaded, kw)
    hf_enable(loaded)
    assert is_enabled(loaded)
    _assert_same_grads(training_step(loaded, kw), training_step(model, kw))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_loaded_model_generates_in_eval(family):
    torch.manual_seed(0)
    make = {"gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel,
                     dict(n_embd=48, n_head=3, n_layer=2)),
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                      dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=1, intermediate_size=64,
                           num_hidden_layers=2))}[family]
    cfg = make[0](vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, **make[2])
    model = _prepare(make[1](cfg).train(), "fused+ckpt")
    kw = {"input_ids": torch.randint(3, VOCAB, (2, 7)), "use_cache": False}
    training_step(model, kw, seed=1)
    loaded = round_trip(model, "torch.save")
    prompt = torch.randint(3, VOCAB, (2, 5))
    outs = [m.eval().generate(prompt, max_new_tokens=4, do_sample=False) for m in (model, loaded)]
    assert torch.equal(outs[0], outs[1]) and outs[0].shape == (2, 9)


# ----------------------------------------------------------------------------------------------------------
# fuse() and enable_checkpointing() twice
# ----------------------------------------------------------------------------------------------------------
def test_fuse_twice_leaves_the_model_as_it_is():
    torch.manual_seed(0)
    model = ckpt_ext.fuse(make_model("gpt2", dropout=0.1, layers=2).train())
    layers = list(layers_of(model))
    keys = list(model.state_dict())
    kw = inputs_for("gpt2", padding=False)
    expected = training_step(model, kw)
    with pytest.warns(UserWarning, match="already fused"):
        assert ckpt_ext.fuse(model) is model
    assert all(a is b for a, b in zip(layers_of(model), layers)) and list(model.state_dict()) == keys
    _assert_same_grads(training_step(model, kw), expected)
    with pytest.raises(ValueError, match="no supported layer"):  # a model with nothing to fuse still raises
        ckpt_ext.fuse(make_stack(n=2))


@pytest.mark.parametrize("options", [{}, {"every": 2}, {"budget": "1GiB"}, {"keep": "attention"}])
def test_enable_checkpointing_twice_with_the_same_arguments_is_a_no_op(options):
    torch.manual_seed(0)
    model = make_model("bert", layers=4).train()
    kw = inputs_for("bert", padding=False)
    ckpt_ext.enable_checkpointing(model, **options)
    training_step(model, kw)
    training_step(model, kw)
    groups = [m._ckpt_ext_group for m in layers_of(model)]
    forwards = [m.forward for m in layers_of(model)]
    text = str(ckpt_ext.explain(model))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt_ext.enable_checkpointing(model, **options)
    assert all(m._ckpt_ext_group is g for m, g in zip(layers_of(model), groups))
    assert all(m.forward is f for m, f in zip(layers_of(model), forwards))
    assert str(ckpt_ext.explain(model)) == text  # a budget's plan is kept, not measured again


@pytest.mark.parametrize("first,second", [({}, {"every": 2}), ({"every": 2}, {}), ({}, {"keep": "attention"}),
                                          ({"budget": "1GiB"}, {"every": 2}), ({"every": 2}, {"budget": "1GiB"}),
                                          ({}, {"layers": "first two"})])
def test_enable_checkpointing_again_with_other_arguments_applies_them(first, second):
    torch.manual_seed(0)
    model = make_model("bert", layers=4).train()
    kw = inputs_for("bert", padding=False)
    expected = training_step(model, kw)
    if second.get("layers") == "first two":
        second = {"layers": list(layers_of(model))[:2]}
    ckpt_ext.enable_checkpointing(model, **first)
    training_step(model, kw)
    ckpt_ext.enable_checkpointing(model, **second)
    fresh = make_model("bert", layers=4).train()
    fresh.load_state_dict(model.state_dict())
    if "layers" in second:
        second = {"layers": list(layers_of(fresh))[:2]}
    ckpt_ext.enable_checkpointing(fresh, **second)
    assert str(ckpt_ext.explain(model)) == str(ckpt_ext.explain(fresh))
    assert [m.__dict__.get("_ckpt_ext_group") is None for m in layers_of(model)] == \
        [m.__dict__.get("_ckpt_ext_group") is None for m in layers_of(fresh)]
    assert saved_tensor_count(model, kw) == saved_tensor_count(fresh, kw)
    _assert_same_grads(training_step(model, kw), expected)


# ----------------------------------------------------------------------------------------------------------
# A model passed to a spawned process
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # a second Python importing torch and transformers: ~10 s alone, more on a shared machine
@pytest.mark.parametrize("variant", ["fused+ckpt"])
def test_model_trains_in_a_spawned_process(variant, tmp_path):
    torch.manual_seed(0)
    model = _prepare(make_model("bert", dropout=0.1, layers=2).train(), variant)
    kw = inputs_for("bert", padding=True)
    training_step(model, kw, seed=1)
    expected = training_step(model, kw)
    out = tmp_path / "child.pt"
    torch.multiprocessing.spawn(train_in_spawned_process, args=(model, kw, str(out)), nprocs=1, join=True)
    child = torch.load(out, weights_only=False)
    _assert_same_grads(child["grads"], expected)
    assert child["enabled"] and child["explain"] == str(ckpt_ext.explain(model))
    assert child["saved"] == saved_tensor_count(model, kw)
