"""fxsplit.schedule."""
