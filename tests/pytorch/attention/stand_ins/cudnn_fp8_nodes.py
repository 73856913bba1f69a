"""cudnn-frontend 1.32's FP8 SDPA nodes (``sdpa_fp8``, ``sdpa_fp8_backward``) as the cuDNN
stand-in (:mod:`.cudnn`) executes them: through the graph's declarations like its BF16 nodes
(dims, strides, ragged offsets, per-sequence lengths), every descale and scale read from the
float32 [1, 1, 1, 1] tensor bound to its uid, the amaxes written into theirs, each FP8 output in
the data type declared for it (checked against the buffer bound to it). The arithmetic is
:func:`.rows.forward_fp8` / :func:`.rows.backward_fp8` in float64, with what the H200 measured:

- forward: each row's exp(s - rowmax) (largest value 1) quantized to E4M3 with scale_s (and
  descale_s) before P V, the row sum divided after; amax_s of the NORMALIZED softmax; O written
  in its FP8 type with scale_o (saturating), amax_o of the unquantized O; a row that sees no key
  left unwritten; with dense padding (lengths, no ragged offsets) the rows past a sequence's
  query length WRITTEN too (with PAST_LENGTH), so the caller must clear them;
- backward: the normalized P recomputed from the stats and quantized with scale_s for dV; dP
  (the gradient of Q K^T, attn_scale included) quantized with scale_dP to dO's FP8 type for dQ
  and dK; dQ, dK, dV written in their FP8 types with scale_dQ/dK/dV in the rows each sequence
  owns; amax_dQ/dK/dV of the unquantized gradients, amax_dP of dP; no ragged offsets (Hopper).
"""

from __future__ import annotations

import torch

from ..reference import band
from .rows import backward_fp8, forward_fp8

E4M3 = torch.float8_e4m3fn
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
PAST_LENGTH = 3.0  # what the FP8 forward leaves in rows past a dense sequence's query length
# Arguments the package's FP8 graphs leave unset (fp8_graphs.py), which the stand-in does not model.
_FP8_UNSET = ("bias", "use_alibi_mask", "sliding_window", "diagonal_alignment", "left_bound", "right_bound", "dropout",
              "paged_attention_k_table", "fn", "score_max", "sink_token", "dSink_token", "cu_seq_len_q", "stats_use_log2")


def fp8_modelled(given: dict) -> None:
    """A node's arguments (by name) use none of :data:`_FP8_UNSET`."""
    assert not any(given.get(n) for n in _FP8_UNSET), [n for n in _FP8_UNSET if given.get(n)]


def cast_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * scale in ``dtype``, saturating at its largest finite value."""
    m = FP8_MAX[dtype]
    return (x.float() * scale.float()).clamp(-m, m).to(dtype)


def _fp8_scalars(node, pack: dict, names) -> dict:
    """{name: float64 value} of the node's [1, 1, 1, 1] float32 scalars, read by uid."""
    out = {}
    for name in names:
        t, value = node.tensors[name], pack[node.uid(name)]
        assert t.dim == [1, 1, 1, 1] and t.data_type == "data_type.FLOAT" and value.dtype == torch.float32, name
        out[name] = value.reshape(()).double()
    return out


def _fp8_io(node, pack: dict, names) -> None:
    """Each named tensor (inputs, then outputs) is declared with its buffer's data type."""
    for name in names:
        t = node.tensors.get(name) or node.outputs[name]
        assert t.data_type == f"data_type.{pack[t.uid].dtype}", f"{name}: declared {t.data_type}, bound {pack[t.uid].dtype}"


def _fp8_write_amaxes(node, pack: dict, values: dict) -> None:
    for name, value in values.items():
        t = node.outputs[name]
        assert t.output and t.dim == [1, 1, 1, 1] and t.data_type == "data_type.FLOAT", name
        pack[t.uid].fill_(value)


def _quantizer(scale: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype):
    return lambda x: cast_fp8(x, scale, dtype).double() * descale


def _fp8_seq(node, pack: dict, scalars: dict, b: int, n: int, m: int, names=("q", "k", "v")) -> list:
    """Sequence b's dequantized tensors as the rows' arithmetic takes them ([rows, H, D])."""
    return [_rows(node.tensors[x].view(pack, b, n if x in ("q", "o", "dO") else m)).double() * scalars["descale_" + x]
            for x in names]


