"""The architecture matrix (fp8compile/architectures.py, `python -m fp8compile models`) on every
causal LM of the installed transformers, each built small with random weights and compiled with
backend="fp8" on the CPU. None may fail, every one within its accuracy bound (the median token's
logits calc_diff against eager bf16 no more than 1.15x that of the model's own unfused block-FP8
composition, the pooled calc_diff no more than 1.5x: the module says why two), and each rewritten
as tests/golden/architectures.json recorded it. MATRIX names the ones that span what real
checkpoints have, and the rewrites each must show: GQA and MLA attention, sliding windows,
biases, fused qkv and gate_up projections, softcapping, softmax and sigmoid routers, grouped
top-k, shared experts, dense first layers, fp32 routing weights, clamped, biased and interleaved
experts, Llama 4's dense experts, stacked shared experts."""

import contextlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from fp8compile import architectures  # noqa: E402

# model type -> the kinds of rewrite it must show (at least one of each)
MATRIX = {
    "llama": ("linear", "silu_mul"),  # GQA, the baseline
    "qwen2": ("linear", "silu_mul"),  # q/k/v biases
    "phi3": ("linear", "silu_mul"),  # fused qkv_proj and gate_up_proj
    "gemma2": ("linear", "silu_mul"),  # gelu_tanh gate (fused), softcapping, sliding window
    "starcoder2": ("linear",),  # plain GELU MLP with biases
    "deepseek_v3": ("linear", "silu_mul", "moe"),  # MLA, sigmoid router with grouped top-k, shared experts
    "qwen3_moe": ("linear", "moe"),  # softmax router, norm_topk_prob
    "mixtral": ("linear", "moe"),  # fp32 routing weights
    "gpt_oss": ("linear", "moe"),  # clamped swigluoai, expert biases, interleaved gate|up, sinks
    "deepseek_v4": ("linear", "silu_mul", "moe"),  # clamped SwiGLU (silu_limit) in experts and shared MLP
    "nemotron_h": ("linear", "moe"),  # non-gated relu^2 experts, Mamba layers, an fp32 router
    "beam": ("linear", "moe"),  # experts' act(gate.float()) * up.float(); dense layers as a list
    "jetmoe": ("linear",),  # experts stacked in one parameter, F.linear(x, w[i]) on each one's rows
    "llama4_text": ("linear", "moe"),  # dense experts: bmm's of every token, top-k scores scale inputs
    "inkling_text": ("linear", "moe"),  # shared experts stacked in parameters, run as bmm's
}
# Linears that are single experts of a stacked parameter, at the matrix's small sizes: JetMoE's 2
# layers x (attention experts, MLP experts) x (input, output projection) x 8 experts; Inkling's
# 2 layers x (gate, up, down) of its one shared expert.
EXPERT_LINEARS = {"jetmoe": 64, "inkling_text": 6}


# What each of the architectures above showed when tests/golden/architectures.json was recorded
# (`python -m fp8compile models --out DIR`, its models.json's status and counts per row), with
# the transformers of constraints.txt: every other causal LM is held to its row too.
GOLDEN = json.loads((Path(__file__).parent / "golden" / "architectures.json").read_text())
RECORDED_WITH = "transformers 5.24.0"


def _installed(arch: str) -> bool:
    from transformers import CONFIG_MAPPING

    return arch in CONFIG_MAPPING


# The slowest architecture took 21 s here (rwkv, 2026-11-28): one that hangs in a future
# transformers fails its test after this long instead of holding CI until its own time limit.
ARCH_SECONDS = 300


