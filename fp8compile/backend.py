"""The torch.compile backend.

    torch.compile(model, backend="fp8")                          # entry point, default config
    torch.compile(model, backend="fp8", options={"e8m0": True})
    torch.compile(model, backend=fp8compile.backend(e8m0=True))

Flow per Dynamo graph: Inductor's compile_fx runs AOTAutograd; our inner compiler receives the
functionalised ATen inference graph, maps its placeholders to the real parameters Dynamo
passed, runs our passes (weights quantized here, once), then hands the graph to Inductor.

    torch.compile(model, backend="fp8", mode="reduce-overhead")  # Inductor's CUDA graphs, one per M

Outside a CUDA graph every call pays the host cost of the compiled graph, the M dispatch and
the kernel launches (BENCHMARKS.md, "Host cost"), which is more than a decode GEMM's GPU time.
mode="reduce-overhead" records the graph once per M and replays it; the report says per graph
whether CUDA graphs are on, and if not, why.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from . import kernel_analysis, size_conds
from .config import Fp8Config, make_config
from .report import Report, Skip

log = logging.getLogger("fp8compile")

_last_report: Report | None = None


def last_report() -> Report | None:
    """The report of the fp8 backend that compiled most recently in this process."""
    return _last_report


class Fp8Backend:
    """A torch.compile backend with a fixed Fp8Config; `.report` collects what every graph it
    compiled got (rewrites, skips with reasons, chosen kernels)."""

    def __init__(self, config: Fp8Config | dict | None = None, **options: Any):
        self.config = make_config(config, **options)
        self.report = Report(self.config)
        self.__name__ = "fp8"

    def __deepcopy__(self, memo: dict) -> Fp8Backend:
        # A backend is its config plus the report it fills; transformers' CompileConfig deep-copies
        # the backend it is given, and a copy would fill a report the user never sees.
        return self

    def __call__(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        *,
        options: dict | None = None,
        mode: str | None = None,
    ) -> Callable:
        global _last_report
        _last_report = self.report
        config = make_config(self.config, **options) if options else self.config
        self.report.config = config
        return compile_graph(gm, example_inputs, config, self.report, mode)


def compile_graph(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    config: Fp8Config,
    report: Report,
    mode: str | None = None,
) -> Callable:
    from torch._guards import detect_fake_mode
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    from .debug import DebugDump
    from .derived import CallWithDerivedInputs
    from .passes import GraphInputs, PassContext, run_passes

    patches = dict(list_mode_options(mode)) if mode else {}
    # With coordinate_descent_tuning on (mode="max-autotune", torchao's recommended Inductor
    # config, gpt-fast's), Inductor's decompositions turn a matmul of one row into a multiply and
    # a sum while AOTAutograd traces the graph, on any device but the CPU: every linear of a
    # graph of M = 1 would reach our passes as no matmul at all and stay bf16, silently. It is
    # off while the graph is traced; Inductor's compile of the rewritten graph gets the user's
    # setting back (inductor_compile).
    tuning = patches.get("coordinate_descent_tuning", torch._inductor.config.coordinate_descent_tuning)
    patches["coordinate_descent_tuning"] = False
    if hasattr(torch._inductor.config, "static_launch_user_defined_triton_kernels"):
        # For a graph compiled in this process (compile_threads=1); compile workers read the
        # environment (static_launch_for_user_kernels).
        patches["static_launch_user_defined_triton_kernels"] = True
    # raises to make Dynamo trace the frame again, if there are any to specialize
    _specialize_float_inputs(gm, arguments_too=bool(patches.get("triton.cudagraphs")))
    graph_index = report.graphs
    report.graphs += 1
    inputs = GraphInputs.from_dynamo(gm, example_inputs)
    dump = DebugDump(config.debug_dir) if config.debug_dir else None
    if dump:
        dump.dynamo(gm)

    cuda_graphs = bool(patches.get("triton.cudagraphs"))
    # a replayed CUDA graph pays no host time per call site: the branches' functions stay there
    inline_conds = config.inline_conds if config.inline_conds is not None else not cuda_graphs

    def inductor_compile(aten_gm: fx.GraphModule, aten_inputs: Sequence[Any], **kwargs: Any):
        if not config.inductor:
            from .eager_graph import eager_graph

            return eager_graph(aten_gm)
        inner = dict(coordinate_descent_tuning=tuning)
        if cuda_graphs and hasattr(torch._inductor.config, "graph_partition") and _partition_off(aten_gm):
            inner["graph_partition"] = False
        with torch._inductor.config.patch(inner):
            return compile_fx_inner(aten_gm, aten_inputs, **kwargs)

    def fp8_inner_compile(aten_gm: fx.GraphModule, aten_inputs: Sequence[Any], **kwargs: Any):
        def skip_graph(reason: str):
            report.skips.append(Skip("graph", f"graph {graph_index}", reason, graph_index))
            return inductor_compile(aten_gm, aten_inputs, **kwargs)

        if not kwargs.get("is_inference", False):
            if kwargs.get("is_backward", False):
                return inductor_compile(aten_gm, aten_inputs, **kwargs)
            warnings.warn(
                "fp8compile: this graph needs gradients, so it stays bf16 (FP8 ops are inference-only). "
                "Run the compiled model under torch.no_grad() or torch.inference_mode().",
                stacklevel=2,
            )
            return skip_graph(
                "needs gradients (training graph): run under torch.no_grad() or torch.inference_mode()"
            )
        bound = inputs.bind(aten_gm)
        if isinstance(bound, str):
            return skip_graph(f"cannot map graph inputs to the model's tensors: {bound}")
        fake_mode = detect_fake_mode(aten_inputs)
        rewrites_before = len(report.rewrites)
        ctx = PassContext(
            aten_gm,
            bound,
            config,
            report,
            graph_index,
            fake_mode,
            cuda_graphs=bool(patches.get("triton.cudagraphs")),
            parameters=inputs.parameter_nodes(bound),
            shards=inputs.shard_notes(bound),
        )
        if dump:
            dump.before(aten_gm)
        # As Dynamo gave it, for Inductor alone should it fail on the graph the passes made
        as_written = (_copy_graph_module(aten_gm), list(aten_inputs), dict(kwargs))
        try:
            faults = run_passes(ctx)
        except BaseException:
            _bring_back_released(ctx)
            raise
        if faults:
            _warn_faults(graph_index, faults)
        if dump:
            dump.after(aten_gm)
        _record_rank(report, graph_index, aten_gm)
        box = kwargs.get("cudagraphs")  # Inductor's: it turns False where CUDA graphs cannot be used
        asked = bool(getattr(box, "value", False))
        keep, dropped = ctx.drop_unused_inputs()
        if len(keep) < len(aten_inputs):
            position = {old: new for new, old in enumerate(keep)}
            kwargs["static_input_idxs"] = [
                position[i] for i in kwargs.get("static_input_idxs", ()) if i in position
            ]
            aten_inputs = [aten_inputs[i] for i in keep]
        if ctx.derived:
            # The FP8 copies of the weights are the graph's last inputs, static like the parameters.
            derived = ctx.derived_example_inputs()
            first = len(aten_inputs)
            kwargs["static_input_idxs"] = [
                *kwargs.get("static_input_idxs", ()),
                *range(first, first + len(derived)),
            ]
            aten_inputs = [*aten_inputs, *derived]
        if ctx.traced_launches:
            static_launch_for_user_kernels()
        try:
            compiled = inductor_compile(aten_gm, aten_inputs, **kwargs)
        except Exception as error:
            _bring_back_released(ctx)  # the graph as written reads every weight in bf16
            if config.strict or _control_flow(error) or len(report.rewrites) == rewrites_before:
                raise
            return _compile_as_written(
                report, graph_index, rewrites_before, error, as_written, inductor_compile
            )
        if config.release_bf16_weights:
            _release_weights(ctx, dropped)
        names = {node.name: name for node, (_, name) in bound.items() if name}
        report.cuda_graphs[graph_index] = (
            _cuda_graph_state(asked, bool(getattr(box, "value", False)), compiled, mode, names)
            if config.inductor or not asked
            else "off: Fp8Config(inductor=False) runs the rewritten graph as its ops, without Inductor"
        )
        if ctx.derived or len(keep) < len(bound):
            return CallWithDerivedInputs(compiled, ctx.derived, keep if len(keep) < len(bound) else None)
        return compiled

    # AOTAutograd's cache would skip our inner compiler on a hit, and with it the report (and
    # the compile-time weight quantization): it is off for graphs we compile. Inductor's FX
    # graph cache stays on; it keys the graph after our passes, which holds no weight values.
    with (
        torch._functorch.config.patch(enable_autograd_cache=False),
        size_conds.keep_cuda_graphs(),
        kernel_analysis.memoized(),
        size_conds.inline_branches() if inline_conds else contextlib.nullcontext(),
    ):
        compiled = compile_fx(gm, example_inputs, inner_compile=fp8_inner_compile, config_patches=patches)
    log.info("fp8compile graph %d: %s", graph_index, report.counts())
    return compiled


def _partition_off(gm: fx.GraphModule) -> bool:
    """Whether Inductor compiles this graph, asked for CUDA graphs, without graph partitioning
    (one CUDA graph for the whole graph, or none).

    Partitioning records CUDA graphs between the ops it cannot record, and a torch.cond is one:
    every FP8 op of the M dispatch would stay outside them, where recorded whole (per M) one graph
    replays them all. A graph with a CPU tensor input (transformers' cache position when the
    static cache is first filled inside the compiled call) stays whole too: partitioned, Inductor
    2.11's static launch of our Triton kernels crashed there (a segfault parsing the kernel's
    arguments, H200). Any other graph keeps Inductor's partitioning: without it CUDA graphs are
    recorded again for every new value of an int input, and a sliding-window cache passes its
    position as one that moves every decode step (Mistral-7B-v0.1's window: a recording per
    step, 10.6 tokens/s against bf16 Inductor's 331 at 2 layers of NeMo widths on an H200;
    BENCHMARKS.md, "Sliding windows"). Under CUDA graphs such a graph gets no conds
    (PassContext.moving_ints), so that it is partitioned too: partitioned around conds, Inductor
    2.11's CUDA-graph trees failed their memory-pool check ("storage data ptrs are not allocated
    in pool", H200)."""
    if any(True for _ in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.cond)):
        return True
    values = (node.meta.get("val") for node in gm.graph.find_nodes(op="placeholder"))
    return any(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in values)


