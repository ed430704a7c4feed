"""The backend as a user meets it: backend="fp8" by entry point, options, explain, debug_dir,
and the promises about the eager model and its weights."""

import functools
import gc
import math
import operator
import os
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

import fp8compile
from fp8compile import registry, weights
from fp8compile.ops.quant import reference as quant_reference
from tests.conftest import BF16, GATED_MLP, ONE_GEMM, TWO_GEMMS, randn
from tests.models import GatedMLP, OddDims


def test_backend_name_fp8_works_in_a_fresh_process_without_importing_fp8compile():
    script = textwrap.dedent("""
        import sys, torch
        model = torch.nn.Linear(256, 256).to(torch.bfloat16)
        x = torch.randn(8, 256, dtype=torch.bfloat16)
        with torch.no_grad():
            out = torch.compile(model, backend="fp8")(x)
            assert "fp8compile" in sys.modules  # loaded by torch through the entry point
            import fp8compile
            print(fp8compile.last_report().counts()["linear"], fp8compile.calc_diff(out, model(x)) < 1e-3)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["1", "True"]


def test_options_reach_the_config():
    model = torch.nn.Linear(256, 256).to(BF16)
    with torch.no_grad():
        torch.compile(model, backend="fp8", options={"e8m0": True, "small_m": 16})(randn(8, 256))
    config = fp8compile.last_report().config
    assert (config.e8m0, config.small_m) == (True, 16)


def test_bad_option_fails_compilation_with_the_valid_choices():
    model = torch.nn.Linear(256, 256).to(BF16)
    with pytest.raises(Exception, match="valid options: recipe, e8m0, batch_invariant, small_m"):
        torch.compile(model, backend="fp8", options={"e8m": True})(randn(8, 256))


def test_backend_accepts_a_config_object():
    fp8 = fp8compile.backend(fp8compile.Fp8Config(e8m0=True), small_m=4)
    assert (fp8.config.e8m0, fp8.config.small_m) == (True, 4)


def test_eager_model_is_bitwise_untouched_by_compiling_and_running():
    model = GatedMLP().to(BF16)
    x = randn(10, 256)
    before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    with torch.no_grad():
        eager_before = model(x)
        compiled = torch.compile(model, backend="fp8")
        compiled(x)
        compiled(randn(50, 256))
        eager_after = model(x)
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, (ptr, value) in before.items():
        assert after[k].data_ptr() == ptr and after[k].dtype == BF16
        assert torch.equal(after[k].view(torch.int16), value.view(torch.int16))
    assert torch.equal(eager_before, eager_after)


def test_weights_are_quantized_once_at_compile_time_not_per_call(monkeypatch, captured):
    calls = []
    real = weights._quantize
    monkeypatch.setattr(weights, "_quantize", lambda w, e8m0: calls.append(1) or real(w, e8m0))
    compiled = torch.compile(GatedMLP().to(BF16), backend="fp8")
    with torch.no_grad():
        for m in (40, 8, 300, 1):  # 1 recompiles (Dynamo specializes size 1): the memo serves it
            x = randn(m, 256)
            torch._dynamo.mark_dynamic(x, 0) if m > 1 else None
            compiled(x)
            if m == 40:
                assert len(calls) == 2  # gate|up stacked (one GEMM) and down, during the first compile
    assert len(calls) == 2
    assert len(captured) == 2
    for g in captured:  # the run-time graph quantizes no weight: it reads their FP8 copies as inputs
        assert g.ops(torch.ops.fp8compile.quant_weight.default) == []
        for node in g.ops(torch.ops.fp8compile.qlinear.default):
            assert node.args[1].op == "placeholder"


@pytest.mark.parametrize("n, k", [(1000, 300), (512, 256)])
@pytest.mark.parametrize("e8m0", [False, True])
def test_a_weight_quantized_in_slabs_of_whole_block_rows_has_the_bits_of_the_whole_at_once(
    n, k, e8m0, monkeypatch
):
    """Weights are quantized QUANT_CHUNK_ELEMENTS at a time (the fp32 temporaries of a slab, not of
    a whole lm_head), in whole 128-row blocks: the same FP8 values and scales as the reference
    over the whole weight, a partial last block row and a K of part of a group included."""
    w = randn(n, k)
    whole_fp8, whole_scale = quant_reference.quant_weight_block(w, e8m0)
    monkeypatch.setattr(weights, "QUANT_CHUNK_ELEMENTS", 2 * 128 * k)  # two block rows a slab
    slabs = []
    quant = torch.ops.fp8compile.quant_weight

    def counted(x, e8m0=False):
        slabs.append(x.shape[0])
        return quant(x, e8m0)

    monkeypatch.setattr(torch.ops.fp8compile, "quant_weight", counted)
    w_fp8, w_scale = weights._quantize(w, e8m0)
    assert slabs == [256] * (n // 256) + ([n % 256] if n % 256 else [])
    assert torch.equal(w_fp8.view(torch.uint8), whole_fp8.view(torch.uint8))
    assert torch.equal(w_scale, whole_scale)


def test_fp8_weights_are_graph_inputs_looked_up_only_when_the_parameters_passed_change(monkeypatch):
    """The compiled graph takes each weight's FP8 copy as an input of its own (static for CUDA
    graphs); per call the wrapper checks the parameters passed (identity and version) and asks the
    weight memo again only when one changed."""
    from fp8compile.derived import CallWithDerivedInputs
    from fp8compile.passes import linear as linear_pass_module

    lookups = []
    real = linear_pass_module.fp8_weight
    monkeypatch.setattr(linear_pass_module, "fp8_weight", lambda *a: lookups.append(a[0].shape) or real(*a))
    wrappers = []
    real_init = CallWithDerivedInputs.__init__
    monkeypatch.setattr(
        CallWithDerivedInputs, "__init__", lambda self, *a: wrappers.append(self) or real_init(self, *a)
    )
    model = GatedMLP().to(BF16)
    compiled = torch.compile(model, backend="fp8")
    x = randn(8, 256)
    with torch.no_grad():
        compiled(x)
        (wrapper,) = wrappers
        assert sorted(len(d.sources) for d in wrapper.derived) == [1, 2]  # down; gate|up stacked from two
        after_first = len(lookups)
        for _ in range(3):
            compiled(x)
        assert len(lookups) == after_first  # same parameters, same versions: nothing looked up
        model.down_proj.weight.mul_(2)
        assert fp8compile.calc_diff(compiled(x), model(x)) < GATED_MLP
        assert len(lookups) == after_first + 2  # one change: both copies asked for again (the memo makes one)


def test_the_derived_inputs_check_reads_inference_tensors_and_forgets_a_source_that_dies():
    """The per-call check compares the sources' ids and version counters: an inference tensor,
    which has no version counter, is still checked by identity; and when a source of the last
    call dies its derived values go with it, so that a new tensor given the dead one's id is
    never taken for it."""
    from fp8compile.derived import CallWithDerivedInputs, DerivedInput

    made = []
    wrapper = CallWithDerivedInputs(
        lambda full: full, [DerivedInput((0,), lambda w: made.append(w.sum().item()) or (w * 2,))], keep=[1]
    )
    with torch.inference_mode():
        w = torch.ones(4)
    x = torch.zeros(2)
    first = wrapper([w, x])
    assert first[0] is x and torch.equal(first[1], w * 2)
    assert wrapper([w, x])[1] is first[1] and len(made) == 1  # the same source: nothing made again
    w = torch.full((4,), 3.0)  # the inference tensor dies
    assert wrapper._last is None
    assert torch.equal(wrapper([w, x])[1], w * 2) and len(made) == 2


def test_compiled_model_follows_an_in_place_weight_change():
    model = GatedMLP().to(BF16)
    compiled = torch.compile(model, backend="fp8")
    x = randn(8, 256)
    with torch.no_grad():
        compiled(x)
        model.up_proj.weight.mul_(-3)
        assert fp8compile.calc_diff(compiled(x), model(x)) < GATED_MLP


def test_a_graph_reused_for_another_instance_uses_that_instances_weights():
    # Dynamo compiles Linear.forward once and reuses the graph for b (same class, same shapes):
    # the FP8 weights must follow the parameters passed in, not those seen at compile time.
    a, b = torch.nn.Linear(256, 256).to(BF16), torch.nn.Linear(256, 256).to(BF16)
    fp8 = fp8compile.backend()
    x = randn(8, 256)
    with torch.no_grad():
        out_a, out_b = torch.compile(a, backend=fp8)(x), torch.compile(b, backend=fp8)(x)
        assert fp8.report.graphs == 1
        assert fp8compile.calc_diff(out_a, a(x)) < 1e-3 and fp8compile.calc_diff(out_b, b(x)) < 1e-3


def test_drop_fp8_weights_frees_the_copies_once_the_graphs_are_reset_and_a_new_compile_makes_them_again():
    fp8compile.drop_fp8_weights()  # what other tests left
    model = GatedMLP().to(BF16)
    x = randn(8, 256)
    with torch.no_grad():
        first = torch.compile(model, backend="fp8")(x)
        w_fp8, _ = weights.fp8_weight(model.down_proj.weight)  # the memo's copy, the graph's input
        copy = weakref.ref(w_fp8)
        del w_fp8
        torch._dynamo.reset()
        assert copy() is not None  # the copies live as long as the parameters do
        assert fp8compile.drop_fp8_weights() == 2  # gate|up stacked, and down
        gc.collect()
        assert copy() is None
        again = torch.compile(model, backend="fp8")(x)
    assert torch.equal(again, first)


def test_a_compiled_model_keeps_running_after_drop_fp8_weights():
    model = GatedMLP().to(BF16)
    compiled = torch.compile(model, backend="fp8")
    x = randn(8, 256)
    with torch.no_grad():
        first = compiled(x)
        fp8compile.drop_fp8_weights()
        assert torch.equal(compiled(x), first)  # the graph's own inputs
        model.down_proj.weight.mul_(2)  # a changed parameter: quantized again, at its first use
        assert fp8compile.calc_diff(compiled(x), model(x)) < GATED_MLP


def test_explain_reports_rewrites_and_skips_with_reasons():
    report = fp8compile.explain(
        OddDims().to(BF16), randn(8, 256), randn(8, 200), randn(8, 64), skip=["nothing"]
    )
    assert report.counts() == {"linear": 2, "silu_mul": 0, "moe": 0, "attention": 0, "mqa_logits": 0}
    text = str(report)
    assert "2 rewritten, 2 left unchanged" in text
    assert "fits" in text and "M = 8: reference" in text
    assert "linear[K=200 padded to 256]  odd_k" in text
    assert "odd_n" in text and "N=100 is less than one 128-row weight block" in text
    assert "short_k" in text and "K=64 is less than one 128-wide activation group" in text


def test_debug_dir_gets_graphs_before_and_after_and_decompiled_code(tmp_path):
    model = GatedMLP().to(BF16)
    with torch.no_grad():
        torch.compile(model, backend=fp8compile.backend(debug_dir=str(tmp_path)))(randn(8, 256))
    files = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("graph_"))
    assert files == [
        "graph_000_aten_after.py",
        "graph_000_aten_before.py",
        "graph_000_diff.txt",
        "graph_000_dynamo.py",
    ]
    assert "torch.ops.fp8compile.qlinear" in (tmp_path / "graph_000_aten_after.py").read_text()
    assert "-mm = aten.mm" in (tmp_path / "graph_000_diff.txt").read_text()
    (code,) = [p for p in tmp_path.iterdir() if p.name.startswith("__transformed_code_")]
    assert "def " in code.read_text() and "could not decompile" not in code.read_text()


def test_debug_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8COMPILE_DEBUG_DIR", str(tmp_path / "dumps"))
    with torch.no_grad():
        torch.compile(torch.nn.Linear(256, 256).to(BF16), backend=fp8compile.backend())(randn(8, 256))
    assert (tmp_path / "dumps" / "graph_000_diff.txt").exists()


def test_import_does_not_touch_cuda_or_vendor_libraries():
    script = (
        "import sys, torch, fp8compile; vendors = ('deep_gemm', 'flashinfer', 'triton'); "
        "print(torch.cuda.is_initialized(), [m for m in vendors if m in sys.modules])"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False []", result.stderr[-2000:]


def test_backends_command_names_the_chosen_backend_and_why_not_the_others():
    result = subprocess.run(
        [sys.executable, "-m", "fp8compile", "backends", "-m", "1", "-n", "4096", "-k", "7168"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("backends for linear N=4096 K=7168 M=1")
    assert any("CHOSEN" in line for line in lines)
    assert any("cublas" in line and "fails below M = 8" in line for line in lines)


@pytest.mark.parametrize("argv", [["backends", "-m", "0"], ["bench", "host", "-m", "-3"]])
def test_the_command_line_refuses_an_m_below_one_token_in_words(argv, capsys):
    from fp8compile.__main__ import main

    with pytest.raises(SystemExit):
        main(argv)
    assert "M is a number of tokens, at least 1" in capsys.readouterr().err


def test_bench_gemm_and_tune_time_the_weight_shapes_the_command_line_names(monkeypatch):
    from fp8compile.__main__ import main
    from fp8compile.bench import gemm, tune

    asked = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        gemm, "bench_gemm", lambda out, shapes, ms, skip, warm_l2: asked.setdefault("gemm", shapes)
    )
    monkeypatch.setattr(tune, "tune", lambda out, shapes, kernels: asked.setdefault("tune", shapes))
    main(["bench", "gemm", "--shape", "6144x4096", "--shape", "28672X4096"])
    main(["bench", "tune", "--kernels", "small_m"])
    assert asked == {"gemm": [(6144, 4096), (28672, 4096)], "tune": gemm.SHAPES}


def test_bench_tune_gqa_decode_sweeps_the_attentions_launch_and_no_gemm(monkeypatch):
    from fp8compile.__main__ import main
    from fp8compile.bench import attention, tune

    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(attention, "tune_gqa_decode", lambda out: asked.append("gqa_decode"))
    monkeypatch.setattr(tune, "tune", lambda out, shapes, kernels: asked.append(kernels))
    main(["bench", "tune", "--kernels", "gqa_decode"])
    main(["bench", "tune", "--kernels", "gqa_decode", "small_m"])
    assert asked == ["gqa_decode", "gqa_decode", ["small_m"]]


def test_a_bench_list_option_takes_its_values_after_one_flag_or_after_several(monkeypatch):
    from fp8compile.__main__ import main
    from fp8compile.bench import gemm

    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        gemm, "bench_gemm", lambda out, shapes, ms, skip, warm_l2: asked.append((shapes, ms, skip, warm_l2))
    )
    main(["bench", "gemm", "-m", "1600", "1792", "-m", "2048", "--shape", "6144x4096", "4096x4096"])
    main(["bench", "gemm", "-m", "1600", "-m", "1792", "--skip", "deep_gemm", "cublas_fp8", "--warm-l2"])
    assert asked == [
        ([(6144, 4096), (4096, 4096)], [1600, 1792, 2048], (), False),
        (gemm.SHAPES, [1600, 1792], ["deep_gemm", "cublas_fp8"], True),
    ]


def test_the_gemm_table_says_whether_the_weights_were_cold_or_warm_in_l2():
    from fp8compile.bench.gemm import gemm_table

    row = dict(n=4096, k=4096, m=1, variant="fp8compile", us=8.5)
    assert "weights cold (copies cycled)" in gemm_table([dict(row, l2="cold")])
    assert "one weight copy, warm in L2" in gemm_table([dict(row, l2="warm")])


@pytest.mark.parametrize("shape", ["6144", "6144x4096x2", "0x4096", "ax4096"])
def test_the_command_line_refuses_a_shape_that_is_not_n_by_k_in_words(shape, capsys):
    from fp8compile.__main__ import main

    with pytest.raises(SystemExit):
        main(["bench", "gemm", "--shape", shape])
    err = capsys.readouterr().err
    assert "a weight shape is NxK" in err or "N and K are at least 1" in err


@pytest.mark.parametrize("k, declined", [(256, True), (896, True), (4864, True), (512, False), (7168, False)])
def test_cublas_declines_a_k_whose_weight_scale_columns_it_misreads(k, declined, monkeypatch):
    # K/128 not a multiple of 4: torch._scaled_mm's block scaling returned calc_diff 0.09-1.0 or
    # NaN with no error on an H100 (tests/test_gpu.py holds every backend that serves to the product).
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100
    request = registry.Request("linear", torch.device("cuda"), 512, k, 128, 128)
    why = registry.why_not("cublas", request) or ""
    assert (f"K={k} is {k // 128} groups of 128, not a multiple of 4" in why) == declined


def test_on_a_blackwell_gpu_the_vendors_block_scaled_gemms_give_way_to_our_triton_kernels(monkeypatch):
    # Their sm_100 forms read other scale formats than the fp32 scales measured on sm_90.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))  # a B200
    monkeypatch.setattr("fp8compile.ops.vendors.import_error", lambda module: None)  # as if installed
    request = registry.Request("linear", torch.device("cuda"), 4096, 4096, 4096, 4096)
    for vendor in ("cublas", "deep_gemm"):
        assert "needs compute capability sm_90 exactly, device has 10.0" in registry.why_not(vendor, request)
    assert registry.choose(request, tier="large") == "triton"


def test_backends_command_on_a_gpu_without_fp8_kernels_says_the_linear_stays_bf16(monkeypatch, capsys):
    from fp8compile.__main__ import main

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100
    main(["backends", "-m", "64", "--device", "cuda"])
    out = capsys.readouterr().out
    assert "CHOSEN" not in out and "no FP8 kernel runs linear" in out and "kept bf16" in out


def test_cli_runs_on_an_install_without_triton():
    # CPU-only torch comes without triton: `backends` says why the Triton kernels do not serve,
    # `bench` (but `bench model`) says in one line that it needs a GPU.
    script = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # as if not installed
        from fp8compile.__main__ import main
        main(["backends", "-m", "1"])
        import torch
        if not torch.cuda.is_available():
            try:
                main(["bench", "gemm"])
            except SystemExit as e:
                print("bench:", e)
    """)
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "triton_small_m  not used: triton is not installed" in result.stdout
    assert any(line.strip().endswith("CHOSEN") for line in result.stdout.splitlines())
    if "bench:" in result.stdout:
        assert "bench: bench gemm needs a CUDA GPU" in result.stdout


