"""One schedule path: fxsplit's action lists lowered onto torch.distributed.pipelining's runtime."""

from __future__ import annotations

import pytest
import torch

from fxsplit.errors import ScheduleError
from fxsplit.runtime.dist_schedule import torch_actions
from fxsplit.schedule import Action, Schedule, make


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 5), (4, 4)])
def test_every_action_keeps_its_place(kind: str, p: int, m: int) -> None:
    schedule = make(kind, p, m)
    lowered = torch_actions(schedule)
    assert sorted(lowered) == list(range(p))
    for rank, actions in enumerate(schedule.actions):
        assert [str(a) for a in lowered[rank]] == [str(a) for a in actions]


def test_an_action_torch_cannot_run_is_refused() -> None:
    schedule = Schedule(((Action(0, "F", 0), Action(0, "B", 0)),), 1, 1)
    object.__setattr__(schedule.actions[0][1], "kind", "Z")  # a kind fxsplit may add later
    with pytest.raises(ScheduleError, match="torch's runtime has no 'Z' action"):
        torch_actions(schedule)


def _two_linear_stages(rank: int, world: int, out_dir: str, kind: str) -> float:
    """Rank ``rank`` of a 2-stage MLP under the lowered ``kind`` schedule: the largest gradient
    difference to the unsplit model."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from fxsplit.runtime.dist_schedule import lowered_schedule

    def mlp() -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh())

    dist.init_process_group("gloo")
    try:
        full, ref = mlp(), mlp()
        part, ref_part = (full[:2], ref[:2]) if rank == 0 else (full[2:], ref[2:])
        m = 4
        schedule = lowered_schedule([PipelineStage(part, rank, 2, torch.device("cpu"))], make(kind, 2, m),
                                    loss_fn=lambda out, t: torch.nn.functional.mse_loss(out, t) / m)
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
        y = torch.randn(8, 8, generator=torch.Generator().manual_seed(2))
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        torch.nn.functional.mse_loss(ref(x), y).backward()
        return max(float((p.grad - q.grad).abs().max()) for p, q in zip(part.parameters(), ref_part.parameters(),
                                                                        strict=True))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_the_lowered_schedule_computes_the_unsplit_gradients(kind: str, tmp_path) -> None:
    from dist_utils import check_ok, launch

    results = launch(_two_linear_stages, 2, tmp_path, kind, deadline_s=60)
    check_ok(results)
    assert results[0]["result"] < 1e-6 and results[1]["result"] < 1e-6


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 2), (2, 2, 4), (4, 2, 8), (4, 3, 6), (3, 2, 9), (4, 2, 10)])
def test_interleaved_matches_torchs_order(p: int, v: int, m: int) -> None:
    """fxsplit's interleaved 1F1B is torch's ``ScheduleInterleaved1F1B`` action for action
    (torch pads its lists with ``None`` steps; the order of the actions is what runs)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    ours = make("interleaved-1f1b", p * v, m, num_ranks=p)
    for rank, order in enumerate(_torch_order(ScheduleInterleaved1F1B, p, v, m)):
        assert order == [str(a) for a in torch_actions(ours)[rank]]


def _torch_order(schedule_class: type, p: int, v: int, m: int) -> list[list[str]]:
    """Each rank's actions in torch's looped ``schedule_class`` for ``v`` stages per rank on ``p``
    ranks and ``m`` micro-batches, its ``None`` padding dropped: the order alone, computed without
    a process group or stages."""
    theirs = object.__new__(schedule_class)
    rounds = max(1, m // p)
    theirs.pp_group_size, theirs.n_local_stages, theirs._n_microbatches = p, v, m
    theirs.number_of_rounds, theirs.microbatches_per_round = rounds, m // rounds
    return [[str(a) for a in theirs._calculate_single_rank_operations(rank) if a is not None] for rank in range(p)]


@pytest.mark.parametrize(("p", "v", "m"), [(2, 1, 3), (4, 1, 8), (3, 1, 2), (2, 2, 4), (4, 2, 8), (3, 2, 9)])
def test_zero_bubble_matches_torchs_order(p: int, v: int, m: int) -> None:
    """fxsplit's zero-bubble schedule is torch's ``ScheduleInterleavedZeroBubble`` (ZB1P) action
    for action, its ``BACKWARD_INPUT`` / ``BACKWARD_WEIGHT`` as ``I`` / ``W`` (no-op slots dropped)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

    ours = make("zero-bubble" if v == 1 else "interleaved-zero-bubble", p * v, m, num_ranks=p)
    for rank, order in enumerate(_torch_order(ScheduleInterleavedZeroBubble, p, v, m)):
        assert order == [str(a) for a in torch_actions(ours)[rank]]
