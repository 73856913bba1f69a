"""``transformer_engine.pytorch.module.base.TransformerEngineBaseModule``: a stand-in (this package implements attention only)."""

from .._placeholder import PlaceholderModule


class TransformerEngineBaseModule(PlaceholderModule):
    """Importable and subclassable; constructing it raises ``NotImplementedError``."""

    te_name = "transformer_engine.pytorch.module.base.TransformerEngineBaseModule"
