"""TransformerEngine's MultiheadAttention checkpoint layout, written from TE's documented facts
(not from this package's code), and a float64 forward computed from such a state dict alone.

The facts (TE 2.x ``multi_head_attention.py``, ``module/linear.py``, ``module/layernorm_linear.py``):
- self attention: ``layernorm_qkv`` (LayerNormLinear) with an input layernorm, else ``qkv``
  (Linear); cross attention: ``layernorm_query`` or ``query_layer``, and ``key_value``; then
  ``core_attention`` (DotProductAttention), then ``proj`` (Linear).
- LayerNormLinear registers ``layer_norm_weight``, ``layer_norm_bias`` (not for RMSNorm), then its
  weights, then its biases; every TE module ends with ``_extra_state`` (an empty uint8 tensor
  without FP8).
- ``fuse_qkv_params=False`` splits the parameters (``parameters_split``): ``query``/``key``/``value``
  for the self-attention QKV, ``query`` for ``layernorm_query`` (not for ``query_layer``), and
  ``key``/``value`` for ``key_value``; the names are ``{name}_weight`` / ``{name}_bias``, weights
  first. TE turns ``qkv_weight_interleaved`` off without fused parameters.
- QKV rows: interleaved [g, h/g + 2, d] (per group: its queries, key, value), else [h | g | g]
  head blocks of d rows; ``key_value``: interleaved [g, 2, d], else [2, g, d].
- Column-parallel shards hold out_features / tp rows of every block; ``proj`` (row-parallel)
  in_features / tp columns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .reference import allowed_matrix, attend_one

HID, H, D = 32, 4, 8
EPS = 1e-5


@dataclass(frozen=True)
class Variant:
    attention_type: str = "self"
    input_layernorm: bool = False
    normalization: str = "LayerNorm"
    bias: bool = True
    hg: int = H
    fuse: bool = False
    interleaved: bool = True
    tp: int = 1
    softmax_type: str = "vanilla"
    hidden: int = HID
    heads: int = H
    head_dim: int = D

    @property
    def interleaved_rows(self) -> bool:
        return self.fuse and self.interleaved

    def kwargs(self) -> dict:
        """MultiheadAttention's keyword arguments for this variant (CPU, float64, no dropout)."""
        kw = dict(kv_channels=self.head_dim, attention_type=self.attention_type, input_layernorm=self.input_layernorm, normalization=self.normalization,
                  bias=self.bias, num_gqa_groups=self.hg, fuse_qkv_params=self.fuse, qkv_weight_interleaved=self.interleaved,
                  softmax_type=self.softmax_type, attention_dropout=0.0, params_dtype=torch.float64, device="cpu",
                  attn_mask_type="causal" if self.attention_type == "self" else "no_mask", layernorm_epsilon=EPS)
        if self.tp > 1:
            kw.update(tp_size=self.tp, set_parallel_mode=True)
        return kw

    def __str__(self) -> str:
        return "-".join([self.attention_type, "ln" if self.input_layernorm else "noln", self.normalization,
                         "bias" if self.bias else "nobias", f"g{self.hg}", "fused" if self.fuse else "split",
                         "inter" if self.interleaved else "concat", f"tp{self.tp}", self.softmax_type])


def _te_module(keys: List, prefix: str, blocks: Sequence[Tuple[str, int]], in_features: int, v: Variant, norm: bool) -> None:
    if norm:
        keys.append((prefix + "layer_norm_weight", (in_features,)))
        if v.normalization == "LayerNorm":
            keys.append((prefix + "layer_norm_bias", (in_features,)))
    keys.extend((f"{prefix}{name}weight", (rows, in_features)) for name, rows in blocks)
    if v.bias:
        keys.extend((f"{prefix}{name}bias", (rows,)) for name, rows in blocks)
    keys.append((prefix + "_extra_state", (0,)))


