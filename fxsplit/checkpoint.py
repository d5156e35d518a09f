"""Distributed checkpoints: an atomic on-disk layout, and one ordinary state dict from the shards.

:meth:`fxsplit.runtime.distributed.DistributedPipeline.save` writes each save into a fresh folder
``ckpt-NNNNNN`` of the checkpoint directory: ``plan.json`` (the plan, the original ``state_dict``
key order, and which shard holds which keys) and one ``stage{i:03d}.pt`` per stage with original
keys, every file written to a temporary name, flushed to disk (``fsync``) and renamed. Once every
rank's shard is on disk, rank 0 writes the folder's ``COMPLETE`` marker and then points
``LATEST`` at it (again temporary name, fsync, rename), so a save interrupted at any point (a
killed rank, a full disk) leaves the previous checkpoint whole and loadable: loading
(:func:`resolve`) takes the folder ``LATEST`` names when it is complete, else the newest complete
one, and logs which. A folder with ``plan.json`` at the top (the layout before this one) still
loads. :func:`consolidate` returns the state dict the unsplit model loads with
``model.load_state_dict(sd)``; a tied tensor saved by several stages is taken from the first and
checked equal in the others. Shard names read from ``plan.json`` must be plain
``stage{i:03d}.pt`` names in that folder.

Command line::

    python -m fxsplit.checkpoint CKPT_DIR model.pt
    python scripts/consolidate_checkpoint.py CKPT_DIR model.pt
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from typing import IO, Any

import torch

from fxsplit.errors import ConfigError

__all__ = ["consolidate", "main", "resolve", "next_version", "write_atomic", "commit", "shard_path", "shard_name",
           "read_index", "load_shard", "LATEST_FILE", "COMPLETE_FILE", "PLAN_FILE"]

log = logging.getLogger(__name__)

LATEST_FILE = "LATEST"
COMPLETE_FILE = "COMPLETE"
PLAN_FILE = "plan.json"
_VERSION = re.compile(r"^ckpt-(\d{6})$")
_SHARD = re.compile(r"^stage\d{3}\.pt$")


def _versions(directory: str) -> list[str]:
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sorted(n for n in names if _VERSION.match(n) and os.path.isdir(os.path.join(directory, n)))


def shard_name(stage: int) -> str:
    """File name of stage ``stage``'s state dict in a checkpoint folder."""
    return f"stage{stage:03d}.pt"


def _complete(directory: str, versions: list[str]) -> list[str]:
    """The ``versions`` whose save finished (their ``COMPLETE`` marker is written)."""
    return [v for v in versions if os.path.exists(os.path.join(directory, v, COMPLETE_FILE))]


def next_version(directory: str | os.PathLike[str]) -> str:
    """The folder name of the next save under ``directory`` (``ckpt-000001`` for the first)."""
    versions = _versions(str(directory))
    last = int(_VERSION.match(versions[-1]).group(1)) if versions else 0  # type: ignore[union-attr]
    return f"ckpt-{last + 1:06d}"


def resolve(directory: str | os.PathLike[str]) -> tuple[str, str]:
    """The folder of the checkpoint to load under ``directory``, and a line saying which.

    ``LATEST``'s folder when it is complete; else the newest complete ``ckpt-*`` folder (an
    interrupted save); else ``directory`` itself when it holds ``plan.json`` (older layout).

    Raises:
        ConfigError: when ``directory`` holds no complete checkpoint.
    """
    directory = str(directory)
    found = _versions(directory)
    complete = _complete(directory, found)
    latest_path = os.path.join(directory, LATEST_FILE)
    latest = open(latest_path).read().strip() if os.path.exists(latest_path) else None
    if latest is not None and latest in complete:
        return os.path.join(directory, latest), f"checkpoint {latest} (LATEST)"
    if complete:
        note = f"LATEST names {latest!r}, which is not complete (an interrupted save)" if latest else "no LATEST marker"
        log.warning("%s in %s; loading the newest complete checkpoint, %s", note, directory, complete[-1])
        return os.path.join(directory, complete[-1]), f"checkpoint {complete[-1]} (newest complete; {note})"
    own = os.path.basename(os.path.normpath(directory))
    if os.path.exists(os.path.join(directory, COMPLETE_FILE)):  # a complete save folder given itself
        return directory, f"checkpoint {own}"
    if os.path.exists(os.path.join(directory, PLAN_FILE)) and not _VERSION.match(own):
        return directory, f"checkpoint {directory} (single-folder layout)"
    raise ConfigError(
        f"{directory} holds no complete checkpoint ({len(found)} unfinished save folder(s): {found[:4]}; "
        "no plan.json): pass a directory written by pipe.save(dir) whose save finished on every rank"
    )


