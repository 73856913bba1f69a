"""Framework-independent pieces of TE's API that callers import (``recipe``)."""

from . import recipe

__all__ = ["recipe"]
