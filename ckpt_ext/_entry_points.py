"""What ckpt_ext.hf.trainer calls back in ckpt_ext.stack, without an import cycle: stack.py imports
hf.trainer (its Hugging Face checks and the take-over of Hugging Face's switch) and, when it is imported,
registers here the functions the take-over calls (enabling means enable_checkpointing, ...)."""
from typing import Callable, Optional

enable_checkpointing: Optional[Callable] = None  # stack.enable_checkpointing
is_enabled: Optional[Callable] = None  # stack.is_enabled
check_options: Optional[Callable] = None  # stack._check_options
detach_groups: Optional[Callable] = None  # stack._detach_groups


def register(**functions: Callable):
    for name, fn in functions.items():
        if name not in globals() or name == "register":
            raise KeyError(f"ckpt_ext._entry_points has no entry point {name!r}")
        globals()[name] = fn
