"""The one configuration object, and the one place that turns user options into it."""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from typing import Any

from . import registry

# "block": DeepSeek-V3 (activations 1x128 per token, weights 128x128); "rowwise": a scale per
# output channel of the weight and per token of the activation (torchao's PerRow, vLLM's
# per-channel weights with per-token activations); "tensor": one scale for the weight and one
# for the activation (ops/linear/reference_scaled.py).
RECIPES = ("block", "rowwise", "tensor")
# Fusion passes, run in this order before the linear pass.
FUSIONS = (
    "gqa_attention",
    "mqa_logits",
    "moe",
    "gate_up",
    "qkv",
    "silu_mul",
    "all_reduce",
    "all_reduce_norm",
)
# Every fusion runs by default. all_reduce_norm was opt-in while its kernel made a tensor-parallel
# step slower; since its 16-byte accesses (416ab1c) it makes the step faster, and since its kernel
# pushes each row to the peers with no barrier (35613c0) 1.12x and 1.11x: Llama-3-8B widths, 32
# layers, TP2 on two H200s, each variant in a process of its own, 2.45 / 3.19 ms a step at batch
# 1 / 16 against 2.74 / 3.54 without it (BENCHMARKS.md, "Tensor parallel at 32 layers: the
# all-reduce pushed").
DEFAULT_FUSIONS = FUSIONS

# Small/large-M threshold for the torch.cond dispatch: M <= SMALL_M takes the decode path.
# 32 is where the anchors' decode kernels stop streaming weights and start being compute-bound
# (../shared/device/README.md: DeepGEMM/FlashInfer/cuBLAS times are flat from M=1 to M=16).
SMALL_M = 32
# Above LARGE_M the large-M kernels take over (DeepGEMM by default). `bench gemm` on an H200
# (BENCHMARKS.md): DeepGEMM is 8-14% faster than cuBLAS at M = 4096 on all five shapes and at
# M = 2048 on four of five, but 2.5x slower at M = 1024 for N = 4096 (and 1.15x at M = 2560:
# no threshold avoids every cliff; autotune does). So 2048 rows belong to DeepGEMM: on a whole
# Llama-3-8B (H100, 2026-11-26 (a315e94)) a 2048-token prefill took 36.3 ms with 1536 here against
# 39.2 ms with 2048 (bf16 Inductor 54.4 ms). Narrow outputs are the exception: for Qwen3-30B-A3B's
# o projection (N = 2048, K = 4096) DeepGEMM took 91-99 us against cuBLAS's 33-37 from 1536 to
# 2048 rows, where it took 0.84-1.16x cuBLAS's time on every output of 3584 or more (H100,
# benchmarks/large_m_probe_h100_2026-11-25_8e56bd4.json), so outputs narrower than WIDE_N keep cuBLAS up
# to NARROW_LARGE_M rows. For MoE blocks our grouped kernels stay first in every range
# (registry.ORDER_EXCEPTIONS).
LARGE_M = 1536
WIDE_N = 4096
NARROW_LARGE_M = 2048

DEBUG_DIR_ENV = "FP8COMPILE_DEBUG_DIR"
INDUCTOR_ENV = "FP8COMPILE_INDUCTOR"  # "0": Fp8Config.inductor defaults to False
# The options that are True or False.
SWITCHES = (
    "e8m0",
    "batch_invariant",
    "autotune",
    "release_bf16_weights",
    "split_kv",
    "inductor",
    "strict",
    "quantize_checkpoint_bf16",
)
# The switches that may also be None: the default picked for the recipe or the mode.
AUTO_SWITCHES = ("inductor_launch", "fast_accum", "inline_conds")


def _debug_dir_from_env() -> str | None:
    return os.environ.get(DEBUG_DIR_ENV) or None


