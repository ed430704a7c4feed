"""FP8 checkpoints as transformers loads them (FineGrainedFP8Config: FP8Linear modules holding
e4m3fn weights and their 128x128 block scales): compiled with backend="fp8", their linears run
on fp8compile's FP8 linear with the checkpoint's own tensors, what it cannot serve stays as
transformers runs it with the reason, and eager calls are untouched.

Each model here is saved as such a checkpoint is published and loaded back by transformers' own
loader (`from_pretrained`), as a user who downloads one gets it.
On the CPU transformers' own FP8 kernels do not load (a Hub download), so its forward is given
the computation they make (`ops/linear/checkpoint.py`'s `reference`): the activation quantized
per token in groups of a block's width, the dequantized weight blocks.
"""

import copy
import os
import subprocess
import sys
import tempfile
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import fp8compile
from fp8compile import architectures, calc_diff, checkpoints, release
from fp8compile.bench import fp8_checkpoint as fp8_checkpoint_files
from fp8compile.numerics import E8M0_DTYPE
from fp8compile.ops.linear import checkpoint as checkpoint_op
from fp8compile.ops.linear import reference as linear_reference
from fp8compile.ops.quant import reference as quant_reference
from fp8compile.passes import checkpoint_linear
from tests.conftest import BF16, golden_text, gpu, randn

transformers = pytest.importorskip("transformers")
finegrained_fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")

BLOCK_DETAIL = checkpoint_linear.DETAIL


def _dequantized(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows = scale.float().repeat_interleave(block[0], 0)[: weight.shape[0]]
    return weight.float() * rows.repeat_interleave(block[1], 1)[:, : weight.shape[1]]


@pytest.fixture
def transformers_kernels(monkeypatch):
    """transformers' FP8 forward, its kernels' computation in PyTorch (the CPU has neither of them)."""
    monkeypatch.setattr(finegrained_fp8, "finegrained_fp8_linear", checkpoint_op.reference)
    monkeypatch.setattr(finegrained_fp8, "is_deepgemm_loadable", lambda: False, raising=False)


def fp8_checkpoint(arch: str = "llama", block=(128, 128), scale_fmt: str = "float"):
    """(the model as transformers loads its FP8 checkpoint, the bf16 model of its dequantized
    weights): every linear but the lm_head in FP8. 128x128 blocks are saved as such a checkpoint
    is published (fp8compile.bench.fp8_checkpoint) and loaded back by transformers' own loader;
    other block sizes get the modules that loader builds (replace_with_fp8_linear), loaded directly."""
    model = architectures.build(arch).eval()
    if block == (128, 128):
        loaded = _saved_and_loaded(model, arch, scale_fmt)
    else:
        loaded = copy.deepcopy(model)
        config = transformers.FineGrainedFP8Config(
            weight_block_size=block, modules_to_not_convert=["lm_head"]
        )
        finegrained_fp8.replace_with_fp8_linear(
            loaded, modules_to_not_convert=["lm_head"], quantization_config=config, pre_quantized=True
        )
        state = {}
        for name in _fp8_linears(loaded):
            weight, scale = _quantize(model.get_submodule(name).weight.detach(), block)
            state[f"{name}.weight"], state[f"{name}.weight_scale_inv"] = weight, scale
        loaded.load_state_dict({**model.state_dict(), **state}, strict=False, assign=True)
    assert not any(p.is_meta for p in loaded.parameters()) and _fp8_linears(loaded)
    dequantized = copy.deepcopy(model)
    for name in _fp8_linears(loaded):
        fp8 = loaded.get_submodule(name)
        dense = _dequantized(fp8.weight, fp8.weight_scale_inv, tuple(fp8.block_size))
        dequantized.get_submodule(name).weight.data = dense.to(model.dtype)
    for name, experts in loaded.named_modules():
        if isinstance(experts, finegrained_fp8.FP8Experts):
            for proj in ("gate_up_proj", "down_proj"):
                weight, scale = getattr(experts, proj), getattr(experts, f"{proj}_scale_inv")
                dense = torch.stack([_dequantized(w, s, (128, 128)) for w, s in zip(weight, scale)])
                getattr(dequantized.get_submodule(name), proj).data = dense.to(model.dtype)
    return loaded.eval(), dequantized


_SAVED: dict[tuple[str, str], str] = {}  # (arch, scale_fmt) -> the checkpoint's folder, written once


@pytest.fixture(scope="module", autouse=True)
def _saved_checkpoints():
    """The checkpoints this file writes (transformers quantizing each model as it loads it is most
    of a test's time), shared by its tests and deleted after them."""
    with tempfile.TemporaryDirectory() as root:
        _SAVED["root"] = root
        yield
    _SAVED.clear()


def _saved_and_loaded(model, arch: str, scale_fmt: str):
    """model saved as a block-FP8 checkpoint (once per arch and scale format: architectures.build
    is seeded) and loaded back through from_pretrained, as on a GPU machine."""
    key = (arch, scale_fmt)
    if key not in _SAVED:
        _SAVED[key] = os.path.join(_SAVED["root"], f"{arch}_{scale_fmt}")
        fp8_checkpoint_files.save(model, _SAVED[key], scale_fmt=scale_fmt)
    return fp8_checkpoint_files.load(_SAVED[key], torch.device("cpu"), model.dtype)


def _quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    tiles = w.float().reshape(n // block[0], block[0], k // block[1], block[1])
    scale = tiles.abs().amax((1, 3)).clamp(min=1e-12) / 448
    weight = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(n, k)
    return weight, scale


def _ids(model, batch=2, tokens=12):
    torch.manual_seed(1)
    return torch.randint(0, model.config.vocab_size, (batch, tokens))


def _linear_rewrites(report) -> dict:
    """The report's rewrites of linears (plain, or a gated MLP's down projection) by module name;
    an attention fusion may rewrite the attention too, as in a bf16 model."""
    return {r.name: r for r in report.rewrites if r.kind in ("linear", "silu_mul")}


def _fp8_linears(model) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, finegrained_fp8.FP8Linear)]


