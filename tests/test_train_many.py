"""``fxsplit.train_many`` (Hydra's shard parallelism): every model ends as training it alone would
leave it, whatever the scheduler interleaves; budgets are enforced; bad input is refused."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pipeline_utils import StatefulBuffers
from torch import nn

import fxsplit
import fxsplit.models as zoo
from fxsplit.errors import ConfigError, ExecutionError, InfeasibleError
from fxsplit.multi import Task, optimizer_state_factor, train_many
from fxsplit.runtime.shards import DevicePool
from fxsplit.schedule.shards import POLICIES

OPTIMIZERS: dict[str, Callable[[float], Callable[[list[nn.Parameter]], torch.optim.Optimizer]]] = {
    "sgd": lambda lr: (lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9)),
    "adamw": lambda lr: (lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=0.01)),
}


def _mlp(width: int, depth: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(8, width), nn.GELU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 3))


def _data(batch: int, steps: int, seed: int) -> list[tuple[tuple[torch.Tensor], torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(batch, 8, generator=g),), torch.randn(batch, 3, generator=g)) for _ in range(steps)]


def _train_alone(model: nn.Module, optimizer: Any, loss_fn: Any, data: list[Any]) -> torch.optim.Optimizer:
    opt = optimizer(list(model.parameters()))
    for inputs, target in data:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(*inputs), target).backward()
        opt.step()
    return opt


def _check_same_as_alone(result: Any, alone: list[tuple[nn.Module, torch.optim.Optimizer]]) -> None:
    for j, (ref, ref_opt) in enumerate(alone):
        trained = dict(result.models[j].named_parameters())
        state = result.optimizer_state(j)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(trained[name], p, rtol=1e-5, atol=1e-7, msg=f"task {j} parameter {name}")
            for key, value in ref_opt.state[p].items():
                torch.testing.assert_close(state[name][key], value, rtol=1e-5, atol=1e-7,
                                           msg=f"task {j} optimizer state {key} of {name}")


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(widths=st.lists(st.sampled_from([16, 32, 48]), min_size=1, max_size=3), devices=st.integers(1, 3),
       policy=st.sampled_from(POLICIES), optimizer=st.sampled_from(sorted(OPTIMIZERS)),
       budget_kib=st.sampled_from([None, 40, 70]), steps=st.integers(1, 3), recompute=st.booleans())
def test_every_model_ends_as_training_it_alone(widths: list[int], devices: int, policy: str, optimizer: str,
                                               budget_kib: int | None, steps: int, recompute: bool) -> None:
    tasks, alone = [], []
    for j, width in enumerate(widths):
        model = _mlp(width, 3, seed=j)
        data = _data(4 + 2 * j, steps, seed=j)
        opt = OPTIMIZERS[optimizer](1e-2 / (j + 1))
        ref = copy.deepcopy(model)
        alone.append((ref, _train_alone(ref, opt, nn.functional.mse_loss, data)))
        tasks.append(Task(model, opt, nn.functional.mse_loss, data, steps=steps))
    budget = None if budget_kib is None else budget_kib * 1024
    result = train_many(tasks, devices, memory_per_device_bytes=budget, scheduler=policy, recompute=recompute)
    _check_same_as_alone(result, alone)
    if budget is not None:
        assert all(st.memory_bytes <= budget for plan in result.report.plans for st in plan.stages)
    assert all(len(losses) == steps for losses in result.report.losses)


@pytest.mark.parametrize("optimizer, recompute", [("sgd", False), ("adamw", True)])
def test_gpt_with_tied_embeddings_in_several_shards_ends_as_alone(optimizer: str, recompute: bool) -> None:
    """The zoo GPT ties its LM head to the token embedding: the weight is read by the first and
    the last shard. It belongs to the first shard, whose backward ends the step, so it steps
    once, with both gradients."""
    tasks, alone = [], []
    for j, bs in enumerate((2, 4)):
        case = zoo.get("gpt", size="tiny", batch_size=bs)
        data = [case.make_batch(bs, 10 * j + s) for s in range(2)]
        opt = OPTIMIZERS[optimizer](1e-3)
        ref = copy.deepcopy(case.model)
        alone.append((ref, _train_alone(ref, opt, case.loss_fn, data)))
        tasks.append(Task(case.model, opt, case.loss_fn, data, steps=2))
    result = train_many(tasks, 2, memory_per_device_bytes=300 * 1024, recompute=recompute)
    for sharded, model in zip(result.sharded, result.models, strict=True):
        assert sharded.num_shards >= 2
        tied = model.tok_emb.weight
        readers = [s for s, stage in enumerate(sharded.pipe.stages) if any(p is tied for p in stage.gm.parameters())]
        assert readers[0] == 0 and readers[-1] == sharded.num_shards - 1  # read by the first and the last shard
        assert any(p is tied for p in sharded.owned[0])
    _check_same_as_alone(result, alone)
    assert result.report.makespan_s > 0 and result.report.moved_bytes > 0
    assert len(result.report.measured.events) == sum(len(m.task.units) for m in result.sharded)


def test_epochs_pass_over_the_data_again() -> None:
    model, data = _mlp(16, 2, 0), _data(4, 3, 0)
    ref = copy.deepcopy(model)
    opt = OPTIMIZERS["sgd"](1e-2)
    ref_opt = _train_alone(ref, opt, nn.functional.mse_loss, data + data)
    result = train_many([Task(model, opt, nn.functional.mse_loss, data, epochs=2)], 1)
    assert len(result.report.losses[0]) == 6
    _check_same_as_alone(result, [(ref, ref_opt)])


def test_a_budget_smaller_than_a_shard_is_refused_when_it_runs() -> None:
    result = train_many([Task(_mlp(16, 2, 0), OPTIMIZERS["sgd"](1e-2), nn.functional.mse_loss, _data(4, 1, 0),
                              steps=1)], 1)
    sharded = result.sharded[0]
    pool = DevicePool([torch.device("cpu")], [sharded.memory_bytes[0] - 1])
    with pytest.raises(ExecutionError, match="more than device 0"):
        pool.bring(0, (0, 0), [sharded])
    assert pool.moved_bytes == 0 and pool.held == [None]  # nothing was brought


def test_a_block_larger_than_the_budget_is_infeasible() -> None:
    task = Task(_mlp(64, 2, 0), OPTIMIZERS["adamw"](1e-3), nn.functional.mse_loss, _data(4, 1, 0), steps=1)
    with pytest.raises(InfeasibleError):
        train_many([task], 2, memory_per_device_bytes=4 * 1024)


def test_dropout_recomputed_on_several_workers_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.1), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 3))

    def task() -> Task:
        return Task(make, OPTIMIZERS["sgd"](1e-2), nn.functional.mse_loss, _data(4, 1, 0), steps=1)

    with pytest.raises(ConfigError, match="random"):
        train_many([task(), task()], 2, memory_per_device_bytes=16 * 1024, recompute=True)
    assert train_many([task()], 1, memory_per_device_bytes=16 * 1024, recompute=True).report.shards[0] >= 2
    # without recomputation each forward's masks are the ones its backward uses: runs, and says the
    # masks are not those of training alone
    with caplog.at_level(logging.WARNING, logger="fxsplit.multi"):
        assert train_many([task(), task()], 2, memory_per_device_bytes=16 * 1024).report.shards == (2, 2)
    assert "differ from training it alone" in caplog.text


@pytest.mark.parametrize("kwargs, match", [
    ({"steps": None}, "exactly one"),
    ({"steps": 1, "epochs": 1}, "exactly one"),
    ({"steps": 0}, "positive"),
    ({"steps": None, "epochs": 1, "data": iter([])}, "length"),
    ({"steps": 3}, "has 2 batches"),
    ({"steps": 3, "data": iter(_data(4, 2, 0))}, "ran out"),
    ({"data": [(torch.randn(4, 8),)]}, r"\(inputs, target\)"),
    ({"model": lambda: 3}, "nn.Module"),
])
def test_bad_tasks_are_refused(kwargs: dict[str, Any], match: str) -> None:
    fields: dict[str, Any] = {"model": _mlp(16, 2, 0), "optimizer": OPTIMIZERS["sgd"](1e-2),
                              "loss_fn": nn.functional.mse_loss, "data": _data(4, 2, 0), "steps": 1}
    fields.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        train_many([Task(**fields)], 1)


@pytest.mark.parametrize("devices, kwargs, match", [
    (["cuda:0"], {}, "CPU workers"), (0, {}, "at least 1"), (1, {"scheduler": "sjf"}, "scheduler"),
])
def test_bad_arguments_are_refused(devices: Any, kwargs: dict[str, Any], match: str) -> None:
    task = Task(_mlp(16, 2, 0), OPTIMIZERS["sgd"](1e-2), nn.functional.mse_loss, _data(4, 1, 0), steps=1)
    with pytest.raises(ConfigError, match=match):
        train_many([task], devices, **kwargs)
    with pytest.raises(ConfigError, match="at least one"):
        train_many([], 1)


def test_optimizer_state_factor_is_measured() -> None:
    assert optimizer_state_factor(lambda p: torch.optim.SGD(p, lr=0.1)) == 0.0
    assert optimizer_state_factor(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)) == 1.0
    assert optimizer_state_factor(lambda p: torch.optim.AdamW(p, lr=0.1)) == 2.0


def test_sweep_cli_trains_the_grid_and_matches_training_alone() -> None:
    import re

    from typer.testing import CliRunner

    import fxsplit.cli as cli

    cli._register_all()
    result = CliRunner().invoke(cli.app, ["sweep", "gpt", "--size", "tiny", "--lr", "1e-3,3e-4", "--batch-size", "2,4",
                                          "--devices", "2", "--memory-per-device", "0.0003", "--steps", "2"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    rows = re.findall(r"lr=\S+ bs=\d+\s+│\s+(\d+) │\s+\S+ │\s+(\S+) │", result.output)
    assert len(rows) == 4, result.output
    assert all(int(shards) >= 2 and float(diff) == 0.0 for shards, diff in rows), result.output
    for quantity in ("measured makespan", "simulator's prediction", "lower bound (measured unit times)"):
        assert quantity in result.output
    assert "dev1 |" in result.output


def test_sweep_cli_refuses_a_bad_grid() -> None:
    from typer.testing import CliRunner

    import fxsplit.cli as cli

    cli._register_all()
    result = CliRunner().invoke(cli.app, ["sweep", "mlp", "--lr", "fast"])
    assert result.exit_code == 2 and "--lr" in result.output
    result = CliRunner().invoke(cli.app, ["sweep", "mlp", "--size", "tiny", "--memory-per-device", "0.0000001"])
    assert result.exit_code == 2 and "error" in result.output


# -- regressions (review of the first version) ------------------------------------------------------
def test_gradients_left_on_the_model_do_not_enter_the_first_step() -> None:
    """Regression: nothing cleared ``.grad`` before step 0, so a gradient left from an earlier
    backward was added to the first step's (training alone starts with ``zero_grad``)."""
    model, data = _mlp(32, 2, 0), _data(4, 2, 0)
    nn.functional.mse_loss(model(*data[0][0]), data[0][1]).backward()
    ref = copy.deepcopy(model)
    opt = OPTIMIZERS["sgd"](1e-2)
    ref_opt = _train_alone(ref, opt, nn.functional.mse_loss, data)
    result = train_many([Task(model, opt, nn.functional.mse_loss, data, steps=2)], 1, memory_per_device_bytes=16 * 1024)
    assert result.report.shards[0] >= 2
    _check_same_as_alone(result, [(ref, ref_opt)])


