"""Which kernel runs each FP8 op: one registry, per op, device, M range and shape.

Every backend says, for a request, either that it can serve it or why not; the registry
walks the preference order (Fp8Config.backends, or the default order of the request's range of
M, DEFAULT_ORDERS) and takes the first that can. Vendor libraries are imported here only, lazily,
when a backend is asked about.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
from collections.abc import Callable

import torch

from .ops import kernels


@dataclasses.dataclass(frozen=True)
class Request:
    """One op call site: what a kernel must handle. m_max None = unbounded."""

    op: str
    device: torch.device
    n: int
    k: int
    m_min: int = 1
    m_max: int | None = None
    batch_invariant: bool = False
    e8m0: bool = False
    dtype: torch.dtype = torch.bfloat16  # the activation's and the output's: the model's

    @property
    def m_range(self) -> str:
        hi = "inf" if self.m_max is None else str(self.m_max)
        return f"M in [{self.m_min}, {hi}]"


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    # op name -> its kernel, or "module:function" naming it (imported on first use).
    ops: dict[str, str | Callable]
    # request -> None if this backend can serve it, else the reason it cannot.
    why_not: Callable[[Request], str | None]
    # Called at compile time for each call site given to this backend: allocates the state its
    # kernels keep between calls, outside any CUDA-graph memory pool (Inductor's CUDA graphs
    # route every allocation of a warm-up run into theirs). A callable or "module:function".
    prepare: str | Callable[[Request], None] | None = None

    def implementation(self, op: str) -> Callable:
        return _resolve(self.ops[op])


def _resolve(fn: str | Callable) -> Callable:
    if callable(fn):
        return fn
    module, _, name = fn.partition(":")
    return getattr(importlib.import_module(module, __package__), name)


def _reference_why_not(request: Request) -> str | None:
    return None  # pure PyTorch: any device, any M, any shape the recipe allows


def _cuda_why_not(
    request: Request, min_capability: tuple[int, int], exact_major: int | None = None
) -> str | None:
    if request.device.type != "cuda":
        return f"needs a CUDA GPU (device is {request.device.type})"
    cap = torch.cuda.get_device_capability(request.device)
    if cap < min_capability or (exact_major is not None and cap[0] != exact_major):
        needed = f"sm_{exact_major}0 exactly" if exact_major else ">= %d.%d" % min_capability
        return f"needs compute capability {needed}, device has {cap[0]}.{cap[1]}"
    return None


def _triton_device_why_not(request: Request) -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if request.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None  # Triton's CPU interpreter: correctness tests at small sizes
    return _cuda_why_not(request, (8, 9))  # FP8 tensor-core dot: Ada / Hopper and newer


def _triton_small_m_why_not(request: Request) -> str | None:
    if request.batch_invariant:
        return "split-K sums partials in whatever order the SMs finish: not batch-invariant"
    why = _triton_device_why_not(request)  # first: the kernel's module imports triton
    if why is not None:
        return why
    from .ops.linear.triton_gemm import SMALL_M_MAX

    if request.m_max is None or request.m_max > SMALL_M_MAX:
        return f"decode kernel: serves M <= {SMALL_M_MAX} ({request.m_range} asked)"
    return None


def _bf16_only(library: str, request: Request) -> str | None:
    """Why a library that writes bfloat16 outputs only cannot serve the request's dtype."""
    if request.dtype != torch.bfloat16:
        return f"{library} writes bfloat16 only ({str(request.dtype).replace('torch.', '')} model)"
    return None


def _vendor_why_not(module: str, request: Request, min_capability, exact_major=None) -> str | None:
    if request.batch_invariant:
        return "picks its kernel by M: not batch-invariant"
    if (why := _bf16_only(module, request)) is not None:
        return why
    why = _cuda_why_not(request, min_capability, exact_major)
    if why is None:
        from .ops.vendors import import_error

        why = import_error(module)
    return why


