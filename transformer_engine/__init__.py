"""An independent implementation of TransformerEngine's PyTorch attention API.

This is not NVIDIA's package: it keeps TransformerEngine's public names and argument
meanings so existing calls run unchanged, and adds per-sequence mask policies, padding
between packed sequences on every backend, and declarative packed QKV inputs.
``__version__`` is the TE API level implemented (see ``version.py``).
"""

from transformer_engine import common  # noqa: F401  (``te.common.recipe`` after ``import transformer_engine``)
from transformer_engine import pytorch  # noqa: F401  (``te.pytorch.X`` after ``import transformer_engine``, as in TE)
from transformer_engine.version import DISTRIBUTION_VERSION, __version__  # noqa: F401
