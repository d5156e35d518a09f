"""``fxsplit inspect MODEL``: the annotated graph and its blocks, as rich tables."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from fxsplit.cli import exit_with_error
from fxsplit.cli.helptext import choices
from fxsplit.ir.names import COST_MODELS
from fxsplit.ir.units import format_bytes, format_seconds

if TYPE_CHECKING:
    from fxsplit.frontend import Inspection

__all__ = ["register", "node_table", "block_table", "formula_table", "inspect_symbolic_seq"]


def node_table(ins: object, limit: int | None = None) -> Table:
    """Rich table of the annotated graph: node, op, shape, FLOPs, time, bytes, block."""
    table = Table(title="annotated graph", show_lines=False)
    for col in ("node", "op", "target", "shape", "FLOPs", "fwd", "bwd", "params", "output", "block"):
        table.add_column(col, justify="right" if col in ("FLOPs", "fwd", "bwd", "params", "output", "block") else "left")
    rows = ins.node_rows()  # type: ignore[attr-defined]
    for r in rows[:limit]:
        table.add_row(
            r["node"], r["op"], r["target"][:40], str(r["shape"] or ""), f"{r['flops']:.3g}",
            format_seconds(r["fwd_s"]), format_seconds(r["bwd_s"]), format_bytes(r["param_bytes"]),
            format_bytes(r["output_bytes"]), str(r["block"]),
        )
    if limit is not None and len(rows) > limit:
        table.caption = f"{len(rows) - limit} more nodes not shown (--limit)"
    return table


def block_table(condensed: object) -> Table:
    """Rich table of the condensed blocks."""
    g = condensed.graph  # type: ignore[attr-defined]
    table = Table(title=f"{condensed!r}")
    for col in ("block", "name", "nodes", "FLOPs", "fwd", "bwd", "params", "activations", "out", "succ"):
        table.add_column(col, justify="left" if col in ("name", "succ") else "right")
    for b in g.blocks:
        table.add_row(
            str(b.id), b.name[:30], str(len(b.nodes)), f"{b.flops:.3g}", format_seconds(b.fwd_s),
            format_seconds(b.bwd_s), format_bytes(b.param_bytes), format_bytes(b.activation_bytes),
            format_bytes(b.output_bytes), ",".join(map(str, g.successors(b.id))),
        )
    return table


def formula_table(ins: object, seq_dim: int | None = None) -> Table:
    """Rich table of each block's analytic costs as formulas of the batch size ``b``
    (:mod:`fxsplit.passes.symbolic`), and of the sequence length ``s`` with ``seq_dim`` (the
    sequence dimension of the batched inputs; ``ins`` then from :func:`inspect_symbolic_seq`).

    Raises:
        ConfigError: when the graph fixes the batch (or, with ``seq_dim``, the length).
    """
    from fxsplit.passes.symbolic import block_formulas, symbolic_node_costs

    captured, condensed, device = ins.captured, ins.condensed, ins.device  # type: ignore[attr-defined]
    nodes = symbolic_node_costs(captured.gm, None, captured.batched_inputs, device, seq_dim=seq_dim)
    formulas = block_formulas(captured.gm, condensed.graph, nodes)
    what = "the batch size b" if seq_dim is None else f"the batch size b and sequence length s (captured: {nodes.seq_len})"
    table = Table(title=f"block costs as formulas of {what} (analytic, {device.name})")
    for col in ("block", "name", "flops", "fwd_s", "bwd_s", "activation_bytes"):
        table.add_column(col, justify="right" if col == "block" else "left")
    for f in formulas:
        table.add_row(str(f.block), f.name[:24], *(str(f.fields[k].evalf(4)) for k in ("flops", "fwd_s", "bwd_s",
                                                                                   "activation_bytes")))
    return table


def inspect_symbolic_seq(model: str, seq_dim: int, *, size: str = "tiny", method: str = "auto",
                         cost_model: str = "analytic", dump_dir: Path | None = None,
                         max_downsets: int = 20_000) -> Inspection:
    """:func:`fxsplit.inspect` of a model spec captured with a symbolic batch and sequence
    (dim ``seq_dim`` of the batched inputs), so :func:`formula_table` gives formulas of ``b``
    and ``s``; the shapes and costs shown are the example's.

    Raises:
        ConfigError: for a bad spec or option, or a model that fixes its sequence length.
        CaptureError: when the model cannot be captured with a symbolic length.
    """
    from fxsplit.api import load_model
    from fxsplit.frontend import front_end
    from fxsplit.options import CompileOptions
    from fxsplit.passes.capture import capture
    from fxsplit.passes.costs import measure_cpu_spec
    from fxsplit.viz import write_dot

    case = load_model(model, size=size)
    kwargs = dict(case.example_kwargs or {})
    captured = capture(case.model, case.example_inputs, kwargs, method=method, dynamic_batch=True, seq_dim=seq_dim)
    options = CompileOptions(capture_method=method, dynamic_batch=True, max_downsets=max_downsets)
    ins = front_end(case.model, case.example_inputs, kwargs, reference=measure_cpu_spec(), cost_model=cost_model,
                    options=options, captured=captured, name=model, force_shapes=True, measure_device="cpu",
                    dump_dir=dump_dir)
    if dump_dir is not None:
        write_dot(ins.condensed, dump_dir / "condensed.dot")
    return ins


def register(app: typer.Typer) -> None:
    @app.command("inspect")
    def inspect_cmd(
        model: Annotated[str, typer.Argument(help="zoo name (gpt, resnet, ...), hf:NAME, or module:function")],
        size: Annotated[str, typer.Option(help="zoo size preset: tiny, small, base")] = "tiny",
        method: Annotated[str, typer.Option(help="capture method: auto, export, symbolic_trace")] = "auto",
        cost_model: Annotated[str, typer.Option(help=choices(COST_MODELS))] = "analytic",
        dump: Annotated[Path | None, typer.Option(help="write the graph after every pass and a DOT/SVG here")] = None,
        limit: Annotated[int, typer.Option(help="show at most this many nodes")] = 60,
        max_downsets: Annotated[int, typer.Option(help="budget of the downset enumeration")] = 20_000,
        symbolic: Annotated[bool, typer.Option("--symbolic", help="print each block's analytic costs as formulas of the batch size b")] = False,
        seq_dim: Annotated[int | None, typer.Option(
            "--seq-dim", help="with --symbolic (implied): the sequence dimension of the batched inputs (tokens [batch, seq]: 1), "
            "captured symbolic too, for formulas of b and the sequence length s")] = None,
    ) -> None:
        """Capture MODEL, annotate costs and condense it; print the graph and the blocks."""
        from fxsplit.api import inspect
        from fxsplit.errors import FxsplitError

        console = Console()
        try:
            with console.status(f"capturing and annotating {model} ..."):
                if seq_dim is None:
                    ins = inspect(model, size=size, method=method, cost_model=cost_model, dump_dir=dump,
                                  max_downsets=max_downsets)
                else:
                    ins = inspect_symbolic_seq(model, seq_dim, size=size, method=method, cost_model=cost_model,
                                               dump_dir=dump, max_downsets=max_downsets)
            formulas = formula_table(ins, seq_dim) if symbolic or seq_dim is not None else None
        except (FxsplitError, OSError) as exc:  # OSError: a --dump folder it cannot write
            exit_with_error(console, exc, 2)
        console.print(node_table(ins, limit))
        console.print(block_table(ins.condensed))
        passes = ", ".join(f"{r.name} {format_seconds(r.time_s)}" for r in ins.records)
        console.print(f"{ins!r}\npasses: {passes}")
        if formulas is not None:
            console.print(formulas)
        if dump is not None:
            console.print(f"graph after every pass and condensed.dot written to {dump}")
