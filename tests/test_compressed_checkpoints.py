"""compressed-tensors FP8 checkpoints as transformers loads them with use_optimized_inference
(CompressedTensorsFP8Linear: e4m3fn weights with one fp32 scale per output channel, activations
quantized per token): compiled with the fp8 backend, their linears run fp8compile's rowwise FP8
linear on the checkpoint's own tensors, whatever Fp8Config.recipe says; what it does not take
stays as transformers runs it, with the reason.

The modules are the ones transformers' loader puts in (as replace_with_compressed_tensors_fp8_linear
does), holding per-channel FP8 weights; and a checkpoint compressed-tensors writes to disk, read
back through transformers' loader (the compressed-tensors package, which the tests install).
torch._scaled_mm has no CPU kernel: transformers' rowwise matmul is given its computation in
PyTorch (ops/linear/checkpoint.py).
"""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

import fp8compile
from fp8compile import architectures, calc_diff, weights
from fp8compile.numerics import FP8_MAX
from fp8compile.ops.linear import checkpoint as checkpoint_op
from tests.conftest import golden_text, gpu

transformers = pytest.importorskip("transformers")
compressed = pytest.importorskip("transformers.integrations.compressed_tensors")
if not hasattr(compressed, "CompressedTensorsFP8Linear"):
    pytest.skip("this transformers has no CompressedTensorsFP8Linear", allow_module_level=True)


@pytest.fixture(autouse=True)
def scaled_mm_in_pytorch(request, monkeypatch):
    # beneath transformers' _scaled_mm_rowwise, which Dynamo traces as fp8compile's op; a GPU
    # test runs torch's own
    if request.node.get_closest_marker("gpu"):
        return
    monkeypatch.setattr(torch.nn.functional, "scaled_mm", checkpoint_op.scaled_mm_reference, raising=False)
    monkeypatch.setattr(torch, "_scaled_mm", checkpoint_op.scaled_mm_reference)


def compressed_checkpoint(arch: str = "llama"):
    """(the model with CompressedTensorsFP8Linear modules holding per-channel FP8 weights, the
    bf16 model of their dequantized weights); the lm_head stays bf16, as such checkpoints keep it."""
    model = architectures.build(arch).eval()
    loaded = copy.deepcopy(model)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    for name in names:  # what transformers' replace_with_compressed_tensors_fp8_linear puts in
        linear = model.get_submodule(name)
        loaded.set_submodule(
            name,
            compressed.CompressedTensorsFP8Linear(
                linear.in_features, linear.out_features, linear.bias is not None
            ),
        )
    dequantized = copy.deepcopy(model)
    for name in names:
        w = model.get_submodule(name).weight.detach().float()
        scale = w.abs().amax(1).clamp(min=1e-12) / FP8_MAX
        fp8 = loaded.get_submodule(name)
        fp8.weight = torch.nn.Parameter((w / scale[:, None]).to(torch.float8_e4m3fn), requires_grad=False)
        fp8.weight_scale = torch.nn.Parameter(scale[None, :], requires_grad=False)
        dense = fp8.weight.float() * scale[:, None]
        dequantized.get_submodule(name).weight.data = dense.to(model.dtype)
    return loaded.eval(), dequantized, names


def _ids(model):
    torch.manual_seed(1)
    return torch.randint(0, model.config.vocab_size, (2, 12))


def test_compressed_tensors_linears_run_fp8compiles_rowwise_linear_with_their_own_weights():
    model, dequantized, names = compressed_checkpoint()
    ids = _ids(model)
    fp8 = fp8compile.backend()  # the block recipe: the checkpoint's rowwise scales decide
    with torch.no_grad():
        logits = torch.compile(model, backend=fp8)(ids).logits
        theirs, bf16 = model(ids).logits, dequantized(ids).logits
    rewritten = {r.name: r for r in fp8.report.rewrites if r.kind in ("linear", "silu_mul")}
    assert sorted(rewritten) == sorted(names) and len(names) == 14
    assert all(
        r.recipe == "rowwise, dynamic" and "per-channel scales, in place" in r.detail
        for r in rewritten.values()
    )
    downs = {name for name in names if name.endswith("mlp.down_proj")}
    assert {name for name, r in rewritten.items() if r.kind == "silu_mul"} == downs
    (kept,) = [s for s in fp8.report.skips if s.kind == "linear"]
    assert kept.name == "lm_head" and "keeps it in bf16" in kept.reason
    assert calc_diff(logits, bf16) <= 1.15 * calc_diff(theirs, bf16)


def test_a_compressed_tensors_linear_fp8compile_does_not_take_stays_as_transformers_runs_it():
    model, dequantized, _ = compressed_checkpoint()
    ids = _ids(model)
    fp8 = fp8compile.backend(skip=("*.q_proj",))
    with torch.no_grad():
        logits = torch.compile(model, backend=fp8)(ids).logits
        theirs, bf16 = model(ids).logits, dequantized(ids).logits
    kept = {s.name: s.reason for s in fp8.report.skips if s.kind == "linear"}
    assert kept["model.layers.0.self_attn.q_proj"] == "matches skip pattern '*.q_proj'"
    assert calc_diff(logits, bf16) <= 1.15 * calc_diff(theirs, bf16)


