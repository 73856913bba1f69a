"""Registered custom ops around the GPU kernels, so ``torch.compile`` traces them (each has a
shape-only fake) and CUDA graphs capture them. Libraries are imported inside the op bodies.

Conventions shared by every op here: q/k/v/out are [T, H, D] (varlen, with ``cu_seqlens``
giving physical offsets and optional ``seqused`` the valid lengths) or [B, S, H, D] (dense,
``cu_seqlens`` None); windows are (left, right) with -1 unbounded; ``bottom_right`` aligns the
diagonal to the last key.

The FA4 ops write into caller-provided buffers (``out``/``lse``, ``dq``/``dk``/``dv``): FA4 leaves
the rows it skips unwritten, so the calls for several mask policies share one set of buffers
and the caller zeroes the rows no sequence owns (``gap_rows.zero_gap_rows``). ``lse`` None
runs FA4's inference variant, which stores no log-sum-exp. The cuDNN ops are functional and return
zero-filled outputs: a call leaves its gaps and tail at 0, but it may write zeros over rows of
sequences it runs with length 0, so calls for several policies do not share buffers.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import torch

from . import gap_rows

LIB = "te_attn"
_OPS: Dict[str, object] = {}  # name -> registered op (what torch.compile traces)


def _opt(w: int) -> Optional[int]:
    return None if w < 0 else w


# ------------------------------------------------------------------ FlashAttention 4 (flash_attn.cute)


def fa4_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: Optional[torch.Tensor],
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_kv: Optional[torch.Tensor],
    seqused_q: Optional[torch.Tensor],
    seqused_kv: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_kv: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    learnable_sink: Optional[torch.Tensor] = None,
) -> None:
    """``learnable_sink`` [H] float32: one extra logit per head in each softmax denominator
    (after scaling), with no value; None for the vanilla softmax."""
    from flash_attn.cute.interface import _flash_attn_fwd

    varlen = cu_seqlens_q is not None
    _flash_attn_fwd(
        q,
        k,
        v,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_kv,
        seqused_q=seqused_q,
        seqused_k=seqused_kv,
        max_seqlen_q=max_seqlen_q if varlen else None,
        max_seqlen_k=max_seqlen_kv if varlen else None,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size_left=_opt(window_left),
        window_size_right=_opt(window_right),
        **({} if learnable_sink is None else {"learnable_sink": learnable_sink}),
        return_lse=lse is not None,
        out=out,
        lse=lse,
    )


_OPS["fa4_fwd"] = torch.library.custom_op(f"{LIB}::fa4_fwd", fa4_fwd, mutates_args=("out", "lse"))


@_OPS["fa4_fwd"].register_fake
def _(q, k, v, out, lse, *args) -> None:
    return None


def fa4_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_kv: Optional[torch.Tensor],
    seqused_q: Optional[torch.Tensor],
    seqused_kv: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_kv: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    deterministic: bool,
    learnable_sink: Optional[torch.Tensor] = None,
    dsink: Optional[torch.Tensor] = None,
) -> None:
    """With ``learnable_sink`` (the forward's), this call's sink gradient is ADDED to ``dsink``
    (calls for several mask policies each reduce over their own rows)."""
    from flash_attn.cute.interface import _flash_attn_bwd

    varlen = cu_seqlens_q is not None
    grads = _flash_attn_bwd(
        q,
        k,
        v,
        out,
        dout,
        lse,
        softmax_scale,
        causal,
        0.0,
        window_size_left=_opt(window_left),
        window_size_right=_opt(window_right),
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_kv,
        seqused_q=seqused_q,
        seqused_k=seqused_kv,
        max_seqlen_q=max_seqlen_q if varlen else None,
        max_seqlen_k=max_seqlen_kv if varlen else None,
        deterministic=deterministic,
        dq=dq,
        dk=dk,
        dv=dv,
        # Only when given: FA4 releases before the sink backward lack the argument.
        **({} if learnable_sink is None else {"learnable_sink": learnable_sink}),
    )
    if dsink is not None:
        dsink.add_(grads[3])


_OPS["fa4_bwd"] = torch.library.custom_op(f"{LIB}::fa4_bwd", fa4_bwd, mutates_args=("dq", "dk", "dv", "dsink"))


@_OPS["fa4_bwd"].register_fake
def _(dout, q, k, v, out, lse, dq, dk, dv, *args) -> None:
    return None


# ------------------------------------------------------------------ cuDNN (nvidia-cudnn-frontend)

_UID = dict(q=1, k=2, v=3, o=4, stats=5, do=6, dq=7, dk=8, dv=9, len_q=10, len_kv=11, rq=12, rk=13, rv=14, ro=15, rdq=16, rdk=17, rdv=18, rdo=19,
            bias=20, dbias=21, seed=22, offset=23)
# Built graphs by configuration, least recently used first; bounded, since each holds cuDNN
# plans and a training run with many shapes (or a per-batch max_seqlen) keeps making new ones.
_graphs: "OrderedDict[tuple, tuple]" = OrderedDict()
MAX_GRAPHS = 256
_graph_lock = threading.Lock()
_handles = threading.local()


def _handle(device: torch.device):
    import cudnn

    cache = getattr(_handles, "by_device", None)
    if cache is None:
        cache = _handles.by_device = {}
    if device not in cache:
        with torch.cuda.device(device):
            cache[device] = cudnn.create_handle()
    cudnn.set_stream(handle=cache[device], stream=torch.cuda.current_stream(device).cuda_stream)
    return cache[device]


def _desc(t: torch.Tensor, varlen: bool, s_max: int) -> Tuple[List[int], List[int]]:
    """cuDNN's [B, H, S, D] dims and strides for a [T, H, D] (varlen) or [B, S, H, D] tensor.

    Varlen batch strides are placeholders: ragged offsets give each sequence's base."""
    if varlen:
        st, sh, sd = t.stride()
        return [0, t.shape[1], s_max, t.shape[2]], [s_max * st, sh, st, sd]
    sb, ss, sh, sd = t.stride()
    return [t.shape[0], t.shape[2], t.shape[1], t.shape[3]], [sb, sh, ss, sd]


def _band_kwargs(causal: bool, window_left: int, window_right: int, bottom_right: bool) -> dict:
    import cudnn

    right = 0 if causal else window_right
    return dict(
        diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT if bottom_right else cudnn.diagonal_alignment.TOP_LEFT,
        # cuDNN's left bound counts the diagonal itself: left = window_left + 1.
        diagonal_band_left_bound=None if window_left < 0 else window_left + 1,
        diagonal_band_right_bound=None if right < 0 else right,
    )


def _graph_tensors(g, tensors: dict, b: int, varlen: bool, s: dict) -> dict:
    """Declare q/k/v-like graph inputs; ``tensors`` maps uid name -> (torch tensor, s_max)."""
    import cudnn

    out = {}
    for name, (t, s_max) in tensors.items():
        dims, strides = _desc(t, varlen, s_max)
        if varlen:
            dims[0] = b
        out[name] = g.tensor(name=name, dim=dims, stride=strides, data_type=_dtype(t.dtype), uid=_UID[name])
    if varlen or s.get("padded"):
        for name in ("len_q", "len_kv"):
            out[name] = g.tensor(name=name, dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32, uid=_UID[name])
    return out


def _ragged(g, name: str, b: int):
    import cudnn

    return g.tensor(name=name, dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT64, uid=_UID[name])


def _dtype(dtype: torch.dtype):
    import cudnn

    return {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16}[dtype]


def _round64(n: int) -> int:
    return (n + 63) // 64 * 64


def _ragged_rows(t: torch.Tensor) -> int:
    """Rows of a dense [T, H, D] tensor that span ``t``'s ragged (element) offsets. cuDNN's
    backward indexes its dQ accumulator with q's ragged offsets but sizes it in rows of H*D, so
    a packed q (t3hd/th3d: a row stride of 3*H*D) needs 3x the rows: sized by T alone it wrote
    out of bounds (an illegal instruction on the H200, probe_cudnn.log)."""
    per_row = t.shape[1] * t.shape[2]
    return -(-t.shape[0] * t.stride(0) // per_row)


def _finish(g):
    import cudnn

    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g, g.get_workspace_size()


def _cached(key, build):
    with _graph_lock:
        hit = _graphs.get(key)
        if hit is not None:
            _graphs.move_to_end(key)
            return hit
        hit = _graphs[key] = build()
        while len(_graphs) > MAX_GRAPHS:
            _graphs.popitem(last=False)
    return hit


def _new_graph(dtype, handle):
    import cudnn

    return cudnn.pygraph(
        handle=handle,
        io_data_type=_dtype(dtype),
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
    )


def _build_fwd(handle, q, k, v, o, b, sq, skv, scale, band, varlen, padded, features):
    import cudnn

    g = _new_graph(q.dtype, handle)
    t = _graph_tensors(g, dict(q=(q, sq), k=(k, skv), v=(v, skv)), b, varlen, dict(padded=padded))
    if varlen:
        for name, rag in (("q", "rq"), ("k", "rk"), ("v", "rv")):
            t[name].set_ragged_offset(_ragged(g, rag, b))
    o_t, stats_t = g.sdpa(
        name="sdpa",
        q=t["q"],
        k=t["k"],
        v=t["v"],
        generate_stats=True,
        attn_scale=scale,
        use_padding_mask=varlen or padded,
        seq_len_q=t.get("len_q"),
        seq_len_kv=t.get("len_kv"),
        **band,
        **_feature_kwargs(g, *features),
    )
    dims, strides = _desc(o, varlen, sq)
    if varlen:
        dims[0] = b
        o_t.set_ragged_offset(_ragged(g, "ro", b))
    o_t.set_uid(_UID["o"]).set_output(True).set_dim(dims).set_stride(strides)
    # Stats stay dense [B, H, SQ, 1] even for THD: the backward then needs no ragged stats.
    h = q.shape[-2]
    stats_t.set_uid(_UID["stats"]).set_output(True).set_dim([b, h, sq, 1]).set_stride([h * sq, sq, 1, 1]).set_data_type(cudnn.data_type.FLOAT)
    return _finish(g)


def _band_key(band: dict) -> tuple:
    return tuple(sorted((n, str(x)) for n, x in band.items()))


def _feature_kwargs(g, bias: Optional[torch.Tensor], alibi: bool, dropout_p: float) -> dict:
    """sdpa / sdpa_backward arguments for a post-scale bias, ALiBi and dropout."""
    import cudnn

    kwargs = {}
    if bias is not None:
        kwargs["bias"] = g.tensor(name="bias", dim=list(bias.shape), stride=list(bias.stride()), data_type=_dtype(bias.dtype),
                                  uid=_UID["bias"])
    if alibi:
        kwargs["use_alibi_mask"] = True
    if dropout_p > 0:
        seed, offset = (g.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT64, uid=_UID[n])
                        for n in ("seed", "offset"))
        kwargs["dropout"] = (dropout_p, seed, offset)
    return kwargs


def _feature_pack(bias: Optional[torch.Tensor], rng: Optional[torch.Tensor], dropout_p: float) -> dict:
    """The device tensors behind :func:`_feature_kwargs`; ``rng`` is int64 [seed, offset]."""
    pack = {}
    if bias is not None:
        pack[_UID["bias"]] = bias
    if dropout_p > 0:
        if rng is None or rng.numel() != 2:
            raise ValueError("cuDNN dropout needs rng = int64 [seed, offset] on the device")
        pack[_UID["seed"]], pack[_UID["offset"]] = rng[0:1].view(1, 1, 1, 1), rng[1:2].view(1, 1, 1, 1)
    return pack


def _feature_key(bias: Optional[torch.Tensor], alibi: bool, dropout_p: float) -> tuple:
    return (None if bias is None else (tuple(bias.shape), bias.stride(), bias.dtype), alibi, dropout_p)


def _run_graph(key, build, pack: dict, device) -> None:
    """Build (once per key) and execute a cuDNN graph on torch's current stream."""
    handle = _handle(device)
    g, ws = _cached(key, lambda: build(handle))
    workspace = torch.empty(max(ws, 1), dtype=torch.uint8, device=device)
    g.execute(pack, workspace, handle=handle)


def _metadata_pack(seqlens_q, seqlens_kv, ragged: dict) -> dict:
    """Per-sequence lengths, and ragged offsets (int64 ELEMENT offsets: token offset times
    that tensor's token stride) for varlen calls."""
    pack = {}
    if seqlens_q is not None:
        pack[_UID["len_q"]] = seqlens_q.int().view(-1, 1, 1, 1)
        pack[_UID["len_kv"]] = seqlens_kv.int().view(-1, 1, 1, 1)
    # Tensors sharing offsets and token stride share one offset tensor: each costs two launches,
    # and a backward names eight (one of them, typically).
    made: Dict[Tuple[int, int], torch.Tensor] = {}
    for name, (offsets, t) in ragged.items():
        key = (id(offsets), t.stride(0))
        if key not in made:
            made[key] = (offsets.long() * t.stride(0)).view(-1, 1, 1, 1)
        pack[_UID[name]] = made[key]
    return pack


def cudnn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets_q: Optional[torch.Tensor],
    offsets_kv: Optional[torch.Tensor],
    seqlens_q: Optional[torch.Tensor],
    seqlens_kv: Optional[torch.Tensor],
    batch_size: int,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    bias: Optional[torch.Tensor] = None,
    rng: Optional[torch.Tensor] = None,
    alibi: bool = False,
    dropout_p: float = 0.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns out (like q, head dim of v; rows the kernel skips are 0) and stats [B, H, SQ, 1].

    ``bias`` [B|1, H|1, SQ, SKV] is added after scaling; ``alibi`` adds cuDNN's own ALiBi (its
    standard slopes; needs a causal mask); ``dropout_p`` > 0 drops probabilities with the
    Philox stream of ``rng`` (int64 [seed, offset]), which the backward must receive again."""
    varlen, padded = offsets_q is not None, seqlens_q is not None
    b, sq, skv = batch_size, max(max_seqlen_q, 1), max(max_seqlen_kv, 1)
    band = _band_kwargs(causal, window_left, window_right, bottom_right)
    features = (bias, alibi, dropout_p)
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    stats = q.new_empty(stats_shape(q, batch_size, max_seqlen_q), dtype=torch.float32)
    key = ("fwd", q.dtype, b, sq, skv, q.shape[1:], k.shape[1:], v.shape[1:], q.stride(), k.stride(), v.stride(),
           out.stride(), softmax_scale, _band_key(band), varlen, padded, _feature_key(*features), q.device)
    pack = {_UID["q"]: q, _UID["k"]: k, _UID["v"]: v, _UID["o"]: out, _UID["stats"]: stats}
    ragged = dict(rq=(offsets_q, q), rk=(offsets_kv, k), rv=(offsets_kv, v), ro=(offsets_q, out)) if varlen else {}
    pack.update(_metadata_pack(seqlens_q, seqlens_kv, ragged))
    pack.update(_feature_pack(bias, rng, dropout_p))
    build = lambda h: _build_fwd(h, q, k, v, out, b, sq, skv, softmax_scale, band, varlen, padded, features)  # noqa: E731
    _run_graph(key, build, pack, q.device)
    return out, stats


_OPS["cudnn_fwd"] = torch.library.custom_op(f"{LIB}::cudnn_fwd", cudnn_fwd, mutates_args=())


@_OPS["cudnn_fwd"].register_fake
def _(q, k, v, offsets_q, offsets_kv, seqlens_q, seqlens_kv, batch_size, max_seqlen_q, *args):
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(stats_shape(q, batch_size, max_seqlen_q), dtype=torch.float32)


def stats_shape(q: torch.Tensor, batch_size: int, max_seqlen_q: int) -> Tuple[int, int, int, int]:
    return (batch_size, q.shape[-2], max(max_seqlen_q, 1), 1)


def _build_bwd(handle, q, k, v, o, do, dq, dk, dv, dbias, b, sq, skv, scale, band, varlen, padded, deterministic, features):
    import cudnn

    g = _new_graph(q.dtype, handle)
    t = _graph_tensors(g, dict(q=(q, sq), k=(k, skv), v=(v, skv), o=(o, sq), do=(do, sq)), b, varlen, dict(padded=padded))
    h = q.shape[-2]
    stats = g.tensor(name="stats", dim=[b, h, sq, 1], stride=[h * sq, sq, 1, 1], data_type=cudnn.data_type.FLOAT, uid=_UID["stats"])
    if varlen:
        for name, rag in (("q", "rq"), ("k", "rk"), ("v", "rv"), ("o", "ro"), ("do", "rdo")):
            t[name].set_ragged_offset(_ragged(g, rag, b))
    # Sizes the ragged dQ accumulator; rounded up as cuDNN's own THD path does.
    extra = dict(max_total_seq_len_q=_round64(_ragged_rows(q)), max_total_seq_len_kv=_round64(_ragged_rows(k))) if varlen else {}
    extra.update(_feature_kwargs(g, *features))
    if dbias is not None:
        extra["dBias"] = g.tensor(name="dbias", dim=list(dbias.shape), stride=list(dbias.stride()), data_type=_dtype(dbias.dtype),
                                  uid=_UID["dbias"])
    dq_t, dk_t, dv_t = g.sdpa_backward(
        name="sdpa_backward",
        q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["do"], stats=stats,
        attn_scale=scale,
        use_padding_mask=varlen or padded,
        seq_len_q=t.get("len_q"),
        seq_len_kv=t.get("len_kv"),
        use_deterministic_algorithm=deterministic,
        **extra,
        **band,
    )
    for name, gt, ref, s_max in (("dq", dq_t, dq, sq), ("dk", dk_t, dk, skv), ("dv", dv_t, dv, skv)):
        dims, strides = _desc(ref, varlen, s_max)
        if varlen:
            dims[0] = b
            gt.set_ragged_offset(_ragged(g, "r" + name, b))
        gt.set_uid(_UID[name]).set_output(True).set_dim(dims).set_stride(strides)
    return _finish(g)


def cudnn_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    stats: torch.Tensor,
    offsets_q: Optional[torch.Tensor],
    offsets_kv: Optional[torch.Tensor],
    seqlens_q: Optional[torch.Tensor],
    seqlens_kv: Optional[torch.Tensor],
    batch_size: int,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    deterministic: bool,
    bias: Optional[torch.Tensor] = None,
    rng: Optional[torch.Tensor] = None,
    alibi: bool = False,
    dropout_p: float = 0.0,
    need_dbias: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns dq/dk/dv (contiguous; rows the kernel skips are 0) and dbias (like ``bias`` when
    ``need_dbias``, else an empty tensor); ``dout`` needs ``out``'s strides. ``bias``, ``rng``,
    ``alibi`` and ``dropout_p`` must be those of the forward."""
    varlen, padded = offsets_q is not None, seqlens_q is not None
    dq, dk, dv = (torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    dbias = torch.zeros(bias.shape, dtype=bias.dtype, device=bias.device) if need_dbias and bias is not None else None
    b, sq, skv = batch_size, max(max_seqlen_q, 1), max(max_seqlen_kv, 1)
    band = _band_kwargs(causal, window_left, window_right, bottom_right)
    features = (bias, alibi, dropout_p)
    key = ("bwd", q.dtype, b, sq, skv, q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), out.stride(),
           dq.stride(), dk.stride(), dv.stride(), softmax_scale, _band_key(band), varlen, padded, deterministic,
           _feature_key(*features), dbias is not None, q.device)
    pack = {_UID["q"]: q, _UID["k"]: k, _UID["v"]: v, _UID["o"]: out, _UID["do"]: dout, _UID["stats"]: stats,
            _UID["dq"]: dq, _UID["dk"]: dk, _UID["dv"]: dv}
    pack.update(_feature_pack(bias, rng, dropout_p))
    if dbias is not None:
        pack[_UID["dbias"]] = dbias
    ragged = {}
    if varlen:
        ragged = dict(rq=(offsets_q, q), rk=(offsets_kv, k), rv=(offsets_kv, v), ro=(offsets_q, out), rdo=(offsets_q, dout),
                      rdq=(offsets_q, dq), rdk=(offsets_kv, dk), rdv=(offsets_kv, dv))
    pack.update(_metadata_pack(seqlens_q, seqlens_kv, ragged))
    build = lambda h: _build_bwd(h, q, k, v, out, dout, dq, dk, dv, dbias, b, sq, skv, softmax_scale, band, varlen, padded,  # noqa: E731
                                 deterministic, features)
    _run_graph(key, build, pack, q.device)
    return dq, dk, dv, (dbias if dbias is not None else q.new_empty(0))


