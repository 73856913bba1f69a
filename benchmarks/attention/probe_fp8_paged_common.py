"""Shared pieces of probe_fp8_paged.py (issues #24 and #25): the float32 reference, the error
measures, per-tensor FP8 quantization, cuDNN graph plumbing, timing, and the result records.

Every result is one JSON object printed on its own line after ``RESULT `` (the driver collects
them); a question's cases run through :func:`run_case`, which turns any exception into a record
and goes on. Import this only in the worker: it imports torch.
"""

from __future__ import annotations

import json
import math
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

RESULT_TAG = "RESULT "
E4M3, E5M2, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
DTYPE_NAMES = {E4M3: "E4M3", E5M2: "E5M2", BF16: "BF16", torch.float16: "FP16", torch.float32: "FP32"}
# TE's fp8_vs_f16 acceptance: RMSE below 0.11 x the reference's value range.
TE_RMSE_OVER_RANGE = 0.11


class Refused(Exception):
    """A library declined the configuration while building (validation, support check, plans)."""


# ------------------------------------------------------------------ records


def emit(question: str, case: str, **fields) -> None:
    print(RESULT_TAG + json.dumps(dict(q=question, case=case, **fields), default=_plain), flush=True)


def _plain(x):
    if isinstance(x, torch.dtype):
        return DTYPE_NAMES.get(x, str(x))
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return str(x)


# Cases to pass over silently, by question: a worker restarted after a crash resumes there.
SKIP_CASES: Dict[str, int] = {}
_CASES_SEEN: Dict[str, int] = {}


def run_case(question: str, case: str, fn: Callable[[], dict], deadline: float) -> Optional[dict]:
    """Run one case; record its fields, or its exception (a build refusal as "refused", anything
    else as "error"), and return the fields (None on failure). A case left when the question's
    time is up is recorded as skipped."""
    index = _CASES_SEEN.get(question, 0)
    _CASES_SEEN[question] = index + 1
    if index < SKIP_CASES.get(question, 0):
        return None
    if time.time() > deadline:
        emit(question, case, status="skipped", error="the question's time cap was reached")
        return None
    print(f"CASE {case}", flush=True)  # the driver names it if the worker dies or hangs in it
    t0 = time.time()
    try:
        fields = fn()
        torch.cuda.synchronize()
    except Refused as e:
        emit(question, case, status="refused", error=str(e)[:2500], secs=round(time.time() - t0, 2))
        return None
    except Exception as e:  # noqa: BLE001 - the probe records every failure as data
        text = f"{type(e).__name__}: {e}"[:2500]
        emit(question, case, status="error", error=text, secs=round(time.time() - t0, 2))
        if _context_poisoned(text):
            raise SystemExit(3)  # the CUDA context is gone: the driver starts a fresh worker
        return None
    status = fields.pop("status", "ok" if fields.get("match", True) else "mismatch")
    emit(question, case, status=status, secs=round(time.time() - t0, 2), **fields)
    return fields


def _context_poisoned(text: str) -> bool:
    return any(s in text for s in ("illegal memory access", "illegal instruction", "unspecified launch failure",
                                   "misaligned address", "CUDA error: an illegal"))


def environment() -> dict:
    import cudnn

    props = torch.cuda.get_device_properties(0)
    return dict(gpu=props.name, cc=f"{props.major}.{props.minor}", torch=torch.__version__, cuda=torch.version.cuda,
                cudnn_backend=cudnn.backend_version(), cudnn_frontend=getattr(cudnn, "__version__", "?"))


# ------------------------------------------------------------------ numbers


def compare(got: torch.Tensor, ref: torch.Tensor, valid: Optional[torch.Tensor] = None) -> dict:
    """max |got - ref|, RMSE and RMSE / range of ref over the rows ``valid`` selects (a bool mask
    over the leading dims), and whether ``got`` is finite there."""
    g, r = got.float(), ref.float()
    if valid is not None:
        g, r = g[valid], r[valid]
    finite = bool(torch.isfinite(g).all())
    diff = (g - r).nan_to_num(nan=float("inf"))
    rmse = diff.pow(2).mean().sqrt().item()
    value_range = (r.max() - r.min()).item()
    return dict(finite=finite, max_abs_err=_round(diff.abs().max().item()), rmse=_round(rmse),
                ref_range=_round(value_range), rmse_over_range=_round(rmse / value_range if value_range else float("nan")),
                ref_absmax=_round(r.abs().max().item()))


def _round(x: float) -> float:
    return float(f"{x:.4g}") if math.isfinite(x) else x


def prefixed(prefix: str, fields: dict) -> dict:
    return {prefix + k: v for k, v in fields.items()}


