"""Whole models on the CPU: the contracts a transformers model leans on that one op never does.

- Every tensor that reaches an FP8 op in any branch of the M dispatch (gate_up halves, slices of a
  fused projection, the last token of a sequence, permuted and transposed views) gives the same
  bits as with one kernel for every M, and the graph our passes hand to Inductor says the right
  strides (a torch.cond branch is compiled for its operands' recorded strides).
- generate() with a static cache, through transformers' CompileConfig and through a user's own
  torch.compile, runs without recompiling after warm-up and within the FP8 bound.
- mode="reduce-overhead" at dynamic=True leaves no CPU tensor input (the Python floats Dynamo
  passes as 0-d CPU tensors are specialized, with a guard: a changed one recompiles).
"""

import dataclasses
import json
import statistics

import pytest
import torch
from torch import nn

import fp8compile
import fp8compile.passes
from fp8compile import architectures, calc_diff
from fp8compile.passes.context import _same_layout
from tests.conftest import BF16, RANGES, TINY_BENCH, CountingBackend
from tests.models import GatedMLP

pytest.importorskip("transformers")
from fp8compile.demo import small_llama  # noqa: E402
from tests.test_llama import fp8_simulated  # noqa: E402


class StridedInputs(nn.Module):
    """Every way a non-contiguous tensor reaches a linear in real model code; x is (B, S, 256)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(256, 3 * 256, bias=False)  # fused projection, outputs sliced
        self.a = nn.Linear(256, 256)
        self.b = nn.Linear(256, 256, bias=False)
        self.mlp = GatedMLP()  # gate and up become one GEMM whose halves feed the down projection
        self.head = nn.Linear(256, 384, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).split(256, dim=-1)  # (B, S, 256) with row stride 768
        h = self.a(q) + self.b(k) + self.mlp(v)
        permuted = self.b(h.transpose(0, 1)).transpose(0, 1)  # (S, B, 256) view
        columns = self.a(h.reshape(-1, 256)).t().contiguous()  # (256, B*S); its .t() is column-major
        transposed = self.b(columns.t())
        last = self.head(h[:, -1, :])  # (B, 256) with row stride S*256: S only in a stride
        return permuted, transposed, last


def _stale_meta(gm: torch.fx.GraphModule, fake_mode) -> list[str]:
    """Nodes whose recorded meta["val"] differs from what their op gives on their inputs' meta,
    and torch.cond branches whose inputs are recorded unlike the operands they get."""
    stale = []
    for node in [n for n in gm.graph.nodes if n.op == "call_function"]:
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        if node.target is torch.ops.higher_order.cond:
            for branch in node.args[1:3]:
                sub = getattr(gm, branch.target)
                inputs = [p.meta["val"] for p in sub.graph.find_nodes(op="placeholder")]
                stale += [
                    f"{branch.target}: {i}"
                    for i, (want, got) in enumerate(zip(inputs, args[3]))
                    if not _same_layout(want, got)
                ]
                stale += _stale_meta(sub, fake_mode)
            continue
        if "val" not in node.meta or not hasattr(node.target, "_schema"):
            continue
        with fake_mode:
            val = node.target(*args, **kwargs)
        if not _same_layout(val, node.meta["val"]):
            stale.append(f"{node.name} = {node.target}")
    return stale


@pytest.fixture
def stale_meta(monkeypatch) -> list[str]:
    """Stale metadata in each graph right after our passes (before Inductor touches it)."""
    found = []
    real = fp8compile.passes.run_passes

    def spy(ctx):
        real(ctx)
        found.extend(_stale_meta(ctx.gm, ctx.fake_mode))

    monkeypatch.setattr(fp8compile.passes, "run_passes", spy)
    return found


# (B, S): M = B*S in every range (M <= 32, 32 < M <= 64, M > 64), S varying so that it is dynamic
SHAPES = [(1, 1), (3, 1), (16, 1), (33, 1), (2, 32), (65, 1), (3, 100), (1, 7)]


def test_strided_sliced_and_transposed_inputs_give_the_same_bits_in_every_range_of_m(
    ranged_references, stale_meta
):
    model = StridedInputs().to(BF16)
    ranged = CountingBackend(backends=ranged_references, **RANGES)
    one_kernel = fp8compile.backend(backends=["reference"])  # no dispatch: one call per site
    compiled = torch.compile(model, backend=ranged, dynamic=True)
    plain = torch.compile(model, backend=one_kernel, dynamic=True)
    with torch.no_grad():
        for b, s in SHAPES:
            x = torch.randn(b, s, 256).to(BF16)
            got, want, eager = compiled(x), plain(x), model(x)
            for g, w, e in zip(got, want, eager):
                assert torch.equal(g, w), f"B={b} S={s}: the M dispatch changed the numbers"
                assert calc_diff(g, e) < 5e-3
    assert ranged.compiles <= 4  # Dynamo specializes B = 1 and S = 1: four graphs at most, then none
    kernels = {k for r in ranged.report.rewrites for k in r.kernels}
    assert {"ref_small", "ref_medium", "reference"} <= {k for _, k in kernels}
    assert ranged.report.counts()["silu_mul"] >= 1 and not ranged.report.skips
    assert stale_meta == []


def test_gate_up_halves_carry_their_row_stride_into_the_down_projections_branches(
    ranged_references, stale_meta
):
    # The 64-token crash of a transformers Llama on the GPU: the gate half of the merged gate|up
    # output (row stride 2I) reached a medium-M branch compiled for a contiguous input.
    model = small_llama(layers=1)
    compiled = torch.compile(
        model, backend=fp8compile.backend(backends=ranged_references, **RANGES), dynamic=True
    )
    with torch.no_grad():
        for b in (16, 64, 70):
            ids = torch.randint(0, 32000, (b, 1))
            assert calc_diff(compiled(ids, use_cache=False).logits, model(ids, use_cache=False).logits) < 5e-3
    assert stale_meta == []


def _generate(model, ids, steps, **kwargs):
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=steps,
        do_sample=False,
        cache_implementation="static",
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    return out.sequences, out.logits


@pytest.mark.parametrize("path", ["compile_config", "user_compile"])
def test_generate_with_a_static_cache_runs_16_steps_without_recompiling_after_warm_up(path):
    from transformers.generation.configuration_utils import CompileConfig

    model = small_llama(layers=1)
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, 32000, (2, 12))
    backend = CountingBackend()
    with torch.no_grad():
        eager_logits = model(ids).logits[:, -1].float()
        bound = calc_diff(fp8_simulated(model)(ids).logits[:, -1].float(), eager_logits)
        if path == "compile_config":  # transformers compiles the decode step; the prompt runs eagerly
            config = CompileConfig(backend=backend, mode="reduce-overhead")
            config._compile_all_devices = True  # transformers compiles generate() on GPUs only otherwise
            kwargs = dict(compile_config=config)
        else:  # a user's own compile: the prompt runs compiled too
            model.forward = torch.compile(model.forward, backend=backend, mode="reduce-overhead")
            kwargs = dict(disable_compile=True)
        tokens, _ = _generate(model, ids, 16, **kwargs)  # warm-up: compiles
        warm = backend.compiles
        again, logits = _generate(model, ids, 16, **kwargs)
    assert backend.compiles == warm > 0, "generate() recompiled after warm-up"
    assert torch.equal(tokens, again)
    assert backend.report.counts()["linear"] > 0
    if path == "user_compile":  # the first step's logits come from the compiled prompt
        assert bound < 5e-3 and calc_diff(logits[0].float(), eager_logits) < 1.15 * bound


def test_transformers_compile_config_keeps_the_users_backend_and_its_report():
    import copy

    fp8 = fp8compile.backend()
    assert copy.deepcopy(fp8) is fp8  # CompileConfig.to_dict() deep-copies its backend


def test_reduce_overhead_specializes_python_float_inputs_and_recompiles_when_one_changes(captured):
    model = small_llama(layers=1)
    ids = torch.randint(0, 32000, (3, 5))
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend, dynamic=True, mode="reduce-overhead")
    with torch.no_grad():
        out = compiled(ids, use_cache=False).logits
        # at dynamic=True Dynamo passes RMSNorm's eps and attention's scaling as 0-d float64 CPU
        # tensors; under CUDA graphs a CPU input, used or not, breaks them: none is left
        inputs = [p.meta["val"] for p in captured[0].after.graph.find_nodes(op="placeholder")]
        assert not [
            v for v in inputs if isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.dim() == 0
        ]
        assert torch.equal(
            out, torch.compile(model, backend=fp8compile.backend(), dynamic=True)(ids, use_cache=False).logits
        )
        compiles = backend.compiles
        model.model.layers[0].input_layernorm.variance_epsilon = 1e-1  # guarded: a new value recompiles
        changed = compiled(ids, use_cache=False).logits
        assert backend.compiles == compiles + 1
        assert calc_diff(changed, model(ids, use_cache=False).logits) < 5e-3


def test_bench_model_plumbing_runs_every_cpu_variant(tmp_path, capsys):
    from fp8compile.bench.model import bench_model
    from fp8compile.bench.table import model_table

    rows = bench_model(
        tmp_path,
        **TINY_BENCH,
        variants=["bf16", "bf16_gqa_ro", "fp8", "fp8_ro", "fp8_ro_release", "fp8_rowwise"],
        repeat=1,
        prefill_batches=[1],
    )
    decode = {r["variant"]: r for r in rows if r["kind"] == "decode"}
    prefill = {(r["variant"], r["batch"]): r for r in rows if r["kind"] == "prefill"}
    assert set(prefill) == {(v, 1) for v in decode}
    # fp8_ro_release: the user's own compile of model.forward (the prompt through the graphs too),
    # with the bf16 weights released, then restored for what follows
    assert set(decode) == {"bf16", "bf16_gqa_ro", "fp8", "fp8_ro", "fp8_ro_release", "fp8_rowwise"}
    # each row names the recipe its variant ran: fp8_rowwise's own beside --recipe's block
    assert {r["variant"] for r in rows if r["recipe"] == "rowwise"} == {
        "fp8_rowwise",
        "fp8_rowwise_unfused_eager",
    }
    assert all(r["recompiles"] == 0 and r["tokens_per_s"] > 0 for r in decode.values())
    accuracy = {r["variant"]: r["calc_diff"] for r in rows if r["kind"] == "accuracy"}
    assert accuracy["bf16"] == 0 and 0 < accuracy["fp8"] < 1.15 * accuracy["fp8_unfused_eager"]
    # fp8_rowwise beside the block run: its own recipe's composition is its bound
    assert 0 < accuracy["fp8_rowwise"] < 1.15 * accuracy["fp8_rowwise_unfused_eager"]
    assert {r["recipe"] for r in rows if r["variant"] == "fp8_rowwise_unfused_eager"} == {"rowwise"}
    # fp8 over the bf16 anchor with the same attention rewrite; a ratio needs both of its variants
    table = model_table(rows)
    assert "fp8_ro/bf16_gqa_ro" in table and "fp8_ro/bf16_inductor_ro" not in table
    assert "fp8_rowwise/fp8" in table
    assert (tmp_path / "bench_model.json").exists()
    # the table after every variant, so that a run cut off by a time limit still shows its rows
    assert capsys.readouterr().out.count("decode tokens/s (ms/step)") == 6


def test_bench_model_cut_off_mid_variant_keeps_every_point_it_measured_on_disk(tmp_path, monkeypatch):
    import fp8compile.bench.model as model_bench

    measured = model_bench.decode

    def killed_at_the_second_batch(subject, variant, batch, *args):
        if batch == 2:  # as a time limit's kill would land: after the first point, mid-variant
            raise KeyboardInterrupt
        return measured(subject, variant, batch, *args)

    monkeypatch.setattr(model_bench, "decode", killed_at_the_second_batch)
    with pytest.raises(KeyboardInterrupt):
        model_bench.bench_model(
            tmp_path, **dict(TINY_BENCH, batches=[1, 2]), variants=["fp8"], repeat=1, prefill_batches=[1]
        )
    kept = json.loads((tmp_path / "bench_model.json").read_text())
    assert {(r["kind"], r.get("batch")) for r in kept if r["variant"] == "fp8"} >= {
        ("prefill", 1),
        ("decode", 1),
    }
    assert not [r for r in kept if r["kind"] == "decode" and r["batch"] == 2]


def test_bench_model_isolate_runs_each_variant_in_a_process_of_its_own_and_tables_them_as_one_run(
    tmp_path, capsys
):
    from fp8compile.bench.model import bench_model
    from fp8compile.bench.table import model_table

    rows = bench_model(
        tmp_path, **TINY_BENCH, variants=["bf16", "fp8"], repeat=1, prefill_batches=[1], isolate=True
    )
    # each process wrote its own rows where its name says; the run's are theirs, merged
    for name in ("bf16", "fp8"):
        own = json.loads((tmp_path / name / "bench_model.json").read_text())
        assert {r["variant"] for r in own if r["kind"] == "decode"} == {name}
    assert json.loads((tmp_path / "bench_model.json").read_text()) == rows
    decode = {r["variant"]: r for r in rows if r["kind"] == "decode"}
    assert set(decode) == {"bf16", "fp8"} and {decode[n]["process"] for n in decode} == {"bf16", "fp8"}
    # both processes computed the composition alike: it is kept once, and bounds the fp8 row
    (unfused,) = [r for r in rows if r["variant"] == "fp8_unfused_eager"]
    (fp8,) = [r for r in rows if r["variant"] == "fp8" and r["kind"] == "accuracy"]
    assert 0 < fp8["calc_diff"] < 1.15 * unfused["calc_diff"]
    assert model_table(rows) in capsys.readouterr().out  # one table of both


def test_bench_model_lean_variants_decode_through_the_lean_loop_and_each_point_has_its_read_bytes(tmp_path):
    from fp8compile.bench.model import bench_model
    from fp8compile.bench.table import model_table

    rows = bench_model(
        tmp_path, **TINY_BENCH, variants=["fp8_ro", "fp8_ro_lean"], repeat=1, prefill_batches=[1]
    )
    decode = {r["variant"]: r for r in rows if r["kind"] == "decode"}
    assert set(decode) == {"fp8_ro", "fp8_ro_lean"}
    assert decode["fp8_ro_lean"]["recompiles"] == 0 and decode["fp8_ro_lean"]["tokens_per_s"] > 0
    # the same model and batch: the same bytes to read, whichever loop decodes
    assert decode["fp8_ro_lean"]["step_read_gb"] == decode["fp8_ro"]["step_read_gb"] > 0
    assert "fp8_ro_lean/fp8_ro" in model_table(rows)


def test_a_decode_steps_read_bytes_count_fp8_linears_at_a_byte_and_sliding_windows_at_their_width():
    from fp8compile.bench.limits import kv_bytes, step_bytes

    model = architectures.build("mistral")  # every layer a 16-token window
    config = model.config
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    other = sum(
        p.numel()
        for n, p in model.named_parameters()
        if "proj" not in n and "lm_head" not in n and "embed" not in n
    )
    bf16 = step_bytes(model, batch=2, context=100, fp8=False)
    fp8 = step_bytes(model, batch=2, context=100, fp8=True)
    embedding_rows = 2 * config.hidden_size * 2
    assert bf16["weights_gb"] * 1e9 == pytest.approx(2 * linears + 2 * other + embedding_rows)
    scales = fp8["weights_gb"] * 1e9 - (linears + 2 * other + embedding_rows)
    assert 0 < scales < linears / 128 / 128 * 4 * 2  # fp32 block scales, blocks rounded up
    # keys and values of 2 layers x 2 KV heads x 64 dims, in bf16: the window's positions, not 100
    assert bf16["kv_gb"] * 1e9 == pytest.approx(kv_bytes(model, 2, 100)) == 2 * 2 * 2 * 16 * 2 * 64 * 2
    config.sliding_window = None
    assert kv_bytes(model, 2, 100) == 2 * 2 * 2 * 100 * 2 * 64 * 2


def test_a_tied_lm_head_is_read_whole_beside_the_embeddings_looked_up_rows():
    # Gemma's, and every model with tie_word_embeddings: one parameter, two reads a step.
    from fp8compile.bench.limits import step_bytes

    model = architectures.build("mistral")
    model.lm_head.weight = model.model.embed_tokens.weight
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    other = sum(
        p.numel()
        for n, p in model.named_parameters()
        if "proj" not in n and "lm_head" not in n and "embed" not in n
    )
    embedding_rows = 2 * model.config.hidden_size * 2
    bf16 = step_bytes(model, batch=2, context=100, fp8=False)
    assert bf16["weights_gb"] * 1e9 == pytest.approx(2 * linears + 2 * other + embedding_rows)
    assert linears > model.lm_head.weight.numel() > 0  # the tied weight among the linears


def test_a_sharded_steps_limit_adds_its_all_reduces_each_at_its_time_alone():
    """Under tensor parallelism a step cannot take less than its reads plus its all-reduces (the
    issue's limit for TP): the row says both, and the table prints the second beside the first."""
    from fp8compile.bench.limits import limit_columns
    from fp8compile.bench.table import model_table

    base = dict(device="cpu", model="tiny-llama", layers=8, recipe="block", tp=4, dtype="bfloat16")
    row = dict(base, variant="fp8_ro_lean", kind="decode", batch=1, ms_per_step=9.0, recompiles=0)
    row["tokens_per_s"] = 1e3 / 9.0
    # 18 GB at 4.5 TB/s: 4 ms of reading; 160 all-reduces of 7.5 us: 1.2 ms
    limit_columns(row, dict(weights_gb=17.5, kv_gb=0.5), 4.5, all_reduces_ms=1.2)
    assert row["read_limit_ms"] == pytest.approx(4.0)
    assert row["limit_with_all_reduces_ms"] == pytest.approx(5.2)
    assert row["wall_of_limit"] == pytest.approx(4.0 / 9.0)
    assert row["wall_of_limit_with_all_reduces"] == pytest.approx(5.2 / 9.0)
    table = model_table([row])
    assert "and with the step's all-reduces" in table
    assert [line.split() for line in table.splitlines() if line.startswith("fp8_ro_lean")][-1] == [
        "fp8_ro_lean",
        "B=1",
        "1.20",
        "5.20",
        "58%",
    ]

    unsharded = dict(row)
    for key in ("all_reduces_ms", "limit_with_all_reduces_ms", "wall_of_limit_with_all_reduces"):
        del unsharded[key]
    limit_columns(unsharded, dict(weights_gb=17.5, kv_gb=0.5), 4.5)
    assert "limit_with_all_reduces_ms" not in unsharded
    assert "all-reduces" not in model_table([unsharded])


def test_bench_model_repeats_each_point_profiles_it_and_prefills_each_batch(tmp_path):
    # The measurement options on one variant (every variant runs them the same way).
    from fp8compile.bench.model import bench_model
    from fp8compile.bench.table import model_table

    rows = bench_model(
        tmp_path, **TINY_BENCH, variants=["fp8"], profile=True, repeat=2, prefill_batches=[1, 2]
    )
    (decode,) = [r for r in rows if r["kind"] == "decode"]
    # each decode point is the median of `repeat` timed generate() calls, every one kept
    assert len(decode["ms_per_step_runs"]) == 2
    assert decode["ms_per_step"] == statistics.median(decode["ms_per_step_runs"])
    prefill = {r["batch"]: r for r in rows if r["kind"] == "prefill" and r["variant"] == "fp8"}
    assert set(prefill) == {1, 2}
    tokens = TINY_BENCH["prefill"]
    assert all(r["tokens_per_s"] == r["batch"] * tokens * 1e3 / r["ms"] for r in prefill.values())
    # each prefill the median of five calls, every one kept
    for r in prefill.values():
        assert len(r["ms_runs"]) == 5 and r["ms"] == statistics.median(r["ms_runs"])
    assert "2x prefill" in model_table(rows)
    assert (
        "generate" in (tmp_path / "profile_tiny-llama_fp8_b2.txt").read_text()
    )  # --profile: host time by function
    assert "step" in (tmp_path / "profile_tiny-llama_fp8_prefill.txt").read_text()  # and of one prefill


def test_bench_model_with_no_decode_steps_bounds_a_moe_model_by_its_composition_and_prefills(
    tmp_path,
):
    # On a MoE model, which is read against its own unfused composition (its experts in FP8 too)
    # by the median token, as the architecture matrix reads it: its routing turns small
    # differences into other experts' outputs for a few tokens, which dominate the pooled number.
    from fp8compile.bench.model import bench_model
    from fp8compile.bench.table import model_table

    options = dict(TINY_BENCH, models=["tiny-mixtral"], steps=0)
    rows = bench_model(tmp_path, **options, variants=["bf16_inductor", "fp8"], repeat=1, prefill_batches=[1])
    assert {(r["variant"], r["kind"]) for r in rows} == {
        ("fp8_unfused_eager", "accuracy"),
        ("bf16_inductor", "accuracy"),
        ("bf16_inductor", "prefill"),
        ("fp8", "accuracy"),
        ("fp8", "prefill"),
    }
    fp8, unfused = (
        {r["variant"]: r for r in rows if r["kind"] == "accuracy"}[v] for v in ("fp8", "fp8_unfused_eager")
    )
    assert 0 < fp8["median_calc_diff"] <= architectures.BOUND_FACTOR * unfused["median_calc_diff"]
    assert fp8["calc_diff"] <= architectures.POOLED_FACTOR * unfused["calc_diff"]
    assert "fp8/bf16_inductor" in model_table(rows)
    with pytest.raises(ValueError, match="steps is a number of decode steps, 0 for none"):
        bench_model(tmp_path, **dict(TINY_BENCH, steps=-1), variants=["bf16"])


def test_bench_model_one_off_ab_switches_are_fp8_variants_with_one_option_not_variants_of_their_own():
    from fp8compile.bench.variants import VARIANTS, make_variant

    for gone in ("fp8_inline_conds", "fp8_sdpa", "fp8_ro_sdpa", "fp8_op_launch", "fp8_ro_repeat_kv"):
        assert gone not in VARIANTS
        with pytest.raises(ValueError, match="unknown variant"):
            make_variant(gone)
    for name, plain, mode, option in (
        ("fp8+inline_conds=true", "fp8", None, dict(inline_conds=True)),
        ("fp8_ro+split_kv=false", "fp8_ro", "reduce-overhead", dict(split_kv=False)),
        ("fp8+inductor_launch=false", "fp8", None, dict(inductor_launch=False)),
        (
            "fp8_ro+fusions=moe,gate_up,qkv,silu_mul",
            "fp8_ro",
            "reduce-overhead",
            dict(fusions=("moe", "gate_up", "qkv", "silu_mul")),
        ),
    ):
        ab, base = make_variant(name, "rowwise"), make_variant(plain, "rowwise")
        assert ab.mode == base.mode == mode and ab.name == name
        assert ab.backend.config == dataclasses.replace(base.backend.config, **option)
        assert ab.backend.config != base.backend.config


def test_bench_model_variant_options_run_the_named_variant_with_those_config_options():
    from fp8compile.bench.variants import make_variant

    tuned = make_variant("fp8_ro+large_m=1536+backends=cublas,deep_gemm,triton_small_m", "rowwise")
    plain = make_variant("fp8_ro", "rowwise")
    assert tuned.name == "fp8_ro+large_m=1536+backends=cublas,deep_gemm,triton_small_m"
    assert tuned.mode == plain.mode == "reduce-overhead"
    assert tuned.backend.config == plain.backend.config.replace(
        large_m=1536, backends=("cublas", "deep_gemm", "triton_small_m")
    )


def test_bench_model_runs_a_variant_under_its_inductor_options_and_puts_the_config_back(
    tmp_path, monkeypatch
):
    """What each variant's prefill and decode see of torch._inductor.config: its own
    +inductor.KEY=VALUE, then the process's as it was, for the next variant and after the run.
    (The measurements stand in: nothing compiles here.)"""
    import torch._inductor.config as inductor_config

    from fp8compile.bench import model as model_bench

    seen = []

    def prefill_and_accuracy(subject, variant, *args):
        seen.append((variant.name, "prefill", inductor_config.combo_kernel_max_num_nodes))
        return []

    def decode(subject, variant, batch, *args):
        seen.append((variant.name, "decode", inductor_config.combo_kernel_max_num_nodes))
        return dict(kind="decode", batch=batch, tokens_per_s=1.0, ms_per_step=1.0)

    monkeypatch.setattr(model_bench, "prefill_and_accuracy", prefill_and_accuracy)
    monkeypatch.setattr(model_bench, "decode", decode)
    before = inductor_config.combo_kernel_max_num_nodes
    ab = "bf16_inductor+inductor.combo_kernel_max_num_nodes=3"
    model_bench.bench_model(tmp_path, **TINY_BENCH, variants=[ab, "bf16_inductor"], repeat=1)
    assert seen == [
        (ab, "prefill", 3),
        (ab, "decode", 3),
        ("bf16_inductor", "prefill", before),
        ("bf16_inductor", "decode", before),
    ]
    assert inductor_config.combo_kernel_max_num_nodes == before


def test_bench_model_inductor_options_set_inductors_config_on_either_side():
    """+inductor.KEY=VALUE: an A/B of Inductor's own config, on bf16 and fp8 variants alike,
    typed as the entry's default; an entry Inductor lacks, a bad switch, or an eager variant is
    an error that says so."""
    from fp8compile.bench.variants import make_variant, split_variant

    for base in ("bf16_inductor_ro_lean", "fp8_ro_lean"):
        name = f"{base}+inductor.combo_kernels=true+inductor.combo_kernel_max_num_nodes=4"
        ab, plain = make_variant(name), make_variant(base)
        assert ab.name == name and ab.mode == plain.mode and ab.lean
        assert ab.inductor == {"combo_kernels": True, "combo_kernel_max_num_nodes": 4}
        assert plain.inductor == {}
        assert split_variant(name) == (base, {})
    both = make_variant("fp8_ro+split_kv=false+inductor.combo_kernels=false")
    assert both.inductor == {"combo_kernels": False} and both.backend.config.split_kv is False
    for bad, says in (
        ("fp8_ro+inductor.no_such_entry=1", "an entry of torch._inductor.config"),
        ("fp8_ro+inductor.combo_kernels=maybe", "takes true or false"),
        ("bf16+inductor.combo_kernels=true", "runs eagerly"),
    ):
        with pytest.raises(ValueError, match=says):
            make_variant(bad)


@pytest.mark.parametrize(
    "name, error",
    [
        ("bf16_inductor_ro+large_m=1536", "not an fp8 variant"),
        ("fp8+large=1536", "did you mean 'large_m'"),
        ("fp9_ro+large_m=1536", "unknown variant 'fp9_ro'"),
    ],
)
def test_the_command_line_refuses_a_variant_option_it_cannot_apply_in_words(name, error, capsys):
    from fp8compile.__main__ import main

    with pytest.raises(SystemExit):
        main(["bench", "model", "--variant", name])
    assert error in capsys.readouterr().err


def test_bench_model_table_puts_a_variant_with_options_beside_the_variant_it_changes():
    from fp8compile.bench.table import model_table

    base = dict(model="llama", layers=2, device="H200", tp=1)
    rows = [
        dict(base, variant=v, kind="decode", batch=1, tokens_per_s=tps, ms_per_step=1e3 / tps, recompiles=0)
        for v, tps in (("fp8_ro", 200.0), ("fp8_ro+large_m=1536", 250.0))
    ]
    table = model_table(rows)
    assert "fp8_ro+large_m=1536/fp8_ro" in table
    assert "1.25" in table.split("fp8_ro+large_m=1536/fp8_ro")[1]


@pytest.mark.parametrize(
    "names, recipe, recipes",
    [
        (["bf16", "fp8", "fp8_ro"], "block", ["block"]),
        (["fp8_ro", "fp8_rowwise_ro+fast_accum=false", "torchao_rowwise_ro"], "block", ["block", "rowwise"]),
        (["fp8+recipe=tensor", "bf16_inductor"], "rowwise", ["rowwise", "tensor"]),
    ],
)
def test_bench_model_bounds_each_recipe_it_runs_by_that_recipes_composition(names, recipe, recipes):
    from fp8compile.bench.variants import composition_recipes

    assert composition_recipes(names, recipe) == recipes


def test_bench_model_table_shows_no_warm_peak_where_no_decode_ran():
    """`--steps 0` measures accuracy and prefill only: its memory row has no decode peak, and the
    table says so with a dash, not a 0.0 GB that reads as a measurement."""
    from fp8compile.bench.table import model_table

    base = dict(model="llama", layers=2, device="H100", tp=1, variant="fp8_ro")
    rows = [
        dict(base, kind="prefill", batch=1, tokens=2048, ms=10.0, tokens_per_s=204800.0),
        dict(base, kind="memory", warm_peak_gb=None, peak_gb=26.5),
    ]
    row = next(line for line in model_table(rows).splitlines() if line.startswith("fp8_ro "))
    assert row.split()[3:5] == ["26.5", "-"]  # prefill, first call, peak, warm peak


def test_bench_model_rowwise_variants_run_the_rowwise_recipe_beside_the_block_one_in_one_run():
    from fp8compile.bench.variants import make_variant

    block, rowwise, rowwise_ro = (
        make_variant("fp8", "block"),
        make_variant("fp8_rowwise"),
        make_variant("fp8_rowwise_ro"),
    )
    assert block.backend.config.recipe == "block"
    assert rowwise.backend.config.recipe == rowwise_ro.backend.config.recipe == "rowwise"
    assert rowwise.mode is None and rowwise_ro.mode == "reduce-overhead"
    assert dataclasses.replace(rowwise.backend.config, recipe="block") == block.backend.config


def test_bench_model_counts_gpu_idle_time_between_the_kernels_it_falls_between():
    from fp8compile.bench.gpu_time import idle_spans

    spans = [  # us; the third overlaps the second, so the GPU is busy from 10 to 40
        (0.0, 10.0, "a"),
        (10.0, 30.0, "b"),
        (25.0, 40.0, "c"),
        (1040.0, 1050.0, "a"),  # 1 ms idle after c
        (1060.0, 1070.0, "b"),  # 10 us idle after a
        (1070.0, 1075.0, "c"),
        (2075.0, 2080.0, "a"),  # 1 ms idle after c again
    ]
    assert idle_spans(reversed(spans)) == [
        (40.0, 1040.0, "c -> a"),
        (1050.0, 1060.0, "a -> b"),
        (1075.0, 2075.0, "c -> a"),
    ]
    assert idle_spans([]) == []


def test_bench_model_profile_counts_a_kernel_once_not_again_for_the_annotation_drawn_over_it():
    from fp8compile.bench.gpu_time import GpuProfile, gpu_activities, summary

    # NCCL's kernel and the "nccl:all_reduce" range its record_function draws over it on the GPU
    events = [
        (20.0, 30.0, "ncclDevKernel_AllReduce", False),
        (0.0, 10.0, "_linear_small_m_kernel", False),
        (19.0, 31.0, "nccl:all_reduce", True),
    ]
    activities = gpu_activities(events)
    assert activities == [(0.0, 10.0, "_linear_small_m_kernel"), (20.0, 30.0, "ncclDevKernel_AllReduce")]
    part = summary(GpuProfile(activities, host=[]))
    assert part["kernels"] == {"_linear_small_m_kernel": 0.01, "ncclDevKernel_AllReduce": 0.01}
    assert part["idle"] == {"_linear_small_m_kernel -> ncclDevKernel_AllReduce": 0.01}


def test_bench_model_owns_a_gap_between_queued_kernels_to_the_boundary_not_to_the_hosts_python():
    """The GPU idles a microsecond between two kernels of one CUDA graph whatever the host does
    meanwhile: such gaps are the kernel boundaries'; a longer one is owned by the host's work."""
    from fp8compile.bench.gpu_time import BOUNDARY, CALLER, GpuProfile, summary

    activities = [(0.0, 10.0, "a"), (11.0, 20.0, "b"), (21.0, 30.0, "c"), (130.0, 140.0, "a")]
    host = [(0.0, 200.0, "the caller's loop", 1)]  # no owner in its name: the caller's Python
    part = summary(GpuProfile(activities, host))
    assert part["owners"] == pytest.approx({BOUNDARY: 0.002, CALLER: 0.1})
    assert sum(part["idle"].values()) == pytest.approx(0.102)


def test_bench_model_profile_takes_the_steps_after_the_prompt_not_the_prompts_collective_waits():
    """A sharded prompt's all-reduces wait on the slower rank for as long as the ranks' eager
    Python differs: another time in each call. The steps' part is what follows the prompt's own
    activities in the whole call, so none of that wait lands in it (subtracting the prompt-only
    call's times left it there)."""
    from fp8compile.bench.gpu_time import GpuProfile, decode_steps

    def prompt(nccl_us):  # the prompt: a linear, then an all-reduce that waited nccl_us
        return [(0.0, 10.0, "linear"), (10.0, 10.0 + nccl_us, "nccl")]

    step = [(0.0, 8.0, "linear"), (8.0, 10.0, "one_shot")]
    steps = [(1000.0 + 20 * i + s, 1000.0 + 20 * i + e, n) for i in range(4) for s, e, n in step]
    alone = GpuProfile(prompt(nccl_us=50.0), host=[])
    whole = GpuProfile(prompt(nccl_us=450.0) + steps, host=[])
    part, method = decode_steps(whole, alone, steps=4)
    assert method == "window"
    assert part["kernels"] == {"linear": 0.008, "one_shot": 0.002}  # ms a step
    assert part["calls"] == {"linear": 1, "one_shot": 1}
    # over 4 steps: the gap from the prompt's end (460 us) to the first step (1000 us), and the
    # 10 us after each step but the last
    idle_ms = {"nccl -> linear": 540 / 4 / 1e3, "one_shot -> linear": 30 / 4 / 1e3}
    assert part["idle"] == pytest.approx(idle_ms)

    # a whole call that does not begin with the prompt's kernels: the prompt-only call's subtracted
    other = GpuProfile([(0.0, 10.0, "linear"), (10.0, 20.0, "copy")] + steps, host=[])
    part, method = decode_steps(other, alone, steps=4)
    assert method == "subtracted"
    assert part["kernels"]["one_shot"] == pytest.approx(0.002)


def test_bench_model_profiles_a_sharded_step_only_once_every_rank_is_there(monkeypatch):
    """A rank that starts a profiled call before its peer times its first collective's wait as
    GPU work (bench/gpu_time.py, meet_ranks): under torch.distributed the ranks meet first."""
    import torch.distributed as dist

    from fp8compile.bench import gpu_time

    met = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: met.append("barrier"))
    gpu_time.meet_ranks()
    assert met == []  # one process: nothing to meet
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        gpu_time.meet_ranks()
    finally:
        dist.destroy_process_group()
    assert met == ["barrier"]


