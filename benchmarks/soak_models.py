"""The soak's models (benchmarks/soak.py): a plain layer stack, tiny Hugging Face BERT and GPT-2, each built twice
from one seed -- the copy ckpt_ext checkpoints and the reference that is not checkpointed."""
import copy
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import ckpt_ext

MODELS = ("stack", "bert", "gpt2")
VOCAB = 101


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm transformer block with explicit attention (masked softmax, attention dropout) and an MLP."""

    def __init__(self, d: int, heads: int, p: float):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.attn_drop, self.drop = nn.Dropout(p), nn.Dropout(p)

    def forward(self, x, keep):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) * (d // self.heads) ** -0.5
        att = self.attn_drop(scores.masked_fill(~keep, float("-inf")).softmax(-1))
        x = x + self.drop(self.proj((att @ v).transpose(1, 2).reshape(b, s, d)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class Stack(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4, layers: int = 4, p: float = 0.1):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Block(d, heads, p) for _ in range(layers))
        self.head_mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Dropout(p),
                                      nn.Linear(2 * d, d))
        self.out = nn.Linear(d, VOCAB)
        self.checkpoint_head = False

    def forward(self, ids, mask):
        keep = mask[:, None, None, :].bool()
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x, keep)
        x = ckpt_ext.checkpoint(self.head_mlp, x, use_reentrant=False) if self.checkpoint_head else self.head_mlp(x)
        return self.out(x)


def _quiet(cfg):
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(cfg, name, None) is not None and getattr(cfg, name) >= VOCAB:
            setattr(cfg, name, None)
    return cfg


def build_pair(name: str, seed: int):
    """(checkpointed model, reference model, loss function(model, ids, mask) -> loss)."""
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' renames, small-vocabulary notices
        if name == "stack":
            ref = Stack()
            ck = copy.deepcopy(ref)
            ckpt_ext.enable_checkpointing(ck, every=2, layers=ck.blocks)
            ck.checkpoint_head = True

            def loss_fn(model, ids, mask):
                logits = model(ids, mask)
                return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        elif name == "bert":
            from transformers import BertConfig, BertForMaskedLM
            cfg = BertConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128,
                             vocab_size=VOCAB, max_position_embeddings=128, hidden_dropout_prob=0.1,
                             attention_probs_dropout_prob=0.1)
            ref = ckpt_ext.fuse(BertForMaskedLM(_quiet(cfg)))
            ck = ckpt_ext.enable_checkpointing(copy.deepcopy(ref), every=2)

            def loss_fn(model, ids, mask):
                return model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        elif name == "gpt2":
            from transformers import GPT2Config, GPT2LMHeadModel
            cfg = GPT2Config(n_embd=64, n_layer=4, n_head=4, n_positions=128, vocab_size=VOCAB, resid_pdrop=0.1,
                             embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM")
            ref = ckpt_ext.fuse(GPT2LMHeadModel(_quiet(cfg)))
            ck = ckpt_ext.enable_checkpointing(copy.deepcopy(ref), every=1)

            def loss_fn(model, ids, mask):
                return model(input_ids=ids, labels=ids, use_cache=False).loss
        else:
            raise ValueError(f"unknown model {name!r} (choose from {', '.join(MODELS)})")
    return ck.train(), ref.train(), loss_fn
