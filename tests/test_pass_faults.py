"""No pass can fail a compile: an exception at one site keeps that site as the model wrote it,
the rest of the graph is still rewritten, the report says where and why, and the user gets one
warning. Fp8Config(strict=True) raises instead."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8compile
from fp8compile import architectures, calc_diff, release
from fp8compile.passes.context import PassContext
from tests.conftest import BF16, randn
from tests.models import GatedMLP

pytest.importorskip("transformers")
from tests.test_moe import qwen3_moe_block  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, CACHED = 4, 2, 64, 256, 24
PASSES = ("gqa_attention", "mqa_logits", "moe", "gate_up", "qkv", "silu_mul", "linear")


class EveryKind(nn.Module):
    """One site of every kind the passes rewrite, at decode rows: grouped-query attention over a
    cache (q|k|v merged, then the repeat_kv pattern), an output projection, a gated MLP (gate|up
    merged, silu_mul), a Qwen3-MoE block and an indexer's scores."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.mlp = GatedMLP(HIDDEN, 512)
        self.experts = qwen3_moe_block("grouped_mm")
        self.index_q = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)

    def forward(self, x, k_cache, v_cache, index_keys, index_weights):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
        keys, values = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)
        attn = F.scaled_dot_product_attention(q, _repeat_kv(keys), _repeat_kv(values))
        h = x + self.o_proj(attn.transpose(1, 2).reshape(b, s, HEADS * HEAD_DIM))
        h = h + self.mlp(h)
        routed = self.experts(h)
        h = h + (routed[0] if isinstance(routed, tuple) else routed)
        iq = self.index_q(h).view(b, s, HEADS, HEAD_DIM)
        scores = torch.einsum("bshd,btd->bsht", iq * 0.125, index_keys).relu()
        return h, (scores * index_weights.unsqueeze(-1)).sum(-2)


def _repeat_kv(x):
    b, kv, length, d = x.shape
    rep = HEADS // KV_HEADS
    return x[:, :, None].expand(b, kv, rep, length, d).reshape(b, kv * rep, length, d)


def _inputs(batch=3):
    return (
        randn(batch, 1, HIDDEN),
        randn(batch, KV_HEADS, CACHED, HEAD_DIM),
        randn(batch, KV_HEADS, CACHED, HEAD_DIM),
        randn(batch, CACHED, HEAD_DIM),
        randn(batch, 1, HEADS),
    )


def _model():
    torch.manual_seed(0)
    model = EveryKind().to(BF16)
    for p in model.parameters():
        nn.init.normal_(p, std=0.02)
    return model


def _fail_after_first_rewrite_of_each_pass(monkeypatch) -> dict[str, str]:
    """Each pass raises at the first site where it changed something (the graph or the report),
    after the change: the site must come back as it was. Returns pass -> that site."""
    real = PassContext.at_site
    injected: dict[str, str] = {}

    def at_site(self, site, work):
        name = self.current_pass
        if name in injected:
            return real(self, site, work)

        def work_then_fail():
            before = (len(self.gm.graph.nodes), len(self.report.rewrites))
            result = work()
            if (len(self.gm.graph.nodes), len(self.report.rewrites)) != before:
                injected[name] = site
                raise RuntimeError(f"injected into the {name} pass")
            return result

        return real(self, site, work_then_fail)

    monkeypatch.setattr(PassContext, "at_site", at_site)
    return injected


def test_an_error_at_one_site_of_each_pass_keeps_that_site_and_rewrites_the_rest(monkeypatch):
    model, args = _model(), _inputs()
    injected = _fail_after_first_rewrite_of_each_pass(monkeypatch)
    fp8 = fp8compile.backend()
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(model, backend=fp8)(*args)
        eager = model(*args)
        with architectures.composition(model):
            unfused = model(*args)
    assert sorted(injected) == sorted(PASSES)
    report = fp8.report
    faults = {s.kind: s for s in report.skips if "injected" in s.reason}
    assert {kind: s.name for kind, s in faults.items()} == injected
    assert all("kept as the model wrote it" in s.reason for s in faults.values())
    ours = [
        w for w in caught if "fp8compile" in str(w.message) and "error(s) in the passes" in str(w.message)
    ]
    assert len(ours) == 1 and "7 error(s)" in str(ours[0].message)

    rewritten = {(r.kind, r.name) for r in report.rewrites}
    assert ("attention", injected["gqa_attention"]) not in rewritten
    assert ("mqa_logits", injected["mqa_logits"]) not in rewritten
    assert ("moe", injected["moe"]) not in rewritten
    assert ("silu_mul", injected["silu_mul"]) not in rewritten
    assert not any(name == injected["linear"] for _, name in rewritten)
    # q|k|v stay apart: each linear rewritten on its own, none "one GEMM with" another. (gate|up,
    # kept apart by the gate_up pass, are two linears over one x: the qkv pass may merge them.)
    merged = {r.name for r in report.rewrites if "one GEMM" in r.detail}
    prefix, _, names = injected["qkv"].rpartition(".")
    assert {f"{prefix}.{n}" for n in names.split("|")}.isdisjoint(merged)
    # The rest is still rewritten: the other projections of the model are FP8
    assert report.counts()["linear"] >= 5
    # The numbers: FP8 where rewritten, bf16 where kept, no worse than the unfused FP8 model
    for got, want, fp8_only in zip(out, eager, unfused):
        assert 1e-6 < calc_diff(got, want) < 1.15 * calc_diff(fp8_only, want)


