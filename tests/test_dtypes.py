"""The model dtypes FP8 serves (passes/dtypes.py): a float16 model is rewritten like a bfloat16
one, its outputs float16, within the bound of its own float16 unfused FP8 composition; a float32
model stays float32, each site saying so and how to get FP8; the report says what stays unchanged
and in which dtype; kernels that write bfloat16 only decline a float16 request by name."""

import pytest
import torch

import fp8compile
from fp8compile import calc_diff, registry
from tests.conftest import randn
from tests.models import GatedMLP
from tests.test_linear_pass import bf16_matmuls
from tests.test_llama import fp8_simulated

F16 = torch.float16


def _compile(model, x, **options):
    fp8 = fp8compile.backend(**options)
    with torch.no_grad():
        return torch.compile(model, backend=fp8)(x), fp8.report


def _sites(report) -> list[tuple[str, str]]:
    return sorted((r.kind, r.name) for r in report.rewrites)


@pytest.mark.parametrize("recipe", ["block", "rowwise", "tensor"])
def test_a_float16_gated_mlp_is_rewritten_as_the_bfloat16_one_and_answers_in_float16(recipe):
    from fp8compile.architectures import composition

    torch.manual_seed(0)
    model, x = GatedMLP().to(F16), randn(3, 40, 256, dtype=F16)
    out, report = _compile(model, x, recipe=recipe)
    torch._dynamo.reset()
    _, bf16_report = _compile(GatedMLP().to(torch.bfloat16), x.bfloat16(), recipe=recipe)
    # the same sites, kinds and fusions: gate and up as one GEMM, down fused with silu(gate) * up
    assert _sites(report) == _sites(bf16_report) and report.counts()["silu_mul"] == 1
    assert report.skips == [] and out.dtype == F16
    with torch.no_grad():
        eager = model(x)
        with composition(model, recipe):  # the recipe's unfused FP8 composition, in float16
            bound = calc_diff(model(x), eager)
    assert 0 < calc_diff(out, eager) <= 1.15 * bound


def test_a_float16_transformers_llama_is_rewritten_within_its_float16_compositions_bound():
    pytest.importorskip("transformers")
    from fp8compile.demo import small_llama

    model = small_llama(layers=1).to(F16)
    ids = torch.randint(0, 32000, (2, 24))
    out, report = _compile(model, ids)
    counts = report.counts()
    assert (counts["linear"], counts["silu_mul"]) == (6 + 1, 1)  # q, k, v, o, gate, up; lm_head
    assert not [s for s in report.skips if s.kind in ("linear", "silu_mul")]
    with torch.no_grad():
        eager = model(ids).logits
        bound = calc_diff(fp8_simulated(model)(ids).logits, eager)
    assert out.logits.dtype == F16 and torch.isfinite(out.logits).all()
    assert 0 < calc_diff(out.logits, eager) <= 1.15 * bound


def test_a_float32_model_stays_float32_and_each_site_says_how_to_get_fp8(captured):
    model, x = GatedMLP().to(torch.float32), randn(16, 256, dtype=torch.float32)
    out, report = _compile(model, x)
    assert report.rewrites == [] and len(report.skipped("linear")) == 3
    assert all(
        s.reason.startswith("dtype float32: linears are rewritten in bfloat16 or float16 models")
        and "model.to(torch.bfloat16)" in s.reason
        for s in report.skips
    )
    assert "left unchanged, in float32:" in str(report) and "3 left unchanged" in str(report)
    assert bf16_matmuls(captured[0].after) == 3  # its three mm's as written (counted whatever their dtype)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))


def _plain_moe():
    from tests.models import GptFastMoE

    return GptFastMoE().to(F16), randn(9, 256, dtype=F16)


def _transformers_grouped_mm_moe():
    # transformers runs a float16 model's "grouped_mm" experts through its own grouped GEMM op
    pytest.importorskip("transformers")
    from tests.test_moe import qwen3_moe_block

    return qwen3_moe_block("grouped_mm").to(F16), randn(1, 9, 256, dtype=F16)


