"""The routed-experts kernels' tile and routing choices, as arithmetic on sizes.

triton_moe.py, moe/decode_op.py and moe/gluon_op.py run by these numbers; the passes decide
with them where a call site's M dispatch is cut and which traced launch serves each side. This
module imports no Triton, so those decisions are made where Triton is absent too (a CPU-only
torch), on the reference kernels.
"""

from __future__ import annotations

import torch

from ...numerics import ceil_div

# Routing in one Triton program up to this many slots (T * k), chunked kernels above. One
# program sorts all slots itself: on an H200 (9d201bf:scripts/decode_probe.py) it took 3.0 us for 8 slots
# and 6.8 us for 128, but 15.1 us for 1024 and 73.9 us for 4096, where the torch ops took 57-99 us.
ROUTE_ONE_PROGRAM_MAX_SLOTS = 512
ROUTE_KERNEL_MAX_SLOTS = 4096  # what one program can sort (its BLOCK_S keys sit in registers)
ROUTE_CHUNK = 64  # slots per program of the chunked routing


def route_capacity(num_slots: int, num_experts: int, block_m: int) -> int:
    """Rows any routing of num_slots slots over num_experts experts can need (each expert's run
    padded to a multiple of block_m). num_slots may be symbolic (moe_decode_op traces this)."""
    return ceil_div(num_slots + torch.sym_min(num_experts, num_slots) * (block_m - 1), block_m) * block_m


# Rows per block by average slots per expert: decode fills few rows of each expert's block.
BLOCK_M_CHOICES = (16, 32, 64)
BATCH_INVARIANT_BLOCK_M = 64


def block_m_for(num_slots: int, num_experts: int, batch_invariant: bool = False) -> int:
    if batch_invariant:
        return BATCH_INVARIANT_BLOCK_M
    per_expert = num_slots / num_experts
    return next((b for b in BLOCK_M_CHOICES if per_expert <= b), BLOCK_M_CHOICES[-1])


# From this many slots per expert on average (and not batch-invariant), the GEMMs are the
# warp-specialized Gluon kernel's on activations gathered into routed order (gluon_gemm.grouped_gemm).
# Its blocks are 64 rows (128 where 256-column tiles do not divide N) and the gather costs a
# pass: the op on an H100, uniform routing, Qwen3-30B-A3B widths: 299 against the Triton
# kernel's 263 us at 16 slots per expert, 310 / 304 at 32, 349 / 413 at 64, 431 / 599 at 128;
# DeepSeek-V3: 4626 / 4991 at 32 (BENCHMARKS.md, "MoE layers").
GLUON_MIN_SLOTS_PER_EXPERT = 32


def decode_fits(num_experts: int, top_k: int, max_tokens: int) -> bool:
    """Whether moe_decode serves 1..max_tokens tokens of top_k of num_experts experts with
    moe_triton's own choices: routing in one program and its smallest row blocks throughout."""
    slots = max_tokens * top_k
    return slots <= ROUTE_ONE_PROGRAM_MAX_SLOTS and block_m_for(slots, num_experts) == BLOCK_M_CHOICES[0]


def gluon_min_tokens(num_experts: int, top_k: int) -> int:
    """The fewest tokens moe_triton runs on the Gluon GEMMs (GLUON_MIN_SLOTS_PER_EXPERT slots per expert)."""
    return ceil_div(GLUON_MIN_SLOTS_PER_EXPERT * num_experts, top_k)