def test_a_shard_without_parameters_trains() -> None:
    """Regression: a parameter-free shard made ``optimizer([])`` raise ValueError."""
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.a(x))
            o = torch.tanh(h.unsqueeze(2) * h.unsqueeze(1))  # parameter-free, large activations
            return self.b(o.mean(-1) + o.amax(-1))

    g = torch.Generator().manual_seed(0)
    data = [((torch.randn(4, 64, generator=g),), torch.randn(4, 3, generator=g)) for _ in range(2)]
    model = Outer()
    ref = copy.deepcopy(model)
    opt = OPTIMIZERS["adamw"](1e-3)
    ref_opt = _train_alone(ref, opt, nn.functional.mse_loss, data)
    result = train_many([Task(model, opt, nn.functional.mse_loss, data, steps=2)], 1, memory_per_device_bytes=70 * 1024)
    assert any(o is None for o in result.optimizers[0]), [len(o) for o in result.sharded[0].owned]
    _check_same_as_alone(result, [(ref, ref_opt)])


def test_one_model_with_dropout_on_one_worker_draws_the_masks_of_training_alone() -> None:
    """Regression: setting up (the CPU probe) drew from the global generator, so even one model
    on one worker drew other dropout masks than training it alone from the same seed."""
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.Dropout(0.3), nn.Linear(32, 3))

    data, opt = _data(4, 3, 0), OPTIMIZERS["sgd"](1e-2)
    ref = make()
    torch.manual_seed(123)
    ref_opt = _train_alone(ref, opt, nn.functional.mse_loss, data)
    model = make()
    torch.manual_seed(123)
    result = train_many([Task(model, opt, nn.functional.mse_loss, data, steps=3)], 1)
    _check_same_as_alone(result, [(ref, ref_opt)])


