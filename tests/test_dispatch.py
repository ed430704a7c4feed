"""M dispatch: one graph, compiled with dynamic M, serves every range of M (M <= small_m,
small_m < M <= large_m, M > large_m) through torch.cond, without recompiling; ranges that get
the same kernel share one call; batch-invariant mode uses one kernel for every M."""

import dataclasses

import pytest
import torch
from torch import nn

import fp8compile
from fp8compile import registry
from tests.conftest import BF16, CountingBackend, randn

FP8_LINEAR = torch.ops.fp8compile.qlinear.default


def run(model, backend, ms, dynamic=True):
    outs = {}
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for m in ms:
            x = randn(m, 256)
            if dynamic:
                torch._dynamo.mark_dynamic(x, 0)
            outs[m] = (x, compiled(x))
    return outs


def test_one_graph_serves_m_on_both_sides_of_the_threshold_without_recompiling(probe_backend, captured):
    model = nn.Linear(256, 384).to(BF16)
    backend = CountingBackend(backends=["probe", "reference"])
    run(model, backend, [45, 3, 32, 33, 200, 17, 300])
    assert backend.compiles == 1
    # the probe backend serves only M <= 32: it ran exactly for the small-M calls
    assert probe_backend == [("linear", m) for m in (3, 32, 17)]
    (rewrite,) = backend.report.rewrites
    assert rewrite.kernels == (("M <= 32", "probe"), ("M > 32", "reference"))
    (g,) = captured
    assert g.count(torch.ops.higher_order.cond) == 1
    assert sorted(n.kwargs["backend"] for n in g.ops(FP8_LINEAR)) == ["probe", "reference"]


def test_three_ranges_of_m_become_nested_conds_in_one_graph(probe_backend, captured):
    model = nn.Linear(256, 384).to(BF16)
    backend = CountingBackend(backends=["probe", "mid", "reference"], large_m=100)
    outs = run(model, backend, [45, 3, 101, 100, 33, 500, 32])
    assert backend.compiles == 1
    assert probe_backend == [
        ("mid:linear", 45),
        ("linear", 3),
        ("mid:linear", 100),
        ("mid:linear", 33),
        ("linear", 32),
    ]
    (rewrite,) = backend.report.rewrites
    assert rewrite.kernels == (("M <= 32", "probe"), ("32 < M <= 100", "mid"), ("M > 100", "reference"))
    (g,) = captured
    assert g.count(torch.ops.higher_order.cond) == 2  # M <= 32 ? probe : (M <= 100 ? mid : reference)
    assert sorted(n.kwargs["backend"] for n in g.ops(FP8_LINEAR)) == ["mid", "probe", "reference"]
    for x, y in outs.values():
        assert fp8compile.calc_diff(y, model(x)) < 1e-3


class Layers(nn.Module):
    """Three linears of one shape (a model's repeated layers), one of another, and one of the first
    shape reading a strided view (the left half of a wider tensor)."""

    def __init__(self):
        super().__init__()
        self.same = nn.ModuleList(nn.Linear(256, 256) for _ in range(3))
        self.wider = nn.Linear(256, 512)
        self.strided = nn.Linear(256, 256)

    def forward(self, x):
        for layer in self.same:
            x = layer(x)
        return self.strided(self.wider(x)[:, :256])


def test_call_sites_of_one_signature_share_their_branch_modules(probe_backend, captured):
    """Inductor lowers and compiles a cond's branch once per module name, so the repeated
    layers' sites read the first one's branches: weights are operands, and only a site with
    another shape or stride has its own."""
    model = Layers().to(BF16)
    backend = CountingBackend(backends=["probe", "mid", "reference"], large_m=100)
    outs = run(model, backend, [3, 45, 500, 32, 100])
    assert backend.compiles == 1 and len(backend.report.rewrites) == 5
    (g,) = captured
    conds = g.after.graph.find_nodes(op="call_function", target=torch.ops.higher_order.cond)
    branches = [tuple(branch.target for branch in cond.args[1:3]) for cond in conds]
    assert len(branches) == 5 and branches[0] == branches[1] == branches[2]
    assert len(set(branches)) == 3  # the repeated layers', the wider one's, the strided one's
    for x, y in outs.values():  # every layer's own weights, in every range of M
        assert fp8compile.calc_diff(y, model(x)) < 5 * 1e-3