def test_bench_model_profile_names_each_top_kernels_launches_per_step():
    from fp8compile.bench.gpu_time import kernel_split
    from fp8compile.bench.table import model_table

    # 32 steps of an 8-layer model: the attention ran once a layer, the linear four times
    row = dict(
        device="cpu",
        model="tiny-llama",
        layers=8,
        variant="fp8_ro_lean",
        kind="decode",
        batch=16,
        recompiles=0,
    )
    row.update(tokens_per_s=12500.0, ms_per_step=1.28)
    kernel_split(
        row,
        {"_gqa_decode_kernel": 32 * 0.30, "_linear_small_m_kernel": 32 * 0.80},
        32,
        {"_gqa_decode_kernel": 32 * 8, "_linear_small_m_kernel": 32 * 32},
    )
    assert row["top_kernels_ms_per_step"] == [
        ["_linear_small_m_kernel", "linear", 0.80, 32.0],
        ["_gqa_decode_kernel", "attention", 0.30, 8.0],
    ]
    assert "_gqa_decode_kernel (attention) 0.300 x8" in model_table([row])
    assert "less a prompt-only call's" not in model_table([row])
    # a profile whose whole call did not begin with the prompt's kernels says how it was split
    assert "less a prompt-only call's" in model_table([dict(row, gpu_profile_steps="subtracted")])
    # rows written before launches were counted still table
    row["top_kernels_ms_per_step"] = [entry[:3] for entry in row["top_kernels_ms_per_step"]]
    assert "_gqa_decode_kernel (attention) 0.300;" in model_table([row]) + ";"


