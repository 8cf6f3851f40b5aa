def enable_checkpointing(*a, **k): raise NotImplementedError
def disable_checkpointing(*a, **k): raise NotImplementedError
