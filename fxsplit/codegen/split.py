"""Codegen: a captured graph plus a stage assignment -> one ``GraphModule`` per pipeline stage.

Each stage is an ordinary ``torch.fx.GraphModule``: placeholders are the values it receives from
the previous stage (stage 0: the model's flat inputs), its output is the tuple of values it sends
to the next stage (the last stage: the model's flat outputs). A value made in stage ``i`` and read
in stage ``j > i + 1`` (a skip connection) is *relayed*: it is an input and an output of every
stage in between, so each stage talks only to its neighbours.

Parameters and buffers are never sent: a ``get_attr`` is re-created in every stage that reads it,
and the stage owns the tensor under its original qualified name. A tensor read by several stages
(tied weights) is shared by stages on the same device and copied for stages on other devices;
:class:`StagedProgram.tied` lists the copies whose gradients the runtime sums.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from fxsplit.errors import PlanError
from fxsplit.passes.manager import getattr_path

__all__ = ["Stage", "StagedProgram", "split_graph", "stage_of_nodes"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stage:
    """One pipeline stage.

    Attributes:
        index: Position in the pipeline.
        gm: The stage's code; ``print(stage.gm.code)`` reads like normal code.
        device: torch device string the stage runs on.
        inputs: Names of the values received, in placeholder order (stage 0: model inputs).
        outputs: Names of the values sent, in output order (last stage: model outputs).
        state: Original names of the parameters and buffers the stage owns.
    """

    index: int
    gm: torch.fx.GraphModule
    device: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    state: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return (
            f"Stage({self.index} on {self.device}: {len(self.gm.graph.nodes)} nodes, "
            f"in={list(self.inputs)}, out={list(self.outputs)}, state={len(self.state)})"
        )


@dataclass(frozen=True)
class StagedProgram:
    """The stages of a split model and what the runtime needs to run them like the original.

    Attributes:
        stages: ``[num_stages]`` stages in pipeline order.
        tied: State name -> stage indices holding *separate copies* (different devices); the
            runtime sums their gradients after backward.
        output_constants: Flat output index -> constant (non-node outputs such as ``None``).
    """

    stages: tuple[Stage, ...]
    tied: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    output_constants: Mapping[int, Any] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return len(self.stages)


def stage_of_nodes(gm: torch.fx.GraphModule, stage_of_block: Mapping[int, int]) -> dict[torch.fx.Node, int]:
    """Stage of every computing node, from ``node.meta["fxsplit.block"]`` and the plan.

    Placeholders are stage 0 (the model's inputs enter the first stage); ``get_attr`` nodes
    get no stage (they are re-created where they are read).

    Raises:
        PlanError: when a node has no block or its block has no stage.
    """
    out: dict[torch.fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("output", "get_attr"):
            continue
        if node.op == "placeholder":
            out[node] = 0
            continue
        block = node.meta.get("fxsplit.block")
        if block is None or block not in stage_of_block:
            raise PlanError(
                f"node {node.name!r} has block {block!r}, which the plan does not place; "
                "condense the same graph the plan was made for"
            )
        out[node] = stage_of_block[block]
    return out


def _check_forward(gm: torch.fx.GraphModule, stage: Mapping[torch.fx.Node, int]) -> None:
    for node, s in stage.items():
        for arg in node.all_input_nodes:
            if arg in stage and stage[arg] > s:
                raise PlanError(
                    f"node {node.name!r} in stage {s} reads {arg.name!r} from later stage {stage[arg]}; "
                    "stages must be contiguous (every prefix a downset): validate the plan"
                )


def _last_use(gm: torch.fx.GraphModule, stage: Mapping[torch.fx.Node, int], last: int) -> dict[torch.fx.Node, int]:
    use: dict[torch.fx.Node, int] = {}
    for node in gm.graph.nodes:
        for arg in node.all_input_nodes:
            if arg in stage:
                s = last if node.op == "output" else stage[node]
                use[arg] = max(use.get(arg, -1), s)
    return use


def _boundaries(gm: torch.fx.GraphModule, stage: Mapping[torch.fx.Node, int], num_stages: int) -> list[list[torch.fx.Node]]:
    """``boundaries[b]``: values sent from stage ``b`` to ``b + 1``, in graph order."""
    use = _last_use(gm, stage, num_stages - 1)
    crossing: list[list[torch.fx.Node]] = [[] for _ in range(num_stages - 1)]
    for node in gm.graph.nodes:
        if node in use:
            for b in range(stage[node], use[node]):
                crossing[b].append(node)
    return crossing


def _check_sendable(values: Sequence[torch.fx.Node], boundary: int) -> None:
    for node in values:
        val = node.meta.get("val")
        # A size read under a symbolic batch (SymInt) is a Python int when the stage runs.
        if isinstance(val, torch.Tensor | int | float | bool | torch.SymInt | torch.SymFloat | torch.SymBool) or val is None:
            continue
        if isinstance(val, list | tuple) and all(isinstance(v, torch.Tensor) for v in val):
            continue
        raise PlanError(
            f"value {node.name!r} ({type(val).__name__}) would cross the boundary after stage {boundary}; "
            "only tensors, lists of tensors and Python scalars can: move the split point so that "
            f"{node.name!r} and its users share a stage"
        )


class _StageBuilder:
    """Copies one stage's nodes into a fresh graph."""

    def __init__(self, source: torch.fx.GraphModule, index: int) -> None:
        self.source, self.index = source, index
        self.graph = torch.fx.Graph()
        self.env: dict[torch.fx.Node, torch.fx.Node] = {}
        self.attrs: dict[str, Any] = {}

    def placeholder(self, node: torch.fx.Node) -> None:
        new = self.graph.placeholder(node.name)
        new.meta = dict(node.meta)
        self.env[node] = new

    def _arg(self, node: torch.fx.Node) -> torch.fx.Node:
        if node in self.env:
            return self.env[node]
        if node.op != "get_attr":
            raise PlanError(f"stage {self.index} reads {node.name!r}, which it neither makes nor receives (a bug in fxsplit)")
        self.attrs[str(node.target)] = getattr_path(self.source, str(node.target))
        new = self.graph.get_attr(str(node.target))
        new.meta = dict(node.meta)
        self.env[node] = new
        return new

    def copy(self, node: torch.fx.Node) -> None:
        if node.op == "call_module":
            self.attrs[str(node.target)] = self.source.get_submodule(str(node.target))
        new = self.graph.node_copy(node, self._arg)
        new.meta["fxsplit.stage"] = self.index
        self.env[node] = new

    def finish(self, outputs: Sequence[Any]) -> torch.fx.GraphModule:
        mapped = tuple(self._arg(o) if isinstance(o, torch.fx.Node) else o for o in outputs)
        self.graph.output(mapped)
        gm = torch.fx.GraphModule(self.attrs, self.graph, class_name=f"Stage{self.index}")
        return gm


def split_graph(
    gm: torch.fx.GraphModule,
    stage_of_block: Mapping[int, int],
    devices: Sequence[str],
) -> StagedProgram:
    """Split an annotated, condensed graph into per-stage GraphModules.

    Args:
        gm: Flat captured graph whose nodes carry ``"fxsplit.block"``.
        stage_of_block: Block id -> stage index (``Plan.stage_of_block()``).
        devices: torch device of each stage, ``[num_stages]``.

    Returns:
        The :class:`StagedProgram`; stage modules share parameter tensors with ``gm`` (no copy),
        except tied tensors on a second device.

    Raises:
        PlanError: for a non-contiguous assignment, a value that cannot cross a boundary, or a
            node without a stage.
    """
    num_stages = len(devices)
    stage = stage_of_nodes(gm, stage_of_block)
    if stage and max(stage.values()) >= num_stages:
        raise PlanError(f"the plan uses stage {max(stage.values())} but only {num_stages} devices were given")
    _check_forward(gm, stage)
    crossing = _boundaries(gm, stage, num_stages)
    for b, values in enumerate(crossing):
        _check_sendable(values, b)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    out_args = tuple(gm.graph.output_node().args[0])  # type: ignore[arg-type]  # flat tuple (capture)
    stages = []
    for s in range(num_stages):
        builder = _StageBuilder(gm, s)
        inputs = placeholders if s == 0 else crossing[s - 1]
        for node in inputs:
            builder.placeholder(node)
        for node in gm.graph.nodes:
            if stage.get(node) == s and node.op != "placeholder":
                builder.copy(node)
                node.meta["fxsplit.stage"] = s
        outs = list(out_args) if s == num_stages - 1 else crossing[s]
        stage_gm = builder.finish(outs)
        state = tuple(_state_names(stage_gm))
        out_names = tuple(o.name if isinstance(o, torch.fx.Node) else f"<const {i}>" for i, o in enumerate(outs))
        stages.append(Stage(s, stage_gm, devices[s], tuple(n.name for n in inputs), out_names, state))
    consts = {i: o for i, o in enumerate(out_args) if not isinstance(o, torch.fx.Node)}
    return StagedProgram(tuple(stages), {}, consts)


def _state_names(gm: torch.fx.GraphModule) -> list[str]:
    names = [k for k, _ in gm.named_parameters(remove_duplicate=False)]
    names += [k for k, _ in gm.named_buffers(remove_duplicate=False)]
    return list(dict.fromkeys(names))