def allowed_mask(b: int, sq: int, skv: int, causal: bool, lens_q, lens_kv, bottom_right: bool, device) -> torch.Tensor:
    """[B, 1, Sq, Skv] True where query i of sequence b may see key j: inside both lengths and,
    if causal, j <= i (+ len_kv - len_q where the diagonal is bottom-right aligned)."""
    lq = torch.full((b,), sq, device=device) if lens_q is None else torch.as_tensor(lens_q, device=device)
    lk = torch.full((b,), skv, device=device) if lens_kv is None else torch.as_tensor(lens_kv, device=device)
    i = torch.arange(sq, device=device).view(1, sq, 1)
    j = torch.arange(skv, device=device).view(1, 1, skv)
    ok = (j < lk.view(b, 1, 1)) & (i < lq.view(b, 1, 1))
    if causal:
        shift = (lk - lq).view(b, 1, 1) if bottom_right else 0
        ok = ok & (j <= i + shift)
    return ok.unsqueeze(1)


def reference(q, k, v, scale: float, causal: bool, lens_q=None, lens_kv=None, bottom_right=False):
    """Attention in float32 (TF32 off): q [B, Sq, H, D], k/v [B, Skv, Hkv, D] (GQA: query head h
    reads key head h // (H / Hkv)); returns out [B, Sq, H, Dv] (rows past len_q zero) and the
    log-sum-exp [B, H, Sq]. Masked scores are a large negative number rather than -inf, so rows
    without keys stay finite (and differentiable); callers compare valid rows only."""
    b, sq, h, _ = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    kf = k.float().repeat_interleave(h // hkv, dim=2)
    vf = v.float().repeat_interleave(h // hkv, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), kf) * scale
    ok = allowed_mask(b, sq, skv, causal, lens_q, lens_kv, bottom_right, q.device)
    scores = scores.masked_fill(~ok, -1e30)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), vf)
    row_ok = ok.any(dim=-1).squeeze(1)  # [B, Sq]
    return out * row_ok.unsqueeze(-1).unsqueeze(-1), lse