def test_missing_vendor_library_error_says_what_to_install(monkeypatch):
    from fp8compile.ops import vendors

    vendors.import_error.cache_clear()
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # as if not installed
    try:
        with pytest.raises(
            RuntimeError, match=r"cannot import deep_gemm.*pip install 'fp8compile\[deep_gemm\]'"
        ):
            vendors.require("deep_gemm")
    finally:
        vendors.import_error.cache_clear()


def test_benchmark_table_reports_speedups_of_the_compiled_linear():
    from fp8compile.bench.gemm import gemm_table

    rows = [
        dict(n=4096, k=7168, m=1, variant=v, us=t)
        for v, t in [
            ("bf16", 40.0),
            ("deep_gemm", 28.0),
            ("flashinfer", 20.0),
            ("cublas_fp8", None),
            ("fp8compile", 10.0),
            ("fp8compile_tuned", 8.0),
            ("read", 8.0),
        ]
    ]
    last = gemm_table(rows).splitlines()[-1].split()
    assert last[:3] == ["4096", "7168", "1"]
    # vs bf16, vs the best anchor (FlashInfer), no Triton GEMM row, the autotuned linear vs bf16,
    # the share of the plain read's speed the compiled linear reaches
    assert last[-5:] == ["4.00", "2.00", "-", "5.00", "0.80"]


