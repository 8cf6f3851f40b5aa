"""Hugging Face knowledge of ckpt_ext: what transformers, Trainer/accelerate and peft do that ckpt_ext
must know about. Nothing here imports transformers or peft: models are recognised by their methods and
attributes, so ckpt_ext works (and imports fast) without them."""
from .peft import adapter_layers, is_adapter_layer, refuse_adapters
from .trainer import hf_checkpointing_on, install_take_over, remove_take_over, take_over_hf_checkpointing

__all__ = ["take_over_hf_checkpointing", "hf_checkpointing_on", "install_take_over", "remove_take_over",
           "is_adapter_layer", "adapter_layers", "refuse_adapters"]
