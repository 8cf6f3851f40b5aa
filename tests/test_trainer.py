"""ckpt_ext under Hugging Face's Trainer (accelerate underneath): a few SGD steps of a tiny GPT-2 (random
weights from a config, dropout on, in-memory data, CPU) give losses and final weights bit-identical to
Trainer with Hugging Face's own checkpointing (torch.utils.checkpoint) and equal to Trainer without
checkpointing within rtol 1e-5 / atol 1e-7 (recomputing a layer changes the last bits of some CPU
gradients of GPT2LMHeadModel, with torch.utils.checkpoint as with ckpt_ext); and Trainer's
gradient_checkpointing=True never checkpoints a layer a second time, whichever of ckpt_ext and Hugging
Face's switch comes first."""
import copy
import logging
import warnings

import pytest
import torch

import ckpt_ext
from helpers.hf_models import hf_disable, hf_enable

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # Trainer needs it
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

VOCAB, SEQ, STEPS, BATCH = 61, 12, 3, 4


def _model():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=3, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.1, embd_pdrop=0.1,
                                      attn_pdrop=0.1))


def _data():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (STEPS * BATCH, SEQ), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


class _RecordingTrainer(Trainer):
    """Keeps every step's loss, unrounded (Trainer's logs round it)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.losses.append((out[0] if return_outputs else out).detach().clone())
        return out


def _train(model, tmp_path, checkpointing):
    with warnings.catch_warnings():
        # The flag users have in their scripts; transformers 5.x renamed it activation_checkpointing (same switch).
        warnings.filterwarnings("ignore", "`gradient_checkpointing` is deprecated", FutureWarning)
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, max_steps=STEPS,
                                 per_device_train_batch_size=BATCH, learning_rate=1e-1, optim="sgd", seed=3,
                                 report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
                                 dataloader_num_workers=0, gradient_checkpointing=checkpointing)
    trainer = _RecordingTrainer(model=model, args=args, train_dataset=_data())
    trainer.losses = []
    trainer.train()
    return torch.stack(trainer.losses), {n: p.detach().clone() for n, p in model.named_parameters()}


def _count_attention_calls(model):
    """Calls of layer 0's attention: once per step unchecked, twice checkpointed (forward and replay)."""
    calls = []
    model.transformer.h[0].attn.register_forward_pre_hook(lambda m, a: calls.append(1))
    return calls


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Trainer without checkpointing, and Trainer with Hugging Face's checkpointing (torch.utils.checkpoint)."""
    model = _model()
    calls = _count_attention_calls(model)
    plain = _train(model, tmp_path_factory.mktemp("ref"), checkpointing=False)
    assert len(calls) == STEPS
    model = _model()
    calls = _count_attention_calls(model)
    hf = _train(model, tmp_path_factory.mktemp("hf"), checkpointing=True)
    assert len(calls) == 2 * STEPS
    return plain, hf


def _assert_same_training(got, reference):
    (losses, weights), ((ref_losses, ref_weights), hf) = got, reference
    assert losses.shape == (STEPS,) and weights.keys() == ref_weights.keys()
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-7)
    for name in ref_weights:
        torch.testing.assert_close(weights[name], ref_weights[name], rtol=1e-5, atol=1e-7, msg=name)
    # The same ops in the same order as torch.utils.checkpoint, the replay restoring the RNG state.
    assert torch.equal(losses, hf[0])
    for name in ref_weights:
        assert torch.equal(weights[name], hf[1][name]), name


def _assert_unchanged_training(got, reference):
    """Nothing checkpointed: bit-identical to Trainer without checkpointing."""
    (losses, weights), ((ref_losses, ref_weights), _) = got, reference
    assert torch.equal(losses, ref_losses)
    for name in ref_weights:
        assert torch.equal(weights[name], ref_weights[name]), name


def test_enable_checkpointing_then_trainer_flag_is_a_hand_over(tmp_path, reference):
    """The issue's case: enable_checkpointing, then gradient_checkpointing=True (layer 0 ran 3x per step)."""
    model = ckpt_ext.enable_checkpointing(_model())
    calls = _count_attention_calls(model)
    got = _train(model, tmp_path, checkpointing=True)
    assert len(calls) == 2 * STEPS
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    _assert_same_training(got, reference)


def test_take_over_makes_the_trainer_flag_mean_ckpt_ext(tmp_path, reference):
    model = ckpt_ext.take_over_hf_checkpointing(_model())
    assert "not enabled" in ckpt_ext.explain(model)  # the flag decides
    calls = _count_attention_calls(model)
    got = _train(model, tmp_path, checkpointing=True)
    assert len(calls) == 2 * STEPS
    assert "1 layer(s)" in ckpt_ext.explain(model)
    _assert_same_training(got, reference)


def test_take_over_without_the_flag_checkpoints_nothing(tmp_path, reference):
    model = ckpt_ext.take_over_hf_checkpointing(_model())
    calls = _count_attention_calls(model)
    got = _train(model, tmp_path, checkpointing=False)
    assert len(calls) == STEPS
    _assert_unchanged_training(got, reference)


def test_hf_flag_first_then_take_over_hands_over(tmp_path, reference, caplog):
    model = _model()
    hf_enable(model)
    with caplog.at_level(logging.INFO, logger="ckpt_ext"):
        ckpt_ext.take_over_hf_checkpointing(model)
    assert "handed over" in caplog.text
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    calls = _count_attention_calls(model)
    got = _train(model, tmp_path, checkpointing=True)
    assert len(calls) == 2 * STEPS
    _assert_same_training(got, reference)