def test_the_reference_of_any_block_size_computes_the_block_recipe_at_128x128():
    # reference() takes fp8compile's own block-recipe reference at 128x128 and a dequantizing one
    # otherwise: at 128x128 the two agree to fp32's product against float64's
    torch.manual_seed(0)
    x, w = randn(5, 384), randn(256, 384, scale=0.02)
    w_fp8, w_scale = quant_reference.quant_weight_block(w)
    exact = linear_reference.linear_block(x, w_fp8, w_scale)
    assert torch.equal(checkpoint_op.reference(x, w_fp8, w_scale, [128, 128]), exact)
    dequantized = checkpoint_op.dequantized_reference(x, w_fp8, w_scale, (128, 128))
    assert calc_diff(dequantized, exact) < 1e-5


def test_the_reference_with_a_static_activation_scale_quantizes_with_that_one_scale():
    torch.manual_seed(0)
    x = randn(3, 256)
    w_fp8, w_scale = quant_reference.quant_weight_block(randn(128, 256, scale=0.02))
    scale = torch.tensor(0.05)
    ours = checkpoint_op.reference(x, w_fp8, w_scale, [128, 128], activation_scale=scale)
    x_q = (x.float() / 0.05).clamp(-448, 448).to(torch.float8_e4m3fn).float() * 0.05
    dense = quant_reference.dequant_weight_block(w_fp8, w_scale)
    assert calc_diff(ours, (x_q @ dense.T).to(BF16)) < 1e-5
    assert calc_diff(ours, linear_reference.linear_block(x, w_fp8, w_scale)) > 1e-5  # not the dynamic one


