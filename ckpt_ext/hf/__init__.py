"""Hugging Face knowledge of ckpt_ext, one module per subject:

* ``layers``: which transformers layer classes are fused into which C++ family, where their weights
  live, how their configurations read (into a ``_C.LayerSpec``), transformers' output-capturing hooks;
* ``cache``: the KV-cache arguments of their forward, dropped before a checkpointed call;
* ``trainer``: Hugging Face's own checkpointing switch (Trainer, accelerate) handed over to ckpt_ext;
* ``peft``: peft adapter layers.

transformers and peft are imported only lazily (``layers``, when a model is fused) or recognised
through ``sys.modules``, so ckpt_ext works (and imports fast) without them."""
from .peft import adapter_layers, is_adapter_layer, refuse_adapters
from .trainer import hf_checkpointing_on, install_take_over, remove_take_over, take_over_hf_checkpointing

__all__ = ["take_over_hf_checkpointing", "hf_checkpointing_on", "install_take_over", "remove_take_over",
           "is_adapter_layer", "adapter_layers", "refuse_adapters"]
