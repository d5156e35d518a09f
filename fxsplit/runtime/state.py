"""Original names for the parameters and buffers spread over the stages.

The stages own the tensors under the names the captured graph uses; a tied tensor has several
original names (``tok_emb.weight`` and ``lm_head.weight``) and may have a copy in several stages.
:class:`StateMap` answers in the original model's terms: ``named_parameters``, ``state_dict`` and
``load_state_dict`` with the original keys, in the original order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn

from fxsplit.codegen.place import get_state
from fxsplit.codegen.split import StagedProgram
from fxsplit.errors import ConfigError

__all__ = ["StateMap", "ParameterAPI", "check_loadable", "check_mode", "grad_norm"]


def check_loadable(pairs: Sequence[tuple[str, object, torch.Tensor]], where: str = "the pipeline") -> None:
    """Check every ``(key, value, target)`` before any is written, as ``nn.Module.load_state_dict``
    does: the value must be a tensor of the target's shape (``copy_`` would broadcast a ``[8]``
    or 0-d value into an ``[8, 8]`` weight without a word).

    Raises:
        ConfigError: listing every key whose value is not a tensor or has another shape, with
            both shapes.
    """
    bad = []
    for key, value, target in pairs:
        if not isinstance(value, torch.Tensor):
            bad.append(f"{key}: a {type(value).__name__}, not a tensor")
        elif tuple(value.shape) != tuple(target.shape):
            bad.append(f"{key}: shape {list(value.shape)} in the state dict, {list(target.shape)} in the model")
    if bad:
        raise ConfigError(
            f"cannot load {len(bad)} key(s) into {where}, nothing was loaded: " + "; ".join(bad[:8])
            + ("; ..." if len(bad) > 8 else "") + "; give each key a tensor of the model's shape"
        )


class StateMap:
    """Map original state names to the stage tensors that hold them.

    Args:
        program: The placed stages.
        aliases: Graph state name -> every original name of that tensor (``Captured.aliases``).
        param_order: Original ``named_parameters(remove_duplicate=False)`` names, in order.
        state_order: Original ``state_dict()`` keys, in order.
        orphans: Original state the graph never reads (kept, returned, loaded; never trained
            by the pipeline).
    """

    def __init__(
        self,
        program: StagedProgram,
        aliases: Mapping[str, Sequence[str]],
        param_order: Sequence[str],
        state_order: Sequence[str],
        orphans: Mapping[str, torch.Tensor],
    ) -> None:
        self.program = program
        self.orphans = dict(orphans)
        self.param_order, self.state_order = list(param_order), list(state_order)
        self.to_graph: dict[str, str] = {a: g for g, names in aliases.items() for a in names}
        self.copies: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for st in program.stages:
            for name in st.state:
                t = get_state(st.gm, name)
                held = self.copies.setdefault(name, [])
                if all(t is not other for _, other in held):
                    held.append((st.index, t))
        # named_parameters() walks names, aliases and copies; its answer never changes (loading
        # copies values in place), so it is worked out once, e.g. for zero_grad() every step.
        self._named: list[tuple[str, nn.Parameter]] | None = None

    def tensor(self, stage: int, name: str) -> torch.Tensor:
        """The tensor stage ``stage`` uses for graph state ``name``."""
        return get_state(self.program.stages[stage].gm, name)

    def _copies_of(self, original: str) -> list[torch.Tensor]:
        g = self.to_graph.get(original, original)
        if g in self.copies:
            return [t for _, t in self.copies[g]]
        return [self.orphans[original]] if original in self.orphans else []

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Original names and parameters; each copy once (copies take the next unused alias).

        A tied tensor copied to more stages than it has names yields its last name again for
        the extra copies: ``parameters()`` (for an optimizer) sees every copy, while
        ``dict(named_parameters())`` keeps one per name.
        """
        if self._named is None:
            self._named = list(self._walk_parameters())
        return iter(self._named)

    def _walk_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        seen: set[int] = set()
        last_name: dict[int, str] = {}
        for name in self.param_order:
            for t in self._copies_of(name):
                if isinstance(t, nn.Parameter) and id(t) not in seen:
                    seen.add(id(t))
                    yield name, t
                    break
            else:
                continue
            for t in self._copies_of(name):
                last_name[id(t)] = name
        for copies in self.copies.values():  # more copies than aliases
            for _, t in copies:
                if isinstance(t, nn.Parameter) and id(t) not in seen:
                    seen.add(id(t))
                    yield last_name.get(id(copies[0][1]), ""), t

    def state_dict(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name in self.state_order:
            copies = self._copies_of(name)
            if copies:
                out[name] = copies[0].detach()
        return out

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Copy values into every stage tensor (and tied copy) they name; all or nothing.

        Raises:
            ConfigError: with ``strict``, listing missing and unexpected keys; for any value that
                is not a tensor of its target's shape (:func:`check_loadable`), before any write.
        """
        expected = set(self.state_order)
        missing = sorted(expected - set(state_dict))
        unexpected = sorted(set(state_dict) - expected)
        if strict and (missing or unexpected):
            raise ConfigError(
                f"state dict does not match the model: missing keys {missing[:8]}, unexpected keys "
                f"{unexpected[:8]}; pass strict=False to load a subset"
            )
        writes = [(name, value, t) for name, value in state_dict.items() for t in self._copies_of(name)]
        check_loadable(writes)
        with torch.no_grad():
            for _name, value, t in writes:
                t.copy_(value.to(t.device))


def check_mode(captured: bool | None, mode: bool) -> None:
    """Refuse running a pipeline in another mode than its model was captured in: ``torch.export``
    records training or eval behaviour (dropout, BatchNorm) in the graph, so ``pipe.train()`` /
    ``pipe.eval()`` could not change it (the stages would keep the captured mode, silently).

    Raises:
        ConfigError: when ``mode`` differs from ``captured`` (None: not known, accepted).
    """
    if captured is not None and bool(mode) != captured:
        want, have = ("train", "eval") if mode else ("eval", "train")
        raise ConfigError(
            f"the pipeline was compiled from a model in {have} mode, and torch.export records the mode "
            f"in the graph; call model.{want}() and compile it again for {want} mode"
        )


def grad_norm(grad: torch.Tensor, norm_type: float) -> float:
    """The ``norm_type``-norm of one gradient, in float64 (as a number)."""
    return float(torch.linalg.vector_norm(grad.detach().to(torch.float64), norm_type))


class ParameterAPI:
    """``parameters()`` and ``zero_grad()`` derived from ``named_parameters()``; shared by the
    local and the distributed pipeline."""

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def buffer_values(self) -> dict[str, torch.Tensor]:
        """A copy of every :meth:`state_dict` entry that is no parameter (the buffers: BatchNorm's
        running statistics, counters, moving averages), for steps that must leave no trace:
        ``load_state_dict(values, strict=False)`` puts them back (calibrate's timed steps)."""
        params = {name for name, _ in self.named_parameters()}
        return {k: v.detach().clone() for k, v in self.state_dict().items() if k not in params}

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Scale the gradients so that their norm over the whole model is at most ``max_norm``,
        as ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)`` does on
        the unsplit model: each parameter counted once (a tied weight's copies, a stage's
        replicas and its tensor-parallel shards together once), every copy scaled by the same
        ``max_norm / (norm + 1e-6)`` when that is below 1. Call it after ``train_step`` and
        before the optimizer's step; on a distributed pipeline every rank calls it (collective).
        ``torch.nn.utils.clip_grad_norm_(pipe.parameters())`` instead would count a tied
        weight once per copy and, across processes, clip each rank by its own stages' norm.

        Returns:
            The norm of all the gradients before clipping (the same on every rank).

        Raises:
            ConfigError: for ``max_norm`` or ``norm_type`` not a positive number.
        """
        for label, value in (("max_norm", max_norm), ("norm_type", norm_type)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"clip_grad_norm_: {label}={value!r} must be a positive number (norm_type may be "
                                  "float('inf'))")
        if math.isinf(max_norm):
            raise ConfigError("clip_grad_norm_: max_norm=inf clips nothing; leave the call out")
        norms = list(self._grad_norms(float(norm_type)).values())
        total = (max(norms, default=0.0) if math.isinf(norm_type)
                 else sum(n**norm_type for n in norms) ** (1.0 / norm_type))
        scale = max_norm / (total + 1e-6)
        if scale < 1.0:
            seen: set[int] = set()
            for p in self.parameters():
                if p.grad is not None and id(p) not in seen:
                    seen.add(id(p))
                    p.grad.mul_(scale)
        return total

    def _grad_norms(self, norm_type: float) -> dict[str, float]:
        """``{tensor: norm of its gradient}``, each tensor of the model once (this process holds
        every stage)."""
        out: dict[str, float] = {}
        for name, p in self.named_parameters():
            key = self._tensor_key(name)
            if p.grad is not None and key not in out:
                out[key] = grad_norm(p.grad, norm_type)
        return out

    def _tensor_key(self, name: str) -> str:
        """One key per tensor of the model for ``name`` (aliases of a tied tensor share it)."""
        return name

    def _stash_grads(self) -> list[tuple[nn.Parameter, torch.Tensor | None]]:
        """Take every parameter's gradient away (``.grad = None``) for a step: the step's
        gradients then land in fresh tensors, so a step that fails part-way can be undone
        exactly by :meth:`_unstash_grads` (no copy of the gradients is made)."""
        saved, seen = [], set()
        for p in self.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                saved.append((p, p.grad))
                p.grad = None
        return saved

    @staticmethod
    def _unstash_grads(saved: list[tuple[nn.Parameter, torch.Tensor | None]], ok: bool) -> None:
        """After a step: add its gradients to the ones stashed (``ok``), or put the stashed ones
        back as they were (the step failed: no micro-batch's gradient is kept)."""
        for p, before in saved:
            if not ok:
                p.grad = before
            elif before is not None:
                if p.grad is not None:
                    before.add_(p.grad.to(before.device))
                p.grad = before

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

