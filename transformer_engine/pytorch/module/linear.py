"""``transformer_engine.pytorch.Linear``: a stand-in (this package implements attention only)."""

from .._placeholder import PlaceholderModule


class Linear(PlaceholderModule):
    """Importable and subclassable; constructing it raises ``NotImplementedError``."""

    te_name = "transformer_engine.pytorch.Linear"