def test_tasks_sharing_weights_or_an_iterator_are_refused() -> None:
    model, data, opt = _mlp(16, 2, 0), _data(4, 1, 0), OPTIMIZERS["sgd"](1e-2)
    with pytest.raises(ConfigError, match="shares"):
        train_many([Task(model, opt, nn.functional.mse_loss, data, steps=1),
                    Task(model, opt, nn.functional.mse_loss, data, steps=1)], 1)
    stream = iter(_data(4, 2, 0))
    with pytest.raises(ConfigError, match="share one data iterator"):
        train_many([Task(_mlp(16, 2, 0), opt, nn.functional.mse_loss, stream, steps=1),
                    Task(_mlp(16, 2, 1), opt, nn.functional.mse_loss, stream, steps=1)], 1)


def test_copied_tied_weights_and_autocast_are_not_taken_silently() -> None:
    """Regression: ``CompileOptions(copy_tied=True)`` gave each shard its own copy of a tied weight,
    each with its own optimizer, and the copies drifted apart."""
    case = zoo.get("gpt", size="tiny", batch_size=2)
    data = [case.make_batch(2, s) for s in range(2)]
    ref, opt = copy.deepcopy(case.model), OPTIMIZERS["sgd"](1e-3)
    ref_opt = _train_alone(ref, opt, case.loss_fn, data)
    result = train_many([Task(case.model, opt, case.loss_fn, data, steps=2)], 1, memory_per_device_bytes=300 * 1024,
                        options=fxsplit.CompileOptions(copy_tied=True))
    _check_same_as_alone(result, [(ref, ref_opt)])
    with pytest.raises(ConfigError, match="autocast"):
        train_many([Task(_mlp(16, 2, 0), opt, nn.functional.mse_loss, _data(4, 1, 0), steps=1)], 1,
                   options=fxsplit.CompileOptions(autocast="bf16"))


