"""fxsplit: split a PyTorch model across devices automatically and run it as a pipeline.

    pipe = fxsplit.compile(model, devices=["cuda:0", "cuda:1"], example_inputs=(x,))
    loss = pipe.train_step(x, target=y, loss_fn=torch.nn.functional.cross_entropy)

``import fxsplit`` is light: torch and the layers load on first use of ``compile``, ``inspect``
or ``capture`` (the torch-free ``fxsplit.ir``, ``fxsplit.solvers`` and ``fxsplit.schedule`` never
load torch).
"""

from __future__ import annotations

from typing import Any

from fxsplit import errors
from fxsplit.errors import FxsplitError

__version__ = "0.1.0"
__all__ = ["errors", "FxsplitError", "__version__", "compile", "inspect", "plan_hybrid", "capture", "load", "CompileOptions", "train_many",
           "Task"]

_LAZY = {
    "compile": ("fxsplit.api", "compile"),
    "inspect": ("fxsplit.api", "inspect"),
    "plan_hybrid": ("fxsplit.api", "plan_hybrid"),
    "CompileOptions": ("fxsplit.api", "CompileOptions"),
    "capture": ("fxsplit.passes.capture", "capture"),
    "load": ("fxsplit.distributed", "load"),
    "Captured": ("fxsplit.passes.capture", "Captured"),
    "train_many": ("fxsplit.multi", "train_many"),
    "Task": ("fxsplit.multi", "Task"),
}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    if name == "viz":  # pictures, Gantt charts and tables: loaded on first use
        return importlib.import_module("fxsplit.viz")
    raise AttributeError(f"module 'fxsplit' has no attribute {name!r}")
