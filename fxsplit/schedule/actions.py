"""Pipeline schedules as data: actions like ``"0F1"`` and per-rank action lists (torch-free).

A :class:`Schedule` says, for each rank (a pipeline device), the order in which it runs its
actions. It says nothing about time: the simulator (:func:`fxsplit.schedule.simulate`) derives
when each action runs from the order, the dependencies and the stage costs.

Text form (:meth:`Schedule.to_text`), one column per rank, one row per position in the lists; ``.``
is an empty cell (a rank with fewer actions) and ``#`` starts a comment::

    schedule gpipe: stages=2 microbatches=2 stage_to_rank=0,1
    step  rank0  rank1
       0  0F0    1F0
       1  0F1    1F1
       2  0B0    1B0
       3  0B1    1B1

References:
    The action text follows ``torch.distributed.pipelining`` (``_Action``, ``_format_pipeline_order``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from fxsplit.errors import ScheduleError

__all__ = ["F", "B", "I", "W", "KINDS", "Action", "Schedule", "parse_actions", "format_actions"]

F = "F"
B = "B"
I = "I"  # noqa: E741 (torch's name for the action kind)
W = "W"
#: Known action kinds and what they compute. A zero-bubble schedule splits each backward ``B``
#: into ``I`` (the gradient of the stage's inputs, which the previous stage waits for) and ``W``
#: (the gradients of its parameters, which nobody waits for and can fill a bubble); Qi et al.,
#: "Zero Bubble Pipeline Parallelism", ICLR 2024. Dependencies: :func:`engine.dependencies`.
KINDS: Mapping[str, str] = {F: "forward", B: "backward (input and weight gradients)",
                            I: "backward, input gradients only", W: "backward, weight gradients only"}

_ACTION_RE = re.compile(r"^(\d+)([A-Z]+)(\d+)$")
_HEADER_RE = re.compile(
    r"^schedule (?P<name>\S+): stages=(?P<p>\d+) microbatches=(?P<m>\d+) stage_to_rank=(?P<map>[\d,]+)$"
)
EMPTY = "."


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work: stage ``stage`` runs ``kind`` on micro-batch ``microbatch``.

    Args:
        stage: Pipeline stage, ``0 <= stage < num_stages``.
        kind: A key of :data:`KINDS` (``"F"`` forward, ``"B"`` backward).
        microbatch: Micro-batch index, ``0 <= microbatch < microbatches``.

    Raises:
        ScheduleError: for a negative index or an unknown kind.

    Example:
        >>> a = Action.parse("2B0")
        >>> a.stage, a.kind, a.microbatch, str(a)
        (2, 'B', 0, '2B0')
    """

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ScheduleError(f"unknown action kind {self.kind!r}; known kinds: {', '.join(KINDS)}")
        if self.stage < 0 or self.microbatch < 0:
            raise ScheduleError(f"action {self.stage}{self.kind}{self.microbatch}: indices must be >= 0")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """The action written as ``text`` (``"0F1"``: stage 0, forward, micro-batch 1).

        Raises:
            ScheduleError: when ``text`` is not ``<stage><kind><microbatch>``.
        """
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ScheduleError(
                f"cannot parse action {text!r}; write <stage><kind><microbatch>, e.g. '0F1' or '2B0'"
            )
        return cls(int(match.group(1)), match.group(2), int(match.group(3)))


def parse_actions(text: str) -> tuple[Action, ...]:
    """Actions from whitespace-separated text (``"0F0 0F1 0B0"``).

    Example:
        >>> format_actions(parse_actions("0F0 0F1  0B0"))
        '0F0 0F1 0B0'
    """
    return tuple(Action.parse(tok) for tok in text.split())


