"""The public entry points: orchestration only, no algorithm lives here.

``fxsplit.inspect`` runs the front end (capture, passes, condensation) and returns every object
it made; ``fxsplit.compile`` goes on to plan, split and run (the steps live in
:mod:`fxsplit.compiler`).
"""

from __future__ import annotations

import importlib
import inspect as pyinspect
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from fxsplit.errors import ConfigError
from fxsplit.frontend import Inspection, front_end, with_batch_dim
from fxsplit.ir.devices import DeviceSpec
from fxsplit.ir.names import ObjectiveName
from fxsplit.options import CompileOptions, with_loss_options
from fxsplit.passes.costs import cuda_spec, measure_cpu_spec

__all__ = ["Inspection", "inspect", "load_model", "analyze", "plan_hybrid", "resolve_cost_model"]

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from fxsplit.calibrate import CompiledPipeline


def load_model(spec: str, *, size: str = "tiny", batch_size: int = 2, **overrides: Any) -> Any:
    """Resolve a model spec to a :class:`fxsplit.models.ModelCase`.

    Args:
        spec: A zoo name (``"gpt"``), ``"hf:NAME"`` (``"hf:llama"``), or ``"module:function"``
            where the function returns ``(model, example_inputs)``.
        size: Zoo size preset.
        batch_size: Batch of the example inputs.
        overrides: Passed to the zoo or Hugging Face builder.

    Raises:
        ConfigError: for a spec that names nothing loadable.
    """
    import fxsplit.models as zoo

    if spec.startswith("hf:"):  # zoo.get refuses a size other than "tiny" for these
        return zoo.get(spec, size=size, batch_size=batch_size, **overrides)
    if ":" in spec:
        mod_name, fn_name = spec.split(":", 1)
        try:
            fn = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"cannot load {spec!r}: {exc}; expected 'module:function' returning (model, inputs)") from exc
        model, inputs = fn()
        return _case(spec, model, inputs)
    return zoo.get(spec, size=size, batch_size=batch_size, **overrides)


def _case(name: str, model: nn.Module, inputs: Sequence[Any]) -> Any:
    import fxsplit.models as zoo
    from fxsplit.models.case import primary_tensor

    inputs = tuple(inputs)
    tensors = [x for x in inputs if isinstance(x, torch.Tensor) and x.dim()]
    example_batch = int(tensors[0].shape[0]) if tensors else 0

    def make_batch(batch_size: int, seed: int) -> Any:
        """``batch_size`` samples drawn (with replacement, seeded) from the example's rows: every
        tensor input whose dim 0 is the example's batch is indexed, the rest kept; the target is
        zeros shaped as the model's output on them (a synthetic regression)."""
        if example_batch == 0:
            raise ConfigError(f"{name}: the example inputs have no batch dimension to draw {batch_size} samples from; "
                              "return inputs with the batch on dim 0 from the function")
        rows = torch.randint(0, example_batch, (batch_size,), generator=torch.Generator().manual_seed(seed))
        batch = tuple(x[rows] if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == example_batch else x
                      for x in inputs)
        with torch.no_grad():
            out = primary_tensor(model(*batch))
        return batch, torch.zeros_like(out)

    def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(primary_tensor(output), target)

    return zoo.ModelCase(
        name=name, model=model, example_inputs=inputs, make_batch=make_batch, loss_fn=loss_fn,
        description=f"{type(model).__name__} from {name}",
    )


def analyze(
    model: nn.Module,
    example_inputs: Sequence[Any],
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    method: str = "auto",
    device: DeviceSpec | None = None,
    cost_model: str = "analytic",
    dump_dir: str | Path | None = None,
    max_downsets: int = 20_000,
    verify: bool = False,
    name: str = "model",
) -> Inspection:
    """Capture ``model`` and run the front-end passes; see :func:`inspect`.

    The profiled cost model times micro-batches smaller than the example batch, so it captures
    with a symbolic batch as :func:`compile` does (an export specialised to the example batch
    cannot run them: a batch size baked into an ``expand`` fails); the others keep capture's
    concrete shapes.
    """
    _check_writable(dump_dir)
    profiled = cost_model == "profiled"
    options = CompileOptions(capture_method=method, dynamic_batch=profiled, max_downsets=max_downsets)
    ins = front_end(model, example_inputs, dict(example_kwargs or {}), reference=device or measure_cpu_spec(),
                    cost_model=cost_model, options=options, name=name, force_shapes=profiled,
                    measure_device="cpu", verify=verify, dump_dir=dump_dir)
    if dump_dir is not None:  # (checked writable before any work)
        from fxsplit.viz import write_dot

        write_dot(ins.condensed, Path(dump_dir) / "condensed.dot")
    return ins