def test_ranges_that_get_the_same_kernel_share_one_call(probe_backend, captured):
    # "mid" serves 33..2048, and the reference serves the rest: without "mid" the two upper
    # ranges both get the reference, so there is one cond, not two.
    backend = fp8compile.backend(backends=["probe", "reference"])
    run(nn.Linear(256, 256).to(BF16), backend, [8, 40, 3000])
    assert backend.report.rewrites[0].kernels == (("M <= 32", "probe"), ("M > 32", "reference"))
    assert captured[0].count(torch.ops.higher_order.cond) == 1


def test_large_m_must_be_above_small_m():
    with pytest.raises(ValueError, match="large_m=16 must be above small_m=32"):
        fp8compile.backend(large_m=16)
    with pytest.raises(ValueError, match="small_m=2000 is not below the default large_m .* set large_m too"):
        fp8compile.backend(small_m=2000)
    assert fp8compile.backend(small_m=2000, large_m=0).config.large_m_for(4096) == 0


class WideAndNarrow(nn.Module):
    def __init__(self):
        super().__init__()
        self.wide, self.narrow = nn.Linear(256, 4096), nn.Linear(256, 2048)

    def forward(self, x):
        return self.wide(x), self.narrow(x)


def test_by_default_the_large_m_range_starts_after_1536_rows_on_wide_outputs_and_2048_on_narrow():
    """large_m=None: outputs of 4096 or more take the large-M order (DeepGEMM first) from 1537 rows,
    narrower ones (where DeepGEMM was measured slower at 1536-2048 rows) from 2049; a set large_m
    serves every width."""
    from fp8compile.passes.dispatch import ranges

    default = fp8compile.Fp8Config()
    assert ranges(default, None, 4096)[1:] == [("medium", 33, 1536), ("large", 1537, None)]
    assert ranges(default, None, 2048)[1:] == [("medium", 33, 2048), ("large", 2049, None)]
    assert ranges(default, 2048, 14336) == [("large", 2048, 2048)]
    assert ranges(default, 2048, 2048) == [("medium", 2048, 2048)]
    for n in (2048, 4096):
        assert ranges(fp8compile.Fp8Config(large_m=1024), None, n)[2] == ("large", 1025, None)
    assert "large_m=1536 (N >= 4096) / 2048 (narrower)" in str(fp8compile.backend().report)


def test_each_call_site_gets_the_large_m_range_of_its_output_width(probe_backend):
    model = WideAndNarrow().to(BF16)
    # fusions=(): the qkv fusion would merge the two siblings into one 6144-wide linear
    backend = fp8compile.backend(backends=["probe", "mid", "reference"], fusions=())
    x = randn(1600, 256)
    torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad():
        wide, narrow = torch.compile(model, backend=backend)(x)
    kernels = {r.name.split(".")[-1]: r.kernels for r in backend.report.rewrites}
    assert kernels["wide"] == (("M <= 32", "probe"), ("32 < M <= 1536", "mid"), ("M > 1536", "reference"))
    assert kernels["narrow"] == (("M <= 32", "probe"), ("32 < M <= 2048", "mid"), ("M > 2048", "reference"))
    assert probe_backend == [("mid:linear", 1600)]  # the narrow site's; the wide one ran the reference
    for y, ref in zip((wide, narrow), model(x)):
        assert fp8compile.calc_diff(y, ref) < 1e-3


def test_m_of_one_works_on_a_dynamic_graph(probe_backend):
    # Dynamo specializes size-1 dimensions, so M = 1 gets its own graph; it must still be right.
    model = nn.Linear(256, 256, bias=False).to(BF16)
    outs = run(model, fp8compile.backend(backends=["probe", "reference"]), [1, 40])
    x, y = outs[1]
    assert y.shape == (1, 256) and ("linear", 1) in probe_backend
    assert fp8compile.calc_diff(y, model(x)) < 1e-3


