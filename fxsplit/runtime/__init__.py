"""fxsplit.runtime."""
