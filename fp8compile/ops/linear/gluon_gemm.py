"""Warp-specialized block-scaled FP8 GEMM for Hopper, written in Gluon (Triton's explicit dialect).

Why a second large-M kernel: triton_gemm's kernel is plain Triton, and Triton waits for each
128-wide K group's tensor-core product before it can scale it into the fp32 accumulator, so the
tensor cores sit idle while the CUDA cores promote (0.60-0.71x DeepGEMM at M = 4096). Gluon lets
the kernel say which warps do what:

- one producer warp streams the activation (A) and weight (B) tiles of each K group into a ring
  of STAGES shared-memory buffers with TMA, STAGE_GROUPS K groups per buffer, and waits on a
  buffer's `empty` barrier before reusing it;
- two (or three) consumer warpgroups each own 64 rows of the output tile. Per buffer a consumer
  waits for its `ready` barrier; per K group it runs its wgmma (64 x BLOCK_N x 128, fp32 out) and
  promotes: acc += product * (the row's activation scale * the weight scale); after the last
  group's wgmma it releases the buffer. The consumers are independent warps, so while one
  promotes, another's wgmma runs. Two groups per buffer halve the barrier waits, releases and
  their warpgroup syncs: 0.79-0.94x DeepGEMM at M = 4096, 0.80-1.11x at 2048
  (9d201bf:scripts/gluon_probe.py, four runs).
- With OVERLAP, each consumer also keeps one of its own wgmmas in flight while it promotes the
  other group of the buffer (two register tiles taking groups in turn).
- The consumers may instead split a tile's columns (64 x 256 tiles, WIDE_CONFIG): one shared
  activation box, a 128-row weight box each.

grouped_gemm() is the routed experts' variant (ops/moe/triton_moe.py, moe_gluon): row block i of the
activations (rows gathered into routed order) is multiplied by expert block_expert[i]'s weights,
scales and bias; blocks of expert -1 are skipped by the producer and the consumers alike.

Numerics are those of triton_gemm's kernel and of the reference, to the bit: every output element
is the same sequence of 128-wide fp32 products, each scaled once and added in K order, whatever
the tile config and M (tests/test_gluon_gemm.py), so switching kernels by M keeps
batch invariance.

TMA descriptors: outside CUDA graphs each program builds its three on the device (the launch
takes pointers; the host's encoding of them cost about 20-30 us a call on an H100 lease's host), and
a launch being captured into a graph takes host-encoded ones, encoded once for every replay
(launch_args).

Requirements (checked by `why_not`): an sm_90 GPU (wgmma is Hopper's), Gluon in the installed
Triton, K % 128 == 0, N % 8 == 0 and 16-byte aligned rows (TMA). The Gluon API moved between
Triton 3.6 (the GPU kit) and 3.9 (CI); both spellings are handled, and compile_sm90() builds the
kernel for sm_90a on any machine, so CI compiles it with ptxas (no spills, no serialized wgmma).

Shape letters: M tokens, N output features, K input features, G = K / 128.
"""

from __future__ import annotations

import functools

import torch
import triton

from ...numerics import BLOCK, ceil_div
from ..launch import Launcher, capability, ensure_scratch_allocator, num_sms

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError as e:  # a Triton without Gluon: the kernel is unavailable, why_not says so
    IMPORT_ERROR: str | None = f"this Triton ({triton.__version__}) has no Gluon for Hopper ({e})"
else:
    IMPORT_ERROR = None
    # Triton 3.9 renamed the TMA copies (async_load / async_store); 3.6 has only the old names.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

# H200, 9d201bf:scripts/gluon_probe.py (BENCHMARKS.md), DeepGEMM timed in the same runs, M = 2048, 4096:
# - CONFIG: 128 x 128 tiles, two consumers each taking one K group at a time, two K groups per
#   ring buffer (STAGE_GROUPS: one barrier wait and one release per pair), 2 buffers (the bytes of
#   the 4 one-group buffers before), grouped tile order GROUP_M = 16. In four runs 0.995-1.07x the
#   speed of the loop it replaced (one group per buffer, each consumer keeping a wgmma in flight
#   while it promotes the one before: OVERLAP), 0.79-0.94x DeepGEMM at M = 4096.
#   OVERLAP on paired buffers (3 of them) is no faster overall: 1.04-1.12x at M = 1024 on three
#   shapes (one run), 0.95-1.00x on 4096 x 14336; it stays a config.
# - TALL_CONFIG: 192 x 128 tiles, three consumers (three 64 x 128 fp32 tiles per thread do not
#   fit beside three warpgroups, so no OVERLAP): less shared-memory and L2 traffic per FLOP,
#   0.95-0.99x on 24576 x 1536, but 0.82-0.85x on N = 4096, K = 7168 at M = 4096, where 704
#   tiles make 5.3 waves on 132 SMs.
CONFIG = dict(BLOCK_M=128, BLOCK_N=128, STAGES=2, STAGE_GROUPS=2, GROUP_M=16, OVERLAP=False)
TALL_CONFIG = dict(BLOCK_M=192, BLOCK_N=128, STAGES=2, STAGE_GROUPS=2, GROUP_M=16, OVERLAP=False)
# - WIDE_CONFIG: 64 x 256 tiles, the two consumers splitting the columns (one shared activation
#   box, a weight box each). For the routed experts' grouped GEMM, whose 64-row blocks pad each
#   expert's rows half as much as 128-row ones. (BENCHMARKS.md, "2026-11-24 (c8e9c49)")
WIDE_CONFIG = dict(BLOCK_M=64, BLOCK_N=256, STAGES=2, STAGE_GROUPS=2, GROUP_M=16, OVERLAP=False)
# A 192-row tile takes this many times a 128-row tile's time (same probe, shapes whose waves are
# full either way: 1.41 and 1.42, and 1.43 with two groups per buffer); pick_config compares whole
# waves with it.
TALL_TILE_COST = 1.42
MAX_REGS = 240  # per thread for a consumer warpgroup after setmaxnreg (the hardware's cap is 256)
PRODUCER_REGS = 24  # the producer warp only computes addresses


