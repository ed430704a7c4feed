"""FP8 checkpoints as transformers loads them: Dynamo traces their linears as one op.

A model loaded from an FP8 checkpoint (`FineGrainedFP8Config`: DeepSeek-V3, Qwen3-*-FP8 and the
like) holds `FP8Linear` modules whose forward calls transformers' `fp8_linear`, which picks
DeepGEMM or a Triton kernel from the Hub at run time. Dynamo cannot trace that choice (on a
machine with neither, tracing it fails), and a traced graph would hold another library's kernel
calls where the passes look for a linear. So `install()` registers, with Dynamo only, a
substitute for `fp8_linear` that is one call of fp8compile::checkpoint_linear
(ops/linear/checkpoint.py) with the same arguments. Eager calls are untouched: the substitute
is what Dynamo traces, and the op's kernel is transformers' function itself. The checkpoint_linear
pass then puts the sites it can serve on fp8compile's FP8 linear, with the checkpoint's own
weights and scales (passes/checkpoint_linear.py). Likewise its routed experts (`FP8Experts`),
whose implementations transformers loads from the Hub: those fp8compile serves trace as
fp8compile::checkpoint_experts (ops/moe/checkpoint.py), which passes/checkpoint_experts.py puts
on fp8compile's MoE op. And a compressed-tensors FP8 checkpoint's `CompressedTensorsFP8Linear`
(install_compressed): its quantization and matmul trace as two ops that
passes/checkpoint_rowwise.py puts on fp8compile's rowwise linear; the decompress hook that
compressed-tensors leaves on such a model, which would convert it to an offloading Dynamo does
not trace, is dropped where it has nothing to decompress (install_idle_hook_drop).

The substitute is registered once a process, when both fp8compile and transformers' FP8
integration are imported, in either order (`install_when_imported`): a model's FP8 modules come
from that integration, so it is imported before any of them exists, and Dynamo traces nothing
before the model's first compiled call.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import inspect
import sys

import torch

MODULE = "transformers.integrations.finegrained_fp8"
# transformers' fp8_linear's parameters, in order, that the substitute passes on
PARAMETERS = (
    "input",
    "weight",
    "weight_scale_inv",
    "block_size",
    "bias",
    "activation_scale",
    "allow_deepgemm",
)

# "installed", "experts", "compressed", "idle_hook": None once installed, else why not
_state: dict[str, str | None] = {}


def install() -> str | None:
    """Register the substitute for transformers' fp8_linear with Dynamo; None once it is, else
    why not (transformers' FP8 integration not imported yet, or a fp8_linear this does not know)."""
    finegrained_fp8, why = _integration("installed", MODULE, "no FP8 checkpoint module exists yet")
    if finegrained_fp8 is None:
        return why
    original = getattr(finegrained_fp8, "fp8_linear", None)
    if original is None:
        return _remember("installed", f"{MODULE} has no fp8_linear")
    names = tuple(inspect.signature(original).parameters)
    if names != PARAMETERS:
        return _remember("installed", f"{MODULE}.fp8_linear takes {names}, not the {PARAMETERS} this knows")

    def fp8_linear(
        input,
        weight,
        weight_scale_inv,
        block_size=None,
        bias=None,
        activation_scale=None,
        allow_deepgemm=True,
    ):
        return torch.ops.fp8compile.checkpoint_linear(
            input, weight, weight_scale_inv, bias, activation_scale, block_size, allow_deepgemm
        )

    try:
        torch._dynamo.substitute_in_graph(original, skip_signature_check=True)(fp8_linear)
    except (TypeError, ValueError, AttributeError) as error:  # a torch that refuses it
        return _remember("installed", f"Dynamo does not take a substitute for fp8_linear: {error}")
    _state["experts"] = _install_experts(finegrained_fp8)
    return _remember("installed", None)


# transformers' FP8 experts implementations (ALL_FP8_EXPERTS_FUNCTIONS), each
# (self, hidden_states, top_k_index, top_k_weights) -> (T, H), that Dynamo traces as
# fp8compile::checkpoint_experts where the experts are ones fp8compile serves
EXPERTS_IMPLEMENTATIONS = (
    "fp8_grouped_mm_experts_forward",
    "fp8_batched_mm_experts_forward",
    "deepgemm_fp8_fp4_experts_forward",
)
EXPERTS_PARAMETERS = ("self", "hidden_states", "top_k_index", "top_k_weights")


def served_experts(experts) -> bool:
    """Whether fp8compile's MoE computes what these FP8Experts compute: e4m3fn weights in 128x128
    blocks with fp32 scales, dynamic activation scales, gate and up stacked, a silu, no bias, no
    clamp. (UE8M0 scales ask for power-of-two activation scales, which the MoE op takes from
    Fp8Config.e8m0 alone: such experts run transformers' own implementation.)"""
    return (
        experts.gate_up_proj.dtype == torch.float8_e4m3fn
        and experts.down_proj.dtype == torch.float8_e4m3fn
        and experts.gate_up_proj_scale_inv.dtype == experts.down_proj_scale_inv.dtype == torch.float32
        and list(experts.block_size or ()) == [128, 128]
        and experts.activation_scheme == "dynamic"
        and getattr(experts, "has_gate", True)
        and not getattr(experts, "has_bias", False)
        and getattr(experts, "limit", None) is None
        and getattr(experts, "swiglu_limit", None) is None
        and (isinstance(experts.act_fn, torch.nn.SiLU) or type(experts.act_fn).__name__ == "SiLUActivation")
    )


def _install_experts(finegrained_fp8) -> str | None:
    """Substitutes for transformers' FP8 experts implementations; None once installed, else why
    not. An experts module fp8compile does not serve runs the implementation itself (a copy of it:
    the original, called from its substitute, would be substituted again)."""
    import types

    for name in EXPERTS_IMPLEMENTATIONS:
        original = getattr(finegrained_fp8, name, None)
        if original is None:
            continue  # a transformers without this implementation
        if tuple(inspect.signature(original).parameters) != EXPERTS_PARAMETERS:
            return f"{MODULE}.{name} takes {tuple(inspect.signature(original).parameters)}"
        unsubstituted = types.FunctionType(
            original.__code__, original.__globals__, name, original.__defaults__, original.__closure__
        )

        def experts(self, hidden_states, top_k_index, top_k_weights, unsubstituted=unsubstituted):
            if not served_experts(self):
                return unsubstituted(self, hidden_states, top_k_index, top_k_weights)
            return torch.ops.fp8compile.checkpoint_experts(
                hidden_states,
                top_k_index,
                top_k_weights,
                self.gate_up_proj,
                self.gate_up_proj_scale_inv,
                self.down_proj,
                self.down_proj_scale_inv,
            )

        try:
            torch._dynamo.substitute_in_graph(original, skip_signature_check=True)(experts)
        except (TypeError, ValueError, AttributeError) as error:
            return f"Dynamo does not take a substitute for {name}: {error}"
    return None


COMPRESSED_MODULE = "transformers.integrations.compressed_tensors"


def install_compressed() -> str | None:
    """Register substitutes for the two steps of transformers' CompressedTensorsFP8Linear forward
    (a compressed-tensors FP8 checkpoint's linear, loaded with use_optimized_inference): its
    activation's quantization and its rowwise-scaled matmul, each one call of an fp8compile op
    (checkpoint_quant_rows, checkpoint_scaled_mm_rowwise). Dynamo inlines a module's forward
    itself, with no look-up a substitute could answer: the functions it calls are substituted.
    None once they are, else why not."""
    compressed_tensors, why = _integration(
        "compressed", COMPRESSED_MODULE, "no compressed-tensors FP8 module exists yet"
    )
    if compressed_tensors is None:
        return why
    expected = {
        "quantize_fp8_per_row": ("x",),
        "_scaled_mm_rowwise": ("input", "weight", "scale_a", "scale_b", "out_dtype", "bias"),
    }
    for name, parameters in expected.items():
        function = getattr(compressed_tensors, name, None)
        if function is None or tuple(inspect.signature(function).parameters) != parameters:
            return _remember(
                "compressed", f"{COMPRESSED_MODULE}.{name} is not the function {parameters} this knows"
            )

    def quantize_fp8_per_row(x):
        return torch.ops.fp8compile.checkpoint_quant_rows(x)

    def _scaled_mm_rowwise(input, weight, scale_a, scale_b, out_dtype, bias=None):
        return torch.ops.fp8compile.checkpoint_scaled_mm_rowwise(
            input, weight, scale_a, scale_b, out_dtype, bias
        )

    try:
        for substitute in (quantize_fp8_per_row, _scaled_mm_rowwise):
            original = getattr(compressed_tensors, substitute.__name__)
            torch._dynamo.substitute_in_graph(original, skip_signature_check=True)(substitute)
    except (TypeError, ValueError, AttributeError) as error:
        return _remember("compressed", f"Dynamo does not take a substitute for them: {error}")
    return _remember("compressed", None)


DECOMPRESS_MODULE = "compressed_tensors.compressors.model_compressors.model_compressor"


def install_idle_hook_drop() -> str | None:
    """Have compressed-tensors' ModelCompressor keep no decompress hook on a model it left nothing
    compressed in; None once it does, else why not.

    transformers' loader has the compressor compress a compressed-tensors checkpoint's model
    (compress_model), which leaves a forward pre-hook, `ct_decompress_hook`, to decompress it on
    its first forward. Where every quantized layer went to CompressedTensorsFP8Linear
    (use_optimized_inference), no module is left compressed, and all the hook does is convert the
    model to compressed-tensors' offloading (decompress_model's from_accelerate): every module's
    tensors behind an onload wrapper that Dynamo breaks on and recompiles over, so that nothing is
    rewritten. Such a hook is removed as it is added; a model with modules to decompress keeps its
    hook. Eager results do not change: the hook would have decompressed nothing."""
    model_compressor, why = _integration(
        "idle_hook", DECOMPRESS_MODULE, "no compressed-tensors model has been loaded yet"
    )
    if model_compressor is None:
        return why
    compressor = getattr(model_compressor, "ModelCompressor", None)
    add_hook = getattr(compressor, "add_decompress_hook", None)
    is_quantized = getattr(model_compressor, "is_module_quantized", None)
    if add_hook is None or is_quantized is None or not hasattr(compressor, "remove_decompression_hook"):
        return _remember(
            "idle_hook",
            f"{DECOMPRESS_MODULE} has no ModelCompressor.add_decompress_hook, remove_decompression_hook "
            "and is_module_quantized as this knows them",
        )

    if getattr(add_hook, "drops_idle_hooks", False):  # wrapped already (fp8compile imported anew)
        return _remember("idle_hook", None)

    @functools.wraps(add_hook)
    def add_decompress_hook(self, model):
        add_hook(self, model)
        if not any(is_quantized(module) for module in model.modules()):
            self.remove_decompression_hook(model)

    add_decompress_hook.drops_idle_hooks = True
    compressor.add_decompress_hook = add_decompress_hook
    return _remember("idle_hook", None)


# the module (transformers' integration, compressed-tensors') -> what installs fp8compile's part
INSTALLERS = {
    MODULE: install,
    COMPRESSED_MODULE: install_compressed,
    DECOMPRESS_MODULE: install_idle_hook_drop,
}


def install_when_imported() -> None:
    """Each installer now if its transformers integration is imported, else right after its import."""
    for module, installer in INSTALLERS.items():
        if module in sys.modules:
            installer()
        elif not any(isinstance(f, _AfterImport) and f.module == module for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterImport(module, installer))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `module` is imported, it has the finders after it find the
    module and makes its loader call installer() once the module has run; then it leaves
    sys.meta_path (a look-up that imports nothing leaves it in place)."""

    def __init__(self, module: str, installer):
        self.module = module
        self.installer = installer
        self._finding = False

    def find_spec(self, name, path, target=None):
        if name != self.module or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module, run=run):
            run(module)
            self.installer()
            if self in sys.meta_path:
                sys.meta_path.remove(self)

        spec.loader.exec_module = exec_module
        return spec


def _integration(key: str, module: str, absent: str):
    """(transformers' integration `module`, None) where its substitutes are still to install;
    (None, None) once they are (_state[key]); else (None, why not): not imported yet (absent says
    what that means), or not importable."""
    if key in _state and _state[key] is None:
        return None, None
    if module not in sys.modules:
        return None, f"{module} is not imported: {absent}"
    try:
        return importlib.import_module(module), None
    except ImportError as error:
        return None, _remember(key, f"{module} does not import: {error}")


def _remember(key: str, why: str | None) -> str | None:
    """why (None: installed) kept under key, and returned."""
    _state[key] = why
    return why


def status() -> str:
    """Whether FP8 checkpoint linears trace as fp8compile::checkpoint_linear here, or why not."""
    why = _state.get("installed", "not tried")
    return "traced as fp8compile::checkpoint_linear" if why is None else f"not traced as one op ({why})"


def experts_status() -> str:
    """Whether FP8 checkpoint experts trace as fp8compile::checkpoint_experts here, or why not."""
    if _state.get("installed", "not tried") is not None:
        return f"not traced as one op ({status()})"
    why = _state.get("experts")
    return "traced as fp8compile::checkpoint_experts" if why is None else f"not traced as one op ({why})"


def compressed_status() -> str:
    """Whether compressed-tensors FP8 linears trace as fp8compile's ops here, or why not."""
    why = _state.get("compressed", "not tried")
    return "traced as fp8compile::checkpoint_scaled_mm_rowwise" if why is None else f"not traced ({why})"
