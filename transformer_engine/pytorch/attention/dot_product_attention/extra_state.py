"""TransformerEngine's ``_extra_state`` checkpoint entry.

TE's Linear, LayerNormLinear and DotProductAttention save their FP8 scaling state as
``<module>._extra_state``: a 1-D uint8 tensor holding the pickled state, or an EMPTY uint8 tensor
when the module has none (it never ran in FP8). On load they take that tensor, ``None`` (older
checkpoints), or an ``io.BytesIO`` (TE 1.x's format). The projections here never run FP8: a
non-empty state is kept as bytes, unread (never unpickled), and saved back unchanged, so a TE
checkpoint survives a load and a save here.

:func:`get_extra_state` and :func:`set_extra_state` are DotProductAttention's two methods: they
write and read the module's FP8 attention state (:mod:`.fp8.checkpoint`, TE's format); a state
this package cannot run (a recipe other than delayed scaling carries no tensors) is kept as bytes
and saved back unchanged, like the projections'.
:func:`load_from_state_dict` is DotProductAttention's ``_load_from_state_dict``: as in TE, a
checkpoint without the core attention's entry loads (TE 1.5 and older wrote none; megatron's
distributed checkpoints leave it out unless the softmax is learnable), and TE 1.6/1.7's
``fused_attention._extra_state`` is read when the module's own entry is absent.
"""

from __future__ import annotations

import io
from typing import Any, List, Optional

import torch

from .fp8.checkpoint import deserialize, serialize

_KEPT = "_te_extra_state"  # where a module keeps the bytes it loaded


def extra_state_bytes(state: Any, owner: str) -> Optional[bytes]:
    """The payload of a TE extra state; None when there is none (None or an empty tensor)."""
    if state is None:
        return None
    if isinstance(state, io.BytesIO):
        data = state.getvalue()
    elif isinstance(state, torch.Tensor) and state.dtype == torch.uint8 and state.dim() == 1:
        data = state.detach().cpu().contiguous().numpy().tobytes()
    else:
        seen = f"a {tuple(state.shape)} {state.dtype} tensor" if isinstance(state, torch.Tensor) else type(state).__name__
        raise TypeError(f"{owner}'s _extra_state must be a 1-D uint8 tensor (TE's serialized extra state, empty when "
                        f"there is none), an io.BytesIO or None; got {seen}")
    return data or None


def extra_state_tensor(data: Optional[bytes]) -> torch.Tensor:
    """TE's on-disk form: the bytes as a 1-D uint8 CPU tensor, empty when there are none."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def keep_extra_state(module: torch.nn.Module, state: Any) -> None:
    """Keep what a checkpoint held for ``module`` (checked, not interpreted)."""
    object.__setattr__(module, _KEPT, extra_state_bytes(state, type(module).__name__))


def kept_extra_state(module: torch.nn.Module) -> torch.Tensor:
    """The extra state to save for ``module``: what it loaded, else TE's empty one."""
    return extra_state_tensor(getattr(module, _KEPT, None))


# DotProductAttention's methods (``self`` is the module).


def get_extra_state(self) -> torch.Tensor:
    """TE's ``_extra_state``: the FP8 attention state in TE's format; else what a checkpoint
    loaded, unchanged; else TE's empty one."""
    state = getattr(self, "_fp8_state", None)
    return serialize(state) if state is not None else kept_extra_state(self)


def set_extra_state(self, state: Any) -> None:
    """A delayed-scaling state becomes the module's FP8 state (used from its next FP8 call on); any
    other non-empty state is kept as bytes. TE's empty state or None drop kept bytes and leave an
    FP8 state the module has (TE's modules keep theirs too)."""
    data = extra_state_bytes(state, type(self).__name__)
    if data is None:
        keep_extra_state(self, None)
        return
    restored = deserialize(data)
    if restored is None:
        keep_extra_state(self, state)
        return
    keep_extra_state(self, None)
    self._fp8_state = restored


def load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                         missing_keys: List[str], unexpected_keys: List[str], error_msgs: List[str]) -> None:
    """torch's loading, then TE's two allowances for the core attention's extra state."""
    own, legacy = prefix + "_extra_state", prefix + "fused_attention._extra_state"
    torch.nn.Module._load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                                          unexpected_keys, error_msgs)
    if own not in state_dict and legacy in state_dict:  # TE 1.6/1.7 kept it under its FusedAttention child
        self.set_extra_state(state_dict[legacy])
    for keys, key in ((missing_keys, own), (unexpected_keys, legacy)):
        if key in keys:
            keys.remove(key)
