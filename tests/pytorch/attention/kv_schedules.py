"""The KV-cache schedules the CPU and GPU tests share: a configuration strategy (hypothesis), a
schedule of sequences joining, growing and finishing (:class:`Simulation`, driven by a
:class:`Picker`), how a step's tokens are packed (padding NaN), the float64 oracle that recomputes
each sequence over its whole history without a cache, a guard against host reads, and the
generation example (``examples/generate.py``) loaded as a module."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import random
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from hypothesis import strategies as st

from transformer_engine.pytorch.attention.inference import InferenceParams

from .reference import allowed_matrix, attend_one

LAYERS = (1, 2)
MASKS = ("padding_causal", "padding_causal_bottom_right", "padding")
WINDOWS = (None, (1, -1), (0, 0), (2, 1), (-1, 0))
NAN = float("nan")


@dataclass(frozen=True)
class Config:
    fmt: str
    paged: bool
    page_size: int
    max_seqlen: int
    max_batch: int
    total_pages: Optional[int]
    hkv: int
    group: int
    d: int
    dv: int
    max_ctx: int
    mask: str
    window: Optional[Tuple[int, int]]
    device: str = "cpu"

    @property
    def heads(self) -> int:
        return self.hkv * self.group

    def params(self, **overrides) -> InferenceParams:
        kwargs = dict(max_batch_size=self.max_batch, max_sequence_length=self.max_seqlen, num_heads_kv=self.hkv,
                      head_dim_k=self.d, dtype=torch.float64, head_dim_v=self.dv, is_paged=self.paged,
                      total_num_pages=self.total_pages, page_size=self.page_size if self.paged else None,
                      max_ctx_len=self.max_ctx, qkv_format=self.fmt, device=self.device)
        kwargs.update(overrides)
        return InferenceParams(**kwargs)


@st.composite
def configs(draw, fmt=None) -> Config:
    paged = draw(st.booleans())
    page_size = draw(st.integers(1, 4)) if paged else 1
    max_seqlen = page_size * draw(st.integers(2, 5)) if paged else draw(st.integers(2, 12))
    max_batch = draw(st.integers(1, 4))
    per_seq = max_seqlen // page_size
    return Config(
        fmt=fmt or draw(st.sampled_from(["bshd", "sbhd", "thd"])),
        paged=paged,
        page_size=page_size,
        max_seqlen=max_seqlen,
        max_batch=max_batch,
        total_pages=draw(st.integers(per_seq, max_batch * per_seq)) if paged else None,
        hkv=draw(st.integers(1, 2)),
        group=draw(st.integers(1, 3)),
        d=draw(st.integers(1, 4)),
        dv=draw(st.integers(1, 4)),
        max_ctx=draw(st.integers(1, max_seqlen)),
        mask=draw(st.sampled_from(MASKS)),
        window=draw(st.sampled_from(WINDOWS)),
    )


class Picker:
    """The schedule's choices: drawn by hypothesis (``data``) or by a seeded ``random.Random``."""

    def __init__(self, data=None, rng: Optional[random.Random] = None) -> None:
        self.data, self.rng = data, rng

    def int(self, lo: int, hi: int, label: str) -> int:
        return self.data.draw(st.integers(lo, hi), label=label) if self.data else self.rng.randint(lo, hi)

    def order(self, items: list) -> list:
        return self.data.draw(st.permutations(items), label="batch order") if self.data else self.rng.sample(items, len(items))