def test_the_compressed_tensors_substitute_is_installed_after_its_integration_is_imported():
    code = "; ".join(
        [
            "import fp8compile",
            "from fp8compile import checkpoints",
            "print(checkpoints.compressed_status())",
            "import transformers.integrations.compressed_tensors",
            "print(checkpoints.compressed_status())",
        ]
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    before, after = done.stdout.strip().splitlines()[-2:]
    assert before.startswith("not traced")
    assert after == "traced as fp8compile::checkpoint_scaled_mm_rowwise"


GOLDEN = Path(__file__).parent / "golden" / "compressed_gated_mlp.diff"


class _CompressedMLP(torch.nn.Module):
    """A gated MLP of transformers' CompressedTensorsFP8Linear modules holding per-channel FP8
    weights, as a compressed-tensors checkpoint loads it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        for name, (n, k) in {"gate_proj": (256, 128), "up_proj": (256, 128), "down_proj": (128, 256)}.items():
            linear = compressed.CompressedTensorsFP8Linear(k, n, False)
            w = torch.randn(n, k) * 0.02
            scale = w.abs().amax(1) / FP8_MAX
            fp8 = (w / scale[:, None]).to(torch.float8_e4m3fn)
            linear.weight = torch.nn.Parameter(fp8, requires_grad=False)
            linear.weight_scale = torch.nn.Parameter(scale[None, :], requires_grad=False)
            setattr(self, name, linear)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def test_golden_graph_diff_of_a_compressed_tensors_gated_mlp(pass_diffs):
    """gate and up: the matmul over checkpoint_quant_rows(x) and the transposed FP8 weight ->
    qlinear_scaled, rowwise, on the checkpoint's own weight and per-channel scale; down:
    gated_qlinear_scaled over silu's two inputs; static M. Regenerate with
    FP8COMPILE_UPDATE_GOLDEN=1 after an intended change, and read the diff."""
    model, x = _CompressedMLP(), torch.randn(2, 3, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        out = torch.compile(model, backend=fp8compile.backend(), dynamic=False)(x)
        # the same FP8 operands both ways: accumulation order and bf16 rounding differ (measured
        # 4.6e-5 for the gated MLPs, 1.4e-4 for the experts, 2026-11-28)
        assert calc_diff(out, model(x)) < 5e-4
    (diff,) = pass_diffs
    assert diff == golden_text(GOLDEN, diff)


def write_checkpoint(folder, preset: str):
    """A tiny Llama written to folder by compressed-tensors itself, as such checkpoints are
    published: FP8_DYNAMIC (per-channel FP8 weights, per-token dynamic activations) or FP8_BLOCK
    (128x128 weight blocks, dynamic 1x128 activation groups), the lm_head left out."""
    quantization = pytest.importorskip("compressed_tensors.quantization")
    compressors = pytest.importorskip("compressed_tensors.compressors")
    model = architectures.build("llama").eval()
    scheme = quantization.preset_name_to_scheme(preset, ["Linear"])
    config = quantization.QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    quantization.apply_quantization_config(model, config)
    for module in model.modules():
        if hasattr(module, "weight_scale"):  # what a calibration would set: each row's or block's amax
            w = module.weight.detach().float().abs()
            if scheme.weights.strategy == "block":
                n, k = w.shape
                amax = w.reshape(n // 128, 128, k // 128, 128).amax((1, 3))
            else:
                amax = w.amax(1, keepdim=True)
            module.weight_scale.data = (amax.clamp(min=1e-12) / FP8_MAX).to(module.weight_scale.dtype)
    compressor = compressors.ModelCompressor.from_pretrained_model(
        model, quantization_format="float-quantized"
    )
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoint_on_disk(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("compressed_llama"), "FP8_DYNAMIC")


def _load(folder, monkeypatch, **options):
    # transformers takes use_optimized_inference only where it finds FP8 matmul hardware: the
    # CPU is answered as an XPU for the load, and the matmul runs in PyTorch (the fixture above)
    with monkeypatch.context() as patch:
        patch.setattr(torch.xpu, "is_available", lambda: True)
        config = transformers.CompressedTensorsConfig(**options)
        return transformers.AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=config, dtype=torch.bfloat16
        ).eval()


def test_a_compressed_tensors_checkpoint_read_from_disk_is_rewritten_whole(checkpoint_on_disk, monkeypatch):
    """compressed-tensors' decompress hook, left on a model with nothing to decompress, would turn
    it into compressed-tensors' offloading on its first forward, which Dynamo breaks on and
    recompiles over: nothing was rewritten. fp8compile has it dropped as the loader adds it."""
    model = _load(checkpoint_on_disk, monkeypatch, use_optimized_inference=True)
    assert isinstance(model.model.layers[0].mlp.down_proj, compressed.CompressedTensorsFP8Linear)
    assert not hasattr(model, "ct_decompress_hook") and not model._forward_pre_hooks
    ids = _ids(model)
    fp8 = fp8compile.backend()
    compiled = torch.compile(model, backend=fp8)
    with torch.no_grad():
        logits = compiled(ids).logits
        graphs = fp8.report.graphs
        again = compiled(ids).logits
        theirs = model(ids).logits
    rewritten = [r.name for r in fp8.report.rewrites if r.kind in ("linear", "silu_mul")]
    assert len(rewritten) == 14 and fp8.report.graphs == graphs  # all of them; no recompile
    assert torch.equal(logits, again)
    # the same FP8 operands as transformers' forward, accumulated in another order: measured
    # 3.9e-4 on this two-layer model (2026-11-28); 5e-4 holds a gated MLP's alone (above)
    assert calc_diff(logits, theirs) < 1e-3


def test_a_model_with_modules_to_decompress_keeps_compressed_tensors_decompress_hook(
    checkpoint_on_disk, monkeypatch
):
    model = _load(checkpoint_on_disk, monkeypatch, use_optimized_inference=False, dequantize=False)
    assert hasattr(model, "ct_decompress_hook")


def test_a_block_compressed_tensors_checkpoint_loaded_dense_runs_on_its_own_fp8_values(tmp_path, monkeypatch):
    """transformers 5.24 keeps FP8 only for per-channel and per-tensor compressed-tensors
    checkpoints (CompressedTensorsFP8Linear): a 128x128-block one loaded with
    use_optimized_inference fails in its scale conversion. Loaded dequantized, it is a bf16 model,
    and fp8compile's block recipe quantizes each weight back to the very FP8 values and blocks the
    checkpoint holds: dequantizing a block and quantizing it again gives back its values."""
    folder = write_checkpoint(tmp_path, "FP8_BLOCK")
    model = _load(folder, monkeypatch, dequantize=True)
    down = model.model.layers[0].mlp.down_proj
    assert down.weight.dtype == torch.bfloat16 and not hasattr(model, "ct_decompress_hook")
    ids = _ids(model)
    fp8 = fp8compile.backend(skip=("lm_head",))  # bf16 in the checkpoint
    with torch.no_grad():
        logits = torch.compile(model, backend=fp8)(ids).logits
        bf16 = model(ids).logits
    stored = safetensors.torch.load_file(folder / "model.safetensors")
    quantized = {key.removesuffix(".weight_scale") for key in stored if key.endswith(".weight_scale")}
    assert {r.name for r in fp8.report.rewrites} == quantized and len(quantized) == 14
    for name, module in model.named_modules():
        if name + ".weight_scale" in stored:
            ours, _ = weights.fp8_weight(module.weight)
            theirs = stored[name + ".weight"]
            assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8)), name
    # the weights are the checkpoint's own: what differs from the bf16 forward of its dequantized
    # weights is the activations' 1x128 FP8 quantization, which the checkpoint asks for (measured
    # 9.7e-4 on this model, 2026-11-28; the bound is twice that)
    assert calc_diff(logits, bf16) < 2e-3


@gpu
@pytest.mark.parametrize("batch, tokens", [(16, 1), (2, 40)])
def test_on_a_gpu_a_compressed_tensors_checkpoint_runs_fp8compiles_kernels_within_the_bound(
    checkpoint_on_disk, batch, tokens
):
    """Read from disk on a GPU (transformers' own hardware check; torch's rowwise scaled_mm in its
    forward): every linear on fp8compile's rowwise kernels, the logits as close to the bf16 model
    of the checkpoint's dequantized weights (its load with dequantize=True) as transformers' own
    FP8 forward, within 1.15x (the FP8 checkpoint tests' bound). Decode on 16 sequences: the two
    paths' FP8 roundings part after the first layer, and 2 rows of logits made a noisy ratio (1.63x
    and 1.03x at 2 x 1 and 2 x 40 tokens on an H200, 2026-11-28)."""
    load = transformers.AutoModelForCausalLM.from_pretrained
    options = dict(dtype=torch.bfloat16, device_map="cuda")
    config = transformers.CompressedTensorsConfig(use_optimized_inference=True)
    model = load(checkpoint_on_disk, quantization_config=config, **options).eval()
    dense = transformers.CompressedTensorsConfig(dequantize=True)
    dequantized = load(checkpoint_on_disk, quantization_config=dense, **options).eval()
    assert isinstance(model.model.layers[0].mlp.down_proj, compressed.CompressedTensorsFP8Linear)
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens), device="cuda")
    fp8 = fp8compile.backend()
    with torch.no_grad():
        logits = torch.compile(model, backend=fp8)(ids).logits
        theirs, bf16 = model(ids).logits, dequantized(ids).logits
    rewritten = [r for r in fp8.report.rewrites if r.kind in ("linear", "silu_mul")]
    assert len(rewritten) == 14
    assert all(kernel != "reference" for r in rewritten for _, kernel in r.kernels)
    print(
        f"calc_diff against bf16: fp8compile {calc_diff(logits, bf16):.3e}, transformers' "
        f"{calc_diff(theirs, bf16):.3e}; against transformers' {calc_diff(logits, theirs):.3e}"
    )
    assert calc_diff(logits, bf16) <= 1.15 * calc_diff(theirs, bf16)