@pytest.mark.parametrize("first", ["fp8compile", "transformers"])
def test_the_substitutes_for_transformers_fp8_linear_and_experts_are_installed_whichever_is_imported_first(
    first,
):
    imports = {
        "fp8compile": "import fp8compile",
        "transformers": "import transformers.integrations.finegrained_fp8",
    }
    second = next(name for name in imports if name != first)
    code = "; ".join(
        [
            imports[first],
            "import sys",
            "mod = sys.modules.get('fp8compile.checkpoints')",
            "print(mod and mod.status())",
            # a look-up that imports nothing (as a library checks what is installed) changes nothing
            "import importlib.util",
            "importlib.util.find_spec('transformers.integrations.finegrained_fp8')",
            imports[second],
            "from fp8compile import checkpoints",
            "print(checkpoints.status())",
            "print(checkpoints.experts_status())",
        ]
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    before, after, experts = done.stdout.strip().splitlines()[-3:]
    assert after == "traced as fp8compile::checkpoint_linear"
    assert experts == "traced as fp8compile::checkpoint_experts"
    if first == "fp8compile":  # not before the integration is imported: it would import transformers
        assert before.startswith("not traced as one op")


def test_an_fp8_checkpoints_linears_run_on_fp8compiles_linear_with_its_own_weights(
    transformers_kernels, weight_quantizations
):
    model, dequantized = fp8_checkpoint()
    ids = _ids(model)
    fp8 = fp8compile.backend()
    with torch.no_grad():
        logits = torch.compile(model, backend=fp8)(ids).logits
        theirs = model(ids).logits  # eager: transformers' FP8 forward
        bf16 = dequantized(ids).logits
    rewritten = _linear_rewrites(fp8.report)
    assert sorted(rewritten) == sorted(_fp8_linears(model)) and len(rewritten) == 14
    assert all(r.detail.endswith(BLOCK_DETAIL) for r in rewritten.values())
    # a gated MLP's down projection quantizes silu(gate) * up in its own kernel, as in a bf16 model
    downs = {name for name in rewritten if name.endswith("mlp.down_proj")}
    assert {name for name, r in rewritten.items() if r.kind == "silu_mul"} == downs and len(downs) == 2
    # the checkpoint's tensors, read in place: no weight quantized, none copied
    assert weight_quantizations == ["compiled"]
    (kept,) = [s for s in fp8.report.skips if s.kind == "linear"]
    assert kept.name == "lm_head" and "keeps it in bf16" in kept.reason
    # within the bound of transformers' own FP8 forward, against the dequantized model in bf16
    assert calc_diff(logits, bf16) <= 1.15 * calc_diff(theirs, bf16)
    assert calc_diff(logits, theirs) < 2e-3


def _storages(model) -> dict[str, int]:
    """Each FP8 weight's storage, by module name (its address)."""
    return {
        name: model.get_submodule(name).weight.untyped_storage().data_ptr() for name in _fp8_linears(model)
    }


def _unique_bytes(model) -> int:
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


def test_checkpoint_linears_over_one_input_are_one_gemm_over_their_own_weights_stacked_in_place(
    transformers_kernels, tmp_path
):
    model, _ = fp8_checkpoint()
    ids = _ids(model)
    weights = {name: model.get_submodule(name).weight.clone() for name in _fp8_linears(model)}
    before, held = model(ids).logits, _unique_bytes(model)
    fp8 = fp8compile.backend()
    with torch.no_grad():
        torch.compile(model, backend=fp8)(ids)
    rewritten = _linear_rewrites(fp8.report)
    attention, mlp = "model.layers.0.self_attn.", "model.layers.0.mlp."
    assert rewritten[attention + "k_proj"].detail.startswith("one GEMM with q_proj, v_proj")
    assert rewritten[mlp + "gate_proj"].detail.startswith("one GEMM with up_proj")
    assert rewritten[mlp + "down_proj"].kind == "silu_mul"
    # the stack is the checkpoint's weights: each one views its rows, the values as they were,
    # and the model holds its bytes once
    storages = _storages(model)
    assert len({storages[attention + p] for p in ("q_proj", "k_proj", "v_proj")}) == 1
    assert storages[mlp + "gate_proj"] == storages[mlp + "up_proj"] != storages[mlp + "down_proj"]
    assert all(
        torch.equal(model.get_submodule(n).weight.view(torch.uint8), w.view(torch.uint8))
        for n, w in weights.items()
    )
    assert _unique_bytes(model) == held
    assert torch.equal(model(ids).logits, before)  # the eager model reads the same numbers
    # another compile finds the stack, no copy; the model saves and loads back as it was
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=fp8compile.backend())(_ids(model, tokens=5))
    assert _storages(model) == storages
    model.save_pretrained(tmp_path)
    reloaded = fp8_checkpoint_files.load(tmp_path, torch.device("cpu"))
    assert torch.equal(reloaded(ids).logits, before)