def _inductor_from_env() -> bool:
    return os.environ.get(INDUCTOR_ENV, "1") != "0"


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """What the fp8 backend rewrites and how.

    recipe:          scaling recipe: "block" (DeepSeek-V3: activations 1x128, weights 128x128),
                     "rowwise" (weights per output channel, activations per token) or "tensor"
                     (one scale each). rowwise and tensor serve linears (gate/up and q/k/v
                     still merged into one GEMM) and a gated MLP's down projection with its
                     activation fused (gated_qlinear_scaled); routed experts stay unquantized.
    e8m0:            round every scale up to a power of two (UE8M0 checkpoints, Blackwell).
    batch_invariant: one kernel and one reduction order for every M, so row i of the output
                     does not depend on the other rows of the batch. In rowwise and tensor
                     (static scales only) our Triton GEMM then serves every M, not cuBLAS.
    small_m:         rows M <= small_m take the small-M (decode) kernel, chosen by torch.cond.
    large_m:         rows M > large_m take the large-M kernel (a second, nested cond);
                     0 = no third range; None = by the output width N: LARGE_M (1536) where
                     N >= WIDE_N (4096), NARROW_LARGE_M (2048) below (large_m_for).
    autotune:        time the backends that serve each call site on this GPU while compiling, and
                     split M where another kernel is faster (autotune.py), instead of the
                     small_m / large_m ranges and the default order; linears and gated linears.
    backends:        kernel backends in preference order; None = the measured default order.
    skip:            module-name globs left unchanged, e.g. ("lm_head", "*.mlp.down_proj").
    fusions:         fusion passes to run (default: all of them); () runs the plain linear pass
                     only.
                     "gqa_attention" is not FP8: grouped-query attention over a KV cache without
                     repeat_kv's copy (passes/gqa_attention.py). "all_reduce" is not FP8 either:
                     a sharded model's sum all-reduces on symmetric memory's one-shot and
                     two-shot kernels at decode sizes, NCCL above (passes/all_reduce.py).
                     "all_reduce_norm": such an all-reduce, the residual add after it and the
                     RMSNorm of the sum in one kernel of ours (passes/all_reduce_norm.py).
    debug_dir:       write graphs before/after our passes and depyf-decompiled code here
                     (default: $FP8COMPILE_DEBUG_DIR).
    inductor_launch: the decode kernel, the quantization and cuBLAS call of the cuBLAS side, and
                     the routed experts' kernels at decode sizes (fp8compile::moe_decode) and
                     around the Gluon GEMMs from 32 rows per expert (fp8compile::moe_gluon),
                     as launches in Inductor's generated code (no Python op around them,
                     passes/inline.py) instead of the fp8compile op; None = where CUDA graphs
                     are not asked for (there every call pays the host's cost).
    inline_conds:    emit the M dispatch's torch.cond branches inline in Inductor's generated code
                     instead of as a function per branch (size_conds.py): less host time per
                     call site, the same bits. None = where CUDA graphs are not asked for (a
                     replayed graph pays no host time per call site): Gemma-2-9B's 8 layers,
                     128-token prefill in default mode, went 0.86x -> 1.18x bf16 Inductor
                     (BENCHMARKS.md, "Default mode at 8 layers", H200, 2026-11-29).
    release_bf16_weights: give back the device memory of the bf16 weights no compiled graph reads
                     (those with an FP8 copy): their values move to host memory (release.py),
                     each as its copy is made, so a compile needs room for one copy beside
                     the bf16 model, not for all of them. An eager call of a module holding
                     one (generate()'s prompt with a CompileConfig) copies them in for the
                     call and frees them after;
                     fp8compile.restore_bf16_weights() brings them back for good.
    act_amax:        static activation scales ("rowwise" and "tensor"): {linear module name:
                     calibrated amax of its input} (fp8compile.calibrate), scale = amax / 448;
                     None = dynamic scales, computed per call. A linear the table lacks stays bf16.
    act_amax_ub:     upper bound on a dynamic activation amax (vLLM's input_scale_ub): values
                     past ub saturate at 448 * scale; 0 = none.
    fast_accum:      the rowwise and tensor recipes' cuBLAS GEMM (above the decode sizes) in
                     torch._scaled_mm's fast-accumulation mode: Hopper's FP8 tensor cores then
                     accumulate all of K in their own reduced-precision accumulator instead of
                     promoting partial sums to fp32 along the way, as our Triton decode kernel
                     of those recipes does at every M. None (the default): on for rowwise and
                     tensor, as torchao's float8 configs run them. Measured on an H100: the
                     GEMM 1.07-1.20x faster at M = 4096, its calc_diff against the exact
                     product of the same FP8 operands 2e-6..7e-6 instead of 1.4e-6 for K 4096-
                     18944, next to quantization's 7.0e-4 (BENCHMARKS.md, "2026-11-26
                     (82a2db6)"). False promotes; True is refused for the block recipe.
    split_kv:        the gqa_attention fusion's decode attention on a GPU runs fp8compile's
                     split-KV kernel (ops/attention/triton_attention.py: the keys spread over the SMs)
                     instead of the sdpa kernel torch picks (its work split over sequences and
                     K/V heads only, each block walking the whole cache).
    inductor:        hand the rewritten graph to Inductor (the default). False runs it as the
                     ops it holds (ours and ATen's), with no code generated or compiled: a check
                     of what the passes rewrote at a fraction of the compile time (the CPU
                     tests: tests/conftest.py), slow to run, no CUDA graphs. The default comes
                     from $FP8COMPILE_INDUCTOR ("0": False).
    strict:          an exception inside a pass fails the compile. Off (the default), it leaves
                     the site it was raised at as the model wrote it, the rest of the graph is
                     still rewritten, the report names the site, the pass and the exception,
                     and one warning says so (passes/guard.py). On, for the tests and debugging.
    quantize_checkpoint_bf16: in a model loaded from an FP8 checkpoint (a graph holding its
                     linears, passes/checkpoint_linear.py), the linears the checkpoint left in
                     bf16 (its modules_to_not_convert: the lm_head, most often) stay as its
                     publisher chose (off, the default); on, they are quantized as in a bf16
                     model: a faster step, a larger error than the checkpoint's own.
    """

    recipe: str = "block"
    e8m0: bool = False
    batch_invariant: bool = False
    small_m: int = SMALL_M
    large_m: int | None = None
    autotune: bool = False
    backends: tuple[str, ...] | None = None
    skip: tuple[str, ...] = ()
    fusions: tuple[str, ...] = DEFAULT_FUSIONS
    debug_dir: str | None = dataclasses.field(default_factory=_debug_dir_from_env)
    inductor_launch: bool | None = None
    inline_conds: bool | None = None
    release_bf16_weights: bool = False
    act_amax: Mapping[str, float] | None = None
    act_amax_ub: float = 0.0
    fast_accum: bool | None = None
    split_kv: bool = True
    inductor: bool = dataclasses.field(default_factory=_inductor_from_env)
    strict: bool = False
    quantize_checkpoint_bf16: bool = False

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"recipe={self.recipe!r} is not supported; valid recipes: {', '.join(RECIPES)}")
        self._check_recipe_options()
        for name in SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in AUTO_SWITCHES:
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True, False or None (auto), got {getattr(self, name)!r}")
        if isinstance(self.small_m, bool) or not isinstance(self.small_m, int) or self.small_m < 0:
            raise ValueError(
                f"small_m must be an int >= 0 (0 = never take the small-M path), got {self.small_m!r}"
            )
        if self.large_m is not None and (
            isinstance(self.large_m, bool) or not isinstance(self.large_m, int) or self.large_m < 0
        ):
            raise ValueError(
                "large_m must be an int >= 0 (0 = no separate large-M range) or None (by the output "
                f"width), got {self.large_m!r}"
            )
        if self.large_m is None and self.small_m >= LARGE_M:
            raise ValueError(
                f"small_m={self.small_m} is not below the default large_m ({LARGE_M} for outputs of "
                f"{WIDE_N} or more, {NARROW_LARGE_M} narrower): set large_m too (0 for no large-M range)"
            )
        if self.large_m is not None and 0 < self.large_m <= self.small_m:
            raise ValueError(
                f"large_m={self.large_m} must be above small_m={self.small_m} (or 0 for no large-M range)"
            )
        object.__setattr__(self, "skip", _str_tuple("skip", self.skip))
        object.__setattr__(self, "fusions", _str_tuple("fusions", self.fusions))
        unknown = [f for f in self.fusions if f not in FUSIONS]
        if unknown:
            raise ValueError(f"unknown fusion(s) {unknown}; valid fusions: {', '.join(FUSIONS)}")
        if self.backends is not None:
            backends = _str_tuple("backends", self.backends)
            valid = registry.names()
            unknown = [b for b in backends if b not in valid]
            if unknown:
                raise ValueError(f"unknown backend(s) {unknown}; valid backends: {', '.join(valid)}")
            if len(set(backends)) != len(backends):
                raise ValueError(f"backends lists a backend twice: {backends}")
            if not backends:
                raise ValueError(f"backends must name at least one of: {', '.join(registry.names())}")
            object.__setattr__(self, "backends", backends)
        if self.debug_dir is not None and not isinstance(self.debug_dir, (str, os.PathLike)):
            raise TypeError(f"debug_dir must be a path or None, got {self.debug_dir!r}")
        if self.debug_dir is not None:
            object.__setattr__(self, "debug_dir", os.fspath(self.debug_dir))

    def large_m_for(self, n: int) -> int:
        """The large-M threshold of a call site with N outputs: large_m, or where it is None,
        LARGE_M for outputs of WIDE_N or more and NARROW_LARGE_M for narrower ones."""
        if self.large_m is not None:
            return self.large_m
        return LARGE_M if n >= WIDE_N else NARROW_LARGE_M

    def cublas_fast_accum(self) -> bool:
        """Whether the scaled recipes' cuBLAS GEMM accumulates fast: fast_accum, or where it is
        None, yes for rowwise and tensor (the block recipe has no such GEMM)."""
        return self.recipe != "block" if self.fast_accum is None else self.fast_accum

    def _check_recipe_options(self) -> None:
        if self.recipe == "block":
            if self.act_amax is not None or self.act_amax_ub:
                raise ValueError(
                    "act_amax and act_amax_ub serve the rowwise and tensor recipes; the block recipe "
                    "scales each 1x128 group of a token from its own amax"
                )
            if self.fast_accum:
                raise ValueError(
                    "fast_accum serves the rowwise and tensor recipes' cuBLAS GEMM; the block recipe "
                    "scales each 128-wide group of K, so its kernels sum every group's product in fp32"
                )
            return
        if self.batch_invariant and self.recipe == "tensor" and self.act_amax is None:
            raise ValueError(
                "batch_invariant=True with recipe='tensor' needs static scales (act_amax, from "
                "fp8compile.calibrate): a dynamic per-tensor scale comes from every row of the batch"
            )
        ub = self.act_amax_ub
        if isinstance(ub, bool) or not isinstance(ub, (int, float)) or not ub >= 0:
            raise ValueError(f"act_amax_ub must be a number >= 0 (0 = no bound), got {ub!r}")
        object.__setattr__(self, "act_amax_ub", float(ub))
        if self.act_amax is not None:
            if not isinstance(self.act_amax, Mapping):
                raise TypeError(
                    "act_amax must map linear module names to calibrated amax values "
                    f"(fp8compile.calibrate), got {type(self.act_amax).__name__}"
                )
            bad = {k: v for k, v in self.act_amax.items() if not isinstance(k, str) or not _positive(v)}
            if bad:
                raise ValueError(f"act_amax needs module name -> positive finite amax, got {bad}")
            if ub:
                raise ValueError("act_amax_ub bounds dynamic scales; with act_amax the scales are static")
            # A read-only copy: a frozen config must not change under the compiled graphs.
            object.__setattr__(self, "act_amax", AmaxTable(self.act_amax))

    def replace(self, **changes: Any) -> Fp8Config:
        return make_config(self, **changes)


