"""The releases of Hugging Face's libraries ckpt_ext is tested with, and the one-time warning outside them.

``make test`` runs the whole suite with the pinned set (constraints.txt); ``make test-compat`` runs the
Hugging Face-facing tests again with the oldest supported transformers and with the newest releases the
registry serves (tools/compat.py). A release outside these ranges is not refused (ckpt_ext asks each
release what it has rather than mirroring names), but it is said once, naming the tested range."""
import re
import sys
import warnings
from typing import Dict, Optional, Tuple

__all__ = ["TESTED", "check_versions"]

# library -> (oldest tested, newest tested); keep in step with constraints.txt, tools/compat.py, README and docs/install.md.
TESTED: Dict[str, Tuple[str, str]] = {
    "transformers": ("5.0.0", "5.24.0"),
    "peft": ("0.21.2", "0.21.2"),
    "accelerate": ("1.15.0", "1.15.0"),
}
_checked: set = set()


def _release(version: str) -> Tuple[int, ...]:
    """(major, minor, patch) of a version string ('5.24.0', '5.25.0.dev0', '4.57.6+local')."""
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def outside(name: str, version: str) -> Optional[str]:
    """Why ``version`` of ``name`` is outside the tested range, or None."""
    low, high = TESTED[name]
    v = _release(version)
    if v < _release(low):
        return f"older than the oldest tested ({low})"
    if v > _release(high):
        return f"newer than the newest tested ({high})"
    return None


def check_versions():
    """Warns once per library (imported only: nothing is imported here) whose version is outside the tested
    range. Called when ckpt_ext first meets a Hugging Face model (fuse, enable_checkpointing, take-over)."""
    for name in TESTED:
        mod = sys.modules.get(name)
        version = getattr(mod, "__version__", None)
        if version is None or name in _checked:
            continue
        _checked.add(name)
        why = outside(name, version)
        if why is not None:
            low, high = TESTED[name]
            warnings.warn(f"ckpt_ext: {name} {version} is {why}; ckpt_ext is tested with {name} {low} to {high}. "
                          "It asks each release what its layers take rather than assuming it, but gradients on "
                          f"this release are unverified: run ckpt_ext's `make test-compat` or pin {name} within "
                          "the range.", stacklevel=3)
