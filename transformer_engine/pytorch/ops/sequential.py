"""``transformer_engine.pytorch.ops.Sequential``: a stand-in (attention only here)."""

from .._placeholder import PlaceholderModule


class Sequential(PlaceholderModule):
    """Importable and subclassable; constructing it raises ``NotImplementedError``."""

    te_name = "transformer_engine.pytorch.ops.Sequential"