def why_not(x_fp8: torch.Tensor, w_fp8: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> str | None:
    """None if gemm() can run on these operands, else why not."""
    why = why_not_shape(x_fp8.shape[1], w_fp8.shape[0], x_fp8.device, out_dtype)
    return why if why is not None else _why_not_rows(x_fp8, w_fp8)


def _why_not_rows(*operands: torch.Tensor) -> str | None:
    """What the TMA loads ask of each operand's rows: contiguous, 16-byte aligned starts."""
    for t in operands:
        if t.stride(-1) != 1 or t.stride(-2) % 16 or t.data_ptr() % 16:
            return "operands must be row-major with 16-byte aligned rows (TMA)"
    return None


def why_not_shape(
    k: int, n: int, device: torch.device, out_dtype: torch.dtype = torch.bfloat16
) -> str | None:
    """What why_not checks that holds for every call of these sizes on this device (no tensor
    needed: what a compile-time decision can ask). Answered once per (sizes, device, dtype): it
    runs on every call of a grouped GEMM, on the host's critical path outside CUDA graphs."""
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return _why_not_shape(k, n, device.type, index, out_dtype)


@functools.lru_cache(maxsize=1024)
def _why_not_shape(k: int, n: int, device_type: str, index: int | None, out_dtype: torch.dtype) -> str | None:
    if IMPORT_ERROR is not None:
        return IMPORT_ERROR
    if device_type != "cuda":
        return "needs a CUDA device"
    if capability(index)[0] != 9:
        return "needs sm_90 (Hopper wgmma)"
    if k == 0 or k % BLOCK:  # K = 0: the consumers would wait for a first group that never comes
        return f"K={k} is not a positive multiple of {BLOCK}"
    if n % 8 or out_dtype.itemsize * n % 16:
        return f"N={n}: output rows must be 16-byte aligned for the TMA store"
    return None


if IMPORT_ERROR is None:

    @gluon.jit
    def _tile_coords(tile, num_m, num_n, GROUP_M: gl.constexpr):
        """triton_gemm._tile_position's grouped tile order (GROUP_M row tiles share each weight
        column tile while it is in L2), again: under TRITON_INTERPRET=1 that one becomes an
        interpreter function, which a Gluon kernel cannot call."""
        in_group = GROUP_M * num_n
        first_m = (tile // in_group) * GROUP_M
        size_m = min(num_m - first_m, GROUP_M)
        return first_m + (tile % in_group) % size_m, (tile % in_group) // size_m

    @gluon.jit
    def _advance(s, phase, STAGES: gl.constexpr):
        """The ring buffer after s, and the phase its barriers are in: it flips each pass over the ring.
        Carried through the loops rather than derived from a step count, whose signed division and
        modulo cost a dozen instructions at every barrier wait."""
        wrap = (s == STAGES - 1).to(gl.int32)
        return (s + 1) * (1 - wrap), phase ^ wrap

    @gluon.jit
    def _produce(
        a_desc,
        b_desc,
        a_bufs,
        b_bufs,
        ready,
        empty,
        expert_ptr,
        M,
        N,
        K,
        GROUP_M: gl.constexpr,
        STAGE_GROUPS: gl.constexpr,
        GROUPED: gl.constexpr,
        A_BOXES: gl.constexpr,
        B_BOXES: gl.constexpr,
    ):
        """Producer warp: every K group of every tile of this program, into the buffer ring. A
        buffer holds STAGE_GROUPS K groups, each A_BOXES 64-row activation boxes and B_BOXES
        weight boxes (one of the two per consumer), behind one `ready` barrier. Grouped: the
        weight rows of the tile's expert."""
        ROWS: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BOX_N: gl.constexpr = b_desc.block_type.shape[0]
        STAGES: gl.constexpr = ready.shape[0]
        TILE_M: gl.constexpr = A_BOXES * ROWS
        TILE_N: gl.constexpr = B_BOXES * BOX_N
        BYTES: gl.constexpr = STAGE_GROUPS * (
            A_BOXES * a_desc.block_type.nbytes + B_BOXES * b_desc.block_type.nbytes
        )
        num_m = gl.cdiv(M, TILE_M)
        num_n = gl.cdiv(N, TILE_N)
        s = 0
        phase = 0
        for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
            pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
            e = _expert(expert_ptr, pid_m, GROUPED)
            if e >= 0:  # the consumers skip the same tiles
                for g in range(0, K // BLOCK_K, STAGE_GROUPS):
                    # A fresh mbarrier counts as having completed the phase before 0: the first
                    # pass over the ring does not wait.
                    mbarrier.wait(empty.index(s), phase ^ 1)
                    bar = ready.index(s)
                    mbarrier.expect(bar, BYTES)
                    # Rows past M or N arrive as zeros (and still count their bytes).
                    for j in gl.static_range(STAGE_GROUPS):
                        for part in gl.static_range(A_BOXES):
                            _tma_load(
                                a_desc,
                                [pid_m * TILE_M + part * ROWS, (g + j) * BLOCK_K],
                                bar,
                                a_bufs.index((s * STAGE_GROUPS + j) * A_BOXES + part),
                            )
                        for part in gl.static_range(B_BOXES):
                            _tma_load(
                                b_desc,
                                [e * N + pid_n * TILE_N + part * BOX_N, (g + j) * BLOCK_K],
                                bar,
                                b_bufs.index((s * STAGE_GROUPS + j) * B_BOXES + part),
                            )
                    s, phase = _advance(s, phase, STAGES)

    @gluon.jit
    def _expert(expert_ptr, pid_m, GROUPED: gl.constexpr):
        """The expert whose weights row block pid_m multiplies (-1: no rows, the tile is skipped);
        0 for a plain GEMM."""
        e = 0
        if GROUPED:
            e = gl.load(expert_ptr + pid_m)
        return e

    @gluon.jit
    def _scales(a_s_rows, b_s, g, stride_asg, stride_bsg):
        """Group g's activation scales (one per row) and weight scale (one per 128 columns)."""
        return gl.load(a_s_rows + g * stride_asg), gl.load(b_s + g * stride_bsg)

    @gluon.jit
    def _mma(a_bufs, b_bufs, buf, PART: gl.constexpr, into, A_BOXES: gl.constexpr, B_BOXES: gl.constexpr):
        """Start consumer PART's wgmma on K-group buffer `buf`: its 64-row activation box (its own
        or the shared one) by its weight box (the shared one or its own), into into's registers
        (overwritten)."""
        return warpgroup_mma(
            a_bufs.index(buf * A_BOXES + PART % A_BOXES),
            b_bufs.index(buf * B_BOXES + PART % B_BOXES).permute((1, 0)),
            into,
            use_acc=False,
            is_async=True,
        )

    @gluon.jit
    def _finish(pending, empty, s):
        """Wait for `pending`, the last wgmma on buffer s (none left in flight), and release the buffer."""
        done = warpgroup_mma_wait(num_outstanding=0, deps=(pending,))
        mbarrier.arrive(empty.index(s), count=1)
        return done

    @gluon.jit
    def _consume(
        shared,
        PART: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        GROUP_M: gl.constexpr,
        OVERLAP: gl.constexpr,
        STAGE_GROUPS: gl.constexpr,
        GROUPED: gl.constexpr,
        A_BOXES: gl.constexpr,
        B_BOXES: gl.constexpr,
    ):
        """One consumer warpgroup: its 64 x BLOCK_N part of every tile of this program, rows
        [PART * 64, PART * 64 + 64) where the consumers split a tile's rows (A_BOXES of them),
        columns [PART * BLOCK_N, ...) where they split its columns (B_BOXES). Grouped: the tile's
        expert's weight scales and bias. `shared`: what every consumer takes (_gemm_kernel)."""
        (
            a_bufs,
            b_bufs,
            ready,
            empty,
            c_desc,
            a_s_ptr,
            b_s_ptr,
            bias_ptr,
            expert_ptr,
            M,
            N,
            K,
            stride_asm,
            stride_asg,
            stride_bse,
            stride_bsn,
            stride_bsg,
            stride_be,
        ) = shared
        STAGES: gl.constexpr = ready.shape[0]
        ROWS: gl.constexpr = a_bufs.type.shape[1]
        BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
        BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
        TILE_M: gl.constexpr = A_BOXES * ROWS
        TILE_N: gl.constexpr = B_BOXES * BLOCK_N
        # wgmma: 16-row instructions, one warpgroup of 4 warps stacked along M; k = 32 for FP8.
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32]
        )
        c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
        num_m = gl.cdiv(M, TILE_M)
        num_n = gl.cdiv(N, TILE_N)
        groups = K // BLOCK_K
        x_free = gl.zeros([ROWS, BLOCK_N], gl.float32, layout)  # the wgmmas' register tiles
        y_free = gl.zeros([ROWS, BLOCK_N], gl.float32, layout)
        s = 0
        phase = 0
        for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
            pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
            e = _expert(expert_ptr, pid_m, GROUPED)
            if e >= 0:
                off_m = pid_m * TILE_M + PART % A_BOXES * ROWS
                off_n = pid_n * TILE_N + PART % B_BOXES * BLOCK_N
                rows = off_m + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
                # Rows past M read the last row's scales; their outputs are never stored.
                a_s_rows = a_s_ptr + gl.minimum(rows, M - 1) * stride_asm
                # BLOCK_N divides the 128-row weight block: one weight scale per (tile, group).
                b_s = b_s_ptr + e * stride_bse + (off_n // BLOCK_K) * stride_bsn
                acc = gl.zeros([ROWS, BLOCK_N], gl.float32, layout)
                if OVERLAP:
                    # Two register tiles, x and y, take the two groups of each buffer (STAGE_GROUPS is
                    # 2), and each is promoted while the other's wgmma runs: y's of the previous buffer
                    # while x's runs. No wgmma is in flight across the loop's back edge: LLVM's copies
                    # there would touch its registers, and ptxas then serializes every wgmma. Scales
                    # load at the top of an iteration.
                    gl.static_assert(
                        STAGE_GROUPS == 2, "the overlapped loop takes a buffer's two groups in turn"
                    )
                    x_a, x_b = _scales(a_s_rows, b_s, 0, stride_asg, stride_bsg)
                    y_a, y_b = _scales(a_s_rows, b_s, 1, stride_asg, stride_bsg)
                    mbarrier.wait(ready.index(s), phase)
                    x = _mma(a_bufs, b_bufs, 2 * s, PART, x_free, A_BOXES, B_BOXES)
                    y = _mma(a_bufs, b_bufs, 2 * s + 1, PART, y_free, A_BOXES, B_BOXES)
                    x_free = warpgroup_mma_wait(num_outstanding=1, deps=(x,))
                    acc += x_free * (x_a * x_b)[:, None]
                    y_free = _finish(y, empty, s)
                    s, phase = _advance(s, phase, STAGES)
                    for g in range(
                        2, groups, 2
                    ):  # issue g (x), promote g - 1 (y), issue g + 1 (y), promote g
                        x_a, x_b = _scales(a_s_rows, b_s, g, stride_asg, stride_bsg)
                        next_a, next_b = _scales(a_s_rows, b_s, g + 1, stride_asg, stride_bsg)
                        mbarrier.wait(ready.index(s), phase)
                        x = _mma(a_bufs, b_bufs, 2 * s, PART, x_free, A_BOXES, B_BOXES)
                        acc += y_free * (y_a * y_b)[:, None]
                        y = _mma(a_bufs, b_bufs, 2 * s + 1, PART, y_free, A_BOXES, B_BOXES)
                        x_free = warpgroup_mma_wait(num_outstanding=1, deps=(x,))
                        acc += x_free * (x_a * x_b)[:, None]
                        y_free = _finish(y, empty, s)
                        s, phase = _advance(s, phase, STAGES)
                        y_a, y_b = next_a, next_b
                    acc += y_free * (y_a * y_b)[:, None]
                else:
                    # One group at a time: wait for its wgmma, promote it, then the buffer's next group;
                    # the other consumers' wgmmas fill the tensor cores meanwhile. One barrier wait and
                    # one release per buffer: after the wgmma of its last group, before that promotion.
                    for g in range(0, groups, STAGE_GROUPS):
                        mbarrier.wait(ready.index(s), phase)
                        for j in gl.static_range(STAGE_GROUPS):
                            a_scale, b_scale = _scales(a_s_rows, b_s, g + j, stride_asg, stride_bsg)
                            x = _mma(a_bufs, b_bufs, s * STAGE_GROUPS + j, PART, x_free, A_BOXES, B_BOXES)
                            if j == STAGE_GROUPS - 1:
                                x_free = _finish(x, empty, s)
                            else:
                                x_free = warpgroup_mma_wait(num_outstanding=0, deps=(x,))
                            acc += x_free * (a_scale * b_scale)[:, None]
                        s, phase = _advance(s, phase, STAGES)
                if HAS_BIAS:
                    cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
                    acc += gl.load(bias_ptr + e * stride_be + cols, mask=cols < N, other=0.0).to(gl.float32)[
                        None, :
                    ]
                tma.store_wait(0)  # the previous tile's store has read c_smem
                c_smem.store(acc.to(c_desc.dtype))
                fence_async_shared()
                _tma_store(c_desc, [off_m, off_n], c_smem)  # rows past M and columns past N are clipped
        tma.store_wait(0)

    @gluon.jit
    def _gemm_kernel(
        a,
        b,
        c,
        a_s_ptr,
        b_s_ptr,
        bias_ptr,
        expert_ptr,
        M,
        N,
        K,
        W_ROWS,
        stride_am,
        stride_wn,
        stride_cm,
        stride_asm,
        stride_asg,
        stride_bse,
        stride_bsn,
        stride_bsg,
        stride_be,
        HAS_BIAS: gl.constexpr,
        GROUP_M: gl.constexpr,
        STAGES: gl.constexpr,
        OVERLAP: gl.constexpr,
        STAGE_GROUPS: gl.constexpr,
        CONSUMERS: gl.constexpr,
        GROUPED: gl.constexpr,
        SPLIT_N: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
        PRODUCER_REGS: gl.constexpr,
        BOX_N: gl.constexpr,
        A_LAYOUT: gl.constexpr,
        B_LAYOUT: gl.constexpr,
        C_LAYOUT: gl.constexpr,
        DEVICE_DESCRIPTORS: gl.constexpr,
    ):
        # a, b, c: the activation (64-row boxes, one consumer's rows), the weights (E * N rows
        # when grouped; BOX_N-row boxes) and the output (64 x BOX_N boxes), as TMA descriptors
        # the host encoded, or, DEVICE_DESCRIPTORS, as pointers that each program turns into
        # descriptors in its global scratch (which the launch allocates through Triton's
        # allocator): no encoding on the host, where it costs about 20-30 us a call, for about 2 us
        # of GPU time (launch_args says when each is taken).
        if DEVICE_DESCRIPTORS:
            a_desc = tma.make_tensor_descriptor(a, [M, K], [stride_am, 1], [64, 128], A_LAYOUT)
            b_desc = tma.make_tensor_descriptor(b, [W_ROWS, K], [stride_wn, 1], [BOX_N, 128], B_LAYOUT)
            c_desc = tma.make_tensor_descriptor(c, [M, N], [stride_cm, 1], [64, BOX_N], C_LAYOUT)
        else:
            a_desc = a
            b_desc = b
            c_desc = c
        # The consumers split a tile's rows (one 64-row activation box each, one shared weight
        # box) or, SPLIT_N, its columns (one shared activation box, a weight box each).
        A_BOXES: gl.constexpr = 1 if SPLIT_N else CONSUMERS
        B_BOXES: gl.constexpr = CONSUMERS if SPLIT_N else 1
        # STAGES ring buffers of STAGE_GROUPS K groups; the boxes of K group j of buffer s sit at
        # index s * STAGE_GROUPS + j (times the boxes per group, plus the box).
        a_bufs = gl.allocate_shared_memory(
            a_desc.dtype, [STAGES * STAGE_GROUPS * A_BOXES] + a_desc.block_type.shape, a_desc.layout
        )
        b_bufs = gl.allocate_shared_memory(
            b_desc.dtype, [STAGES * STAGE_GROUPS * B_BOXES] + b_desc.block_type.shape, b_desc.layout
        )
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)  # the producer's expect; TMA completes the bytes
            mbarrier.init(empty.index(i), count=CONSUMERS)  # one arrival per consumer warpgroup
        # What every consumer takes, as one tuple (constexprs stay apart: a tuple variable would
        # carry them as plain values).
        shared = (
            a_bufs,
            b_bufs,
            ready,
            empty,
            c_desc,
            a_s_ptr,
            b_s_ptr,
            bias_ptr,
            expert_ptr,
            M,
            N,
            K,
            stride_asm,
            stride_asg,
            stride_bse,
            stride_bsn,
            stride_bsg,
            stride_be,
        )
        # The default partition (the kernel's own 4 warps) is the first consumer.
        if CONSUMERS == 2:
            gl.warp_specialize(
                [
                    (
                        _consume,
                        (shared, 0, HAS_BIAS, GROUP_M, OVERLAP, STAGE_GROUPS, GROUPED, A_BOXES, B_BOXES),
                    ),
                    (
                        _consume,
                        (shared, 1, HAS_BIAS, GROUP_M, OVERLAP, STAGE_GROUPS, GROUPED, A_BOXES, B_BOXES),
                    ),
                    (
                        _produce,
                        (
                            a_desc,
                            b_desc,
                            a_bufs,
                            b_bufs,
                            ready,
                            empty,
                            expert_ptr,
                            M,
                            N,
                            K,
                            GROUP_M,
                            STAGE_GROUPS,
                            GROUPED,
                            A_BOXES,
                            B_BOXES,
                        ),
                    ),
                ],
                [4, 1],
                [CONSUMER_REGS, PRODUCER_REGS],
            )
        else:
            gl.static_assert(CONSUMERS == 3, "two or three consumer warpgroups")
            gl.warp_specialize(
                [
                    (
                        _consume,
                        (shared, 0, HAS_BIAS, GROUP_M, OVERLAP, STAGE_GROUPS, GROUPED, A_BOXES, B_BOXES),
                    ),
                    (
                        _consume,
                        (shared, 1, HAS_BIAS, GROUP_M, OVERLAP, STAGE_GROUPS, GROUPED, A_BOXES, B_BOXES),
                    ),
                    (
                        _consume,
                        (shared, 2, HAS_BIAS, GROUP_M, OVERLAP, STAGE_GROUPS, GROUPED, A_BOXES, B_BOXES),
                    ),
                    (
                        _produce,
                        (
                            a_desc,
                            b_desc,
                            a_bufs,
                            b_bufs,
                            ready,
                            empty,
                            expert_ptr,
                            M,
                            N,
                            K,
                            GROUP_M,
                            STAGE_GROUPS,
                            GROUPED,
                            A_BOXES,
                            B_BOXES,
                        ),
                    ),
                ],
                [4, 4, 1],
                [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS],
            )

    _gemm_launch = Launcher(_gemm_kernel)


@functools.lru_cache(maxsize=None)
def _shared_layout(block_shape: tuple[int, ...], dtype: torch.dtype):
    """The TMA boxes' shared-memory layout (a constexpr of the kernel), built once per (box, dtype):
    three per launch otherwise, on the host's critical path outside CUDA graphs."""
    gl_dtype = {
        torch.float8_e4m3fn: gl.float8e4nv,
        torch.bfloat16: gl.bfloat16,
        torch.float16: gl.float16,
        torch.float32: gl.float32,
    }[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), gl_dtype)