def test_static_m_compiles_one_kernel_without_cond(probe_backend, captured):
    backend = fp8compile.backend(backends=["probe", "reference"])
    run(nn.Linear(256, 256).to(BF16), backend, [8], dynamic=False)
    assert captured[0].count(torch.ops.higher_order.cond) == 0
    assert backend.report.rewrites[0].kernels == (("M = 8", "probe"),)


def test_small_m_zero_means_one_large_m_kernel(probe_backend, captured):
    backend = fp8compile.backend(backends=["probe", "reference"], small_m=0)
    run(nn.Linear(256, 256).to(BF16), backend, [8, 40])
    assert captured[0].count(torch.ops.higher_order.cond) == 0
    assert backend.report.rewrites[0].kernels == (("all M", "reference"),)
    assert probe_backend == []


class Shifted(nn.Module):
    """A linear whose caller passes an int that changes every call, as transformers' sliding-window
    cache passes its position to a decode step."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(256, 384).to(BF16)

    def forward(self, x, position: int):
        return self.linear(x) + position


@pytest.mark.parametrize("mode", ["reduce-overhead", None])
def test_under_cuda_graphs_a_graph_with_a_moving_int_input_gets_no_cond_and_picks_each_ms_kernel_per_call(
    mode, probe_backend, captured
):
    # Inductor records a graph with torch.conds as one CUDA graph, again for each value of its int
    # inputs: a sliding-window decode step was recorded at every step (Mistral-7B-v0.1, batch 16:
    # 0.05x bf16 Inductor, H200). Without conds Inductor partitions it as it does bf16's graph;
    # the op then picks its range's kernel by M at every call, so that decode keeps its kernel.
    model = Shifted()
    backend = CountingBackend(backends=["probe", "reference"])
    compiled = torch.compile(model, backend=backend, mode=mode)
    with torch.no_grad():
        for m, position in ((3, 5), (40, 6), (7, 7), (60, 8)):
            x = randn(m, 256)
            torch._dynamo.mark_dynamic(x, 0)
            assert fp8compile.calc_diff(compiled(x, position), model(x, position)) < 1e-3
    assert backend.compiles == 2  # the position specialised, then a SymInt input
    first, moving = captured
    assert first.count(torch.ops.higher_order.cond) == 1
    (_, kernels), (_, moving_kernels) = [(r.graph, r.kernels) for r in backend.report.rewrites]
    assert kernels == (("M <= 32", "probe"), ("M > 32", "reference"))
    if mode is None:  # no CUDA graphs, nothing recorded: the dispatch as for any graph
        assert moving.count(torch.ops.higher_order.cond) == 1
        assert moving_kernels == kernels
    else:  # one call whose backend names each range's kernel (the probe serves M <= 32 only)
        assert moving.count(torch.ops.higher_order.cond) == 0
        label = "all M (no cond: an int input moves every call)"
        assert moving_kernels == ((label, "probe if M <= 32 else reference"),)
    assert probe_backend == [("linear", 3), ("linear", 7)]  # M = 40 and 60 ran on the reference


def test_batch_invariant_mode_uses_one_kernel_and_rows_do_not_depend_on_the_batch(captured):
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).to(BF16)
    backend = CountingBackend(batch_invariant=True)
    compiled = torch.compile(model, backend=backend)
    x = randn(300, 256)
    with torch.no_grad():
        outs = {}
        for m in (300, 77, 33, 32, 5, 2):
            xs = x[:m].clone()
            torch._dynamo.mark_dynamic(xs, 0)
            outs[m] = compiled(xs)
        alone = [compiled(x[i : i + 1].clone()) for i in (0, 1, 4, 31)]
    assert captured[0].count(torch.ops.higher_order.cond) == 0
    assert all(r.kernels == (("all M", "reference"),) for r in backend.report.rewrites)
    for m, out in outs.items():
        assert torch.equal(out, outs[300][:m]), f"rows of the M={m} batch differ from the M=300 batch"
    for i, row in zip((0, 1, 4, 31), alone):
        assert torch.equal(row[0], outs[300][i])


def test_explicit_backends_that_cannot_serve_are_a_clear_error(probe_backend):
    # "probe" alone cannot serve M > 32, and the user asked for nothing else
    with pytest.raises(
        Exception, match=r"no backend in \['probe'\] can run linear .*probe serves M <= 32 only"
    ):
        run(nn.Linear(256, 256).to(BF16), fp8compile.backend(backends=["probe"]), [40])


def test_a_dynamic_size_that_is_no_graph_input_leaves_the_linear_in_bf16_with_the_reason(
    monkeypatch, captured, probe_backend
):
    from fp8compile.passes import dispatch

    def unbindable(ctx, operands):
        raise dispatch.NoDispatch(
            "dynamic sizes ['u0'] are not graph inputs (data-dependent?), so no torch.cond"
        )

    monkeypatch.setattr(dispatch, "_symbol_operands", unbindable)
    model = nn.Linear(256, 256).to(BF16)
    backend = fp8compile.backend(backends=["probe", "reference"])  # two kernels: a cond is needed
    outs = run(model, backend, [40])
    (skip,) = backend.report.skipped("linear")
    assert "not graph inputs" in skip.reason and backend.report.rewrites == []
    assert torch.equal(outs[40][1], model(outs[40][0]))  # the bf16 linear, untouched
    assert captured[0].ops(FP8_LINEAR) == []


def test_each_chosen_kernel_prepares_its_call_site_at_compile_time(probe_backend, monkeypatch):
    # A backend's prepare hook allocates the state its kernels keep between calls while the
    # model compiles: allocated in a CUDA graph's warm-up run instead, it would land in the
    # graph's memory pool (tests/test_gpu_compiled.py runs that case on a GPU).
    prepared = []
    probe = registry._BACKENDS["probe"]
    monkeypatch.setitem(registry._BACKENDS, "probe", dataclasses.replace(probe, prepare=prepared.append))
    compiled = torch.compile(
        nn.Linear(256, 384).to(BF16), backend=fp8compile.backend(backends=["probe", "reference"])
    )
    x = randn(5, 256)
    torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad():
        compiled(x)
        assert [(r.op, r.n, r.k, r.m_min, r.m_max) for r in prepared] == [("linear", 384, 256, 1, 32)]
        for m in (3, 40):  # calls prepare nothing more
            compiled(randn(m, 256))
    assert len(prepared) == 1


def test_prepare_hooks_make_real_tensors_while_the_compiler_traces_with_fake_ones(probe_backend, monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensor

    made = []
    probe = registry._BACKENDS["probe"]
    monkeypatch.setitem(
        registry._BACKENDS,
        "probe",
        dataclasses.replace(probe, prepare=lambda request: made.append(torch.zeros(request.n))),
    )
    x = randn(5, 256)
    torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad():
        torch.compile(
            nn.Linear(256, 384).to(BF16), backend=fp8compile.backend(backends=["probe", "reference"])
        )(x)
    assert len(made) == 1 and not isinstance(made[0], FakeTensor) and made[0].shape == (384,)


def test_moe_above_large_m_prefers_our_grouped_gemms_to_deep_gemm_while_linears_keep_deep_gemm_first():
    """The large-M order puts DeepGEMM first (linears); for the MoE op the triton backend, whose
    grouped Gluon GEMMs give DeepGEMM's numbers faster, comes before it. Nothing else moves."""
    large = registry.default_order("large")
    assert large[0] == "deep_gemm" and registry.default_order("large", "linear") == large
    moe = registry.default_order("large", "moe")
    assert moe.index("triton") + 1 == moe.index("deep_gemm")
    assert sorted(moe) == sorted(large) and moe[-1] == "reference"
    assert registry.default_order("medium", "moe") == registry.default_order("medium")


