"""The layering rules of ARCHITECTURE.md §1, checked on the installed package."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

import fxsplit

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("module", ["fxsplit.ir", "fxsplit.solvers", "fxsplit.schedule"])
def test_torch_free_layers_do_not_load_torch(module: str) -> None:
    code = (
        f"import sys, importlib, pkgutil; m = importlib.import_module({module!r}); "
        "[importlib.import_module(i.name) for i in pkgutil.walk_packages(m.__path__, m.__name__ + '.')]; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", f"importing {module} loaded torch"


@pytest.mark.parametrize("folder", ["solvers", "fxsplit/ir", "fxsplit/schedule"])
def test_torch_free_sources_never_import_torch(folder: str) -> None:
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            bad = [n for n in names if n == "torch" or n.startswith("torch.") or n.startswith("fxsplit.passes")]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_import_fxsplit_is_light() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import sys, fxsplit; print('torch' in sys.modules, 'ortools' in sys.modules)"],
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.split() == ["False", "False"]


def test_import_linter_contracts() -> None:
    lint = pathlib.Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        pytest.skip("import-linter is not installed (pip install -e .[dev])")
    out = subprocess.run([str(lint)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_version() -> None:
    assert fxsplit.__version__


def _tool(name: str) -> pathlib.Path:
    path = pathlib.Path(sys.executable).with_name(name)
    if not path.exists():
        pytest.skip(f"{name} is not installed (pip install -e .[dev])")
    return path


def test_mypy_is_clean_on_the_package() -> None:
    """The package type-checks (``[tool.mypy]`` in pyproject.toml), so a wrong type fails CI."""
    out = subprocess.run([str(_tool("mypy"))], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_ruff_is_clean() -> None:
    out = subprocess.run([str(_tool("ruff")), "check", "fxsplit", "passes", "solvers", "tests", "bench"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
