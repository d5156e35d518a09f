"""fxsplit.codegen."""