def test_a_side_cut_at_a_token_count_keeps_its_kernel_on_both_parts():
    """dispatch.split (what the moe pass does at the Gluon GEMMs' first token count, so the part
    above can be a traced launch): the side that serves both at - 1 and at becomes two with its
    kernel and bounds; a count at a side's edge or outside every side changes nothing."""
    from fp8compile.passes.dispatch import Side, split

    sides = [Side("M <= 32", "triton_small_m", 32, 1), Side("M > 32", "triton", None, 33)]
    assert split(sides, 512) == [
        sides[0],
        Side("32 < M <= 511", "triton", 511, 33),
        Side("M > 511", "triton", None, 512),
    ]
    assert split(sides, 20) == [
        Side("M <= 19", "triton_small_m", 19, 1),
        Side("19 < M <= 32", "triton_small_m", 32, 20),
        sides[1],
    ]
    assert split(sides, 33) == sides and split(sides, 1) == sides
    assert split(sides, 512, "triton_small_m") == sides  # only a side of this kernel is cut
    static = [Side("M = 300", "triton", 300, 300)]
    assert split(static, 128) == static and split(static, 300) == static


def test_moe_call_sites_are_cut_after_the_decode_range_so_dynamic_graphs_launch_moe_decode():
    """inline.moe_decode_cut: a dynamic-M moe call site's triton side is cut after the most tokens
    (at most small_m) that moe_decode serves with moe_triton's own choices, so that the decode
    range is its own side (a traced launch); where moe_decode cannot serve small_m tokens the cut
    comes earlier; no cut where no launch is wanted (CPU, batch invariance, CUDA graphs)."""
    from types import SimpleNamespace

    from fp8compile.ops.moe.decode_op import decode_fits
    from fp8compile.passes.dispatch import Side, split
    from fp8compile.passes.inline import moe_decode_cut

    def ctx(launch=True, **config):
        return SimpleNamespace(inductor_launch=launch, config=fp8compile.Fp8Config(**config))

    cuda = torch.device("cuda")  # decode_fits is arithmetic: no GPU is touched
    assert moe_decode_cut(ctx(), 128, 8, cuda) == 33  # Qwen3-30B-A3B: 256 slots, 2 per expert
    assert moe_decode_cut(ctx(), 8, 2, cuda) == 33  # Mixtral
    # 8 experts, top-8: from 17 tokens on, 17 slots per expert take 32-row blocks
    assert decode_fits(8, 8, 16) and not decode_fits(8, 8, 17)
    assert moe_decode_cut(ctx(), 8, 8, cuda) == 17
    assert moe_decode_cut(ctx(small_m=8), 128, 8, cuda) == 9
    assert moe_decode_cut(ctx(small_m=0), 128, 8, cuda) is None
    assert moe_decode_cut(ctx(), 128, 8, torch.device("cpu")) is None
    assert moe_decode_cut(ctx(launch=False), 128, 8, cuda) is None
    assert moe_decode_cut(ctx(batch_invariant=True), 128, 8, cuda) is None
    # With the Gluon cut, a Qwen3-MoE site gets three triton sides: moe_decode, the op, moe_gluon.
    sides = split(split([Side("all M", "triton", None, 1)], 33, "triton"), 512, "triton")
    assert [s.label for s in sides] == ["M <= 32", "32 < M <= 511", "M > 511"]


