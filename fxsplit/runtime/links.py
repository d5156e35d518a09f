"""Measured links: time transfers of several sizes and fit ``latency_s + bytes / bytes_per_s``.

The planner charges every stage boundary ``LinkSpec.transfer_s(bytes)``. A datasheet number for
NVLink or PCIe, or the default 25 GB/s, is not what a gloo socket between two processes or a
copy between two GPUs of this machine does; these probes measure it:

* :func:`probe_devices`: copies between two devices of one process (``tensor.to(dst)``).
* :func:`probe_ranks`: a ping-pong of ``send``/``recv`` between two ranks of a process group
  (gloo or NCCL), one-way time = half the round trip; call it on both ranks.
* :func:`probe_collective_link`: all-gathers over every rank of the group, read back as the
  link of a ring (what the per-layer strategies' collective formulas take).

Both time each size ``repeats`` times after a warm-up, keep the median and fit the line by least
squares with non-negative intercept and slope (:func:`fit_link`).

References:
    Hockney, "The communication challenge for MPP", Parallel Computing 1994 (the latency +
    bytes / bandwidth model).
"""

from __future__ import annotations

import functools
import logging
import math
import statistics
import time
from collections.abc import Sequence

import torch

from fxsplit.errors import ConfigError
from fxsplit.ir.devices import LinkSpec
from fxsplit.passes.measure import median_time_s
from fxsplit.passes.profile import fit_affine

__all__ = ["fit_link", "probe_devices", "probe_ranks", "probe_pipeline_links", "pipeline_links", "probe_collective_link",
           "DEFAULT_PROBE_BYTES", "SAME_DEVICE_LINK"]

log = logging.getLogger(__name__)

DEFAULT_PROBE_BYTES = (2**10, 2**14, 2**18, 2**22)
"""1 KiB to 4 MiB: latency-bound to bandwidth-bound."""

SAME_DEVICE_LINK = LinkSpec(bytes_per_s=math.inf, latency_s=0.0)
"""Two stages on one device hand tensors over without a copy."""


def fit_link(sizes_bytes: Sequence[int], times_s: Sequence[float]) -> LinkSpec:
    """The :class:`LinkSpec` of the least-squares line through ``(size, seconds)`` points.

    Args:
        sizes_bytes: ``[k]`` message sizes, at least two different ones.
        times_s: ``[k]`` one-way seconds.

    Raises:
        ConfigError: for fewer than two sizes, or times that do not grow with size (no
            bandwidth can be fitted; probe larger messages).

    Example:
        >>> link = fit_link([0, 1000], [1e-5, 1e-5 + 1e-6])
        >>> round(link.bytes_per_s / 1e9, 6), round(link.latency_s * 1e6, 6)
        (1.0, 10.0)
    """
    if len(set(sizes_bytes)) < 2:
        raise ConfigError(f"fit_link needs at least two message sizes, got {list(sizes_bytes)}")
    latency_s, s_per_byte = fit_affine(sizes_bytes, times_s)
    if s_per_byte <= 0:
        raise ConfigError(
            f"transfer times {[f'{t:.2e}' for t in times_s]} s do not grow with sizes {list(sizes_bytes)} bytes; "
            "probe larger messages (e.g. up to 64 MiB) to see the bandwidth"
        )
    return LinkSpec(bytes_per_s=1.0 / s_per_byte, latency_s=latency_s)


def _robust_fit(sizes_bytes: Sequence[int], times_s: Sequence[float]) -> LinkSpec:
    """:func:`fit_link`, or on a machine too noisy for a line (times that do not grow with size)
    the bandwidth of the largest message and the latency of the fastest, with a warning."""
    try:
        return fit_link(sizes_bytes, times_s)
    except ConfigError:
        largest = max(range(len(sizes_bytes)), key=lambda k: sizes_bytes[k])
        log.warning("link probe: times %s s do not grow with sizes %s bytes (noisy machine?); using the largest "
                    "message's bandwidth", [f"{t:.2e}" for t in times_s], list(sizes_bytes))
        return LinkSpec(bytes_per_s=sizes_bytes[largest] / times_s[largest], latency_s=min(times_s))


def _check(sizes_bytes: Sequence[int], repeats: int) -> None:
    if not sizes_bytes or any(not isinstance(s, int) or s < 4 for s in sizes_bytes) or repeats < 1:
        raise ConfigError(f"probe sizes {list(sizes_bytes)} must be ints >= 4 bytes and repeats={repeats} >= 1")


