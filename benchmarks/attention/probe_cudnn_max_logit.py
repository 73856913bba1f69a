"""Probe for issue #22 (return_max_logit on cuDNN): what sdpa's score_max / score_sum_exp outputs
hold on this machine's cuDNN and cudnn-frontend, through the package's own op
(``backends/cudnn/ops.cudnn_fwd_max``, which builds the graph with both outputs and
generate_stats=False, as cuDNN before 9.21 requires) against a float64 reference and against
the plain op (``cudnn_fwd``, generated stats).

Per case it prints one line:
  built      the max-logit graph built and ran (else the error, shortened)
  max_err    |max logit - reference| (reference: scaled, biased, masked scores; no sink)
  row_err    |row max - reference row max| over rows that see a key
  past_len   rows at or past a sequence's length: "untouched" (still the -inf the op put
             there) or "written" (then the max logit depends on the op masking them)
  no_key     rows inside a sequence that see no key: "untouched" or the values found, and
             their stats as derived here and as the plain graph generates them
  stats_err  |derived stats (max + log sum_exp) - generated stats| over rows that see a key
  out_same   the output of both graphs agrees (max abs difference)
  sink       (sink cases) whether the row max is max(row max, sink): cuDNN folding the sink in
and at the end the facts the declaration rests on (FACT lines). Needs a GPU with
nvidia-cudnn-frontend; about 30 s (two graph builds per case).

  python benchmarks/attention/probe_cudnn_max_logit.py [OUT.json]
"""

import json
import sys
import time
import traceback

import torch

from transformer_engine.pytorch.attention.dot_product_attention.backends.cudnn import ops

H, HG, D = 4, 2, 64
SCALE = D ** -0.5
SINK = 6.0  # above every row max of these inputs, so a max that folds it in shows it


def alibi_slopes(h):
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], dtype=torch.float64, device="cuda")


def case_list():
    """(name, dense lengths or THD (lengths_q, lengths_kv, gaps), options)."""
    return [
        ("bshd no_mask", dict(b=2, s=128)),
        ("bshd causal", dict(b=2, s=128, causal=True)),
        ("bshd padded", dict(b=2, s=128, lengths=[128, 77])),
        ("thd causal gaps", dict(thd=([100, 37, 1, 64], None, [5, 0, 3, 2]), causal=True)),
        ("thd cross bottom-right (rows without keys)", dict(thd=([64, 20], [32, 40], [0, 2]), causal=True, bottom_right=True)),
        ("thd one row per sequence", dict(thd=([1, 1, 1], [50, 3, 7], None))),
        ("bshd bias", dict(b=2, s=128, bias=True)),
        ("bshd alibi causal", dict(b=2, s=128, causal=True, alibi=True)),
        ("bshd dropout 0.2", dict(b=2, s=128, dropout=0.2)),
        ("bshd window 16 causal", dict(b=2, s=128, causal=True, left=16)),
        ("bshd learnable sink", dict(b=2, s=128, sink=True)),
    ]