def te_keys(v: Variant) -> List[Tuple[str, Tuple[int, ...]]]:
    """TE's state dict entries for ``v``, in TE's order, with their shapes."""
    q, kv = v.heads * v.head_dim // v.tp, v.hg * v.head_dim // v.tp
    split, ln, hid = not v.fuse, v.input_layernorm, v.hidden
    keys: List = []
    if v.attention_type == "self":
        blocks = [("query_", q), ("key_", kv), ("value_", kv)] if split else [("", q + 2 * kv)]
        _te_module(keys, "layernorm_qkv." if ln else "qkv.", blocks, hid, v, ln)
    else:
        _te_module(keys, "layernorm_query." if ln else "query_layer.", [("query_", q)] if split and ln else [("", q)], hid, v, ln)
        _te_module(keys, "key_value.", [("key_", kv), ("value_", kv)] if split else [("", 2 * kv)], hid, v, False)
    if v.softmax_type == "learnable":
        keys.append(("core_attention.softmax_offset", (v.heads // v.tp,)))
    keys.append(("core_attention._extra_state", (0,)))
    _te_module(keys, "proj.", [("", hid)], q, v, False)
    return keys


def te_state_dict(v: Variant, seed: int = 0) -> Dict[str, torch.Tensor]:
    """A TE-layout state dict with random float64 values (norm weights near 1) and TE's empty
    extra states."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for key, shape in te_keys(v):
        if key.endswith("_extra_state"):
            sd[key] = torch.empty(0, dtype=torch.uint8)
        else:
            sd[key] = torch.randn(shape, generator=g, dtype=torch.float64) * 0.3 + (1.0 if key.endswith("layer_norm_weight") else 0.0)
    return sd


def _linear(sd: Dict[str, torch.Tensor], prefix: str, x: torch.Tensor, norm: Optional[str]) -> torch.Tensor:
    """A TE Linear / LayerNormLinear from its state dict entries: blocks joined top to bottom."""
    if norm == "LayerNorm":
        x = F.layer_norm(x, x.shape[-1:], sd[prefix + "layer_norm_weight"], sd[prefix + "layer_norm_bias"], EPS)
    elif norm == "RMSNorm":
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * sd[prefix + "layer_norm_weight"]
    # Blocks top to bottom, whatever the dict's order ("weight" alone when fused).
    names = [n for n in ("weight", "query_weight", "key_weight", "value_weight") if prefix + n in sd]
    w = torch.cat([sd[prefix + n] for n in names])
    out = x @ w.T
    biases = [prefix + n[: -len("weight")] + "bias" for n in names]
    return out + torch.cat([sd[b] for b in biases]) if biases[0] in sd else out


def _qkv(sd, v: Variant, x: torch.Tensor, enc: Optional[torch.Tensor]):
    h, g, d = v.heads // v.tp, v.hg // v.tp, v.head_dim
    norm = v.normalization if v.input_layernorm else None
    if v.attention_type == "self":
        mixed = _linear(sd, "layernorm_qkv." if v.input_layernorm else "qkv.", x, norm)
        if v.interleaved_rows:
            grouped = mixed.view(*mixed.shape[:-1], g, h // g + 2, d)
            return grouped[..., : h // g, :].reshape(*mixed.shape[:-1], h, d), grouped[..., h // g, :], grouped[..., h // g + 1, :]
        q, k, val = mixed.split([h * d, g * d, g * d], dim=-1)
        return q.view(*q.shape[:-1], h, d), k.view(*k.shape[:-1], g, d), val.view(*val.shape[:-1], g, d)
    q = _linear(sd, "layernorm_query." if v.input_layernorm else "query_layer.", x, norm)
    kv = _linear(sd, "key_value.", enc, None)
    kv = kv.view(*kv.shape[:-1], g, 2, d) if v.interleaved_rows else kv.view(*kv.shape[:-1], 2, g, d)
    k, val = kv.unbind(-2 if v.interleaved_rows else -3)
    return q.view(*q.shape[:-1], h, d), k, val


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """[sq, h, d] x [skv, hg, d] -> [sq, h, d]: the float64 reference, causal top-left."""
    mask = allowed_matrix(q.shape[0], k.shape[0], "causal" if causal else "no_mask")
    return attend_one(q, k, v, mask, 1 / math.sqrt(q.shape[-1])).to(q.dtype)


def te_forward(sd: Dict[str, torch.Tensor], v: Variant, x: torch.Tensor, enc: Optional[torch.Tensor] = None,
               fmt: str = "sbhd", lengths: Optional[Sequence[int]] = None) -> torch.Tensor:
    """MultiheadAttention's output (tp=1) from a TE-layout state dict: sbhd / bshd, or thd with
    ``lengths`` (one packed batch used for both sides)."""
    assert v.tp == 1 and v.softmax_type == "vanilla"
    q, k, val = _qkv(sd, v, x, enc)
    causal = v.attention_type == "self"
    if fmt == "thd":
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        ctx = torch.cat([_attend(q[s:s + n], k[s:s + n], val[s:s + n], causal) for s, n in zip(starts, lengths)])
    else:
        bdim = 1 if fmt == "sbhd" else 0
        ctx = torch.stack([_attend(*(t.select(bdim, b) for t in (q, k, val)), causal) for b in range(q.shape[bdim])], dim=bdim)
    return _linear(sd, "proj.", ctx.flatten(-2), None)


def variants(**fixed) -> List[Variant]:
    """Every combination of the checkpoint-relevant choices (``fixed`` pins some)."""
    grid = dict(attention_type=("self", "cross"), input_layernorm=(True, False), normalization=("LayerNorm", "RMSNorm"),
                bias=(True, False), hg=(H, 2, 1), fuse=(True, False), interleaved=(True, False))
    out = [Variant()]
    for name, values in grid.items():
        values = (fixed[name],) if name in fixed else values
        out = [replace(v, **{name: value}) for v in out for value in values]
    return [replace(v, **{k: val for k, val in fixed.items() if k not in grid}) for v in out]


def te_inputs(v: Variant, fmt: str = "sbhd", seed: int = 1):
    """Hidden states (and, for cross attention, encoder output) in ``fmt``, float64."""
    g = torch.Generator().manual_seed(seed)
    shape = {"sbhd": (5, 2, v.hidden), "bshd": (2, 5, v.hidden), "thd": (9, v.hidden)}[fmt]
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    enc_shape = {"sbhd": (7, 2, v.hidden), "bshd": (2, 7, v.hidden), "thd": (9, v.hidden)}[fmt]
    enc = torch.randn(enc_shape, generator=g, dtype=torch.float64) if v.attention_type == "cross" else None
    return x, enc