def test_moe_gluon_serves_from_32_slots_per_expert_and_only_where_the_kernel_can_run():
    """moe_gluon_op.min_tokens: the fewest tokens moe_triton runs on the Gluon GEMMs (32 slots per
    expert: 512 tokens for Qwen3-30B-A3B's 128 experts, top-8); fits is False below it, and on a
    device the Gluon kernel cannot run on (here the CPU)."""
    from fp8compile.ops.linear import gluon_gemm
    from fp8compile.ops.moe import gluon_op as moe_gluon_op

    assert moe_gluon_op.min_tokens(128, 8) == 512 and moe_gluon_op.min_tokens(8, 2) == 128
    assert moe_gluon_op.min_tokens(256, 8) == 1024 and moe_gluon_op.min_tokens(32, 3) == 342
    assert not moe_gluon_op.fits(128, 8, 511, 1536, 768, 2048, torch.device("cpu"))
    assert not moe_gluon_op.fits(128, 8, 512, 1536, 768, 2048, torch.device("cpu"))
    assert gluon_gemm.why_not_shape(2048, 1536, torch.device("cpu")) is not None


class GatedMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up = nn.Linear(256, 512, bias=False), nn.Linear(256, 512, bias=False)
        self.down = nn.Linear(512, 256, bias=False)

    def forward(self, x):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def _qwen3_moe_block():
    pytest.importorskip("transformers")
    from tests.test_moe import qwen3_moe_block

    return qwen3_moe_block("grouped_mm")