def test_a_failing_unit_says_where_every_model_stopped() -> None:
    data = [_data(4, 3, j) for j in range(2)]
    bad = data[1][1][1]  # task 1's second target

    def flaky(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if target is bad:
            raise RuntimeError("boom")
        return nn.functional.mse_loss(output, target)

    tasks = [Task(_mlp(16, 2, j), OPTIMIZERS["sgd"](1e-2), flaky, data[j], steps=3) for j in range(2)]
    with pytest.raises(ExecutionError, match=r"boom.*stopped where they were: 'task0' after \d whole step.*'task1' after 1 "):
        train_many(tasks, 1)


def test_buffers_read_after_their_update_recompute_as_training_alone() -> None:
    """Regression: with recompute=True the second forward read the buffers as the first forward
    had left them (a counter one ahead, a normaliser already moved): wrong gradients, no error."""
    torch.manual_seed(0)
    model, data, opt = StatefulBuffers(), _data(8, 3, 0), OPTIMIZERS["sgd"](1e-1)
    ref = copy.deepcopy(model)
    ref_opt = _train_alone(ref, opt, nn.functional.mse_loss, data)
    result = train_many([Task(model, opt, nn.functional.mse_loss, data, steps=3)], 1, memory_per_device_bytes=16 * 1024,
                        recompute=True)
    assert result.report.shards[0] >= 2 and result.sharded[0].pipe.plan.stages[0].recompute
    _check_same_as_alone(result, [(ref, ref_opt)])
    torch.testing.assert_close(model.mean, ref.mean)
    assert float(model.t) == float(ref.t) == 3.0


def test_a_shard_task_times_its_loss_as_compile_does() -> None:
    """The last shard's unit carries the loss, timed by frontend.loss_times_s on stand-in zeros
    of the model's output shapes; a loss that cannot take them costs 0 (the runtime measures it)."""
    from fxsplit.frontend import capture_with
    from fxsplit.multi import _loss_s
    from fxsplit.options import CompileOptions

    model = nn.Linear(4, 3)
    captured = capture_with(model, (torch.randn(2, 4),), {}, CompileOptions())
    assert _loss_s(captured, nn.functional.mse_loss, torch.ones(2, 3)) > 0.0

    def fails(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("wrong target")

    assert _loss_s(captured, fails, torch.ones(2, 3)) == 0.0


class _ClippedSGD(torch.optim.SGD):
    """SGD that clips the global gradient norm of its parameters inside its step: it couples them."""

    def step(self, closure: Any = None) -> Any:
        nn.utils.clip_grad_norm_([p for g in self.param_groups for p in g["params"] if p.grad is not None], 0.5)
        return super().step(closure)


def test_an_optimizer_that_couples_parameters_is_refused_across_shards() -> None:
    from fxsplit.runtime.shards import optimizer_coupling

    for factory in (*(f(1e-2) for f in OPTIMIZERS.values()), lambda p: torch.optim.Adam(p, foreach=True)):
        assert optimizer_coupling(factory) == 0.0
    clipped = optimizer_coupling(lambda p: _ClippedSGD(p, lr=0.1))
    assert clipped is not None and clipped > 1e-3

    def task() -> Task:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 3))
        return Task(model, lambda p: _ClippedSGD(p, lr=0.1), nn.functional.mse_loss, _data(4, 2, 0), steps=2)

    with pytest.raises(ConfigError, match=r"couples them.*cuts this model into \d+ shards"):
        train_many([task()], 1, memory_per_device_bytes=12 * 1024)
    # one shard: one optimizer over the whole model, as training it alone
    result = train_many([task()], 1, memory_per_device_bytes=2**30)
    assert result.report.shards == (1,)