FIELDS = tuple(f.name for f in dataclasses.fields(Fp8Config))


class AmaxTable(Mapping):
    """A read-only {linear module name: calibrated amax} (Fp8Config.act_amax): hashable, so the
    config stays hashable, and copyable (transformers deep-copies compile configs)."""

    def __init__(self, table: Mapping[str, float]):
        self._table = {str(k): float(v) for k, v in table.items()}

    def __getitem__(self, name: str) -> float:
        return self._table[name]

    def __iter__(self):
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def __hash__(self) -> int:
        return hash(frozenset(self._table.items()))

    def __repr__(self) -> str:
        return f"AmaxTable({len(self)} linears)"


def _positive(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < float("inf")


def _str_tuple(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    try:
        items = tuple(value)
    except TypeError:
        raise TypeError(f"{name} must be a string or a sequence of strings, got {value!r}") from None
    if not all(isinstance(v, str) for v in items):
        raise TypeError(f"{name} must contain strings only, got {items!r}")
    return items


# Options a command line can set as text (KEY=VALUE), by how their text reads; Fp8Config's own
# checks then judge the value. act_amax is a table: fp8compile.calibrate / load_scales make it.
_TEXT_INTS = ("small_m", "large_m")
_TEXT_FLOATS = ("act_amax_ub",)
_TEXT_LISTS = ("backends", "skip", "fusions")  # comma-separated; empty = ()


def parse_option(text: str) -> tuple[str, Any]:
    """ "KEY=VALUE" from a command line -> (key, typed value): true/false for switches (none too
    for inductor_launch, fast_accum and large_m), ints, comma-separated lists; an unknown key or a
    bad value is an error that says what the key takes."""
    key, sep, value = text.partition("=")
    key, value = key.strip(), value.strip()
    if not sep or not key:
        raise ValueError(f"{text!r}: an option is KEY=VALUE, e.g. large_m=1536")
    if key not in FIELDS:
        hint = difflib.get_close_matches(key, FIELDS, n=1)
        raise ValueError(
            f"unknown fp8compile option {key!r}"
            + (f" (did you mean {hint[0]!r}?)" if hint else "")
            + f"; valid options: {', '.join(FIELDS)}"
        )
    switches = {"true": True, "false": False}
    if key in SWITCHES or key in AUTO_SWITCHES:
        choices = {**switches, "none": None} if key in AUTO_SWITCHES else switches
        if value.lower() not in choices:
            raise ValueError(f"{key} takes {' or '.join(choices)}, got {value!r}")
        return key, choices[value.lower()]
    if key == "large_m" and value.lower() == "none":
        return key, None  # the threshold by output width
    for names, kind, what in ((_TEXT_INTS, int, "an integer"), (_TEXT_FLOATS, float, "a number")):
        if key in names:
            try:
                return key, kind(value)
            except ValueError:
                what += " or none (by the output width)" if key == "large_m" else ""
                raise ValueError(f"{key} takes {what}, got {value!r}") from None
    if key in _TEXT_LISTS:
        return key, tuple(v.strip() for v in value.split(",") if v.strip())
    if key == "act_amax":
        raise ValueError("act_amax is a table of calibrated scales: make it with fp8compile.calibrate")
    return key, value  # recipe, debug_dir: the text itself


def make_config(config: Fp8Config | Mapping[str, Any] | None = None, **options: Any) -> Fp8Config:
    """Fp8Config from a config, a dict of options, keyword options, or a mix (keywords win).

    Unknown option names are an error that lists the valid ones.
    """
    if config is None:
        base: dict[str, Any] = {}
    elif isinstance(config, Fp8Config):
        base = {f: getattr(config, f) for f in FIELDS}
    elif isinstance(config, Mapping):
        base = dict(config)
    else:
        raise TypeError(f"expected an Fp8Config, a dict of options or None, got {type(config).__name__}")
    merged = {**base, **options}
    unknown = [k for k in merged if k not in FIELDS]
    if unknown:
        hints = [difflib.get_close_matches(k, FIELDS, n=1) for k in unknown]
        hint = "".join(f" (did you mean {h[0]!r} for {k!r}?)" for k, h in zip(unknown, hints) if h)
        raise TypeError(f"unknown fp8compile option(s) {unknown}{hint}; valid options: {', '.join(FIELDS)}")
    return Fp8Config(**merged)
