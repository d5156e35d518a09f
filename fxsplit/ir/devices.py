"""Devices and the links between them, as the planner sees them (torch-free).

Units: FLOP/s, bytes, bytes/s, seconds. ``speed`` is relative to the *reference device* on which
block times were annotated: a device of speed 2.0 runs every block in half the reference time.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from fxsplit.errors import ConfigError

__all__ = ["DeviceSpec", "LinkSpec", "GiB", "PRESETS"]

GiB = 1024**3


@dataclass(frozen=True)
class DeviceSpec:
    """One device of a pipeline.

    Args:
        name: Label shown in plans and tables (``"cuda:0"``, ``"cpu"``, ``"fast0"``).
        peak_flops: Dense FLOP/s the cost model assumes (roofline compute roof) for the
            low-precision math of mixed precision (bf16/fp16 tensor cores on a GPU preset).
        fp32_peak_flops: Dense FLOP/s of float32 (and float64) math where it differs from
            ``peak_flops`` (a GPU's fp32 rate without tensor cores: A100 19.5 TFLOP/s against
            312 for bf16); 0 (default) means ``peak_flops`` serves every dtype.
        tf32_peak_flops: Dense FLOP/s of fp32 convolutions, which cuDNN runs in TF32 by default
            (``torch.backends.cudnn.allow_tf32``; matmuls do not); 0: ``fp32_peak_flops``.
        memory_bandwidth_bytes_per_s: Device memory bandwidth (roofline memory roof).
        memory_bytes: Memory available to one stage, bytes.
        speed: Compute speed relative to the reference device (1.0 = same).
        kind: Device type; devices of one kind are interchangeable to the solvers.
        torch_device: Where the stage runs (``"cuda:1"``); defaults to ``name``.
        op_overhead_s: Fixed cost of launching one operator (kernel launch, dispatch),
            seconds; added to every computing node's forward time (twice to its backward).
        comm_free: A stage on this device pays nothing for the tensors it receives and sends
            (its neighbours still pay theirs): the host CPU of Tarnawski et al.'s planner
            (``dp.cpp``: "CPU does not pay for communication"), where the accelerators' transfers
            are staged. Default False: every stage pays its boundary transfers.

    Raises:
        ConfigError: from :meth:`check` when a number is not positive.

    Example:
        >>> DeviceSpec.preset("a100").memory_bytes // GiB
        80
    """

    name: str
    peak_flops: float = 1e12
    memory_bandwidth_bytes_per_s: float = 100e9
    memory_bytes: int = 16 * GiB
    speed: float = 1.0
    kind: str = ""
    torch_device: str = ""
    op_overhead_s: float = 0.0
    fp32_peak_flops: float = 0.0
    tf32_peak_flops: float = 0.0
    comm_free: bool = False

    def __post_init__(self) -> None:
        if not self.kind:
            object.__setattr__(self, "kind", self.name.split(":")[0])
        if not self.torch_device:
            object.__setattr__(self, "torch_device", self.name)

    def check(self) -> DeviceSpec:
        """Raise :class:`ConfigError` when a number is not positive and finite (``op_overhead_s``:
        not negative and finite); return ``self``."""
        for attr in ("peak_flops", "memory_bandwidth_bytes_per_s", "memory_bytes", "speed", "op_overhead_s",
                     "fp32_peak_flops", "tf32_peak_flops"):
            value = getattr(self, attr)
            may_be_zero = attr in ("op_overhead_s", "fp32_peak_flops", "tf32_peak_flops")
            low_ok = value >= 0 if may_be_zero else value > 0
            if not (isinstance(value, int | float) and math.isfinite(value) and low_ok):
                kind = "not negative" if may_be_zero else "positive"
                raise ConfigError(
                    f"device {self.name!r}: {attr}={value!r} must be a finite, {kind} number; "
                    f"pass e.g. DeviceSpec({self.name!r}, {attr}=...)"
                )
        return self

    def peak_flops_for(self, dtype: str, *, convolution: bool = False) -> float:
        """The compute roof for math in ``dtype`` (a torch dtype's name: ``"float32"``,
        ``"bfloat16"``, ...): ``fp32_peak_flops`` for float32/float64 where set (a float32
        ``convolution``: ``tf32_peak_flops`` where set), else ``peak_flops``.

        Example:
            >>> a100 = DeviceSpec.preset("a100")
            >>> a100.peak_flops_for("float32") / 1e12, a100.peak_flops_for("bfloat16") / 1e12
            (19.5, 312.0)
        """
        name = dtype.removeprefix("torch.")
        if convolution and name == "float32" and self.tf32_peak_flops > 0:
            return self.tf32_peak_flops
        if self.fp32_peak_flops > 0 and name in ("float32", "float64"):
            return self.fp32_peak_flops
        return self.peak_flops

    def with_(self, **changes: Any) -> DeviceSpec:
        """A copy with some fields changed."""
        return replace(self, **changes)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> DeviceSpec:
        """A known accelerator: ``h100``, ``h200``, ``a100``, ``a100-40gb``, ``v100``, ``t4``, or
        ``fpga`` (a generic FPGA-like card with assumed numbers, for what-if plans).

        ``peak_flops`` is the dense bf16/fp16 tensor-core FLOP/s, ``fp32_peak_flops`` the
        dense fp32 FLOP/s without TF32 (PyTorch's default for matmuls) and ``tf32_peak_flops``
        the dense TF32 rate (cuDNN's default for fp32 convolutions), from the vendors' data
        sheets (SXM parts). A CPU is measured on the spot by
        ``fxsplit.passes.measure_cpu_spec()`` (it needs torch).

        Raises:
            ConfigError: for an unknown preset name, listing the known ones.
        """
        key = name.lower()
        if key not in PRESETS:
            raise ConfigError(
                f"unknown device preset {name!r}; known presets: {', '.join(sorted(PRESETS))}"
            )
        return replace(PRESETS[key], **overrides)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceSpec:
        return cls(**data)


@dataclass(frozen=True)
class LinkSpec:
    """A link between two pipeline neighbours: ``latency_s + bytes / bytes_per_s`` per message."""

    bytes_per_s: float = 25e9
    latency_s: float = 10e-6

    def check(self, where: str = "link") -> LinkSpec:
        """Raise :class:`ConfigError` unless ``bytes_per_s`` is positive (``math.inf``: a link that
        costs nothing, e.g. two stages on one device) and ``latency_s`` finite and not negative;
        return ``self``.

        Example:
            >>> LinkSpec(bytes_per_s=1e9, latency_s=-1.0).check()
            Traceback (most recent call last):
            ...
            fxsplit.errors.ConfigError: link: latency_s=-1.0 must be a finite number >= 0; pass e.g. LinkSpec(latency_s=1e-05)
        """
        if not (isinstance(self.bytes_per_s, int | float) and self.bytes_per_s > 0):
            raise ConfigError(f"{where}: bytes_per_s={self.bytes_per_s!r} must be a number > 0 (math.inf: free); "
                              "pass e.g. LinkSpec(bytes_per_s=25e9)")
        if not (isinstance(self.latency_s, int | float) and math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ConfigError(f"{where}: latency_s={self.latency_s!r} must be a finite number >= 0; "
                              "pass e.g. LinkSpec(latency_s=1e-05)")
        return self

    def transfer_s(self, size_bytes: float) -> float:
        """Seconds to send ``size_bytes`` (0 when nothing is sent)."""
        if size_bytes <= 0:
            return 0.0
        return self.latency_s + size_bytes / self.bytes_per_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


PRESETS: dict[str, DeviceSpec] = {
    "h100": DeviceSpec("h100", 989e12, 3.35e12, 80 * GiB, kind="h100", torch_device="cuda", op_overhead_s=5e-6,
                       fp32_peak_flops=67e12, tf32_peak_flops=495e12),
    "h200": DeviceSpec("h200", 989e12, 4.8e12, 141 * GiB, kind="h200", torch_device="cuda", op_overhead_s=5e-6,
                       fp32_peak_flops=67e12, tf32_peak_flops=495e12),
    "a100": DeviceSpec("a100", 312e12, 2.039e12, 80 * GiB, kind="a100", torch_device="cuda", op_overhead_s=5e-6,
                       fp32_peak_flops=19.5e12, tf32_peak_flops=156e12),
    "a100-40gb": DeviceSpec("a100-40gb", 312e12, 1.555e12, 40 * GiB, kind="a100", torch_device="cuda",
                            op_overhead_s=5e-6, fp32_peak_flops=19.5e12, tf32_peak_flops=156e12),
    "v100": DeviceSpec("v100", 125e12, 900e9, 32 * GiB, kind="v100", torch_device="cuda", op_overhead_s=5e-6,
                       fp32_peak_flops=15.7e12),
    "t4": DeviceSpec("t4", 65e12, 320e9, 16 * GiB, kind="t4", torch_device="cuda", op_overhead_s=5e-6,
                     fp32_peak_flops=8.1e12),
    # A generic FPGA-like accelerator for what-if plans (BaPipe simulates FPGA clusters): an
    # Alveo-U280-class card's 8 GiB of HBM2 at 460 GB/s, with 2 TFLOP/s *assumed* for training
    # arithmetic. Not a measured device: give your own numbers in a cluster file.
    "fpga": DeviceSpec("fpga", 2e12, 460e9, 8 * GiB, kind="fpga", torch_device="cpu", op_overhead_s=1e-6),
}