def test_without_the_qkv_and_gate_up_fusions_checkpoint_linears_stay_one_gemm_each(transformers_kernels):
    model, _ = fp8_checkpoint()
    storages = _storages(model)
    fp8 = fp8compile.backend(fusions=("silu_mul",))
    with torch.no_grad():
        torch.compile(model, backend=fp8)(_ids(model))
    assert not [r for r in _linear_rewrites(fp8.report).values() if r.detail.startswith("one GEMM")]
    assert _storages(model) == storages


def test_without_the_silu_mul_fusion_a_down_projection_is_a_plain_fp8_linear(transformers_kernels):
    model, _ = fp8_checkpoint()
    fp8 = fp8compile.backend(fusions=())
    with torch.no_grad():
        torch.compile(model, backend=fp8)(_ids(model))
    assert [r.kind for r in fp8.report.rewrites] == ["linear"] * 14  # no fusion: no attention either


def test_quantize_checkpoint_bf16_puts_the_linears_the_checkpoint_left_in_fp8_too(transformers_kernels):
    model, _ = fp8_checkpoint()
    fp8 = fp8compile.backend(quantize_checkpoint_bf16=True)
    with torch.no_grad():
        torch.compile(model, backend=fp8)(_ids(model))
    names = list(_linear_rewrites(fp8.report))
    assert "lm_head" in names and len(names) == 15
    assert not [s for s in fp8.report.skips if s.kind == "linear"]


@pytest.mark.parametrize("mapped", [False, True], ids=["own storage", "mapped file"])
def test_a_checkpoint_with_its_bf16_linears_quantized_can_give_their_bf16_weights_back(
    transformers_kernels, mapped
):
    """quantize_checkpoint_bf16 with release_bf16_weights: the lm_head the checkpoint left in bf16
    is read through its FP8 copy only, so its bf16 weight leaves the device (the published
    checkpoint's floor, 0.566x the bf16 model's bytes for Llama-3-8B, comes down to its FP8
    weights, the lm_head's FP8 copy and the embedding); the checkpoint's own FP8 weights stay,
    and the logits are those of the same compile without the release. A weight that is a file
    mapped into memory (from_pretrained on the CPU) cannot be freed: it stays, and the compile
    goes on (it raised "Trying to resize storage that is not resizable" inside the backend). The
    merged q|k|v and gate|up read their scales stacked, made again from the scales at the first
    call: those scales stay too (released, that first call read freed memory: a crash on an
    H200, a segfault on the CPU)."""
    model, _ = fp8_checkpoint()
    head = model.lm_head.weight
    if not mapped:  # as on a GPU: the loader's tensors copied into memory of their own
        for p in model.parameters():
            p.data = p.data.clone()
    assert head.untyped_storage().resizable() is not mapped
    ids = _ids(model)
    with torch.no_grad():
        kept = torch.compile(model, backend=fp8compile.backend(quantize_checkpoint_bf16=True))(ids).logits
        torch._dynamo.reset()
        fp8compile.drop_fp8_weights()
        freed = fp8compile.backend(quantize_checkpoint_bf16=True, release_bf16_weights=True)
        try:
            logits = torch.compile(model, backend=freed)(ids).logits
            assert release.is_released(head) is not mapped
            assert (head.untyped_storage().nbytes() == 0) is not mapped
            for name in _fp8_linears(model):
                linear = model.get_submodule(name)
                assert not release.is_released(linear.weight)
                assert not release.is_released(linear.weight_scale_inv)
            assert not release.is_released(model.model.embed_tokens.weight)
        finally:
            fp8compile.restore_bf16_weights()
    assert "lm_head" in _linear_rewrites(freed.report)
    assert torch.equal(logits, kept)


def test_ue8m0_scales_are_read_as_fp32_copies_with_power_of_two_activation_scales(transformers_kernels):
    if E8M0_DTYPE is None:
        pytest.skip("this torch has no float8_e8m0fnu")
    model, dequantized = fp8_checkpoint(scale_fmt="ue8m0")
    assert model.model.layers[0].mlp.down_proj.weight_scale_inv.dtype == E8M0_DTYPE
    ids = _ids(model)
    fp8 = fp8compile.backend()
    with torch.no_grad():
        logits = torch.compile(model, backend=fp8)(ids).logits
        theirs, bf16 = model(ids).logits, dequantized(ids).logits
    assert len(_linear_rewrites(fp8.report)) == 14
    assert calc_diff(logits, bf16) <= 1.15 * calc_diff(theirs, bf16)