# The indexer-logits ops (fp8compile::mqa_logits and its paged form): Request.n = H query heads,
# Request.k = D, the head size.
MQA_OPS = ("mqa_logits", "paged_mqa_logits", "paged_mqa_logits_metadata")


def _triton_mqa_why_not(request: Request) -> str | None:
    h, d = request.n, request.k
    if h & (h - 1) or d & (d - 1) or d < 16:
        return f"H={h} heads and D={d}: the Triton MQA kernels take powers of two (D >= 16)"
    return _triton_device_why_not(request)


def _triton_why_not(request: Request) -> str | None:
    return _triton_mqa_why_not(request) if request.op in MQA_OPS else _triton_device_why_not(request)


# What DeepGEMM's sm_90 MQA-logits kernels serve (its tests: H 32 or 64; D 32, 64 or 128).
DEEP_GEMM_MQA_HEADS = (32, 64)
DEEP_GEMM_MQA_HEAD_DIMS = (32, 64, 128)


def _deep_gemm_why_not(request: Request) -> str | None:
    if request.op in MQA_OPS:
        if request.n not in DEEP_GEMM_MQA_HEADS or request.k not in DEEP_GEMM_MQA_HEAD_DIMS:
            return (
                f"H={request.n} heads, D={request.k}: DeepGEMM's MQA logits take H in "
                f"{DEEP_GEMM_MQA_HEADS} and D in {DEEP_GEMM_MQA_HEAD_DIMS}"
            )
        return _vendor_why_not("deep_gemm", request, (9, 0), exact_major=9)
    if request.n % 64:
        return f"N={request.n} is not a multiple of 64"
    return _vendor_why_not("deep_gemm", request, (9, 0), exact_major=SCALED_VENDOR_MAJOR)


def _deep_gemm_masked_why_not(request: Request) -> str | None:
    if request.op != "moe":
        return "serves routed experts only (fp8compile::moe)"
    from .ops.moe.vendors import MASKED_MAX_TOKENS

    if request.m_max is None or request.m_max > MASKED_MAX_TOKENS:
        return (
            f"masked layout: E blocks of up to T rows each, for T <= {MASKED_MAX_TOKENS} tokens "
            f"({request.m_range} asked)"
        )
    return _deep_gemm_why_not(request)


def _flashinfer_why_not(request: Request) -> str | None:
    if request.e8m0:
        return "quantizes activations itself, without E8M0 scale rounding"
    if request.n % 64:
        return f"N={request.n} is not a multiple of 64"
    return _vendor_why_not("flashinfer", request, (9, 0), exact_major=9)


def _cublas_why_not(request: Request) -> str | None:
    if (why := _bf16_only("cuBLAS (torch._scaled_mm)", request)) is not None:
        return why
    if request.op in SCALED_OPS:  # tensorwise / rowwise _scaled_mm: no block-scaling limits
        if request.batch_invariant:
            return "picks its kernel by M: not batch-invariant"
        from .ops.linear.scaled_cublas import why_not as shape_why_not

        why = shape_why_not(request.n, request.k)
        if why is None and request.op == "gated_scaled_linear":  # act(a, b) quantized by our kernel
            why = _triton_device_why_not(request)
        return why if why is not None else _cuda_why_not(request, (8, 9))
    if request.m_min < CUBLAS_MIN_M:
        return f"cuBLAS block scaling fails below M = {CUBLAS_MIN_M} (CUBLAS_STATUS_NOT_SUPPORTED at M = 1)"
    if request.n % 128:
        return f"N={request.n} is not a multiple of 128"
    if request.k % (CUBLAS_K_GROUPS * 128):
        return (
            f"K={request.k} is {request.k // 128} groups of 128, not a multiple of {CUBLAS_K_GROUPS}: "
            "cuBLAS block scaling returns wrong numbers there, with no error"
        )
    if request.batch_invariant:
        return "picks its kernel by M: not batch-invariant"
    return _cuda_why_not(request, (9, 0), exact_major=SCALED_VENDOR_MAJOR)