@pytest.mark.parametrize("n, k", [(48, 1536), (37, 1000)])
def test_the_plain_read_reads_every_byte_of_the_weight_once(n, k):
    """bench gemm's reference for a decode GEMM: its programs' XORs together are the XOR of all of
    the weight's bytes, whether or not the tiles divide N and K (a byte skipped or read twice
    would change it)."""
    pytest.importorskip("triton")
    from fp8compile.bench.read import plain_read

    w = torch.randint(0, 256, (n, k), dtype=torch.uint8).view(torch.float8_e4m3fn)
    partials = plain_read(w, block_n=16, block_k=512, programs_per_sm=8)
    assert partials.numel() == 3 * math.ceil(k / 512)  # 3 tiles of N, each split over K
    assert functools.reduce(operator.xor, partials.tolist()) == functools.reduce(
        operator.xor, w.view(torch.uint8).flatten().tolist()
    )


def test_inference_mode_works_like_no_grad():
    model = GatedMLP().to(BF16)
    fp8 = fp8compile.backend()
    x = randn(8, 256)
    with torch.inference_mode():
        out = torch.compile(model, backend=fp8)(x)
        assert fp8compile.calc_diff(out, model(x)) < GATED_MLP
    assert fp8.report.counts() == {"linear": 2, "silu_mul": 1, "moe": 0, "attention": 0, "mqa_logits": 0}