def test_a_checkpoint_linear_fp8compile_cannot_serve_stays_as_transformers_runs_it(transformers_kernels):
    model, _ = fp8_checkpoint(block=(64, 64))
    ids = _ids(model)
    fp8 = fp8compile.backend()
    with torch.no_grad():
        logits = torch.compile(model, backend=fp8)(ids).logits
        # transformers' own forward, as the graph runs without fp8compile: through Inductor where
        # fp8compile hands its graphs to Inductor (on a GPU machine), eagerly where not
        theirs = torch.compile(model, backend="inductor")(ids) if fp8.config.inductor else model(ids)
    assert not _linear_rewrites(fp8.report)
    reasons = {s.name: s.reason for s in fp8.report.skips if s.kind == "linear"}
    assert set(_fp8_linears(model)) <= set(reasons)
    assert all("[64, 64] blocks: fp8compile serves 128x128 blocks" in reasons[n] for n in _fp8_linears(model))
    assert calc_diff(logits, theirs.logits) < 1e-6


def test_a_checkpoint_linear_with_a_static_activation_scale_stays_as_transformers_runs_it(
    transformers_kernels,
):
    model, _ = fp8_checkpoint()
    down = model.model.layers[0].mlp.down_proj
    down.activation_scale = torch.nn.Parameter(torch.tensor(0.01), requires_grad=False)
    fp8 = fp8compile.backend()
    with torch.no_grad():
        torch.compile(model, backend=fp8)(_ids(model))
    reasons = {s.name: s.reason for s in fp8.report.skips if s.kind == "linear"}
    assert "static activation scale" in reasons["model.layers.0.mlp.down_proj"]
    assert len(_linear_rewrites(fp8.report)) == 13


def test_a_checkpoint_model_compiled_for_any_sequence_length_keeps_its_leading_dimensions(
    transformers_kernels,
):
    model, _ = fp8_checkpoint()
    fp8 = fp8compile.backend()
    compiled = torch.compile(model, backend=fp8, dynamic=True)
    with torch.no_grad():
        for tokens in (5, 9):
            ids = _ids(model, batch=3, tokens=tokens)
            logits = compiled(ids).logits
            assert logits.shape == (3, tokens, model.config.vocab_size)
            assert calc_diff(logits, model(ids).logits) < 2e-3
    assert any(r.m == "dynamic" for r in fp8.report.rewrites)


def test_an_error_in_the_checkpoint_pass_keeps_that_linear_as_transformers_runs_it(
    transformers_kernels, monkeypatch
):
    real = checkpoint_linear.rewrite

    def failing(ctx, node, a, name):
        if name == "model.layers.1.self_attn.o_proj":
            raise RuntimeError("injected")
        return real(ctx, node, a, name)

    monkeypatch.setattr(checkpoint_linear, "rewrite", failing)
    model, _ = fp8_checkpoint()
    ids = _ids(model)
    fp8 = fp8compile.backend()
    with torch.no_grad(), pytest.warns(UserWarning, match="error"):
        logits = torch.compile(model, backend=fp8)(ids).logits
    names = set(_linear_rewrites(fp8.report))
    assert "model.layers.1.self_attn.o_proj" not in names and len(names) == 13
    assert any(
        "injected" in s.reason and s.name == "model.layers.1.self_attn.o_proj" for s in fp8.report.skips
    )
    assert calc_diff(logits, model(ids).logits) < 2e-3


@gpu
@pytest.mark.parametrize("tokens", [1, 40])
def test_on_a_gpu_an_fp8_checkpoint_runs_fp8compiles_kernels_within_the_bound(transformers_kernels, tokens):
    model, dequantized = fp8_checkpoint()
    model, dequantized = model.cuda(), dequantized.cuda()
    ids = _ids(model, batch=2, tokens=tokens).cuda()
    fp8 = fp8compile.backend()
    with torch.no_grad():
        logits = torch.compile(model, backend=fp8)(ids).logits
        theirs, bf16 = model(ids).logits, dequantized(ids).logits
    rewritten = _linear_rewrites(fp8.report)
    assert len(rewritten) == 14
    assert all(kernel != "reference" for r in rewritten.values() for _, kernel in r.kernels)
    assert calc_diff(logits, bf16) <= 1.15 * calc_diff(theirs, bf16)