def inspect(
    model: nn.Module | str,
    example_inputs: Sequence[Any] | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    **options: Any,
) -> Inspection:
    """Capture, annotate and condense a model; return every object made.

    Args:
        model: An ``nn.Module``, or a spec for :func:`load_model` (``"gpt"``, ``"hf:bert"``,
            ``"module:function"``).
        example_inputs: Positional inputs (required for a module; a spec brings its own).
        example_kwargs: Keyword inputs.
        options: ``method``, ``device`` (a :class:`DeviceSpec`, default: this CPU measured),
            ``cost_model`` (``"analytic"`` | ``"measured"`` | ``"profiled"``), ``dump_dir``, ``max_downsets``,
            ``verify``, and for a spec ``size``.

    Returns:
        An :class:`Inspection`.

    Raises:
        ConfigError: for a module without example inputs or a bad option.
        CaptureError: when the model cannot be captured.

    Example:
        >>> import torch, fxsplit
        >>> ins = fxsplit.inspect(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), (torch.randn(2, 4),))
        >>> ins.condensed.num_blocks >= 1
        True
    """
    if isinstance(model, str):
        size = options.pop("size", "tiny")
        case = load_model(model, size=size)
        return analyze(case.model, case.example_inputs, case.example_kwargs or None, name=model, **options)
    if example_inputs is None:
        raise ConfigError("fxsplit.inspect(module) needs example_inputs, e.g. (torch.randn(8, 16),)")
    return analyze(model, example_inputs, example_kwargs, name=type(model).__name__, **options)


def _check_writable(folder: str | Path | None) -> None:
    """``dump_dir`` must be a folder fxsplit can create and write.

    Raises:
        ConfigError: naming the folder and the system's reason.
    """
    if folder is None:
        return
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        probe = Path(folder) / ".fxsplit-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"cannot write the dump to {str(folder)!r}: {exc.strerror or exc}; pick a folder you can write") from exc


# -- compile -----------------------------------------------------------------------------------
MAX_DEVICES = 1024
"""The most devices (pipeline stages) one plan takes: a bound, so a typo such as ``devices=10**7``
is an error rather than out-of-memory."""


def _device_specs(devices: Any, memory_limit_bytes: int | None) -> list[DeviceSpec]:
    """Normalise ``devices`` (an int, torch device strings or DeviceSpecs) to DeviceSpecs."""
    if isinstance(devices, int):
        if not 1 <= devices <= MAX_DEVICES:
            raise ConfigError(f"devices={devices}: give 1 to {MAX_DEVICES} devices (a count, or a list of device strings)")
        devices = ["cpu"] * devices
    elif isinstance(devices, str | DeviceSpec | torch.device):
        devices = [devices]
    devices = list(devices)
    if not devices:
        raise ConfigError("devices is empty; pass e.g. devices=['cpu', 'cpu'] or devices=2")
    if len(devices) > MAX_DEVICES:
        raise ConfigError(f"{len(devices)} devices: fxsplit plans at most {MAX_DEVICES} pipeline stages; "
                          "pass fewer devices")
    specs: list[DeviceSpec] = []
    cpu: DeviceSpec | None = None
    for i, d in enumerate(devices):
        if isinstance(d, DeviceSpec):
            spec = d
        elif isinstance(d, str | torch.device):
            dev = _runnable_device(i, d)
            if dev.type == "cuda":
                spec = cuda_spec(dev)
            else:
                cpu = cpu or measure_cpu_spec()
                spec = cpu.with_(torch_device=str(dev))
            spec = spec.with_(name=f"{dev}#{i}" if [str(x) for x in devices].count(str(d)) > 1 else str(dev))
        else:
            raise ConfigError(f"devices[{i}]={d!r} is neither a device string nor a DeviceSpec")
        if memory_limit_bytes is not None:
            spec = spec.with_(memory_bytes=int(memory_limit_bytes))
        specs.append(spec.check())
    return specs


