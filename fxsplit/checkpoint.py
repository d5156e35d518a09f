"""Merge the per-stage shards of a distributed checkpoint into one ordinary state dict.

A directory written by :meth:`fxsplit.runtime.distributed.DistributedPipeline.save` holds
``plan.json`` (the plan, the original ``state_dict`` key order, and which shard holds which
keys) and one ``stage{i:03d}.pt`` per stage with original keys. :func:`consolidate` returns the
state dict the unsplit model loads with ``model.load_state_dict(sd)``; a tied tensor saved by
several stages is taken from the first and checked equal in the others.

Command line::

    python -m fxsplit.checkpoint CKPT_DIR model.pt
    python scripts/consolidate_checkpoint.py CKPT_DIR model.pt
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

import torch

from fxsplit.errors import ConfigError

__all__ = ["consolidate", "main"]

log = logging.getLogger(__name__)


def _read_index(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, "plan.json")
    if not os.path.exists(path):
        raise ConfigError(f"{path} not found: pass a directory written by pipe.save(dir)")
    with open(path) as f:
        return json.load(f)


def consolidate(directory: str | os.PathLike[str], *, check_tied: bool = True) -> dict[str, torch.Tensor]:
    """One state dict (original keys, original order) from a checkpoint's shards.

    Args:
        directory: Written by ``pipe.save(directory)``.
        check_tied: Check that copies of a tensor in several shards are equal.

    Returns:
        ``{original key: CPU tensor}`` in the original model's ``state_dict`` order.

    Raises:
        ConfigError: for a missing ``plan.json`` or shard, or tied copies that differ.
    """
    directory = str(directory)
    index = _read_index(directory)
    merged: dict[str, torch.Tensor] = {}
    for shard, keys in index["shards"].items():
        path = os.path.join(directory, shard)
        if not os.path.exists(path):
            raise ConfigError(f"shard {path} listed in plan.json is missing; was every rank's save() finished?")
        sd = torch.load(path, map_location="cpu", weights_only=True)
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