# The scaled recipes' ops (a linear, a gated MLP's down projection): one scale per row or tensor.
SCALED_OPS = ("scaled_linear", "gated_scaled_linear")


# The vendors' block-scaled GEMMs (DeepGEMM's, cuBLAS's 1x128 / 128x128) with the fp32 scales we
# pass were measured on sm_90 (H100, H200) only. DeepGEMM's sm_100 kernels take UE8M0 scales
# packed four to an int (its README); cuBLAS's block-scaled modes were not tried on any other
# major. Elsewhere our Triton kernels serve, rather than a vendor call that may fail or read the
# scales otherwise than we lay them out.
SCALED_VENDOR_MAJOR = 9
# Measured on an H200 (../shared/device/README.md): torch._scaled_mm block scaling works at
# M >= 8 and fails at M = 1.
CUBLAS_MIN_M = 8
# Measured on an H100 (torch 2.11, BENCHMARKS.md "cuBLAS block scaling and K"): torch._scaled_mm's
# 1x128 / 128x128 block scaling is right (calc_diff 2e-7 against the reference) only where K/128,
# the length of each transposed weight-scale column, is a multiple of 4 (16-byte aligned columns,
# as cuBLAS wants of the activation scales too). At K/128 = 1, 2, 3, 5, 6, 7, 9 and 38 it returns
# calc_diff 0.09-1.0 or NaN, with no error; a column stride padded to 4 is refused by torch.
CUBLAS_K_GROUPS = 4


_BACKENDS: dict[str, Backend] = {
    "triton_small_m": Backend(
        "triton_small_m",
        {
            "linear": ".ops.linear.triton_gemm:linear_small_m",
            "gated_linear": ".ops.linear.triton_gemm:gated_linear_small_m",
            "scaled_linear": ".ops.linear.triton_scaled:linear_scaled_small_m",
            "gated_scaled_linear": ".ops.linear.triton_scaled:gated_linear_scaled_small_m",
        },
        _triton_small_m_why_not,
        prepare=".ops.linear.triton_gemm:prepare_small_m",
    ),
    "deep_gemm": Backend(
        "deep_gemm",
        {
            "linear": ".ops.linear.vendors:linear_deep_gemm",
            "gated_linear": ".ops.linear.vendors:gated_linear_deep_gemm",
            "moe": ".ops.moe.vendors:moe_deep_gemm",
            "mqa_logits": ".ops.mqa_logits.vendors:mqa_logits_deep_gemm",
            "paged_mqa_logits": ".ops.mqa_logits.vendors:paged_mqa_logits_deep_gemm",
            "paged_mqa_logits_metadata": ".ops.mqa_logits.vendors:paged_mqa_logits_metadata_deep_gemm",
        },
        _deep_gemm_why_not,
        prepare=".ops.vendors:prepare_deep_gemm",
    ),
    "deep_gemm_masked": Backend(
        "deep_gemm_masked",
        {"moe": ".ops.moe.vendors:moe_deep_gemm_masked"},
        _deep_gemm_masked_why_not,
        prepare=".ops.vendors:prepare_deep_gemm",
    ),
    "triton": Backend(
        "triton",
        {
            "linear": ".ops.linear.triton_gemm:linear_large_m",
            "gated_linear": ".ops.linear.triton_gemm:gated_linear_large_m",
            "gemm": ".ops.linear.triton_gemm:gemm_large_m",
            "quant_act": ".ops.quant.triton_quant:quant_act_row",
            "scaled_linear": ".ops.linear.triton_scaled_gemm:linear_scaled_large_m",
            "gated_scaled_linear": ".ops.linear.triton_scaled_gemm:gated_linear_scaled_large_m",
            "moe": ".ops.moe.triton_moe:moe_triton",
            "mqa_logits": ".ops.mqa_logits.triton_mqa:mqa_logits",
            "paged_mqa_logits": ".ops.mqa_logits.triton_mqa:paged_mqa_logits",
            "paged_mqa_logits_metadata": ".ops.mqa_logits.reference:paged_schedule",
        },
        _triton_why_not,
    ),
    "cublas": Backend(
        "cublas",
        {
            "linear": ".ops.linear.vendors:linear_cublas",
            "gated_linear": ".ops.linear.vendors:gated_linear_cublas",
            "scaled_linear": ".ops.linear.scaled_cublas:linear_scaled_cublas",
            "gated_scaled_linear": ".ops.linear.scaled_gated_mm:gated_linear_scaled_cublas",
        },
        _cublas_why_not,
    ),
    "flashinfer": Backend(
        "flashinfer", {"linear": ".ops.linear.vendors:linear_flashinfer"}, _flashinfer_why_not
    ),
    "reference": Backend(
        name="reference",
        ops={
            "linear": ".ops.linear.reference:linear_block",
            "gated_linear": ".ops.linear.reference:gated_linear_block",
            "gemm": ".ops.linear.reference:gemm_block",
            "quant_act": ".ops.quant.reference:quant_act_block",
            "moe": ".ops.moe.reference:moe_block",
            "scaled_linear": ".ops.linear.reference_scaled:linear_scaled",
            "gated_scaled_linear": ".ops.linear.reference_scaled:gated_linear_scaled",
            "mqa_logits": ".ops.mqa_logits.reference:mqa_logits",
            "paged_mqa_logits": ".ops.mqa_logits.reference:paged_mqa_logits",
            "paged_mqa_logits_metadata": ".ops.mqa_logits.reference:paged_schedule",
        },
        why_not=_reference_why_not,
    ),
}


