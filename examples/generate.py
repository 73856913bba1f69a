"""Greedy generation with a KV cache: a few MultiheadAttention layers with random weights, TE's
InferenceParams (paged by default), and every chosen token checked against full recomputation.

    python examples/generate.py                    # paged cache; CPU (unfused backend) or GPU
    python examples/generate.py --no-paged
    python examples/generate.py --cuda-graph       # GPU: decode steps replayed from a CUDA graph

Requests with prompts of different lengths wait in a queue and at most ``--batch`` run at once.
Each step is one ``pre_step`` (TE's order: the continuing sequences first, each decoding one
token, then the ones that join, each prefilling its prompt) and one forward of the model over
the cache. A sequence leaves after its new tokens (its pages go back to the pool) and a waiting
one takes its place. Every step, each sequence's logits are recomputed from its whole history
without a cache; the token chosen with the cache must be the one recomputation chooses (where
their two best logits are too close to tell apart in the dtype, the step counts as a tie).
With ``--cuda-graph`` the decode-only steps (fixed batch of ``--batch`` rows, lengths and page
table in device tensors) replay one captured graph; steps where sequences join run eagerly.
"""

from __future__ import annotations

import argparse
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, fields, field
from typing import Dict, List, Optional, Sequence

import torch

import transformer_engine.pytorch as te

# The logit gap below which greedy choices are called ties (rounding can swap them).
TIE = {torch.float64: 1e-9, torch.float32: 1e-3, torch.float16: 0.05, torch.bfloat16: 0.2}


