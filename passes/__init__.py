"""Graph passes: capture, shapes, costs, antichain condensation (installed as fxsplit.passes)."""
