"""TE's re-export surface: backend selection lives in ``selection.py``, qkv layouts in
``layouts.py``, switches in ``environment.py``."""

from .environment import env_snapshot  # noqa: F401
from .layouts import (  # noqa: F401
    _may_share,
    _shared_interleave,
    get_qkv_layout,
    layout_string,
    stride_rules_out_packing,
)
from .selection import (  # noqa: F401
    BACKENDS_BY_LABEL,
    BackendSelection,
    NoBackendError,
    _select,
    backend_scope,
    chosen_backend_label,
    explain_backends,
    get_attention_backend,
    logger,
    require_backend,
    support_matrix_markdown,
)
from .backends import BACKENDS, backend_label  # noqa: F401
