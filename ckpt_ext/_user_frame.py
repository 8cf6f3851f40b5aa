"""The stacklevel that makes a warning point at the user's line, past ckpt_ext's, torch's and Hugging
Face's frames (a fused layer's warning is raised several module calls below the user's code)."""
import os
import sys

_LIBRARIES = ("ckpt_ext", "torch", "transformers", "accelerate", "peft")


def _library_dirs() -> tuple:
    dirs = []
    for name in _LIBRARIES:
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(dirs)


def user_stacklevel() -> int:
    """For ``warnings.warn(..., stacklevel=user_stacklevel())``: the first frame outside those libraries,
    counted from the function that calls warnings.warn (1 when every frame is a library's)."""
    dirs = _library_dirs()
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(dirs):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 1