def test_bench_model_gives_gpu_idle_time_to_the_innermost_host_range_that_names_an_owner():
    from fp8compile.bench.gpu_time import CALLER, host_owners

    gaps = [(100.0, 200.0), (300.0, 320.0)]  # us the GPU idles
    ranges = [  # (start, end, name, thread): the launching thread, and a compile worker's range
        (90.0, 150.0, "aten::copy_", 1),  # the caller's own op: no owner in its name
        (150.0, 400.0, "Torch-Compiled Region: 0/1", 1),
        (170.0, 190.0, "## Call CompiledFxGraph abc ##", 1),
        (175.0, 185.0, "cudaMemcpyAsync", 1),  # inside the wrapper: the wrapper's
        (305.0, 315.0, "cudaGraphLaunch", 1),
        (0.0, 1000.0, "a worker's long range", 2),
    ]
    owners, names = host_owners(gaps, ranges)
    assert owners == pytest.approx(
        {
            CALLER: 0.05,
            "dynamo (frame and guards)": 0.03 + 0.01,
            "compiled graph's wrappers": 0.02,
            "cuda-graph replay": 0.01,
        }
    )
    assert names["cudaMemcpyAsync"] == pytest.approx(0.01)
    assert sum(names.values()) == pytest.approx(0.12)


