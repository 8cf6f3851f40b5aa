"""ckpt_ext: fast activation checkpointing for PyTorch.

    import ckpt_ext
    y = ckpt_ext.checkpoint(block, x, use_reentrant=False)  # drop-in for torch.utils.checkpoint.checkpoint
    ckpt_ext.enable_checkpointing(model)         # checkpoint every layer of a layer-stack model
    ckpt_ext.fuse(model)                         # Hugging Face BERT/GPT-2/Llama/Qwen/Mistral/Gemma layers -> C++
    ckpt_ext.take_over_hf_checkpointing(model)   # Trainer's gradient_checkpointing=True means ckpt_ext
"""
from ._extension import load as _load

_C = _load()

from .checkpoint import checkpoint, checkpoint_sequential, is_recomputing  # noqa: E402
from .keep import keep_attention  # noqa: E402
from .stack import disable_checkpointing, enable_checkpointing, explain  # noqa: E402
from .pool import (empty_pool, is_pooled, pool_chunk_bytes, pool_min_chunk_bytes, pool_stats,  # noqa: E402
                   record_stream, reset_peak_stats, set_pool_chunk_bytes)
from . import ops  # noqa: E402  (torch.ops.ckpt_ext: fake kernels, documented wrappers)
from .fused import FusedTransformerLayer, fuse  # noqa: E402
from .hf import take_over_hf_checkpointing  # noqa: E402
from .hf.head import fuse_lm_head, unfuse_lm_head  # noqa: E402
from .head import linear_cross_entropy  # noqa: E402
from ._compiler import tag_compile_caches as _tag_compile_caches  # noqa: E402

_tag_compile_caches()  # every operator is registered by now (C++ and torch.library ones)

__version__ = "0.1.0"
__all__ = [
    "checkpoint",
    "checkpoint_sequential",
    "is_recomputing",
    "keep_attention",
    "enable_checkpointing",
    "disable_checkpointing",
    "explain",
    "take_over_hf_checkpointing",
    "fuse",
    "FusedTransformerLayer",
    "fuse_lm_head",
    "unfuse_lm_head",
    "linear_cross_entropy",
    "pool_stats",
    "reset_peak_stats",
    "empty_pool",
    "set_pool_chunk_bytes",
    "pool_chunk_bytes",
    "pool_min_chunk_bytes",
    "is_pooled",
    "record_stream",
]