def register(backend: Backend, *, first: bool = False) -> None:
    """Add a backend (replacing one of the same name); `first` puts it at the front of every
    default order, else it goes just before "reference", which always stays last."""
    _BACKENDS[backend.name] = backend
    _IMPLEMENTATIONS.clear()

    def placed(order):
        order = [n for n in order if n != backend.name]
        order.insert(0 if first else len(order) - 1, backend.name)
        return tuple(order)

    for tier in DEFAULT_ORDERS:
        DEFAULT_ORDERS[tier] = placed(DEFAULT_ORDERS[tier])


def names() -> tuple[str, ...]:
    return tuple(_BACKENDS)


# Preference order per range of M when Fp8Config.backends is None: the first that serves wins.
# From `python -m fp8compile bench gemm` / `bench moe` on an H200 (BENCHMARKS.md):
# - small (M <= small_m): our fused decode kernel (linears), our grouped Triton MoE kernel
#   (DeepGEMM's masked grouped GEMM after it: a MoE layer took 1.11-2.63x the Triton path's time
#   at 1-64 tokens on an H100, Qwen3-30B-A3B and DeepSeek-V3 widths: BENCHMARKS.md, "MoE layers");
# - medium: cuBLAS for linears (DeepGEMM was 2.2-2.6x slower than cuBLAS at M = 1024 for
#   N = 4096 and at M = 128 for N = 24576), Triton for MoE (DeepGEMM pads every expert to 128
#   rows: slower up to 1024 tokens);
# - large (M > large_m): DeepGEMM (8-14% faster than cuBLAS at M = 4096 on every shape).
# reference always last.
DEFAULT_ORDERS = {
    "small": (
        "triton_small_m",
        "triton",
        "deep_gemm_masked",
        "cublas",
        "deep_gemm",
        "flashinfer",
        "reference",
    ),
    "medium": ("cublas", "triton", "deep_gemm", "flashinfer", "reference"),
    "large": ("deep_gemm", "cublas", "triton", "flashinfer", "reference"),
}
# Where one op's order departs from its tier's: (op, tier) -> (backend, the backend it comes after).
# MoE above large_m: our grouped Gluon GEMMs (the triton backend from 32 slots per expert) give
# DeepGEMM's numbers (calc_diff 0.0) faster, with 64-row expert blocks where DeepGEMM pads to
# 128: on an H100, 431 against 565 us at 2048 tokens, 642 / 758 at 4096 and 1136 / 1195 at 8192
# (Qwen3-30B-A3B), 5893 / 7924 at 4096 (DeepSeek-V3) (BENCHMARKS.md, "2026-11-24 (c8e9c49)").
ORDER_EXCEPTIONS = {("moe", "large"): ("deep_gemm", "triton")}


