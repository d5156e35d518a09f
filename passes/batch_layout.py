"""Where the batch is: the batch dimension of every input and output, and a batch-first graph.

fxsplit splits micro-batches on dim 0. A model whose batch is elsewhere (a sequence-first
``nn.TransformerEncoder``: ``src [seq, batch, d]``, ``src_key_padding_mask [batch, seq]``; an
output ``[seq, batch, d]``) is captured with a symbolic batch (``torch.export``'s ``Dim.AUTO``), the
batch dimension of every value is read from the symbol export proves equal to the first input's,
and the graph is made batch-first at its boundary (a ``movedim`` after each such placeholder and
before each such output). Every pass and the runtime then see dim 0; :class:`BatchLayout` moves
the user's values to and from that form (views, no copies).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from fxsplit.errors import ConfigError

__all__ = ["BatchLayout", "batch_dims", "batch_dynamic_shapes", "check_batch_dim", "make_batch_first", "primary_input"]


@dataclass(frozen=True)
class BatchLayout:
    """Where the batch is in the model's own inputs and outputs, when it is not dim 0.

    A sequence-first model (``nn.TransformerEncoder(batch_first=False)``: ``src [seq, batch,
    d]``, ``src_key_padding_mask [batch, seq]``) has its batch on different dims of different
    values. The captured graph is made batch-first at its boundary (a ``movedim`` after each
    such placeholder and before each such output), so every pass and the runtime split and
    merge micro-batches on dim 0; this layout moves the user's values to and from that form.

    Attributes:
        in_dims: ``[num_flat_inputs]`` the batch dimension of each flat input in the model's
            layout, or None for an input without the batch.
        out_dims: ``[num_flat_outputs]`` the same for the outputs.
        target_dim: Where the batch is in a target leaf (the first input's batch dimension;
            :func:`fxsplit.runtime.microbatch.split_target`).
    """

    in_dims: tuple[int | None, ...]
    out_dims: tuple[int | None, ...]
    target_dim: int = 0

    @staticmethod
    def _move(flat: Sequence[Any], dims: Sequence[int | None], forward: bool) -> list[Any]:
        out = []
        for x, d in zip(flat, dims, strict=True):
            if d and isinstance(x, torch.Tensor):
                x = x.movedim(d, 0) if forward else x.movedim(0, d)
            out.append(x)
        return out

    def inputs_to_batch_first(self, flat: Sequence[Any]) -> list[Any]:
        """The user's flat inputs as the captured graph takes them (views, no copy)."""
        return self._move(flat, self.in_dims, True)

    def outputs_from_batch_first(self, flat: Sequence[Any]) -> list[Any]:
        """The graph's flat outputs in the model's own layout (views, no copy)."""
        return self._move(flat, self.out_dims, False)


def check_batch_dim(batch_dim: Any) -> int:
    """``batch_dim`` as given to ``compile``: an int >= 0.

    Raises:
        ConfigError: for anything else (a bool, a string, a negative dimension).
    """
    if isinstance(batch_dim, bool) or not isinstance(batch_dim, int) or batch_dim < 0:
        raise ConfigError(f"batch_dim={batch_dim!r}; pass the batch dimension of the first input, an int >= 0 "
                          "(negative dimensions are not taken: count from 0)")
    return batch_dim


def primary_input(args: tuple, kwargs: dict, batch_dim: int) -> tuple[int, torch.Tensor] | None:
    """The flat index and value of the first tensor input with a ``batch_dim`` dimension.

    Raises:
        ConfigError: for ``batch_dim != 0`` when no tensor input has that many dimensions.
    """
    leaves = pytree.tree_leaves((args, kwargs))
    for i, t in enumerate(leaves):
        if isinstance(t, torch.Tensor) and t.dim() > batch_dim >= 0:
            return i, t
    if batch_dim == 0:
        return None
    shapes = [list(t.shape) for t in leaves if isinstance(t, torch.Tensor)]
    raise ConfigError(f"batch_dim={batch_dim}, but no input tensor has dimension {batch_dim} (input shapes {shapes}); "
                      "give the batch dimension of the first input, counted from 0")


def batch_dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict, batch_dim: int = 0) -> Any:
    """Dim.AUTO on the batch: dim 0 of every input of the batch's size (``batch_dim == 0``);
    else the first input's ``batch_dim`` and every dimension of the batch's size of the others
    (export then ties the real batch dimensions together and leaves the rest apart)."""
    first = primary_input(args, kwargs, batch_dim)
    if first is None:
        return None
    batch = first[1].shape[batch_dim]
    shapes = torch.export.ShapesCollection()
    for i, t in enumerate(pytree.tree_leaves((args, kwargs))):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            continue
        if batch_dim == 0:
            dims = [0] if t.shape[0] == batch else []
        elif i == first[0]:
            dims = [batch_dim]
        else:
            dims = [d for d in range(t.dim()) if t.shape[d] == batch]
        if dims:
            shapes[t] = dict.fromkeys(dims, torch.export.Dim.AUTO)
    return shapes.dynamic_shapes(model, args, kwargs)


def _symbolic(size: Any) -> bool:
    return isinstance(size, torch.SymInt) and not is_concrete_int(size)


def _expr(size: Any) -> Any:
    """The sympy expression of a symbolic size (a ``torch.SymInt``, typed ``int`` in shapes)."""
    return size.node.expr


