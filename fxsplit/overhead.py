"""The local runtime's own work per stage action, measured on a pipeline of trivial stages
(see :mod:`fxsplit.runtime.overhead` for what it is and how the plan charges it)."""

from __future__ import annotations

import functools
import logging
from dataclasses import replace

import torch
from torch import nn

from fxsplit.compiler import action_overhead_option, assemble_choice, compile_pipeline
from fxsplit.errors import ConfigError
from fxsplit.ir.devices import DeviceSpec, LinkSpec
from fxsplit.options import CompileOptions
from fxsplit.runtime import Pipeline
from fxsplit.runtime.local import choose_executor
from fxsplit.runtime.overhead import (
    PROBE_BATCH,
    PROBE_MICROBATCHES,
    PROBE_WIDTH,
    RuntimeOverhead,
    action_overhead,
    untouched_rng,
)

__all__ = ["probe_action_overhead", "resolve_action_overhead"]

log = logging.getLogger(__name__)


class _Probe(nn.Module):
    """Two tiny layers: one stage each."""

    def __init__(self, width: int = PROBE_WIDTH) -> None:
        super().__init__()
        self.first = nn.Linear(width, width)
        self.second = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


@functools.cache
def probe_action_overhead(device: str = "cpu", executor: str = "sequential", steps: int = 20) -> RuntimeOverhead:
    """Seconds the local pipeline (:class:`fxsplit.runtime.local.Pipeline`) spends per stage
    action beyond the stage's operators, on ``device`` (memoised per process).

    Compiles the two-layer probe model onto ``[device, device]`` (two stages, 4 micro-batches of
    4 rows, 1F1B, ``executor``), runs ``steps`` training steps after two warm-ups, and takes the
    median action time of the runtime's trace minus the bare layer's.

    Args:
        device: A torch device string (``"cpu"``, ``"cuda:0"``).
        executor: The local executor the pipeline will use (``"sequential"`` or ``"threads"``).
        steps: Timed steps.

    Raises:
        ConfigError: for an unknown device or a bad step count.
    """
    if steps < 1:
        raise ConfigError(f"probe_action_overhead(steps={steps}) needs at least one timed step")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"probe_action_overhead: unknown device {device!r}: {exc}") from exc
    with untouched_rng(dev):
        return _probe_local(dev, executor, steps)


def _probe_local(dev: torch.device, executor: str, steps: int) -> RuntimeOverhead:
    model = _Probe().to(dev)
    x = torch.randn(PROBE_BATCH, PROBE_WIDTH, device=dev)
    target = torch.randn(PROBE_BATCH, PROBE_WIDTH, device=dev)
    options = CompileOptions(allow_idle_devices=False, executor=executor, link=LinkSpec(), profile_cache_dir=False,
                             action_overhead_s=0.0, capture_method="symbolic_trace", recompute="none")
    specs = [DeviceSpec(f"probe{i}", torch_device=str(dev)) for i in range(2)]
    pipe = compile_pipeline(model, specs, (x,), {}, microbatches=PROBE_MICROBATCHES, schedule="1f1b", solver="dp",
                            cost_model="analytic", objective="bottleneck", options=options,
                            build=lambda ctx, choice, _report: assemble_choice(ctx, choice, Pipeline))
    recorder = pipe.recorder
    if recorder is None:
        raise ConfigError("probe_action_overhead reads the runtime trace; the pipeline kept none")
    per_step = []
    loss_fn = nn.functional.mse_loss
    for i in range(steps + 2):
        pipe.zero_grad(set_to_none=True)
        pipe.train_step(x, target=target, loss_fn=loss_fn)
        if i >= 2:
            per_step.append(recorder.per_stage_s(pipe.num_stages))
    found = action_overhead(per_step, dev)
    log.info("runtime overhead on %s (%s): %.1f us per forward, %.1f us per backward", dev, executor,
             found.forward_s * 1e6, found.backward_s * 1e6)
    return found


def resolve_action_overhead(options: CompileOptions, specs: list[DeviceSpec], cost_model: str) -> CompileOptions:
    """``options`` with ``action_overhead_s`` in seconds: as given when a number; measured on the
    first device with the executor the pipeline will use (:func:`probe_action_overhead`) for
    ``"probe"``, and for ``"auto"`` when ``cost_model`` times the devices (profiled or measured);
    else 0.

    Raises:
        ConfigError: for a value that is not a number >= 0, ``"auto"`` or ``"probe"``.
    """
    given = action_overhead_option(options)
    if given is not None:
        return options
    if options.action_overhead_s == "probe" or cost_model in ("profiled", "measured"):
        executor = choose_executor(options.executor, [s.torch_device for s in specs])
        return replace(options, action_overhead_s=probe_action_overhead(str(specs[0].torch_device), executor).action_s)
    return replace(options, action_overhead_s=0.0)
