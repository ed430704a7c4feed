"""The rewritten graph run as the ops it holds, for Fp8Config(inductor=False): what Inductor's
inner compile returns (an OutputCode), without Inductor's code generation or C++ compiles.

AOTAutograd's inference graph is functional, but Inductor's passes may leave an aten.view whose
input no longer has strides a view can take (Inductor's lowering copies where it must); run
eagerly, each view is a reshape, which is the same view where one exists and a copy where not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.output_code import OutputCode


def _views_as_reshapes(gm: fx.GraphModule) -> fx.GraphModule:
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.view.default):
        node.target = torch.ops.aten.reshape.default
    gm.recompile()
    return gm


@dataclasses.dataclass
class EagerGraph(OutputCode):
    """A boxed call of the graph module on its inputs, as Inductor's compiled graphs are called."""

    gm: fx.GraphModule | None = None

    def __post_init__(self) -> None:
        self._boxed_call = True

    def post_compile(self, example_inputs, constants, graph_kwargs) -> None:
        pass

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        pass

    def __call__(self, inputs: Sequence[Any]) -> Any:
        args = list(inputs)
        inputs.clear()  # a boxed call owns its inputs, as Inductor's do
        return self.gm(*args)


def eager_graph(gm: fx.GraphModule) -> EagerGraph:
    return EagerGraph(gm=_views_as_reshapes(gm))