def _copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """gm over a copy of its graph (node meta shared, shallow): what the passes change is not in it."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def _warn_faults(graph_index: int, faults) -> None:
    first = faults[0]
    where = f" at {first.site}" if first.site else ""
    warnings.warn(
        f"fp8compile: {len(faults)} error(s) in the passes on graph {graph_index}; what they concern "
        f"is kept as the model wrote it and the rest is rewritten (first: the {first.pass_name} pass"
        f"{where}: {first.error}). The report (fp8compile.explain) lists them; "
        "Fp8Config(strict=True) raises instead.",
        stacklevel=3,
    )


def _control_flow(error: Exception) -> bool:
    """Whether error is Dynamo's way of tracing again or giving up on a frame, not a failure."""
    from torch._dynamo import exc

    kinds = tuple(getattr(exc, name) for name in ("RestartAnalysis", "SkipFrame") if hasattr(exc, name))
    return isinstance(error, kinds)


def _compile_as_written(report, graph_index, rewrites_before, error, as_written, inductor_compile):
    """Inductor could not compile the graph our passes made: the graph as Dynamo gave it instead,
    its rewrites taken off the report and the reason on it."""
    log.warning("fp8compile: Inductor failed on rewritten graph %d", graph_index, exc_info=True)
    warnings.warn(
        f"fp8compile: Inductor could not compile graph {graph_index} as rewritten "
        f"({type(error).__name__}: {str(error)[:300]}); it runs as the model wrote it. "
        "Fp8Config(strict=True) raises instead.",
        stacklevel=3,
    )
    del report.rewrites[rewrites_before:]
    report.skips.append(
        Skip(
            "graph",
            f"graph {graph_index}",
            f"Inductor could not compile it as rewritten ({type(error).__name__}: {str(error)[:300]}): "
            "kept as the model wrote it",
            graph_index,
        )
    )
    gm, inputs, kwargs = as_written
    return inductor_compile(gm, inputs, **kwargs)