def probe_devices(src: str, dst: str, sizes_bytes: Sequence[int] = DEFAULT_PROBE_BYTES, repeats: int = 5) -> LinkSpec:
    """Measure copies from ``src`` to ``dst`` (torch device strings) in this process.

    Returns:
        The fitted link; :data:`SAME_DEVICE_LINK` when both name the same device (stages on one
        device share tensors).

    Raises:
        ConfigError: for bad sizes or repeats, or a device torch does not know.
    """
    _check(sizes_bytes, repeats)
    try:
        a, b = torch.device(src), torch.device(dst)
    except RuntimeError as exc:
        raise ConfigError(f"cannot probe {src!r} -> {dst!r}: {exc}") from exc
    if a == b or (a.type == b.type == "cpu"):
        return SAME_DEVICE_LINK
    sync = b if b.type == "cuda" else (a if a.type == "cuda" else None)
    times = []
    for size in sizes_bytes:
        x = torch.empty(size // 4, dtype=torch.float32, device=a)
        times.append(median_time_s(functools.partial(x.to, b), warmup=2, repeats=repeats, device=sync))
    link = _robust_fit(sizes_bytes, times)
    log.info("link %s -> %s: %.3g GB/s, %.3g us", src, dst, link.bytes_per_s / 1e9, link.latency_s * 1e6)
    return link


def probe_ranks(
    peer: int,
    sizes_bytes: Sequence[int] = DEFAULT_PROBE_BYTES,
    repeats: int = 5,
    device: str = "cpu",
    group: torch.distributed.ProcessGroup | None = None,
) -> LinkSpec:
    """Measure ``send``/``recv`` between this rank and ``peer``; call on both ranks.

    The lower rank times a ping-pong (send, then receive the echo) per size and fits half the
    round trip; it sends the fitted numbers to the higher rank, so both return the same link.

    Args:
        peer: The other rank (global rank).
        sizes_bytes: Message sizes to time.
        repeats: Timed round trips per size (after two warm-up ones); the median is kept.
        device: Where the messages live (``"cuda:0"`` for NCCL).
        group: The process group (default: the world).

    Raises:
        ConfigError: without an initialised process group, for ``peer`` equal to this rank, or
            bad sizes.
    """
    import torch.distributed as dist

    _check(sizes_bytes, repeats)
    if not dist.is_initialized():
        raise ConfigError("probe_ranks needs an initialised process group (torch.distributed.init_process_group)")
    rank = dist.get_rank()
    if peer == rank:
        raise ConfigError(f"probe_ranks(peer={peer}) names this rank; pass the other rank of the link")
    lead = rank < peer
    messages = [torch.zeros(size // 4, dtype=torch.float32, device=device) for size in sizes_bytes]
    samples: list[list[float]] = [[] for _ in sizes_bytes]
    for rep in range(2 + repeats):  # sizes interleaved, so drifting load spreads over all of them
        for k, x in enumerate(messages):
            start = time.perf_counter()
            if lead:
                dist.send(x, peer, group=group)
                dist.recv(x, peer, group=group)
            else:
                dist.recv(x, peer, group=group)
                dist.send(x, peer, group=group)
            if rep >= 2:
                samples[k].append((time.perf_counter() - start) / 2)
    times = [statistics.median(s) for s in samples]
    fitted = torch.zeros(2, dtype=torch.float64, device=device)
    if lead:
        link = _robust_fit(sizes_bytes, times)
        fitted[0], fitted[1] = link.bytes_per_s, link.latency_s
        dist.send(fitted, peer, group=group)
    else:
        dist.recv(fitted, peer, group=group)
    link = LinkSpec(bytes_per_s=float(fitted[0]), latency_s=float(fitted[1]))
    log.info("link rank %d <-> %d: %.3g GB/s, %.3g us", rank, peer, link.bytes_per_s / 1e9, link.latency_s * 1e6)
    return link


def pipeline_links(devices: Sequence[str], repeats: int = 5) -> tuple[tuple[int, int, LinkSpec], ...]:
    """Probe the link between every pair of devices of this process (each distinct pair of
    torch devices once; a plan may leave devices idle, so non-neighbours can meet).

    Args:
        devices: ``[num_devices]`` torch device strings in pipeline order.
        repeats: Timed copies per size (:func:`probe_devices`).

    Returns:
        ``Problem.links`` entries ``(i, j, LinkSpec)`` for ``i < j``; pairs on one device are a
        hand-over (:data:`SAME_DEVICE_LINK`).
    """
    cache: dict[tuple[str, str], LinkSpec] = {}
    out = []
    for i in range(len(devices)):
        for j in range(i + 1, len(devices)):
            key = (str(devices[i]), str(devices[j]))
            if key not in cache:
                cache[key] = probe_devices(*key, repeats=repeats)
            out.append((i, j, cache[key]))
    return tuple(out)


def probe_pipeline_links(device: str = "cpu", sizes_bytes: Sequence[int] = DEFAULT_PROBE_BYTES, repeats: int = 5
                         ) -> tuple[tuple[int, int, LinkSpec], ...]:
    """Probe every pair of neighbouring ranks (``r``, ``r + 1``) of the world; call on every rank.

    The pairs are probed one after another (the others wait), so no probe shares the network
    with another; every rank returns the same ``Problem.links`` entries.

    Raises:
        ConfigError: without an initialised process group.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ConfigError("probe_pipeline_links needs an initialised process group")
    rank, world = dist.get_rank(), dist.get_world_size()
    mine: list[tuple[int, int, LinkSpec]] = []
    for r in range(world - 1):
        if rank in (r, r + 1):
            link = probe_ranks(r + 1 if rank == r else r, sizes_bytes, repeats, device)
            if rank == r:
                mine.append((r, r + 1, link))
        dist.barrier()
    gathered: list[list[tuple[int, int, LinkSpec]] | None] = [None] * world
    dist.all_gather_object(gathered, mine)
    return tuple(sorted((e for part in gathered if part for e in part), key=lambda e: e[0]))


def probe_collective_link(sizes_bytes: Sequence[int] = DEFAULT_PROBE_BYTES, repeats: int = 5,
                          device: str = "cpu") -> LinkSpec:
    """Time ``all_gather_into_tensor`` of several whole sizes over every rank of the world and
    return the ring link that explains it: a ring all-gather of ``B`` bytes over ``n`` ranks takes
    ``(n-1)/n * B / bandwidth + (n-1) * latency``, so the fit ``t(B) = a + b * B`` gives
    ``bandwidth = (n-1) / (n * b)`` and ``latency = a / (n-1)``. Call on every rank (collective);
    every rank returns the slowest rank's timings' link.

    Gloo's collectives on one machine are slower than its send/recv between two ranks (more
    copies, every rank at once): per-layer plans costed on the ping-pong link underprice them.

    Args:
        sizes_bytes: Whole (gathered) sizes to time.
        repeats: Timed all-gathers per size (after two warm-up ones); the median is kept.
        device: Where the buffers live (``"cuda:0"`` for NCCL).

    Raises:
        ConfigError: without an initialised process group of at least 2 ranks, or bad sizes.
    """
    import torch.distributed as dist

    _check(sizes_bytes, repeats)
    if not dist.is_initialized() or dist.get_world_size() < 2:
        raise ConfigError("probe_collective_link needs an initialised process group of at least 2 ranks")
    n = dist.get_world_size()
    pieces = [max(1, size // (4 * n)) for size in sizes_bytes]
    samples: list[list[float]] = [[] for _ in sizes_bytes]
    for rep in range(2 + repeats):
        for k, piece in enumerate(pieces):
            local = torch.zeros(piece, dtype=torch.float32, device=device)
            whole = torch.empty(piece * n, dtype=torch.float32, device=device)
            dist.barrier()
            start = time.perf_counter()
            dist.all_gather_into_tensor(whole, local)
            if rep >= 2:
                samples[k].append(time.perf_counter() - start)
    times = torch.tensor([statistics.median(s) for s in samples], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    fit = _robust_fit([p * 4 * n for p in pieces], [float(t) for t in times])
    per_byte = 1.0 / fit.bytes_per_s if fit.bytes_per_s > 0 else 0.0
    link = LinkSpec(bytes_per_s=(n - 1) / (n * per_byte) if per_byte > 0 else math.inf,
                    latency_s=fit.latency_s / (n - 1))
    log.info("collective link over %d ranks: %.3g GB/s, %.3g us per step", n, link.bytes_per_s / 1e9, link.latency_s * 1e6)
    return link
