"""Command line: which backend would run a configuration, and why not the others.

The answer is for this machine's installed libraries; where a GPU library is missing and a
machine with every one would choose differently, a note says what that machine would choose
(``--assume-all-libraries`` prints its report).

    te-attention-backend --dtype bf16 --format thd --mask padding_causal --head-dim 128 --cc 9.0
    python -m transformer_engine.pytorch.attention.dot_product_attention.selection.explain --matrix
"""

from __future__ import annotations

import argparse
from typing import List, Optional

import torch

from .libraries import LIBRARY_INSTALLS, InstalledLibraries, installed_libraries
from ..masks import AttnMaskType
from .params import AttentionParams
from ...inference import inference_attn_mask_type
from . import autotune
from ..environment import AUTOTUNE
from .backend_selection import get_attention_backend, kv_cache_support_markdown, support_matrix_markdown

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--cc", default="9.0", help="compute capability, e.g. 9.0")
    p.add_argument("--format", choices=["sbhd", "bshd", "thd"], default="thd")
    p.add_argument("--mask", default="padding_causal", choices=[m.value for m in AttnMaskType])
    p.add_argument("--window", type=int, nargs=2, default=None, metavar=("LEFT", "RIGHT"))
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--gqa-groups", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--bias", default="no_bias", choices=["no_bias", "pre_scale_bias", "post_scale_bias", "alibi"])
    p.add_argument("--pad-between-seqs", action="store_true")
    p.add_argument("--fp8", action="store_true", help="FP8 attention (a recipe with fp8_dpa=True)")
    p.add_argument("--kv-cache", choices=["none", "non-paged", "paged"], default="none",
                   help="attention over a KV cache (inference_params): the step's queries as --format, forward only")
    p.add_argument("--page-size", type=int, default=64, help="tokens per page of a paged KV cache")
    p.add_argument("--fp8-recipe", default="DelayedScaling", choices=["DelayedScaling", "Float8CurrentScaling"],
                   help="with --fp8: the recipe (cuDNN runs delayed scaling only)")
    p.add_argument("--no-grad", action="store_true", help="forward only (no gradients: FP8's backward rules do not apply)")
    p.add_argument("--assume-all-libraries", action="store_true", help="pretend every GPU library is installed")
    p.add_argument("--matrix", action="store_true", help="print the support matrix and exit")
    p.add_argument("--kv-matrix", action="store_true", help="print the KV-cache support table and exit")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.matrix or args.kv_matrix:
        print(support_matrix_markdown() if args.matrix else kv_cache_support_markdown())
        return 0
    facts = dict(qkv_format=args.format, pad_between_seqs=args.pad_between_seqs, attn_mask_type=args.mask,
                 requires_grad=not args.no_grad)
    facts.update(_kv_cache_args(args))
    params = AttentionParams(
        qkv_dtype=DTYPES[args.dtype],
        device_type=args.device,
        compute_capability=tuple(int(x) for x in args.cc.split(".")) if args.device == "cuda" else None,
        num_heads=args.heads,
        num_gqa_groups=args.gqa_groups or args.heads,
        head_dim_qk=args.head_dim,
        head_dim_v=args.head_dim,
        window_size=tuple(args.window) if args.window else None,
        attention_dropout=args.dropout,
        core_attention_bias_type=args.bias,
        fp8=args.fp8,
        fp8_recipe=args.fp8_recipe if args.fp8 else None,
        **facts,
    )
    libs = TESTED_LIBRARIES if args.assume_all_libraries else installed_libraries()
    selection = get_attention_backend(params, libs)
    print(selection.report())
    how = autotune.mode()
    if autotune.applies(selection, params):
        print(f"NVTE_ATTN_AUTOTUNE={AUTOTUNE.get('0')}: a call runs the fastest of {autotune.candidates(selection)} measured "
              f"({how} timing) on its shape bucket's first call; the line above is the fixed preference order")
    if not args.assume_all_libraries:
        note = fallback_note(params, selection, libs)
        if note:
            print(note)
    return 0


def _kv_cache_args(args) -> dict:
    """A KV call as the module describes it: the step's queries as a THD call over the cache
    (padding between its sequences' slots when not paged), forward only."""
    if args.kv_cache == "none":
        return {}
    return dict(kv_cache=True, kv_page_size=args.page_size if args.kv_cache == "paged" else None, requires_grad=False,
                is_training=False, qkv_format="thd", pad_between_seqs=args.kv_cache == "non-paged", shared_cu_seqlens=False,
                attn_mask_type=inference_attn_mask_type(args.mask))


# "All libraries": each at the release this package is tested with (cuDNN 9.26 runs every sink case).
TESTED_LIBRARIES = InstalledLibraries("2.7.4", "3.0.0", "4.0.0b36", "1.32.0", cudnn=92600)


def fallback_note(params: AttentionParams, selection, libs: InstalledLibraries) -> Optional[str]:
    """What a machine with every GPU library would choose, when it is not what this machine's
    libraries allow (the answer above is for this machine)."""
    missing = [install.package for name, install in LIBRARY_INSTALLS.items() if getattr(libs, name) is None]
    gpu = get_attention_backend(params, TESTED_LIBRARIES)
    if not missing or gpu.label == selection.label:
        return None
    return (f"note: this answer is for this machine, where {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not installed; with every GPU library installed, "
            f"{gpu.label or 'no backend'} would be selected (run with --assume-all-libraries for its report)")


if __name__ == "__main__":
    raise SystemExit(main())
