"""A model saved as an FP8 checkpoint the way such checkpoints are published (DeepSeek-V3,
Qwen3-*-FP8): transformers' `FineGrainedFP8Config` in config.json, every linear but those kept
(the lm_head) as an e4m3fn weight with one fp32 `weight_scale_inv` a 128x128 block (the factor
that dequantizes it; UE8M0 with scale_fmt="ue8m0"), the rest as it is. Loaded back through
transformers' own loader, it is what a user who downloads one gets, with no download.
"""

from __future__ import annotations

import contextlib
import importlib.util
import tempfile
from pathlib import Path
from unittest import mock

import torch

from ..numerics import E8M0_DTYPE
from ..ops.quant import reference as quant_reference


def quantized_state(
    model: torch.nn.Module, keep: tuple[str, ...] = ("lm_head",), scale_fmt: str = "float"
) -> dict[str, torch.Tensor]:
    """model's state dict with every nn.Linear's weight (but the modules named in keep) as its
    128x128 block-FP8 weight and weight_scale_inv."""
    state = dict(model.state_dict())
    stacked = [name for name, p in model.named_parameters() if p.dim() == 3 and ".experts." in name]
    if stacked:  # transformers' loader would make them FP8Experts, which need their FP8 tensors
        raise NotImplementedError(f"routed experts ({stacked[0]}, ...) are not written in FP8 here yet")
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name in keep:
            continue
        w8, scale = quant_reference.quant_weight_block(module.weight.detach(), e8m0=scale_fmt == "ue8m0")
        if w8.shape != module.weight.shape:
            raise ValueError(f"{name}: K={module.weight.shape[1]} is not a whole number of 128-wide blocks")
        state[f"{name}.weight"] = w8
        state[f"{name}.weight_scale_inv"] = scale.to(E8M0_DTYPE) if scale_fmt == "ue8m0" else scale
    return state


def save(model, path: str | Path, keep: tuple[str, ...] = ("lm_head",), scale_fmt: str = "float") -> Path:
    """Save model (a transformers PreTrainedModel) at path as a block-FP8 checkpoint."""
    from transformers import FineGrainedFP8Config

    path = Path(path)
    config = FineGrainedFP8Config(
        weight_block_size=(128, 128), scale_fmt=scale_fmt, modules_to_not_convert=list(keep)
    )
    model.config.quantization_config = config.to_dict()
    try:
        model.save_pretrained(path, state_dict=quantized_state(model, keep, scale_fmt))
    finally:
        del model.config.quantization_config
    return path


def load(path: str | Path, device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """The checkpoint at path through transformers' own loader, on device. transformers loads an
    FP8 checkpoint as FP8 modules only where a GPU is (it dequantizes to bf16 on a CPU): on a CPU
    it is told there is one, so that the CPU tests get the modules a GPU machine gets."""
    from transformers import AutoModelForCausalLM

    with contextlib.ExitStack() as stack:
        if not torch.cuda.is_available():
            stack.enter_context(mock.patch("torch.cuda.is_available", lambda: True))
            stack.enter_context(mock.patch("torch.cuda.get_device_capability", lambda *_: (9, 0)))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=str(device))
    return model.eval()


def round_trip(model, device: torch.device, keep: tuple[str, ...] = ("lm_head",), scale_fmt: str = "float"):
    """model saved as a block-FP8 checkpoint in a temporary folder and loaded back (load)."""
    with tempfile.TemporaryDirectory() as path:
        save(model, path, keep, scale_fmt)
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
