"""Per-sequence mask policies inside one packed (THD) batch.

Two spellings reach the same object:

* ``attn_mask_type_per_seq={"padding_causal": ids_a, "padding": ids_b}``: each key is a mask type
  (or a ``(mask_type, (left, right))`` pair giving that policy its own sliding window), each
  value a 1-D integer tensor of sequence indices on the inputs' device.
* ``thd_sequence_is_causal``: a [B] bool tensor; shorthand for ``padding_causal`` where True and
  ``padding`` elsewhere.

Only shapes are read on the host: which sequences belong where stays on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Tuple, Union

import torch

from ..masks import AttnMaskType, MaskSpec, normalize_window
from .packed_seqs import value_checks_on

PolicyKey = Union[str, AttnMaskType, Tuple[Union[str, AttnMaskType], Tuple[int, int]]]


@dataclass(frozen=True)
class SeqPolicies:
    """Policies of one batch: host-side specs, and each sequence's policy index on the device.

    ``maybe_nonempty[p]`` is False only when policy p is known (from a shape) to own no sequence;
    ``sizes[p]`` is how many sequences policy p names, where shapes tell (the dict spelling), else
    None. Well-formed ids make it the policy's sequence count; it is always an upper bound.
    """

    specs: Tuple[MaskSpec, ...]
    policy_of_seq: torch.Tensor
    maybe_nonempty: Tuple[bool, ...]
    sizes: Optional[Tuple[int, ...]] = None

    def active(self) -> Tuple[int, ...]:
        return tuple(p for p, live in enumerate(self.maybe_nonempty) if live)

    def uniform_spec(self) -> Optional[MaskSpec]:
        """The single policy every sequence follows, when shapes alone prove it."""
        live = self.active()
        return self.specs[live[0]] if len(live) == 1 else None

    def seq_mask(self, p: int) -> torch.Tensor:
        """[B] bool: the sequences of policy p."""
        return self.policy_of_seq == p


def _parse_key(key: PolicyKey, window_size, arg: str = "attn_mask_type_per_seq") -> MaskSpec:
    if isinstance(key, tuple):
        if len(key) != 2:
            raise ValueError(f"{arg} keys must be a mask type or (mask_type, (left, right)); got {key!r}")
        mask = AttnMaskType.parse(key[0], f"{arg} key")
        window = normalize_window(key[1], mask, f"window of {arg} key {key[0]!r}")
    else:
        mask = AttnMaskType.parse(key, f"{arg} key")
        window = normalize_window(window_size, mask, f"window_size (applied to the {mask.value!r} policy of {arg})")
    if mask is AttnMaskType.ARBITRARY:
        raise ValueError(f"{arg} cannot use 'arbitrary': it needs a dense attention_mask, which THD has not")
    return MaskSpec(mask.with_padding(), window)


def from_mask_type_dict(
    per_seq: Mapping[PolicyKey, torch.Tensor], batch_size: int, device: torch.device, window_size
) -> SeqPolicies:
    """Parse ``attn_mask_type_per_seq``; counts are checked from shapes, values only in debug."""
    arg = "attn_mask_type_per_seq"
    if not isinstance(per_seq, Mapping) or len(per_seq) == 0:
        raise TypeError(f"{arg} must be a non-empty dict of mask type -> 1-D tensor of sequence ids; got {per_seq!r}")
    specs, id_tensors = [], []
    for key, ids in per_seq.items():
        spec = _parse_key(key, window_size)
        if spec in specs:
            raise ValueError(f"{arg} names the policy {spec.mask_type.value!r} with window {spec.window} twice")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise TypeError(f"{arg}[{key!r}] must be a 1-D integer tensor of sequence ids; got {_describe(ids)}")
        if ids.device != device:
            raise ValueError(f"{arg}[{key!r}] must be on the inputs' device {device}; got {ids.device}")
        specs.append(spec)
        id_tensors.append(ids)
    total = sum(int(ids.numel()) for ids in id_tensors)
    if total != batch_size:
        raise ValueError(
            f"{arg} must place each of the {batch_size} sequences in exactly one entry; its entries hold {total} ids"
        )
    if value_checks_on(device):
        _validate_ids(id_tensors, batch_size)
    sizes = tuple(int(ids.numel()) for ids in id_tensors)
    return SeqPolicies(tuple(specs), policy_of_ids(id_tensors, batch_size, device), tuple(n > 0 for n in sizes), sizes)


def policy_of_ids(id_tensors, batch_size: int, device: torch.device) -> torch.Tensor:
    """[B] int64: the index of the last policy (in dict order) whose ids name each sequence, -1
    for a sequence none names. Two launches per policy (three for ids that need a cast to int64)
    and one more, with no sync.

    Ids outside [0, B) land in two spare slots past the end, never on a sequence: clamped to
    [-1, B], an id >= B writes slot B and a negative one writes -1, which index_fill wraps to
    the last slot B + 1 (it accepts indices in [-size, size) on the CPU and on CUDA). Unclamped,
    such an id would be a device-side assert on CUDA or wrap around to another sequence."""
    table = torch.full((batch_size + 2,), -1, dtype=torch.int64, device=device)
    for p, ids in enumerate(id_tensors):
        table.index_fill_(0, ids.long().clamp(-1, batch_size), p)  # in order: a repeated id keeps the last policy
    return table[:batch_size]


def from_is_causal(is_causal: torch.Tensor, batch_size: int, device: torch.device, window_size) -> SeqPolicies:
    """Parse ``thd_sequence_is_causal``: both policies may be live (telling would need a sync)."""
    arg = "thd_sequence_is_causal"
    if not isinstance(is_causal, torch.Tensor) or is_causal.dtype != torch.bool or is_causal.dim() != 1:
        raise TypeError(f"{arg} must be a 1-D bool tensor, one value per sequence; got {_describe(is_causal)}")
    if is_causal.numel() != batch_size:
        raise ValueError(f"{arg} must hold one value per sequence ({batch_size}); got {is_causal.numel()}")
    if is_causal.device != device:
        raise ValueError(f"{arg} must be on the inputs' device {device}; got {is_causal.device}")
    specs = tuple(_parse_key(m, window_size, arg) for m in (AttnMaskType.PADDING, AttnMaskType.PADDING_CAUSAL))
    live = batch_size > 0
    return SeqPolicies(specs, is_causal.long(), (live, live))


@dataclass(frozen=True)
class PolicyRecipe:
    """The host half of one call's policies, for repeats of that call (see :mod:`.fast_path`,
    whose key holds every fact it was parsed from: the spelling, the dict's keys in order, the
    window, the id tensors' dtypes, shapes and devices, and the batch size).

    ``specs`` None: one policy owned every sequence (shapes said so), and the call ran the
    scalar path with that policy's mask; repeats then build no policies at all."""

    by_ids: bool  # attn_mask_type_per_seq (else thd_sequence_is_causal)
    specs: Optional[Tuple[MaskSpec, ...]]
    maybe_nonempty: Tuple[bool, ...] = ()
    sizes: Optional[Tuple[int, ...]] = None

    @classmethod
    def of(cls, policies: Optional[SeqPolicies], by_ids: bool) -> "PolicyRecipe":
        if policies is None:
            return cls(by_ids, None)
        return cls(by_ids, policies.specs, policies.maybe_nonempty, policies.sizes)

    def policies(self, per_seq, is_causal, batch_size: int, device: torch.device) -> Optional[SeqPolicies]:
        """This call's policies, as :func:`parse_policies` builds them for it (the same value
        checks included, where :func:`value_checks_on` runs them)."""
        if not self.by_ids:
            return None if self.specs is None else SeqPolicies(self.specs, is_causal.long(), self.maybe_nonempty)
        id_tensors = tuple(per_seq.values())
        if value_checks_on(device):
            _validate_ids(id_tensors, batch_size)
        if self.specs is None:
            return None
        return SeqPolicies(self.specs, policy_of_ids(id_tensors, batch_size, device), self.maybe_nonempty, self.sizes)