def format_actions(actions: Sequence[Action]) -> str:
    """The inverse of :func:`parse_actions`."""
    return " ".join(str(a) for a in actions)


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered action lists of one training step.

    Args:
        actions: ``[num_ranks][*]`` actions each rank runs, in order.
        num_stages: Number of pipeline stages ``p``.
        microbatches: Number of micro-batches ``m``.
        stage_to_rank: ``[num_stages]`` rank that runs each stage; default stage ``s`` on rank ``s``.
            Several stages may share a rank (interleaved schedules).
        name: The generator's name (``"gpipe"``, ``"1f1b"``) or ``"custom"``.

    Raises:
        ScheduleError: when ``stage_to_rank`` has the wrong length or names a missing rank.
            Deeper checks are :func:`fxsplit.schedule.validate`'s.
    """

    actions: tuple[tuple[Action, ...], ...]
    num_stages: int
    microbatches: int
    stage_to_rank: tuple[int, ...] = ()
    name: str = "custom"

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", tuple(tuple(r) for r in self.actions))
        mapping = tuple(self.stage_to_rank) or tuple(range(self.num_stages))
        object.__setattr__(self, "stage_to_rank", mapping)
        if len(mapping) != self.num_stages:
            raise ScheduleError(
                f"stage_to_rank has {len(mapping)} entries for {self.num_stages} stages; give one rank per stage"
            )
        if any(not 0 <= r < len(self.actions) for r in mapping):
            raise ScheduleError(
                f"stage_to_rank={list(mapping)} names a rank outside 0..{len(self.actions) - 1}; "
                "give one action list per rank"
            )
        if not self.name or any(c.isspace() for c in self.name):
            raise ScheduleError(f"schedule name {self.name!r} must be one word")

    @property
    def num_ranks(self) -> int:
        """Number of ranks (pipeline devices)."""
        return len(self.actions)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """Stages that ``rank`` runs, in increasing order."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def __iter__(self) -> Iterator[tuple[int, int, Action]]:
        """Yield ``(rank, step, action)`` for every action."""
        for rank, acts in enumerate(self.actions):
            for step, action in enumerate(acts):
                yield rank, step, action

    def __str__(self) -> str:
        return self.to_text()

    # -- text ------------------------------------------------------------------------------
    def header(self) -> str:
        """The first line of :meth:`to_text`."""
        mapping = ",".join(str(r) for r in self.stage_to_rank)
        return (
            f"schedule {self.name}: stages={self.num_stages} microbatches={self.microbatches} "
            f"stage_to_rank={mapping}"
        )

    def to_text(self, marks: Mapping[tuple[int, int], str] | None = None) -> str:
        """A table with one column per rank and one row per step (position in the lists).

        Args:
            marks: Notes keyed by ``(rank, step)``, written as ``# <-- rank r: note`` at the end
                of that row (the validator marks failing steps this way). The result still
                parses with :meth:`from_text`.

        Returns:
            The table, lines without trailing spaces, ending with a newline.
        """
        marks = dict(marks or {})
        steps = max((len(a) for a in self.actions), default=0)
        steps = max([steps, *(s + 1 for _, s in marks)])
        cols = [f"rank{r}" for r in range(self.num_ranks)]
        cells = [
            [str(a[i]) if i < len(a) else EMPTY for a in self.actions] for i in range(steps)
        ]
        widths = [max([len(c), *(len(row[r]) for row in cells)]) for r, c in enumerate(cols)]
        sw = max(4, len(str(steps - 1)))
        lines = [self.header(), "  ".join(["step".rjust(sw), *(c.ljust(w) for c, w in zip(cols, widths, strict=True))])]
        for i, row in enumerate(cells):
            line = "  ".join([str(i).rjust(sw), *(c.ljust(w) for c, w in zip(row, widths, strict=True))]).rstrip()
            notes = [f"rank {r}: {marks[(r, i)]}" for r in range(self.num_ranks) if (r, i) in marks]
            if notes:
                line += "    # <-- " + "; ".join(notes)
            lines.append(line)
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        """Parse :meth:`to_text`'s table (comments after ``#`` and blank lines are ignored).

        Raises:
            ScheduleError: naming the line that does not fit the format.
        """
        lines = [ln.split("#", 1)[0].rstrip() for ln in text.splitlines()]
        numbered = [(i + 1, ln) for i, ln in enumerate(lines) if ln.strip()]
        if len(numbered) < 2:
            raise ScheduleError("schedule text needs a header line and a 'step rank0 ...' line")
        (_, head), (_, cols_line), rows = numbered[0], numbered[1], numbered[2:]
        match = _HEADER_RE.match(head.strip())
        if match is None:
            raise ScheduleError(
                f"line 1 {head!r} is not a schedule header; expected e.g. "
                "'schedule gpipe: stages=2 microbatches=4 stage_to_rank=0,1'"
            )
        cols = cols_line.split()
        if cols[:1] != ["step"] or cols[1:] != [f"rank{r}" for r in range(len(cols) - 1)]:
            raise ScheduleError(f"column line {cols_line!r} must read 'step rank0 rank1 ...'")
        actions: list[list[Action]] = [[] for _ in cols[1:]]
        for step, (lineno, row) in enumerate(rows):
            toks = row.split()
            if len(toks) != len(cols) or toks[0] != str(step):
                raise ScheduleError(
                    f"line {lineno} {row!r}: expected step {step} and {len(cols) - 1} cells ('.' when empty)"
                )
            for r, tok in enumerate(toks[1:]):
                if tok == EMPTY:
                    continue
                if len(actions[r]) != step:
                    raise ScheduleError(f"line {lineno}: rank {r} has an action after an empty cell")
                actions[r].append(Action.parse(tok))
        return cls(
            actions=tuple(tuple(a) for a in actions),
            num_stages=int(match["p"]),
            microbatches=int(match["m"]),
            stage_to_rank=tuple(int(x) for x in match["map"].split(",")),
            name=match["name"],
        )
