"""``transformer_engine.pytorch.LayerNorm``: a stand-in (this package implements attention only)."""

from .._placeholder import PlaceholderModule


class LayerNorm(PlaceholderModule):
    """Importable and subclassable; constructing it raises ``NotImplementedError``."""

    te_name = "transformer_engine.pytorch.LayerNorm"