def test_strict_re_raises_the_passes_error(monkeypatch):
    from fp8compile import passes

    def broken(ctx):
        raise RuntimeError("a bug in a pass")

    monkeypatch.setitem(passes.FUSION_PASSES, "silu_mul", broken)
    model, x = GatedMLP(256, 512).to(BF16), randn(4, 256)
    with torch.no_grad(), pytest.raises(Exception, match="a bug in a pass"):
        torch.compile(model, backend=fp8compile.backend(strict=True))(x)


def test_an_error_outside_any_site_leaves_that_pass_out_of_the_graph(monkeypatch):
    from fp8compile import passes

    def broken(ctx):
        raise RuntimeError("a bug in a pass's matching")

    monkeypatch.setitem(passes.FUSION_PASSES, "silu_mul", broken)
    model, x = GatedMLP(256, 512).to(BF16), randn(4, 256)
    fp8 = fp8compile.backend()
    with torch.no_grad(), pytest.warns(UserWarning, match="error.s. in the passes"):
        out = torch.compile(model, backend=fp8)(x)
    assert fp8.report.counts()["silu_mul"] == 0 and fp8.report.counts()["linear"] == 3
    (fault,) = [s for s in fp8.report.skips if s.kind == "silu_mul"]
    assert "left out of" in fault.reason and "a bug in a pass's matching" in fault.reason
    with torch.no_grad():
        assert calc_diff(out, model(x)) < 3 * 7.2e-4


@pytest.mark.inductor
def test_a_graph_inductor_cannot_compile_as_rewritten_is_compiled_as_dynamo_gave_it(monkeypatch):
    from torch._inductor import compile_fx

    real = compile_fx.compile_fx_inner

    def inner(gm, *args, **kwargs):
        if any("fp8compile" in str(node.target) for node in gm.graph.nodes):
            raise RuntimeError("a lowering Inductor lacks")
        return real(gm, *args, **kwargs)

    monkeypatch.setattr(compile_fx, "compile_fx_inner", inner)
    model, x = GatedMLP(256, 512).to(BF16), randn(4, 256)
    fp8 = fp8compile.backend()
    with torch.no_grad(), pytest.warns(UserWarning, match="Inductor could not compile graph 0 as rewritten"):
        out = torch.compile(model, backend=fp8)(x)
    assert set(fp8.report.counts().values()) == {0}  # the rewrites it did not keep are off the report
    (skip,) = fp8.report.skipped("graph")
    assert "a lowering Inductor lacks" in skip.reason and "kept as the model wrote it" in skip.reason
    with torch.no_grad():
        assert calc_diff(out, model(x)) < 1e-5  # bf16: no FP8 error


class _FourLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256, bias=False) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x).relu()
        return x


def _device_of_limited_memory(monkeypatch, model: nn.Module, room_for_copies: float) -> None:
    """Quantization raises the device's out-of-memory error where the model's bf16 weights still
    resident, the FP8 copies held and the one being made would pass the bf16 weights' bytes plus
    `room_for_copies` copies of a weight: a GPU that the model fills, simulated on the CPU."""
    from fp8compile import weights

    params = list(model.parameters())
    copy_bytes = params[0].numel()  # a weight's FP8 copy: a byte an element (scales aside)
    limit = sum(p.numel() * p.element_size() for p in params) + room_for_copies * copy_bytes
    quantize = weights._quantize

    def _quantize(w, e8m0):
        resident = sum(p.untyped_storage().nbytes() for p in params)
        held = sum(entry[2][0].numel() for entry in weights._MEMO.values())
        if resident + held + w.numel() > limit:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated: the device holds the model)")
        return quantize(w, e8m0)

    monkeypatch.setattr(weights, "_quantize", _quantize)


def test_out_of_memory_quantizing_keeps_the_linears_bf16_drops_the_copies_and_names_the_way_out(monkeypatch):
    from fp8compile import weights

    torch.manual_seed(0)
    model, x = _FourLinears().to(BF16), randn(4, 256)
    weights.forget()
    _device_of_limited_memory(monkeypatch, model, room_for_copies=2.5)  # two copies fit, not three
    fp8 = fp8compile.backend()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch.compile(model, backend=fp8)(x)
        eager = model(x)
    # Two runs of the passes failed at the third copy; the linear pass was then left out
    report = fp8.report
    assert report.counts()["linear"] == 0
    out_of_memory = [s for s in report.skips if "OutOfMemoryError" in s.reason]
    assert len(out_of_memory) == 2
    assert all("release_bf16_weights=True" in s.reason for s in out_of_memory)
    # The copies those runs made went with them: none holds the memory the bf16 model runs in
    assert not weights._MEMO
    assert calc_diff(out, eager) < 1e-5  # bf16: no FP8 error


def test_released_as_each_copy_is_made_a_model_that_fills_the_device_compiles_in_fp8(monkeypatch):
    from fp8compile import weights

    torch.manual_seed(0)
    model, x = _FourLinears().to(BF16), randn(4, 256)
    weights.forget()
    _device_of_limited_memory(monkeypatch, model, room_for_copies=1.5)  # one copy beside the model
    fp8 = fp8compile.backend(release_bf16_weights=True)
    try:
        with torch.no_grad():
            eager = model(x)
            with architectures.composition(model):
                unfused = model(x)
            out = torch.compile(model, backend=fp8)(x)
            assert torch.equal(model(x), eager)  # the eager model is lent its released weights back
        assert fp8.report.counts()["linear"] == 4 and not fp8.report.skips
        assert all(release.is_released(p) for p in model.parameters())
        assert calc_diff(out, eager) < 1.15 * calc_diff(unfused, eager)
    finally:
        fp8compile.restore_bf16_weights()