def test_bench_model_splits_gpu_time_by_kernel_kind_attention_and_experts_before_gemm_names():
    from fp8compile.bench.gpu_time import kernel_kind

    kinds = {
        name: kernel_kind(name)
        for name in (
            "nvjet_tst_128x64_64x4_1x1_v_bz_coopA_TNT",
            "_linear_small_m_kernel",
            "_quant_act_kernel",
            "_scaled_small_m_kernel",
            "_quant_rows_kernel",
            "fmha_cutlassF_bf16_aligned_64x128_rf_sm80",
            "pytorch_flash::flash_fwd_kernel",
            "_gqa_decode_kernel",
            "triton_red_fused_add_mean_mul_pow_rsqrt_0",
            "_moe_gemm_kernel",
            "cutlass::Kernel2<cutlass_sm90_grouped_gemm_bf16>",
            "ncclDevKernel_AllReduce_Sum_bf16_RING_LL",
            "void c10d::symmetric_memory::one_shot_all_reduce_kernel<c10::BFloat16, 16, 2>",
        )
    }
    assert kinds == {
        "nvjet_tst_128x64_64x4_1x1_v_bz_coopA_TNT": "linear",
        "_linear_small_m_kernel": "linear",
        "_quant_act_kernel": "linear",
        "_scaled_small_m_kernel": "linear",  # the scaled recipes' decode kernel
        "_quant_rows_kernel": "linear",  # their per-token quantization before cuBLAS
        "fmha_cutlassF_bf16_aligned_64x128_rf_sm80": "attention",
        "pytorch_flash::flash_fwd_kernel": "attention",
        "_gqa_decode_kernel": "attention",
        "triton_red_fused_add_mean_mul_pow_rsqrt_0": "other",
        "_moe_gemm_kernel": "moe",
        "cutlass::Kernel2<cutlass_sm90_grouped_gemm_bf16>": "moe",
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL": "collective",  # a sharded step's all-reduce
        "void c10d::symmetric_memory::one_shot_all_reduce_kernel<c10::BFloat16, 16, 2>": "collective",
    }