@pytest.mark.inductor
@pytest.mark.parametrize("asked_by", ["inductor_config", "max_autotune_mode"])
def test_a_one_row_linear_is_rewritten_when_coordinate_descent_tuning_is_on(asked_by, monkeypatch):
    # With coordinate_descent_tuning on (mode="max-autotune", or torchao's quantize_, which
    # turns it on for the whole process), Inductor decomposes a one-row matmul into a multiply and
    # a sum while the graph is traced, on every device but the CPU; the linear would reach the
    # passes as no matmul and stay bf16. The GPU's rule is put in the CPU's table here.
    from torch._inductor import compile_fx
    from torch._inductor import config as inductor_config
    from torch._inductor.decomposition import select_decomp_table

    def mm_as_on_a_gpu(a, b):
        if inductor_config.coordinate_descent_tuning and a.shape[0] == 1:
            return (a.unsqueeze(2) * b.unsqueeze(0)).sum(dim=1)
        return NotImplemented

    tuning_in_inductors_compile = []

    def inner(*args, original=compile_fx.compile_fx_inner, **kwargs):
        tuning_in_inductors_compile.append(inductor_config.coordinate_descent_tuning)
        return original(*args, **kwargs)

    monkeypatch.setitem(select_decomp_table(), torch.ops.aten.mm.default, mm_as_on_a_gpu)
    monkeypatch.setattr(compile_fx, "compile_fx_inner", inner)
    mode = None
    if asked_by == "inductor_config":
        tuning = inductor_config.patch(coordinate_descent_tuning=True)
    else:
        tuning, mode = inductor_config.patch({}), "max-autotune-no-cudagraphs"
    model = torch.nn.Linear(256, 512, bias=False).to(BF16)
    fp8 = fp8compile.backend()
    x = randn(1, 256)
    with torch.no_grad(), tuning:
        out = torch.compile(model, backend=fp8, mode=mode)(x)
    assert fp8.report.counts()["linear"] == 1
    # FP8's error, not bf16's (1e-5); one row's 512 outputs spread more than ONE_GEMM's mean: 7.3e-4
    assert 1e-4 < fp8compile.calc_diff(out, model(x)) < 1.5 * ONE_GEMM
    assert tuning_in_inductors_compile == [True]  # the user's setting, for Inductor's own kernels


