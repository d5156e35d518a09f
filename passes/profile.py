"""The profiled cost model: every node timed on the target device at the micro-batch sizes that run.

PipeDream's profiler times each layer's forward and backward on the device it will run on; the
time of a micro-batch is not a linear share of the batch's (small matrices run below the peak and
every operator pays a launch and dispatch cost). This pass times every compute node at two or
three micro-batch sizes ``b`` (the smallest and largest micro-batch of the candidate micro-batch
counts, and one between), fits ``t(b) = t0 + t1 * b`` per node by least squares (``t0, t1 >= 0``),
and stores the time of the whole annotated batch ``t0 + t1 * B`` with its fixed part ``t0``
(``NodeCost.fwd_fixed_s``), so :meth:`CondensedGraph.scaled` gives ``t0 + t1 * b`` for a
micro-batch of any size ``b``.

Nodes are timed inside whole forward and backward passes (:func:`~fxsplit.passes.measure.time_nodes_in_context`).
Timings are cached on disk, one JSON file per device name and torch version, keyed by the
micro-batch size, the graph's digest (its code, input shapes and state shapes) and the node: a
second compile of the same model times nothing.

References:
    Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN Training", SOSP 2019,
    section 3.1 (profiling).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import tempfile
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx

from fxsplit.errors import ConfigError
from fxsplit.ir.devices import DeviceSpec
from fxsplit.passes.measure import NodeTimes, median_time_s, time_nodes_in_context

__all__ = ["ProfileCache", "STALE_RTOL", "reference_kernel_s", "fit_affine", "profile_sizes", "profile_node_times", "default_cache_dir", "device_name",
           "graph_digest", "is_cached"]

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]
"""``progress(done, total)``: called after each micro-batch size is timed."""


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/fxsplit/profiles`` (``~/.cache/fxsplit/profiles`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fxsplit" / "profiles"


def open_cache(directory: str | os.PathLike[str] | bool | None, device: str,
               torch_device: str | None = None) -> ProfileCache | None:
    """The timing cache ``CompileOptions.profile_cache_dir`` asks for: ``False`` none (every node
    timed afresh), ``None``, ``True`` or ``""`` the default folder (:func:`default_cache_dir`), else that
    folder; ``device`` is the name timings are kept under (:func:`device_name`). With
    ``torch_device`` (where the timings are taken) the machine's speed is measured
    (:func:`reference_kernel_s`) and timings taken at another speed are dropped
    (:class:`ProfileCache`)."""
    if directory is False:
        return None
    reference = reference_kernel_s(torch_device) if torch_device is not None else None
    return ProfileCache(default_cache_dir() if directory is True or not directory else directory, device, reference)


STALE_RTOL = 0.1
"""Cached timings are dropped when the machine's reference kernel runs more than this much
faster or slower (relative) than when they were taken."""


def reference_kernel_s(device: str = "cpu", repeats: int = 7) -> float:
    """Median seconds of a fixed kernel on ``device`` (``"cpu"`` with torch's threads, or a CUDA
    device): 24 products of 256 x 256 matrices and eight 8 MiB copies, compute and memory as a
    model's operators use them; a few milliseconds on one core of this kind of CPU.

    Raises:
        ConfigError: for a device torch does not know.
    """
    try:
        dev = torch.device(device)
        a = torch.full((256, 256), 0.5, device=dev)  # no random draw: the caller's streams stay
        src = torch.empty(2 * 2**20, device=dev)
        dst = torch.empty_like(src)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"reference_kernel_s: no such device {device!r}: {exc}") from exc

    def kernel() -> None:
        for _ in range(24):
            torch.mm(a, a)
        for _ in range(8):
            dst.copy_(src)

    return median_time_s(kernel, warmup=1, repeats=repeats, device=dev)


def device_name(spec: DeviceSpec) -> str:
    """The name timings of ``spec`` are cached under: the CUDA device's model name, or for a CPU
    its model name and torch's thread count (timings depend on both).

    Example:
        >>> device_name(DeviceSpec("fast", torch_device="meta"))
        'meta'
    """
    dev = torch.device(spec.torch_device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(dev)
    if dev.type == "cpu":
        return f"cpu-{_cpu_model()}-{torch.get_num_threads()}t"
    return dev.type


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


class ProfileCache(MutableMapping[str, NodeTimes]):
    """Node timings of one device kind and torch version, kept in one JSON file.

    Args:
        directory: Folder of the cache files (created on :meth:`save`).
        device_name: The device's name (``torch.cuda.get_device_name`` or ``"cpu"``).
        reference_s: The machine's speed now: seconds of :func:`reference_kernel_s` on the
            device. The file keeps the one measured when its timings were taken; when the two
            differ by more than :data:`STALE_RTOL` (a VM's neighbours, clocks and thermal state
            move a machine's speed by 10-40 % between hours), or the file does not say (its
            first format), the cached timings are dropped and timed again, with a log line.
            None: not checked.

    Keys are ``"{size}|{graph digest}|{node}"``, values ``(fwd_s, bwd_s)``. :attr:`hits` and
    :attr:`misses` count look-ups since the file was opened; :attr:`stale` says whether the
    file's timings were dropped for the machine's speed.
    """

    def __init__(self, directory: str | os.PathLike[str], device_name: str, reference_s: float | None = None) -> None:
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{device_name}-torch{torch.__version__}")
        self.path = Path(directory) / f"{slug}.json"
        self._data: dict[str, NodeTimes] = {}
        self.hits = self.misses = 0
        self._dirty = False
        self.reference_s = reference_s
        self.stale = False
        if self.path.exists():
            try:
                raw = json.loads(self.path.read_text())
                versioned = isinstance(raw, dict) and "timings" in raw  # else the first format: timings only
                timings = raw["timings"] if versioned else raw
                self._data = {k: (float(v[0]), float(v[1])) for k, v in timings.items()}
                then = raw.get("reference_s") if versioned else None
            except (ValueError, TypeError, IndexError, OSError, AttributeError) as exc:
                log.warning("ignoring unreadable profile cache %s (%s); it will be rewritten", self.path, exc)
                then = None
            why = ""
            if reference_s is not None and self._data:
                if then is None:
                    why = "its timings do not say at what speed of this machine they were taken"
                elif abs(reference_s / float(then) - 1.0) > STALE_RTOL:
                    why = (f"this machine runs a reference kernel in {reference_s * 1e3:.2f} ms, {float(then) * 1e3:.2f} "
                           f"ms when its timings were taken ({(reference_s / float(then) - 1.0) * 100:+.0f} %)")
            if why:
                log.info("profile cache %s: %s; timing again", self.path, why)
                self._data, self._dirty, self.stale = {}, True, True
            elif then is not None:
                self.reference_s = float(then)  # the timings' own speed, kept with them

    def __getitem__(self, key: str) -> NodeTimes:
        return self._data[key]

    def __contains__(self, key: object) -> bool:
        found = key in self._data
        self.hits += found
        self.misses += not found
        return found

    def __setitem__(self, key: str, value: NodeTimes) -> None:
        self._data[key] = (float(value[0]), float(value[1]))
        self._dirty = True

    def __delitem__(self, key: str) -> None:
        del self._data[key]
        self._dirty = True

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def save(self) -> None:
        """Write the file atomically (a crash never leaves a half-written cache)."""
        if not self._dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"reference_s": self.reference_s, "timings": self._data}, f)
        os.replace(tmp, self.path)
        self._dirty = False


def fit_affine(sizes: Sequence[int], times_s: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``t(b) = t0 + t1 * b`` with ``t0, t1 >= 0``.

    Args:
        sizes: ``[k]`` micro-batch sizes, samples.
        times_s: ``[k]`` measured seconds.

    Returns:
        ``(t0_s, t1_s_per_sample)``. With one size (or all sizes equal) ``t0 = 0`` and ``t1 =
        mean(t / b)``: the time is taken as proportional to the batch.

    Example:
        >>> fit_affine([1, 4], [3.0, 6.0])
        (2.0, 1.0)
    """
    pts = [(float(b), float(t)) for b, t in zip(sizes, times_s, strict=True)]
    if len({b for b, _ in pts}) < 2:
        return 0.0, sum(t / b for b, t in pts) / len(pts)
    n = len(pts)
    mb, mt = sum(b for b, _ in pts) / n, sum(t for _, t in pts) / n
    slope = sum((b - mb) * (t - mt) for b, t in pts) / sum((b - mb) ** 2 for b, _ in pts)
    if slope < 0:  # noise on a size-independent op: a constant fits best
        return mt, 0.0
    t0 = mt - slope * mb
    if t0 < 0:  # through the origin instead
        return 0.0, sum(b * t for b, t in pts) / sum(b * b for b, _ in pts)
    return t0, slope


