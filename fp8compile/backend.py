"""The torch.compile backend.

    torch.compile(model, backend="fp8")                          # entry point, default config
    torch.compile(model, backend="fp8", options={"e8m0": True})
    torch.compile(model, backend=fp8compile.backend(e8m0=True))

Flow per Dynamo graph: Inductor's compile_fx runs AOTAutograd; our inner compiler receives the
functionalised ATen inference graph, maps its placeholders to the real parameters Dynamo
passed, runs our passes (weights quantized here, once), then hands the graph to Inductor.
"""
from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

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

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], *, options: dict | None = None,
                 mode: str | None = None) -> Callable:
        global _last_report
        _last_report = self.report
        config = make_config(self.config, **options) if options else self.config
        self.report.config = config
        return compile_graph(gm, example_inputs, config, self.report, mode)


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], config: Fp8Config, report: Report,
                  mode: str | None = None) -> Callable:
    from torch._guards import detect_fake_mode
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    from .debug import DebugDump
    from .passes import GraphInputs, PassContext, run_passes

    graph_index = report.graphs
    report.graphs += 1
    inputs = GraphInputs.from_dynamo(gm, example_inputs)
    dump = DebugDump(config.debug_dir) if config.debug_dir else None
    if dump:
        dump.dynamo(gm)

    def fp8_inner_compile(aten_gm: fx.GraphModule, aten_inputs: Sequence[Any], **kwargs: Any):
        def skip_graph(reason: str):
            report.skips.append(Skip("graph", f"graph {graph_index}", reason, graph_index))
            return compile_fx_inner(aten_gm, aten_inputs, **kwargs)

        if not kwargs.get("is_inference", False):
            if kwargs.get("is_backward", False):
                return compile_fx_inner(aten_gm, aten_inputs, **kwargs)
            warnings.warn(
                "fp8compile: this graph needs gradients, so it stays bf16 (FP8 ops are inference-only). "
                "Run the compiled model under torch.no_grad() or torch.inference_mode().",
                stacklevel=2,
            )
            return skip_graph("needs gradients (training graph): run under torch.no_grad() or torch.inference_mode()")
        bound = inputs.bind(aten_gm)
        if isinstance(bound, str):
            return skip_graph(f"cannot map graph inputs to the model's tensors: {bound}")
        fake_mode = detect_fake_mode(aten_inputs)
        ctx = PassContext(aten_gm, bound, config, report, graph_index, fake_mode)
        if dump:
            dump.before(aten_gm)
        run_passes(ctx)
        if dump:
            dump.after(aten_gm)
        return compile_fx_inner(aten_gm, aten_inputs, **kwargs)

    patches = dict(list_mode_options(mode)) if mode else {}
    # AOTAutograd's cache would skip our inner compiler on a hit, and with it the report (and
    # the compile-time weight quantization): it is off for graphs we compile. Inductor's FX
    # graph cache stays on; it keys the graph after our passes, which holds no weight values.
    with torch._functorch.config.patch(enable_autograd_cache=False):
        compiled = compile_fx(gm, example_inputs, inner_compile=fp8_inner_compile, config_patches=patches)
    log.info("fp8compile graph %d: %s", graph_index, report.counts())
    return compiled


def fp8_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], *, options: dict | None = None,
                mode: str | None = None) -> Callable:
    """The `torch_dynamo_backends` entry point: backend="fp8" with the default config."""
    return _default_backend()(gm, example_inputs, options=options, mode=mode)


_DEFAULT: Fp8Backend | None = None


def _default_backend() -> Fp8Backend:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Fp8Backend()
    return _DEFAULT