def test_graph_breaks_give_several_graphs_in_one_report():
    class TwoGraphs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)

        def forward(self, x):
            h = self.a(x)
            torch._dynamo.graph_break()
            return self.b(h)

    model = TwoGraphs().to(BF16)
    fp8 = fp8compile.backend()
    x = randn(8, 256)
    with torch.no_grad():
        out = torch.compile(model, backend=fp8)(x)
        assert fp8compile.calc_diff(out, model(x)) < TWO_GEMMS
    assert fp8.report.graphs == 2
    assert [(r.name, r.graph) for r in fp8.report.rewrites] == [("a", 0), ("b", 1)]


def test_mlp_benchmark_table_reports_fp8_speedups():
    from fp8compile.bench.mlp import mlp_table

    rows = [
        dict(model="llama3-8b", m=16, variant=v, us=t)
        for v, t in [
            ("bf16_inductor", 90.0),
            ("torchao_rowwise", 67.5),
            ("fp8_unfused", 60.0),
            ("fp8_gate_up_apart", 50.0),
            ("fp8", 45.0),
            ("fp8_plain_down", 49.5),
        ]
    ]
    last = mlp_table(rows).splitlines()[-1].split()
    assert last[:2] == ["llama3-8b", "16"] and last[-5:] == ["2.00", "1.50", "1.33", "1.11", "1.10"]


