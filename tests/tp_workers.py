"""Workers for test_tensor_parallel.py: per-layer plans (PaSE) run with DTensor on gloo ranks.

Each worker builds the unsplit model and a copy, runs :func:`fxsplit.distributed.parallelize`
with a strategy, and compares outputs, the loss, every gradient (by original name) and, after
one SGD step on both, the whole state dict; it returns the largest differences.
"""

from __future__ import annotations

import copy
import math
import random
from typing import Any

import torch


def perturbed_choice(seed: int) -> Any:
    """A strategy function: the optimum of the strategy graph under random costs (every
    forbidden pair kept forbidden), so a random *valid* per-node plan."""
    from fxsplit.ir.strategy import StrategyEdge, StrategyGraph, StrategyOption, StrategyVertex
    from fxsplit.solvers.pase import solve_strategies

    def pick(found: Any) -> tuple[int, ...]:
        rng = random.Random(seed)
        g = found.graph
        vertices = tuple(StrategyVertex(v.name, tuple(StrategyOption(o.name, o.compute_s if math.isinf(o.compute_s)
                                                                     else rng.random()) for o in v.options))
                         for v in g.vertices)
        edges = tuple(StrategyEdge(e.src, e.dst, tuple(tuple(c if math.isinf(c) else 0.1 * rng.random() for c in row)
                                                       for row in e.cost_s)) for e in g.edges)
        return solve_strategies(StrategyGraph(vertices, edges)).choice

    return pick


def _first(y: Any) -> torch.Tensor:
    return y[0] if isinstance(y, tuple | list) else y


