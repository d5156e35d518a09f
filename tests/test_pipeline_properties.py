"""Property: random DAG modules x random valid plans x random micro-batch counts train like eager."""

from __future__ import annotations

import os
import random

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pipeline_utils import Compiled, assert_same_training, devices

import fxsplit.models as zoo
from fxsplit.ir import LinkSpec, Problem, evaluate


def random_valid_split(graph, num_stages: int, rng: random.Random) -> list[list[int]]:
    """Cut a random linear extension of the block DAG into ``num_stages`` non-empty pieces:
    every prefix of a linear extension is a downset, so the stages are contiguous."""
    indeg = {b.id: len(graph.predecessors(b.id)) for b in graph.blocks}
    ready, order = [b for b, d in indeg.items() if d == 0], []
    while ready:
        b = ready.pop(rng.randrange(len(ready)))
        order.append(b)
        for s in graph.successors(b):
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    cuts = sorted(rng.sample(range(1, len(order)), num_stages - 1))
    bounds = [0, *cuts, len(order)]
    return [order[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


# Cases per run: 12 in CI; FXSPLIT_TRANSPARENCY_CASES=N for more (bench/soak.py runs thousands).
CASES = int(os.environ.get("FXSPLIT_TRANSPARENCY_CASES", "12"))


@settings(max_examples=CASES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), num_stages=st.integers(2, 4), microbatches=st.integers(1, 4),
       schedule=st.sampled_from(["gpipe", "1f1b", "zero-bubble"]))
def test_random_dag_random_plan(seed, num_stages, microbatches, schedule):
    assume(transparency_case(seed, 10, num_stages, microbatches, schedule))


def transparency_case(seed: int, max_nodes: int, num_stages: int, microbatches: int, schedule: str) -> bool:
    """One random DAG module, random valid plan, micro-batch count and schedule: the pipeline's
    outputs and every gradient equal the unsplit model's (raises AssertionError otherwise).
    Returns False when the graph has fewer than 2 blocks (nothing to split)."""
    spec = zoo.random_dag_spec(random.Random(seed), max_nodes=max_nodes, max_extra_outputs=2)
    torch.manual_seed(seed)
    model = zoo.build_dag_module(spec, width=8)
    batch = 4

    def loss_fn(out, target):
        return sum(o.float().pow(2).mean() for o in out) / len(out)

    inputs = (torch.randn(batch, 8, generator=torch.Generator().manual_seed(seed)),)
    case = zoo.ModelCase(name="dag", model=model, example_inputs=inputs,
                         make_batch=lambda n, s: (inputs, torch.zeros(n)), loss_fn=loss_fn, description="random DAG")
    compiled = Compiled(case)
    graph = compiled.condensed.graph
    num_stages = min(num_stages, len(graph))
    if num_stages < 2:
        return False
    stages = random_valid_split(graph, num_stages, random.Random(seed))
    problem = Problem(graph, tuple(devices(num_stages)), LinkSpec(), microbatches=microbatches, schedule=schedule)
    plan = evaluate(problem, stages)
    assert plan.validate(problem) == []
    pipe = compiled.assemble(plan, schedule, microbatches)
    assert_same_training(pipe, compiled, inputs, None)
    return True
