"""fxsplit: split a PyTorch model across devices automatically and run it as a pipeline."""

from fxsplit import errors
from fxsplit.errors import FxsplitError

__version__ = "0.1.0"
__all__ = ["errors", "FxsplitError", "__version__"]
