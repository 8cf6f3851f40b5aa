"""enable_checkpointing on Hugging Face models (built from configs, random weights) and plain stacks:
outputs and every parameter's gradient against the same model without checkpointing and with
Hugging Face's own torch.utils.checkpoint, dropout on."""
import logging

import pytest
import torch
from torch import nn

import ckpt_ext

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
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        fn = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        fn()


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
    from ckpt_ext import integration
    integration._CACHE_WARNED.clear()
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


