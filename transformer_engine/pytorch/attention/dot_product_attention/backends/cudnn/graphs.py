"""cudnn-frontend graphs for the cuDNN ops: building them (tensors, strides, ragged offsets, the
mask band, bias, ALiBi, dropout, sinks, the max-logit outputs), caching the built ones, and
executing them on torch's current stream.

Q/K/V/O are declared [B, H, S, D] over the torch tensors' own strides; a varlen (THD) tensor
[T, H, D] gets per-sequence ragged offsets (int64 ELEMENT offsets) and per-sequence lengths.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ...prepare.metadata_cache import derived_from

UID = dict(q=1, k=2, v=3, o=4, stats=5, do=6, dq=7, dk=8, dv=9, len_q=10, len_kv=11, rq=12, rk=13, rv=14, ro=15, rdq=16, rdk=17,
           rdv=18, rdo=19, bias=20, dbias=21, seed=22, offset=23, sink=24, dsink=25, max=26, sum_exp=27)
# Built graphs by configuration, least recently used first; bounded, since each holds cuDNN
# plans and a training run with many shapes (or a per-batch max_seqlen) keeps making new ones.
_graphs: "OrderedDict[tuple, tuple]" = OrderedDict()
MAX_GRAPHS = 256
_graph_lock = threading.Lock()
_handles = threading.local()

# (bias, alibi, dropout_p, sink): what sdpa and sdpa_backward add between scores and output.
Features = Tuple[Optional[torch.Tensor], bool, float, Optional[torch.Tensor]]


# ------------------------------------------------------------------ handles, cache, execution


def _handle(device: torch.device):
    """This thread's cuDNN handle for ``device``, bound to torch's current stream there. The
    stream is read as a raw pointer and set on the handle only when it changed (the handle is
    this module's own): ``torch.cuda.current_stream(...).cuda_stream`` and ``set_stream`` cost
    a few microseconds per call on the host path."""
    import cudnn

    cache = getattr(_handles, "by_device", None)
    if cache is None:
        cache = _handles.by_device = {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    entry = cache.get(index)
    if entry is None:
        with torch.cuda.device(index):
            entry = cache[index] = [cudnn.create_handle(), None]
    stream = torch._C._cuda_getCurrentRawStream(index)
    if entry[1] != stream:
        cudnn.set_stream(handle=entry[0], stream=stream)
        entry[1] = stream
    return entry[0]


def cached(key, build: Callable[[], tuple]) -> tuple:
    """The built graph of ``key`` (built now on a miss; the least recently used is dropped past
    :data:`MAX_GRAPHS`)."""
    with _graph_lock:
        hit = _graphs.get(key)
        if hit is not None:
            _graphs.move_to_end(key)
            return hit
        hit = _graphs[key] = build()
        while len(_graphs) > MAX_GRAPHS:
            _graphs.popitem(last=False)
    return hit


def run_graph(key, build: Callable, pack: dict, device) -> None:
    """Build (once per key) and execute a cuDNN graph on torch's current stream."""
    handle = _handle(device)
    g, ws = cached(key, lambda: build(handle))
    workspace = torch.empty(max(ws, 1), dtype=torch.uint8, device=device)
    g.execute(pack, workspace, handle=handle)


def _finish(g):
    import cudnn

    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g, g.get_workspace_size()


def _new_graph(dtype, handle):
    import cudnn

    return cudnn.pygraph(
        handle=handle,
        io_data_type=_dtype(dtype),
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
    )


# ------------------------------------------------------------------ tensor declarations


def _desc(t: torch.Tensor, varlen: bool, s_max: int) -> Tuple[List[int], List[int]]:
    """cuDNN's [B, H, S, D] dims and strides for a [T, H, D] (varlen) or [B, S, H, D] tensor.

    Varlen batch strides are placeholders: ragged offsets give each sequence's base."""
    if varlen:
        st, sh, sd = t.stride()
        return [0, t.shape[1], s_max, t.shape[2]], [s_max * st, sh, st, sd]
    sb, ss, sh, sd = t.stride()
    return [t.shape[0], t.shape[2], t.shape[1], t.shape[3]], [sb, sh, ss, sd]


def _dims(t: torch.Tensor, varlen: bool, s_max: int, b: int) -> Tuple[List[int], List[int]]:
    """:func:`_desc` with the batch dim of a varlen tensor set to the sequence count."""
    dims, strides = _desc(t, varlen, s_max)
    if varlen:
        dims[0] = b
    return dims, strides


@functools.lru_cache(maxsize=256)
def band(causal: bool, window_left: int, window_right: int, bottom_right: bool) -> Tuple[dict, tuple]:
    """(:func:`band_kwargs`, its cache key) of one mask, cached: the few masks a process meets
    come back on every call. The dict is shared: callers unpack it, never change it."""
    kwargs = band_kwargs(causal, window_left, window_right, bottom_right)
    return kwargs, band_key(kwargs)


def band_kwargs(causal: bool, window_left: int, window_right: int, bottom_right: bool) -> dict:
    """sdpa's mask arguments for a causal flag and a (left, right) window (-1 unbounded)."""
    import cudnn

    right = 0 if causal else window_right
    return dict(
        diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT if bottom_right else cudnn.diagonal_alignment.TOP_LEFT,
        # cuDNN's left bound counts the diagonal itself: left = window_left + 1.
        diagonal_band_left_bound=None if window_left < 0 else window_left + 1,
        diagonal_band_right_bound=None if right < 0 else right,
    )


def band_key(band: dict) -> tuple:
    return tuple(sorted((n, str(x)) for n, x in band.items()))


def _set_ragged(g, tensors: dict, names: Tuple[str, ...], b: int) -> None:
    """Give each named graph input its ragged offsets (uid name "r" + its name)."""
    for name in names:
        tensors[name].set_ragged_offset(_ragged(g, "r" + name, b))


def _declare_output(g, gt, name: str, ref: torch.Tensor, s_max: int, b: int, varlen: bool) -> None:
    """Set a graph output's uid, dims and strides from the torch tensor it is written into."""
    dims, strides = _dims(ref, varlen, s_max, b)
    if varlen:
        gt.set_ragged_offset(_ragged(g, "r" + name, b))
    gt.set_uid(UID[name]).set_output(True).set_dim(dims).set_stride(strides)


def _stats_layout(b: int, h: int, sq: int) -> Tuple[List[int], List[int]]:
    """Stats (and the row max and sum of exponents) stay dense [B, H, SQ, 1] float32 even for
    THD: the backward then needs no ragged stats."""
    return [b, h, sq, 1], [h * sq, sq, 1, 1]


def _row_tensor(g, name: str, b: int, h: int, sq: int):
    """A float32 [B, H, SQ, 1] graph tensor of one value per query row (``name`` is its uid name)."""
    import cudnn

    dims, strides = _stats_layout(b, h, sq)
    return g.tensor(name=name, dim=dims, stride=strides, data_type=cudnn.data_type.FLOAT, uid=UID[name])


def _sdpa_kwargs(t: dict, scale: float, varlen: bool, padded: bool, band: dict) -> dict:
    """What sdpa and sdpa_backward take alike: scale, per-sequence lengths and the mask band."""
    return dict(attn_scale=scale, use_padding_mask=varlen or padded, seq_len_q=t.get("len_q"), seq_len_kv=t.get("len_kv"),
                **band)


def _graph_tensors(g, tensors: dict, b: int, varlen: bool, padded: bool) -> dict:
    """Declare q/k/v-like graph inputs; ``tensors`` maps uid name -> (torch tensor, s_max)."""
    import cudnn

    out = {}
    for name, (t, s_max) in tensors.items():
        dims, strides = _dims(t, varlen, s_max, b)
        out[name] = g.tensor(name=name, dim=dims, stride=strides, data_type=_dtype(t.dtype), uid=UID[name])
    if varlen or padded:
        for name in ("len_q", "len_kv"):
            out[name] = g.tensor(name=name, dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32, uid=UID[name])
    return out


def _ragged(g, name: str, b: int):
    import cudnn

    return g.tensor(name=name, dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT64, uid=UID[name])


def _dtype(dtype: torch.dtype):
    import cudnn

    return {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float32: cudnn.data_type.FLOAT,
            torch.float8_e4m3fn: cudnn.data_type.FP8_E4M3, torch.float8_e5m2: cudnn.data_type.FP8_E5M2}[dtype]


def _round64(n: int) -> int:
    return (n + 63) // 64 * 64


def _ragged_rows(t: torch.Tensor) -> int:
    """Rows of a dense [T, H, D] tensor that span ``t``'s ragged (element) offsets. cuDNN's
    backward indexes its dQ accumulator with q's ragged offsets but sizes it in rows of H*D, so
    a packed q (t3hd/th3d: a row stride of 3*H*D) needs 3x the rows: sized by T alone it wrote
    out of bounds (an illegal instruction on the H200, probe_cudnn.log). Sized so, it no longer
    crashes, but dQ still comes out wrong (te_matrix.log), so selection refuses those layouts
    with gradients (the declaration's probed backward rules); this stays as the guard against
    the crash."""
    per_row = t.shape[1] * t.shape[2]
    return -(-t.shape[0] * t.stride(0) // per_row)


# ------------------------------------------------------------------ the two graphs


def build_fwd(handle, q, k, v, o, b, sq, skv, scale, band, varlen, padded, features: Features, with_max: bool):
    """The forward graph. Without ``with_max`` it outputs O and the stats; with it, O, the row
    max and the row sum of exponents instead of the stats (cuDNN before 9.21 outputs stats OR
    max and sum_exp, never both; ops.py derives the stats from the pair)."""
    import cudnn

    g = _new_graph(q.dtype, handle)
    t = _graph_tensors(g, dict(q=(q, sq), k=(k, skv), v=(v, skv)), b, varlen, padded)
    if varlen:
        _set_ragged(g, t, ("q", "k", "v"), b)
    h = q.shape[-2]
    rows = dict(score_max=_row_tensor(g, "max", b, h, sq), score_sum_exp=_row_tensor(g, "sum_exp", b, h, sq)) if with_max else {}
    o_t, stats_t = g.sdpa(name="sdpa", q=t["q"], k=t["k"], v=t["v"], generate_stats=not with_max, **rows,
                          **_sdpa_kwargs(t, scale, varlen, padded, band), **_feature_kwargs(g, *features))
    _declare_output(g, o_t, "o", o, sq, b, varlen)
    if with_max:
        for row in rows.values():
            row.set_output(True)
    else:
        dims, strides = _stats_layout(b, h, sq)
        stats_t.set_uid(UID["stats"]).set_output(True).set_dim(dims).set_stride(strides).set_data_type(cudnn.data_type.FLOAT)
    return _finish(g)


def build_bwd(handle, q, k, v, o, do, dq, dk, dv, grads, b, sq, skv, scale, band, varlen, padded, deterministic,
              features: Features):
    """The backward graph; ``grads`` = (dbias, dsink): the optional gradient outputs (None = not
    asked for)."""
    g = _new_graph(q.dtype, handle)
    t = _graph_tensors(g, dict(q=(q, sq), k=(k, skv), v=(v, skv), o=(o, sq), do=(do, sq)), b, varlen, padded)
    stats = _row_tensor(g, "stats", b, q.shape[-2], sq)
    if varlen:
        _set_ragged(g, t, ("q", "k", "v", "o", "do"), b)
    # Sizes the ragged dQ accumulator; rounded up as cuDNN's own THD path does.
    extra = dict(max_total_seq_len_q=_round64(_ragged_rows(q)), max_total_seq_len_kv=_round64(_ragged_rows(k))) if varlen else {}
    extra.update(_feature_kwargs(g, *features))
    dbias, dsink = grads
    if dbias is not None:
        extra["dBias"] = g.tensor(name="dbias", dim=list(dbias.shape), stride=list(dbias.stride()), data_type=_dtype(dbias.dtype),
                                  uid=UID["dbias"])
    if dsink is not None:
        extra["dSink_token"] = _sink_tensor(g, "dsink", dsink)
    dq_t, dk_t, dv_t = g.sdpa_backward(name="sdpa_backward", q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["do"], stats=stats,
                                       use_deterministic_algorithm=deterministic,
                                       **_sdpa_kwargs(t, scale, varlen, padded, band), **extra)
    for name, gt, ref, s_max in (("dq", dq_t, dq, sq), ("dk", dk_t, dk, skv), ("dv", dv_t, dv, skv)):
        _declare_output(g, gt, name, ref, s_max, b, varlen)
    return _finish(g)


# ------------------------------------------------------------------ bias, ALiBi, dropout, sinks


def sink_dims(sink: torch.Tensor) -> List[int]:
    return [1, sink.shape[0], 1, 1]  # cuDNN's sink_token is [1, H, 1, 1] float32


def _sink_tensor(g, name: str, sink: torch.Tensor):
    import cudnn

    dims = sink_dims(sink)
    return g.tensor(name=name, dim=dims, stride=[dims[1], 1, 1, 1], data_type=cudnn.data_type.FLOAT, uid=UID[name])


def _feature_kwargs(g, bias: Optional[torch.Tensor], alibi: bool, dropout_p: float, sink: Optional[torch.Tensor]) -> dict:
    """sdpa / sdpa_backward arguments for a post-scale bias, ALiBi, dropout and the sink logits."""
    import cudnn

    kwargs = {}
    if bias is not None:
        kwargs["bias"] = g.tensor(name="bias", dim=list(bias.shape), stride=list(bias.stride()), data_type=_dtype(bias.dtype),
                                  uid=UID["bias"])
    if alibi:
        kwargs["use_alibi_mask"] = True
    if dropout_p > 0:
        seed, offset = (g.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT64, uid=UID[n])
                        for n in ("seed", "offset"))
        kwargs["dropout"] = (dropout_p, seed, offset)
    if sink is not None:
        kwargs["sink_token"] = _sink_tensor(g, "sink", sink)
    return kwargs


def feature_pack(bias: Optional[torch.Tensor], rng: Optional[torch.Tensor], dropout_p: float,
                 sink: Optional[torch.Tensor]) -> dict:
    """The device tensors behind :func:`_feature_kwargs`; ``rng`` is int64 [seed, offset]."""
    pack = {}
    if bias is not None:
        pack[UID["bias"]] = bias
    if dropout_p > 0:
        if rng is None or rng.numel() != 2:
            raise ValueError("cuDNN dropout needs rng = int64 [seed, offset] on the device")
        pack[UID["seed"]], pack[UID["offset"]] = rng[0:1].view(1, 1, 1, 1), rng[1:2].view(1, 1, 1, 1)
    if sink is not None:
        if sink.dtype != torch.float32 or sink.dim() != 1:
            raise ValueError(f"cuDNN's sink must be float32 [H]; got {sink.dtype} {tuple(sink.shape)}")
        pack[UID["sink"]] = sink.contiguous().view(sink_dims(sink))
    return pack


def feature_key(bias: Optional[torch.Tensor], alibi: bool, dropout_p: float, sink: Optional[torch.Tensor]) -> tuple:
    return (None if bias is None else (tuple(bias.shape), bias.stride(), bias.dtype), alibi, dropout_p,
            None if sink is None else sink.shape[0])


# ------------------------------------------------------------------ per-sequence metadata

_Q_SIDE = frozenset({"q", "o", "do", "dq"})  # tensors with query rows (the others have key rows)


def ragged_sources(offsets_q: torch.Tensor, offsets_kv: torch.Tensor, tensors: dict) -> dict:
    """{ragged uid name: (token offsets, the tensor whose token stride scales them)}."""
    return {"r" + name: (offsets_q if name in _Q_SIDE else offsets_kv, t) for name, t in tensors.items()}


def metadata_pack(seqlens_q, seqlens_kv, ragged: dict) -> dict:
    """Per-sequence lengths, and ragged offsets (int64 ELEMENT offsets: token offset times
    that tensor's token stride) for varlen calls."""
    pack = {}
    if seqlens_q is not None:
        pack[UID["len_q"]] = derived_from(seqlens_q, "column", lambda: seqlens_q.int().view(-1, 1, 1, 1))
        pack[UID["len_kv"]] = derived_from(seqlens_kv, "column", lambda: seqlens_kv.int().view(-1, 1, 1, 1))
    # Tensors sharing offsets and token stride share one offset tensor: each costs two launches,
    # and a backward names eight (one of them, typically).
    made: Dict[Tuple[int, int], torch.Tensor] = {}
    for name, (offsets, t) in ragged.items():
        key = (id(offsets), t.stride(0))
        if key not in made:
            made[key] = _element_offsets(offsets, t.stride(0))
        pack[UID[name]] = made[key]
    return pack


def _element_offsets(offsets: torch.Tensor, stride: int) -> torch.Tensor:
    # int64 offsets the module remembers across calls (prepare/metadata_cache.py) keep their
    # element offsets too: the backward and the next layers launch nothing for them.
    return derived_from(offsets, ("elements", stride), lambda: (offsets.long() * stride).view(-1, 1, 1, 1))