@gpu
def test_transformers_fp8_forward_runs_the_installed_deep_gemm_where_the_hub_does_not_load():
    # bench model's anchor on a machine offline: transformers' own FP8Linear forward, its DeepGEMM
    # branch on the deep_gemm wheel. Its logits answer to the same bound as the reference's.
    pytest.importorskip("deep_gemm")
    model, dequantized = fp8_checkpoint()
    model, dequantized = model.cuda(), dequantized.cuda()
    ids = _ids(model, batch=2, tokens=40).cuda()
    with torch.no_grad(), fp8_checkpoint_files.transformers_on_installed_deep_gemm(ids.device) as runs:
        assert runs == "hub" or runs.startswith("deep_gemm"), runs
        theirs = model(ids).logits
    with (
        torch.no_grad(),
        mock.patch.object(finegrained_fp8, "finegrained_fp8_linear", checkpoint_op.reference),
    ):
        with mock.patch.object(finegrained_fp8, "is_deepgemm_loadable", lambda: False):
            reference = model(ids).logits
        bf16 = dequantized(ids).logits
    assert calc_diff(theirs, bf16) <= 1.15 * calc_diff(reference, bf16)


def _moe_checkpoint():
    """A Qwen3-MoE as transformers writes it in FP8 (its routed experts as FP8Experts), and its
    dequantized bf16 model."""
    model, dequantized = fp8_checkpoint("qwen3_moe")
    experts = [m for m in model.modules() if isinstance(m, finegrained_fp8.FP8Experts)]
    assert len(experts) == model.config.num_hidden_layers
    assert all(e.gate_up_proj.dtype == e.down_proj.dtype == torch.float8_e4m3fn for e in experts)
    return model, dequantized, experts


def _transformers_fp8(model, ids):
    """transformers' own FP8 forward. Its grouped experts kernel comes from the Hub: here its
    per-expert loop runs, each expert's linears on its kernels' computation (the fixture)."""
    implementation = model.config._experts_implementation
    model.set_experts_implementation("eager")
    try:
        return model(ids).logits
    finally:
        model.set_experts_implementation(implementation)


def test_an_fp8_moe_checkpoints_experts_run_on_fp8compiles_moe_with_their_own_weights(transformers_kernels):
    model, dequantized, experts = _moe_checkpoint()
    ids = _ids(model)
    fp8 = fp8compile.backend()
    with torch.no_grad():
        logits = torch.compile(model, backend=fp8)(ids).logits
        theirs, bf16 = _transformers_fp8(model, ids), dequantized(ids).logits
    moe = {r.name: r for r in fp8.report.rewrites if r.kind == "moe"}
    assert set(moe) == {f"model.layers.{i}.mlp.experts" for i in range(len(experts))}
    assert all(r.detail.endswith("128x128 block scales, in place") for r in moe.values())
    # the op reads the checkpoint's tensors: its FP8 "copies" are the parameters themselves
    w13, scale = fp8compile.weights.fp8_experts(experts[0].gate_up_proj, gate_up="concat")
    assert w13 is experts[0].gate_up_proj and scale is experts[0].gate_up_proj_scale_inv
    merged = [r.name for r in _linear_rewrites(fp8.report).values() if r.detail.startswith("one GEMM")]
    assert {name.rsplit(".", 1)[1] for name in merged} == {"q_proj", "k_proj", "v_proj"}
    assert calc_diff(logits, bf16) <= 1.15 * calc_diff(theirs, bf16)


def test_release_bf16_weights_leaves_an_fp8_moe_checkpoints_tensors_on_the_device(transformers_kernels):
    """The MoE op reads the checkpoint's experts and scales as its FP8 copies, and the merged q|k|v
    their scales stacked again at the first call: release_bf16_weights frees none of them (every
    tensor in memory of its own, as on a GPU), and the logits are the same compile's without it."""
    model, _, experts = _moe_checkpoint()
    for p in model.parameters():
        p.data = p.data.clone()
    ids = _ids(model)
    with torch.no_grad():
        kept = torch.compile(model, backend=fp8compile.backend())(ids).logits
        torch._dynamo.reset()
        fp8compile.drop_fp8_weights()
        freed = fp8compile.backend(release_bf16_weights=True)
        try:
            logits = torch.compile(model, backend=freed)(ids).logits
            assert not [p for p in model.parameters() if release.is_released(p)]
        finally:
            fp8compile.restore_bf16_weights()
    assert freed.report.counts()["moe"] == len(experts)
    assert torch.equal(logits, kept)


