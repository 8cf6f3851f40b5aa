"""enable_checkpointing on Hugging Face models (built from configs, random weights) and plain stacks:
outputs and every parameter's gradient against the same model without checkpointing and with
Hugging Face's own torch.utils.checkpoint, dropout on."""
import copy
import logging
import warnings
import weakref

import pytest
import torch
from torch import nn

import ckpt_ext
from helpers.hf_models import hf_disable, hf_enable

transformers = pytest.importorskip("transformers")
from transformers import (BertConfig, BertModel, GPT2Config, GPT2Model, LlamaConfig,  # noqa: E402
                          LlamaModel, RobertaConfig, RobertaModel)

VOCAB = 97


def _bert():
    return BertModel(BertConfig(hidden_size=72, num_hidden_layers=4, num_attention_heads=3, intermediate_size=96,
                                vocab_size=VOCAB, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1))


def _roberta():
    return RobertaModel(RobertaConfig(hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                                      intermediate_size=64, vocab_size=VOCAB, pad_token_id=1))


def _gpt2():
    return GPT2Model(GPT2Config(n_embd=48, n_layer=4, n_head=4, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
                                resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1))


def _llama():
    return LlamaModel(LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=96, vocab_size=VOCAB, attention_dropout=0.1))


MODELS = {"bert": _bert, "roberta": _roberta, "gpt2": _gpt2, "llama": _llama}