# The indexer logits have no range of M: one order for every call. DeepGEMM first: at prefill
# (M = N = 4096 and 8192, H = 64, D = 128, causal) it took 151.5 and 591.5 us on an H100 against
# our Triton kernel's 155.2 and 586.1 (bench mqa, BENCHMARKS.md, "Indexer logits"): a tie, and
# DeepGEMM's side of it is the shorter prefill.
MQA_ORDER = ("deep_gemm", "triton", "reference")
# The paged form: ours first, DeepGEMM next. In bench mqa (H100, 2026-11-25 (833267e); blocks of
# 64, next_n 1, both through the op) ours took 0.76-1.16x DeepGEMM's time over batch 1-64 and
# context 4k-64k (geometric mean 1.00x): a tie, and ours serves every block size and next_n where
# DeepGEMM's sm_90 kernel takes blocks of 64 and next_n 1 or 2. DeepGEMM's adapter passes its GPU
# test behind the op (next_n 1 and 2, ragged lengths, clean_logits).
PAGED_MQA_ORDER = ("triton", "deep_gemm", "reference")


def default_order(tier: str, op: str | None = None) -> tuple[str, ...]:
    """The preference order of a range of M ("small", "medium" or "large"), for `op` if given."""
    if op in ("paged_mqa_logits", "paged_mqa_logits_metadata"):
        return PAGED_MQA_ORDER
    if op in MQA_OPS:
        return MQA_ORDER
    order = DEFAULT_ORDERS[tier]
    moved, after = ORDER_EXCEPTIONS.get((op, tier), (None, None))
    if moved in order and after in order and order.index(moved) < order.index(after):
        order = tuple(name for name in order if name != moved)
        at = order.index(after) + 1
        order = order[:at] + (moved,) + order[at:]
    return order


def why_not(backend: str, request: Request) -> str | None:
    if backend not in _BACKENDS:
        return f"unknown backend (valid: {', '.join(names())})"
    b = _BACKENDS[backend]
    if request.op not in b.ops:
        return f"no {request.op} kernel"
    return b.why_not(request)


class UnservableBackends(RuntimeError):
    """The backends the config names (Fp8Config.backends) cannot serve a call site: the user's
    choice cannot be honoured, which is an error of the compile, not a site kept bf16."""


class NoGpuKernel(RuntimeError):
    """No FP8 kernel runs this request on its GPU (one without FP8 tensor cores, or without the
    libraries): only the float64 reference would, far slower than the bf16 op it replaces, so
    the call site stays bf16 unless Fp8Config.backends names the reference."""


def choose(request: Request, order: tuple[str, ...] | None = None, tier: str = "medium") -> str:
    """The first backend in `order` (default: the tier's default order) that serves `request`;
    RuntimeError naming every reason if none (UnservableBackends where `order` was given),
    NoGpuKernel if the default order on a GPU comes down to the reference."""
    default = order is None
    if default:
        # On the CPU the reference is the product; Triton's interpreter runs only when asked for.
        order = default_order(tier, request.op) if request.device.type != "cpu" else ("reference",)
    rejected = []
    for name in order:
        reason = why_not(name, request)
        if reason is None:
            if name == "reference" and default and request.device.type == "cuda":
                raise NoGpuKernel(
                    f"no FP8 kernel runs {request.op} ({request.m_range}) on this GPU "
                    f"({'; '.join(rejected)}): kept bf16; Fp8Config(backends=[..., 'reference']) "
                    "runs the float64 reference kernels instead"
                )
            return name
        rejected.append(f"{name}: {reason}")
    raise (RuntimeError if default else UnservableBackends)(
        f"no backend in {list(order)} can run {request.op} (N={request.n}, K={request.k}, "
        f"{request.m_range}) on {request.device}: {'; '.join(rejected)}"
    )


