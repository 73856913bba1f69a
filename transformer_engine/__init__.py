"""An independent implementation of TransformerEngine's PyTorch attention API.

This is not NVIDIA's package: it keeps TransformerEngine's public names and argument
meanings so existing calls run unchanged, and adds per-sequence mask policies, padding
between packed sequences on every backend, and declarative packed QKV inputs.
"""

from transformer_engine.version import __version__  # noqa: F401
