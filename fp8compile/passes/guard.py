"""No pass fails a compile: an exception at one site leaves that site as the model wrote it.

A pass does its work site by site (one linear, gated MLP, MoE block, attention, ...), each inside
`PassContext.at_site(name, work)`. An exception raised there becomes a SiteFailure that names the
pass and the site; one raised elsewhere in a pass names the pass alone. `run_guarded` then puts
the graph and what the passes recorded back as they were before the first pass (Snapshot), and
runs the passes again without that site, or without that pass on this graph where it failed
outside a site or at MAX_SITE_FAILURES sites (an error that repeats at every layer would
otherwise cost one run of the passes per layer). So a half-rewritten site never reaches Inductor,
and the FP8 copies a run made go with it (an out-of-memory error while making them would
otherwise leave them holding the memory the model then runs in; its reason names
release_bf16_weights, which makes them one at a time).
Each fault is one Skip on the report, with the pass, the site and the exception, and the backend
warns once per graph (backend.py). Fp8Config(strict=True) re-raises instead.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch.fx as fx

from .. import registry, weights
from .context import PassContext, SiteFailure

log = logging.getLogger("fp8compile")

# Sites one pass may fail at in one graph before it is left out of that graph altogether.
MAX_SITE_FAILURES = 2
# What a site's out-of-memory error says besides: where the FP8 copies do not fit beside the bf16
# weights, releasing each bf16 weight as its copy is made needs room for one weight's copy at a time.
OUT_OF_MEMORY_HINT = (
    "the device ran out of memory making the FP8 copies beside the bf16 weights; "
    "Fp8Config(release_bf16_weights=True) moves each bf16 weight to host memory as its copy is made"
)


@dataclasses.dataclass(frozen=True)
class Fault:
    """A pass's exception, and what was left out for it: one site, or (site None) the whole pass."""

    pass_name: str
    site: str | None
    error: str

    def reason(self) -> str:
        where = "at this site" if self.site else "on this graph, so the pass was left out of it"
        said = f"{self.pass_name} pass error {where} ({self.error}): kept as the model wrote it"
        if self.error.startswith("OutOfMemoryError"):
            said += f"; {OUT_OF_MEMORY_HINT}"
        return said


@dataclasses.dataclass
class Snapshot:
    """The graph and the passes' records as they were before the first pass: restore() puts them
    back in place, in the same graph object, with the same placeholder nodes (the context and the
    backend key the graph's inputs by them)."""

    graph: fx.Graph  # a copy
    placeholders: dict[fx.Node, fx.Node]  # the copy's placeholder -> the live graph's
    output_meta: dict
    modules: set[str]
    rewrites: int
    skips: int

    @classmethod
    def take(cls, ctx: PassContext) -> Snapshot:
        live = ctx.gm.graph
        copy, val_map = fx.Graph(), {}
        out, output = copy.graph_copy(live, val_map, return_output_node=True)
        copy.output(out)
        placeholders = {val_map[node]: node for node in live.find_nodes(op="placeholder")}
        report = ctx.report
        return cls(
            copy,
            placeholders,
            dict(output.meta),
            set(ctx.gm._modules),
            len(report.rewrites),
            len(report.skips),
        )

    def restore(self, ctx: PassContext) -> None:
        graph = ctx.gm.graph
        keep = set(self.placeholders.values())
        doomed = [node for node in graph.nodes if node not in keep]
        for node in doomed:  # unlink first: a failed pass may have left any order behind
            node.args, node.kwargs = (), {}
        for node in reversed(doomed):
            graph.erase_node(node)
        _forget_names(graph)
        out = graph.graph_copy(self.graph, dict(self.placeholders))
        graph.output(out).meta.update(self.output_meta)
        for name in set(ctx.gm._modules) - self.modules:  # branch modules of the M dispatch
            delattr(ctx.gm, name)
        del ctx.report.rewrites[self.rewrites :], ctx.report.skips[self.skips :]
        ctx.start_over()


def _forget_names(graph: fx.Graph) -> None:
    """Free the names of the nodes erased from graph: the nodes copied back take their names
    again (a site named after its node is the same site on the next run), not "name_1"."""
    try:
        from torch.fx.graph import _Namespace

        names = _Namespace()
        for node in graph.nodes:
            names.create_name(node.name, None)
        graph._graph_namespace = names
    except (ImportError, AttributeError):  # a torch without them: the copies get fresh names
        pass


def run_guarded(ctx: PassContext, passes: list[tuple[str, Callable[[PassContext], None]]]) -> list[Fault]:
    """Run passes (name, pass) in order on ctx's graph; returns the faults, each already left out
    (see the module's docstring). The report gets one Skip per fault."""
    snapshot = Snapshot.take(ctx)
    faults: list[Fault] = []
    while True:
        try:
            with weights.made_during() as made:
                for name, run in passes:
                    if name not in ctx.passes_left_out:
                        ctx.current_pass = name
                        run(ctx)
            break
        except Exception as error:
            if ctx.config.strict or isinstance(getattr(error, "error", error), registry.UnservableBackends):
                raise  # strict, or the user's own choice of backends cannot be honoured: their error
            fault = _fault(ctx, error)
            log.warning("fp8compile: %s", fault.reason(), exc_info=True)
            faults.append(fault)
            snapshot.restore(ctx)
            # The FP8 copies this run made go with it: after an out-of-memory error above all,
            # the copies made before it would otherwise hold the memory the model runs in.
            freed = weights.forget_made(made)
            if freed:
                log.info("fp8compile: dropped %.2f GB of FP8 copies the failed run made", freed / 2**30)
        finally:
            ctx.current_pass = None
    for fault in faults:
        ctx.skipped(fault.pass_name, fault.site or f"graph {ctx.graph_index}", fault.reason())
    for name, sites in ctx.failed_sites.items():
        if name in ctx.passes_left_out:
            ctx.skipped(
                name,
                f"graph {ctx.graph_index}",
                f"{name} pass left out of this graph after errors at {len(sites)} sites (above): "
                "what it would have rewritten is kept as the model wrote it",
            )
    return faults


def _fault(ctx: PassContext, error: Exception) -> Fault:
    """The fault for error, with what is left out for it recorded on ctx."""
    if isinstance(error, SiteFailure):
        failed = ctx.failed_sites.setdefault(error.pass_name, set())
        failed.add(error.site)
        if len(failed) >= MAX_SITE_FAILURES:
            ctx.passes_left_out.add(error.pass_name)
        return Fault(error.pass_name, error.site, f"{type(error.error).__name__}: {error.error}")
    name = ctx.current_pass or "fp8compile"
    ctx.passes_left_out.add(name)
    return Fault(name, None, f"{type(error).__name__}: {error}")
