"""What a pass knows about the ATen graph it rewrites: the real tensor and the model name
behind each placeholder, the config and the report, and helpers to add nodes with their fake values.

Invariants every pass keeps: each node it adds carries meta["val"] (a FakeTensor / SymInt of
the graph's fake mode), and so does every node downstream of a replaced one (replace_uses
re-derives it: a torch.cond branch is compiled for the strides its operands' meta says, so a
stale stride there is a crash or wrong numbers); no weight values enter the graph (weights
stay inputs, and their FP8 copies are inputs the backend derives from them per call:
derived_inputs, fp8compile/derived.py); no new aliasing.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .. import release, shards
from . import dtypes
from ..config import Fp8Config
from ..derived import DerivedInput
from ..report import Report, Rewrite, Skip
from .trace import TraceCache


def qualified_name(source_name: str) -> str:
    """Dynamo source name -> the name model.named_parameters() would give:
    "L['self']._modules['mlp']._parameters['weight']" -> "mlp.weight", and a plain attribute the
    same way: "L['self']._modules['norm'].variance_epsilon" -> "norm.variance_epsilon". A local
    root (the compiled module, whatever Dynamo calls it: self, fn, an argument, or an element of
    *args / **kwargs, as in "L['args'][0].model.norm.weight" when generate() calls a compiled
    bound forward) is dropped; a global's name is kept."""
    keys = [
        key or attr
        for key, attr in re.findall(r"\[['\"]?([^'\"\]]+)['\"]?\]|\.(\w+)", source_name)
        if attr not in _MODULE_DICTS
    ]
    if keys and source_name.startswith("L[") and len(keys) > 1:
        root = 2 if len(keys) > 2 and re.match(r"L\[['\"](args|kwargs)['\"]\]\[", source_name) else 1
        keys = keys[root:]
    return ".".join(keys) or source_name


_MODULE_DICTS = ("_modules", "_parameters", "_buffers")


def dynamo_input_names(gm: fx.GraphModule) -> list[str | None]:
    """Model-side name of each placeholder of a Dynamo graph, from its grapharg source."""
    names: list[str | None] = []
    for node in gm.graph.find_nodes(op="placeholder"):
        grapharg = node.meta.get("grapharg")
        source = getattr(grapharg, "source", None)
        name = getattr(source, "name", None)
        if callable(name):  # a method in older torch, a property in newer
            name = name()
        names.append(qualified_name(name) if isinstance(name, str) else None)
    return names