def test_the_report_names_the_model_input_that_keeps_a_graph_from_cuda_graphs():
    from fp8compile.backend import _cuda_graph_state

    class Compiled:
        device_types = {"cuda"}
        disabled_cudagraphs_reason = "skipping cudagraphs due to cpu device (arg3_1)"

    state = _cuda_graph_state(
        True,
        False,
        Compiled(),
        "reduce-overhead",
        {"arg3_1": "model.layers.0.input_layernorm.variance_epsilon", "arg13_1": "lm_head.weight"},
    )
    assert state == (
        "off: Inductor skipped them: skipping cudagraphs due to cpu device "
        "(arg3_1 = model.layers.0.input_layernorm.variance_epsilon)"
    )


def test_the_report_says_how_to_keep_transformers_static_cache_counter_off_the_cpu():
    from fp8compile.backend import _cuda_graph_state

    class Compiled:
        device_types = {"cuda"}
        disabled_cudagraphs_reason = "skipping cudagraphs due to cpu device (arg5_1)"

    state = _cuda_graph_state(
        True, False, Compiled(), "reduce-overhead", {"arg5_1": "past_key_values.layers.0.cumulative_length"}
    )
    assert "(arg5_1 = past_key_values.layers.0.cumulative_length)" in state
    assert "early_initialization" in state and "past_key_values" in state.split("(transformers'")[1]
    Compiled.disabled_cudagraphs_reason = "skipping cudagraphs due to cpu device (arg3_1)"
    other = _cuda_graph_state(True, False, Compiled(), "reduce-overhead", {"arg3_1": "model.norm.eps"})
    assert "early_initialization" not in other  # the hint is for the cache's counter only