@pytest.mark.parametrize(
    "make", [lambda: nn.Linear(256, 384), GatedMlp, _qwen3_moe_block], ids=["linear", "gated_mlp", "moe"]
)
def test_an_empty_input_stays_bf16_with_the_reason_where_there_is_no_range_of_m_to_serve(make):
    """Dynamo specialises a size of 0, so an empty batch compiles a graph of its own with M = 0:
    no kernel range holds it, and every FP8 candidate stays bf16 (free on no rows) with the
    reason, where it once crashed the backend (StopIteration in the M dispatch's plan)."""
    model = make().to(BF16)
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    first = lambda y: y[0] if isinstance(y, tuple) else y  # noqa: E731  (an MoE block returns a tuple)
    with torch.no_grad():
        some = randn(1, 5, 256)
        assert fp8compile.calc_diff(first(compiled(some)).float(), first(model(some)).float()) < 0.01
        rewritten = len(backend.report.rewrites)
        none = randn(1, 0, 256)
        empty, eager = first(compiled(none)), first(model(none))
    assert backend.compiles == 2 and empty.shape == eager.shape and empty.shape[1] == 0
    assert rewritten > 0 and len(backend.report.rewrites) == rewritten  # the empty graph adds none
    reasons = {s.kind: s.reason for s in backend.report.skips if s.reason.startswith("M = 0")}
    assert reasons and all("an empty input" in r for r in reasons.values()), backend.report


def test_the_passes_fake_values_are_computed_past_the_fake_modes_cache_which_stays_on():
    """The passes' other compile-time cost at dynamic M: re-deriving fake values below a merged
    projection's slices. The fake mode's dispatch cache made that slower (a miss pays for an
    entry, a hit still builds a view's output), so PassContext.fake computes past it; the mode
    keeps its cache for Inductor."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from fp8compile.passes.context import PassContext

    mode = FakeTensorMode()
    with mode:
        x = torch.empty(8, 6144, dtype=torch.bfloat16)
    before = FakeTensorMode.cache_info()
    view = PassContext.fake(SimpleNamespace(fake_mode=mode), torch.ops.aten.slice.Tensor, x, 1, 0, 4096)
    after = FakeTensorMode.cache_info()
    assert view.shape == (8, 4096) and view.stride() == (6144, 1)
    assert (after.hits, after.misses, after.size) == (before.hits, before.misses, before.size)
    assert mode.cache_enabled


def _launch_like(t):
    """What a traced Triton launch's node gives: {argument name: tensor}."""
    return {"o_ptr": t[:, :2]}