@pytest.mark.parametrize(
    "recipe, extra",
    [
        ("block", []),
        ("rowwise", ["fp8_promote", "fp8_plain_down"]),
        ("tensor", ["fp8_promote", "fp8_plain_down"]),
    ],
)
def test_mlp_benchmark_plumbing_runs_every_variant(monkeypatch, tmp_path, recipe, extra):
    """The GPU benchmark's code path on the CPU with a tiny MLP: every variant compiles and runs,
    JSON and table come out; the scaled recipes add cuBLAS's GEMM promoting along K (fast_accum=False)
    and the down projection as a plain linear on the bf16 product (no silu_mul fusion).
    Timing itself needs CUDA graphs and is stubbed here."""
    import json

    from fp8compile.bench import harness, mlp

    monkeypatch.setattr(harness, "copies", lambda nbytes: 2)
    monkeypatch.setattr(harness, "time_us", lambda fns: [fn() for fn in fns] and 1.0)
    rows = mlp.bench_mlp(tmp_path, ms=[3], mlps={"tiny": (256, 512)}, device="cpu", recipe=recipe)
    assert sorted(r["variant"] for r in rows) == sorted(
        ["bf16_inductor", "fp8", "fp8_gate_up_apart", "fp8_unfused"] + extra
    )
    assert json.loads((tmp_path / "bench_mlp.json").read_text()) == rows


