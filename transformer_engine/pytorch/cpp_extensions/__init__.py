"""``transformer_engine.pytorch.cpp_extensions``: TE's compiled-extension wrappers. This package has
no compiled extension; only the names TE's callers compare selection results with exist here."""