def _runnable_device(i: int, d: str | torch.device) -> torch.device:
    """``devices[i]`` as a torch device the pipeline can run on (``cpu`` or ``cuda``).

    Raises:
        ConfigError: for a string torch does not know (``"tpu"``), for ``meta`` (no data: the
            outputs would be empty shells) and for device types fxsplit has no cost model or
            runtime for.
    """
    try:
        dev = torch.device(d)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"devices[{i}]={d!r} is not a torch device ({exc}); use 'cpu', 'cuda' or 'cuda:N'") from exc
    if dev.type == "meta":
        raise ConfigError(
            f"devices[{i}]={d!r}: a meta device holds no data, so the pipeline would return empty outputs; "
            "run on 'cpu' or 'cuda:N'; to plan for devices you do not have, capture with "
            "fxsplit.inspect(model, inputs, device=DeviceSpec.preset('a100')) and solve its blocks (fxsplit solve)"
        )
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"devices[{i}]={d!r}: fxsplit runs stages on 'cpu' and 'cuda' devices only, not {dev.type!r}")
    return dev


def _check_compile_args(solver: str, schedule: str, microbatches: Any, objective: str, cost_model: str) -> None:
    from fxsplit import solvers
    from fxsplit.ir.problem import OBJECTIVES, SCHEDULES
    from fxsplit.passes.costs import COST_MODELS

    if solver not in solvers.available_solvers():
        raise ConfigError(f"solver={solver!r} is unknown; choose one of {solvers.available_solvers()}")
    if schedule != "auto" and schedule not in SCHEDULES:
        raise ConfigError(f"schedule={schedule!r} is unknown; choose 'auto' or one of {SCHEDULES}")
    if microbatches != "auto" and (not isinstance(microbatches, int) or microbatches < 1):
        raise ConfigError(f"microbatches={microbatches!r}; pass a positive int or 'auto'")
    if objective not in OBJECTIVES:
        raise ConfigError(f"objective={objective!r} is unknown; choose one of {OBJECTIVES}")
    if cost_model != "auto" and cost_model not in COST_MODELS:
        raise ConfigError(f"cost_model={cost_model!r} is unknown; choose 'auto' or one of {COST_MODELS}")