@contextlib.contextmanager
def time_limit(seconds: int, what: str):
    """A TimeoutError after `seconds` (SIGALRM: the main thread of a Unix process, where pytest and
    its xdist workers run tests); elsewhere no limit."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"{what} took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def every_causal_lm() -> list[str]:
    """Every causal-LM model type of the installed transformers, and the recorded ones it lacks
    (skipped: a newer transformers may drop one)."""
    return sorted(set(architectures.causal_lm_architectures()) | set(GOLDEN))


@pytest.mark.parametrize("arch", every_causal_lm())
def test_every_causal_lm_compiles_within_its_bound_and_is_rewritten_as_recorded(arch):
    """A new transformers release that breaks a pass on any architecture fails here: its row must
    not be "failed" (an exception of the backend) or "over bound", and must match the recorded
    status and rewrite counts. An architecture new in the installed transformers is held to the
    first part only. A row that changes on purpose (a pass that takes more, a transformers whose
    config now builds small) is recorded again in tests/golden/architectures.json."""
    if not _installed(arch):
        pytest.skip(f"{arch} is not in this transformers")
    with time_limit(ARCH_SECONDS, arch):
        row = architectures.run(arch)
    assert row.status not in ("failed", "over bound"), architectures.table([row])
    if arch in MATRIX:
        assert row.status == "rewritten", architectures.table([row])
        assert all(row.counts.get(kind, 0) > 0 for kind in MATRIX[arch]), row.counts
        assert row.counts["linear"] > EXPERT_LINEARS.get(arch, 0), row.counts
        # Every bound compares like with like: the composition's own FP8 error is not zero.
        assert 0 < row.median_composition and 0 < row.composition
    if arch in GOLDEN:
        now = {"status": row.status, "counts": dict(sorted(row.counts.items()))}
        assert now == GOLDEN[arch], (
            f"{arch}: {now} now, {GOLDEN[arch]} recorded with {RECORDED_WITH}\n" + architectures.table([row])
        )


@pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="SIGALRM: Unix")
def test_an_architecture_that_hangs_is_stopped_by_the_time_limit():
    import time

    handler, begin = signal.getsignal(signal.SIGALRM), time.perf_counter()
    with pytest.raises(TimeoutError, match="hanging_model took more than 1 s"):
        with time_limit(1, "hanging_model"):
            time.sleep(30)
    assert time.perf_counter() - begin < 10
    assert signal.getsignal(signal.SIGALRM) is handler and signal.alarm(0) == 0  # put back, none pending


def test_moe_architectures_are_found_as_moe_and_their_routers_stay_bf16():
    row = architectures.run("olmoe")
    assert row.experts == "MoE" and row.counts["moe"] == 2
    assert any("router of a rewritten MoE block" in reason for reason in row.kept), row.kept


def test_small_config_sets_only_the_sizes_an_architecture_has_and_keeps_mla_without_gqa():
    llama = architectures.small_config("llama")
    assert (llama.hidden_size, llama.num_hidden_layers, llama.num_key_value_heads) == (256, 2, 2)
    assert not hasattr(llama, "kv_lora_rank")
    deepseek = architectures.small_config("deepseek_v3")  # MLA: every head has its own K and V
    assert deepseek.num_key_value_heads == deepseek.num_attention_heads == 4
    assert deepseek.kv_lora_rank == 128 and deepseek.n_routed_experts == 8


def test_moe_models_listing_their_dense_layers_get_experts_in_their_second_small_layer():
    """Beam's default dense layers (three, by mlp_layer_types) and Flint's (layers 0 and 1, by
    mlp_only_layers) would leave both small layers without experts."""
    for arch, field, value in (
        ("beam", "mlp_layer_types", ["dense", "sparse"]),
        ("flint", "mlp_only_layers", [0]),
    ):
        if _installed(arch):
            assert getattr(architectures.small_config(arch), field) == value, arch
    assert architectures.small_config("qwen3_moe").mlp_only_layers == []  # no dense layers: kept


def test_a_multimodal_models_language_model_gets_the_small_sizes_in_its_nested_config():
    """Llama 4 and Mllama keep their language model's sizes in text_config: it gets SMALL's too
    (the full-size defaults exhausted a 24 GiB machine), and its per-layer lists follow the new depth."""
    llama4 = architectures.small_config("llama4").text_config
    assert (llama4.hidden_size, llama4.num_hidden_layers, llama4.num_local_experts) == (256, 2, 8)
    assert len(llama4.layer_types) == 2
    assert architectures.small_config("mllama").text_config.hidden_size == 256


def test_a_config_the_small_sizes_do_not_reach_is_refused_by_its_size_before_it_is_built(monkeypatch):
    """Counted on the meta device: a model too large to be 'small' is a "not built small" row
    with its parameter count, not a process the out-of-memory killer ends."""
    monkeypatch.setattr(architectures, "MAX_PARAMS", 1_000_000)  # llama's small config has 1.4M
    row = architectures.run("llama")
    assert row.status == "not built small"
    assert "1M parameters at the small sizes (at most 1M)" in row.note


def test_composition_quantizes_the_expert_gemms_and_the_linears_and_restores_the_model():
    """Without the experts' GEMMs in FP8 the composition of an MoE model would understate its
    FP8 error and make the bound too tight; after the block, the model is its bf16 self."""
    from transformers.integrations import moe

    model = architectures.build("qwen3_moe")
    ids = torch.randint(0, 512, (1, 32))
    original = moe._grouped_mm
    calls = []
    with torch.no_grad():
        eager = model(ids).logits
        with architectures.composition(model):
            real = moe._grouped_mm
            moe._grouped_mm = lambda x, w, offs: calls.append(w.shape) or real(x, w, offs)
            simulated = model(ids).logits
            moe._grouped_mm = real
        again = model(ids).logits
    assert moe._grouped_mm is original and torch.equal(again, eager)
    assert len(calls) == 4  # gate_up and down of both layers' experts
    assert architectures.calc_diff(simulated, eager) > 0


def test_an_architecture_that_cannot_be_built_small_is_listed_as_such_not_as_a_failure(monkeypatch):
    def refuse(arch, seed=0, dtype=None):
        raise ValueError("this config needs a vision tower")

    monkeypatch.setattr(architectures, "build", refuse)
    row = architectures.run("llama")
    assert row.status == "not built small" and "vision tower" in row.note


def test_the_matrix_runs_each_architecture_in_its_own_process_and_keeps_going():
    """`python -m fp8compile models` takes each architecture in a fresh process, so one that is
    killed (DeepSeek-style defaults that exhaust memory, a hang) is a row, not the end of the
    matrix; the row comes back through JSON whole."""
    row = architectures.run_isolated("no_such_model_type", timeout=300)
    assert row.arch == "no_such_model_type" and row.status == "not built small"
    assert "KeyError" in row.note


def test_the_null_check_reaches_the_architectures_own_process(monkeypatch):
    import subprocess

    commands = []

    def run(command, **kwargs):
        commands.append(command)
        return subprocess.CompletedProcess(command, 0, stdout='{"arch": "llama", "status": "rewritten"}\n')

    monkeypatch.setattr(subprocess, "run", run)
    row = architectures.run_isolated("llama", device="cuda", modes=("reduce-overhead",), null=True)
    (command,) = commands
    assert row.status == "rewritten" and "--null" in command and "--generate=reduce-overhead" in command


def test_the_matrix_runs_architectures_side_by_side_and_prints_them_in_the_order_asked(tmp_path):
    """`--jobs 2` runs two processes at once (the GPU matrix ran 8); the rows keep their order,
    the order asked, not the alphabet's. (Rows of real architectures, rewritten in a process of
    their own, are test_the_matrix_runs_each_architecture_in_its_own_process_and_keeps_going's
    and the parametrized test's; two unknown ones keep this test to the command's plumbing.)"""
    asked = ["zz_no_such_model_type", "aa_no_such_model_type"]
    result = subprocess.run(
        [sys.executable, "-m", "fp8compile", "models", "--jobs", "2", "--out", str(tmp_path)] + asked,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((tmp_path / "models.json").read_text())
    assert [(r["arch"], r["status"]) for r in rows] == [(arch, "not built small") for arch in asked]
    assert all("KeyError" in r["note"] for r in rows)
    printed = [line.split("|")[1].strip() for line in result.stdout.splitlines() if line.startswith("| ")]
    assert printed[1:] == asked  # after the header


def test_generate_in_the_matrix_tells_a_crash_of_fp8_from_the_models_own(monkeypatch):
    # generate_check.decode runs bf16 Inductor first: an exception there is the model's or
    # transformers' (a note), one on fp8's side fails the row.
    from fp8compile import generate_check

    def fake_generate(model, ids, backend, mode, repeat):
        if mode == "default" and backend != "inductor":
            raise IndexError("tuple index out of range")
        if mode == "reduce-overhead" and backend == "inductor":
            raise ValueError("this model has no static cache")
        return 0.5, 0

    monkeypatch.setattr(generate_check, "_generate_timed", fake_generate)
    model = architectures.build("llama")
    row = architectures.Row("llama", "rewritten", counts={"linear": 14})
    architectures._decode(row, model, "cpu", ("default", "reduce-overhead"))
    assert row.status == "failed" and "generate() in default: fp8: IndexError" in row.note
    assert [d["error"].split(":")[0] for d in row.decode] == ["fp8", "bf16"]
    header, _, line = architectures.table([row]).splitlines()
    assert "generate(), default" in header and "generate(), reduce-overhead" in header
    assert "fp8: IndexError: tuple index out of range" in line and "bf16: ValueError" in line
    assert header.count("|") == line.count("|")


def test_lean_in_the_matrix_decodes_greedy_and_sampled_and_fails_the_row_on_a_crash(monkeypatch):
    from fp8compile import lean_decode

    model = architectures.build("llama")
    row = architectures.Row("llama", "rewritten", counts={"linear": 14})
    architectures._lean(row, model, "cpu")
    assert (row.status, row.lean) == ("rewritten", "ran")
    header, _, line = architectures.table([row]).splitlines()
    assert "| LeanDecoder, fp8 |" in header and "| ran |" in line and header.count("|") == line.count("|")

    model._can_compile_fullgraph = False  # transformers' mark of a model without a static cache
    refused = architectures.Row("llama", "rewritten", counts={"linear": 14})
    architectures._lean(refused, model, "cpu")
    assert refused.status == "rewritten" and refused.lean.startswith(
        "refused: LlamaForCausalLM cannot decode"
    )

    def crash(self, *args, **kwargs):
        raise IndexError("index 12 is out of bounds")

    monkeypatch.setattr(lean_decode.LeanDecoder, "generate", crash)
    model._can_compile_fullgraph = True
    crashed = architectures.Row("llama", "rewritten", counts={"linear": 14})
    architectures._lean(crashed, model, "cpu")
    assert crashed.status == "failed" and crashed.note == "LeanDecoder: IndexError: index 12 is out of bounds"


def test_lean_reaches_the_architectures_own_process(monkeypatch):
    commands = []

    def run(command, **kwargs):
        commands.append(command)
        return subprocess.CompletedProcess(
            command, 0, stdout='{"arch": "llama", "status": "rewritten", "lean": "ran"}\n'
        )

    monkeypatch.setattr(subprocess, "run", run)
    row = architectures.run_isolated("llama", lean=True)
    assert row.lean == "ran" and "--lean" in commands[0]
    architectures.run_isolated("llama")
    assert "--lean" not in commands[1]


def test_generate_in_the_matrix_gives_tokens_per_second_on_both_sides_dropping_the_first_block(monkeypatch):
    from fp8compile import generate_check

    sides = []
    block_seconds = iter([9.0, 0.2, 0.5, 0.5, 0.3])  # the first block is slowest: not counted

    def fake_generate(model, ids, backend, mode, repeat):
        sides.append("bf16" if backend == "inductor" else "fp8")
        return next(block_seconds), 0

    monkeypatch.setattr(generate_check, "_generate_timed", fake_generate)
    result = generate_check.decode(architectures.build("llama"), "reduce-overhead", "cpu", timed=True)
    # a bf16 block first, then fp8, bf16, bf16, fp8: each side's counted blocks sit at the same
    # mean position in the process
    assert sides == ["bf16", "fp8", "bf16", "bf16", "fp8"]
    assert (result.bf16_tokens_per_s, result.fp8_tokens_per_s) == (64.0, 128.0)  # fp8: the mean, 0.25 s
    assert [side for side, _ in result.blocks] == sides and result.blocks[0][1] == 9.0
    assert result.recompiles == 0 and result.error == "" and not result.null


def test_the_null_check_times_bf16_inductor_on_both_sides_and_says_so(monkeypatch):
    import dataclasses

    from fp8compile import generate_check

    backends = []

    def fake_generate(model, ids, backend, mode, repeat):
        backends.append(backend)
        return 0.5, 0

    monkeypatch.setattr(generate_check, "_generate_timed", fake_generate)
    result = generate_check.decode(
        architectures.build("llama"), "reduce-overhead", "cpu", timed=True, null=True
    )
    assert backends == ["inductor"] * len(generate_check.TIMED_ORDER)
    assert result.null and result.bf16_tokens_per_s == result.fp8_tokens_per_s == 64.0
    row = architectures.Row("llama", "rewritten", counts={"linear": 14}, decode=[dataclasses.asdict(result)])
    assert "null (bf16 Inductor on both sides): 64 / 64 = 1.00x" in architectures.table([row])


def test_generate_check_times_the_median_of_its_repeated_calls_after_one_warm_up(monkeypatch):
    from fp8compile import generate_check

    calls, clock = [], [0.0]
    durations = iter([9.0, 5.0, 1.0, 3.0])  # the warm-up call, then three timed ones

    class Model:
        def generate(self, ids, **kwargs):
            calls.append(kwargs["compile_config"].mode)
            clock[0] += next(durations)

    monkeypatch.setattr(generate_check, "perf_counter", lambda: clock[0])
    seconds, recompiles = generate_check._generate_timed(Model(), torch.ones(1, 4), "inductor", "default", 3)
    assert calls == ["default"] * 4 and seconds == 3.0 and recompiles == 0