def test_hf_flag_first_then_enable_checkpointing_is_refused():
    model = _model()
    hf_enable(model)
    with pytest.raises(ValueError, match="take_over_hf_checkpointing"):
        ckpt_ext.enable_checkpointing(model)
    assert not ckpt_ext.stack.is_enabled(model)


def test_flag_set_past_the_take_over_is_refused_at_the_step():
    """enable_checkpointing on the inner GPT2Model, HF's switch on the outer model: not seen by the
    take-over, so the layer refuses to run checkpointed twice."""
    model = _model().train()
    ckpt_ext.enable_checkpointing(model.transformer)
    hf_enable(model)
    ids = _data()[0]["input_ids"][None]
    with pytest.raises(RuntimeError, match="checkpointed twice"):
        model(input_ids=ids, labels=ids)


def test_taken_over_switch_disables_and_enables_again():
    model = ckpt_ext.take_over_hf_checkpointing(_model(), every=3)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert "1 groups of 3 layer(s)" in ckpt_ext.explain(model)
    hf_disable(model)
    assert "not enabled" in ckpt_ext.explain(model)
    hf_enable(model)
    assert "1 groups of 3 layer(s)" in ckpt_ext.explain(model)
    ckpt_ext.disable_checkpointing(model)  # undoes the take-over too: the switch is Hugging Face's again
    hf_enable(model)
    assert all(m.gradient_checkpointing for m in model.transformer.h)


@pytest.mark.parametrize("kwargs, match", [
    ({"every_n_layers": 2}, "every_n_layers=2"),
    ({"offload": True}, "offload=True"),
    ({"activation_checkpointing_kwargs": {"preserve_rng_state": False}}, "preserve_rng_state=False"),
    ({"activation_checkpointing_kwargs": {"determinism_check": "none"}}, "determinism_check"),
])
def test_taken_over_switch_refuses_what_ckpt_ext_cannot_honour(kwargs, match):
    model = ckpt_ext.take_over_hf_checkpointing(_model())
    with pytest.raises(ValueError, match=match):
        hf_enable(model, **kwargs)
    assert not ckpt_ext.stack.is_enabled(model)


def test_take_over_wants_a_hugging_face_model():
    with pytest.raises(TypeError, match="expects an nn.Module"):
        ckpt_ext.take_over_hf_checkpointing("model")
    with pytest.raises(TypeError, match="Hugging Face model"):
        ckpt_ext.take_over_hf_checkpointing(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="not both"):
        ckpt_ext.take_over_hf_checkpointing(_model(), every=2, budget="1GiB")


def test_take_over_survives_deepcopy():
    model = ckpt_ext.take_over_hf_checkpointing(_model())
    twin = copy.deepcopy(model)
    hf_enable(twin)
    assert ckpt_ext.stack.is_enabled(twin) and not ckpt_ext.stack.is_enabled(model)


def test_ckpt_ext_calls_raise_no_future_warning():
    """transformers 5.x deprecates is_gradient_checkpointing (a FutureWarning); ckpt_ext never reads it."""
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        ckpt_ext.enable_checkpointing(model)
        ckpt_ext.disable_checkpointing(model)
        ckpt_ext.take_over_hf_checkpointing(model)
        model.gradient_checkpointing_enable()  # taken over: not the deprecated method of transformers
        model.gradient_checkpointing_disable()


def test_accelerate_loop_with_enable_checkpointing_matches_without():
    """Your own loop under accelerate: enable_checkpointing before accelerator.prepare."""
    from accelerate import Accelerator

    def run(checkpoint):
        model = _model().train()
        if checkpoint == "ckpt_ext":
            ckpt_ext.enable_checkpointing(model)
        elif checkpoint == "hf":
            hf_enable(model)
        accelerator = Accelerator(cpu=True)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        model, opt = accelerator.prepare(model, opt)
        torch.manual_seed(5)
        losses = []
        for i in range(STEPS):
            ids = torch.stack([row["input_ids"] for row in _data()[i * BATCH:(i + 1) * BATCH]])
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return torch.stack(losses), {n: p.detach().clone() for n, p in model.named_parameters()}

    _assert_same_training(run("ckpt_ext"), (run(None), run("hf")))


def test_peft_lora_under_trainer_with_the_take_over(tmp_path):
    peft = pytest.importorskip("peft")

    def lora():
        model = peft.get_peft_model(_model(), peft.LoraConfig(r=4, lora_alpha=8, fan_in_fan_out=True,
                                                              target_modules=["c_attn", "c_fc"]))
        return model, {n: p.detach().clone() for n, p in model.named_parameters()}

    model, before = lora()
    plain = _train(model, tmp_path / "plain", checkpointing=False)
    model, before = lora()
    ckpt_ext.take_over_hf_checkpointing(model)  # on the PeftModel, which Trainer calls
    calls = _count_attention_calls(model.base_model.model)
    losses, weights = _train(model, tmp_path / "ckpt", checkpointing=True)
    assert len(calls) == 2 * STEPS
    torch.testing.assert_close(losses, plain[0], rtol=1e-5, atol=1e-7)
    changed = {n for n in weights if not torch.equal(weights[n], before[n])}
    assert changed and all("lora_" in n for n in changed)  # only the adapters train
