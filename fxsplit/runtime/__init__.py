"""Runtimes: the local in-process pipeline (and, later, torch.distributed)."""

from fxsplit.runtime.local import Pipeline, execution_order
from fxsplit.runtime.microbatch import merge_outputs, split_microbatches
from fxsplit.runtime.state import StateMap

__all__ = ["Pipeline", "StateMap", "execution_order", "merge_outputs", "split_microbatches"]