def profile_sizes(batch: int, microbatches: int | Sequence[int]) -> tuple[int, ...]:
    """The micro-batch sizes to time for a batch of ``batch`` samples.

    Args:
        batch: Samples in the annotated batch.
        microbatches: The micro-batch count that runs, or the candidate counts of the schedule
            search.

    Returns:
        One size for one count (``ceil(batch / m)``); otherwise the smallest and largest
        micro-batch size of the candidates and, when they are far apart, their geometric mean.

    Raises:
        ConfigError: for a count outside ``1..batch``.
    """
    counts = (microbatches,) if isinstance(microbatches, int) else tuple(microbatches)
    bad = [m for m in counts if not 1 <= m <= batch]
    if bad or not counts:
        raise ConfigError(f"micro-batch counts {list(bad or counts)} must lie in 1..batch={batch}")
    sizes = sorted({math.ceil(batch / m) for m in counts})
    if len(sizes) <= 2:
        return tuple(sizes)
    lo, hi = sizes[0], sizes[-1]
    mid = min(sizes, key=lambda s: abs(math.log(s) - (math.log(lo) + math.log(hi)) / 2))
    return tuple(sorted({lo, mid, hi}))


def _slice_batch(flat: Sequence[Any], batched: Sequence[bool], size: int) -> list[Any]:
    return [x[:size] if b and isinstance(x, torch.Tensor) else x for x, b in zip(flat, batched, strict=True)]