class Simulation:
    """The schedule's ground truth: each live sequence's whole history (q, k, v) per layer."""

    def __init__(self, cfg: Config, seed: int) -> None:
        self.cfg = cfg
        self.gen = torch.Generator().manual_seed(seed)
        self.lengths: "OrderedDict[int, int]" = OrderedDict()  # batch order of the last step
        self.history: Dict[Tuple[int, int], List[torch.Tensor]] = {}
        self.left: List[int] = []  # finished ids, which may join again as new sequences
        self.next_id = 0

    def draw_step(self, pick: "Picker") -> "OrderedDict[int, int]":
        cfg, steps = self.cfg, {}
        for seq, n in self.lengths.items():
            room = cfg.max_seqlen - n
            if room > 0 and pick.int(0, 2, f"finish {seq}?") > 0:
                steps[seq] = pick.int(1, min(2, room, cfg.max_ctx), "decode")
        for _ in range(pick.int(0 if steps else 1, cfg.max_batch - len(steps), "joins")):
            if self.left and pick.int(0, 1, "re-join?"):
                seq = self.left.pop(0)
            else:
                seq, self.next_id = self.next_id, self.next_id + 1
            steps[seq] = pick.int(1, cfg.max_ctx, "prefill")
        return OrderedDict((seq, steps[seq]) for seq in pick.order(list(steps)))

    def fits_pool(self, step_dict) -> bool:
        ps = self.cfg.page_size
        return sum(-(-(self.lengths.get(s, 0) + n) // ps) for s, n in step_dict.items()) <= self.cfg.total_pages

    def apply(self, step_dict) -> None:
        cfg = self.cfg
        self.left += [seq for seq in self.lengths if seq not in step_dict]
        for seq, n in step_dict.items():
            for layer in LAYERS:
                new = [torch.randn(n, h, d, generator=self.gen, dtype=torch.float64)
                       for h, d in ((cfg.heads, cfg.d), (cfg.hkv, cfg.d), (cfg.hkv, cfg.dv))]
                old = self.history.get((layer, seq)) if seq in self.lengths else None
                self.history[(layer, seq)] = new if old is None else [torch.cat(p) for p in zip(old, new)]
        self.lengths = OrderedDict((seq, self.lengths.get(seq, 0) + n) for seq, n in step_dict.items())

    def reset(self) -> None:
        self.left += list(self.lengths)
        self.lengths = OrderedDict()


@functools.lru_cache(maxsize=None)
def _full_mask(m: int, causal: bool, window) -> torch.Tensor:
    return allowed_matrix(m, m, "causal" if causal else "no_mask", window)


def oracle(sim: Simulation, layer: int, seq: int, n: int) -> torch.Tensor:
    """Attention of the sequence's last n queries, recomputed over its whole history (square
    problem: top-left and bottom-right alignment agree)."""
    q, k, v = sim.history[(layer, seq)]
    ok = _full_mask(k.shape[0], "causal" in sim.cfg.mask, sim.cfg.window)
    return attend_one(q, k, v, ok, 1.0 / math.sqrt(sim.cfg.d))[k.shape[0] - n :]


@dataclass(frozen=True)
class Packing:
    """How a step's tokens are laid out: extra (NaN) batch rows, sequence positions, thd rows."""

    extra_b: int
    extra_s: int
    tail: int


def pack(cfg: Config, step_dict, parts: List[torch.Tensor], packing: Packing) -> torch.Tensor:
    lens = list(step_dict.values())
    h, d = parts[0].shape[1:]
    if cfg.fmt == "thd":
        out = torch.full((sum(lens) + packing.tail, h, d), NAN, dtype=torch.float64)
        for part, start in zip(parts, starts(lens)):
            out[start : start + part.shape[0]] = part
        return out.to(cfg.device)
    out = torch.full((len(lens) + packing.extra_b, max(lens) + packing.extra_s, h, d), NAN, dtype=torch.float64)
    for i, part in enumerate(parts):
        out[i, : part.shape[0]] = part
    return (out if cfg.fmt == "bshd" else out.transpose(0, 1).contiguous()).to(cfg.device)


def starts(lens) -> List[int]:
    return [sum(lens[:i]) for i in range(len(lens))]


def rows_of(fmt: str, t: torch.Tensor, i: int, start: int, n: int) -> torch.Tensor:
    if fmt == "thd":
        return t[start : start + n]
    return t[i, :n] if fmt == "bshd" else t[:n, i]


def check_output(out, sim: Simulation, layer: int, step_dict, tol: float = 1e-12) -> None:
    """Each sequence's rows of ``out`` (the step's format, [..., H, Dv]) against the oracle;
    ``tol``: 1e-12 for float64 (reduction order only), the dtype's rounding otherwise."""
    rest = out.clone()
    for i, ((seq, n), start) in enumerate(zip(step_dict.items(), starts(list(step_dict.values())))):
        got = rows_of(sim.cfg.fmt, out, i, start, n).double()
        torch.testing.assert_close(got, oracle(sim, layer, seq, n), rtol=tol, atol=tol)
        rows_of(sim.cfg.fmt, rest, i, start, n).zero_()
    assert torch.count_nonzero(rest) == 0, "rows no sequence owns must be exactly 0 (NaN inputs there never leak)"


def round_history(sim: Simulation, dtype: torch.dtype) -> None:
    """Round every history to ``dtype`` (idempotent), so that the oracle sees exactly the inputs
    a ``dtype`` run gets."""
    for key, parts in sim.history.items():
        sim.history[key] = [t.to(dtype).double() for t in parts]


def poison(params: InferenceParams) -> None:
    for layer in LAYERS:
        params.allocate_memory(layer)
        for cache in params.cache_manager.cache[layer]:
            cache.fill_(NAN)  # slots never written must never be read


HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy")


@contextlib.contextmanager
def no_host_reads():
    """Inside the block, reading a tensor's values on the host (a sync on CUDA) raises."""
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def refuse(name):
        def read(self, *args, **kwargs):
            raise AssertionError(f"host read of a tensor: Tensor.{name}")
        return read

    for name in HOST_READS:
        setattr(torch.Tensor, name, refuse(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def load_example():
    """``examples/generate.py`` as a module (the examples are not a package)."""
    path = Path(__file__).resolve().parents[3] / "examples" / "generate.py"
    spec = importlib.util.spec_from_file_location("generate_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module