def _record_rank(report: Report, graph_index: int, gm: fx.GraphModule) -> None:
    """Under torch.distributed, the report's rank and a digest of the graph our passes made: its
    code with every subgraph's, numbers left out (a vocab-sharded embedding's offsets are this
    rank's own). Ranks that compiled the same program show the same digest."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    report.rank = (dist.get_rank(), dist.get_world_size())
    report.collectives[graph_index] = _collectives(gm)
    code = gm.print_readable(print_output=False, include_stride=True, include_device=True)
    code = re.sub(r"\b\d+(\.\d+)?(e-?\d+)?\b", "#", code)
    report.digests[graph_index] = hashlib.sha256(code.encode()).hexdigest()[:12]


def _collectives(gm: fx.GraphModule) -> dict[str, int]:
    """The functional collectives the graph holds (in its subgraphs too), by name: what a sharded
    model's all-reduces and gathers became, launched by Inductor with the graph (waits not
    counted), fp8compile's all-reduce among them."""
    found: Counter[str] = Counter()
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                target = getattr(node.target, "_schema", None) and node.target.name()
                if target and target.startswith("_c10d_functional::") and not target.endswith("wait_tensor"):
                    found[target.removeprefix("_c10d_functional::")] += 1
                elif target == "fp8compile::all_reduce":
                    found[FP8COMPILE_ALL_REDUCE] += 1
                elif target == "fp8compile::all_reduce_rms_norm":
                    found[FP8COMPILE_ALL_REDUCE_NORM] += 1
    return dict(found)