def test_no_benchmark_variant_runs_under_the_inductor_config_a_variant_before_it_set(monkeypatch):
    # torchao's quantize_ turns coordinate_descent_tuning on for the process (its
    # recommended_inductor_config_setter); the variants after it once ran under it.
    from torch._inductor import config as inductor_config

    from fp8compile.bench import harness

    monkeypatch.setattr(harness, "time_us", lambda fns: [fn() for fn in fns] and 1.0)
    seen = {}

    def compile_variant(variant):
        seen[variant] = inductor_config.coordinate_descent_tuning
        if variant == "like_torchao":
            inductor_config.coordinate_descent_tuning = True
        return [lambda x: x]

    with inductor_config.patch(coordinate_descent_tuning=False):
        rows = harness.variant_rows(
            compile_variant, {"like_torchao": None, "next": None}, [(1, 0)], lambda v, key, us: (v, key, us)
        )
        assert inductor_config.coordinate_descent_tuning is False  # and none after the benchmark
    assert rows == [("like_torchao", 1, 1.0), ("next", 1, 1.0)]
    assert seen == {"like_torchao": False, "next": False}


@pytest.mark.inductor
def test_report_says_per_graph_whether_calls_replay_cuda_graphs():
    # On the GPU, mode="reduce-overhead" gives "on: ..." (tests/test_gpu_compiled.py checks the replays).
    lines = {}
    for mode in (None, "reduce-overhead", "max-autotune-no-cudagraphs"):
        torch._dynamo.reset()
        fp8 = fp8compile.backend()
        with torch.no_grad():
            torch.compile(torch.nn.Linear(256, 256).to(BF16), backend=fp8, mode=mode)(randn(4, 256))
        lines[mode] = fp8.report.cuda_graphs[0]
        assert f"graph 0: {lines[mode]}" in str(fp8.report)
    assert lines[None].startswith("off (default mode") and "reduce-overhead" in lines[None]
    assert lines["reduce-overhead"] == "off: the graph runs on no CUDA device"
    assert (
        lines["max-autotune-no-cudagraphs"] == "off (mode='max-autotune-no-cudagraphs' does not ask for them)"
    )


def test_compiling_with_the_m_dispatch_leaves_inductors_cond_lowering_as_it_was(probe_backend):
    from torch._inductor.lowering import lowerings

    cond = torch.ops.higher_order.cond
    before = lowerings[cond]
    fp8 = fp8compile.backend(backends=["probe", "reference"])  # two kernels: the graph has a cond
    model = torch.nn.Linear(256, 256).to(BF16)
    with torch.no_grad():
        for m in (4, 40):
            x = randn(m, 256)
            torch._dynamo.mark_dynamic(x, 0)
            torch.compile(model, backend=fp8, mode="reduce-overhead")(x)
    assert fp8.report.rewrites[0].kernels == (("M <= 32", "probe"), ("M > 32", "reference"))
    assert lowerings[cond] is before


class _FakeWorkerPool:
    def __init__(self):
        self.shut = False

    def shutdown(self):
        self.shut = True


@pytest.mark.parametrize("user_value", [None, "0", "1"])
def test_static_launch_of_our_kernels_reaches_compile_workers_unless_the_user_chose(monkeypatch, user_value):
    """Inductor's compile workers decide how a user-defined Triton kernel is launched from the
    environment they started with: the backend sets the variable (and restarts workers started
    without it); a value the user set is left as it is, workers included."""
    from torch._inductor import async_compile

    from fp8compile.backend import STATIC_LAUNCH_ENV, static_launch_for_user_kernels

    if not hasattr(torch._inductor.config, "static_launch_user_defined_triton_kernels"):
        pytest.skip("this Inductor has no static launcher for user-defined Triton kernels")
    pool = _FakeWorkerPool()
    monkeypatch.setattr(async_compile, "_pool_set", {pool})
    monkeypatch.setattr(
        async_compile, "shutdown_compile_workers", lambda: [p.shutdown() for p in async_compile._pool_set]
    )
    if user_value is None:
        monkeypatch.delenv(STATIC_LAUNCH_ENV, raising=False)
    else:
        monkeypatch.setenv(STATIC_LAUNCH_ENV, user_value)
    assert static_launch_for_user_kernels() == (user_value != "0")
    assert os.environ[STATIC_LAUNCH_ENV] == (user_value or "1")
    assert pool.shut == (user_value is None)


@pytest.mark.parametrize("user_value", [None, "0"])
def test_importing_fp8compile_sets_static_launch_before_a_compile_starts_workers(user_value):
    """Set at import, the variable is there when the first compile starts Inductor's compile
    workers (set at the first fp8 compile instead, workers an earlier compile started are
    restarted: 10 s of a Qwen3-MoE's first call); importing does not import Inductor."""
    from fp8compile.backend import STATIC_LAUNCH_ENV

    env = {key: value for key, value in os.environ.items() if key != STATIC_LAUNCH_ENV}
    if user_value is not None:
        env[STATIC_LAUNCH_ENV] = user_value
    probe = (
        "import os, sys, fp8compile; "
        f"print(os.environ.get('{STATIC_LAUNCH_ENV}'), 'torch._inductor' in sys.modules)"
    )
    seen = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert seen == [user_value or "1", "False"]


