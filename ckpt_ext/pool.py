"""Statistics and control of the BoundaryPool: one arena per device holding checkpoint boundaries."""
import os
from typing import Dict, Optional, Union

import torch

from ._extension import load

_C = load()

DeviceLike = Union[str, int, torch.device, None]


def _device(device: DeviceLike) -> torch.device:
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        d = torch.device("cuda", device) if isinstance(device, int) and not isinstance(device, bool) \
            else torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise TypeError(f"expected a device such as 'cpu', 'cuda:0' or torch.device, got {device!r}") from e
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"ckpt_ext pools exist for CPU and CUDA devices only, got {d}")
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {d} was asked for, but CUDA is not available here "
                             f"(torch {torch.__version__}); use device='cpu'")
        if d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
        elif not 0 <= d.index < torch.cuda.device_count():
            raise ValueError(f"device {d} does not exist: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return d


def pool_stats(device: DeviceLike = None) -> Dict[str, int]:
    """Counters of the device's pool: ``reserved_bytes`` (held in chunks), ``peak_reserved_bytes``,
    ``in_use_bytes`` (live slots), ``peak_in_use_bytes``, ``live_slots``, ``grows`` (chunks ever added),
    ``releases`` (chunks ever given back), ``chunks``, ``allocations`` and ``stream_fences``. Peaks are
    high-water marks since the last `reset_peak_stats`. Default device: the current CUDA device, else CPU.

    A chunk goes back to PyTorch's allocator as soon as its last slot is freed, except one spare
    shared chunk kept for the next step, so ``reserved_bytes`` falls during backward."""
    return dict(_C.pool_stats(_device(device)))


def reset_peak_stats(device: DeviceLike = None) -> None:
    """Sets ``peak_in_use_bytes`` and ``peak_reserved_bytes`` of the device's pool to the current values."""
    _C.reset_peak_stats(_device(device))


def empty_pool(device: DeviceLike = None) -> int:
    """Returns the pool's chunks that hold no live slot (the spare, if any) to PyTorch's allocator;
    returns the bytes freed."""
    return int(_C.empty_pool(_device(device)))


def pool_chunk_bytes(device: DeviceLike = None) -> int:
    """Size of the chunks the device's arena grows by now (see :func:`set_pool_chunk_bytes`)."""
    return int(_C.pool_chunk_bytes(_device(device)))


def pool_min_chunk_bytes() -> int:
    """The smallest chunk size :func:`set_pool_chunk_bytes` accepts (the pool's alignment, set in C++)."""
    return int(_C.pool_min_chunk_bytes)


def set_pool_chunk_bytes(nbytes: int, device: DeviceLike = None) -> None:
    """Size of the chunks the device's arena grows by (default 64 MiB on GPUs, 4 MiB on CPU; the
    environment variable CKPT_EXT_POOL_CHUNK_MB sets the default). Affects later growth only. A slot
    of more than a quarter of this gets a chunk of exactly its own size; smaller slots share chunks
    holding a whole number of them."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"nbytes must be an int (bytes), got {type(nbytes).__name__}; "
                        "for '64MiB' use ckpt_ext.planner.parse_bytes('64MiB')")
    least = pool_min_chunk_bytes()
    if nbytes < least:
        raise ValueError(f"nbytes must be at least {least}, got {nbytes}")
    d = _device(device)
    total = _device_memory(d)
    if total is not None and nbytes > total:
        raise ValueError(f"nbytes={nbytes} is more than the {total} bytes of memory of {d}; "
                         "a pool chunk must fit in the device's memory")
    _C.set_pool_chunk_bytes(d, nbytes)


def _device_memory(d: torch.device) -> Optional[int]:
    if d.type == "cuda":
        return int(torch.cuda.get_device_properties(d).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def is_pooled(tensor: torch.Tensor) -> bool:
    """True when the tensor's storage is a slot of a ckpt_ext pool."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a Tensor, got {type(tensor).__name__}")
    return bool(_C.is_pooled(tensor))


def record_stream(tensor: torch.Tensor, stream: torch.Stream) -> None:
    """Pooled counterpart of ``Tensor.record_stream``: the tensor is used on ``stream``, so its slot is
    reused only after the work queued there. (``Tensor.record_stream`` only knows PyTorch's caching
    allocator and has no effect on pooled tensors.)"""
    if not isinstance(stream, torch.Stream):
        raise TypeError(f"expected a torch.Stream (e.g. torch.cuda.Stream), got {type(stream).__name__}")
    if not is_pooled(tensor):
        raise ValueError("ckpt_ext.record_stream: this tensor is not in a ckpt_ext pool; use "
                         "tensor.record_stream(stream) for tensors from PyTorch's allocator")
    _C.record_stream(tensor, stream.stream_id, stream.device_index, stream.device_type)
