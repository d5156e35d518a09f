"""Random DAG-shaped modules for property tests: branches, skips, merges, several outputs.

A :class:`DagSpec` is plain data (JSON round-trip, so a failing hypothesis case can be saved and
replayed); :func:`build_dag_module` turns it into an ``nn.Module`` whose forward follows the DAG with
static Python control flow, so both ``torch.export`` and ``torch.fx.symbolic_trace`` capture it.
Every value has shape ``[batch, width]``.

Example:
    >>> import random
    >>> spec = random_dag_spec(random.Random(0), max_nodes=8)
    >>> spec.validate()
    >>> DagSpec.from_json(spec.to_json()) == spec
    True
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import torch
from torch import nn

from fxsplit.errors import ConfigError

__all__ = ["OPS", "DagNode", "DagSpec", "DagModule", "build_dag_module", "random_dag_spec"]

OPS: dict[str, int] = {
    "linear": 1,
    "relu": 1,
    "layernorm": 1,
    "add": 2,
    "mul": 2,
    "concat_linear": 2,
    "tied_linear": 1,
    "inplace_relu": 1,
}
"""Op kind -> number of inputs. ``concat_linear`` concatenates its two inputs on the last dim and
projects ``[batch, 2 * width] -> [batch, width]``; ``mul`` is the elementwise product;
``tied_linear`` is one ``Linear`` shared by every such node (tied parameters, registered under
each node's name); ``inplace_relu`` applies ``relu_`` in place to a fresh copy of its input
(an in-place op on an activation, as ``nn.ReLU(inplace=True)`` does)."""

_PARAMETRIC = ("linear", "layernorm", "concat_linear", "tied_linear")


@dataclass(frozen=True)
class DagNode:
    """One node of a :class:`DagSpec`.

    Attributes:
        op: A key of :data:`OPS`.
        inputs: Indices of the values it reads; value 0 is the module input, value ``i + 1`` is the
            output of node ``i``. Each index must be smaller than this node's own value index.
    """

    op: str
    inputs: tuple[int, ...]


@dataclass(frozen=True)
class DagSpec:
    """A DAG of width-preserving ops over one input ``[batch, width]``.

    Attributes:
        nodes: The nodes in topological order; node ``i`` produces value ``i + 1``.
        outputs: Value indices returned, as a tuple, by the module's forward.
    """

    nodes: tuple[DagNode, ...]
    outputs: tuple[int, ...]

    def validate(self) -> None:
        """Check ops, arities, topological order and outputs.

        Raises:
            ConfigError: Naming the first faulty node or output and what is wrong with it.
        """
        if not self.nodes:
            raise ConfigError("DagSpec has no nodes")
        for i, node in enumerate(self.nodes):
            if node.op not in OPS:
                raise ConfigError(f"DagSpec node {i}: unknown op {node.op!r}; known: {list(OPS)}")
            if len(node.inputs) != OPS[node.op]:
                raise ConfigError(
                    f"DagSpec node {i}: op {node.op!r} takes {OPS[node.op]} inputs, "
                    f"got {node.inputs}"
                )
            if any(not 0 <= v <= i for v in node.inputs):
                raise ConfigError(f"DagSpec node {i}: inputs {node.inputs} must lie in [0, {i}]")
        if not self.outputs:
            raise ConfigError("DagSpec has no outputs")
        bad = [v for v in self.outputs if not 1 <= v <= len(self.nodes)]
        if bad:
            raise ConfigError(f"DagSpec outputs {bad} must lie in [1, {len(self.nodes)}]")

    def to_json(self) -> str:
        """Serialise as JSON text; :meth:`from_json` reads it back."""
        nodes = [{"op": n.op, "inputs": list(n.inputs)} for n in self.nodes]
        return json.dumps({"nodes": nodes, "outputs": list(self.outputs)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DagSpec:
        """Parse the JSON written by :meth:`to_json` and validate it.

        Raises:
            ConfigError: The text is not a valid spec.
        """
        try:
            data = json.loads(text)
            nodes = tuple(DagNode(n["op"], tuple(n["inputs"])) for n in data["nodes"])
            spec = cls(nodes=nodes, outputs=tuple(data["outputs"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"not a DagSpec JSON: {exc}") from exc
        spec.validate()
        return spec


class DagModule(nn.Module):
    """The module of a :class:`DagSpec`; build it with :func:`build_dag_module`.

    Args:
        spec: A valid spec.
        width: Feature width of every value.

    Shape:
        ``x [batch, width] -> tuple of len(spec.outputs) tensors [batch, width]``.
    """

    def __init__(self, spec: DagSpec, width: int) -> None:
        super().__init__()
        self.spec = spec
        self.width = width
        self.layers = nn.ModuleDict()
        shared: nn.Linear | None = None
        for i, node in enumerate(spec.nodes):
            if node.op == "tied_linear":
                shared = shared or nn.Linear(width, width)
                self.layers[f"n{i}"] = shared
            elif node.op == "linear":
                self.layers[f"n{i}"] = nn.Linear(width, width)
            elif node.op == "layernorm":
                self.layers[f"n{i}"] = nn.LayerNorm(width)
            elif node.op == "concat_linear":
                self.layers[f"n{i}"] = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Evaluate the DAG on ``x [batch, width]`` and return the output values."""
        values = [x]
        for i, node in enumerate(self.spec.nodes):
            args = [values[v] for v in node.inputs]
            if node.op in _PARAMETRIC:
                if node.op == "concat_linear":
                    args = [torch.cat(args, dim=-1)]
                values.append(self.layers[f"n{i}"](args[0]))
            elif node.op == "relu":
                values.append(torch.relu(args[0]))
            elif node.op == "inplace_relu":
                fresh = args[0] * 1.0
                values.append(fresh.relu_())
            elif node.op == "add":
                values.append(args[0] + args[1])
            else:  # "mul", the only op left after validate()
                values.append(args[0] * args[1])
        return tuple(values[v] for v in self.spec.outputs)

    def extra_repr(self) -> str:
        return f"width={self.width}, nodes={len(self.spec.nodes)}, outputs={self.spec.outputs}"


def build_dag_module(spec: DagSpec, width: int) -> DagModule:
    """Build the module of ``spec`` (weights from torch's current RNG state).

    Args:
        spec: The DAG.
        width: Feature width of every value (>= 1).

    Returns:
        The module; ``module(x [batch, width])`` returns a tuple of ``len(spec.outputs)`` tensors.

    Raises:
        ConfigError: ``spec`` is invalid or ``width < 1``.
    """
    spec.validate()
    if width < 1:
        raise ConfigError(f"build_dag_module: width must be >= 1, got {width}")
    return DagModule(spec, width)


def random_dag_spec(rng: random.Random, max_nodes: int, *, max_extra_outputs: int = 1) -> DagSpec:
    """Draw a random DAG with 1 to ``max_nodes`` nodes; deterministic for the state of ``rng``.

    Inputs favour the previous value (long chains) but reach back anywhere (skips), binary ops merge
    branches, and every value nobody reads is an output, so the module has no dead code.

    Args:
        rng: The random source; seed it for reproducible specs.
        max_nodes: Largest number of nodes (>= 1).
        max_extra_outputs: At most this many values that other nodes also read become outputs too.

    Returns:
        A valid spec.

    Raises:
        ConfigError: ``max_nodes < 1``.
    """
    if max_nodes < 1:
        raise ConfigError(f"random_dag_spec: max_nodes must be >= 1, got {max_nodes}")
    ops = sorted(OPS)
    nodes = []
    for i in range(rng.randint(1, max_nodes)):
        op = rng.choice(ops)
        inputs = tuple(i if rng.random() < 0.5 else rng.randint(0, i) for _ in range(OPS[op]))
        nodes.append(DagNode(op, inputs))
    read = {v for node in nodes for v in node.inputs}
    sinks = [v for v in range(1, len(nodes) + 1) if v not in read]
    inner = [v for v in range(1, len(nodes) + 1) if v in read]
    extra = rng.sample(inner, min(len(inner), rng.randint(0, max_extra_outputs)))
    return DagSpec(nodes=tuple(nodes), outputs=tuple(sorted(sinks + extra)))
