"""Support declarations as data, and the reasons a declaration rejects a configuration.

Each backend states what it runs as class attributes of :class:`BackendSupport`; one method
turns them into reasons. A reason names the field, the value seen and the values allowed, so
the same data answers "why not FlashAttention?" and renders the README's support matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, FrozenSet, List, Optional, Tuple

import torch

from ....tensor import QuantizedTensor
from ..environment import FP8_EMULATE, backend_switch_on
from .libraries import LIBRARY_INSTALLS, InstalledLibraries
from ..masks import AttnMaskType
from .params import AttentionParams

HALF = frozenset({torch.float16, torch.bfloat16})
ALL_FLOAT = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})
PACKAGES = {field: install.package for field, install in LIBRARY_INSTALLS.items()}
NON_ARBITRARY_MASKS = frozenset(m for m in AttnMaskType if m is not AttnMaskType.ARBITRARY)
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
# FP8 attention (AttentionParams.fp8): "no", "emulated" (the unfused backend's emulation of the
# FP8 kernels, run under TE's NVTE_UnfusedDPA_Emulate_FP8=1) or "yes" (FP8 kernels; the
# backend's own rules say which FP8 calls).
FP8_SUPPORT_KINDS = ("no", "emulated", "yes")


@dataclass(frozen=True)
class Reason:
    """Why one backend cannot run one configuration."""

    field: str
    seen: str
    allowed: str

    def __str__(self) -> str:
        return f"{self.field}={self.seen} (supported: {self.allowed})"


def env_enabled(name: str) -> bool:
    """NVTE_* switches: '0' turns a backend off; anything else (or unset) leaves it on."""
    return backend_switch_on(name)


class BackendSupport:
    """Declarations shared by every backend; subclasses override the attributes they differ in.

    ``NOTES`` maps a feature field to why it is unsupported; it is appended to that reason.
    """

    NAME: ClassVar[str] = "?"
    ENV_VARS: ClassVar[Tuple[str, ...]] = ()
    LIBRARY: ClassVar[Optional[str]] = None  # field of InstalledLibraries, None = built in
    SUPPORTED_DEVICES: ClassVar[FrozenSet[str]] = frozenset({"cuda"})
    SUPPORTED_DTYPES: ClassVar[FrozenSet[torch.dtype]] = HALF
    SUPPORTED_FORMATS: ClassVar[FrozenSet[str]] = frozenset({"sbhd", "bshd", "thd"})
    SUPPORTED_MASK_TYPES: ClassVar[FrozenSet[AttnMaskType]] = NON_ARBITRARY_MASKS
    SUPPORTED_BIAS_TYPES: ClassVar[FrozenSet[str]] = frozenset({"no_bias"})
    MIN_COMPUTE_CAPABILITY: ClassVar[Optional[Tuple[int, int]]] = None
    COMPUTE_CAPABILITY_MAJORS: ClassVar[Optional[FrozenSet[int]]] = None
    MAX_HEAD_DIM: ClassVar[int] = 256
    HEAD_DIM_MULTIPLE: ClassVar[int] = 8
    SUPPORTS_DROPOUT: ClassVar[bool] = False
    SUPPORTS_WINDOW: ClassVar[bool] = True
    SUPPORTS_PAD_BETWEEN_SEQS: ClassVar[bool] = False
    SUPPORTS_PER_SEQ_POLICY: ClassVar[bool] = False
    SUPPORTS_TOP_LEFT_CROSS: ClassVar[bool] = True
    SUPPORTS_DENSE_PADDING: ClassVar[bool] = True
    SUPPORTS_DIFFERENT_HEAD_DIM_V: ClassVar[bool] = True
    SUPPORTED_SOFTMAX_TYPES: ClassVar[FrozenSet[str]] = frozenset({"vanilla"})
    SUPPORTS_RETURN_MAX_LOGIT: ClassVar[bool] = False
    # TE's num_splits is a split-KV performance hint: the compute-capability majors on which the
    # backend passes it to its library. Elsewhere (and by every backend with none) it is
    # ignored, as TE ignores it outside FlashAttention 3; results do not depend on it.
    NUM_SPLITS_MAJORS: ClassVar[FrozenSet[int]] = frozenset()
    # TE's inference_params: attention of a step's queries over a KV cache, forward only.
    # SUPPORTS_KV_CACHE: a non-paged cache; SUPPORTS_PAGED_KV_CACHE: page tables too, with page
    # sizes a multiple of KV_PAGE_SIZE_MULTIPLE. The rules every KV backend shares are
    # _check_kv_cache's; a backend declaring the cache runs it with ``run_kv_cache``.
    SUPPORTS_KV_CACHE: ClassVar[bool] = False
    SUPPORTS_PAGED_KV_CACHE: ClassVar[bool] = False
    KV_PAGE_SIZE_MULTIPLE: ClassVar[int] = 1
    # The backend's kernel interface (backends/kernel_problem.py: forward, backward,
    # stats_to_rows, stats_from_rows), None where it has none. Context parallelism runs the
    # ring and all-gather steps on it (cp/spans.py wraps it), so a backend declaring those comm
    # types names one.
    KERNEL: ClassVar[Optional[type]] = None
    # Context parallelism: the comm types this backend runs. a2a calls the backend's ordinary
    # run on the whole sequences after the all-to-all, so every backend; the others need KERNEL.
    CP_COMM_TYPES: ClassVar[FrozenSet[str]] = frozenset({"a2a"})
    FP8_SUPPORT: ClassVar[str] = "no"  # one of FP8_SUPPORT_KINDS; NOTES["fp8"] says why not
    NOTES: ClassVar[dict] = {}

    @classmethod
    def not_supported_reasons(cls, params: AttentionParams, libs: InstalledLibraries) -> List[Reason]:
        """Every rule this configuration breaks; empty means the backend can run it."""
        checks = (
            cls._check_switches,
            cls._check_library,
            cls._check_device,
            cls._check_dtype_format,
            cls._check_head_dims,
            cls._check_masks,
            cls._check_features,
            cls._check_kv_cache,
            cls._check_special,
        )
        reasons: List[Reason] = []
        for check in checks:
            reasons.extend(check(params, libs))
        return [cls._annotate(r) for r in reasons]

    @classmethod
    def _annotate(cls, r: Reason) -> Reason:
        note = cls.NOTES.get(r.field)
        return Reason(r.field, r.seen, f"{r.allowed}; {note}") if note else r

    @classmethod
    def _check_switches(cls, params, libs):
        return [Reason(var, "0", "unset or 1 (switched off by the environment)") for var in cls.ENV_VARS if not env_enabled(var)]

    @classmethod
    def _check_library(cls, params, libs):
        if cls.LIBRARY is None or getattr(libs, cls.LIBRARY) is not None:
            return []
        return [Reason("library", "not installed", f"{PACKAGES[cls.LIBRARY]} installed")]

    @classmethod
    def _check_device(cls, params, libs):
        out = []
        if params.device_type not in cls.SUPPORTED_DEVICES:
            out.append(Reason("device", params.device_type, _fmt(cls.SUPPORTED_DEVICES)))
            return out
        cc = params.compute_capability
        if params.device_type == "cuda" and cc is not None:
            if cls.MIN_COMPUTE_CAPABILITY is not None and tuple(cc) < cls.MIN_COMPUTE_CAPABILITY:
                out.append(Reason("compute_capability", f"sm{cc[0]}{cc[1]}", f">= sm{''.join(map(str, cls.MIN_COMPUTE_CAPABILITY))}"))
            if cls.COMPUTE_CAPABILITY_MAJORS is not None and cc[0] not in cls.COMPUTE_CAPABILITY_MAJORS:
                out.append(Reason("compute_capability", f"sm{cc[0]}{cc[1]}", "sm" + "x/sm".join(map(str, sorted(cls.COMPUTE_CAPABILITY_MAJORS))) + "x"))
        return out

    @classmethod
    def _check_dtype_format(cls, params, libs):
        out = []
        if params.qkv_dtype not in cls.SUPPORTED_DTYPES:
            out.append(Reason("qkv_dtype", str(params.qkv_dtype), _fmt(cls.SUPPORTED_DTYPES)))
        # A KV call's format is its queries' (TE's "thd_2bshd": q in thd, the cache in bshd).
        fmt = params.qkv_format.split("_2")[0] if params.kv_cache else params.qkv_format
        if fmt not in cls.SUPPORTED_FORMATS:
            out.append(Reason("qkv_format", params.qkv_format, _fmt(cls.SUPPORTED_FORMATS)))
        if issubclass(params.qkv_type, QuantizedTensor):
            out.append(Reason("qkv_type", params.qkv_type.__name__, "torch.Tensor (quantized q/k/v tensors are not implemented)"))
        return out

    @classmethod
    def _check_head_dims(cls, params, libs):
        out = []
        for name, d in (("head_dim_qk", params.head_dim_qk), ("head_dim_v", params.head_dim_v)):
            if d > cls.MAX_HEAD_DIM or d % cls.HEAD_DIM_MULTIPLE:
                out.append(Reason(name, str(d), f"multiples of {cls.HEAD_DIM_MULTIPLE} up to {cls.MAX_HEAD_DIM}"))
        if params.head_dim_qk != params.head_dim_v and not cls.SUPPORTS_DIFFERENT_HEAD_DIM_V:
            out.append(Reason("head_dim_v", str(params.head_dim_v), f"equal to head_dim_qk={params.head_dim_qk}"))
        return out

    @classmethod
    def _check_masks(cls, params, libs):
        out = []
        for spec in params.mask_specs:
            if spec.mask_type not in cls.SUPPORTED_MASK_TYPES:
                out.append(Reason("attn_mask_type", spec.mask_type.value, _fmt(m.value for m in cls.SUPPORTED_MASK_TYPES)))
            if spec.window[0] >= 0 and not cls.SUPPORTS_WINDOW:
                out.append(Reason("window_size", str(spec.window), "(-1, -1) or (-1, 0)"))
            top_left = spec.mask_type.is_causal and not spec.mask_type.bottom_right
            if top_left and not cls.SUPPORTS_TOP_LEFT_CROSS and not params.same_lengths:
                out.append(Reason("attn_mask_type", f"{spec.mask_type.value} with sq != skv possible", "bottom-right causal, or self-attention sharing cu_seqlens"))
        if params.has_padding_mask and params.qkv_format != "thd" and not cls.SUPPORTS_DENSE_PADDING:
            out.append(Reason("attention_mask", f"padding mask in {params.qkv_format}", "thd with cu_seqlens"))
        return out

    @classmethod
    def _check_features(cls, params, libs):
        out = []
        if params.attention_dropout > 0 and params.is_training and not cls.SUPPORTS_DROPOUT:
            out.append(Reason("attention_dropout", str(params.attention_dropout), "0.0"))
        if params.core_attention_bias_type not in cls.SUPPORTED_BIAS_TYPES:
            out.append(Reason("core_attention_bias_type", params.core_attention_bias_type, _fmt(cls.SUPPORTED_BIAS_TYPES)))
        if params.pad_between_seqs and not cls.SUPPORTS_PAD_BETWEEN_SEQS:
            out.append(Reason("pad_between_seqs", "True", "False"))
        if params.per_seq_policies is not None and not cls.SUPPORTS_PER_SEQ_POLICY:
            out.append(Reason("attn_mask_type_per_seq", "given", "None"))
        if params.softmax_type not in cls.SUPPORTED_SOFTMAX_TYPES:
            out.append(Reason("softmax_type", repr(params.softmax_type), _fmt(cls.SUPPORTED_SOFTMAX_TYPES)))
        if params.return_max_logit and not cls.SUPPORTS_RETURN_MAX_LOGIT:
            out.append(Reason("return_max_logit", "True", "False"))
        if params.kv_cache and not cls.SUPPORTS_KV_CACHE:
            out.append(Reason("inference_params", "given (KV caching)", "None (KV caching is not implemented yet)"))
        out.extend(cls._fp8_reasons(params))
        if params.context_parallel and params.cp_comm_type not in cls.CP_COMM_TYPES:
            out.append(Reason("cp_comm_type", str(params.cp_comm_type), _fmt(cls.CP_COMM_TYPES) + " (context parallelism)"))
        return out

    @classmethod
    def _fp8_reasons(cls, params):
        if not params.fp8:
            return []
        if cls.FP8_SUPPORT == "no":
            return [Reason("fp8", "True", "False")]
        if cls.FP8_SUPPORT == "yes":
            return []
        if FP8_EMULATE.get("0") != "1":
            return [Reason(FP8_EMULATE.name, FP8_EMULATE.get("") or "unset",
                           "1 (this backend runs FP8 attention as an emulation of the FP8 kernels, only when asked to)")]
        return []

    @classmethod
    def _check_kv_cache(cls, params, libs):
        """The rules of attention over a KV cache (a backend without one is refused in
        ``_check_features``): forward only, vanilla softmax, no dropout, and the page layout."""
        if not (params.kv_cache and cls.SUPPORTS_KV_CACHE):
            return []
        out = []
        if params.requires_grad:
            out.append(Reason("requires_grad", "True with inference_params (q/k/v need gradients in training mode)",
                              "False: attention over a KV cache runs forward only (torch.no_grad(), torch.inference_mode() "
                              "or the module in eval mode)"))
        for field, unsupported, seen, allowed in (
            ("softmax_type", params.softmax_type != "vanilla", repr(params.softmax_type), "'vanilla'"),
            ("return_max_logit", params.return_max_logit, "True", "False"),
            ("attention_dropout", params.attention_dropout > 0 and params.is_training, str(params.attention_dropout), "0.0, or eval mode"),
        ):
            if unsupported:
                out.append(Reason(field, f"{seen} with inference_params", f"{allowed} with inference_params"))
        page = params.kv_page_size
        if page is not None and not cls.SUPPORTS_PAGED_KV_CACHE:
            out.append(Reason("inference_params.is_paged", f"True (page_size={page})", "False (a non-paged cache)"))
        elif page is not None and page % cls.KV_PAGE_SIZE_MULTIPLE:
            out.append(Reason("page_size", str(page), f"multiples of {cls.KV_PAGE_SIZE_MULTIPLE}"))
        return out

    @classmethod
    def _check_special(cls, params, libs):
        """Backend-specific rules that do not fit the attributes above."""
        return []

    @classmethod
    def run_kv_cache(cls, inp) -> torch.Tensor:
        """Attention of a KV call's query rows over the cache (``inp.kv_cache``): [rows, H, Dv],
        rows no sequence owns 0. Backends declaring SUPPORTS_KV_CACHE override it."""
        raise NotImplementedError(f"{cls.NAME} does not run attention over a KV cache (SUPPORTS_KV_CACHE is False)")

    @classmethod
    def bind(cls, inp, training: bool):
        """The call ``run(inp, training)`` makes, bound once for later fast-path calls that
        differ only in q/k/v (``prepare/fast_path.bound_call``): (THD plan, KernelCall or None
        where this call cannot be bound), or None where the backend binds none. Backends on
        the kernel interface override it (backends/kernel_autograd.bind_kernel)."""
        return None

    @classmethod
    def matrix_row(cls) -> dict:
        """This declaration as one row of the README's support matrix."""
        cc = "any" if cls.SUPPORTED_DEVICES == frozenset({"cpu", "cuda"}) else ""
        if cls.MIN_COMPUTE_CAPABILITY:
            cc = f">= sm{''.join(map(str, cls.MIN_COMPUTE_CAPABILITY))}"
        if cls.COMPUTE_CAPABILITY_MAJORS:
            cc = ", ".join(f"sm{m}x" for m in sorted(cls.COMPUTE_CAPABILITY_MAJORS))
        masks = "all" if cls.SUPPORTED_MASK_TYPES == frozenset(AttnMaskType) else "all but arbitrary"
        yes = lambda flag: "yes" if flag else "no"  # noqa: E731
        return {
            "backend": cls.NAME,
            "devices": _fmt(cls.SUPPORTED_DEVICES),
            "compute capability": cc or "any",
            "dtypes": _fmt(str(d).replace("torch.", "") for d in cls.SUPPORTED_DTYPES),
            "formats": _fmt(cls.SUPPORTED_FORMATS),
            "masks": masks,
            "head dim": f"<= {cls.MAX_HEAD_DIM}, multiple of {cls.HEAD_DIM_MULTIPLE}",
            "dropout": yes(cls.SUPPORTS_DROPOUT),
            "bias": _fmt(cls.SUPPORTED_BIAS_TYPES),
            "pad_between_seqs": yes(cls.SUPPORTS_PAD_BETWEEN_SEQS),
            "per-seq policy": yes(cls.SUPPORTS_PER_SEQ_POLICY),
            "softmax_type": ", ".join(t for t in SOFTMAX_TYPES if t in cls.SUPPORTED_SOFTMAX_TYPES),
            "return_max_logit": yes(cls.SUPPORTS_RETURN_MAX_LOGIT),
            "num_splits": ", ".join(f"sm{m}x" for m in sorted(cls.NUM_SPLITS_MAJORS)) or "ignored",
            "fp8": cls.FP8_SUPPORT,
        }


def bias_thd_reasons(params) -> List[Reason]:
    """A bias tensor has no packed layout: thd takes no_bias or alibi (unfused and cuDNN)."""
    if params.qkv_format == "thd" and params.core_attention_bias_type in ("pre_scale_bias", "post_scale_bias"):
        # Named by format: FusedAttention's note on core_attention_bias_type (pre- vs
        # post-scale) would not explain this one.
        return [Reason("qkv_format", f"thd with {params.core_attention_bias_type}",
                       "bshd or sbhd for a bias tensor (it has no packed layout; thd takes no_bias or alibi)")]
    return []


def _fmt(values) -> str:
    return ", ".join(sorted(str(v) for v in values))