def graph_digest(gm: torch.fx.GraphModule, flat_inputs: Sequence[Any]) -> str:
    """A digest equal for two graphs that run the same code on inputs and state of the same
    shapes and dtypes: the generated code, the input shapes and every parameter and buffer's
    name, shape and dtype (values do not change the timing), and the autocast dtypes in force
    (mixed precision runs other kernels)."""
    h = hashlib.sha256(gm.code.encode())
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            h.update(f"autocast:{device}:{torch.get_autocast_dtype(device)}".encode())
    for x in flat_inputs:
        h.update(repr((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x).encode())
    for name, t in [*gm.named_parameters(), *gm.named_buffers()]:
        h.update(f"{name}{tuple(t.shape)}{t.dtype}{t.requires_grad}".encode())
    return h.hexdigest()[:24]


def is_cached(gm: torch.fx.GraphModule, flat_inputs: Sequence[Any], sizes: Sequence[int],
              cache: MutableMapping[str, NodeTimes] | None) -> bool:
    """Whether ``cache`` holds every node's timings at every size, so that
    :func:`profile_node_times` with the same arguments times nothing."""
    if cache is None:
        return False
    digest = graph_digest(gm, flat_inputs)
    return all(f"{size}|{digest}|{n}" in cache for size in sizes for n in _timed_names(gm))


def _timed_names(gm: torch.fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op != "output" and not n.meta["fxsplit.cost"].is_view]


def _timed_at(gm: torch.fx.GraphModule, inputs: list[Any], names: list[str], key: str, device: str,
              cache: MutableMapping[str, NodeTimes], warmup: int, repeats: int) -> dict[str, NodeTimes]:
    """Per-node times at one size, from the cache when every node is there, else timed."""
    keys = {n: f"{key}|{n}" for n in names}
    if all(k in cache for k in keys.values()):
        return {n: cache[k] for n, k in keys.items()}
    times = time_nodes_in_context(gm, inputs, device, warmup, repeats)
    for n, k in keys.items():
        cache[k] = times.get(n, (0.0, 0.0))
    return {n: cache[k] for n, k in keys.items()}


def profile_node_times(
    gm: torch.fx.GraphModule,
    flat_inputs: Sequence[Any],
    batched: Sequence[bool],
    sizes: Sequence[int],
    device: str = "cpu",
    *,
    cache: MutableMapping[str, NodeTimes] | None = None,
    warmup: int = 2,
    repeats: int = 5,
    progress: Progress | None = None,
) -> dict[str, tuple[float, float, float, float]]:
    """Time every compute node at each micro-batch size, fit ``t0 + t1 * b``, store the costs.

    Args:
        gm: Annotated graph (every node has ``"fxsplit.cost"``), real weights, exported with a
            symbolic batch dimension (so it runs at any micro-batch size).
        flat_inputs: Real flat inputs of the whole batch, ``B`` samples on dim 0 of the batched ones.
        batched: ``[len(flat_inputs)]`` which inputs carry the batch (``Captured.batched_inputs``).
        sizes: Micro-batch sizes to time (:func:`profile_sizes`), each ``<= B``.
        device: Where to time.
        cache: Timings by ``"{size}|{graph digest}|{node}"`` (a :class:`ProfileCache`), read and
            extended; a size whose every node is cached is not run.
        warmup, repeats: Untimed and timed steps per size; the per-node median is kept.
        progress: ``progress(done, total)`` after each size.

    Returns:
        ``{node name: (fwd_t0_s, fwd_t1_s, bwd_t0_s, bwd_t1_s)}``; every timed node's
        ``"fxsplit.cost"`` gets ``fwd_s = fwd_t0 + fwd_t1 * B`` with ``fwd_fixed_s = fwd_t0``
        (backward likewise) and ``source="profiled"``.

    Raises:
        ConfigError: for a size outside ``1..B``, or when the graph cannot run a micro-batch
            smaller than ``B`` (a capture specialised to the example batch).
    """
    batch = next((int(x.shape[0]) for x, b in zip(flat_inputs, batched, strict=True) if b), None)
    if batch is None or any(not 1 <= s <= batch for s in sizes):
        raise ConfigError(f"profile sizes {list(sizes)} must lie in 1..batch={batch}; the inputs carry {batch} samples")
    store: MutableMapping[str, NodeTimes] = {} if cache is None else cache
    names = _timed_names(gm)
    digest = graph_digest(gm, flat_inputs)
    runs = []
    for i, size in enumerate(sizes):
        try:
            runs.append(_timed_at(gm, _slice_batch(flat_inputs, batched, size), names, f"{size}|{digest}", device,
                                  store, warmup, repeats))
        except RuntimeError as exc:
            if size == batch:
                raise
            raise ConfigError(
                f"the profiled cost model could not run the graph on a micro-batch of {size} of the {batch} "
                f"samples ({type(exc).__name__}: {str(exc).splitlines()[0]}): the capture is specialised to the "
                f"example batch; capture with a symbolic batch (dynamic_batch=True, as fxsplit.compile does) or "
                f"use cost_model='measured'") from exc
        if progress is not None:
            progress(i + 1, len(sizes))
    fits = {}
    for node in gm.graph.nodes:
        if node.name not in runs[0]:
            continue
        f0, f1 = fit_affine(sizes, [r[node.name][0] for r in runs])
        b0, b1 = fit_affine(sizes, [r[node.name][1] for r in runs])
        fits[node.name] = (f0, f1, b0, b1)
        node.meta["fxsplit.cost"] = node.meta["fxsplit.cost"].with_bwd_s(
            b0 + b1 * batch, fwd_s=f0 + f1 * batch, fwd_fixed_s=f0, bwd_fixed_s=b0, source="profiled")
    log.info("profiled %d nodes at micro-batch sizes %s on %s", len(fits), list(sizes), device)
    return fits
