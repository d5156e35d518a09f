"""Shared helpers of the pipeline tests: fixed devices, compile once, compare with eager."""

from __future__ import annotations

import copy
from typing import Any

import torch

from fxsplit.api import CompileOptions
from fxsplit.compiler import assemble, plan_pipeline
from fxsplit.frontend import front_end
from fxsplit.ir import DeviceSpec, LinkSpec, Problem
from fxsplit.models import primary_tensor

# A fixed device, so plans are deterministic and no test measures the CPU.
CPU = DeviceSpec("cpu", peak_flops=50e9, memory_bandwidth_bytes_per_s=20e9, memory_bytes=8 * 2**30,
                 kind="cpu", torch_device="cpu", op_overhead_s=5e-6)


def devices(n: int) -> list[DeviceSpec]:
    return [CPU.with_(name=f"cpu#{i}") for i in range(n)]


class Compiled:
    """A model captured once; pipelines with different stage counts and schedules share it."""

    def __init__(self, case: Any, *, copy_tied: bool = False, use_kwargs: bool = False, executor: str = "sequential") -> None:
        self.case = case
        self.model = copy.deepcopy(case.model)
        self.reference = copy.deepcopy(case.model)
        self.options = CompileOptions(copy_tied=copy_tied, allow_idle_devices=False, time_limit_s=30.0, executor=executor)
        # make_batch gives positional inputs only, so capture without the optional kwargs.
        args, kwargs = tuple(case.example_inputs), dict(case.example_kwargs or {}) if use_kwargs else {}
        ins = front_end(self.model, args, kwargs, reference=CPU, cost_model="analytic", options=self.options)
        self.captured, self.condensed = ins.captured, ins.condensed
        self.batch = int(args[0].shape[0])

    def pipeline(self, num_stages: int, schedule: str, microbatches: int, solver: str = "auto") -> Any:
        problem = Problem(self.condensed.graph, tuple(devices(num_stages)), LinkSpec(), allow_idle_devices=False)
        choice = plan_pipeline(problem, self.batch, microbatches, schedule, solver, self.options)
        return self.assemble(choice.plan, schedule, microbatches)

    def assemble(self, plan: Any, schedule: str, microbatches: int) -> Any:
        pipe = assemble(self.model, self.captured, plan, devices(plan.num_stages), schedule, microbatches, self.options)
        pipe.zero_grad()
        return pipe


def reference_grads(model: torch.nn.Module, case: Any, inputs: Any, target: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = case.loss_fn(model(*inputs), target)
    if loss.requires_grad:  # a random DAG may have no parameter at all
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}
    return loss.detach(), grads


def assert_same_training(pipe: Any, compiled: Compiled, inputs: Any, target: Any, *, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Outputs, loss and every parameter's gradient of ``pipe`` equal the eager model's."""
    case = compiled.case
    ref_loss, ref_grads = reference_grads(compiled.reference, case, inputs, target)
    with torch.no_grad():
        torch.testing.assert_close(
            primary_tensor(pipe(*inputs)), primary_tensor(compiled.reference(*inputs)), rtol=rtol, atol=atol,
            msg=lambda m: f"outputs differ: {m}",
        )
    pipe.zero_grad()
    loss = pipe.train_step(*inputs, target=target, loss_fn=case.loss_fn)
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol, msg=lambda m: f"loss differs: {m}")
    names = set()
    for name, p in pipe.named_parameters():
        names.add(name)
        if name not in ref_grads:
            assert p.grad is None or not p.grad.abs().any(), f"{name}: gradient where the original has none"
            continue
        assert p.grad is not None, f"{name}: no gradient in the pipeline"
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"gradient of {n}: {m}")
    unique = {n for n, _ in compiled.reference.named_parameters()}  # tied tensors once
    missing = {n for n in ref_grads if n not in names and n in unique}
    assert not missing, f"parameters with a gradient in the original but not in the pipeline: {sorted(missing)}"


class StatefulBuffers(torch.nn.Module):
    """Buffers the forward reads after updating them: a warm-up counter and a running normaliser
    (written inside ``torch.no_grad``, which export wraps in a higher-order op). What a
    recomputed forward must read as the first forward read it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(8, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 3)
        self.register_buffer("t", torch.zeros(()))
        self.register_buffer("mean", torch.zeros(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.t += 1
        h = self.a(x) * torch.clamp(self.t / 10, max=1.0)
        with torch.no_grad():
            self.mean.mul_(0.9).add_(0.1 * h.detach().mean(0))  # detach: symbolic_trace drops no_grad
        return self.c(torch.tanh(self.b(h - self.mean)))