def shard_path(folder: str, shard: str) -> str:
    """``folder/shard`` for a shard name read from ``plan.json``.

    Raises:
        ConfigError: for a name other than ``stage{i:03d}.pt`` (``../outside/x.pt`` would read
            a file outside the checkpoint).
    """
    if not isinstance(shard, str) or not _SHARD.match(shard):
        raise ConfigError(f"plan.json in {folder} names shard {shard!r}; shards are 'stage000.pt', 'stage001.pt', ... "
                          "in the checkpoint folder: the file was edited or is not an fxsplit checkpoint")
    return os.path.join(folder, shard)


def write_atomic(path: str, write: Callable[[IO[bytes]], Any]) -> None:
    """Write ``path`` all or nothing: ``write(f)`` into a temporary file beside it, ``fsync``,
    rename over ``path``, ``fsync`` the folder. A crash leaves the old file or the new one."""
    folder = os.path.dirname(path) or "."
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    _fsync_dir(folder)


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(directory: str, version: str, keep: int = 2) -> None:
    """Rank 0, once every shard of ``version`` is on disk: mark it complete, point ``LATEST`` at
    it, and remove the complete checkpoints older than the newest ``keep``."""
    folder = os.path.join(directory, version)
    write_atomic(os.path.join(folder, COMPLETE_FILE), lambda f: f.write(b"ok\n"))
    write_atomic(os.path.join(directory, LATEST_FILE), lambda f: f.write(version.encode() + b"\n"))
    complete = _complete(directory, _versions(directory))
    for old in complete[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(directory, old), ignore_errors=True)
    log.info("checkpoint %s committed in %s", version, directory)


def read_index(directory: str | os.PathLike[str]) -> tuple[str, dict[str, Any], dict[str, str]]:
    """The checkpoint to load under ``directory`` (:func:`resolve`): the line saying which, its
    ``plan.json``, and the path of every shard it names (each name checked: :func:`shard_path`).

    Raises:
        ConfigError: as :func:`resolve` and :func:`shard_path`.
    """
    folder, which = resolve(directory)
    log.info("reading %s", which)
    with open(os.path.join(folder, PLAN_FILE)) as f:
        index = json.load(f)
    return which, index, {shard: shard_path(folder, shard) for shard in index["shards"]}


def load_shard(path: str, which: str, *, mmap: bool = False) -> dict[str, torch.Tensor]:
    """One shard's state dict (``weights_only``), on the CPU.

    Raises:
        ConfigError: for a missing, truncated or unreadable shard, naming it.
    """
    if not os.path.exists(path):
        raise ConfigError(f"shard {path} listed in plan.json of {which} is missing; was every rank's save() finished?")
    try:
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except Exception as exc:  # truncated, not a torch file, unpicklable content
        raise ConfigError(f"shard {path} cannot be read ({type(exc).__name__}: {str(exc)[:200]}) in {which}; "
                          "the checkpoint is damaged: load an earlier one") from exc


def consolidate(directory: str | os.PathLike[str], *, check_tied: bool = True) -> dict[str, torch.Tensor]:
    """One state dict (original keys, original order) from a checkpoint's shards.

    Args:
        directory: Written by ``pipe.save(directory)``.
        check_tied: Check that copies of a tensor in several shards are equal.

    Returns:
        ``{original key: CPU tensor}`` in the original model's ``state_dict`` order.

    Raises:
        ConfigError: for a directory without a complete checkpoint, a missing, unreadable or
            misnamed shard, or tied copies that differ.
    """
    which, index, paths = read_index(directory)
    merged: dict[str, torch.Tensor] = {}
    for shard, keys in index["shards"].items():
        sd = load_shard(paths[shard], which)
        for key in keys:
            if key in merged:
                if check_tied and not torch.equal(merged[key], sd[key]):
                    raise ConfigError(f"{key} differs between shards (tied copies out of sync); in {shard}")
                continue
            merged[key] = sd[key]
    order = index.get("state_order") or list(merged)
    missing = [k for k in order if k not in merged]
    if missing:
        log.warning("checkpoint lacks %d key(s) of the original model: %s", len(missing), missing[:8])
    return {k: merged[k] for k in order if k in merged} | {k: v for k, v in merged.items() if k not in order}


def main(argv: list[str] | None = None) -> int:
    """``python -m fxsplit.checkpoint CKPT_DIR OUT.pt``: write the consolidated state dict."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="checkpoint directory written by pipe.save(dir)")
    parser.add_argument("output", help="where to torch.save the consolidated state dict")
    args = parser.parse_args(argv)
    try:
        sd = consolidate(args.directory)
    except ConfigError as exc:
        print(f"error: {exc}")
        return 2
    torch.save(sd, args.output)
    print(f"wrote {len(sd)} tensors ({sum(t.numel() for t in sd.values()):,} elements) to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