def hf_checkpointing(model, enable):
    """Hugging Face's own checkpointing (torch.utils.checkpoint, non-reentrant), under its 5.x name."""
    if enable:
        hf_enable(model, activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        hf_disable(model)


def _step(model, ids, mask, seed=1234):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    (out.float() ** 2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach().clone(), grads


def _inputs(batch=3, seq=37):
    ids = torch.randint(2, VOCAB, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, seq - 9:] = 0  # padding
    mask[2, seq - 20:] = 0
    return ids, mask


def _assert_same(ref, got):
    (o_ref, g_ref), (o_got, g_got) = ref, got
    assert set(g_ref) == set(g_got), set(g_ref) ^ set(g_got)
    assert len(g_ref) == sum(1 for _ in g_ref)  # every parameter compared
    # Same ops in the same order with the same RNG stream: bit-identical.
    assert torch.equal(o_ref, o_got)
    for name in g_ref:
        assert torch.equal(g_ref[name], g_got[name]), name


@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("every", [1, 2])
def test_hf_parity_with_no_checkpointing(family, every):
    torch.manual_seed(0)
    model = MODELS[family]().train()
    ids, mask = _inputs()
    ref = _step(model, ids, mask)
    n_params = sum(1 for p in model.parameters() if p.requires_grad)
    ckpt_ext.enable_checkpointing(model, every=every)
    got = _step(model, ids, mask)
    _assert_same(ref, got)
    # the pooler of BERT/RoBERTa gets no gradient from last_hidden_state; all others do
    assert len(got[1]) >= n_params - 2
    ckpt_ext.disable_checkpointing(model)
    _assert_same(ref, _step(model, ids, mask))


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_hf_parity_with_torch_utils_checkpoint(family):
    torch.manual_seed(0)
    model = MODELS[family]().train()
    ids, mask = _inputs()
    hf_checkpointing(model, True)
    ref = _step(model, ids, mask)
    hf_checkpointing(model, False)
    ckpt_ext.enable_checkpointing(model)
    _assert_same(ref, _step(model, ids, mask))


class _CountedSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """torch's save_on_cpu (copies every saved tensor to the CPU, hands the copy back), counting its packs
    (the shapes) and unpacks."""

    def __init__(self):
        super().__init__()
        self.packed, self.unpacked = [], 0
        pack, unpack = self.pack_hook, self.unpack_hook

        def counted_pack(t):
            self.packed.append(tuple(t.shape))
            return pack(t)

        def counted_unpack(packed):
            self.unpacked += 1
            return unpack(packed)

        self.pack_hook, self.unpack_hook = counted_pack, counted_unpack


def _offloaded_step(model, ids, mask, seed=1234):
    """_step under save_on_cpu: (output, gradients), the packed shapes, the unpack count, and whether the
    first layer's input (the embeddings' output, held by nothing but the checkpoint) outlived the forward."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    seen = []
    embeddings = model.get_input_embeddings()
    handle = embeddings.register_forward_hook(lambda m, a, out: seen.append(weakref.ref(out)))
    hooks = _CountedSaveOnCpu()
    try:
        with hooks:
            out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    finally:
        handle.remove()
    held = seen[0]() is not None
    (out.float() ** 2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return (out.detach().clone(), grads), hooks.packed, hooks.unpacked, held


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_plain_groups_save_their_input_through_outer_hooks_as_torch_checkpoint(family):
    """Issue 33: the input of a plain (not fused) checkpointed group is saved as autograd saves a tensor, so an
    outer saved_tensors_hooks (save_on_cpu) packs it -- as it packs the layer input torch's checkpoint saves --
    and the checkpoint holds the offloaded copy, not the input. (It used to be held inside an argument tuple:
    no pack, the input kept on its device.)"""
    torch.manual_seed(0)
    model = MODELS[family]().train()
    layers = len(list(model.get_submodule("h" if family == "gpt2" else "layers")))
    ids, mask = _inputs()
    ref = _step(model, ids, mask)
    hf_checkpointing(model, True)
    torch_ref, torch_packed, torch_unpacked, torch_held = _offloaded_step(model, ids, mask)
    hf_checkpointing(model, False)
    hidden = tuple(ref[0].shape)
    # torch's checkpoint packs each layer's input (a hidden state) and nothing else inside the layers
    assert torch_packed.count(hidden) >= layers
    # GPT-2: nothing else holds the embeddings' output, so the offload frees it. (Llama's is held by something
    # of transformers' outside the layers under torch's checkpoint too, so there ckpt_ext is held to torch's.)
    assert torch_held is (family == "llama")
    for every in (1, 2):
        ckpt_ext.enable_checkpointing(model, every=every)
        got, packed, unpacked, held = _offloaded_step(model, ids, mask)
        ckpt_ext.disable_checkpointing(model)
        groups = -(-layers // every)
        if every == 1:
            assert packed == torch_packed and unpacked == torch_unpacked
        else:  # one input per group: the later layers' inputs are inside the group
            assert packed.count(hidden) == torch_packed.count(hidden) - (layers - groups)
            assert unpacked == len(packed)
        assert held == torch_held, "the group's input outlived the forward: save_on_cpu did not offload it"
        _assert_same(ref, got)  # gradients unchanged, bit for bit
    _assert_same(ref, torch_ref)


def test_hf_layers_are_checkpointed_and_state_dict_kept():
    torch.manual_seed(0)
    model = _bert().train()
    keys = list(model.state_dict())
    ids, mask = _inputs()
    ckpt_ext.enable_checkpointing(model, every=2)
    assert list(model.state_dict()) == keys
    frames = ckpt_ext._C.checkpoint_frames_created()
    out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    # two groups of two layers: two checkpointed calls (issue 13: no pool on this path)
    assert ckpt_ext._C.checkpoint_frames_created() - frames == 2
    out.sum().backward()


def test_eval_and_no_grad_do_not_checkpoint():
    torch.manual_seed(0)
    model = _gpt2()
    ids, mask = _inputs()
    ckpt_ext.enable_checkpointing(model, every=2)
    model.eval()
    out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert out.requires_grad and not ckpt_ext.is_pooled(out)
    model.train()
    with torch.no_grad():
        out2 = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert not out2.requires_grad


def test_kv_cache_is_dropped_with_a_warning(caplog):
    torch.manual_seed(0)
    model = _gpt2().train()
    ids, mask = _inputs()
    ref = _step(model, ids, mask)
    ckpt_ext.enable_checkpointing(model)
    from ckpt_ext.hf import cache as hf_cache
    hf_cache._CACHE_WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="ckpt_ext"):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1234)
        out = model(input_ids=ids, attention_mask=mask, use_cache=True).last_hidden_state
    assert "KV cache" in caplog.text
    (out ** 2).mean().backward()
    assert torch.equal(out.detach(), ref[0])


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.Dropout(0.2)

    def forward(self, x, scale=1.0):
        return x + self.drop(self.fc2(torch.relu(self.fc1(x)))) * scale


class Net(nn.Module):
    def __init__(self, d=24, n=5):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x, scale=0.5)
        return self.head(x)


def _net_step(model, x, seed=7):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    y = model(x)
    y.pow(2).sum().backward()
    return y.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("every", [1, 2, 3, 5])
def test_generic_module_list_every(every):
    torch.manual_seed(0)
    model = Net().train()
    x = torch.randn(6, 24)
    ref = _net_step(model, x)
    ckpt_ext.enable_checkpointing(model, every=every)
    _assert_same(ref, _net_step(model, x))


def test_sequential_model_and_explicit_layers():
    torch.manual_seed(0)
    seq = nn.Sequential(*[Block(16) for _ in range(4)]).train()
    x = torch.randn(5, 16)
    ref = _net_step(seq, x)
    ckpt_ext.enable_checkpointing(seq, every=2)
    _assert_same(ref, _net_step(seq, x))
    ckpt_ext.disable_checkpointing(seq)
    net = Net().train()
    ref = _net_step(net, x.new_empty(5, 24).normal_())
    ckpt_ext.enable_checkpointing(net, layers=list(net.blocks)[:2])
    assert "_ckpt_ext_group" in net.blocks[0].__dict__ and "_ckpt_ext_group" not in net.blocks[3].__dict__


def test_layer_called_directly_after_grouping_still_correct():
    torch.manual_seed(0)
    model = Net().train()
    ckpt_ext.enable_checkpointing(model, every=2)
    x = torch.randn(4, 24, requires_grad=True)
    torch.manual_seed(3)
    y = model.blocks[1](x)  # second layer of a group, called on its own
    torch.manual_seed(3)
    ckpt_ext.disable_checkpointing(model)
    y_ref = model.blocks[1](x)
    assert torch.equal(y, y_ref)


@pytest.mark.parametrize("order,bad_layer", [([0, 1, 0, 2, 3, 4], 2), ([0, 2, 3, 4], 2), ([0, 1, 2, 3, 2, 4], 4)])
def test_grouping_detects_layers_called_out_of_order(order, bad_layer):
    class Repeats(Net):
        def forward(self, x):
            for i in order:
                x = self.blocks[i](x, scale=0.5)
            return self.head(x)

    def step(model):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        y = model(x)
        y.pow(2).sum().backward()
        return y.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    torch.manual_seed(0)
    model = Repeats().train()
    x = torch.randn(3, 24)
    ref = step(model)
    ckpt_ext.enable_checkpointing(model, every=2)
    with pytest.raises(RuntimeError, match=rf"layer {bad_layer} \(Block\) received the output of the group of layers "
                                           r".*Use every=1"):
        model(x)
    ckpt_ext.enable_checkpointing(model, every=1)
    _assert_same(ref, step(model))


def test_grouping_detects_transformed_hidden_states():
    class Odd(Net):
        def forward(self, x):
            for b in self.blocks:
                x = b(x) * 2  # transforms between layers
            return x

    model = Odd().train()
    ckpt_ext.enable_checkpointing(model, every=2)
    with pytest.raises(RuntimeError, match="every=1"):
        model(torch.randn(3, 24))
    ckpt_ext.enable_checkpointing(model, every=1)
    model(torch.randn(3, 24)).sum().backward()




# ---- the budget planner's inputs and words (stack.py) ----------------------------------------------------------------


def _planner(model):
    return model.blocks[0].__dict__["_ckpt_ext_group"].planner


def test_plan_follows_a_larger_input_and_keeps_serving_smaller_ones():
    torch.manual_seed(0)
    model = Net(n=4).train()
    ref = copy.deepcopy(model)
    ckpt_ext.enable_checkpointing(model, budget="1GiB")
    small, large = torch.randn(4, 24), torch.randn(16, 24)
    for x in (small, small):
        _assert_same(_net_step(ref, x), _net_step(model, x))
    planner = _planner(model)
    assert planner.installed and planner.shape == (4, 24)
    _assert_same(_net_step(ref, large), _net_step(model, large))  # measured again, for this input
    assert planner.shape == (16, 24) and set(planner.plans) == {(4, 24), (16, 24)}
    text = ckpt_ext.explain(model)
    assert "for input shape (16, 24)" in text and "(4, 24)" in text
    for x in (large, small):  # the plan for (16, 24) serves (4, 24): nothing is measured again
        _assert_same(_net_step(ref, x), _net_step(model, x))
        assert planner.installed and planner.shape == (16, 24) and len(planner.plans) == 2


class _SigmoidChain(nn.Module):
    """Each sigmoid saves its output. When the graph does not hold `a` (the probe's graph holds nothing),
    it is freed before `c` is allocated, and the allocator may give `c` its address."""

    def __init__(self, d=32):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        a = torch.sigmoid(x)
        b = torch.sigmoid(a)
        del a
        return self.fc(torch.sigmoid(b))


def _saved_bytes(layer, x):
    """Bytes of the tensors a forward saves for backward (parameters excluded), every one kept alive."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    del out
    return sum(st.nbytes() for st in kept.values())


def test_planner_measures_every_saved_tensor_the_same_every_run():
    """The least achievable budget once varied from run to run (11.51/11.26/11.00 MiB): the probe let saved
    tensors die, and a later one at the same address counted as the same tensor."""
    torch.manual_seed(0)
    for rows, d in [(64, 32), (16, 64), (128, 512)]:  # 96 probes: the old probe miscounted 10-30% of them
        x = torch.randn(rows, d, requires_grad=True)
        for _ in range(4):
            model = nn.Sequential(*[_SigmoidChain(d) for _ in range(8)]).train()
            ckpt_ext.enable_checkpointing(model, budget="1GiB")
            model(x).sum().backward()
            measured = [c.act_bytes for c in model[0].__dict__["_ckpt_ext_group"].planner.costs]
            # the three sigmoid outputs (the last one is also fc's input)
            assert measured == [3 * x.numel() * x.element_size()] * 8, (rows, d)
        assert measured == [_saved_bytes(layer, x) for layer in model]


def test_explain_returns_its_text_once_and_in_one_unit(capsys):
    model = Net(n=3).train()
    ckpt_ext.enable_checkpointing(model, budget=50 * 2**20)
    text = ckpt_ext.explain(model)
    assert capsys.readouterr().out == ""  # returned, not printed: a REPL shows it once
    assert isinstance(text, str) and repr(text) == str(text)
    assert "budget 50.00 MiB" in text and "bytes" not in text
    _net_step(model, torch.randn(4, 24))
    text = ckpt_ext.explain(model)
    assert "plan made" in text and "bytes" not in text.splitlines()[0]


# ---- warnings ----------------------------------------------------------------------------------------------------


def test_kv_cache_line_is_said_once_for_gpt2_and_llama(caplog, monkeypatch):
    from ckpt_ext.hf import cache as hf_cache
    monkeypatch.setattr(hf_cache, "_CACHE_WARNED", set())  # as in a fresh process; other tests' state kept
    with caplog.at_level(logging.WARNING, logger="ckpt_ext"):
        for make in (_gpt2, _llama, _gpt2):  # default configs: use_cache=True
            model = ckpt_ext.enable_checkpointing(make().train())
            ids, mask = _inputs()
            for _ in range(2):
                _step(model, ids, mask)
    assert caplog.text.count("KV cache") == 1


def test_fused_layer_warnings_point_at_the_users_line(monkeypatch):
    from ckpt_ext import fused
    model = ckpt_ext.fuse(_gpt2()).train()
    ids, mask = _inputs()
    monkeypatch.setattr(fused, "_warned", set())  # warned once per process: as in a fresh one
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(input_ids=ids, attention_mask=mask, use_cache=True)  # a cache in training: ignored, with a warning
    cache = [w for w in caught if "KV cache" in str(w.message)]
    assert len(cache) == 1 and cache[0].filename == __file__, [(w.filename, str(w.message)) for w in caught]


# ---- peft ------------------------------------------------------------------------------------------------------------


def _lora_gpt2():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(_gpt2(), peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, fan_in_fan_out=True,
                                                        target_modules=["c_attn", "c_proj"]))
    for name, p in model.named_parameters():  # LoRA's B starts at zero: give the adapter terms a value
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return model.train()


def test_peft_lora_with_enable_checkpointing_matches_peft_without():
    model = _lora_gpt2()
    ids, mask = _inputs()
    ref = _step(model, ids, mask)
    assert ref[1] and all("lora_" in name for name in ref[1])  # only adapter weights get gradients
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # ckpt_ext never reads is_gradient_checkpointing
        ckpt_ext.enable_checkpointing(model)
    _assert_same(ref, _step(model, ids, mask))


def test_fuse_refuses_unsupported_peft_adapters_before_and_after(monkeypatch):
    """LoRA itself fuses (tests/test_lora_fused.py); DoRA is refused at fuse and at the call."""
    from ckpt_ext import fused
    monkeypatch.setattr(fused, "_warned", set())  # the KV-cache warning on the way: other tests' state kept
    peft = pytest.importorskip("peft")
    dora = peft.LoraConfig(r=4, fan_in_fan_out=True, target_modules=["c_attn"], use_dora=True)
    with pytest.raises(ValueError, match="DoRA.*merge_and_unload"):
        ckpt_ext.fuse(peft.get_peft_model(_gpt2(), dora))
    model = ckpt_ext.fuse(_gpt2()).train()
    model = peft.get_peft_model(model, dora)
    ids, mask = _inputs()
    with pytest.raises(RuntimeError, match="adapters added after ckpt_ext.fuse"):
        model(input_ids=ids, attention_mask=mask)
    ckpt_ext.enable_checkpointing(model)  # the segment path refuses too
    with pytest.raises(RuntimeError, match="adapters added after ckpt_ext.fuse"):
        model(input_ids=ids, attention_mask=mask)
