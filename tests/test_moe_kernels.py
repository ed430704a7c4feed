"""The Triton routed-experts kernels (fp8compile/ops/triton_moe.py) against their definitions:
on the GPU at real sizes, on the CPU in Triton's interpreter at small sizes."""

import weakref

import pytest
import torch

pytest.importorskip("triton")

from fp8compile import calc_diff  # noqa: E402
from fp8compile.ops import activations  # noqa: E402
from fp8compile.ops.linear import reference as linear_reference  # noqa: E402
from fp8compile.ops.moe import reference as moe_reference  # noqa: E402
from fp8compile.ops.quant import reference as quant_reference  # noqa: E402
from fp8compile.ops.moe import triton_moe  # noqa: E402
from fp8compile.ops.quant import triton_quant  # noqa: E402
from tests.conftest import DEVICE, fp8_exact_activation, randn  # noqa: E402
from tests.test_triton_kernels import ON_GPU, assert_bf16_close, to_bf16_as_the_device_does  # noqa: E402

ROUTINGS = {
    "random": lambda t, e, k: torch.randint(0, e, (t, k)),
    "one expert": lambda t, e, k: torch.full((t, k), e - 1),
    "sentinels": lambda t, e, k: torch.where(torch.rand(t, k) < 0.3, e, torch.randint(0, e, (t, k))),
}


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens, block_m", [(1, 16), (5, 16), (37, 32), (300, 64)])
def test_route_puts_each_slot_once_in_a_block_of_its_expert(routing, tokens, block_m):
    num_experts, top_k = 8, 4
    ids = ROUTINGS[routing](tokens, num_experts, top_k)
    slots, block_expert = triton_moe.route_torch(ids, num_experts, block_m)
    s = ids.numel()
    assert slots.numel() == block_expert.numel() * block_m
    flat = ids.reshape(-1)
    routed = ((flat >= 0) & (flat < num_experts)).nonzero().squeeze(1)
    real = slots[slots < s].long()
    assert sorted(real.tolist()) == routed.tolist()  # every routed slot once, sentinels nowhere
    row_expert = block_expert.repeat_interleave(block_m).long()
    assert torch.equal(row_expert[slots < s], flat[real])  # each in a block of its own expert
    assert bool((row_expert[slots == s] >= -1).all())
    # Each expert's rows are one run padded to whole blocks: blocks of an expert are contiguous.
    used = block_expert[block_expert >= 0].tolist()
    assert used == sorted(used) and len(used) == sum(-(-int((flat == e).sum()) // block_m) for e in set(used))


@pytest.mark.parametrize("kernel", ["route_kernel", "route_chunked"])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize(
    "tokens, num_experts, top_k, block_m",
    [(1, 8, 4, 16), (5, 8, 4, 16), (37, 8, 4, 32), (3, 128, 8, 16), (40, 256, 8, 16), (130, 8, 4, 64)],
)
def test_route_kernels_give_the_same_rows_as_the_torch_routing(
    kernel, routing, tokens, num_experts, top_k, block_m
):
    """The routing kernels (one program for decode; count, scan and place over chunks of slots
    for more) and the torch-op routing are interchangeable: the same slot on every row and the
    same expert on every block, padding and sentinels included. 130 x 4 slots span 9 chunks."""
    ids = ROUTINGS[routing](tokens, num_experts, top_k).to(DEVICE)
    slots, block_expert = getattr(triton_moe, kernel)(ids, num_experts, block_m)
    want_slots, want_blocks = triton_moe.route_torch(ids, num_experts, block_m)
    assert torch.equal(slots, want_slots)
    assert torch.equal(block_expert, want_blocks)


def test_route_kernel_refuses_more_slots_than_one_program_sorts():
    ids = torch.zeros(triton_moe.ROUTE_KERNEL_MAX_SLOTS // 8 + 1, 8, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="route_kernel serves up to"):
        triton_moe.route_kernel(ids, 8, 16)


def quant_experts(w):
    """(E, N, K) bf16 -> (E, N, K) e4m3, (E, N/128, K/128): 128x128 blocks per expert."""
    e, n, k = w.shape
    w_fp8, scale = quant_reference.quant_weight_block(w.reshape(e * n, k))
    return w_fp8.reshape(e, n, k), scale.reshape(e, n // 128, k // 128)


# Gated (gate and up halves) and non-gated (Nemotron-H's relu(up)^2) experts, with and without biases.
ACTIVATIONS = [
    ("silu", False),
    ("swigluoai", True),
    ("silu_limit", False),
    ("gelu_tanh", False),
    ("relu2", False),
    ("relu2", True),
]


def moe_inputs(tokens, num_experts=4, hidden=256, inter=256, top_k=2, bias=False, seed=0, activation="silu"):
    """The moe kernels' operands: w13 gate rows then up rows, or up rows alone for a non-gated
    activation (activations.UNARY_ACTIVATIONS)."""
    g = torch.Generator().manual_seed(seed)
    n13 = inter if activation in activations.UNARY_ACTIVATIONS else 2 * inter
    w13 = (torch.randn(num_experts, n13, hidden, generator=g) * 0.05).bfloat16()
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) * 0.05).bfloat16()
    (w13_fp8, s13), (w2_fp8, s2) = quant_experts(w13), quant_experts(w2)
    x = randn(tokens, hidden) if ON_GPU else fp8_exact_activation(tokens, hidden)
    ids = torch.randint(0, num_experts, (tokens, top_k), generator=g)
    weights = torch.rand(tokens, top_k, generator=g).bfloat16()
    b13 = (torch.randn(num_experts, n13, generator=g) * 0.1).bfloat16() if bias else None
    b2 = (torch.randn(num_experts, hidden, generator=g) * 0.1).bfloat16() if bias else None
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return [to(t) for t in (x, ids, weights, w13_fp8, s13, w2_fp8, s2, b13, b2)]


@pytest.mark.parametrize("tokens, block_m", [(1, 16), (9, 16), (70, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_gemm_writes_each_slot_the_block_gemm_of_its_token_and_expert(tokens, block_m, bias):
    x, ids, _, w13_fp8, s13, _, _, b13, _ = moe_inputs(tokens, bias=bias)
    x_fp8, x_scale = quant_reference.quant_act_block(x)
    slots, block_expert = triton_moe.route(ids, w13_fp8.shape[0], block_m)
    out = triton_moe.grouped_gemm(
        x_fp8, x_scale, w13_fp8, s13, b13, slots, block_expert, ids.numel(), ids.shape[1], block_m
    )
    flat = ids.reshape(-1)
    token = torch.arange(ids.numel(), device=ids.device) // ids.shape[1]
    for e in flat.unique().tolist():
        rows = (flat == e).nonzero().squeeze(1)
        exact = linear_reference.gemm_block(
            x_fp8[token[rows]], x_scale[token[rows]], w13_fp8[e], s13[e], None, torch.float64
        )
        if bias:
            exact = exact + b13[e].double()
        assert_bf16_close(out[rows], to_bf16_as_the_device_does(exact))


@pytest.mark.parametrize("e8m0", [False, True])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_gather_quant_puts_each_slots_token_quantized_on_its_row(routing, e8m0):
    """What the grouped Gluon GEMM reads: row r holds the token of slot slots[r] quantized bit
    for bit as quant_act quantizes it (and its scales), padding rows are quantized zeros, and
    rows[slot] points back at the slot's row."""
    tokens, num_experts, top_k, block_m = 37, 4, 3, 16
    ids = ROUTINGS[routing](tokens, num_experts, top_k).to(DEVICE)
    x = randn(tokens, 256, device=DEVICE)
    x_fp8, x_scale = triton_quant.quant_act(x, e8m0)
    slots, block_expert = triton_moe.route(ids, num_experts, block_m)
    s = ids.numel()
    a, a_scale, rows = triton_moe.gather_quant(x, slots, block_expert, s, top_k, block_m, e8m0)
    in_use = (block_expert >= 0).repeat_interleave(block_m)
    real = in_use & (slots < s)
    pad = in_use & (slots >= s)
    token = slots[real].long() // top_k
    assert torch.equal(a[real].view(torch.uint8), x_fp8[token].view(torch.uint8))
    assert torch.equal(a_scale[real], x_scale[token])
    assert not a[pad].view(torch.uint8).any()
    routed = slots[real].long()
    assert torch.equal(rows[routed].long(), real.nonzero().squeeze(1))


def test_topk_sum_weights_and_sums_each_tokens_slots_in_fp32_skipping_sentinels():
    t, k, h, num_experts = 6, 3, 384, 4
    c = randn(t * k, h, device=DEVICE)
    ids = torch.randint(0, num_experts, (t, k), device=DEVICE)
    ids[0, 1] = -1
    ids[2, 0] = num_experts
    weights, bias = torch.rand(t, k, device=DEVICE).bfloat16(), randn(num_experts, h, device=DEVICE)
    out = triton_moe.topk_sum(c, ids, weights, num_experts, bias, out_dtype=torch.float32)
    valid = ((ids >= 0) & (ids < num_experts)).reshape(-1, 1)
    y = (c.float() + bias.float()[ids.reshape(-1).clamp(0, num_experts - 1)]) * weights.reshape(-1, 1).float()
    expected = torch.where(valid, y, 0).reshape(t, k, h).sum(1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def staged_reference(x, ids, weights, w13_fp8, s13, w2_fp8, s2, b13, b2, activation):
    """moe_triton's stages with the exact reference GEMM in place of the grouped kernel and the
    device's own conversions (bf16 store, float -> e4m3), so the comparison can be tight even
    in the CPU interpreter, whose conversions differ from the GPU's (conftest)."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    token = torch.arange(t * k, device=x.device) // k
    x_fp8, x_scale = triton_quant.quant_act(x)
    c1 = torch.zeros(t * k, w13_fp8.shape[1], dtype=torch.bfloat16, device=x.device)
    for e in flat.unique().tolist():
        rows = (flat == e).nonzero().squeeze(1)
        exact = linear_reference.gemm_block(
            x_fp8[token[rows]], x_scale[token[rows]], w13_fp8[e], s13[e], None, torch.float64
        )
        c1[rows] = to_bf16_as_the_device_does(exact + (b13[e].double() if b13 is not None else 0))
    gate, up = activations.act_operands(c1, activation)
    h_fp8, h_scale = triton_quant.quant_act(gate, b=up, activation=activation)
    out = torch.zeros(t * k, w2_fp8.shape[1], dtype=torch.float64, device=x.device)
    for e in flat.unique().tolist():
        rows = (flat == e).nonzero().squeeze(1)
        c2 = to_bf16_as_the_device_does(
            linear_reference.gemm_block(h_fp8[rows], h_scale[rows], w2_fp8[e], s2[e], None, torch.float64)
        )
        out[rows] = (c2.double() + (b2[e].double() if b2 is not None else 0)) * weights.reshape(-1)[
            rows, None
        ].double()
    return to_bf16_as_the_device_does(out.reshape(t, k, -1).sum(1))


@pytest.mark.parametrize("tokens", [1, 5, 40])
@pytest.mark.parametrize("activation, bias", ACTIVATIONS)
@pytest.mark.parametrize("top_k", [1, 2])  # top-1: Llama 4's dense experts, one row per slot (moe_dense.py)
def test_moe_triton_equals_its_stages_composed_from_the_reference_gemm(tokens, activation, bias, top_k):
    args = moe_inputs(tokens, bias=bias, activation=activation, top_k=top_k)
    out = triton_moe.moe_triton(*args, False, activation=activation)
    if ON_GPU:
        # The reference sums GEMM 1 exactly, the tensor cores in (reduced-precision) fp32: a gate|up
        # value can land one bf16 ulp apart and flip an FP8 rounding of the activation, which moves
        # some outputs by more than an ulp, so the elementwise check cannot hold there. The op
        # against the reference op measured 3.3e-6..1.5e-5 on an H200 (9d201bf:scripts/moe_diag.py).
        assert calc_diff(out, staged_reference(*args, activation)) < 1e-4
    else:
        assert_bf16_close(out, staged_reference(*args, activation))
    if ON_GPU:  # (the interpreter's float -> e4m3 error on the intermediate would dominate here)
        ref = moe_reference.moe_block(
            *[a.cpu() if a is not None else None for a in args], False, activation=activation
        )
        # The kernel equals the staged composition bit for bit (calc_diff 0.0 on an H100); against
        # the exact definition the tensor cores' fp32 sums in GEMM 1 flip a few FP8 roundings of
        # the activation: 3.1e-6..1.1e-4 on an H100 over 1, 5 and 40 tokens, silu and silu_limit
        # (git show 636e3e4:scripts/moe_act_probe.py), 3.3e-6..1.5e-5 on an H200; at top-1 over 5
        # tokens 2.60e-4 on an H200 (2026-11-27, 3024af3: five slots, half of top-2's ten, to
        # average a flipped rounding over). 2x the worst.
        assert calc_diff(out.cpu(), ref) < 5.2e-4


def test_moe_triton_frees_the_gate_up_products_before_it_makes_the_down_projections(monkeypatch):
    """The grouped buffers hold a row per slot plus every expert's padding to a block, so at a
    prompt's size the gate|up products (slots x 2I) and the down projections' (slots x H) are
    the op's largest tensors: the first is dropped once its activation is quantized, and is
    gone (with the views of it) when the second GEMM runs, so the two never sit in memory
    together."""
    alive = {}
    real_gemm, real_operands = triton_moe.grouped_gemm, triton_moe.act_operands

    def gemm(*args, **kwargs):
        if alive:  # the down projection: what the gate|up step made must be gone by now
            alive["at the second GEMM"] = [ref() is not None for ref in alive["refs"]]
        return real_gemm(*args, **kwargs)

    def operands(c1, activation):
        gate, up = real_operands(c1, activation)
        alive["refs"] = [weakref.ref(t) for t in (c1, gate, up)]
        return gate, up

    monkeypatch.setattr(triton_moe, "grouped_gemm", gemm)
    monkeypatch.setattr(triton_moe, "act_operands", operands)
    args = moe_inputs(5)
    out = triton_moe.moe_triton(*args, False)
    assert alive["at the second GEMM"] == [False, False, False]
    assert calc_diff(out, staged_reference(*args, "silu")) < 1e-4  # and still the op's numbers


# Each token count against each program size, top-1 and top-2, with silu; then each other
# activation at one of them: the decode op's own work is the routing (tokens, max_tokens, top_k);
# the activation passes through to the quantization kernel that moe_triton launches too, and
# test_moe_triton_equals_its_stages_composed_from_the_reference_gemm crosses it with the sizes.
DECODE_CASES = [
    (tokens, max_tokens, "silu", False, top_k)
    for tokens, max_tokens in [(1, 1), (3, 16), (16, 16), (32, 32)]
    for top_k in (1, 2)
] + [(3, 16, activation, bias, 2) for activation, bias in ACTIVATIONS if activation != "silu"]


@pytest.mark.parametrize("tokens, max_tokens, activation, bias, top_k", DECODE_CASES)
def test_moe_decode_op_gives_the_bits_of_moe_triton(tokens, max_tokens, activation, bias, top_k):
    """fp8compile::moe_decode (the op Inductor launches itself at decode sizes) routes in one
    program sized for max_tokens and runs the Triton kernel's 16-row blocks: moe_triton's own
    choices there, so the same bits for any token count up to max_tokens."""
    from fp8compile.ops.moe import decode_op as moe_decode_op

    args = moe_inputs(tokens, bias=bias, activation=activation, top_k=top_k)
    assert moe_decode_op.decode_fits(4, top_k, max_tokens)
    out = torch.ops.fp8compile.moe_decode(*args, False, max_tokens, activation=activation)
    assert torch.equal(out, triton_moe.moe_triton(*args, False, activation=activation))
    if ON_GPU:  # as for moe_triton above: the tensor cores' fp32 sums keep the check from being elementwise
        assert calc_diff(out, staged_reference(*args, activation)) < 1e-4
    else:
        assert_bf16_close(out, staged_reference(*args, activation))


def test_moe_decode_fits_only_where_moe_triton_routes_in_one_program_with_its_smallest_blocks():
    from fp8compile.ops.moe import decode_op as moe_decode_op

    # Qwen3-30B-A3B (128 experts, top-8) up to 64 tokens: 512 slots, 4 per expert
    assert moe_decode_op.decode_fits(128, 8, 64)
    assert not moe_decode_op.decode_fits(128, 8, 65)  # 520 slots: past one program's sort
    assert not moe_decode_op.decode_fits(8, 2, 128)  # Mixtral: 32 slots per expert take 32-row blocks
    with pytest.raises(ValueError, match="past that"):
        torch.ops.fp8compile.moe_decode(*moe_inputs(2), False, 1024)


@pytest.mark.skipif(not ON_GPU, reason="the Gluon kernel runs on an sm_90 GPU only")
@pytest.mark.parametrize("activation, bias", ACTIVATIONS)
def test_moe_triton_takes_the_gluon_gemms_from_64_slots_per_expert_with_the_same_numbers(
    monkeypatch, activation, bias
):
    """300 tokens x top-2 over 4 experts is 150 slots per expert: the GEMMs are the grouped Gluon
    kernel's on gathered rows (64-row blocks: N = 512 and 256 take 256-column tiles), with the
    numbers of the staged reference and of the Triton kernel's path (the same 128-wide products,
    scaled per group; calc_diff as in the test above)."""
    from fp8compile.ops.linear import gluon_gemm

    if gluon_gemm.why_not_grouped(
        torch.empty(0, 256, dtype=torch.float8_e4m3fn, device=DEVICE),
        torch.empty(4, 512, 256, dtype=torch.float8_e4m3fn, device=DEVICE),
    ):
        pytest.skip("needs an sm_90 GPU and Gluon")
    calls = []
    real = triton_moe.moe_gluon
    monkeypatch.setattr(triton_moe, "moe_gluon", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
    args = moe_inputs(300, bias=bias, activation=activation)
    out = triton_moe.moe_triton(*args, False, activation=activation)
    assert calls == [args[1].shape]
    assert calc_diff(out, staged_reference(*args, activation)) < 1e-4
    # 128-row blocks (experts whose N 256-column tiles do not divide): the same bits
    assert torch.equal(
        triton_moe.moe_gluon(*args, False, activation=activation, config=gluon_gemm.CONFIG), out
    )
    calls.clear()
    triton_path = triton_moe.moe_triton(*args, False, activation=activation, batch_invariant=True)
    assert calls == []  # batch-invariant: the Triton kernel's fixed 64-row blocks
    assert calc_diff(out, triton_path) < 1e-4


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens, max_m", [(1, 64), (5, 64), (37, 64), (70, 128)])
def test_masked_layout_gives_each_routed_slot_its_own_row_of_its_experts_block_in_slot_order(
    routing, tokens, max_m
):
    """DeepGEMM's masked layout (vendors.masked_layout): expert e's slots on rows e * max_m,
    e * max_m + 1, ... in slot order, masked_m[e] of them; a slot routed outside [0, E) on the one
    row past every block."""
    from fp8compile.ops.moe.vendors import masked_layout

    num_experts, top_k = 8, 4
    ids = ROUTINGS[routing](tokens, num_experts, top_k).to(DEVICE)
    dest, masked_m = masked_layout(ids, num_experts, max_m)
    flat = ids.reshape(-1).cpu()
    dest, masked_m = dest.cpu(), masked_m.cpu()
    assert masked_m.dtype == torch.int32
    for e in range(num_experts):
        slots = (flat == e).nonzero().squeeze(1)
        assert masked_m[e] == slots.numel()
        assert dest[slots].tolist() == [e * max_m + r for r in range(slots.numel())]
    outside = (flat < 0) | (flat >= num_experts)
    assert bool((dest[outside] == num_experts * max_m).all())


class _MaskedGemmOfTheReference:
    """deep_gemm's fp8_m_grouped_gemm_nt_masked as the reference block GEMM: writes rows
    [0, masked_m[e]) of each expert's block, in the device's bf16 rounding, and leaves the rest
    as they were, as DeepGEMM does."""

    @staticmethod
    def fp8_m_grouped_gemm_nt_masked(a, b, d, masked_m, expected_m, disable_ue8m0_cast=False):
        (a_fp8, a_scale), (w_fp8, w_scale) = a, b
        assert a_fp8.shape[:2] == d.shape[:2] and expected_m >= 1 and disable_ue8m0_cast
        for e, m in enumerate(masked_m.tolist()):
            if m:
                exact = linear_reference.gemm_block(
                    a_fp8[e, :m], a_scale[e, :m], w_fp8[e], w_scale[e], None, torch.float64
                )
                d[e, :m] = to_bf16_as_the_device_does(exact)


@pytest.mark.parametrize("tokens", [1, 5, 70])
@pytest.mark.parametrize("activation, bias", ACTIVATIONS)
def test_masked_deep_gemm_moe_scatters_and_gathers_every_slot_like_the_staged_reference(
    tokens, activation, bias, monkeypatch
):
    """vendors.moe_deep_gemm_masked's own part (the masked layout, the quantized tokens scattered
    into it, the activation over the blocks, the top-k sum read back through it) around the two
    masked GEMMs: on the CPU with the reference GEMM in DeepGEMM's place, on the GPU with DeepGEMM."""
    import sys

    from fp8compile.ops import vendors
    from fp8compile.ops.moe import vendors as moe_vendors

    if ON_GPU:
        if vendors.import_error("deep_gemm") is not None:
            pytest.skip(vendors.import_error("deep_gemm"))
    else:
        monkeypatch.setitem(sys.modules, "deep_gemm", _MaskedGemmOfTheReference)
        monkeypatch.setattr(vendors, "import_error", lambda module: None)
    args = moe_inputs(tokens, bias=bias, activation=activation)
    out = moe_vendors.moe_deep_gemm_masked(*args, False, activation=activation)
    want = staged_reference(*args, activation)
    if ON_GPU or bias:
        # DeepGEMM writes gate|up in bf16 and the bias is added after, so they round twice (the
        # contiguous layout's bound, test_gpu.py); the tensor cores' fp32 sums, as for moe_triton.
        assert calc_diff(out, want) < 3e-4
    else:
        assert_bf16_close(out, want)


def _float16_kernels():
    from fp8compile.ops.moe import decode_op  # noqa: F401  registers fp8compile::moe_decode
    from fp8compile.ops.moe import vendors as moe_vendors

    kernels = {
        "moe_triton": triton_moe.moe_triton,
        "moe_decode": lambda *args: torch.ops.fp8compile.moe_decode(*args, 32),  # built for 32 tokens
    }
    if ON_GPU:
        kernels["moe_deep_gemm"] = moe_vendors.moe_deep_gemm
        kernels["moe_deep_gemm_masked"] = moe_vendors.moe_deep_gemm_masked
    return kernels


@pytest.mark.parametrize("kernel", ["moe_triton", "moe_decode", "moe_deep_gemm", "moe_deep_gemm_masked"])
@pytest.mark.parametrize("tokens", [1, 5, 40, 300])
def test_every_moe_kernel_answers_float16_tokens_in_float16_from_the_same_fp8_products(kernel, tokens):
    """A float16 model's experts run the bfloat16 model's kernels (passes/moe.py). Tokens held
    exactly in both dtypes quantize to the same FP8 values, every product is the same bfloat16
    value, and only the fp32 top-k sum is written in float16: within a bfloat16 ulp (half of one
    on the GPU; the interpreter truncates fp32 to bfloat16, conftest) plus half a float16 ulp of
    the bfloat16 answer. 300 tokens x top-2 over 4 experts take the Gluon GEMMs on an sm_90 GPU;
    DeepGEMM's kernels run where it is installed."""
    from fp8compile.ops import vendors

    if kernel.startswith("moe_deep_gemm") and (not ON_GPU or vendors.import_error("deep_gemm")):
        pytest.skip("DeepGEMM's MoE GEMMs: a GPU with deep_gemm")
    if kernel == "moe_decode" and tokens > 32 or not ON_GPU and tokens > 40:
        pytest.skip("past the decode op's 32 tokens / the interpreter's time")
    run = _float16_kernels()[kernel]
    args = moe_inputs(tokens)
    if not ON_GPU:  # the interpreter's tokens, exact in FP8, scaled into float16's range: every
        args[0] = fp8_exact_activation(tokens, 256).to(DEVICE) * 2**-6  # value a multiple of 2^-24
    bf16 = run(*args, False)
    f16 = run(args[0].half(), *args[1:], False)
    assert f16.dtype == torch.float16 and bf16.dtype == torch.bfloat16
    bf16_ulp = 2**-8 if ON_GPU else 2**-7  # relative: half a bfloat16 ulp rounded, a whole one truncated
    torch.testing.assert_close(f16.float(), bf16.float(), rtol=bf16_ulp + 2**-11, atol=1e-6)