def test_bench_model_static_cache_is_made_before_the_first_call_and_marked_static():
    from fp8compile.bench.presets import build
    from fp8compile.bench.decode import static_cache

    model = build("tiny-llama", 1, "cpu")
    cache = static_cache(model, 3, 20, "cpu")
    layer = cache.layers[0]
    assert layer.is_initialized and layer.keys.shape == (3, 2, 20, 64)
    # Dynamo takes tensors marked here as static addresses: CUDA graphs need not copy them per call
    assert all(
        getattr(t, "_dynamo_static_input_type", None)
        for t in (layer.keys, layer.values, layer.cumulative_length)
    )


def test_generate_with_a_cache_made_before_the_call_builds_the_m_dispatch_when_dynamo_passes_the_batch_twice(
    ranged_references,
):
    # A user's own compile of model.forward, with the StaticCache made and initialized before
    # generate() (how CUDA graphs stay on, bench.model.static_cache): Dynamo passes the batch
    # symbol twice, once for the token ids and once for the cache tensors marked as static
    # addresses, and the branches of the M dispatch must get the one the graph reads (the other
    # fails in Inductor's codegen, "expected [s16] to have been codegen-ed", here as on the GPU).
    from fp8compile.bench.decode import static_cache

    model = small_llama(layers=1)
    model.generation_config.eos_token_id = None
    backend = CountingBackend(backends=ranged_references, **RANGES)
    model.forward = torch.compile(model.forward, backend=backend, mode="reduce-overhead")
    with torch.no_grad():
        for batch in (1, 16):
            ids = torch.randint(0, 32000, (batch, 12))
            cache = static_cache(model, batch, 24, "cpu")

            def generate():
                cache.reset()
                return model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=8,
                    do_sample=False,
                    past_key_values=cache,
                    disable_compile=True,
                )

            first = generate()
            warm = backend.compiles
            assert torch.equal(generate(), first) and backend.compiles == warm, f"batch {batch}: recompiled"
    assert {"ref_small", "ref_medium"} <= {k for r in backend.report.rewrites for _, k in r.kernels}