def _fp8_allowed(node, n: int, m: int) -> torch.Tensor:
    """The FP8 nodes' mask: the causal flags (top-left or bottom-right), else every key."""
    causal = node.args["use_causal_mask"] or node.args["use_causal_mask_bottom_right"]
    return band(n, m, -1, 0 if causal else -1, m - n if node.args["use_causal_mask_bottom_right"] else 0)


def fp8_forward(node, pack: dict, sequences) -> None:
    """O in its declared FP8 type (scale_o; rows that see no key unwritten), the stats, amax_s of the
    normalized P and amax_o of the unquantized O. With dense padding, the rows past each
    sequence's query length are written too (PAST_LENGTH), as on the H200."""
    sc = _fp8_scalars(node, pack, ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"))
    _fp8_io(node, pack, ("q", "k", "v", "o"))
    o, stats, quantize_s = node.outputs["o"], pack[node.outputs["stats"].uid], _quantizer(sc["scale_s"], sc["descale_s"], E4M3)
    amax = dict(amax_s=torch.zeros((), dtype=torch.float64), amax_o=torch.zeros((), dtype=torch.float64))
    for b, n, m in sequences:
        if node.padded and not node.varlen:
            o.view(pack, b, node.sq)[:, n:] = PAST_LENGTH
        if not (n and m):
            continue
        ok = _fp8_allowed(node, n, m)
        out, lse, p = forward_fp8(*_fp8_seq(node, pack, sc, b, n, m), ok, node.args["attn_scale"], quantize_s)
        seen = ok.any(dim=1)
        amax["amax_s"] = torch.maximum(amax["amax_s"], p[:, seen].amax())
        amax["amax_o"] = torch.maximum(amax["amax_o"], out[seen].abs().amax())
        rows = o.view(pack, b, n)
        rows[:, seen] = _rows(cast_fp8(out[seen], sc["scale_o"], rows.dtype))
        stats[b, :, :n, 0] = lse.float()
    _fp8_write_amaxes(node, pack, amax)


_FP8_BWD_SCALARS = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP", "scale_s",
                    "scale_dQ", "scale_dK", "scale_dV", "scale_dP")


def fp8_backward(node, pack: dict, sequences) -> None:
    """dQ, dK, dV in their buffers' FP8 types (scale_dQ/dK/dV) in the rows each sequence owns,
    and amax_dQ/dK/dV (unquantized) and amax_dP; dense layouts only."""
    assert not node.varlen, "cuDNN's FP8 backward takes no ragged offsets on Hopper"
    sc = _fp8_scalars(node, pack, _FP8_BWD_SCALARS)
    _fp8_io(node, pack, ("q", "k", "v", "o", "dO", "dq", "dk", "dv"))
    quantize_s = _quantizer(sc["scale_s"], sc["descale_s"], E4M3)
    quantize_dp = _quantizer(sc["scale_dP"], sc["descale_dP"], pack[node.uid("dO")].dtype)
    found = torch.zeros(4, dtype=torch.float64)
    for b, n, m in sequences:
        if not (n and m):
            continue
        q, k, v, o, do = _fp8_seq(node, pack, sc, b, n, m, ("q", "k", "v", "o", "dO"))
        grads = backward_fp8(do, q, k, v, o, pack[node.uid("stats")][b, :, :n, 0], _fp8_allowed(node, n, m),
                             node.args["attn_scale"], quantize_s, quantize_dp)
        found = torch.maximum(found, torch.stack([g.abs().amax() for g in grads]))
        for name, g, rows, scale in zip(("dq", "dk", "dv"), grads, (n, m, m), ("scale_dQ", "scale_dK", "scale_dV")):
            view = node.outputs[name].view(pack, b, rows)
            view.copy_(_rows(cast_fp8(g, sc[scale], view.dtype)))
    _fp8_write_amaxes(node, pack, dict(zip(("amax_dQ", "amax_dK", "amax_dV", "amax_dP"), found)))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[H, n, D] (a graph's view) <-> [n, H, D] (the arithmetic's rows)."""
    return x.transpose(0, 1)
