"""The ``fxsplit`` command line: one module per subcommand, all on one typer app.

Subcommand modules (``fxsplit/cli/<name>.py``) define ``register(app)`` and are listed in
``_SUBCOMMANDS``; the CLI prints (rich tables, progress bars), the library only logs.
"""

from __future__ import annotations

import importlib
import logging

import typer

__all__ = ["app", "main"]

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


_SUBCOMMANDS = ("solve", "inspect", "compile", "plan")
_registered = False


def _register_all() -> None:
    global _registered
    if _registered:
        return
    for name in _SUBCOMMANDS:
        try:
            module = importlib.import_module(f"fxsplit.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"fxsplit.cli.{name}":
                continue  # subcommand not built yet
            raise
        module.register(app)
    _registered = True


def main() -> None:
    """Entry point of the ``fxsplit`` script and ``python -m fxsplit``."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    _register_all()
    app()
