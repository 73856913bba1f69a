"""TE's fusible-operation base classes: stand-ins (this package implements attention only)."""

from .._placeholder import PlaceholderModule


class FusibleOperation(PlaceholderModule):
    """Importable and subclassable; constructing it raises ``NotImplementedError``."""

    te_name = "transformer_engine.pytorch.ops.FusibleOperation"


class BasicOperation(FusibleOperation):
    """Importable and subclassable; constructing it raises ``NotImplementedError``."""

    te_name = "transformer_engine.pytorch.ops.BasicOperation"