def make(opts):
    """q, k, v, op arguments (offsets .. bottom_right) and per-sequence (q rows, kv rows)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    causal, left, br = opts.get("causal", False), opts.get("left", -1), opts.get("bottom_right", False)
    if "thd" in opts:
        lq, lkv, gaps = opts["thd"]
        lkv = lkv or lq
        gaps = gaps or [0] * len(lq)
        off_q = torch.tensor([0] + [sum(lq[:i + 1]) + sum(gaps[:i + 1]) for i in range(len(lq))], dtype=torch.int32, device="cuda")
        off_kv = torch.tensor([0] + [sum(lkv[:i + 1]) + sum(gaps[:i + 1]) for i in range(len(lkv))], dtype=torch.int32, device="cuda")
        q, k, v = rnd(int(off_q[-1]), H, D), rnd(int(off_kv[-1]), HG, D), rnd(int(off_kv[-1]), HG, D)
        lens_q, lens_kv = (torch.tensor(x, dtype=torch.int32, device="cuda") for x in (lq, lkv))
        seqs = [(slice(int(off_q[i]), int(off_q[i]) + lq[i]), slice(int(off_kv[i]), int(off_kv[i]) + lkv[i])) for i in range(len(lq))]
        args = (off_q, off_kv, lens_q, lens_kv, len(lq), max(lq), max(lkv), SCALE, causal, left, -1, br)
        return q, k, v, args, seqs
    b, s = opts["b"], opts["s"]
    q, k, v = rnd(b, s, H, D), rnd(b, s, HG, D), rnd(b, s, HG, D)
    lengths = opts.get("lengths")
    lens = None if lengths is None else torch.tensor(lengths, dtype=torch.int32, device="cuda")
    seqs = [((i, slice(0, (lengths or [s] * b)[i])), (i, slice(0, (lengths or [s] * b)[i]))) for i in range(b)]
    args = (None, None, lens, lens, b, s, s, SCALE, causal, left, -1, br)
    return q, k, v, args, seqs


def reference(q, k, v, seqs, opts, bias):
    """Per sequence: row max [H, n] of the scaled (biased) masked scores (-inf: no key), lse."""
    out = []
    for idx, (sq_sel, skv_sel) in enumerate(seqs):
        qs, ks = q[sq_sel].double(), k[skv_sel].double()
        n, m = qs.shape[0], ks.shape[0]
        ks = ks.repeat_interleave(H // HG, dim=1)
        s = torch.einsum("nhd,mhd->hnm", qs, ks) * SCALE
        i, j = torch.arange(n, device="cuda").view(-1, 1), torch.arange(m, device="cuda").view(1, -1)
        diag = i + (m - n if opts.get("bottom_right") else 0)
        allowed = torch.ones(n, m, dtype=torch.bool, device="cuda")
        if opts.get("causal"):
            allowed &= j <= diag
        if opts.get("left", -1) >= 0:
            allowed &= j >= diag - opts["left"]
        if bias is not None:
            s = s + bias[0 if bias.shape[0] == 1 else idx].double()[:, :n, :m]
        if opts.get("alibi"):
            s = s + alibi_slopes(H).view(-1, 1, 1) * (j - i).double()
        s = s.masked_fill(~allowed, float("-inf"))
        out.append((s.amax(-1), torch.logsumexp(s, -1), allowed.any(-1)))
    return out


def features(opts, q):
    bias = torch.randn(1, H, q.shape[1], q.shape[1], device="cuda", dtype=torch.bfloat16) * 2 if opts.get("bias") else None
    rng = torch.randint(0, 1 << 62, (2,), dtype=torch.int64, device="cuda") if opts.get("dropout") else None
    sink = torch.full((H,), SINK, dtype=torch.float32, device="cuda") if opts.get("sink") else None
    return bias, rng, opts.get("alibi", False), opts.get("dropout", 0.0), sink


def run_case(name, opts):
    q, k, v, args, seqs = make(opts)
    feats = features(opts, q)
    row = {"case": name}
    captured = {}
    orig = ops._stats_of

    def spy(row_max, sum_exp):
        captured["row_max"] = row_max.clone()
        return orig(row_max, sum_exp)

    out_plain = q.new_zeros(*q.shape[:-1], v.shape[-1])
    stats_gen = ops.cudnn_fwd(q, k, v, out_plain, *args, *feats)
    out_max = q.new_zeros(*q.shape[:-1], v.shape[-1])
    ops._stats_of = spy
    try:
        stats_der, max_logit = ops.cudnn_fwd_max(q, k, v, out_max, *args, *feats)
    finally:
        ops._stats_of = orig
    torch.cuda.synchronize()
    row["built"] = True
    row.update(compare(captured["row_max"], stats_gen, stats_der, max_logit, reference(q, k, v, seqs, opts, feats[0]), opts))
    row["out_same"] = float((out_plain.float() - out_max.float()).abs().max())
    return row


def compare(row_max, stats_gen, stats_der, max_logit, ref, opts):
    """The per-case facts: errors over rows that see a key, and what the other rows hold."""
    row_err = stats_err = 0.0
    past, no_key, sink_folded = set(), set(), []
    want = torch.full((H,), float("-inf"), dtype=torch.float64, device="cuda")
    for b, (rmax, lse, seen) in enumerate(ref):
        n = rmax.shape[1]
        got = row_max[b, :, :n, 0].double()
        want = torch.maximum(want, rmax.amax(-1))
        if seen.any():
            expect = torch.clamp(rmax, min=SINK) if opts.get("sink") else rmax
            row_err = max(row_err, float((got[:, seen] - expect[:, seen]).abs().max()))
            sink_folded.append(bool(torch.allclose(got[:, seen], torch.clamp(rmax[:, seen], min=SINK), atol=1e-2)))
            diff = stats_der[b, :, :n, 0].double()[:, seen] - stats_gen[b, :, :n, 0].double()[:, seen]
            stats_err = max(stats_err, float(diff.abs().max()))
        if (~seen).any():
            vals = got[:, ~seen]
            no_key.add("untouched" if torch.isneginf(vals).all() else f"values {vals.flatten()[:3].tolist()}")
            der, gen = (t[b, :, :n, 0][:, ~seen].flatten()[:3].tolist() for t in (stats_der, stats_gen))
            no_key.add(f"stats derived {der} / generated {gen}")
        rest = row_max[b, :, n:, 0]
        if rest.numel():
            past.add("untouched" if torch.isneginf(rest).all() else "written")
    return {"max_err": float((max_logit.double() - want).abs().max()), "row_err": row_err,
            "past_len": ", ".join(sorted(past)) or "-", "no_key": ", ".join(sorted(no_key)) or "-",
            "stats_err": stats_err, "sink": (all(sink_folded) if opts.get("sink") else "-")}


def facts(rows):
    ok = {r["case"]: r for r in rows if r.get("built")}
    lines = [f"FACT max-logit graph (score_max + score_sum_exp, no stats) builds: {len(ok)}/{len(rows)} cases"
             + "".join(f"; FAILED {r['case']}: {r['error']}" for r in rows if not r.get("built"))]
    vanilla = [r for r in ok.values() if r["sink"] == "-"]
    worst = max((r["max_err"] for r in vanilla), default=float("nan"))
    off = [r["case"] for r in vanilla if not r["max_err"] < 2e-2]
    lines.append(f"FACT max logit vs reference (no sink cases; scaled scores, bias and ALiBi included): worst |err| {worst:.3g}; "
                 + (f"DOES NOT MATCH in: {', '.join(off)}" if off else "matches in every case"))
    sink = [r for r in ok.values() if r["sink"] != "-"]
    if sink:
        lines.append(f"FACT score_max with a sink {'folds the sink in (max(row max, sink))' if sink[0]['sink'] else 'leaves the sink out'}"
                     " -> the declaration refuses sinks with return_max_logit" + ("" if sink[0]["sink"] else " NEEDLESSLY"))
    worst = max((r["stats_err"] for r in ok.values()), default=float("nan"))
    lines.append(f"FACT derived stats vs generated stats: worst |diff| {worst:.3g} over rows that see a key")
    lines.append("FACT rows past a length: " + ", ".join(sorted({r["past_len"] for r in ok.values()})))
    lines.append("FACT rows without a key: " + ", ".join(sorted({r["no_key"] for r in ok.values()})))
    return lines


def main():
    import cudnn

    print(f"cuDNN {cudnn.backend_version()}, cudnn-frontend {getattr(cudnn, '__version__', '?')}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}", flush=True)
    rows, start = [], time.time()
    for name, opts in case_list():
        try:
            rows.append(run_case(name, opts))
        except Exception as err:  # noqa: BLE001 - a case that does not build is a finding
            traceback.print_exc(limit=1)
            rows.append({"case": name, "built": False, "error": str(err).splitlines()[0][:200] if str(err) else type(err).__name__})
        print(json.dumps(rows[-1]), flush=True)
    for line in facts(rows):
        print(line)
    print(f"({time.time() - start:.1f} s)")
    if len(sys.argv) > 1:
        json.dump(rows, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