class _Static:
    """What one launch's sizes and config decide (launch_args), made once per distinct
    (config, N, K, bias, grouped, descriptor mode, dtypes) and kept: checking the config and
    building the constexprs cost about 8 us a call on a CPU machine, and the Launcher's key over
    them (three Gluon layouts hashed in Python) about 20 more. Compared by identity, it is the
    Launcher's key for them (Launcher.launch's static_key)."""

    def __init__(self, cfg: tuple, n: int, k: int, has_bias: bool, grouped: bool, descriptors: bool, dtypes):
        cfg = dict(cfg)
        bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
        split_n = bm == 64
        consumers = bn // 128 if split_n else bm // 64
        box_n = 128 if split_n else bn
        if not ((bm in (128, 192) and bn in (64, 128)) or (bm, bn) == (64, 256)):
            raise ValueError(
                "tiles are 128 or 192 rows (64 per consumer warpgroup) by 64 or 128 columns, or 64 rows "
                f"by 256 columns (128 per consumer); got {bm}x{bn}"
            )
        if grouped and n % bn:
            raise ValueError(f"a grouped launch takes N={n} in whole {bn}-column tiles")
        if cfg["OVERLAP"] and consumers != 2:
            raise ValueError(
                "the overlapped loop keeps three 64 x BLOCK_N fp32 tiles per thread: two consumers only"
            )
        stages, stage_groups, overlap = cfg["STAGES"], cfg["STAGE_GROUPS"], cfg["OVERLAP"]
        if stage_groups not in (1, 2):
            raise ValueError(f"a ring buffer holds one or two K groups; got STAGE_GROUPS={stage_groups}")
        if overlap and stage_groups != 2:
            raise ValueError(
                "the overlapped loop takes the two K groups of a buffer in turn: STAGE_GROUPS=2 only"
            )
        if (
            k // BLOCK % stage_groups
        ):  # an odd number of K groups: one per buffer (as many), one at a time (same bits)
            stages, stage_groups, overlap = stages * stage_groups, 1, False
        x_dtype, w_dtype, out_dtype = dtypes
        self.block_m, self.block_n, self.descriptors = bm, bn, descriptors
        self.boxes = ((64, BLOCK), (box_n, BLOCK), (64, box_n))
        self.layouts = (
            _shared_layout(self.boxes[0], x_dtype),
            _shared_layout(self.boxes[1], w_dtype),
            _shared_layout(self.boxes[2], out_dtype),
        )
        # Registers: at launch every warpgroup (the producer's warp counts as one) gets an equal
        # share of the SM's 64K; setmaxnreg then gives the producer PRODUCER_REGS and the
        # consumers the rest.
        launch = 65536 // ((consumers + 1) * 128) // 8 * 8
        consumer_regs = min(MAX_REGS, (launch * (consumers + 1) - PRODUCER_REGS) // consumers // 8 * 8)
        self.constexprs = dict(
            HAS_BIAS=has_bias,
            GROUP_M=cfg["GROUP_M"],
            STAGES=stages,
            STAGE_GROUPS=stage_groups,
            OVERLAP=overlap,
            CONSUMERS=consumers,
            GROUPED=grouped,
            SPLIT_N=split_n,
            CONSUMER_REGS=consumer_regs,
            PRODUCER_REGS=PRODUCER_REGS,
            BOX_N=box_n,
            A_LAYOUT=self.layouts[0],
            B_LAYOUT=self.layouts[1],
            C_LAYOUT=self.layouts[2],
            DEVICE_DESCRIPTORS=descriptors,
        )
        self.options = dict(num_warps=4, maxnreg=launch)


@functools.lru_cache(maxsize=256)
def _static(cfg: tuple, n: int, k: int, has_bias: bool, grouped: bool, descriptors: bool, dtypes) -> _Static:
    return _Static(cfg, n, k, has_bias, grouped, descriptors, dtypes)


def _prepare(
    x_fp8, x_scale, w_fp8, w_scale, bias, out, config=None, block_expert=None, device_descriptors=None
) -> tuple[tuple, tuple, _Static]:
    """(grid, args, static) of one launch: launch_args with the constexprs and options kept in
    the cached _Static, what gemm() and grouped_gemm() launch from."""
    m, k = x_fp8.shape
    grouped = block_expert is not None
    n = w_fp8.shape[-2]
    sms = num_sms(out.device.index or 0) if out.device.type == "cuda" else 132
    cfg = grouped_config(n) if grouped else pick_config(m, n, sms)
    if config:
        cfg = {**cfg, **config}
    if device_descriptors is None:
        device_descriptors = not (out.is_cuda and torch.cuda.is_current_stream_capturing())
    static = _static(
        tuple(cfg.items()),
        n,
        k,
        bias is not None,
        grouped,
        device_descriptors,
        (x_fp8.dtype, w_fp8.dtype, out.dtype),
    )
    bm = static.block_m
    if grouped and block_expert.numel() != ceil_div(m, bm):
        raise ValueError(
            f"a grouped launch takes one expert per {bm}-row block ({ceil_div(m, bm)} of them, got "
            f"{block_expert.numel()})"
        )
    # Grouped: the experts' weights one after another, expert e at rows e * N (why_not_grouped
    # asks for that layout), so the kernel reads them as one (E * N, K) matrix. The kernel that
    # builds its descriptors takes only the pointer and these sizes: no view made per call.
    w_rows, w_row_stride = w_fp8.numel() // k, w_fp8.stride(-2)
    if device_descriptors:
        operands = (x_fp8, w_fp8, out)
    else:
        operands = tuple(
            TensorDescriptor.from_tensor(t, list(box), layout)
            for t, box, layout in zip((x_fp8, w_fp8.reshape(-1, k), out), static.boxes, static.layouts)
        )
    tiles = ceil_div(m, bm) * ceil_div(n, static.block_n)
    stride_bse, stride_be = (w_scale.stride(0), 0 if bias is None else bias.stride(0)) if grouped else (0, 0)
    args = (
        *operands,
        x_scale,
        w_scale,
        bias if bias is not None else w_scale,
        block_expert if grouped else w_scale,
        m,
        n,
        k,
        w_rows,
        x_fp8.stride(0),
        w_row_stride,
        out.stride(0),
        x_scale.stride(0),
        x_scale.stride(1),
        stride_bse,
        w_scale.stride(-2),
        w_scale.stride(-1),
        stride_be,
    )
    return (min(tiles, sms),), args, static


def launch_args(
    x_fp8, x_scale, w_fp8, w_scale, bias, out, config=None, block_expert=None, device_descriptors=None
):
    """(grid, args, constexprs and launch options as keywords) of one launch; scripts compile
    the kernel on a CPU from them too. config: keys of CONFIG to override; default pick_config's
    (grouped: grouped_config's).

    device_descriptors: the kernel builds its TMA descriptors (True) or the host encodes them
    (False). Default: on the device except while a CUDA graph is captured, where the host
    encodes them once for every replay and the kernel does not pay the ~2 us of building them
    (H100: 0.5-3% of the GPU time at a 2048-token prefill's shapes, for about 20-30 us less host time
    a call outside graphs; BENCHMARKS.md, "2026-11-24 (be32267)").

    Grouped (block_expert given): w_fp8 (E, N, K), w_scale (E, N/128, G), bias (E, N); row block
    i of x_fp8 (BLOCK_M rows) is multiplied by expert block_expert[i]'s weights, or skipped where
    it is -1 (its output rows are left unwritten)."""
    grid, args, static = _prepare(
        x_fp8, x_scale, w_fp8, w_scale, bias, out, config, block_expert, device_descriptors
    )
    return grid, args, {**static.constexprs, **static.options}


def _launch(grid: tuple, args: tuple, static: _Static) -> None:
    """_gemm_kernel[grid](*args, **constexprs, **options) through our Launcher (launch.py):
    outside CUDA graphs a launch through Triton's own path cost 135 us of host time on an H100
    lease's host."""
    if static.descriptors:
        ensure_scratch_allocator()  # where the kernel builds its TMA descriptors
    _gemm_launch.launch(grid, args, static.constexprs, static.options, static)


def pick_config(m: int, n: int, sms: int) -> dict:
    """CONFIG or TALL_CONFIG, whichever needs less time in whole waves of persistent programs
    (a wave is one tile per SM; the last one is paid in full however few tiles it has)."""

    def waves(block_m: int) -> int:
        return ceil_div(ceil_div(m, block_m) * ceil_div(n, CONFIG["BLOCK_N"]), sms)

    return (
        TALL_CONFIG if waves(TALL_CONFIG["BLOCK_M"]) * TALL_TILE_COST < waves(CONFIG["BLOCK_M"]) else CONFIG
    )


def gemm(x_fp8, x_scale, w_fp8, w_scale, bias=None, out_dtype=torch.bfloat16, config=None):
    """Block-scaled x_fp8 (M, K) @ w_fp8 (N, K).T (+ bias) -> (M, N) out_dtype, like
    triton_gemm.gemm_large_m. x_scale (M, G) and w_scale (ceil(N/128), G) fp32, any strides."""
    why = why_not(x_fp8, w_fp8, out_dtype)
    if why is not None:
        raise RuntimeError(f"the Gluon GEMM cannot run here: {why}")
    m = x_fp8.shape[0]
    out = torch.empty(m, w_fp8.shape[0], dtype=out_dtype, device=x_fp8.device)
    if m == 0:
        return out
    _launch(*_prepare(x_fp8, x_scale, w_fp8, w_scale, bias, out, config))
    return out


def grouped_config(*ns: int) -> dict:
    """The grouped GEMM's tiles for experts of N output features (each of ns, for GEMMs that
    share one routing): WIDE_CONFIG's 64 rows where its 256-column tiles divide every N (a tile
    must not straddle two experts' weights), else CONFIG's 128."""
    return WIDE_CONFIG if all(n % WIDE_CONFIG["BLOCK_N"] == 0 for n in ns) else CONFIG


@functools.cache
def config_of_rows(block_m: int) -> dict:
    """The grouped config whose row blocks are block_m rows (what grouped_config picked for a routing)."""
    config = next((c for c in (WIDE_CONFIG, CONFIG) if c["BLOCK_M"] == block_m), None)
    if config is None:
        raise ValueError(
            f"grouped row blocks are {WIDE_CONFIG['BLOCK_M']} or {CONFIG['BLOCK_M']} rows, got {block_m}"
        )
    return config


def why_not_grouped_shape(k: int, n: int, device: torch.device) -> str | None:
    """why_not_grouped for experts of n outputs over k inputs on this device, from sizes alone."""
    why = why_not_shape(k, n, device)
    if why is None and n % CONFIG["BLOCK_N"]:
        why = f"N={n}: a tile must not straddle two experts ({CONFIG['BLOCK_N']}-column tiles)"
    return why


def why_not_grouped(x_fp8: torch.Tensor, w_fp8: torch.Tensor) -> str | None:
    """None if grouped_gemm() can run on these operands (x_fp8 (M, K), w_fp8 (E, N, K)), else why not."""
    if w_fp8.dim() != 3 or x_fp8.dim() != 2 or x_fp8.shape[1] != w_fp8.shape[2]:
        shapes = f"{tuple(x_fp8.shape)} and {tuple(w_fp8.shape)}"
        return f"takes x (M, K) and the experts' weights (E, N, K) of the same K; got {shapes}"
    if w_fp8.stride(0) != w_fp8.shape[1] * w_fp8.stride(1):
        return "the experts' weights must lie one after another (expert e's rows at e * N)"
    why = why_not_grouped_shape(x_fp8.shape[1], w_fp8.shape[1], x_fp8.device)
    return why if why is not None else _why_not_rows(x_fp8, w_fp8)


def grouped_gemm(
    x_fp8, x_scale, w_fp8, w_scale, block_expert, bias=None, out_dtype=torch.bfloat16, config=None
):
    """Row block i of x_fp8 (M, K) @ w_fp8[block_expert[i]].T (+ bias[e]) -> (M, N) out_dtype;
    blocks of expert -1 are skipped and their rows left unwritten. A block is the tile's rows:
    grouped_config(N)'s BLOCK_M unless config says. w_fp8 (E, N, K), w_scale (E, N/128, G),
    bias (E, N); x_scale (M, G), any strides. The numbers of each row are those of gemm() on
    that row and its expert's weights."""
    why = why_not_grouped(x_fp8, w_fp8)
    if why is not None:
        raise RuntimeError(f"the Gluon grouped GEMM cannot run here: {why}")
    out = torch.empty(x_fp8.shape[0], w_fp8.shape[1], dtype=out_dtype, device=x_fp8.device)
    if x_fp8.shape[0] == 0:
        return out
    _launch(*_prepare(x_fp8, x_scale, w_fp8, w_scale, bias, out, config, block_expert))
    return out


def compile_sm90(m=4096, n=4096, k=7168, bias=False, config=None, experts=0, device_descriptors=True):
    """Compile the kernel for sm_90a as gemm() (or, with experts > 0, grouped_gemm()) would launch
    it, without a GPU (a CPU is enough), its TMA descriptors built on the device or encoded by
    the host: returns Triton's compiled kernel (PTX and cubin in .asm).
    Catches Gluon API drift between Triton versions; ptxas_report() says what ptxas made of it."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    lead = (experts,) if experts else ()
    x = torch.empty(m, k, dtype=torch.float8_e4m3fn)
    w = torch.empty(*lead, n, k, dtype=torch.float8_e4m3fn)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    scales = torch.empty(m, k // BLOCK), torch.empty(*lead, ceil_div(n, BLOCK), k // BLOCK)
    b = torch.empty(*lead, n, dtype=torch.bfloat16) if bias else None
    block_m = {**(grouped_config(n) if experts else CONFIG), **(config or {})}["BLOCK_M"]
    block_expert = torch.empty(ceil_div(m, block_m), dtype=torch.int32) if experts else None
    _, args, meta = launch_args(x, scales[0], w, scales[1], b, out, config, block_expert, device_descriptors)
    options = {key: meta.pop(key) for key in ("num_warps", "maxnreg")}
    names = _gemm_kernel.arg_names
    signature = {name: mangle_type(a) for name, a in zip(names, args)}
    signature.update({name: "constexpr" for name in meta})
    constexprs = {(names.index(name),): value for name, value in meta.items()}
    return triton.compile(
        GluonASTSource(_gemm_kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32), options=options
    )


def ptxas_report(ptx: str) -> str:
    """What `ptxas -v` (Triton's bundled one) says of the PTX for sm_90a: registers, spills, and
    any warning, such as wgmma instructions it had to serialize."""
    import os
    import subprocess
    import tempfile

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    # Triton 3.9 bundles the ptxas that reads its PTX version under the first name
    ptxas = next(
        os.path.join(bin_dir, name)
        for name in ("ptxas-blackwell", "ptxas")
        if os.path.exists(os.path.join(bin_dir, name))
    )
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "k.ptx"), "w") as f:
            f.write(ptx)
        r = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", os.path.join(d, "k.ptx"), "-o", os.path.join(d, "k.cubin")],
            capture_output=True,
            text=True,
        )
    return (r.stdout + r.stderr).strip()


def main_loop_report(cubin: bytes) -> str:
    """The consumers' main loop in the SASS (cuobjdump, bundled with Triton): its length and what
    it is made of. It is the shortest loop holding a wgmma: a backward branch before the kernel's
    last EXIT (the mbarrier-wait retry stubs sit after it)."""
    import collections
    import os
    import re
    import subprocess
    import tempfile

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run(
            [os.path.join(bin_dir, "cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True
        ).stdout
    code = [
        (int(m.group(1), 16), m.group(2).strip())
        for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)
    ]
    index = {addr: i for i, (addr, _) in enumerate(code)}
    last_exit = max(addr for addr, text in code if text.endswith("EXIT"))
    opcodes = [text.split()[1 if text.startswith("@") else 0] for _, text in code]  # past a predicate
    loops = []
    for i, (addr, text) in enumerate(code):
        target = re.search(r"BRA (0x[0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr < last_exit:
            body = opcodes[index[int(target.group(1), 16)] : i + 1]
            if any("GMMA" in op for op in body):
                loops.append(body)
    if not loops:
        return "no loop with a wgmma found"
    ops = collections.Counter(min(loops, key=len))
    return (
        f"main loop: {sum(ops.values())} instructions, "
        f"{sum(n for op, n in ops.items() if 'GMMA' in op)} wgmma, "
        f"{ops['FFMA']} FFMA, {ops['MOV']} MOV, {ops['BAR.SYNC.DEFER_BLOCKING']} bar.sync, "
        f"{ops['LDG.E']} LDG, "
        f"{ops['SYNCS.PHASECHK.TRANS64.TRYWAIT']} mbarrier waits"
    )
