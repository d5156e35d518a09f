"""The layering rules of ARCHITECTURE.md §1, checked on the installed package."""

from __future__ import annotations

import ast
import os
import pathlib
import re
import shutil
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


def _imported(path: pathlib.Path) -> list[str]:
    """Every module ``path`` imports (at any depth: lazy imports in functions count)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def _under(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


@pytest.mark.parametrize("folder", ["solvers", "fxsplit/ir", "fxsplit/schedule"])
def test_torch_free_sources_never_import_torch(folder: str) -> None:
    for path in (ROOT / folder).rglob("*.py"):
        bad = [n for n in _imported(path) if _under(n, ("torch", "fxsplit.passes"))]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


@pytest.mark.parametrize("folder", ["passes", "solvers"])
def test_passes_and_solvers_leave_presentation_to_the_edge(folder: str) -> None:
    """The import contract's presentation rule for the two folders ``lint-imports`` cannot see
    from the source tree (pyproject.toml)."""
    for path in (ROOT / folder).rglob("*.py"):
        bad = [n for n in _imported(path) if _under(n, ("rich", "matplotlib", "typer", "fxsplit.viz", "fxsplit.cli"))]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


@pytest.fixture(scope="module")
def installed_layout(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The package as a wheel installs it: ``fxsplit/`` with ``passes/`` and ``solvers/`` inside
    (``[tool.setuptools.package-dir]``), and pyproject.toml beside it for the tools' settings."""
    tree = tmp_path_factory.mktemp("installed")
    shutil.copytree(ROOT / "fxsplit", tree / "fxsplit", ignore=shutil.ignore_patterns("__pycache__"))
    for folder in ("passes", "solvers"):
        shutil.copytree(ROOT / folder, tree / "fxsplit" / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    return tree


def _run_on(tree: pathlib.Path, tool: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}  # before the editable install's finder
    return subprocess.run([str(_tool(tool))], capture_output=True, text=True, cwd=tree, env=env)


def test_import_contracts_hold_for_every_package(installed_layout: pathlib.Path) -> None:
    """pyproject.toml's contracts on the whole package, passes and solvers held to their layers."""
    out = _run_on(installed_layout, "lint-imports")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_installed_layout_is_what_python_imports(installed_layout: pathlib.Path) -> None:
    """The two checks above and below read the copy, not the source tree (else they prove nothing)."""
    code = "import fxsplit.passes, fxsplit.solvers; print(fxsplit.passes.__file__, fxsplit.solvers.__file__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=installed_layout,
                         env={**os.environ, "PYTHONPATH": str(installed_layout)})
    assert all(p.startswith(str(installed_layout)) for p in out.stdout.split()), out.stdout


def test_mypy_is_clean_on_every_package(installed_layout: pathlib.Path) -> None:
    """The whole package type-checks, passes and solvers included (the source tree's ``mypy``
    sees fxsplit/ only), with ``disallow_any_generics`` and ``warn_unused_ignores`` on ir,
    solvers and schedule (``[tool.mypy]`` in pyproject.toml)."""
    out = _run_on(installed_layout, "mypy")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    checked = int(re.search(r"in (\d+) source files", out.stdout).group(1))  # type: ignore[union-attr]
    own = sum(1 for _ in (ROOT / "fxsplit").rglob("*.py"))
    assert checked > own, f"mypy checked {checked} files, fxsplit/ alone has {own}: passes/solvers were not seen"


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


def test_ruff_is_clean() -> None:
    out = subprocess.run([str(_tool("ruff")), "check", "fxsplit", "passes", "solvers", "tests", "bench"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


@pytest.mark.parametrize("module,bad", [
    ("fxsplit/runtime/trace.py", "import fxsplit.compiler"),  # a layer importing one above it
    ("fxsplit/solvers/dp.py", "import fxsplit.passes.costs"),  # solvers' layer is held too, not only fxsplit/
])
def test_a_wrong_way_import_breaks_the_contract(installed_layout: pathlib.Path, tmp_path: pathlib.Path,
                                                module: str, bad: str) -> None:
    tree = tmp_path / "tree"
    shutil.copytree(installed_layout, tree)
    path = tree / module
    path.write_text(path.read_text() + f"\n{bad}  # noqa\n")
    out = _run_on(tree, "lint-imports")
    assert out.returncode != 0 and "BROKEN" in out.stdout, out.stdout[-2000:]


def test_every_package_folder_is_installed() -> None:
    """Regression: ``fxsplit/viz/`` was a new package missing from ``[tool.setuptools] packages``
    (an explicit list), so a wheel or a non-editable install lacked it and ``fxsplit plan`` failed
    to import; the editable install and the copied layout above both hid it."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {prefix: ROOT / path for prefix, path in config["package-dir"].items()}
    found = set()
    for prefix, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            parts = init.parent.relative_to(folder).parts
            found.add(".".join((prefix, *parts)))
    assert found - set(config["packages"]) == set(), "add these to [tool.setuptools] packages"