def prepare(backend: str, request: Request) -> None:
    """Let `backend` allocate what its kernels keep between calls for `request` (see Backend.prepare)."""
    hook = _BACKENDS[backend].prepare
    if hook is not None:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with (
            unset_fake_temporarily(),
            torch.no_grad(),
        ):  # real tensors, though the compiler traces with fake ones
            _resolve(hook)(request)


# (op, backend) -> its kernel, resolved once: every op call asks, and outside a CUDA graph an
# import_module per call is host time on the critical path.
_IMPLEMENTATIONS: dict[tuple[str, str], tuple[Backend, Callable]] = {}


# A call site that gets no M dispatch cond (passes/dispatch.py: a graph whose int input moves
# every call, under CUDA graphs) still runs each range of M on its own kernel: its backend names
# them all, "triton_small_m if M <= 32 else deep_gemm", and the op picks one by the rows of its
# first operand (..., K) at every call. Under CUDA graphs each M is recorded once, with the
# kernel its range gets.
_IF_M = " if M <= "


def by_rows(pieces: list[tuple[int | None, str]]) -> str:
    """The backend name of `pieces`, (m_max, backend) in increasing m_max, the last unbounded:
    [(32, "triton_small_m"), (None, "deep_gemm")] -> "triton_small_m if M <= 32 else deep_gemm"."""
    *bounded, (last_max, last) = pieces
    if not bounded:
        return last
    if last_max is not None or any(m_max is None for m_max, _ in bounded):
        raise ValueError(f"by_rows needs bounded pieces then one unbounded, got {pieces}")
    return " else ".join([f"{name}{_IF_M}{m_max}" for m_max, name in bounded] + [last])


def rows_pieces(backend: str) -> list[tuple[int | None, str]]:
    """by_rows inverted; a plain backend name is one unbounded piece."""
    *bounded, last = backend.split(" else ")
    pieces = []
    for part in bounded:
        name, _, m_max = part.partition(_IF_M)
        pieces.append((int(m_max), name))
    return pieces + [(None, last)]


def _by_rows_kernel(op: str, backend: str) -> Callable:
    table = rows_pieces(backend)

    def run(x, *args, **kwargs):
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        name = next(name for m_max, name in table if m_max is None or rows <= m_max)
        return implementation(op, name)(x, *args, **kwargs)

    return run


# backend names of by_rows -> their kernel, parsed once
_BY_ROWS: dict[tuple[str, str], Callable] = {}


def implementation(op: str, backend: str) -> Callable:
    if _IF_M in backend:
        fn = _BY_ROWS.get((op, backend))
        if fn is None:
            fn = _BY_ROWS[(op, backend)] = _by_rows_kernel(op, backend)
        return fn
    b = _BACKENDS.get(backend)
    cached = _IMPLEMENTATIONS.get((op, backend))
    if cached is not None and cached[0] is b:  # the same Backend object as when resolved
        return cached[1]
    if b is None or op not in b.ops:
        raise RuntimeError(f"backend {backend!r} has no {op!r} kernel (backends: {', '.join(names())})")
    fn = b.implementation(op)
    _IMPLEMENTATIONS[(op, backend)] = (b, fn)
    return fn


# The ops look their kernels up through ops/kernels.py: the registry fills that table, so that
# no op imports it.
kernels.install(implementation)
