"""Merge a distributed fxsplit checkpoint into one state dict: ``consolidate_checkpoint.py DIR OUT.pt``.

The unsplit model then loads it with ``model.load_state_dict(torch.load("OUT.pt"))``. Same as
``python -m fxsplit.checkpoint DIR OUT.pt``.
"""

from fxsplit.checkpoint import main

if __name__ == "__main__":
    raise SystemExit(main())
