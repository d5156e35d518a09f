"""Clusters as data: device kinds, nodes and links in a JSON or YAML file, for plans of machines
one does not have (torch-free).

BaPipe (Zhao et al., 2021) explores pipelines for GPU clusters and for simulated FPGA clusters
from the devices' compute, memory and bandwidth; a cluster file gives fxsplit the same inputs::

    {"name": "2 x 8 A100",
     "device_kinds": {"a100": {"preset": "a100"},
                      "fpga": {"peak_flops": 2e12, "memory_bandwidth_bytes_per_s": 460e9,
                               "memory_bytes": 8589934592}},
     "nodes": [{"name": "n0", "devices": {"a100": 8}},
               {"name": "n1", "devices": {"a100": 8}}],
     "links": {"intra_node": {"bytes_per_s": 300e9, "latency_s": 5e-6},
               "inter_node": {"bytes_per_s": 25e9, "latency_s": 1e-5}}}

A kind is a preset (:data:`~fxsplit.ir.devices.PRESETS`, optionally with fields overridden) or
its own numbers (:class:`~fxsplit.ir.DeviceSpec` fields). Devices are numbered node by node, in
the order the file lists them, so a pipeline in device order crosses nodes as rarely as it can;
two devices of one node talk over ``intra_node``, others over ``inter_node`` (both default to
:class:`~fxsplit.ir.LinkSpec`'s). Each device's ``speed`` is its peak FLOP/s over the reference
device's (the block times are annotated on the reference; a compute-bound assumption).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from fxsplit.errors import ConfigError
from fxsplit.ir.devices import PRESETS, DeviceSpec, LinkSpec

__all__ = ["Cluster", "load_cluster"]

_DEVICE_FIELDS = {f.name for f in fields(DeviceSpec)} - {"name", "speed", "torch_device"}
_LINK_FIELDS = {f.name for f in fields(LinkSpec)}


@dataclass(frozen=True)
class Cluster:
    """Devices in pipeline order with the node each sits in, and the links inside and across
    nodes.

    Attributes:
        name: The cluster's label.
        devices: ``[num_devices]`` devices named ``"{node}/{kind}:{i}"``, node by node.
        node_of: ``[num_devices]`` index of each device's node.
        intra_node, inter_node: The links inside a node and across nodes.
    """

    name: str
    devices: tuple[DeviceSpec, ...]
    node_of: tuple[int, ...]
    intra_node: LinkSpec
    inter_node: LinkSpec

    def link_overrides(self) -> tuple[tuple[int, int, LinkSpec], ...]:
        """Per-pair links for :class:`~fxsplit.ir.Problem` (``links=``): ``intra_node`` for every
        pair in one node; the default link (``inter_node``) serves the rest."""
        if self.intra_node == self.inter_node:
            return ()
        n = len(self.devices)
        return tuple((i, j, self.intra_node) for i in range(n) for j in range(i + 1, n)
                     if self.node_of[i] == self.node_of[j])

    def relative_to(self, reference: DeviceSpec) -> tuple[DeviceSpec, ...]:
        """The devices with ``speed`` = peak FLOP/s over ``reference``'s."""
        return tuple(d.with_(speed=d.peak_flops / reference.peak_flops) for d in self.devices)


def _where(path: str, key: str) -> str:
    return f"cluster file {path}: {key}"


def _kind(path: str, name: str, spec: Any) -> DeviceSpec:
    if not isinstance(spec, dict):
        raise ConfigError(f"{_where(path, f'device_kinds.{name}')} must be an object "
                          '(e.g. {"preset": "a100"} or {"peak_flops": 2e12, "memory_bytes": 8589934592})')
    unknown = sorted(set(spec) - _DEVICE_FIELDS - {"preset"})
    if unknown:
        raise ConfigError(f"{_where(path, f'device_kinds.{name}')} has unknown fields {unknown}; "
                          f"known: preset, {', '.join(sorted(_DEVICE_FIELDS))}")
    numbers = {k: v for k, v in spec.items() if k != "preset"}
    if "memory_bytes" in numbers:  # JSON writes 8e9 for 8 GB: a whole number of bytes is fine as a float
        mem = numbers["memory_bytes"]
        if not (isinstance(mem, int | float) and not isinstance(mem, bool) and float(mem).is_integer() and mem > 0):
            raise ConfigError(f"{_where(path, f'device_kinds.{name}.memory_bytes')} = {mem!r} must be a whole "
                              "number of bytes > 0 (e.g. 8589934592 or 8e9)")
        numbers["memory_bytes"] = int(mem)
    if "preset" in spec:
        if spec["preset"] not in PRESETS:
            raise ConfigError(f"{_where(path, f'device_kinds.{name}.preset')} = {spec['preset']!r} is unknown; "
                              f"known presets: {', '.join(sorted(PRESETS))}")
        base = PRESETS[spec["preset"]].with_(name=name, kind=numbers.pop("kind", PRESETS[spec["preset"]].kind))
        device = base.with_(**numbers)
    else:
        device = DeviceSpec(name=name, **{"kind": name, **numbers})
    try:
        return device.check()
    except ConfigError as exc:
        raise ConfigError(f"{_where(path, f'device_kinds.{name}')}: {exc}") from exc


