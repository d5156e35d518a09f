"""The ``fxsplit`` command line: one module per subcommand, all on one typer app.

Subcommand modules (``fxsplit/cli/<name>.py``) define ``register(app)`` and are listed in
``_SUBCOMMANDS``; the CLI prints (rich tables, progress bars), the library only logs.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any, NoReturn

import typer

__all__ = ["app", "exit_with_error", "main"]

app = typer.Typer(
    name="fxsplit",
    help="Split a PyTorch model across devices automatically and run it as a pipeline.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Split a PyTorch model across devices automatically and run it as a pipeline."""


def exit_with_error(console: Any, exc: BaseException, code: int = 2, label: str = "error") -> NoReturn:
    """Print ``label: message`` (the message escaped: rich markup in it, ``[...]``, prints as
    written) on ``console`` and end the command with exit code ``code`` (2: the input or a
    usage error; 1: a failure)."""
    from rich.markup import escape

    console.print(f"[red]{label}:[/red] {escape(str(exc))}", highlight=False)
    raise typer.Exit(code) from exc


_SUBCOMMANDS = ("solve", "inspect", "compile", "plan", "sweep", "strategies", "hybrid")
_registered = False


def _register_all(only: str | None = None) -> None:
    """Register every subcommand on :data:`app`, or ``only`` that one (start-up: a command does
    not import the others' modules)."""
    global _registered
    if _registered:
        return
    for name in (only,) if only in _SUBCOMMANDS else _SUBCOMMANDS:
        module = importlib.import_module(f"fxsplit.cli.{name}")
        module.register(app)
    _registered = True


def main() -> None:
    """Entry point of the ``fxsplit`` script and ``python -m fxsplit``."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    first = next((a for a in sys.argv[1:] if not a.startswith("-")), None)  # the subcommand, if one is named
    _register_all(only=first)
    app()
