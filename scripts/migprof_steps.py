"""Report a program's steps to migprof (`migprof exec`): one file, standard library only.

Copy this file beside your program, or put scripts/ on PYTHONPATH, then time each step:

    import migprof_steps

    for images, labels in loader:
        with migprof_steps.step(items=len(images), phase="train"):
            train_step(images, labels)

Each step becomes a line of JSON in the file `migprof exec` names in MIGPROF_STEPS:
{"duration_ms": 12.5, "items": 32, "phase": "train"}. Outside migprof (MIGPROF_STEPS unset) the
helper does nothing, so the program runs as it always did.

A step's time is the device's, not just the launches': when PyTorch is loaded and CUDA is in use,
the helper waits for the device (torch.cuda.synchronize) before and after the step. It never imports
PyTorch itself.

Phases: "warmup" (steps migprof leaves out of the measurement), "infer", "train" or "generate"; a
step that names none takes `migprof exec --mode` (infer by default). `items` is what the step
processed (samples, sequences or tokens), a whole number of at least 1.
"""

import json
import os
import sys
import time
from contextlib import contextmanager

ENV = "MIGPROF_STEPS"
PHASES = ("warmup", "infer", "train", "generate")

_out = None


def _file():
    """The step file migprof named, opened once for appending; None outside migprof."""
    global _out
    path = os.environ.get(ENV)
    if not path:
        return None
    if _out is None or _out.name != path:
        _out = open(path, "a", buffering=1, encoding="utf-8")
    return _out


def _synchronize():
    """Waits for the device when the program uses PyTorch on CUDA."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_available() and cuda.is_initialized():
        cuda.synchronize()


def _check(items, phase):
    if isinstance(items, bool) or not isinstance(items, int) or items < 1:
        raise ValueError(f"items is a whole number of at least 1, not {items!r}")
    if phase is not None and phase not in PHASES:
        raise ValueError(f"phase {phase!r}; valid phases: {', '.join(PHASES)}")


def record(duration_s, items=1, phase=None):
    """Reports a step the program timed itself: `duration_s` seconds for `items` items."""
    _check(items, phase)
    if not (isinstance(duration_s, (int, float)) and 0 < duration_s <= 86400):
        raise ValueError(f"a step's duration is above 0 and at most a day, not {duration_s!r}")
    out = _file()
    if out is None:
        return
    line = {"duration_ms": duration_s * 1e3, "items": items}
    if phase is not None:
        line["phase"] = phase
    out.write(json.dumps(line) + "\n")


@contextmanager
def step(items=1, phase=None):
    """Times the block as one step of `items` items; a block that raises reports nothing."""
    _check(items, phase)
    if _file() is None:
        yield
        return
    _synchronize()
    start = time.perf_counter()
    yield
    _synchronize()
    record(max(time.perf_counter() - start, 1e-9), items, phase)