def _link(path: str, key: str, spec: Any) -> LinkSpec:
    if spec is None:
        return LinkSpec()
    if not isinstance(spec, dict) or set(spec) - _LINK_FIELDS:
        raise ConfigError(f"{_where(path, f'links.{key}')} must be an object with fields "
                          f"{sorted(_LINK_FIELDS)}, got {spec!r}")
    link = LinkSpec(**spec)
    return link.check(_where(path, f"links.{key}"))


def cluster_from_dict(data: dict[str, Any], path: str = "<dict>") -> Cluster:
    """The :class:`Cluster` a parsed cluster file describes (see the module docstring).

    Raises:
        ConfigError: naming the file and the key, for a missing or unknown field, an unknown
            preset or device kind, a count that is not a positive int, or a bad number.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"cluster file {path} must hold a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - {"name", "device_kinds", "nodes", "links"})
    if unknown:
        raise ConfigError(f"cluster file {path} has unknown fields {unknown}; known: name, device_kinds, nodes, links")
    kinds = {name: _kind(path, name, spec) for name, spec in (data.get("device_kinds") or {}).items()}
    nodes = data.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise ConfigError(f"{_where(path, 'nodes')} must be a non-empty list of "
                          '{"name": ..., "devices": {"KIND": COUNT}}')
    devices: list[DeviceSpec] = []
    node_of: list[int] = []
    for n, node in enumerate(nodes):
        label = node.get("name", f"node{n}") if isinstance(node, dict) else None
        counts = node.get("devices") if isinstance(node, dict) else None
        if not isinstance(counts, dict) or not counts:
            raise ConfigError(f"{_where(path, f'nodes[{n}].devices')} must map device kinds to counts, got {counts!r}")
        for kind, count in counts.items():
            if kind not in kinds and kind in PRESETS:
                kinds[kind] = PRESETS[kind].with_(name=kind)
            if kind not in kinds:
                raise ConfigError(f"{_where(path, f'nodes[{n}].devices')} names kind {kind!r}, which neither "
                                  f"device_kinds ({sorted(kinds)}) nor the presets ({sorted(PRESETS)}) define")
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise ConfigError(f"{_where(path, f'nodes[{n}].devices.{kind}')} = {count!r} must be an int >= 1")
            for i in range(count):
                devices.append(kinds[kind].with_(name=f"{label}/{kind}:{i}"))
                node_of.append(n)
    links = data.get("links") or {}
    if not isinstance(links, dict) or set(links) - {"intra_node", "inter_node"}:
        raise ConfigError(f"{_where(path, 'links')} may only give intra_node and inter_node, got {links!r}")
    return Cluster(str(data.get("name", Path(path).stem)), tuple(devices), tuple(node_of),
                   _link(path, "intra_node", links.get("intra_node")), _link(path, "inter_node", links.get("inter_node")))


def load_cluster(path: str | Path) -> Cluster:
    """Read a cluster file: JSON, or YAML for a ``.yaml`` / ``.yml`` name (the same keys; see the
    module docstring).

    Raises:
        ConfigError: when the file cannot be read or parsed, or describes no valid cluster
            (:func:`cluster_from_dict`).
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read cluster file {path}: {exc}") from exc
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"cannot read cluster file {path}: not valid YAML: {exc}") from exc
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"cannot read cluster file {path}: {exc} (a .yaml or .yml name reads YAML)") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"cluster file {path} holds a {type(data).__name__}; it needs a mapping with "
                          "'device_kinds', 'nodes' and 'links' (see fxsplit.ir.cluster)")
    return cluster_from_dict(data, str(path))
