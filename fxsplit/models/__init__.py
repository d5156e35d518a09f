"""fxsplit.models."""