def test_a_merge_re_derives_values_below_it_through_a_traced_launchs_dict_of_outputs():
    """A q|k|v merge hands its users strided slices and re-derives the values below them; a
    traced kernel launch there (the split-KV attention's) has a dict as its value."""
    import operator
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from fp8compile.passes.context import PassContext

    mode = FakeTensorMode()
    graph = torch.fx.Graph()
    x, wide = graph.placeholder("x"), graph.placeholder("wide")
    old = graph.call_function(torch.ops.aten.clone.default, (x,))
    new = graph.call_function(torch.ops.aten.slice.Tensor, (wide, 1, 0, 4))
    launch = graph.call_function(_launch_like, (old,))
    out = graph.call_function(operator.getitem, (launch, "o_ptr"))
    graph.output(out)
    with mode:
        x.meta["val"], wide.meta["val"] = torch.empty(8, 4), torch.empty(8, 12)
        old.meta["val"], new.meta["val"] = torch.empty(8, 4), wide.meta["val"][:, :4]
        launch.meta["val"] = _launch_like(old.meta["val"])
        out.meta["val"] = launch.meta["val"]["o_ptr"]
    ctx = SimpleNamespace(fake_mode=mode)
    ctx.fake = lambda fn, *args, **kwargs: PassContext.fake(ctx, fn, *args, **kwargs)
    PassContext.replace_uses(ctx, old, new)
    assert launch.meta["val"]["o_ptr"].stride() == (12, 1)
    assert out.meta["val"].shape == (8, 2) and out.meta["val"].stride() == (12, 1)


@pytest.mark.parametrize("autotune", [False, True])
def test_on_a_gpu_without_fp8_kernels_a_linear_stays_bf16_with_why_not_the_float64_reference(
    autotune, monkeypatch
):
    """An A100 (sm_80) has no FP8 tensor cores: every kernel declines and only the reference
    (float64 sums) would serve, far slower than the bf16 linear it replaces."""
    from types import SimpleNamespace

    from fp8compile import autotune as autotune_module
    from fp8compile.passes import dispatch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(autotune_module, "time_us", lambda *a: pytest.fail("nothing serves: nothing to time"))
    ctx = SimpleNamespace(config=fp8compile.make_config(autotune=autotune), moving_ints=[])
    with pytest.raises(dispatch.NoDispatch, match="kept bf16") as kept:
        dispatch.plan(ctx, "linear", torch.device("cuda"), 512, 512, 64)
    if not autotune:  # each kernel's own reason, as `backends` prints them
        assert "triton: needs compute capability >= 8.9, device has 8.0" in str(kept.value)
    # named by the user, the reference still runs there
    config = fp8compile.make_config(backends=("cublas", "reference"), autotune=autotune)
    ctx = SimpleNamespace(config=config, moving_ints=[])
    sides = dispatch.plan(ctx, "linear", torch.device("cuda"), 512, 512, 64)
    assert [side.kernel for side in sides] == ["reference"]


@pytest.mark.parametrize("capability, kept", [((8, 0), True), ((9, 0), False)])
def test_gpu_why_not_tells_a_gpu_without_fp8_kernels_before_any_weight_is_quantized(
    capability, kept, monkeypatch
):
    from types import SimpleNamespace

    from fp8compile.passes import dispatch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    ctx = SimpleNamespace(config=fp8compile.make_config())
    for op in ("linear", "gated_linear", "moe", "scaled_linear"):
        why = dispatch.gpu_why_not(ctx, op, torch.device("cuda"))
        assert (why is not None and f"no FP8 kernel runs {op}" in why) == kept
    assert (
        dispatch.gpu_why_not(ctx, "linear", torch.device("cpu")) is None
    )  # the reference is the CPU's product
    named = SimpleNamespace(config=fp8compile.make_config(backends=("reference",)))
    assert dispatch.gpu_why_not(named, "linear", torch.device("cuda")) is None  # asked for by name


def test_a_backend_by_rows_names_each_range_of_m_and_its_kernel_and_reads_back():
    pieces = [(32, "probe"), (1536, "mid"), (None, "reference")]
    name = registry.by_rows(pieces)
    assert name == "probe if M <= 32 else mid if M <= 1536 else reference"
    assert registry.rows_pieces(name) == pieces
    assert registry.by_rows([(None, "reference")]) == "reference"
    with pytest.raises(ValueError, match="one unbounded"):
        registry.by_rows([(32, "probe"), (64, "mid")])