def batch_dims(gm: torch.fx.GraphModule, args: tuple, kwargs: dict, batch_dim: int
                ) -> tuple[tuple[int | None, ...], tuple[int | None, ...]] | None:
    """The batch dimension of every flat input and output (None: no batch), read from export's
    symbolic shapes; None when export specialised the batch (the model fixes it).

    With ``batch_dim == 0`` every input whose dim 0 stayed symbolic is batched (each was marked
    alone), and an output's batch dimension is the first carrying one of their symbols. Else the
    batch is the first input's ``batch_dim`` symbol: a dimension with that symbol (export proved
    it equal) carries the batch, wherever it is.

    Raises:
        ConfigError: for a fixed ``batch_dim != 0``, or a value with two batch dimensions or
            with a dimension of the batch's size export could not tie to the batch (an output
            with two batch dimensions is left unbatched: the per-sample check flags it).
    """
    phs = list(gm.graph.find_nodes(op="placeholder"))
    vals = [n.meta.get("val") for n in phs]
    if batch_dim == 0:
        symbols = {_expr(v.shape[0]) for v in vals if isinstance(v, torch.Tensor) and v.dim() and _symbolic(v.shape[0])}
        if not symbols:
            return None
        in_dims = tuple(0 if isinstance(v, torch.Tensor) and v.dim() and _symbolic(v.shape[0]) else None for v in vals)
    else:
        index, tensor = primary_input(args, kwargs, batch_dim)  # type: ignore[misc]
        size = vals[index].shape[batch_dim]
        if not _symbolic(size):
            raise ConfigError(
                f"batch_dim={batch_dim}: the model fixes dim {batch_dim} of input {phs[index].name!r} "
                f"{list(tensor.shape)} to {tensor.shape[batch_dim]} (export specialised it), so it is not a batch "
                "dimension the pipeline can split; give the dimension that holds the samples")
        symbols = {size.node.expr}
        in_dims = tuple(_dim_of(v, symbols, f"input {n.name!r}", int(tensor.shape[batch_dim]), strict=True)
                        for n, v in zip(phs, vals, strict=True))
    outs = gm.graph.output_node().args[0]
    out_dims = tuple(_dim_of(o.meta.get("val"), symbols, f"output {i}", None) if isinstance(o, torch.fx.Node) else None
                     for i, o in enumerate(outs))  # type: ignore[arg-type]
    return in_dims, out_dims


def _dim_of(val: Any, symbols: set[Any], what: str, batch: int | None, strict: bool = False) -> int | None:
    if not isinstance(val, torch.Tensor):
        return None
    dims = [d for d, s in enumerate(val.shape) if _symbolic(s) and _expr(s) in symbols]
    if len(dims) > 1 and not strict:  # an output such as x @ x.T [batch, batch]: no one batch dimension
        return None  # (the per-sample check finds it: it changes shape twice with the batch)
    if len(dims) > 1:
        raise ConfigError(f"{what} {list(val.shape)} has the batch on dims {dims}; fxsplit splits one batch dimension "
                          "per value: pass such a value whole (not batched), or reshape it")
    loose = [d for d, s in enumerate(val.shape) if strict and _symbolic(s) and d not in dims]
    if not dims and loose:
        raise ConfigError(
            f"{what} {list(val.shape)}: dim {loose[0]} has the batch's size {batch} but the model never ties it to the "
            "first input's batch dimension, so fxsplit cannot tell whether it holds samples; give this example a "
            "batch size no other dimension has")
    return dims[0] if dims else None


def make_batch_first(gm: torch.fx.GraphModule, dims: Any, batch_dim: int
                 ) -> tuple[tuple[bool, ...] | None, tuple[bool, ...] | None, BatchLayout | None]:
    """Make ``gm`` take and return its batched values batch-first: ``movedim(x, 0, d)`` after a
    placeholder with the batch on ``d > 0``, ``movedim(y, d, 0)`` before such an output.

    Returns:
        ``(batched_inputs, batched_outputs, layout)`` (None, None, None when ``dims`` is None);
        ``layout`` is None when every batch already is on dim 0.
    """
    if dims is None:
        return None, None, None
    in_dims, out_dims = dims
    batched = (tuple(d is not None for d in in_dims), tuple(d is not None for d in out_dims))
    if not any(in_dims) and not any(out_dims):
        return (*batched, None)
    graph = gm.graph
    phs = list(graph.find_nodes(op="placeholder"))
    with graph.inserting_after(phs[-1]):
        for node, d in zip(reversed(phs), reversed(in_dims), strict=True):
            if not d:
                continue
            moved = graph.call_function(torch.ops.aten.movedim.int, (node, 0, d))
            node.replace_all_uses_with(moved, delete_user_cb=lambda user, m=moved: user is not m)
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                moved.meta["val"] = val
                node.meta["val"] = val.movedim(d, 0)
    out = graph.output_node()
    leaves = list(out.args[0])  # type: ignore[arg-type]
    with graph.inserting_before(out):
        for i, (leaf, d) in enumerate(zip(leaves, out_dims, strict=True)):
            if d:
                leaves[i] = graph.call_function(torch.ops.aten.movedim.int, (leaf, d, 0))
                val = leaf.meta.get("val")
                if isinstance(val, torch.Tensor):
                    leaves[i].meta["val"] = val.movedim(d, 0)
    out.args = (tuple(leaves),)
    gm.recompile()
    return (*batched, BatchLayout(tuple(in_dims), tuple(out_dims), batch_dim))