# the report's name for fp8compile::all_reduce (passes/all_reduce.py; which kernels it runs:
# Report.all_reduce_paths)
FP8COMPILE_ALL_REDUCE = "all_reduce (fp8compile's)"
# and fp8compile::all_reduce_rms_norm's (passes/all_reduce_norm.py)
FP8COMPILE_ALL_REDUCE_NORM = "all_reduce with the residual add and RMSNorm (fp8compile's)"


def _bring_back_released(ctx) -> None:
    """The parameters the passes released as they quantized (release_bf16_weights,
    passes/context.py) back on their device: a compile that fails, or falls back to the graph as
    written, leaves the model's weights where they were."""
    if ctx.released:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        from . import release

        with unset_fake_temporarily():
            release.resident(ctx.released)


def _release_weights(ctx, dropped: list[torch.Tensor]) -> None:
    """Fp8Config.release_bf16_weights: the parameters this graph reads in bf16 stay on their
    device (brought back if an earlier graph released them); those it dropped for their FP8
    copies are released (release.py)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from . import release

    values = [value for value, _ in ctx.inputs.values()]
    with_copies = {id(values[i]) for d in ctx.derived if d.memo for i in d.sources}
    with unset_fake_temporarily():  # real host buffers, not the compiler's fakes
        release.keep_resident(
            value for node, (value, _) in ctx.inputs.items() if node in ctx.parameters and node.users
        )
        freed = release.release(p for p in dropped if id(p) in with_copies and not ctx.is_shared(p))
    if freed:
        log.info("fp8compile graph %d: released %.2f GB of bf16 weights", ctx.graph_index, freed / 2**30)


STATIC_LAUNCH_ENV = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"


def static_launch_for_user_kernels() -> bool:
    """Have Inductor launch user-defined Triton kernels (the decode kernel it launches for us,
    passes/inline.py) through its static launcher; returns whether it will.

    Otherwise Inductor launches them through Triton's Python path (launch metadata, hooks):
    60.2 us of host time per linear at M = 1 where the static launcher takes 28.7 and bf16
    Inductor's cuBLAS call 33.2 (lent H100s, `bench host --chain 8`; BENCHMARKS.md). The choice
    is made where the kernel is compiled, mostly in Inductor's compile workers, which read
    their config from the environment when they start and are passed no config patch of ours.
    So the environment variable is set here, unless the user set it (their choice stands).
    Importing fp8compile calls this, before a compile starts the workers: workers already
    running (started by an earlier compile, say a bf16 model's) are shut down, and the next
    compile starts them again, which cost a Qwen3-MoE's first fp8 call 10 s (26.3 against
    16.3 s at 4 layers, H100; BENCHMARKS.md, "2026-11-25 (710a17a)")."""
    if STATIC_LAUNCH_ENV not in os.environ:
        os.environ[STATIC_LAUNCH_ENV] = "1"  # an Inductor without the static launcher ignores it
        # Not imported yet: no compile has started workers (and importing it here would cost
        # `import fp8compile` Inductor's imports, a second on a CPU machine).
        async_compile = sys.modules.get("torch._inductor.async_compile")
        if async_compile is not None and getattr(async_compile, "_pool_set", None):
            log.info(
                "fp8compile: restarting Inductor's compile workers so that they launch our Triton "
                "kernels statically (%s=1)",
                STATIC_LAUNCH_ENV,
            )
            async_compile.shutdown_compile_workers()
    if os.environ[STATIC_LAUNCH_ENV] != "1":
        return False
    config = sys.modules.get("torch._inductor.config")  # imported by every compile
    return config is None or hasattr(config, "static_launch_user_defined_triton_kernels")


def _specialize_float_inputs(gm: fx.GraphModule, arguments_too: bool) -> None:
    """Have Dynamo trace the frame again with the Python floats it passed as graph inputs made
    constants (guarded: a changed value recompiles), where there are any: those read from a
    module or an object (RMSNorm.variance_epsilon, attention.scaling, GPT-OSS's experts.alpha and
    .limit) always, the frame's own float arguments only when arguments_too (under CUDA graphs).

    At dynamic=True Dynamo passes such a float as a 0-d float64 CPU tensor input, read with
    .item() where it is used. The passes need a model's constants as constants: an activation's
    clamp limit and slope are part of what an FP8 op computes (GPT-OSS's experts stayed bf16 at
    dynamic=True, with no reason given), as they are in a graph of static shapes. A graph with a
    CPU input gets no CUDA graphs ("skipping cudagraphs due to cpu device (arg3_1)"), and an
    unused one still breaks the recording of a graph that follows another. bf16 Inductor gets
    around the first with graph partitioning, which our graphs run without (a torch.cond would
    be a partition boundary). A float the caller passes each call (a temperature, a scale) stays
    an input outside CUDA graphs, so that a new value does not recompile. Dynamo itself
    specializes floats it cannot turn into tensors by restarting the trace (TensorifyState): we
    ask it the same for these, with the same mechanism."""
    try:
        from torch._dynamo.exc import TensorifyScalarRestartAnalysis
        from torch._dynamo.source import LocalSource
        from torch._dynamo.symbolic_convert import TensorifyState
    except ImportError:  # a torch without the mechanism: the report says which input stops CUDA graphs
        return
    names = []
    for node in gm.graph.find_nodes(op="placeholder"):
        memo = getattr(node.meta.get("example_value"), "item_memo", None)
        name = getattr(getattr(getattr(memo, "node", None), "_expr", None), "name", None)
        source = getattr(node.meta.get("grapharg"), "source", None)
        if not arguments_too and (source is None or isinstance(source, LocalSource)):
            continue
        if name is not None and not TensorifyState.should_specialize(name):
            names.append(name)
    if names:
        log.info("fp8compile: specializing float inputs %s and tracing again", names)
        for name in names:
            TensorifyState.specialize(name)
        raise TensorifyScalarRestartAnalysis


# What to do about a known cause of "off", by the model input Inductor's reason names.
_CUDA_GRAPH_HINTS = (
    (
        re.compile(r"cpu device \(\w+ = [\w.]*cumulative_length"),
        "transformers' static cache was first filled inside this compiled call, so its position counter "
        "is still on the CPU and its keys and values are not static addresses: make the cache before "
        "the first call, StaticCache(config=model.config, max_cache_len=...).early_initialization(batch, "
        "kv_heads, head_dim, dtype, device), and pass it to generate() as past_key_values; or let "
        "generate() compile the decode step (compile_config=CompileConfig(...))",
    ),
)


def _cuda_graph_state(asked: bool, kept: bool, compiled: Any, mode: str | None, names: dict[str, str]) -> str:
    """One line for the report: are this graph's calls replayed from CUDA graphs, and if not, why.
    asked: the mode asked Inductor for them; kept: Inductor still had them after compiling;
    names: graph input name -> the model's name for it (Inductor's reasons name graph inputs)."""
    if not asked:
        if mode in (None, "default"):
            return (
                "off (default mode: every call pays its host cost; mode='reduce-overhead' records one per M)"
            )
        return f"off (mode={mode!r} does not ask for them)"
    if kept:
        return "on: Inductor records one per M and replays it"
    if "cuda" not in getattr(compiled, "device_types", {"cuda"}):
        return "off: the graph runs on no CUDA device"
    reason = getattr(compiled, "disabled_cudagraphs_reason", None)
    if reason:
        reason = re.sub(
            r"\b\w+\b",
            lambda m: f"{m[0]} = {names[m[0]]}" if m[0] in names else m[0],
            " ".join(reason.split()),
        )
        hints = [hint for pattern, hint in _CUDA_GRAPH_HINTS if pattern.search(reason)]
        return f"off: Inductor skipped them: {reason[:300]}" + "".join(f" ({hint})" for hint in hints)
    return "off: Inductor skipped them (it gave no reason)"


def fp8_backend(
    gm: fx.GraphModule, example_inputs: Sequence[Any], *, options: dict | None = None, mode: str | None = None
) -> Callable:
    """The `torch_dynamo_backends` entry point: backend="fp8" with the default config."""
    return _default_backend()(gm, example_inputs, options=options, mode=mode)


_DEFAULT: Fp8Backend | None = None


def _default_backend() -> Fp8Backend:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Fp8Backend()
    return _DEFAULT
