"""The pass manager: an explicit, ordered list of graph passes (after MLIR's and torch.fx's).

A pass is a function ``fn(gm) -> PassResult`` named with a verb, or a frozen dataclass with
``__call__`` when it has options. It declares the ``node.meta`` keys it needs (``requires``) and
writes (``produces``) with the :func:`graph_pass` decorator. The manager checks every
``requires`` before running anything, times each pass, verifies after each pass when asked (the
graph lints and every produced key is on every node), and can dump the graph after each pass to
``{i:03d}_{name}.txt``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch.fx

from fxsplit.errors import AnnotationError, FxsplitError, PassError

__all__ = [
    "PassResult", "GraphPass", "graph_pass", "PassManager", "PassRecord", "require_meta", "carries_value",
    "getattr_path",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PassResult:
    """What a pass returns: the (possibly new) graph module, whether it changed, and an artifact."""

    gm: torch.fx.GraphModule
    modified: bool = False
    artifact: Any = None


class GraphPass(Protocol):
    """A graph pass: ``__call__(gm) -> PassResult`` with ``requires``/``produces`` meta keys."""

    requires: tuple[str, ...]
    produces: tuple[str, ...]

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult: ...


F = TypeVar("F", bound=Callable[..., PassResult])


def graph_pass(*, requires: Sequence[str] = (), produces: Sequence[str] = ()) -> Callable[[F], F]:
    """Declare the ``node.meta`` keys a pass function reads and writes."""

    def wrap(fn: F) -> F:
        fn.requires = tuple(requires)  # type: ignore[attr-defined]
        fn.produces = tuple(produces)  # type: ignore[attr-defined]
        return fn

    return wrap


def pass_name(p: Any) -> str:
    """The pass's name: the function name, or the class name in snake case."""
    if hasattr(p, "__name__"):
        return str(p.__name__)
    cls = type(p).__name__
    return "".join("_" + c.lower() if c.isupper() else c for c in cls).lstrip("_")


def getattr_path(root: Any, target: str, default: Any = None) -> Any:
    """``root.a.b.c`` for ``target="a.b.c"`` (a ``get_attr`` target), or ``default`` when a part
    is missing."""
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part, _MISSING)
        if obj is _MISSING:
            return default
    return obj


_MISSING = object()


def carries_value(node: torch.fx.Node) -> bool:
    """True when ``node`` has a value for ``node.meta["val"]``: every node except the output and
    ``get_attr`` nodes of non-tensor attributes (the subgraph ``GraphModule`` of a higher-order op
    such as ``wrap_with_set_grad_enabled``, which export emits for a ``torch.no_grad()`` region)."""
    if node.op == "output":
        return False
    if node.op == "get_attr":
        obj = getattr_path(node.graph.owning_module, str(node.target))
        return obj is None or not isinstance(obj, torch.nn.Module)
    return True


def require_meta(node: torch.fx.Node, key: str, writer: str) -> Any:
    """``node.meta[key]``, or :class:`AnnotationError` naming the node, the key and the writer."""
    try:
        return node.meta[key]
    except KeyError:
        raise AnnotationError(
            f"node {node.name!r} ({node.op} {node.target}) has no meta[{key!r}]; "
            f"run the {writer} pass first"
        ) from None


@dataclass(frozen=True)
class PassRecord:
    """Timing and outcome of one pass run."""

    name: str
    time_s: float
    modified: bool
    num_nodes: int


@dataclass
class PassManager:
    """Run an ordered list of passes over a GraphModule.

    Args:
        passes: The passes, in order.
        verify: Lint the graph and check produced keys after each pass (tests turn this on).
        dump_dir: When set, write ``{i:03d}_{name}.txt`` (the graph after pass ``i``) there.

    Raises:
        AnnotationError: before anything runs, when a pass requires a key that no earlier pass
            produces and the graph does not already carry.
        PassError: when a pass raises a foreign exception (wrapped, with the passes before it).
    """

    passes: Sequence[Any]
    verify: bool = False
    dump_dir: str | Path | None = None
    records: list[PassRecord] = field(default_factory=list)
    artifacts: dict[str, Any] = field(default_factory=dict)

    def check_requires(self, gm: torch.fx.GraphModule) -> None:
        available = {k for k in ("val", "fxsplit.cost", "fxsplit.block") if _all_have(gm, k)}
        for p in self.passes:
            missing = [k for k in getattr(p, "requires", ()) if k not in available]
            if missing:
                raise AnnotationError(
                    f"pass {pass_name(p)!r} requires meta keys {missing} that no earlier pass "
                    f"produces; add the pass that writes them before it"
                )
            available |= set(getattr(p, "produces", ()))

    def run(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        """Run every pass in order and return the final graph module."""
        self.check_requires(gm)
        done: list[str] = []
        if self.dump_dir is not None:
            Path(self.dump_dir).mkdir(parents=True, exist_ok=True)
            self._dump(gm, 0, "captured")
        for i, p in enumerate(self.passes, start=1):
            name = pass_name(p)
            start = time.perf_counter()
            try:
                result = p(gm)
            except FxsplitError:
                raise
            except Exception as exc:
                raise PassError(f"pass {name!r} failed (after {done or 'no passes'}): {type(exc).__name__}: {exc}") from exc
            elapsed = time.perf_counter() - start
            gm = result.gm
            self.records.append(PassRecord(name, elapsed, result.modified, len(gm.graph.nodes)))
            if result.artifact is not None:
                self.artifacts[name] = result.artifact
            log.info("pass %s: %.3f s, modified=%s", name, elapsed, result.modified)
            if self.verify:
                self._verify(gm, p, name)
            if self.dump_dir is not None:
                self._dump(gm, i, name)
            done.append(name)
        return gm

    def _verify(self, gm: torch.fx.GraphModule, p: Any, name: str) -> None:
        try:
            gm.graph.lint()
        except Exception as exc:
            raise PassError(f"graph does not lint after pass {name!r}: {exc}") from exc
        for key in getattr(p, "produces", ()):
            for node in gm.graph.nodes:
                if _should_have(node, key) and key not in node.meta:
                    raise PassError(f"pass {name!r} declares {key!r} but node {node.name!r} lacks it")

    def _dump(self, gm: torch.fx.GraphModule, i: int, name: str) -> None:
        assert self.dump_dir is not None
        lines = [f"# graph after pass {i}: {name}", gm.graph.python_code("self").src, "", "# nodes"]
        for node in gm.graph.nodes:
            meta = {k: v for k, v in node.meta.items() if k.startswith("fxsplit.")}
            val = node.meta.get("val")
            shape = tuple(val.shape) if hasattr(val, "shape") else ""
            lines.append(f"{node.name}\t{node.op}\t{node.target}\t{shape}\t{meta}")
        (Path(self.dump_dir) / f"{i:03d}_{name}.txt").write_text("\n".join(lines) + "\n")

    def summary(self) -> list[tuple[str, float, bool, int]]:
        return [(r.name, r.time_s, r.modified, r.num_nodes) for r in self.records]


def _should_have(node: torch.fx.Node, key: str) -> bool:
    return carries_value(node) if key == "val" else node.op != "output"


def _all_have(gm: torch.fx.GraphModule, key: str) -> bool:
    return all(key in n.meta for n in gm.graph.nodes if _should_have(n, key))