@pytest.mark.parametrize(
    "name, feature",
    [
        ("mistral-7b-v0.1", lambda c: c.sliding_window == 4096),
        ("gemma-2-9b", lambda c: c.sliding_window == 4096 and c.final_logit_softcapping == 30.0),
        ("gemma-3-12b", lambda c: c.sliding_window == 1024 and "full_attention" in c.layer_types),
        ("phi-3-medium", lambda c: c.num_key_value_heads == 10),
        ("mixtral-8x7b", lambda c: (c.num_local_experts, c.num_experts_per_tok) == (8, 2)),
        ("qwen3-8b", lambda c: c.head_dim == 128),
    ],
)
def test_bench_model_builds_each_family_at_its_real_widths(name, feature):
    # On the meta device: the real widths, the family's own attention or layout, no memory.
    from fp8compile.bench.presets import MODELS, build

    model = build(name, layers=6, device="meta")  # Gemma-3: the sixth layer is its first global one
    config = model.config
    assert config.hidden_size == MODELS[name][2]["hidden_size"] and config.num_hidden_layers == 6
    assert feature(config)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_a_sliding_window_decode_at_a_second_batch_size_gets_one_kernel_for_every_m_and_no_cond(captured):
    # transformers' sliding-window static cache passes its position to the decode step as an int
    # that moves every step; under CUDA graphs, a graph with torch.conds would be recorded again
    # at every step (tests/test_gpu_models.py counts the recordings on a GPU). Here, on the CPU:
    # the int still reaches the graph, and that graph's call sites get no cond.
    import transformers
    from transformers.generation.configuration_utils import CompileConfig

    config = transformers.MistralConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        sliding_window=4096,
    )
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    backend = CountingBackend()
    compile_config = CompileConfig(backend=backend, mode="reduce-overhead")
    compile_config._compile_all_devices = True  # transformers compiles generate() on GPUs only otherwise
    with torch.no_grad():
        for batch in (2, 3):  # the second batch size makes the batch dynamic
            ids = torch.randint(0, 1024, (batch, 8))
            tokens, _ = _generate(model, ids, 4, compile_config=compile_config)
            assert tokens.shape == (batch, 12)
    moving = [r for r in backend.report.rewrites if r.m == "dynamic"]
    assert moving and all(
        r.kernels == (("all M (no cond: an int input moves every call)", "reference"),) for r in moving
    )
    assert all(graph.count(torch.ops.higher_order.cond) == 0 for graph in captured)
