"""The planning problem: a condensed graph, the devices, and how training runs (torch-free).

JSON schema (``Problem.to_json``)::

    {"graph": CondensedGraph.to_dict(),
     "devices": [DeviceSpec.to_dict(), ...],          # pipeline order when device_order == "fixed"
     "link": {"bytes_per_s": float, "latency_s": float},   # default for every pair
     "links": [[i, j, {"bytes_per_s": ..., "latency_s": ...}], ...],   # per-pair overrides
     "microbatches": int, "schedule": "gpipe" | "1f1b" | "interleaved-1f1b" | "zero-bubble"
                     | "interleaved-zero-bubble",
     "objective": "bottleneck" | "makespan", "training": bool,
     "optimizer_state_factor": float, "grad_factor": float,
     "device_order": "fixed" | "free", "allow_idle_devices": bool,
     "stages_per_device": int,                        # > 1 only for the interleaved ones
     "recompute": "none" | "auto" | "all",            # activation recomputation per stage
     "transfer_memory": bool,                          # received inputs and output buffers in memory
     "action_overhead_s": float}                       # the runtime's own seconds per stage action
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

from fxsplit.errors import ConfigError
from fxsplit.ir.devices import DeviceSpec, LinkSpec
from fxsplit.ir.graph import Block, CondensedGraph
from fxsplit.ir.names import (
    AUTO_SCHEDULES,
    LOOPED_SCHEDULES,
    OBJECTIVES,
    RECOMPUTE,
    SCHEDULES,
    SIMULATED_SCHEDULES,
    ObjectiveName,
    RecomputeName,
    ScheduleName,
)

# The vocabularies live in fxsplit.ir.names; re-exported here, where the problem uses them.
__all__ = ["Problem", "RECOMPUTE", "SCHEDULES", "AUTO_SCHEDULES", "LOOPED_SCHEDULES", "SIMULATED_SCHEDULES", "OBJECTIVES",
           "ObjectiveName", "RecomputeName", "ScheduleName"]


@dataclass(frozen=True)
class Problem:
    """Everything a solver needs.

    Args:
        graph: The condensed block graph, times on the reference device (speed 1.0).
        devices: The devices, ``[num_devices]``. With ``device_order="fixed"`` stage ``s`` runs on
            ``devices[s]``; with ``"free"`` the solver also chooses which device runs each stage.
        link: Default link between any two devices.
        links: Per-pair overrides ``((i, j, LinkSpec), ...)``, symmetric.
        microbatches: Micro-batches per training step, ``m >= 1``.
        schedule: ``"gpipe"`` (all ``m`` micro-batches in flight), ``"1f1b"`` (stage ``s`` of
            ``p`` holds ``min(m, p - s)``) or ``"interleaved-1f1b"`` (several stages per device,
            each costed with ``m`` in flight: a bound, the first chunk holds up to ``m``; the
            schedule search checks the exact counts), ``"zero-bubble"`` (ZB-H1: backward split
            into input and weight halves; every stage holds ``min(m, p)``) or
            ``"interleaved-zero-bubble"`` (its looped form, costed as interleaved 1F1B).
        objective: ``"bottleneck"`` (slowest stage per micro-batch) or ``"makespan"`` (one
            training step: ``sum(stage times) + (m - 1) * bottleneck``).
        training: False plans inference: no backward, gradients or optimizer state.
        optimizer_state_factor: Optimizer state in multiples of parameter bytes (Adam: 2.0).
        grad_factor: Gradient bytes in multiples of parameter bytes (1.0).
        device_order: ``"fixed"`` or ``"free"`` (see ``devices``).
        allow_idle_devices: When True a plan may use fewer stages than devices.
        stages_per_device: ``v``: each device runs ``v`` stages in looping placement (stage ``s``
            on device ``s mod num_devices``); more than 1 only with a looped schedule
            (:data:`LOOPED_SCHEDULES`).
        recompute: Activation recomputation (:data:`RECOMPUTE`, training only): a recomputed
            stage keeps only its inputs per in-flight micro-batch, holds its activations for one
            micro-batch while it recomputes them, and pays one more forward in its backward
            (Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016; GPipe §2.3).
        transfer_memory: Count a stage's received inputs (per in-flight micro-batch) and its
            output buffer in its memory, as a running pipeline holds them. False counts
            parameters, optimizer state, buffers and activations only: the model of Tarnawski
            et al. (NeurIPS 2020), whose ``dp.cpp`` counts node sizes only and charges edges as
            time (:func:`fxsplit.ir.formats.load_tarnawski`).
        action_overhead_s: Seconds the pipeline runtime spends on each action of a stage (one
            forward or one backward of one micro-batch) besides the stage's compute and its
            transfers: taking and detaching its inputs, keeping its outputs for backward, running
            autograd on them, posting its sends and receives. Not scaled by device speed (host
            work). Every non-empty stage's ``fwd_s`` and ``bwd_s`` carry it, so a stage costs
            ``2 * action_overhead_s`` more per micro-batch in training, ``1 *`` in inference; a
            zero-bubble weight half pays none of its own. Measured by
            :func:`fxsplit.overhead.probe_action_overhead` and
            :func:`fxsplit.distributed.probe_distributed_overhead` (0: not modelled).

    Raises:
        ConfigError: from :meth:`check` for bad values, naming the field and the fix.
    """

    graph: CondensedGraph
    devices: tuple[DeviceSpec, ...]
    link: LinkSpec = field(default_factory=LinkSpec)
    links: tuple[tuple[int, int, LinkSpec], ...] = ()
    microbatches: int = 1
    schedule: ScheduleName = "1f1b"
    objective: ObjectiveName = "bottleneck"
    training: bool = True
    optimizer_state_factor: float = 2.0
    grad_factor: float = 1.0
    device_order: str = "fixed"
    allow_idle_devices: bool = True
    stages_per_device: int = 1
    recompute: RecomputeName = "none"
    transfer_memory: bool = True
    action_overhead_s: float = 0.0

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def link_between(self, i: int, j: int) -> LinkSpec:
        """The link between devices ``i`` and ``j`` (override if any, else the default)."""
        for a, b, spec in self.links:
            if {a, b} == {i, j}:
                return spec
        return self.link

    def in_flight(self, stage: int, num_stages: int) -> int:
        """Micro-batches whose activations stage ``stage`` (0-based) of ``num_stages`` holds at peak."""
        if not self.training:
            return 1
        if self.schedule == "gpipe" or self.schedule in LOOPED_SCHEDULES:
            return self.microbatches
        if self.schedule == "zero-bubble":  # weight halves held back: every stage as 1F1B's first
            return min(self.microbatches, num_stages)
        return min(self.microbatches, num_stages - stage)

    @property
    def in_flight_depends_on_stage_count(self) -> bool:
        """Whether :meth:`in_flight` depends on how many stages the plan uses (1F1B and
        zero-bubble with several micro-batches in training), so the solvers cost each count."""
        return self.training and self.schedule in ("1f1b", "zero-bubble") and self.microbatches > 1

    def state_bytes_per_param_byte(self) -> float:
        """Bytes of params + grads + optimizer state per parameter byte."""
        if not self.training:
            return 1.0
        return 1.0 + self.grad_factor + self.optimizer_state_factor

    def static_bytes(self, block: Block) -> float:
        """Memory a block takes regardless of micro-batches: its parameters and the copies of
        parameters it reads (times params + grads + optimizer state), plus its buffers."""
        return (block.param_bytes + block.replica_param_bytes) * self.state_bytes_per_param_byte() + block.buffer_bytes

    def stage_overhead_s(self) -> float:
        """The runtime's seconds per micro-batch on every non-empty stage:
        :attr:`action_overhead_s` per action, two actions (forward, backward) in training."""
        return self.action_overhead_s * (2 if self.training else 1)

    def may_recompute(self) -> bool:
        """Whether a stage may recompute its activations (training, ``recompute`` not ``"none"``)."""
        return self.training and self.recompute != "none"

    @staticmethod
    def stage_memory_bytes(static_bytes: Any, act_bytes: Any, in_bytes: Any, out_bytes: Any, flight: Any,
                           recompute: bool, *, transfers: bool = True) -> Any:
        """Peak memory of a stage (numbers or NumPy arrays of them, ``flight`` too), bytes: its state, what each of
        ``flight`` in-flight micro-batches keeps (activations and received inputs; only the inputs
        when it recomputes, plus one micro-batch's activations while recomputing) and its output
        buffer. ``transfers=False`` (:attr:`transfer_memory`) leaves the inputs and the output
        buffer out."""
        if not transfers:
            in_bytes = out_bytes = 0
        if recompute:
            return static_bytes + in_bytes * flight + act_bytes + out_bytes
        return static_bytes + (act_bytes + in_bytes) * flight + out_bytes

    def recomputes(self, keep_bytes: float, recompute_bytes: float, cap_bytes: float) -> bool:
        """Whether a stage recomputes: always under ``"all"``; under ``"auto"`` exactly when its
        memory kept (``keep_bytes``) exceeds the device's ``cap_bytes`` and recomputing
        (``recompute_bytes``) takes less (the fastest choice for the stage: recomputing only adds
        time); never in inference or under ``"none"``."""
        if not self.may_recompute():
            return False
        return self.recompute == "all" or (keep_bytes > cap_bytes and recompute_bytes < keep_bytes)

    def with_latency_added(self, extra_s: float) -> Problem:
        """A copy with ``extra_s`` seconds added to the latency of the default link and of every
        pair's, each kept >= 0 (``extra_s`` may be negative): per-message costs the links do not
        probe (the runtime's own work, fitted by calibrate or measured by the overhead probes)."""
        def shifted(link: LinkSpec) -> LinkSpec:
            return LinkSpec(bytes_per_s=link.bytes_per_s, latency_s=max(link.latency_s + extra_s, 0.0))

        return replace(self, link=shifted(self.link), links=tuple((i, j, shifted(lk)) for i, j, lk in self.links))

    def with_(self, **changes: Any) -> Problem:
        """A copy with some fields changed."""
        return replace(self, **changes)

    def check(self) -> Problem:
        """Raise :class:`ConfigError` on a bad field; return ``self``."""
        if not self.devices:
            raise ConfigError("problem has no devices; pass at least one DeviceSpec")
        for d in self.devices:
            d.check()
        if self.microbatches < 1:
            raise ConfigError(f"microbatches={self.microbatches} must be >= 1")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule={self.schedule!r}; choose one of {SCHEDULES}")
        if not (isinstance(self.stages_per_device, int) and self.stages_per_device >= 1):
            raise ConfigError(f"stages_per_device={self.stages_per_device!r} must be an int >= 1")
        if self.stages_per_device > 1 and self.schedule not in LOOPED_SCHEDULES:
            raise ConfigError(f"stages_per_device={self.stages_per_device} needs a schedule that runs several stages "
                              f"per device ({', '.join(LOOPED_SCHEDULES)}), not {self.schedule!r}")
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"recompute={self.recompute!r}; choose one of {RECOMPUTE}")
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"objective={self.objective!r}; choose one of {OBJECTIVES}")
        if not isinstance(self.transfer_memory, bool):
            raise ConfigError(f"transfer_memory={self.transfer_memory!r} must be true or false (a JSON boolean)")
        if self.device_order not in ("fixed", "free"):
            raise ConfigError(f"device_order={self.device_order!r}; choose 'fixed' or 'free'")
        for i, j, spec in self.links:
            if not (0 <= i < self.num_devices and 0 <= j < self.num_devices):
                raise ConfigError(f"link override ({i}, {j}) names a device outside 0..{self.num_devices - 1}")
            spec.check(f"link ({i}, {j})")
        self.link.check("default link")
        for attr in ("optimizer_state_factor", "grad_factor"):
            value = getattr(self, attr)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"{attr}={value!r} must be a finite number >= 0 (Adam: optimizer_state_factor=2.0)")
        value = self.action_overhead_s
        if not (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0):
            raise ConfigError(f"action_overhead_s={value!r} must be a finite number of seconds >= 0 (0: the runtime's "
                              "own work per stage action is not modelled)")
        self.graph.check()
        if self.graph.direct:
            self._check_direct()
        return self

    def _check_direct(self) -> None:
        """The graph's direct transfers (:attr:`CondensedGraph.direct`) are costed per stage as
        bytes over the one default link without latency, for the bottleneck objective, with one
        stage per device and no transfer buffers in memory (Tarnawski et al.'s model)."""
        wrong = [(name, value, fix) for name, value, fix, ok in (
            ("objective", self.objective, "'bottleneck'", self.objective == "bottleneck"),
            ("stages_per_device", self.stages_per_device, "1", self.stages_per_device == 1),
            ("transfer_memory", self.transfer_memory, "False", not self.transfer_memory),
            ("links", self.links, "() (one default link)", not self.links),
            ("link.latency_s", self.link.latency_s, "0", self.link.latency_s == 0),
        ) if not ok]
        if wrong:
            name, value, fix = wrong[0]
            raise ConfigError(f"graph {self.graph.name!r} has {len(self.graph.direct)} direct transfers (each paid by "
                              f"the sending and the reading stages, as Tarnawski et al.'s dp.cpp charges them), which "
                              f"fxsplit costs only with {name}={fix}; got {name}={value!r}. Relay the values instead "
                              f"(edges) or set {name}={fix}")

    # -- serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "graph": self.graph.to_dict(),
            "devices": [d.to_dict() for d in self.devices],
            "link": self.link.to_dict(),
            "links": [[i, j, s.to_dict()] for i, j, s in self.links],
            "microbatches": self.microbatches,
            "schedule": self.schedule,
            "objective": self.objective,
            "training": self.training,
            "optimizer_state_factor": self.optimizer_state_factor,
            "grad_factor": self.grad_factor,
            "device_order": self.device_order,
            "allow_idle_devices": self.allow_idle_devices,
            "stages_per_device": self.stages_per_device,
            "recompute": self.recompute,
            "transfer_memory": self.transfer_memory,
            "action_overhead_s": self.action_overhead_s,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Problem:
        known = {k: v for k, v in data.items() if k not in ("graph", "devices", "link", "links")}
        return cls(
            graph=CondensedGraph.from_dict(data["graph"]),
            devices=tuple(DeviceSpec.from_dict(d) for d in data["devices"]),
            link=LinkSpec(**data.get("link", {})),
            links=tuple((int(i), int(j), LinkSpec(**s)) for i, j, s in data.get("links", ())),
            **known,
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Problem:
        return cls.from_dict(json.loads(text))
