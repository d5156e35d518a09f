"""fp16 loss scaling across the ranks of a pipeline: one skip decision, one scale.

With ``autocast="fp16"`` the loss is multiplied by a scale before backward so that small
gradients do not underflow in fp16; an overflow (``inf``/``nan`` in any gradient) means the
optimizer step must be skipped and the scale lowered. In a pipeline every rank holds different
parameters, so a rank sees only its own overflow: with a plain ``torch.amp.GradScaler`` one rank
would skip its step while the others take theirs, and the ranks' scales would drift apart.

torch's ``ShardedGradScaler`` (``torch.distributed.fsdp.sharded_grad_scaler``, written for
sharded parameters, which is what pipeline stages are) all-reduces the found-inf flag over its
process group in ``unscale_`` (which ``step`` calls), so every rank of the group skips or steps
together and ``update`` moves every rank's scale the same way. fxsplit only builds and checks
it; the last rank multiplies each micro-batch's loss by ``scaler.scale`` before backward
(:meth:`fxsplit.runtime.distributed.DistributedPipeline.train_step`).

References:
    Micikevicius et al., "Mixed precision training", ICLR 2018, section 3.2 (loss scaling);
    https://pytorch.org/docs/stable/amp.html#gradient-scaling
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from fxsplit.errors import ConfigError

__all__ = ["ShardedGradScaler", "pipeline_grad_scaler", "prepare_grad_scaler", "scale_loss"]


def pipeline_grad_scaler(
    device: torch.device,
    *,
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
) -> ShardedGradScaler:
    """A ``ShardedGradScaler`` whose overflow check is reduced over every rank of the default
    process group (the ranks a :class:`~fxsplit.runtime.distributed.DistributedPipeline` runs on,
    with every replica of its stages: an overflow in one replica's gradients reaches the others
    through the replicas' all-reduce, and every rank skips the step together).

    Args:
        device: The device the stages run on (its type, ``"cpu"`` or ``"cuda"``, is the scaler's).
        init_scale: The first loss scale (a power of two keeps the unscaling exact).
        growth_factor: The scale is multiplied by it after ``growth_interval`` steps without
            overflow.
        backoff_factor: The scale is multiplied by it after a step with an overflow on any rank.
        growth_interval: Steps without overflow before the scale grows.

    Returns:
        The scaler; build it on every rank with the same arguments.

    Example:
        >>> pipeline_grad_scaler(torch.device("cpu"), init_scale=1024.0).get_scale()
        1024.0
    """
    return ShardedGradScaler(device.type, init_scale=init_scale, growth_factor=growth_factor,
                             backoff_factor=backoff_factor, growth_interval=growth_interval,
                             process_group=dist.group.WORLD)


def prepare_grad_scaler(scaler: Any, device: torch.device, num_ranks: int) -> None:
    """Refuse a scaler whose skip decision would not be the same on every rank of the pipeline;
    give an accepted one its scale tensor on ``device`` (``GradScaler`` creates it at the first
    ``scale()`` call, which only the last rank makes, and ``unscale_`` needs it on every rank).

    Args:
        scaler: What ``train_step(grad_scaler=...)`` got (not None).
        device: The device the stages run on.
        num_ranks: The ranks that must agree: every rank of the job (the default group's size:
            the pipeline's stages with their replicas).

    Raises:
        ConfigError: for something that is not a ``torch.amp.GradScaler``; for a plain
            ``GradScaler`` on more than one rank (its overflow check sees this rank alone); for
            a scaler of another device type than the stages'; or for a ``ShardedGradScaler``
            whose process group is not the pipeline's ranks. Raised before any communication.
    """
    rank = dist.get_rank()
    fix = "pass pipe.grad_scaler() (a ShardedGradScaler over the pipeline's ranks), built the same way on every rank"
    if not isinstance(scaler, torch.amp.GradScaler):
        raise ConfigError(f"rank {rank}: train_step(grad_scaler=...) got {type(scaler).__name__}, "
                          f"not a gradient scaler; {fix}")
    if not isinstance(scaler, ShardedGradScaler) and num_ranks > 1:
        raise ConfigError(
            f"rank {rank}: train_step(grad_scaler=...) got a plain {type(scaler).__name__}, whose overflow check "
            f"sees only this rank's gradients, so the {num_ranks} ranks would not agree on skipping "
            f"optimizer.step() nor keep the same loss scale; {fix}")
    kind = getattr(scaler, "_device", device.type)
    if kind != device.type:
        raise ConfigError(f"rank {rank}: the grad_scaler is for device type {kind!r} but the stages run on "
                          f"{str(device)!r}; {fix}")
    group = getattr(scaler, "process_group", None)  # set on an enabled ShardedGradScaler only
    if isinstance(scaler, ShardedGradScaler) and scaler.is_enabled():
        size = dist.get_world_size(group)
        if size != num_ranks:
            raise ConfigError(
                f"rank {rank}: the ShardedGradScaler's process group has {size} rank(s) (-1: this rank is not in "
                f"it) but the pipeline and its replicas run on {num_ranks}; the overflow check must be reduced over all of "
                f"them: "
                f"{fix}")
    scaler.scale(torch.zeros((), device=device))  # creates the scale tensor where it is missing; a no-op otherwise


def scale_loss(scaler: torch.amp.GradScaler, loss: torch.Tensor) -> torch.Tensor:
    """``loss`` times the scaler's scale, in float32 and of ``loss``'s shape, as
    ``torch.amp.GradScaler.scale`` gives it in the unsplit model (``ShardedGradScaler.scale``
    would cast an fp16 loss back to fp16, where the scaled value can overflow)."""
    return scaler.scale(loss.float()).reshape(loss.shape)