@dataclass
class Settings:
    vocab: int = 97
    hidden: int = 64
    heads: int = 4
    gqa: int = 2
    layers: int = 2
    batch: int = 3
    requests: int = 5
    prompt: int = 12  # longest prompt
    new_tokens: int = 10  # most new tokens per request (each draws between half and all of it)
    paged: bool = True
    page_size: int = 16
    cuda_graph: bool = False
    device: str = "cpu"
    dtype: torch.dtype = torch.float64
    seed: int = 0

    @property
    def max_len(self) -> int:
        """The cache's max_sequence_length: the longest request, rounded up to whole pages."""
        return -(-(self.prompt + self.new_tokens) // self.page_size) * self.page_size


class TinyLM(torch.nn.Module):
    """Embedding, pre-norm MultiheadAttention layers with rotary embeddings and residuals, head."""

    def __init__(self, s: Settings) -> None:
        super().__init__()
        factory = dict(device=s.device, dtype=s.dtype)
        self.embed = torch.nn.Embedding(s.vocab, s.hidden, **factory)
        self.layers = torch.nn.ModuleList(
            te.MultiheadAttention(s.hidden, s.heads, num_gqa_groups=s.gqa, attention_dropout=0.0, input_layernorm=True,
                                  attn_mask_type="padding_causal", qkv_format="bshd", layer_number=i + 1,
                                  params_dtype=s.dtype, device=s.device)
            for i in range(s.layers))
        self.norm = torch.nn.LayerNorm(s.hidden, **factory)
        self.head = torch.nn.Linear(s.hidden, s.vocab, bias=False, **factory)
        torch.nn.init.normal_(self.head.weight, std=4.0 / s.hidden ** 0.5)  # logits far apart: few ties
        d, positions = s.hidden // s.heads, -(-s.max_len // 32) * 32  # Report.check pads to multiples of 32
        angles = torch.arange(positions, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(0, d, 2) / d)
        self.register_buffer("rope", torch.cat([angles, angles], -1).view(positions, 1, 1, d).float().to(s.device))

    def forward(self, tokens: torch.Tensor, inference_params: Optional[te.InferenceParams] = None) -> torch.Tensor:
        """tokens [B, S] -> logits [B, S, vocab]: over the cache with ``inference_params`` (the
        step's tokens, padded), else the whole sequences (causal)."""
        x = self.embed(tokens)
        mask = "causal" if inference_params is None else "padding_causal"
        for layer in self.layers:
            x = x + layer(x, attn_mask_type=mask, inference_params=inference_params, rotary_pos_emb=self.rope)
        return self.head(self.norm(x))


@dataclass
class Request:
    id: int
    tokens: List[int]
    prompt_len: int
    total_len: int

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.total_len


@dataclass
class Report:
    """Cached vs recomputed: greedy choices compared, ties, the largest logit difference."""

    compared: int = 0
    mismatches: int = 0
    ties: int = 0
    max_logit_diff: float = 0.0
    graph_steps: int = 0
    eager_steps: int = 0
    finished: Dict[int, Request] = field(default_factory=dict)

    def check(self, model: TinyLM, req: Request, logits: torch.Tensor, tie: float) -> None:
        # Padded to a multiple of 32 tokens (causal: the padding cannot reach the last real one),
        # so the recomputation meets few shapes (each new one builds a cuDNN graph).
        n = len(req.tokens)
        tokens = torch.tensor([req.tokens + [0] * (-n % 32)], device=logits.device)
        full = model(tokens)[0, n - 1].double()
        logits = logits.double()
        self.max_logit_diff = max(self.max_logit_diff, float((full - logits).abs().max()))
        top2 = full.topk(2).values
        if float(top2[0] - top2[1]) < tie:
            self.ties += 1
            return
        self.compared += 1
        self.mismatches += int(int(full.argmax()) != int(logits.argmax()))


class StepRunner:
    """Runs one step over the cache: eagerly, or (decode-only steps with ``cuda_graph``) by
    replaying a graph captured on the second such step (the first warms up: JIT, plans)."""

    def __init__(self, model: TinyLM, params: te.InferenceParams, s: Settings) -> None:
        self.model, self.params, self.s = model, params, s
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.tokens = torch.zeros(s.batch, 1, dtype=torch.long, device=s.device)
        self.logits: Optional[torch.Tensor] = None
        self.warmed = False

    def step(self, rows: Sequence[List[int]], report: Report) -> torch.Tensor:
        """``rows``: each batch row's new tokens -> [B, vocab] logits of each row's last one."""
        if not (self.s.cuda_graph and all(len(r) == 1 for r in rows)):
            # Two shapes only, [batch, 1] and [batch, prompt] (rows past the step's sequences and
            # tokens past each one's step are padding): each new shape costs a cuDNN graph build.
            report.eager_steps += 1
            width = 1 if all(len(r) == 1 for r in rows) else self.s.prompt
            padded = [r + [0] * (width - len(r)) for r in rows] + [[0] * width] * (self.s.batch - len(rows))
            logits = self.model(torch.tensor(padded, device=self.s.device), self.params)
            return logits[torch.arange(len(rows)), torch.tensor([len(r) - 1 for r in rows])]
        self.tokens.zero_()
        self.tokens[: len(rows), 0] = torch.tensor([r[0] for r in rows], device=self.s.device)
        if not self.warmed:
            return self._warm_up(len(rows))
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self.model(self.tokens, self.params)
        self.graph.replay()
        report.graph_steps += 1
        return self.logits[: len(rows), 0]

    def _warm_up(self, batch: int) -> torch.Tensor:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = self.model(self.tokens, self.params)
        torch.cuda.current_stream().wait_stream(side)
        self.warmed = True
        return logits[:batch, 0]


def make_requests(s: Settings) -> List[Request]:
    rng = random.Random(s.seed)
    out = []
    for i in range(s.requests):
        prompt = [rng.randrange(s.vocab) for _ in range(rng.randint(1, s.prompt))]
        out.append(Request(i, prompt, len(prompt), len(prompt) + rng.randint(max(1, s.new_tokens // 2), s.new_tokens)))
    return out


def make_params(s: Settings) -> te.InferenceParams:
    pages = s.batch * s.max_len // s.page_size
    return te.InferenceParams(max_batch_size=s.batch, max_sequence_length=s.max_len, num_heads_kv=s.gqa,
                              head_dim_k=s.hidden // s.heads, dtype=s.dtype, is_paged=s.paged,
                              total_num_pages=pages if s.paged else None, page_size=s.page_size if s.paged else None,
                              max_ctx_len=s.prompt, qkv_format="bshd", device=s.device)


@torch.no_grad()
def generate(model: TinyLM, s: Settings, requests: Sequence[Request]) -> Report:
    """Serve ``requests`` greedily through the cache, checking every step (see the module doc)."""
    params, report = make_params(s), Report()
    runner = StepRunner(model, params, s)
    waiting, live = deque(requests), OrderedDict()
    while waiting or live:
        for rid in [rid for rid, req in live.items() if req.done]:
            report.finished[rid] = live.pop(rid)
        rows = [req.tokens[-1:] for req in live.values()]
        while waiting and len(live) < s.batch:
            req = waiting.popleft()
            live[req.id] = req
            rows.append(list(req.tokens))
        if not live:
            break
        params.pre_step(OrderedDict((rid, len(row)) for rid, row in zip(live, rows)))
        logits = runner.step(rows, report)
        for req, row in zip(live.values(), logits):
            report.check(model, req, row, TIE[s.dtype])
            req.tokens.append(int(row.argmax()))
    return report


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in fields(Settings):  # the int settings' defaults live in Settings only
        if f.type in (int, "int"):
            p.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=f.default)
    p.add_argument("--no-paged", dest="paged", action="store_false", help="a non-paged cache")
    p.add_argument("--cuda-graph", action="store_true", help="replay decode-only steps from a CUDA graph (GPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float64", "float32", "bfloat16", "float16"], default=None,
                   help="default: float64 on the CPU (exact), bfloat16 on the GPU")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = _parser().parse_args(argv)
    dtype = getattr(torch, a.dtype or ("float64" if a.device == "cpu" else "bfloat16"))
    if a.cuda_graph and a.device == "cpu":
        raise SystemExit("--cuda-graph needs a CUDA device")
    s = Settings(**{f.name: getattr(a, f.name) for f in fields(Settings) if f.name != "dtype"}, dtype=dtype)
    torch.manual_seed(s.seed)
    model = TinyLM(s).eval()
    report = generate(model, s, make_requests(s))
    backend = model.layers[0].core_attention.last_selection.label
    print(f"{'paged' if s.paged else 'non-paged'} cache, {s.device} {str(dtype).replace('torch.', '')}, backend: {backend}; "
          f"{report.eager_steps} eager steps, {report.graph_steps} replayed from a CUDA graph")
    for rid, req in sorted(report.finished.items()):
        print(f"request {rid}: prompt {req.tokens[:req.prompt_len]} -> {req.tokens[req.prompt_len:]}")
    verdict = "match" if report.mismatches == 0 else f"MISMATCH ({report.mismatches} tokens differ)"
    print(f"{verdict}: {report.compared} tokens equal to full recomputation, {report.ties} ties, "
          f"largest logit difference {report.max_logit_diff:.2e}")
    return 0 if report.mismatches == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
