"""Micro-batches: split flat inputs on the batch dimension and merge outputs back.

A tensor whose dim 0 equals the batch size is split with ``torch.tensor_split`` (sizes differ by
at most one, so an uneven last micro-batch is allowed); every other value (scalars, tensors
without the batch dimension) is given whole to every micro-batch.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fxsplit.errors import ConfigError

__all__ = ["batch_size_of", "check_splittable", "split_microbatches", "split_target", "target_batch_dim",
           "target_leaf_dims", "loss_weights", "merge_outputs", "microbatch_sizes",
           "loss_reduction", "LossReductions", "scalar_outputs", "scalar_reductions", "DrawsAsExpected"]


def batch_size_of(flat: Sequence[Any]) -> int:
    """Dim 0 of the first tensor with at least one dimension.

    Raises:
        ConfigError: when no input is a tensor with a batch dimension.
    """
    for x in flat:
        if isinstance(x, torch.Tensor) and x.dim() >= 1:
            return int(x.shape[0])
    raise ConfigError("no input is a tensor with a batch dimension; pipelining needs one to split on")


def microbatch_sizes(batch: int, m: int) -> list[int]:
    """Sizes of ``m`` micro-batches of a batch of ``batch`` (``tensor_split`` rule)."""
    return [batch // m + (1 if i < batch % m else 0) for i in range(m)]


def split_microbatches(
    flat: Sequence[Any], m: int, batch: int | None = None, batched: Sequence[bool | None] | None = None
) -> tuple[list[list[Any]], list[int]]:
    """Split flat inputs into ``m`` micro-batches.

    Args:
        flat: Flat model inputs; batched tensors have the batch on dim 0.
        m: Number of micro-batches.
        batch: The batch size (default: dim 0 of the first batched tensor of ``flat``); targets
            are split with the inputs' batch size.
        batched: Which values carry the batch (``Captured.batched_inputs``); default: every
            tensor whose dim 0 equals the batch size.

    Returns:
        ``([m][len(flat)] values, [m] sizes)``.

    Raises:
        ConfigError: when the batch is smaller than ``m``.
    """
    if batched is not None:
        sized = [x for x, b in zip(flat, batched, strict=True) if b]
        batch = batch if batch is not None else batch_size_of(sized)
        for x in sized:
            if x.shape[0] != batch:
                raise ConfigError(
                    f"a batched input has {x.shape[0]} samples on dim 0 where the others have {batch}; "
                    "give every batched input the same batch size"
                )
    batch = batch_size_of(flat) if batch is None else batch
    check_splittable(batch, m)
    if m == 1:  # the batch is the micro-batch: no views to make
        return [list(flat)], [batch]
    flags = _batched_flags(batched, flat, batch)
    return _split_rows(flat, m, [0 if split else None for split in flags]), microbatch_sizes(batch, m)


def check_splittable(batch: int, m: int) -> None:
    """Raise :class:`ConfigError` when a batch of ``batch`` samples has fewer than ``m``."""
    if batch < m:
        raise ConfigError(f"a batch of {batch} samples cannot be split into {m} micro-batches; "
                          f"use microbatches <= {batch}")


def _split_rows(values: Sequence[Any], m: int, dims: Sequence[int | None]) -> list[list[Any]]:
    """``[m][len(values)]``: each value cut into ``m`` parts on its batch dimension
    (``torch.tensor_split``), or given whole to every part where its dimension is None."""
    columns = [list(torch.tensor_split(x, m, dim=d)) if d is not None else [x] * m
               for x, d in zip(values, dims, strict=True)]
    return [list(row) for row in zip(*columns, strict=True)]


def target_batch_dim(leaf: Any, batch: int, target_dim: int = 0) -> int | None:
    """The batch dimension of a target leaf, or None for a leaf without the batch.

    ``target_dim`` (the first input's batch dimension, ``compile(batch_dim=...)``) when the leaf
    has it and its size there is ``batch``; else dim 0 when that is ``batch`` (a ``[batch]``
    label next to ``[seq, batch]`` inputs); else None (the leaf goes whole to every micro-batch).
    """
    if not isinstance(leaf, torch.Tensor):
        return None
    return next((d for d in dict.fromkeys((target_dim, 0)) if leaf.dim() > d and leaf.shape[d] == batch), None)


def target_leaf_dims(target: Any, batch: int, target_dim: int = 0) -> list[int | None]:
    """:func:`target_batch_dim` of each leaf of ``target`` (pytree order), for the whole batch of
    ``batch`` samples: the split of every micro-batch's target, which a micro-batch's own sizes
    cannot tell (a ``[2]`` leaf without the batch looks batched in micro-batches of 2)."""
    return [target_batch_dim(x, batch, target_dim) for x in pytree.tree_leaves(target)]


def _target_dims(target: Any, size: int, target_dim: int, dims: Sequence[int | None] | None) -> list[int | None]:
    return list(dims) if dims is not None else target_leaf_dims(target, size, target_dim)


def split_target(target: Any, m: int, batch: int, target_dim: int = 0) -> list[Any]:
    """``[m]`` targets: the leaves of ``target`` that carry the batch split like the inputs.

    Args:
        target: Any pytree (a tensor ``[batch, ...]``, a dict of them, None).
        m: Number of micro-batches.
        batch: The inputs' batch size: leaves with the batch (:func:`target_batch_dim`) are split.
        target_dim: Where the batch is in a target leaf, when it has that dimension.

    Example:
        >>> [t.tolist() for t in split_target(torch.arange(4), 2, 4)]
        [[0, 1], [2, 3]]
        >>> [t.tolist() for t in split_target(torch.arange(4).view(1, 4), 2, 4, target_dim=1)]
        [[[0, 1]], [[2, 3]]]
    """
    if m == 1 or target is None:
        return [target] * m
    leaves, spec = pytree.tree_flatten(target)
    if not leaves:
        return [target] * m
    check_splittable(batch, m)
    rows = _split_rows(leaves, m, target_leaf_dims(target, batch, target_dim))
    return [pytree.tree_unflatten(row, spec) for row in rows]


def loss_weights(sizes: Sequence[int]) -> list[float]:
    """Each micro-batch's share of the batch, the weight of its (mean-reduced) loss."""
    total = sum(sizes)
    return [n / total for n in sizes]


def loss_reduction(
    loss_fn: Any, flat_outputs: Sequence[Any], batched: Sequence[bool | None] | None, unflatten: Any, target: Any, size: int,
    target_dim: int = 0, target_dims: Sequence[int | None] | None = None,
) -> str:
    """How ``loss_fn`` reduces over the batch, tried on one micro-batch of ``size`` samples.

    A pipeline adds the micro-batches' losses with weights: each micro-batch's share of the
    batch for a mean (the contract), 1 for a sum. The loss of the micro-batch is compared with
    the loss of the micro-batch given twice (every batched output and target leaf concatenated
    with itself): equal for a mean, twice for a sum; anything else is a loss that mixes samples
    (a contrastive or batch-normalised loss), which micro-batching changes.

    Args:
        loss_fn: ``loss_fn(output, target) -> scalar``.
        flat_outputs: The model's flat outputs on the micro-batch (detached here).
        batched: Which flat outputs carry the batch (None: those whose dim 0 is ``size``).
        unflatten: Flat outputs -> the output structure ``loss_fn`` takes.
        target: The micro-batch's target (leaves carry the batch as :func:`target_batch_dim` says).
        size: The micro-batch's size.
        target_dim: Where the batch is in a target leaf that has that dimension.
        target_dims: Each target leaf's batch dimension as the whole batch's split gave it
            (:func:`target_leaf_dims`); None: judged on the micro-batch's ``size``.

    Returns:
        ``"mean"``, ``"sum"``, or ``"unknown"`` when the loss is 0 (nothing to tell apart; run
        as a mean, the contract).

    Raises:
        ConfigError: for a loss that is neither, naming both values.
    """
    flags = _batched_flags(batched, flat_outputs, size)

    def twice(x: Any, dim: int | None) -> Any:
        return torch.cat([x, x], dim=dim) if dim is not None and isinstance(x, torch.Tensor) else x

    with torch.no_grad():
        # in float32: under mixed precision a bf16 mean of a doubled batch rounds differently
        outs = [(x.detach().float() if x.is_floating_point() else x.detach()) if isinstance(x, torch.Tensor) else x
                for x in flat_outputs]
        one = loss_fn(unflatten(outs), target)
        leaves, spec = pytree.tree_flatten(target)
        dims = _target_dims(target, size, target_dim, target_dims)
        doubled_target = pytree.tree_unflatten([twice(t, d) for t, d in zip(leaves, dims, strict=True)], spec)
        two = loss_fn(unflatten([twice(x, 0 if b else None) for x, b in zip(outs, flags, strict=True)]), doubled_target)
    one_f, two_f = float(one), float(two)
    tol = 1e-4 * abs(one_f) + 1e-12
    if one_f == 0.0:
        return "unknown"
    if abs(two_f - one_f) <= tol:
        return "mean"
    if abs(two_f - 2 * one_f) <= 2 * tol:
        return "sum"
    raise ConfigError(
        f"loss_fn is neither a mean nor a sum over the batch: on a micro-batch of {size} samples it gives {one_f:.6g}, "
        f"on the same samples twice {two_f:.6g} (a mean gives the same, a sum twice); a loss that mixes samples "
        "changes when the batch is split: use microbatches=1, or make the loss a per-sample mean"
    )


def check_loss_pair(
    loss_fn: Any, outputs: Sequence[Sequence[Any]], targets: Sequence[Any], sizes: Sequence[int], kind: str,
    batched: Sequence[bool | None] | None, unflatten: Any, target_dim: int = 0, joint: Sequence[Any] | None = None,
    first: int = 0, losses: Sequence[float] | None = None, target_dims: Sequence[int | None] | None = None,
) -> None:
    """Check that the loss of consecutive micro-batches together is what the pipeline adds up
    from their losses: ``sum(n_i L_i) / sum(n_i)`` for a mean, ``sum(L_i)`` for a sum.

    :func:`loss_reduction` tells a mean from a sum on one micro-batch given twice; a loss
    normalised by a count that varies between micro-batches (a token mean that skips padding:
    ``cross_entropy(..., ignore_index=-100)`` with uneven padding, a Hugging Face model's own
    ``loss``) passes that test and still gives another batch loss and other gradients when the
    micro-batches are weighted by their samples. The runtimes run it on every two consecutive
    micro-batches of a step (a pair passes only when both have the same count per sample, or the
    same loss: so all pairs passing means the whole batch does), or on all of them at once.

    Args:
        loss_fn: ``loss_fn(output, target) -> scalar``.
        outputs: ``[k]`` the micro-batches' flat outputs (detached here; the losses are
            computed again from them in float32, so that mixed precision cannot hide or fake a
            difference).
        targets: ``[k]`` their targets.
        sizes: ``[k]`` their samples.
        kind: ``"mean"`` or ``"sum"`` (:func:`loss_reduction`).
        batched, unflatten, target_dim, target_dims: As :func:`loss_reduction`.
        joint: The model's flat outputs on the ``k`` micro-batches run together, when the caller
            ran them (the local runtime does for a model with 0-d outputs: a model's own loss is
            not the concatenation of anything). None: the outputs are joined, batched ones
            concatenated, the others taken from the first when all have the same value.
        first: The index of the first of them in the step, for the message.
        losses: ``[k]`` their losses as the step computed them, when it did so in float32
            without autocast (the values the check would compute again); None: computed here.

    Raises:
        ConfigError: naming the values and the fix when they differ by more than rounding; and
            without ``joint``, for an output without the batch that differs between them (a 0-d
            loss the model computes itself), whose value on all of them cannot be known here.
    """
    flags = _batched_flags(batched, outputs[0], sizes[0])
    which = (f"micro-batches {first} and {first + 1}" if len(outputs) == 2
             else f"micro-batches {first}..{first + len(outputs) - 1}")
    if joint is None:
        for j, f in enumerate(flags):
            differs = next((x[j] for x in outputs[1:] if not _same_value(outputs[0][j], x[j])), None)
            if not f and differs is not None:
                raise ConfigError(
                    f"output {j} of the model has no batch dimension and differs between {which} "
                    f"({_describe(outputs[0][j])}: {_brief(outputs[0][j])} and {_brief(differs)}; the model's own "
                    "loss?), so its value on the batch is not what the pipeline can add up from its micro-batches, and "
                    "loss_fn reads the outputs. Compute the loss in loss_fn from per-sample outputs (e.g. the logits), "
                    "or run with microbatches=1")

    def as_float(values: Sequence[Any]) -> list[Any]:
        return [(x.detach().float() if x.is_floating_point() else x.detach()) if isinstance(x, torch.Tensor) else x
                for x in values]

    with torch.no_grad():
        outs = [as_float(mb) for mb in outputs]
        if joint is None:
            both = [torch.cat([mb[j].to(outs[0][j].device) for mb in outs]) if f and isinstance(outs[0][j], torch.Tensor)
                    else outs[0][j] for j, f in enumerate(flags)]
        else:
            both = as_float(joint)
        leaves = [pytree.tree_flatten(t)[0] for t in targets]
        spec = pytree.tree_flatten(targets[0])[1]
        dims = _target_dims(targets[0], sizes[0], target_dim, target_dims)
        target = pytree.tree_unflatten(
            [torch.cat([lv[i].to(leaves[0][i].device) for lv in leaves], dim=d) if d is not None else leaves[0][i]
             for i, d in enumerate(dims)], spec)
        got = float(loss_fn(unflatten(both), target))
        if losses is None:
            losses = [float(loss_fn(unflatten(mb), t)) for mb, t in zip(outs, targets, strict=True)]
    mean, added, shown = _by_samples(losses, sizes)
    expected = mean if kind == "mean" else added
    if abs(got - expected) > 1e-5 * max(abs(got), abs(expected)) + 1e-9:
        raise ConfigError(
            f"loss_fn over {which} together gives {got:.6g}, but the pipeline would count "
            f"{expected:.6g} ({'their losses weighted by samples' if kind == 'mean' else 'their sum'}: "
            f"{shown}): the loss is normalised by something "
            "other than the samples (e.g. the tokens that cross_entropy does not ignore, or a model's own token-mean "
            "loss), so the micro-batched step would train on another loss. Make it a per-sample mean or a sum "
            "(e.g. the token sum divided by a fixed count), or run with microbatches=1")


class LossReductions:
    """:func:`loss_reduction` of each ``loss_fn`` a pipeline was given, found once per function
    (kept by weak reference; a callable that cannot be weakly referenced is tried every step).
    Raises as :func:`loss_reduction` does."""

    def __init__(self) -> None:
        self._known: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()

    def of(self, loss_fn: Any, flat_outputs: Sequence[Any], batched: Sequence[bool | None] | None, unflatten: Any,
           target: Any, size: int, target_dim: int = 0, target_dims: Sequence[int | None] | None = None) -> str:
        try:
            known = self._known.get(loss_fn)
        except TypeError:
            known = None
        if known is not None:
            return known
        kind = loss_reduction(loss_fn, flat_outputs, batched, unflatten, target, size, target_dim, target_dims)
        if kind != "unknown":
            with contextlib.suppress(TypeError):
                self._known[loss_fn] = kind
        return kind


def _looks_batched(x: Any, batch: int) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == batch


def _batched_flags(batched: Sequence[bool | None] | None, values: Sequence[Any], size: int) -> list[bool]:
    """Which ``values`` carry the batch on dim 0: as ``batched`` says (the capture's symbolic
    batch, or False for a value no input reaches), by shape (dim 0 equal to ``size``) where it
    says None or nothing."""
    known = list(batched) if batched is not None else [None] * len(values)
    return [b if b is not None else _looks_batched(x, size) for b, x in zip(known, values, strict=True)]


def merge_outputs(per_mb: Sequence[Sequence[Any]], sizes: Sequence[int], batched: Sequence[bool | None] | None = None,
                  reductions: Mapping[int, str] | None = None, given: Mapping[int, Any] | None = None) -> list[Any]:
    """Merge flat outputs of the micro-batches into flat outputs of the batch.

    Batched outputs (``batched``; where it says None or nothing: tensors whose dim 0 is each
    micro-batch's size) are concatenated; a 0-d tensor (a loss the model computes itself) is merged as ``reductions``
    says (:func:`scalar_reductions`, found by running two micro-batches together): ``"mean"``
    weights the micro-batches by their samples, ``"sum"`` adds them; anything else must be the
    same in every micro-batch (a value that does not depend on the batch) and is taken from
    the first. ``given``: output index -> the batch's value, known without the micro-batches (a
    number computed from the inputs' sizes:
    :meth:`~fxsplit.passes.capture.Captured.size_output_values`).

    Raises:
        ConfigError: for an output that differs between micro-batches but is none of these: its
            dim 0 is not the batch (``logits.flatten(0, 1)`` of shape ``[batch * seq, vocab]``:
            fxsplit cannot tell how its rows interleave the samples), or it is 0-d and
            ``reductions`` does not say how it adds up (a token mean over padding is not the
            samples' mean). Taking one micro-batch's would silently return another answer than
            the model's.
    """
    if len(per_mb) == 1:  # one micro-batch: its outputs are the batch's
        return list(per_mb[0])
    total = sum(sizes)
    merged = []
    for j in range(len(per_mb[0])):
        if given and j in given:
            merged.append(given[j])
            continue
        vals = [outs[j] for outs in per_mb]
        first = vals[0]
        known = batched[j] if batched is not None else None
        cat = known if known is not None else all(_looks_batched(v, n) for v, n in zip(vals, sizes, strict=True))
        rule = (reductions or {}).get(j)
        if cat and isinstance(first, torch.Tensor):
            merged.append(torch.cat([v.to(first.device) for v in vals], dim=0))
        elif rule == "mean":
            merged.append(sum(v.to(first.device) * (n / total) for v, n in zip(vals, sizes, strict=True)))
        elif rule == "sum":
            merged.append(sum(v.to(first.device) for v in vals))
        else:
            for i, v in enumerate(vals[1:], start=1):
                if not _same_value(first, v):
                    zero_d = isinstance(first, torch.Tensor) and first.dim() == 0
                    raise ConfigError(
                        f"output {j} of the model differs between micro-batches ({_describe(first)} in micro-batch 0, "
                        f"{_describe(v)} in micro-batch {i}) but " + (
                            "it is 0-d and this runtime cannot run micro-batches together to see how it adds up (a "
                            "mean over samples, a sum, or a token mean over padding, which no weighting of the "
                            "micro-batches gives). Compute it outside the model from per-sample outputs (a loss in "
                            "loss_fn), or run with microbatches=1" if zero_d else
                            "its dim 0 is not the batch, so the pipeline cannot merge it into the batch's output "
                            "(taking one micro-batch's would return another answer than the model's). Return it with "
                            "the batch on dim 0 (e.g. logits [batch, seq, vocab] rather than flattened to [batch * "
                            "seq, vocab]), or run with microbatches=1"))
            merged.append(first)
    return merged


def scalar_outputs(flat_outputs: Sequence[Any]) -> list[int]:
    """Indices of the 0-d tensors among a micro-batch's flat outputs (a loss or count the model
    computes itself), whose value on the batch :func:`scalar_reductions` must find."""
    return [j for j, x in enumerate(flat_outputs) if isinstance(x, torch.Tensor) and x.dim() == 0]


def scalar_reductions(parts: Sequence[Sequence[Any]], joint: Sequence[Any], sizes: Sequence[int],
                      indices: Sequence[int]) -> dict[int, str]:
    """How each 0-d output adds up over micro-batches, from the micro-batches run apart and
    together: ``"mean"`` when the joint value is the parts' mean weighted by samples (a
    per-sample mean loss; also a value that does not depend on the batch), else ``"sum"`` when
    it is their sum (a count, a token sum over a fixed normaliser).

    Args:
        parts: ``[k][outputs]`` the micro-batches' flat outputs.
        joint: ``[outputs]`` the flat outputs of all ``k`` run as one micro-batch.
        sizes: ``[k]`` their samples.
        indices: The 0-d outputs to classify (:func:`scalar_outputs`).

    Returns:
        ``{index: "mean" | "sum"}``. Floating values agree to a relative ``1e-5`` (``4 eps`` of
        a narrower dtype), others exactly.

    Raises:
        ConfigError: for an output that is neither (a token mean that skips padding, whose
            micro-batches count different tokens), naming the values and the fix.
    """
    rules = {}
    for j in indices:
        values = [float(x[j].detach()) for x in parts]  # (0-d tensors: scalar_outputs)
        got = float(joint[j].detach())
        dtype = joint[j].dtype
        rtol = max(1e-5, 4 * torch.finfo(dtype).eps) if dtype.is_floating_point else 0.0
        mean, added, shown = _by_samples(values, sizes)

        def close(x: float, got: float = got, rtol: float = rtol) -> bool:
            return abs(got - x) <= rtol * max(abs(got), abs(x)) + (1e-12 if rtol else 0.0)

        if close(mean) and dtype != torch.bool:
            rules[j] = "mean"
        elif close(added) and dtype != torch.bool:
            rules[j] = "sum"
        elif all(v == got for v in values):
            rules[j] = "same"
        else:
            raise ConfigError(
                f"output {j} of the model is 0-d and neither the mean nor the sum of its micro-batches' values: "
                f"{shown} apart, {got:.6g} all together (mean by samples "
                f"{mean:.6g}, sum {added:.6g}). It is normalised by something other than the samples (e.g. a model's "
                "own token-mean loss over uneven padding), so no weighting of the micro-batches gives the model's "
                "value. Compute the loss in loss_fn from per-sample outputs, normalised by the samples or a fixed "
                "count, or run with microbatches=1")
    return rules


class DrawsAsExpected(TorchDispatchMode):
    """Run code without drawing random numbers: a Bernoulli draw (dropout's mask, also inside
    attention with ``dropout_p > 0`` on the CPU) gives its probability, its expectation, so
    dropout computes what it computes in evaluation; ``native_dropout`` passes its input through
    and fused attention kernels run with ``dropout_p=0``. Used
    where one computation is compared with another and a draw would make them differ
    (:func:`scalar_reductions`' joint run).

    Raises:
        ConfigError: for any other op that draws random numbers (``rand``, ``normal_``...),
            naming it: its draws cannot be matched between two runs of different batch sizes.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        if func in (aten.bernoulli_.float, aten.bernoulli_.Tensor):
            self_, p = args[0], args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            return self_.copy_(p) if isinstance(p, torch.Tensor) else self_.fill_(p)
        if func is aten.bernoulli.p:
            return torch.full_like(args[0], args[1] if len(args) > 1 else kwargs.get("p", 0.5))
        if func is aten.bernoulli.default:
            return args[0].clone()
        if func is aten.native_dropout.default:
            x = args[0]
            return x.clone(), torch.ones_like(x, dtype=torch.bool)
        names = [a.name for a in func._schema.arguments]
        if "dropout_p" in names:  # attention's fused kernels: dropout off is its expectation
            at = names.index("dropout_p")
            if at < len(args):
                args = (*args[:at], 0.0, *args[at + 1:])
            else:
                kwargs = {**kwargs, "dropout_p": 0.0}
            return func(*args, **kwargs)
        raise ConfigError(
            f"{func} draws random numbers in a run that must match another without them (two micro-batches run "
            "together to find how a 0-d output adds up): its draws cannot be matched. Return per-sample outputs "
            "and reduce them in loss_fn, or run with microbatches=1")


def _same_value(a: Any, b: Any) -> bool:
    """Whether two micro-batches' values of one output are the same value."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and torch.equal(a.detach().cpu(), b.detach().cpu()))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value whose == is not a truth value: not provably the same
        return a is b


def _by_samples(values: Sequence[float], sizes: Sequence[int]) -> tuple[float, float, str]:
    """The micro-batches' ``values`` weighted by their samples ``sizes``, their sum, and the first
    four as text for a message."""
    pairs = list(zip(values, sizes, strict=True))
    shown = ", ".join(f"{v:.6g} on {n} samples" for v, n in pairs[:4]) + (", ..." if len(pairs) > 4 else "")
    return sum(n * v for v, n in pairs) / sum(sizes), sum(values), shown


def _brief(value: Any) -> str:
    """A value for an error message: a number's digits, else its description."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return f"{float(value):.6g}"
    return _describe(value)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"