@dataclasses.dataclass
class GraphInputs:
    """The real values behind an ATen graph's placeholders, in AOTAutograd's flat order:
    the Dynamo graph's own parameters and buffers (lifted by AOTAutograd) then its inputs, each
    tensor subclass among them (a tensor-parallel model's DTensor parameter) flattened into the
    values inside it (shards.py)."""

    values: list[Any]
    names: list[str | None]
    parameters: list[bool]  # a model parameter, or a parameter's local shard
    shards: list[str]  # how a shard lies in its parameter ("Shard(dim=0) over 2 ranks of 256x512"), or ""

    @classmethod
    def from_dynamo(cls, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> GraphInputs:
        lifted = [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]
        outer = [t for _, t in lifted] + list(example_inputs)
        outer_names = [qualified_name(n) for n, _ in lifted] + dynamo_input_names(gm)
        inputs = cls([], [], [], [])
        for value, name in zip(outer, outer_names):
            for inner, inner_name, shard in shards.flatten(value, name):
                inputs.values.append(inner)
                inputs.names.append(inner_name)
                inputs.parameters.append(
                    isinstance(value, torch.nn.Parameter) and isinstance(inner, torch.Tensor)
                )
                inputs.shards.append(shard)
        return inputs

    def bind(self, aten_gm: fx.GraphModule) -> dict[fx.Node, tuple[Any, str | None]] | str:
        """Map the ATen graph's placeholders to (real value, name), or say why that is not possible."""
        placeholders = list(aten_gm.graph.find_nodes(op="placeholder"))
        if len(placeholders) != len(self.values):
            return (
                f"graph has {len(placeholders)} inputs but Dynamo passed {len(self.values)} "
                "(after flattening tensor subclasses)"
            )
        for node, value in zip(placeholders, self.values):
            fake = node.meta.get("val")
            if isinstance(value, torch.Tensor) != isinstance(fake, torch.Tensor):
                return (
                    f"input {node.name} is a {type(fake).__name__} in the graph "
                    f"but {type(value).__name__} from Dynamo"
                )
            if isinstance(value, torch.Tensor) and value.dtype != fake.dtype:
                return f"input {node.name} has dtype {fake.dtype} in the graph but {value.dtype} from Dynamo"
            if (
                isinstance(value, torch.Tensor)
                and self._static(fake)  # first: comparing a symbolic size would add a guard
                and tuple(value.shape) != tuple(fake.shape)
            ):
                return (
                    f"input {node.name} has shape {tuple(fake.shape)} in the graph "
                    f"but {tuple(value.shape)} from Dynamo"
                )
        return {node: (value, name) for node, value, name in zip(placeholders, self.values, self.names)}

    def parameter_nodes(self, bound: dict[fx.Node, Any]) -> set[fx.Node]:
        return {node for node, is_param in zip(bound, self.parameters) if is_param}

    def shard_notes(self, bound: dict[fx.Node, Any]) -> dict[fx.Node, str]:
        return {node: note for node, note in zip(bound, self.shards) if note}

    @staticmethod
    def _static(fake: torch.Tensor) -> bool:
        return all(type(d) is int for d in fake.shape)


class SiteFailure(Exception):
    """An exception raised while a pass worked on one site (PassContext.at_site; passes/guard.py)."""

    def __init__(self, pass_name: str, site: str, error: BaseException):
        super().__init__(f"{pass_name} pass at {site}: {type(error).__name__}: {error}")
        self.pass_name, self.site, self.error = pass_name, site, error


def moving_ints(values: Sequence[Any]) -> list[torch.SymInt]:
    """The int inputs among a graph's example inputs that size none of its tensor inputs: values
    the model computes with, such as the position of a sliding-window cache
    (transformers' StaticSlidingWindowLayer.cumulative_length_int, one more every decode step),
    rather than a batch or a sequence length. Inductor records a CUDA graph of a whole graph once
    per value of each of its int inputs."""
    sized: set = set()
    for value in values:
        if isinstance(value, torch.Tensor):
            for dim in (*value.shape, *value.stride(), value.storage_offset()):
                if isinstance(dim, torch.SymInt):
                    sized |= dim.node.expr.free_symbols
    return [
        value
        for value in values
        if isinstance(value, torch.SymInt) and not value.node.expr.free_symbols <= sized
    ]


class PassContext:
    def __init__(
        self,
        gm: fx.GraphModule,
        inputs: dict[fx.Node, tuple[Any, str | None]],
        config: Fp8Config,
        report: Report,
        graph_index: int,
        fake_mode,
        cuda_graphs: bool,
        parameters: set[fx.Node],
        shards: dict[fx.Node, str],
    ):
        self.gm = gm
        self.inputs = inputs
        # The placeholders that are model parameters (or their local shards): weights the passes
        # may quantize at compile time (GraphInputs.parameter_nodes).
        self.parameters = parameters
        # What a site left unchanged stays in (the report says): the parameters' commonest dtype
        found = Counter(
            node.meta["val"].dtype
            for node in parameters
            if isinstance(node.meta.get("val"), torch.Tensor) and node.meta["val"].is_floating_point()
        )
        self.model_dtype = dtypes.name(found.most_common(1)[0][0]) if found else ""
        self.shards = shards  # placeholder -> how its shard lies in its parameter (shards.py)
        self._shard_by_name = {inputs[node][1]: note for node, note in self.shards.items() if inputs[node][1]}
        self.config = config
        self.report = report
        self.graph_index = graph_index
        self.fake_mode = fake_mode
        self.cuda_graphs = cuda_graphs  # asked for (reduce-overhead); Inductor may still turn them off
        # Decode-kernel sides of the dispatch as launches Inductor makes itself (passes/inline.py):
        # as the config says, else outside CUDA graphs, where every call pays its host cost.
        self.inductor_launch = (
            config.inductor_launch if config.inductor_launch is not None else not cuda_graphs
        )
        # Under CUDA graphs, a graph with an int input that moves every call gets no M dispatch
        # conds (dispatch.plan): Inductor can record a graph with conds only whole, and a whole
        # graph is recorded again for every value of its int inputs.
        self.moving_ints = (
            moving_ints([node.meta.get("val") for node in gm.graph.find_nodes(op="placeholder")])
            if cuda_graphs
            else []
        )
        self._index = {
            node: i for i, node in enumerate(inputs)
        }  # placeholder -> its position among the inputs
        # What a pass's error left out (passes/guard.py): pass -> sites, and whole passes.
        self.current_pass: str | None = None
        self.failed_sites: dict[str, set[str]] = {}
        self.passes_left_out: set[str] = set()
        # Parameters given back as their FP8 copies were made (release_bf16_weights), across runs
        # of the passes: the backend makes resident again those the compiled graph reads in bf16.
        self.released: list[torch.Tensor] = []
        self._shared: set[int] | None = None  # release.shared's among the parameters, once asked
        self.start_over()

    def start_over(self) -> None:
        """Forget what the passes made: they run again on the graph as it was before them
        (passes/guard.py puts it back)."""
        self.traced_launches = 0  # how many it emitted: Inductor must launch them statically (backend.py)
        self.traces = TraceCache()  # inline_traced's traces, one per call signature (passes/inline.py)
        self.dispatch_branches: dict[tuple, list[str]] = {}  # M dispatch: call signature -> branch modules
        # matmul node -> why a fusion pass wants it left bf16 (linear_pass records the reason)
        self.keep_bf16: dict[fx.Node, str] = {}
        # The graph holds an FP8 checkpoint's linears (passes/checkpoint_linear.py), or follows
        # one that did in the same compile (after a graph break, an lm_head may be a graph of
        # its own): its bf16 linears are the ones the checkpoint left unquantized
        # (Fp8Config.quantize_checkpoint_bf16).
        checkpoint_ops = (
            torch.ops.fp8compile.checkpoint_linear.default,
            torch.ops.fp8compile.checkpoint_scaled_mm_rowwise.default,
            torch.ops.fp8compile.checkpoint_experts.default,
        )
        self.report.fp8_checkpoint |= any(
            self.gm.graph.find_nodes(op="call_function", target=target) for target in checkpoint_ops
        )
        self.fp8_checkpoint = self.report.fp8_checkpoint
        # Inputs the backend appends to the graph and computes per call (derived_inputs):
        # (key, sources) -> (what computes them, their placeholders).
        self._derived: dict[tuple, tuple[DerivedInput, tuple[fx.Node, ...]]] = {}

    def site_failed(self, site: str) -> bool:
        """Whether the current pass raised at this site before (at_site leaves it out)."""
        return site in self.failed_sites.get(self.current_pass, ())

    def at_site(self, site: str, work: Callable[[], Any]) -> Any:
        """work(), the current pass's matching, checks and rewrite of one site (a module's name
        where it has one), or None without calling it where that site failed before. An
        exception from work() is a guard.SiteFailure naming the pass and the site: the graph
        is put back and the passes run again without it (passes/guard.py)."""
        if self.site_failed(site):
            return None
        try:
            return work()
        except SiteFailure:
            raise
        except Exception as error:
            raise SiteFailure(self.current_pass or "fp8compile", site, error) from error

    @property
    def derived(self) -> list[DerivedInput]:
        """How the backend computes the appended inputs, in input order."""
        return [record for record, _ in self._derived.values()]

    def derived_inputs(
        self,
        key: tuple,
        names: Sequence[str],
        sources: Sequence[fx.Node],
        make: Callable[..., tuple[torch.Tensor, ...]],
        memo: bool = False,
        release_now: bool = True,
    ) -> tuple[fx.Node, ...]:
        """Placeholders (one per name) for make(*the real tensors behind sources), appended to the graph's
        inputs: made once now (compile time, so the FP8 copy of a weight is ready before any
        call), then by the compiled graph's wrapper per call from the tensors passed. The same
        key over the same sources gives the same placeholders. memo: make goes through the
        weight memo (DerivedInput.memo: its sources may be released; under release_bf16_weights
        they are at once, unless not release_now: the op reads them in bf16 too, or each is
        one expert of a stacked parameter, which would go back and forth once an expert)."""
        memo_key = (key, tuple(sources))
        if memo_key in self._derived:
            return self._derived[memo_key][1]
        values = make(*[self.inputs[node][0] for node in sources])
        if memo and release_now and self.config.release_bf16_weights:
            self._release_sources(sources)
        graph = self.gm.graph
        last = list(graph.find_nodes(op="placeholder"))[-1]
        nodes = []
        for name, value in zip(names, values, strict=True):
            with graph.inserting_after(last):
                last = graph.placeholder(self._fresh_placeholder_name(name))
            last.meta["val"] = self.fake_mode.from_tensor(value, static_shapes=True)
            nodes.append(last)
        self._derived[memo_key] = (
            DerivedInput(tuple(self._index[node] for node in sources), make, memo),
            tuple(nodes),
        )
        return tuple(nodes)

    def drop_unused_derived_inputs(self) -> None:
        """Forget derived inputs no node reads (a rewrite that gave up after asking for them)."""
        for memo_key, (_, nodes) in list(self._derived.items()):
            if not any(node.users for node in nodes):
                for node in nodes:
                    self.gm.graph.erase_node(node)
                del self._derived[memo_key]

    def _release_sources(self, sources: Sequence[fx.Node]) -> None:
        """release_bf16_weights: the parameters among sources give their device memory back now,
        their FP8 copies made, so that a model whose bf16 weights and FP8 copies do not fit on the
        device together is quantized one weight at a time, not all of them beside all the copies.
        Whatever the compiled graph still reads in bf16 comes back before it runs (backend.py)."""
        params = [self.inputs[node][0] for node in sources if node in self.parameters]
        fresh = [p for p in params if not release.is_released(p) and not self.is_shared(p)]
        with unset_fake_temporarily():  # real host buffers, not the compiler's fakes
            release.release(fresh)
        self.released.extend(p for p in fresh if release.is_released(p))

    def is_shared(self, p: torch.Tensor) -> bool:
        """Whether another module holds parameter p too (release.shared, over this graph's
        parameters, once): it stays resident, and is never released (keep_resident)."""
        if self._shared is None:
            with unset_fake_temporarily():
                found = release.shared(self.inputs[node][0] for node in self.parameters)
                release.keep_resident(found)
            self._shared = {id(p) for p in found}
        return id(p) in self._shared

    def drop_unused_inputs(self) -> tuple[list[int], list[torch.Tensor]]:
        """Remove the tensor inputs (of those Dynamo passes) that no node reads any more, the bf16
        weights of rewritten linears among them; returns the positions of the inputs kept, and
        the parameters dropped. Sizes stay: the compiled code binds its symbols from them."""
        keep, dropped = [], []
        for node, i in list(self._index.items()):
            value = self.inputs[node][0]
            if (
                node.users
                or not isinstance(value, torch.Tensor)
                or not isinstance(node.meta.get("val"), torch.Tensor)
            ):
                keep.append(i)
                continue
            self.gm.graph.erase_node(node)
            if node in self.parameters:
                dropped.append(value)
        return keep, dropped

    def derived_example_inputs(self) -> list[torch.Tensor]:
        """The fake values of the derived inputs, in input order (for Inductor)."""
        return [node.meta["val"] for _, nodes in self._derived.values() for node in nodes]

    def _fresh_placeholder_name(self, hint: str) -> str:
        base = re.sub(r"[^0-9a-zA-Z_]", "_", hint)
        base = base if base[:1].isalpha() else "m" + base  # "0.weight" of an nn.Sequential: no identifier
        taken = {node.name for node in self.gm.graph.nodes}
        name, i = base, 1
        while name in taken:
            name, i = f"{base}_{i}", i + 1
        return name

    def parameter(self, node: fx.Node) -> tuple[torch.Tensor, str] | None:
        """The model parameter a placeholder stands for (this rank's shard of a sharded one),
        with its name; None if not a parameter."""
        if node not in self.parameters:
            return None
        value, name = self.inputs[node]
        return value, name or node.name

    def attr_name(self, hint: str) -> str:
        """A fresh attribute name on the graph module (for subgraphs), readable: _fp8_<hint>[_<i>]."""
        base = "_fp8_" + re.sub(r"[^0-9a-zA-Z_]", "_", hint)
        name, i = base, 1
        while hasattr(self.gm, name):
            name, i = f"{base}_{i}", i + 1
        return name

    def fake(self, fn, *args, **kwargs):
        """Run fn on the meta["val"] of node arguments, under the graph's fake mode, past its
        dispatch cache: our calls rarely repeat one (each layer's nodes have inputs of their
        own), and a miss pays for an entry while a hit still builds the output (with symbolic
        sizes, 4.6 ms a call on average on an H200's host, most of them views): without it, 38%
        less time in this function for a 32-layer Llama at dynamic M (on a CPU; BENCHMARKS.md,
        2026-11-26 (18e8dc2)). The mode keeps its cache for everything else."""
        args, kwargs = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        cached = getattr(self.fake_mode, "cache_enabled", None)
        if cached:
            self.fake_mode.cache_enabled = False
        try:
            with self.fake_mode:
                return fn(*args, **kwargs)
        finally:
            if cached:
                self.fake_mode.cache_enabled = cached

    def replace_uses(self, old: fx.Node, new: fx.Node) -> None:
        """old's users read new instead, and every node downstream of new whose value (shape,
        strides, dtype) follows from it gets its meta["val"] re-derived. new may differ from
        old in strides: gate_up's halves of one (M, 2N) output are (M, N) with row stride 2N,
        where the matmul each replaces was contiguous, and the views and branches below them
        must say so. A torch.cond built earlier (another pass's M dispatch over old, say a gated
        MLP over a linear's output) keeps its branches where new has old's layout."""
        same = _same_layout(new.meta.get("val"), old.meta.get("val"))
        old.replace_all_uses_with(new)
        # a node whose meta changes sends its users back here (a DAG: this ends)
        work = [(user, same) for user in new.users]
        while work:
            node, unchanged = work.pop()
            if node.op != "call_function":
                continue
            if node.target is torch.ops.higher_order.cond:
                if unchanged:
                    continue
                raise AssertionError(f"{node.name}: a torch.cond whose operands change after it was built")
            try:
                val = self.fake(node.target, *node.args, **node.kwargs)
            except Exception:  # an op the fake mode cannot rerun here: keep what tracing recorded
                continue
            if _unbacked(val) or _same_layout(val, node.meta.get("val")):
                continue
            node.meta["val"] = val
            work.extend((user, False) for user in node.users)

    def rewrote(self, kind: str, name: str, m: Any, n: int, k: int, kernels, detail: str = "") -> None:
        m_desc = str(m) if isinstance(m, int) else "dynamic"
        recipe = "block"
        if kind == "mqa_logits":  # q per (token, head), k per token: one scale per row of D
            recipe = "per row"
        elif kind in ("linear", "silu_mul") and self.config.recipe != "block":  # the others run block
            scales = "static" if self.config.act_amax is not None else "dynamic"
            recipe = f"{self.config.recipe}, {scales}"
        self.report.rewrites.append(
            Rewrite(
                kind,
                name,
                m_desc,
                n,
                k,
                tuple(kernels),
                self.graph_index,
                detail,
                recipe,
                self.shard_of(name),
            )
        )

    def shard_of(self, module: str) -> str:
        """How the sharded parameters of a module lie in their whole (tensor parallelism): the
        weight's "Shard(dim=0) over 2 ranks of 512x512", or per parameter where it has several
        (routed experts); "" where nothing of it is sharded."""
        notes = {
            name[len(module) + 1 :]: note
            for name, note in self._shard_by_name.items()
            if name.startswith(module + ".") and "." not in name[len(module) + 1 :]
        }
        if list(notes) in (["weight"], ["weight", "bias"]):
            return notes["weight"]
        return "; ".join(f"{attr}: {note}" for attr, note in notes.items())

    def skipped(self, kind: str, name: str, reason: str, shape: str = "") -> None:
        if shard := self.shard_of(name):  # the shape in the reason is this rank's shard's
            reason += f" (this rank's shard: {shard})"
        self.report.skips.append(Skip(kind, name, reason, self.graph_index, shape, self.model_dtype))


def _unbacked(val: Any) -> bool:
    """Whether a meta value (a tensor, a size, or a tuple / list / dict of them: a traced Triton
    launch gives {argument name: tensor}) holds an unbacked symbol."""
    return any(
        free_unbacked_symbols(leaf)
        for leaf in pytree.tree_leaves(val)
        if isinstance(leaf, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool))
    )


def _same_layout(a: Any, b: Any) -> bool:
    """Whether two meta values (tensors, or tuples / lists / dicts of them) agree in shape,
    strides and dtype."""
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_layout(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_layout(a[key], b[key]) for key in a)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype and a.device == b.device
    return type(a) is type(b) and not isinstance(a, torch.Tensor)