@pytest.mark.parametrize("make", [_plain_moe, _transformers_grouped_mm_moe])
def test_float16_experts_are_rewritten_and_answer_in_float16_within_the_bf16_blocks_bound(make):
    """Every MoE kernel writes its expert GEMMs' products in bfloat16 (DeepGEMM's only output
    dtype; ops/moe/reference.py): a float16 model's experts run the same kernels, the op summing
    in fp32 and answering in float16."""
    from tests.test_moe import MOE_BLOCK, compile_block

    torch.manual_seed(0)
    out, eager, report = compile_block(*make())
    (rewrite,) = [r for r in report.rewrites if r.kind == "moe"]
    assert "8 experts, top-2" in rewrite.detail
    assert not report.skipped("moe")
    assert out.dtype == F16 and calc_diff(out, eager) < MOE_BLOCK


def test_a_float16_qwen3_moe_model_is_within_its_float16_compositions_bound():
    """The architecture matrix's small Qwen3-MoE in float16: both blocks' experts and every
    linear rewritten, its median token within 1.15x of the float16 model's own unfused FP8
    composition (its experts' GEMMs one by one, their products in float16)."""
    pytest.importorskip("transformers")
    from fp8compile import architectures

    row = architectures.run("qwen3_moe", dtype=F16)
    assert row.dtype == "float16" and row.status == "rewritten", architectures.table([row])
    assert row.counts["moe"] == 2 and row.counts["linear"] > 0
    assert row.median <= architectures.BOUND_FACTOR * row.median_composition


def test_a_float16_deepseek_v32_indexer_is_rewritten_within_its_float16_bound():
    """Its bound as test_mqa_logits measures bfloat16's: the same model compiled with the FP8
    linears but without this pass (1.97e-2 against 1.93e-2: 1.02x, 2026-11-28)."""
    pytest.importorskip("transformers")
    from fp8compile.config import FUSIONS
    from tests.test_mqa_logits import deepseek_v32

    model = deepseek_v32(topk=16, layers=1).to(F16)
    ids = torch.randint(0, 200, (2, 64))
    out, report = _compile(model, ids)
    torch._dynamo.reset()
    unfused, _ = _compile(model, ids, fusions=tuple(f for f in FUSIONS if f != "mqa_logits"))
    assert report.counts()["mqa_logits"] == 1 and out.logits.dtype == F16
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits.float()
    bound = calc_diff(unfused.logits.float(), eager)
    assert 0 < calc_diff(out.logits.float(), eager) <= 1.15 * bound


def test_the_report_gives_each_left_site_its_dtype_where_they_stay_in_more_than_one():
    from fp8compile.report import Report, Skip

    report = Report()
    report.skips += [
        Skip("linear", "gate", "N=8 is less than one 128-row weight block", 0, "8x256", "bfloat16"),
        Skip("moe", "experts", "dtype float32: experts stay", 0, "8x256x256", "float32"),
    ]
    lines = str(report).splitlines()
    assert "left unchanged:" in lines and lines[lines.index("left unchanged:") + 1].split()[3] == "dtype"
    assert any(line.split()[:4] == ["moe", "experts", "8x256x256", "float32"] for line in lines)


@pytest.mark.parametrize("backend", ["deep_gemm", "flashinfer", "cublas"])
def test_a_library_that_writes_bfloat16_only_declines_a_float16_model_by_name(backend):
    request = registry.Request("linear", torch.device("cpu"), 4096, 4096, 1, 16, dtype=F16)
    assert "writes bfloat16 only (float16 model)" in registry.why_not(backend, request)
    assert registry.why_not("reference", request) is None  # ours write the model's dtype


def test_bench_model_runs_a_float16_model_against_its_float16_composition(tmp_path):
    pytest.importorskip("transformers")
    from fp8compile.bench.model import bench_model
    from fp8compile.bench.table import model_table
    from tests.conftest import TINY_BENCH

    options = dict(TINY_BENCH, steps=0, variants=["fp8"], repeat=1, prefill_batches=[1])
    rows = bench_model(tmp_path, **options, dtype="float16")
    assert {r["dtype"] for r in rows} == {"float16"}
    accuracy = {r["variant"]: r["calc_diff"] for r in rows if r["kind"] == "accuracy"}
    assert 0 < accuracy["fp8"] <= 1.15 * accuracy["fp8_unfused_eager"]
    assert "tiny-llama, 1 layers, cpu, float16:" in model_table(rows)