def reference_grads(q, k, v, scale: float, causal: bool, dout, lens=None):
    """The reference's float32 autograd gradients (q/k/v as :func:`reference` takes them): returns
    (out, lse, (dq, dk, dv), amax of dS = P * (dP - rowsum(dO * O)) * scale), the last for
    comparing with cuDNN's amax_dP."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = reference(*leaves, scale, causal, lens, lens)
    out.backward(dout)
    with torch.no_grad():
        delta = (out * dout).sum(-1)  # [B, S, H]
        ds_amax = _ds_amax(*leaves, dout, delta, scale, causal, lens)
    return out.detach(), lse.detach(), tuple(t.grad for t in leaves), ds_amax


def _ds_amax(q, k, v, dout, delta, scale, causal, lens):
    rep = q.shape[2] // k.shape[2]
    kf, vf = (t.detach().float().repeat_interleave(rep, dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q.detach().float(), kf) * scale
    ok = allowed_mask(q.shape[0], q.shape[1], k.shape[1], causal, lens, lens, False, q.device)
    p = torch.softmax(s.masked_fill(~ok, -1e30), dim=-1)
    dp = torch.einsum("bqhd,bkhd->bhqk", dout.float(), vf)
    return (p * (dp - delta.permute(0, 2, 1).unsqueeze(-1)) * scale).abs().amax()


def dout_v_amax(dout: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """amax of dO V^T over all (query, key) pairs: cudnn-frontend's tests scale dP from it."""
    vf = v.float().repeat_interleave(dout.shape[2] // v.shape[2], dim=2)
    return torch.einsum("bqhd,bkhd->bhqk", dout.float(), vf).abs().amax()


def quantize(x: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor current scaling (TE's formula with margin 0): scale = fp8_max / amax(x).
    Returns the FP8 tensor (x's layout kept) and its descale as a float32 [1, 1, 1, 1] device
    tensor."""
    scale = FP8_MAX[dtype] / x.abs().amax().float().clamp_min(1e-12)
    xq = (x.float() * scale).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
    return xq, (1.0 / scale).reshape(1, 1, 1, 1).contiguous()


def scale_for(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scale that maps ``amax`` to the largest value of ``dtype`` (1 for a 16-bit dtype)."""
    if dtype not in FP8_MAX:
        return torch.ones(1, 1, 1, 1, device=amax.device)
    return (FP8_MAX[dtype] / amax.float().clamp_min(1e-12)).reshape(1, 1, 1, 1).contiguous()


def scalar_value(t: torch.Tensor) -> float:
    return _round(float(t.float().reshape(-1)[0].item()))


def time_calls(fn: Callable[[], None], warmup: int = 3, reps: int = 20) -> dict:
    """Eager, graph-free timing after ``warmup`` calls: ``ms_per_call`` is the CUDA-event time of
    ``reps`` back-to-back calls (where the host is slower than the GPU this is launch overhead,
    which ``host_ms_per_call`` shows), ``kernel_ms_per_call`` the same calls queued behind a GPU
    sleep so they run back to back on the device (valid when ``kernel_timing_queued``: the host
    had enqueued them all before the sleep ended)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    host_s = time.perf_counter() - t0
    end.synchronize()
    out = dict(ms_per_call=_round(start.elapsed_time(end) / reps), host_ms_per_call=_round(host_s * 1e3 / reps), reps=reps,
               warmup=warmup)
    out.update(_queued_time(fn, reps))
    return out


SLEEP_CYCLES = 200_000_000  # about 0.1 s of GPU clock: longer than enqueueing 20 calls


def _queued_time(fn: Callable[[], None], reps: int) -> dict:
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return {}
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    torch.cuda.synchronize()
    events[0].record()
    sleep(SLEEP_CYCLES)
    events[1].record()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    events[2].record()
    host_ms = (time.perf_counter() - t0) * 1e3
    events[2].synchronize()
    return dict(kernel_ms_per_call=_round(events[1].elapsed_time(events[2]) / reps),
                kernel_timing_queued=host_ms < events[0].elapsed_time(events[1]))


# ------------------------------------------------------------------ cuDNN graphs

UID = {name: i + 1 for i, name in enumerate((
    "q", "k", "v", "o", "stats", "do", "dq", "dk", "dv", "len_q", "len_kv", "off_q", "off_kv", "off_stats",
    "descale_q", "descale_k", "descale_v", "descale_o", "descale_do", "descale_s", "descale_dp",
    "scale_s", "scale_o", "scale_dq", "scale_dk", "scale_dv", "scale_dp",
    "amax_s", "amax_o", "amax_dq", "amax_dk", "amax_dv", "amax_dp", "table_k", "table_v"))}
_HANDLE: List = []


def handle():
    """One cuDNN handle, bound to torch's current stream."""
    import cudnn

    if not _HANDLE:
        _HANDLE.append(cudnn.create_handle())
    cudnn.set_stream(handle=_HANDLE[0], stream=torch.cuda.current_stream().cuda_stream)
    return _HANDLE[0]


def cudnn_dtype(dtype: torch.dtype):
    import cudnn

    return {E4M3: cudnn.data_type.FP8_E4M3, E5M2: cudnn.data_type.FP8_E5M2, BF16: cudnn.data_type.BFLOAT16,
            torch.float16: cudnn.data_type.HALF, torch.float32: cudnn.data_type.FLOAT,
            torch.int32: cudnn.data_type.INT32, torch.int64: cudnn.data_type.INT64}[dtype]


def bhsd(t: torch.Tensor) -> Tuple[List[int], List[int]]:
    """cuDNN's [B, H, S, D] dims and strides for a [B, S, H, D]-shaped view of any layout (a page
    pool viewed as [pages, page_size, H, D] gives [pages, H, page_size, D])."""
    return [t.shape[0], t.shape[2], t.shape[1], t.shape[3]], [t.stride(0), t.stride(2), t.stride(1), t.stride(3)]


def new_graph(io_dtype: torch.dtype):
    import cudnn

    return cudnn.pygraph(handle=handle(), io_data_type=cudnn_dtype(io_dtype), intermediate_data_type=cudnn.data_type.FLOAT,
                         compute_data_type=cudnn.data_type.FLOAT)


def graph_input(g, name: str, dims: Sequence[int], strides: Sequence[int], dtype: torch.dtype):
    return g.tensor(name=name, dim=list(dims), stride=list(strides), data_type=cudnn_dtype(dtype), uid=UID[name])


def graph_scalar(g, name: str):
    return graph_input(g, name, [1, 1, 1, 1], [1, 1, 1, 1], torch.float32)


def graph_output(t, name: str, dims: Sequence[int], strides: Sequence[int], dtype: torch.dtype) -> None:
    t.set_uid(UID[name]).set_output(True).set_dim(list(dims)).set_stride(list(strides)).set_data_type(cudnn_dtype(dtype))


def finish(g) -> Tuple[object, int]:
    """Validate, plan and build as the package's cuDNN backend does; any failure is a
    :class:`Refused` carrying the library's text."""
    from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn.graphs import _finish

    try:
        return _finish(g)
    except Exception as e:  # noqa: BLE001 - a refusal is data here
        raise Refused(f"{type(e).__name__}: {e}") from e


def executor(built: Tuple[object, int], pack: Dict[str, torch.Tensor]) -> Callable[[], None]:
    """A call that executes the built graph on ``pack`` (uid names -> tensors) with a workspace
    allocated once (what the timing loop calls)."""
    g, ws = built
    workspace = torch.empty(max(ws, 1), dtype=torch.uint8, device="cuda")
    by_uid = {UID[name]: t for name, t in pack.items()}
    h = handle()
    return lambda: g.execute(by_uid, workspace, handle=h)


def execute(built: Tuple[object, int], pack: Dict[str, torch.Tensor]) -> None:
    executor(built, pack)()


def nans(shape, dtype=torch.float32) -> torch.Tensor:
    """An output buffer filled with NaN: a row a kernel does not write stays non-finite (an empty
    buffer could hold an earlier case's result and pass for one)."""
    # Filled in float32 and cast: the cast to an FP8 dtype is the path quantize() uses anyway.
    return torch.full(tuple(shape), float("nan"), dtype=torch.float32, device="cuda").to(dtype)


def amax_buffer() -> torch.Tensor:
    return nans((1, 1, 1, 1))
