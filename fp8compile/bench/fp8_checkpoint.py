"""A model saved as an FP8 checkpoint the way transformers writes one (DeepSeek-V3's recipe, as
Qwen3-*-FP8 and others publish it): `FineGrainedFP8Config` in config.json, every linear and
routed-expert projection but those kept (the lm_head) as e4m3fn weights with one fp32
`weight_scale_inv` a 128x128 block (the factor that dequantizes it; UE8M0 with
scale_fmt="ue8m0"), the rest as it is. transformers quantizes the model as it loads it with that
config and saves what it loaded: its own quantizer and its own file layout. Loaded back through
its loader, it is what a user who downloads one gets, with no download.
"""

from __future__ import annotations

import contextlib
import importlib.util
import tempfile
from pathlib import Path
from unittest import mock

import torch


@contextlib.contextmanager
def _fp8_modules_on_any_device():
    """transformers loads an FP8 checkpoint as FP8 modules only where a GPU is (it dequantizes to
    bf16 on a CPU, and refuses to quantize there): on a CPU it is told there is one, so that the
    CPU tests get the modules a GPU machine gets."""
    with contextlib.ExitStack() as stack:
        if not torch.cuda.is_available():
            stack.enter_context(mock.patch("torch.cuda.is_available", lambda: True))
            stack.enter_context(mock.patch("torch.cuda.get_device_capability", lambda *_: (9, 0)))
        yield


def save(
    model, path: str | Path, keep: tuple[str, ...] = ("lm_head",), scale_fmt: str = "float", device=None
) -> Path:
    """Save model (a transformers PreTrainedModel) at path as a block-FP8 checkpoint, quantized by
    transformers on `device` (the model's by default)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    path = Path(path)
    device = torch.device(device or next(model.parameters()).device)
    config = FineGrainedFP8Config(
        weight_block_size=(128, 128), scale_fmt=scale_fmt, modules_to_not_convert=list(keep)
    )
    with tempfile.TemporaryDirectory() as bf16, _fp8_modules_on_any_device():
        model.save_pretrained(bf16)
        quantized = AutoModelForCausalLM.from_pretrained(
            bf16, dtype=model.dtype, device_map=str(device), quantization_config=config
        )
        quantized.save_pretrained(path)
    return path


def load(path: str | Path, device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """The checkpoint at path through transformers' own loader, on device."""
    from transformers import AutoModelForCausalLM

    with _fp8_modules_on_any_device():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=str(device))
    return model.eval()


def round_trip(model, device: torch.device, keep: tuple[str, ...] = ("lm_head",), scale_fmt: str = "float"):
    """model saved as a block-FP8 checkpoint in a temporary folder and loaded back (load)."""
    with tempfile.TemporaryDirectory() as path:
        save(model, path, keep, scale_fmt, device)
        return load(path, device, model.dtype)


# What transformers' DeepGEMM integration reads off the Kernel Hub's deep-gemm build (deepgemm.py,
# _load_deepgemm_kernel): the deep_gemm wheel exposes the same entry points.
_DEEP_GEMM_ENTRY_POINTS = (
    "fp8_fp4_gemm_nt",
    "m_grouped_fp8_fp4_gemm_nt_contiguous",
    "transform_sf_into_required_layout",
    "get_mk_alignment_for_contiguous_layout",
)


@contextlib.contextmanager
def transformers_on_installed_deep_gemm(device: torch.device):
    """transformers' FP8 forward (`fp8_linear`) runs DeepGEMM where its Kernel Hub build loads
    (the `kernels` package, and the Hub) and a Triton kernel, from the Hub too, otherwise. On a
    machine offline neither loads and transformers' FP8 path cannot run at all. Where the
    deep_gemm wheel is installed, this points transformers' DeepGEMM branch at it: the library
    the Hub build packages, reached through transformers' own code (its activation cast, its
    scale layout, its dispatch), so that the anchor is transformers' fast path as a user with the
    Hub gets it. Yields what transformers' FP8 forward runs: "hub" (its own kernels load, nothing
    patched), "deep_gemm X (installed wheel)", or why it is left as it is (a model on the CPU:
    DeepGEMM is CUDA's)."""
    try:
        from transformers.integrations import deepgemm, hub_kernels
    except ImportError as error:  # a transformers without the DeepGEMM integration
        yield f"left as it is: {error}"
        return
    if device.type != "cuda":
        yield f"left as it is: the model is on {device.type}"
        return
    if deepgemm.is_deepgemm_loadable():
        yield "hub"
        return
    if importlib.util.find_spec("deep_gemm") is None:
        yield "left as it is: no deep_gemm wheel"
        return
    import deep_gemm

    missing = [name for name in _DEEP_GEMM_ENTRY_POINTS if not hasattr(deep_gemm, name)]
    if missing:
        yield f"left as it is: deep_gemm lacks {', '.join(missing)}"
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(deepgemm, "is_kernels_available", lambda *_, **__: True))
        stack.enter_context(mock.patch.dict(hub_kernels._KERNEL_MODULE_MAPPING, {"deep-gemm": deep_gemm}))
        stack.enter_context(mock.patch.object(deepgemm, "_DEEPGEMM", None))  # loaded afresh, and forgotten
        if not deepgemm.is_deepgemm_loadable():  # the toolkit DeepGEMM compiles with: transformers' check
            yield "left as it is: transformers finds no CUDA toolkit for DeepGEMM"
            return
        yield f"deep_gemm {getattr(deep_gemm, '__version__', '?')} (installed wheel)"


@contextlib.contextmanager
def transformers_computation(model):
    """transformers' FP8 forward of model with its kernels' computation in PyTorch
    (ops/linear/checkpoint.py, reference) and its experts in their per-expert loop: what the
    checkpoint computes, on any machine. The eager composition the compiled checkpoint answers to
    (a checkpoint's own quantization is transformers', not fp8compile's)."""
    from transformers.integrations import finegrained_fp8

    from ..ops.linear import checkpoint as checkpoint_op

    implementation = getattr(model.config, "_experts_implementation", None)
    has_experts = any(isinstance(m, finegrained_fp8.FP8Experts) for m in model.modules())
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            mock.patch.object(finegrained_fp8, "finegrained_fp8_linear", checkpoint_op.reference)
        )
        stack.enter_context(mock.patch.object(finegrained_fp8, "is_deepgemm_loadable", lambda: False))
        if has_experts:
            model.set_experts_implementation("eager")
            stack.callback(model.set_experts_implementation, implementation)
        yield


def experts_on_deep_gemm(model, transformers_kernel: str) -> str | None:
    """Where model holds FP8Experts and transformers' FP8 forward runs the installed deep_gemm
    (transformers_on_installed_deep_gemm's answer), its experts are set to transformers'
    "deepgemm" implementation: their default, grouped_mm, takes a Triton kernel from the Hub,
    which does not load there either. Returns the implementation set, or None."""
    from transformers.integrations import finegrained_fp8

    if not transformers_kernel.startswith("deep_gemm"):
        return None
    if not any(isinstance(m, finegrained_fp8.FP8Experts) for m in model.modules()):
        return None
    model.set_experts_implementation("deepgemm")
    return "deepgemm"