def train_like_unsplit(rank: int, world: int, out_dir: str, runs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``runs``: ``(model name, strategy)``; a strategy ``("random", seed)`` is
    :func:`perturbed_choice`. Returns per run the differences and what ran."""
    import torch.nn.functional as F

    import fxsplit.distributed as fxd
    from fxsplit.api import load_model

    results: dict[str, Any] = {}
    for name, strategy in runs:
        torch.manual_seed(0)
        case = load_model(name, size="tiny", batch_size=8)
        reference = case.model
        asked = perturbed_choice(strategy[1]) if isinstance(strategy, tuple) else strategy
        pg = fxd.parallelize(lambda reference=reference: copy.deepcopy(reference), case.example_inputs, strategy=asked)
        out = _first(pg(*case.example_inputs))
        gen = torch.Generator().manual_seed(1)
        if out.dim() > 2:
            target = torch.randint(0, out.shape[-1], out.shape[:-1], generator=gen)
        else:
            target = torch.randint(0, out.shape[-1], (out.shape[0],), generator=gen)

        def loss_fn(y: Any, t: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(_first(y).flatten(0, -2), t.flatten())

        loss = pg.train_step(*case.example_inputs, target=target, loss_fn=loss_fn)
        ref_out = _first(reference(*case.example_inputs))
        ref_loss = loss_fn(ref_out, target)
        ref_loss.backward()
        grads = pg.grads()
        params = dict(reference.named_parameters(remove_duplicate=False))
        grad_diff = max(float((grads[n] - p.grad).abs().max() / (p.grad.abs().max() + 1e-12)) for n, p in params.items())
        torch.optim.SGD(pg.parameters(), lr=0.1).step()
        torch.optim.SGD(reference.parameters(), lr=0.1).step()
        state, ref_state = pg.state_dict(), reference.state_dict()
        tag = f"{name}-{strategy}"
        results[tag] = {
            "out_diff": float((out - ref_out).detach().abs().max()),
            "loss_diff": abs(float(loss) - float(ref_loss.detach())),
            "grad_rel_diff": grad_diff,
            "grads_named": sorted(n for n, g in grads.items() if g is not None),
            "params_named": sorted(params),
            "keys": list(state) == list(ref_state),
            "state_diff": max(float((state[k] - ref_state[k]).abs().max()) for k in ref_state),
            "placements": sorted(set(pg.placements().values())),
            "strategy": pg.plan.strategy,
            "predicted_s": pg.plan.predicted_step_s,
            "run_whole": sorted(pg.run_whole),
        }
    return results


def different_targets(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """Every rank passes its own target: each must refuse (ConfigError), none may train."""
    import torch.nn.functional as F

    import fxsplit.distributed as fxd
    from fxsplit.api import load_model
    from fxsplit.errors import ConfigError

    torch.manual_seed(0)
    case = load_model("mlp", size="tiny", batch_size=8)
    pg = fxd.parallelize(lambda: copy.deepcopy(case.model), case.example_inputs, strategy="data-parallel")
    out = _first(pg(*case.example_inputs))
    target = torch.full((out.shape[0],), rank % out.shape[-1])
    try:
        pg.train_step(*case.example_inputs, target=target, loss_fn=lambda y, t: F.cross_entropy(_first(y), t))
    except ConfigError as exc:
        return {"refused": str(exc), "grads": [n for n, g in pg.grads().items() if g is not None]}
    return {"refused": None}


def cli_layers(rank: int, world: int, out_dir: str, strategy: str) -> str:
    """``fxsplit compile mlp --distributed --parallel STRATEGY`` (its body): what rank 0 prints."""
    import contextlib
    import io

    from fxsplit.cli.compile_dist import run_layers

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        run_layers("mlp", steps=2, strategy=strategy, size="tiny", batch_size=8, lr=0.1, timeout_s=60.0)
    return buf.getvalue()


def relayout_equal(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """A plan whose output placements differ from what DTensor's propagation gives (every op
    of the data-parallel plan told to leave its output whole while its operands stay split):
    each output is moved to the plan's placement, and the model still trains like the unsplit one."""
    import dataclasses

    import torch.nn.functional as F

    import fxsplit.distributed as fxd
    from fxsplit.api import load_model

    torch.manual_seed(0)
    case = load_model("mlp", size="tiny", batch_size=8)
    reference = case.model
    pg = fxd.parallelize(lambda: copy.deepcopy(reference), case.example_inputs, strategy="data-parallel")
    ops = {n.name for n in pg.gm.graph.nodes if n.op == "call_function"}
    for name, plan in list(pg.layout.items()):
        if name in ops and plan.output == "S(0)" and "S(0)" in plan.inputs:
            pg.layout[name] = dataclasses.replace(plan, output="R")
    target = torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(1))

    def loss_fn(y: Any, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(_first(y), t % _first(y).shape[-1])

    loss = pg.train_step(*case.example_inputs, target=target, loss_fn=loss_fn)
    ref_loss = loss_fn(reference(*case.example_inputs), target)
    ref_loss.backward()
    grads = pg.grads()
    return {"relayouts": sum(pg.relayouts.values()), "loss_diff": abs(float(loss) - float(ref_loss.detach())),
            "grad_diff": max(float((grads[n] - p.grad).abs().max()) for n, p in reference.named_parameters())}


def calibrate_equal(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """``calibrate`` on PaSE's pick for the GPT: the report's numbers, gradients left as before the call,
    and the returned graph (rebuilt or not) holding the same weights and training like the
    unsplit model."""
    import torch.nn.functional as F

    import fxsplit.distributed as fxd
    from fxsplit.api import load_model

    torch.manual_seed(0)
    case = load_model("gpt", size="tiny", batch_size=8)
    reference = case.model
    pg = fxd.parallelize(lambda: copy.deepcopy(reference), case.example_inputs, strategy="auto")
    gen = torch.Generator().manual_seed(1)
    out = _first(reference(*case.example_inputs))
    target = torch.randint(0, out.shape[-1], out.shape[:-1], generator=gen)

    def loss_fn(y: Any, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(_first(y).flatten(0, -2), t.flatten())

    pg.train_step(*case.example_inputs, target=target, loss_fn=loss_fn)  # gradients calibrate must keep
    kept = {n: g.clone() for n, g in pg.grads().items() if g is not None}
    state = pg.state_dict()
    split_before = pg.split_ops
    graph, report = pg.calibrate(*case.example_inputs, target=target, loss_fn=loss_fn, steps=2)
    after_grads = pg.grads()
    graph.zero_grad(set_to_none=True)
    loss = graph.train_step(*case.example_inputs, target=target, loss_fn=loss_fn)
    ref_loss = loss_fn(reference(*case.example_inputs), target)
    ref_loss.backward()
    grads = graph.grads()
    return {
        "report": report.__dict__,
        "split_before": split_before, "split_after": graph.split_ops,
        "grads_kept": max(float((after_grads[n] - g).abs().max()) for n, g in kept.items()),
        "state_same": max(float((graph.state_dict()[k] - v).abs().max()) for k, v in state.items()),
        "loss_diff": abs(float(loss) - float(ref_loss.detach())),
        "grad_diff": max(float((grads[n] - p.grad).abs().max()) for n, p in reference.named_parameters()),
    }


def collective_link(rank: int, world: int, out_dir: str) -> tuple[float, float]:
    """The ring link all-gathers over every rank measure (every rank returns it)."""
    import fxsplit.distributed as fxd
    from fxsplit.runtime.links import probe_collective_link

    fxd.init_process_group("gloo", 60.0)
    link = probe_collective_link(repeats=3)
    return link.bytes_per_s, link.latency_s


def reshard_equal(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """A Megatron plan trained one SGD step, its whole state loaded into a data-parallel plan of
    the same model (another layout): the same state, the same loss and gradients next step."""
    import torch.nn.functional as F

    import fxsplit.distributed as fxd
    from fxsplit.api import load_model

    torch.manual_seed(0)
    case = load_model("gpt", size="tiny", batch_size=8)
    reference = case.model
    megatron = fxd.parallelize(lambda: copy.deepcopy(reference), case.example_inputs, strategy="megatron")
    out = _first(reference(*case.example_inputs))
    target = torch.randint(0, out.shape[-1], out.shape[:-1], generator=torch.Generator().manual_seed(1))

    def loss_fn(y: Any, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(_first(y).flatten(0, -2), t.flatten())

    megatron.train_step(*case.example_inputs, target=target, loss_fn=loss_fn)
    torch.optim.SGD(megatron.parameters(), lr=0.5).step()
    state = megatron.state_dict()
    dp = fxd.parallelize(lambda: copy.deepcopy(reference), case.example_inputs, strategy="data-parallel")
    dp.load_state_dict(state)
    megatron.zero_grad(set_to_none=True)
    losses = [float(g.train_step(*case.example_inputs, target=target, loss_fn=loss_fn)) for g in (megatron, dp)]
    a, b = megatron.grads(), dp.grads()
    fresh = fxd.parallelize(lambda: copy.deepcopy(reference), case.example_inputs, strategy="megatron")
    fresh.load_state_dict(dp.state_dict())  # back into shards
    return {"state_diff": max(max(float((g.state_dict()[k] - v).abs().max()) for k, v in state.items())
                              for g in (dp, fresh)),
            "moved": max(float((state[k] - v).abs().max()) for k, v in reference.state_dict().items()),
            "loss_diff": abs(losses[0] - losses[1]),
            "grad_diff": max(float((a[n] - b[n]).abs().max()) for n in a if a[n] is not None),
            "layouts": (sorted(set(megatron.placements().values())), sorted(set(dp.placements().values())))}


def clip_like_unsplit(rank: int, world: int, out_dir: str, strategy: str) -> dict[str, Any]:
    """GPT split per layer (Megatron's column/row linears: sharded gradients): after one step,
    ``pg.clip_grad_norm_`` gives the unsplit model's norm and clipped gradients."""
    import torch.nn.functional as F

    import fxsplit.distributed as fxd
    from fxsplit.api import load_model

    torch.manual_seed(0)
    case = load_model("gpt", size="tiny", batch_size=8)
    reference = case.model
    pg = fxd.parallelize(lambda: copy.deepcopy(reference), case.example_inputs, strategy=strategy)
    out = _first(pg(*case.example_inputs))
    target = torch.randint(0, out.shape[-1], out.shape[:-1], generator=torch.Generator().manual_seed(1))

    def loss_fn(y: Any, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(_first(y).flatten(0, -2), t.flatten())

    pg.train_step(*case.example_inputs, target=target, loss_fn=loss_fn)
    loss_fn(reference(*case.example_inputs), target).backward()
    ref_total = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05))
    total = pg.clip_grad_norm_(0.05)
    grads = pg.grads()
    params = dict(reference.named_parameters(remove_duplicate=False))
    diff = max(float((grads[n] - p.grad).abs().max() / (p.grad.abs().max() + 1e-12)) for n, p in params.items())
    return {"total": total, "ref_total": ref_total, "grad_rel_diff": diff,
            "placements": sorted(set(pg.placements().values()))}
