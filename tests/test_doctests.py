"""The examples in the docstrings of the torch-free layers (ir, schedule, solvers) run and hold."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

PACKAGES = ["fxsplit.ir", "fxsplit.schedule", "fxsplit.solvers", "fxsplit.runtime.trace", "fxsplit.runtime.dist_schedule"]


def _modules() -> list[str]:
    names = []
    for pkg in PACKAGES:
        mod = importlib.import_module(pkg)
        names.append(pkg)
        for info in pkgutil.walk_packages(getattr(mod, "__path__", []), prefix=f"{pkg}."):
            names.append(info.name)
    return sorted(set(names))


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples of {name} failed"


def test_the_layers_have_examples() -> None:
    finder = doctest.DocTestFinder()  # counted, not run again: test_docstring_examples runs them
    attempted = sum(len(t.examples) for n in _modules() for t in finder.find(importlib.import_module(n)))
    assert attempted >= 10, f"only {attempted} docstring examples in {PACKAGES}"