@pytest.mark.parametrize(
    "source, name",
    [
        ("L['self']._modules['mlp']._parameters['weight']", "mlp.weight"),
        ("L['fn'].model.norm.weight", "model.norm.weight"),
        # generate() of transformers 5.24 calls a compiled bound forward with the model in *args
        ("L['args'][0].model.layers.0.self_attn", "model.layers.0.self_attn"),
        ("L['kwargs']['model'].lm_head.weight", "lm_head.weight"),
        ("L['args'].model.norm", "model.norm"),  # a parameter named args: only it is the root
        ("G['lm_head'].weight", "lm_head.weight"),  # a global keeps its name
    ],
)
def test_report_names_are_the_models_own_whatever_dynamo_calls_the_compiled_root(source, name):
    from fp8compile.passes.context import qualified_name

    assert qualified_name(source) == name


def test_dynamic_true_makes_a_modules_float_constants_constants_and_leaves_the_callers_floats_inputs():
    """At dynamic=True Dynamo passes a float read from a module as a graph input; the backend has
    it traced again as a guarded constant, so that GPT-OSS's experts (their clamp limit and
    sigmoid slope are module floats) are rewritten as in a graph of static shapes, and a changed
    value recompiles. A float the caller passes stays an input: a new value does not recompile."""
    pytest.importorskip("transformers")
    from tests.conftest import CountingBackend
    from tests.test_moe import MOE_BLOCK, gpt_oss_mlp

    model = gpt_oss_mlp("grouped_mm")
    x = randn(1, 5, 256)
    with torch.no_grad():
        static = torch.compile(model, backend=fp8compile.backend())(x)[0] * 0.5
        torch._dynamo.reset()
        backend = CountingBackend()
        compiled = torch.compile(lambda x, scale: model(x)[0] * scale, backend=backend, dynamic=True)
        out = compiled(x, 0.5)
        assert backend.report.counts()["moe"] == 1, backend.report
        assert torch.equal(out, static)
        compiles = backend.compiles
        assert torch.equal(compiled(x, 0.25), out / 2)
        assert compiled(randn(1, 9, 256), 2.0).shape == (1, 9, 256)
        assert backend.compiles == compiles
        # one graph: the backend restarted the first trace, to have the floats traced as constants
        assert compiles == 1 and backend.calls == 2
        model.experts.limit = 0.1  # a guarded constant: a new value recompiles, with the new clamp
        clamped = compiled(x, 0.5)
        assert backend.compiles == compiles + 1
        assert fp8compile.calc_diff(clamped, out) > 0.1  # the clamp bites (0.42 in eager bf16)
        eager = model(x)[0] * 0.5
        assert fp8compile.calc_diff(clamped, eager) < MOE_BLOCK


def test_without_inductor_the_rewritten_graph_runs_as_its_ops_with_the_same_rewrites_and_numbers():
    from torch._inductor.utils import run_and_get_code

    model = GatedMLP(256, 512).to(BF16)
    x = randn(8, 256)
    runs = {}
    for inductor in (True, False):
        backend = fp8compile.backend(inductor=inductor)
        torch._dynamo.reset()
        with torch.no_grad():
            out, code = run_and_get_code(torch.compile(model, backend=backend), x)
        runs[inductor] = (out, code, backend.report.counts())
    (with_out, with_code, with_counts), (eager_out, eager_code, eager_counts) = runs[True], runs[False]
    assert with_code and not eager_code  # no code generated without Inductor
    assert eager_counts == with_counts and eager_counts["silu_mul"] == 1
    assert fp8compile.calc_diff(eager_out, with_out) < 1e-5
    # nothing records CUDA graphs of it either, and the report says so where a mode asked for them
    backend = fp8compile.backend(inductor=False)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend, mode="reduce-overhead")(x)
    (state,) = backend.report.cuda_graphs.values()
    assert state.startswith("off: Fp8Config(inductor=False)")


def test_the_inductor_default_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("FP8COMPILE_INDUCTOR", "0")
    assert fp8compile.make_config().inductor is False
    monkeypatch.setenv("FP8COMPILE_INDUCTOR", "1")
    assert fp8compile.make_config().inductor is True
    assert fp8compile.make_config(inductor=False).inductor is False
