"""Old module paths kept as thin re-exports, faithful to assignment as well as to reading.

A test that patches an old path (``monkeypatch.setattr(gpu_ops, "MAX_GRAPHS", 2)``) expects the
code to see the new value; a plain re-export would only rebind the old module's name. So the
re-export module forwards assignments of the names it lists to the module that uses them.
"""

from __future__ import annotations

import sys
import types
from typing import Dict


def forward_assignments(module_name: str, homes: Dict[str, types.ModuleType]) -> None:
    """After this, ``module.<name> = x`` also sets ``homes[name].<name> = x``."""

    class _Forwarding(types.ModuleType):
        def __setattr__(self, name, value):
            home = homes.get(name)
            if home is not None:
                setattr(home, name, value)
            super().__setattr__(name, value)

    sys.modules[module_name].__class__ = _Forwarding
