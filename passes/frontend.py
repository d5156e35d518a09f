"""The front-end pass list shared by ``fxsplit.inspect`` and ``fxsplit.compile``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fxsplit.ir.devices import DeviceSpec
from fxsplit.passes.condense import CondenseAntichains
from fxsplit.passes.costs import AnnotateCosts
from fxsplit.passes.shapes import PropagateShapes

__all__ = ["front_end_passes"]


def front_end_passes(
    flat_inputs: Sequence[Any],
    device: DeviceSpec,
    *,
    cost_model: str = "analytic",
    max_downsets: int,
    name: str,
    force_shapes: bool = False,
    timed_inputs: Sequence[Any] | None = None,
    measure_device: str = "cpu",
    measure_scale: float = 1.0,
    profile: dict[str, Any] | None = None,
) -> list[Any]:
    """``propagate_shapes -> annotate_costs -> condense_antichains`` for a PassManager.

    Args:
        flat_inputs: Flat example inputs (placeholder order).
        device: Reference device of the cost annotation.
        cost_model: ``"analytic"`` or ``"measured"``.
        max_downsets: Budget of the downset enumeration.
        name: Name of the condensed graph.
        force_shapes: Recompute ``"val"`` even where export left one (symbolic-batch captures).
        timed_inputs: Inputs the measured cost model times (default: ``flat_inputs``).
        measure_device, measure_scale: See :class:`AnnotateCosts`.
        profile: Options of the profiled cost model for :class:`AnnotateCosts` (``batched``,
            ``profile_sizes``, ``profile_cache``, ``progress``).
    """
    timed = tuple(flat_inputs if timed_inputs is None else timed_inputs)
    return [
        PropagateShapes(tuple(flat_inputs), force=force_shapes),
        AnnotateCosts(device, cost_model=cost_model, example_inputs=timed, measure_device=measure_device,
                      measure_scale=measure_scale, **(profile or {})),
        CondenseAntichains(max_downsets=max_downsets, name=name),
    ]
