"""Shape propagation: ``node.meta["val"]`` on every node, via torch's ``FakeTensorProp``."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.nn.utils.stateless import _reparametrize_module

from fxsplit.passes.manager import PassResult, carries_value

__all__ = ["PropagateShapes", "propagate_shapes", "fake_mode_of", "fake_state", "MetaDevicesMoved",
           "autocast_run_device", "fake_like", "meta_devices_moved"]

log = logging.getLogger(__name__)


def fake_mode_of(gm: torch.fx.GraphModule) -> FakeTensorMode | None:
    """The fake mode of the ``"val"`` tensors already on ``gm``'s nodes, if any."""
    vals = [n.meta["val"] for n in gm.graph.nodes if "val" in n.meta]
    return detect_fake_mode(vals)


@contextlib.contextmanager
def fake_state(gm: torch.nn.Module, mode: FakeTensorMode, device: torch.device | None = None) -> Iterator[None]:
    """Swap ``gm``'s parameters and buffers for fakes, so running it never touches real state.

    Without this, in-place buffer updates (BatchNorm's ``num_batches_tracked``) would change the
    user's model while we only wanted shapes. With ``device`` the fakes sit there whatever the
    state's own device (meta state run as on a CPU, where ``torch.autocast`` acts).
    """
    made: dict[int, torch.Tensor] = {}  # one fake per tensor: tied weights stay tied

    def fake(v: torch.Tensor) -> torch.Tensor:
        if device is None:
            return mode.from_tensor(v, static_shapes=True)
        if id(v) not in made:
            with mode:
                made[id(v)] = torch.empty(tuple(v.shape), dtype=v.dtype, device=device, requires_grad=v.requires_grad)
        return made[id(v)]

    state: dict[str, torch.Tensor] = {
        **{k: fake(v) for k, v in gm.named_parameters(remove_duplicate=False)},
        **{k: fake(v) for k, v in gm.named_buffers(remove_duplicate=False)},
    }
    with _reparametrize_module(gm, state, tie_weights=True):
        yield


_IMMUTABLE_LEAVES = (torch.device, torch.dtype, torch.layout, torch.memory_format, str, type(None))


class MetaDevicesMoved(torch.fx.Interpreter):
    """Interpreter mixin: ops that name the meta device run on ``self.device`` instead (None:
    as captured); see :func:`autocast_run_device`."""

    device: torch.device | None = None

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        return super().call_function(target, *meta_devices_moved(self.device, args, kwargs))


class _ShapeProp(MetaDevicesMoved, FakeTensorProp):
    """``FakeTensorProp`` that also records immutable non-tensor results.

    torch's ``FakeTensorProp`` writes ``"val"`` only for tensors and numbers, so a symbolically
    traced ``tokens.device`` (a ``torch.device``) or a call returning ``None`` would be left
    without ``"val"`` and every later pass would stop on it. Such results are immutable, so they
    are stored as they are.
    """

    def __init__(self, module: torch.fx.GraphModule, mode: FakeTensorMode | None = None,
                 device: torch.device | None = None) -> None:
        super().__init__(module, mode)
        self.device = device  # where meta devices named in the graph's ops run instead (None: as captured)

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        if "val" not in n.meta and all(isinstance(x, _IMMUTABLE_LEAVES) for x in pytree.tree_leaves(result)):
            n.meta["val"] = result if not isinstance(result, list) else tuple(result)
        return result


def _has_all_vals(gm: torch.fx.GraphModule) -> bool:
    return all("val" in n.meta for n in gm.graph.nodes if carries_value(n))


@dataclass(frozen=True)
class PropagateShapes:
    """Write ``node.meta["val"]`` (a FakeTensor or pytree of them) on every node.

    Nodes that already carry ``"val"`` from ``torch.export`` keep it; otherwise the whole graph is
    run once under a ``FakeTensorMode`` on fakes of ``example_inputs`` (no real compute, works for
    models on the ``meta`` device).

    Args:
        example_inputs: Flat inputs in placeholder order (``Captured.flatten_inputs``).
        force: Recompute even when every node already has ``"val"``.
    """

    example_inputs: Sequence[Any]
    force: bool = False
    requires: tuple[str, ...] = ()
    produces: tuple[str, ...] = ("val",)

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        if _has_all_vals(gm) and not self.force:
            log.info("propagate_shapes: every node already has 'val' (from export)")
            return PassResult(gm, modified=False)
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        # a meta model under CPU autocast runs as on a CPU: autocast does not act on meta tensors
        device = autocast_run_device(gm, self.example_inputs)
        fake_inputs = [fake_like(x, mode, device) if isinstance(x, torch.Tensor) else x for x in self.example_inputs]
        with fake_state(gm, mode, device), mode:
            _ShapeProp(gm, mode, device).propagate_dont_convert_inputs(*fake_inputs)
        return PassResult(gm, modified=True)


def autocast_run_device(gm: torch.nn.Module, inputs: Sequence[Any]) -> torch.device | None:
    """Where a fake run of ``gm`` must place meta state and inputs for ``torch.autocast`` to act:
    ``cpu`` when CPU autocast is on and the state or an input is on the meta device (autocast
    does not act on meta tensors); else None (run where they are)."""
    if not torch.is_autocast_enabled("cpu"):
        return None
    tensors = [*gm.parameters(), *gm.buffers(), *(x for x in inputs if isinstance(x, torch.Tensor))]
    return torch.device("cpu") if any(t.is_meta for t in tensors) else None


def fake_like(x: torch.Tensor, mode: FakeTensorMode, device: torch.device | None = None) -> torch.Tensor:
    """A fake of ``x`` in ``mode`` (``x`` itself when it is one), on ``device`` when given and
    ``x`` is on meta (shape and dtype kept: a meta model's inputs run as on a CPU)."""
    if device is not None and x.is_meta:
        with mode:
            return torch.empty(tuple(x.shape), dtype=x.dtype, device=device, requires_grad=x.requires_grad)
    return x if getattr(x, "fake_mode", None) is mode else mode.from_tensor(x)


def meta_devices_moved(device: torch.device | None, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """``(args, kwargs)`` of an op with every meta ``torch.device`` replaced by ``device`` (None:
    unchanged): ops that name their device (``arange(device=meta)``, export's tensor-metadata
    asserts) on a meta graph run as on ``device``."""
    if device is None:
        return args, kwargs
    moved = pytree.tree_map_only(torch.device, lambda d: device if d.type == "meta" else d, (args, kwargs))
    return moved[0], moved[1]


def propagate_shapes(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, force: bool = False) -> PassResult:
    """Functional form of :class:`PropagateShapes`."""
    return PropagateShapes(tuple(example_inputs), force)(gm)