def test_fp8_checkpoint_experts_the_moe_fusion_does_not_take_run_the_block_recipes_moe(transformers_kernels):
    model, dequantized, experts = _moe_checkpoint()
    ids = _ids(model)
    fp8 = fp8compile.backend(fusions=("qkv",))
    with torch.no_grad():
        logits = torch.compile(model, backend=fp8)(ids).logits
        theirs, bf16 = _transformers_fp8(model, ids), dequantized(ids).logits
    kept = {s.name: s.reason for s in fp8.report.skips if s.kind == "moe"}
    assert kept == {
        f"model.layers.{i}.mlp.experts": "the moe fusion is off (Fp8Config.fusions)" for i in range(2)
    }
    assert calc_diff(logits, bf16) <= 1.15 * calc_diff(theirs, bf16)


def test_fp8_checkpoint_experts_with_ue8m0_scales_are_left_to_transformers_implementation():
    # power-of-two scales ask for power-of-two activation scales, which the MoE op takes from
    # Fp8Config.e8m0 alone: such experts are not traced as fp8compile's op
    if E8M0_DTYPE is None:
        pytest.skip("this torch has no float8_e8m0fnu")
    _, _, (served, *_) = _moe_checkpoint()
    ue8m0, _ = fp8_checkpoint("qwen3_moe", scale_fmt="ue8m0")
    kept = next(m for m in ue8m0.modules() if isinstance(m, finegrained_fp8.FP8Experts))
    assert kept.gate_up_proj_scale_inv.dtype == E8M0_DTYPE
    assert checkpoints.served_experts(served) and not checkpoints.served_experts(kept)


def test_bench_points_transformers_fp8_experts_at_deep_gemm_only_where_its_linears_run_the_wheel():
    model, _, _ = _moe_checkpoint()
    default = model.config._experts_implementation
    assert fp8_checkpoint_files.experts_on_deep_gemm(model, "left as it is: no deep_gemm wheel") is None
    assert fp8_checkpoint_files.experts_on_deep_gemm(model, "hub") is None
    assert model.config._experts_implementation == default != "deepgemm"
    assert fp8_checkpoint_files.experts_on_deep_gemm(model, "deep_gemm 0.1.5 (installed wheel)") == "deepgemm"
    assert model.config._experts_implementation == "deepgemm"
    dense, _ = fp8_checkpoint()  # no experts: nothing to set
    assert fp8_checkpoint_files.experts_on_deep_gemm(dense, "deep_gemm 0.1.5 (installed wheel)") is None


def test_bench_model_runs_the_fp8_checkpoint_and_says_why_transformers_own_path_did_not_run(tmp_path, capsys):
    # No transformers_kernels fixture: on a CPU transformers' FP8 kernels do not load (a Hub
    # download), as on a GPU machine offline. Its eager forward fails, and so does generate()'s
    # eager prompt before fp8compile's decode step; through the user's own compile of the
    # forward (_own) the prompt runs on fp8compile's kernels too.
    from fp8compile.bench.model import bench_model
    from tests.conftest import TINY_BENCH

    names = ["transformers_fp8", "fp8_ckpt", "fp8_own_ckpt"]
    rows = bench_model(tmp_path, **TINY_BENCH, variants=names, repeat=1, prefill_batches=[1])
    errors = {r["variant"]: r["error"] for r in rows if r["kind"] == "error"}
    assert set(errors) == {"transformers_fp8", "fp8_ckpt"}
    # no deep_gemm to point transformers at on a CPU either: each row says so
    kernels = {r["transformers_kernel"] for r in rows if r["variant"] in names}
    assert kernels == {"left as it is: the model is on cpu"}
    assert all(e.startswith("ImportError") for e in errors.values())
    assert "transformers_fp8: did not run: ImportError" in capsys.readouterr().out
    (decoded,) = [r for r in rows if r["kind"] == "decode"]
    assert decoded["variant"] == "fp8_own_ckpt" and decoded["recompiles"] == 0
    # within the bound of the checkpoint's own composition: transformers' forward on its kernels'
    # computation (the checkpoint's quantization is transformers', not the bf16 composition's)
    accuracy = {r["variant"]: r["calc_diff"] for r in rows if r["kind"] == "accuracy"}
    assert 0 < accuracy["fp8_own_ckpt"] <= 1.15 * accuracy["fp8_ckpt_unfused_eager"]


