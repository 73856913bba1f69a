"""Versions; setup.py reads them from here without importing torch.

``__version__`` is the TransformerEngine API level this package implements, as a PEP 440
version of TE's line with a local label naming this package: version-gated callers
(megatron-core's ``is_te_min_version``) compare it like TE's own, and the label tells anyone
reading it that this is not NVIDIA's build. The distribution (``te-attention``) has its own
release number, ``DISTRIBUTION_VERSION``.
"""

__version__ = "2.10.0+teattention"
DISTRIBUTION_VERSION = "0.2.0"