_OPS["cudnn_bwd"] = torch.library.custom_op(f"{LIB}::cudnn_bwd", cudnn_bwd, mutates_args=())


@_OPS["cudnn_bwd"].register_fake
def _(dout, q, k, v, out, stats, offsets_q, offsets_kv, seqlens_q, seqlens_kv, batch_size, max_seqlen_q, max_seqlen_kv,
      softmax_scale, causal, window_left, window_right, bottom_right, deterministic, bias=None, rng=None, alibi=False,
      dropout_p=0.0, need_dbias=False):
    dbias = bias.new_empty(bias.shape) if need_dbias and bias is not None else q.new_empty(0)
    return (*(q.new_empty(t.shape) for t in (q, k, v)), dbias)


_EAGER = {"fa4_fwd": fa4_fwd, "fa4_bwd": fa4_bwd, "cudnn_fwd": cudnn_fwd, "cudnn_bwd": cudnn_bwd,
          "zero_gap_rows": gap_rows.zero_gap_rows, "zero_gap_rows_qkv": gap_rows.zero_gap_rows_qkv}


class KernelOps:
    """``ops.<name>(...)``: the registered op while torch.compile traces, the plain function in
    eager mode. Both run the same body; the dispatcher's Python layers around a custom op cost
    about 25 us per call (measured on a CPU core), and a training step makes several calls."""

    def __getattr__(self, name: str):
        if torch.compiler.is_compiling():
            return getattr(torch.ops.te_attn, name)
        return _EAGER[name]


ops = KernelOps()