def test_an_fp8_weight_read_other_than_through_fp8linear_is_reported_as_run_as_written():
    class OwnFP8(torch.nn.Module):  # a model's own FP8 layer, not transformers' FP8Linear
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(
                torch.randn(256, 256).to(torch.float8_e4m3fn), requires_grad=False
            )

        def forward(self, x):
            return x @ (self.weight.to(x.dtype) * 0.01).t()

    model, x = OwnFP8(), torch.randn(4, 256, dtype=torch.bfloat16)
    fp8 = fp8compile.backend()
    with torch.no_grad():
        out = torch.compile(model, backend=fp8)(x)
    assert calc_diff(out, model(x)) < 1e-6
    (kept,) = [s for s in fp8.report.skips if "FP8Linear" in s.reason]
    assert kept.name == "weight" and "read other than through transformers' FP8Linear" in kept.reason
    assert "traced as fp8compile::checkpoint_linear" in kept.reason  # the substitute is installed here


GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "checkpoint_gated_mlp.diff")


class _CheckpointMLP(torch.nn.Module):
    """A gated MLP of transformers' FP8Linear modules, as a block-FP8 checkpoint loads it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        for name, (n, k) in {"gate_proj": (256, 128), "up_proj": (256, 128), "down_proj": (128, 256)}.items():
            linear = finegrained_fp8.FP8Linear(k, n, block_size=(128, 128))
            weight, scale = quant_reference.quant_weight_block(randn(n, k, scale=0.02))
            linear.weight = torch.nn.Parameter(weight, requires_grad=False)
            linear.weight_scale_inv = torch.nn.Parameter(scale, requires_grad=False)
            setattr(self, name, linear)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def test_golden_graph_diff_of_an_fp8_checkpoints_gated_mlp(pass_diffs, transformers_kernels):
    """gate and up: checkpoint_linear -> qlinear on the checkpoint's own weight and scale
    placeholders; down: gated_qlinear over silu's two inputs, static M. Regenerate with
    FP8COMPILE_UPDATE_GOLDEN=1 after an intended change, and read the diff."""
    model, x = _CheckpointMLP(), randn(2, 3, 128)
    with torch.no_grad():
        out = torch.compile(model, backend=fp8compile.backend(), dynamic=False)(x)
        # the same FP8 operands both ways: accumulation order and bf16 rounding differ (measured
        # 4.6e-5 for the gated MLPs, 1.4e-4 for the experts, 2026-11-28)
        assert calc_diff(out, model(x)) < 5e-4
    (diff,) = pass_diffs
    assert diff == golden_text(GOLDEN, diff)


GOLDEN_EXPERTS = os.path.join(os.path.dirname(__file__), "golden", "checkpoint_experts.diff")


def test_golden_graph_diff_of_an_fp8_checkpoints_routed_experts(pass_diffs, transformers_kernels):
    """One Qwen3-MoE block of an FP8 checkpoint: checkpoint_experts -> fp8compile::moe on the
    checkpoint's own gate|up and down placeholders and their scales (static M: no dispatch); the
    router stays a bf16 linear. Regenerate with FP8COMPILE_UPDATE_GOLDEN=1 after an intended
    change, and read the diff."""
    model, _, _ = _moe_checkpoint()
    block, x = model.model.layers[0].mlp, randn(2, 3, model.config.hidden_size)
    with torch.no_grad():
        out = torch.compile(block, backend=fp8compile.backend(), dynamic=False)(x)
        model.set_experts_implementation("eager")  # transformers' per-expert loop (see _transformers_fp8)
        # the same FP8 operands both ways: accumulation order and bf16 rounding differ (measured
        # 4.6e-5 for the gated MLPs, 1.4e-4 for the experts, 2026-11-28)
        assert calc_diff(out, block(x)) < 5e-4
    (diff,) = pass_diffs
    assert diff == golden_text(GOLDEN_EXPERTS, diff)