def _validate_ids(id_tensors, batch_size) -> None:
    """Value checks (see :func:`value_checks_on`): ids in range, each sequence claimed once."""
    seen: dict = {}
    for ids in id_tensors:
        values = ids.tolist()
        bad = [i for i in values if not 0 <= i < batch_size]
        if bad:
            raise ValueError(f"attn_mask_type_per_seq ids must be sequence indices in [0, {batch_size}); got {bad}")
        for i in values:
            seen[i] = seen.get(i, 0) + 1
    repeated = sorted(i for i, n in seen.items() if n > 1)
    if repeated:
        missing = sorted(set(range(batch_size)) - set(seen))
        raise ValueError(
            f"attn_mask_type_per_seq must name each sequence once; ids {repeated} are repeated and {missing} missing"
        )


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)}, dtype {x.dtype}"
    return type(x).__name__


def parse_policies(per_seq, is_causal, batch_size: int, device: torch.device, window_size) -> Optional[SeqPolicies]:
    """The policies of a THD call from either spelling (None when neither is given);
    ``window_size`` as given to the call, normalized here against each policy's own mask."""
    if per_seq is not None and is_causal is not None:
        raise ValueError("pass attn_mask_type_per_seq or thd_sequence_is_causal, not both")
    if per_seq is not None:
        return from_mask_type_dict(per_seq, batch_size, device, window_size)
    if is_causal is not None:
        return from_is_causal(is_causal, batch_size, device, window_size)
    return None


def reject_per_seq(per_seq, is_causal, what: str) -> None:
    """Per-sequence policies are a packed-batch feature: refused by name for ``what``."""
    if per_seq is not None or is_causal is not None:
        name = "attn_mask_type_per_seq" if per_seq is not None else "thd_sequence_is_causal"
        raise NotImplementedError(f"{name} needs qkv_format='thd' (per-sequence policies are a packed-batch feature); got {what}")