def _check_inputs_bind(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None,
                       batch_dim: int = 0) -> None:
    """The example inputs must fit ``model.forward``'s signature (cheap, before any capture)."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"compile needs an nn.Module, got {type(model).__name__}")
    if isinstance(args, torch.Tensor):
        raise ConfigError(f"example_inputs is a bare tensor {list(args.shape)}; wrap it in a tuple: example_inputs=(x,)")
    leaves = pytree.tree_leaves((tuple(args), dict(kwargs or {})))
    batched = [x for x in leaves if isinstance(x, torch.Tensor) and x.dim() > batch_dim]
    if batched and all(x.shape[batch_dim] == 0 for x in batched):
        raise ConfigError(f"the example batch has 0 samples (dim {batch_dim} of every input tensor is 0); give at least "
                          "one sample per micro-batch")
    try:
        pyinspect.signature(model.forward).bind(*args, **dict(kwargs or {}))
    except TypeError as exc:
        raise ConfigError(
            f"example inputs do not match {type(model).__name__}.forward{pyinspect.signature(model.forward)}: {exc}; "
            "pass example_inputs (positional) and example_kwargs as the model takes them"
        ) from exc


def compile(  # noqa: A001 - the public name users expect
    model: nn.Module,
    devices: Any,
    example_inputs: Sequence[Any],
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    microbatches: int | str = "auto",
    schedule: str = "auto",
    solver: str = "auto",
    memory_limit_bytes: int | None = None,
    cost_model: str = "auto",
    objective: ObjectiveName = "makespan",
    batch_dim: int | None = None,
    options: CompileOptions | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
) -> CompiledPipeline:
    """Split ``model`` across ``devices`` and return a :class:`~fxsplit.runtime.Pipeline`.

    Args:
        model: The module. Like torchgpipe, the pipeline takes its parameters and buffers over
            (no copy): a stage on another device moves them there, so ``model`` itself is left
            split across the devices; tied tensors read on several devices get one copy each.
        devices: ``["cuda:0", "cuda:1"]``, ``["cpu"] * 4``, an int (that many CPU devices), or
            :class:`DeviceSpec` s (speed, memory, torch device).
        example_inputs: A representative batch, batch on dim 0 (e.g. tokens ``[batch, seq]``).
        example_kwargs: Keyword inputs.
        microbatches: Micro-batches per step, or ``"auto"`` (chosen with the schedule).
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"auto"``.
        solver: A name from ``fxsplit.solvers.available_solvers()``.
        memory_limit_bytes: Memory of every device, overriding the specs.
        cost_model: ``"auto"`` (``"profiled"`` when the model's weights and the inputs are real
            tensors, else ``"analytic"``), ``"profiled"`` (every node timed on the first device at
            the micro-batch sizes that may run, cached in ``options.profile_cache_dir``),
            ``"measured"`` (timed at one size, scaled linearly) or ``"analytic"`` (roofline).
        objective: ``"makespan"`` (one training step) or ``"bottleneck"``.
        batch_dim: The dimension of the first input that holds the samples (default
            ``options.batch_dim``, 0; 1 for a
            sequence-first model such as ``nn.TransformerEncoder(batch_first=False)`` with
            ``src [seq, batch, d]``). The batch dimension of every other input and output is the
            one export proves equal to it (``src_key_padding_mask [batch, seq]``); targets are
            split on ``batch_dim`` when they have it, else on dim 0. fxsplit never guesses it:
            a model whose dim 0 mixes samples runs one micro-batch, and the log or warning names
            the dimension no op mixes.
        options: :class:`CompileOptions`.
        loss_fn, target: The loss ``train_step`` will compute (``loss_fn(output, target) ->
            scalar``) and a target for ``example_inputs``: the last stage computes it after its
            forward, so with a timed cost model (profiled, measured) compile times it on the
            model's outputs and plans the last stage with it (``options.loss_fn``); without it
            the plan leaves the loss out (``calibrate`` measures it later).

    The random draws compile makes (timings, checks) leave the caller's random streams (CPU and
    the CUDA devices named) as they were, so what a seeded script draws after it does not depend
    on compiling.

    Returns:
        The pipeline: ``pipe(*inputs)``, ``pipe.train_step(*inputs, target=..., loss_fn=...)``.

    Raises:
        ConfigError: for bad arguments (no devices, unknown solver, a batch smaller than the
            micro-batches, inputs that do not fit the model, a ``batch_dim`` the inputs lack or
            the model fixes), before any work.
        CaptureError: when the model cannot be captured.
        InfeasibleError: when no split fits the devices' memory.
    """
    from fxsplit.calibrate import CompiledPipeline
    from fxsplit.compiler import compile_pipeline
    from fxsplit.overhead import resolve_action_overhead
    from fxsplit.runtime.overhead import untouched_rng

    options = options or CompileOptions()
    options = with_batch_dim(options, batch_dim)
    options = with_loss_options(options, loss_fn, target)
    _check_compile_args(solver, schedule, microbatches, objective, cost_model)
    _check_inputs_bind(model, example_inputs, example_kwargs, options.batch_dim)
    with untouched_rng():  # timings and checks draw: the caller's CPU stream stays, and below its devices'
        specs = _device_specs(devices, memory_limit_bytes)
        if cost_model == "auto":
            cost_model = resolve_cost_model(model, (example_inputs, example_kwargs), options.reference or specs[0])
        with untouched_rng(*_torch_devices(specs)):
            options = resolve_action_overhead(options, specs, cost_model)
            return compile_pipeline(
                model, specs, tuple(example_inputs), dict(example_kwargs or {}), microbatches=microbatches,
                schedule=schedule, solver=solver, cost_model=cost_model, objective=objective, options=options,
                build=CompiledPipeline.build,
            )


def _torch_devices(specs: Sequence[DeviceSpec]) -> list[torch.device]:
    """The torch devices of ``specs`` (labels that name none, such as ``"fast0"``, left out)."""
    out = []
    for spec in specs:
        try:
            out.append(torch.device(spec.torch_device))
        except (RuntimeError, ValueError):
            continue
    return out


def resolve_cost_model(model: nn.Module, inputs: Any, reference: DeviceSpec) -> str:
    """``cost_model="auto"``: ``"profiled"`` when the target device exists here and the model's
    weights and the inputs are real tensors (nothing on the meta device or fake), else
    ``"analytic"`` (a model too big to run, planned on meta tensors, or a device preset).

    Example:
        >>> resolve_cost_model(torch.nn.Linear(2, 2), (torch.ones(1, 2),), DeviceSpec("cpu"))
        'profiled'
        >>> resolve_cost_model(torch.nn.Linear(2, 2, device="meta"), (), DeviceSpec("cpu"))
        'analytic'
    """

    from torch._subclasses.fake_tensor import FakeTensor

    try:
        dev: torch.device | None = torch.device(reference.torch_device)
    except (RuntimeError, ValueError):  # a label such as "fast0": no device to time on
        dev = None
    present = dev is not None and (dev.type == "cpu" or (dev.type == "cuda" and torch.cuda.is_available()))
    tensors = [*model.parameters(), *model.buffers(), *(x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor))]
    real = all(not t.is_meta and not isinstance(t, FakeTensor) for t in tensors)
    return "profiled" if present and real else "analytic"


def plan_hybrid(
    model: nn.Module,
    example_inputs: Sequence[Any],
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    devices: int | str | Path | Any = 8,
    microbatches: int = 8,
    device: DeviceSpec | None = None,
    link: Any = None,
    families: Sequence[str] = ("pase", "megatron"),
    max_tp: int | None = None,
    schedule: str = "1f1b",
    time_limit_s: float = 10.0,
    cost_model: str = "analytic",
    name: str = "model",
) -> tuple[Any, Inspection]:
    """Choose pipeline depth, stage replicas and per-layer strategies together for ``devices``.

    The model is captured once on ``example_inputs`` (one micro-batch), its per-layer plans solved
    over ``2, 4, ...`` devices (:func:`fxsplit.passes.layer_costs.layer_parallel_costs`, one per
    family), and every ``[pp, dp, tp]`` mesh costed (:func:`fxsplit.solvers.hybrid.plan_hybrid`).

    Args:
        model, example_inputs, example_kwargs: The model and one micro-batch (meta tensors plan
            a model too big for this machine).
        devices: ``N`` identical ``device`` s joined by ``link``, or a cluster (a
            :class:`~fxsplit.ir.cluster.Cluster` or its JSON/YAML file): links from the file, the
            node's links inside a ``tp`` group, ``tp`` at most one node.
        microbatches: ``m`` per step: the global batch is ``m`` micro-batches.
        device: The devices' spec (default: this machine's CPU; a cluster's own kinds otherwise).
        link: :class:`~fxsplit.ir.LinkSpec` between the devices when ``devices`` is a count.
        families: Per-layer plan families to try (``"pase"``, ``"megatron"``).
        max_tp: Largest ``tp`` (default: a cluster's largest node, else ``N``).
        schedule: ``"1f1b"`` or ``"gpipe"``.
        time_limit_s: Per solve (strategies, pipeline), seconds.
        cost_model: ``"analytic"`` or ``"profiled"``.

    Returns:
        ``(HybridPlan, Inspection)``.

    Raises:
        ConfigError: for a device count below 1, an unknown family, a cluster whose devices differ.
        InfeasibleError: when no mesh fits.
    """
    from fxsplit.ir import LinkSpec, Problem
    from fxsplit.ir.cluster import Cluster, load_cluster
    from fxsplit.passes.layer_costs import per_layer_costs
    from fxsplit.solvers.hybrid import plan_hybrid as search

    if isinstance(devices, str | Path):
        devices = load_cluster(devices)
    if isinstance(devices, Cluster):
        reference = device or devices.devices[0].with_(speed=1.0)
        specs = devices.relative_to(reference)
        inter, links, tp_link = devices.inter_node, devices.link_overrides(), devices.intra_node
        per_node = max(devices.node_of.count(k) for k in set(devices.node_of))
        max_tp = max_tp or per_node
    elif isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1:
        reference = device or measure_cpu_spec()
        specs = tuple(reference.with_(name=f"{reference.name}:{i}") for i in range(devices))
        inter = tp_link = link or LinkSpec()
        links = ()
    else:
        raise ConfigError(f"devices={devices!r}; give a device count >= 1, a Cluster or a cluster file's path")
    ins = front_end(model, example_inputs, dict(example_kwargs or {}), reference=reference, cost_model=cost_model,
                    options=CompileOptions(), name=name, measure_device="cpu")
    graph = ins.condensed.graph
    degrees = [t for t in range(2, len(specs) + 1) if len(specs) % t == 0 and (max_tp is None or t <= max_tp)]
    costs = per_layer_costs(ins.captured.gm, graph, degrees, families, link=tp_link, time_limit_s=time_limit_s,
                            memory_limit_bytes=min(d.memory_bytes for d in specs))
    problem = Problem(graph, tuple(specs), link=inter, links=links, microbatches=microbatches,
                      schedule=schedule, objective="makespan")  # type: ignore[arg-type]
    return search(problem, costs, time_limit_s=time_limit_s, max_tp=max_tp), ins
