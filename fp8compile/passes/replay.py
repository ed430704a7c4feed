"""Run a matched piece of the graph on real tensors at small sizes, to check what a pass read
from its structure against what it computes (the MoE and indexer passes verify each match this
way before they rewrite it)."""

from __future__ import annotations

import torch
import torch.fx as fx

from .. import release
from .context import PassContext


class ReplayError(Exception):
    """The piece reads something the replay cannot give it; the message says what."""


def small_symbols(ctx: PassContext, cap: int) -> dict:
    """Each dynamic size of the graph's inputs -> min(its hint, cap): small concrete sizes."""
    symbols = {}
    for node in ctx.gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):
            symbols[val.node.expr] = min(val.node.hint or cap, cap)
    return symbols


def concrete(size, symbols: dict) -> int:
    """A (symbolic) size at the concrete values of `symbols`."""
    return int(size.node.expr.subs(symbols)) if isinstance(size, torch.SymInt) else int(size)


def run_subgraph(ctx: PassContext, env: dict, output: fx.Node, symbols: dict, what: str) -> torch.Tensor:
    """output evaluated from the tensors in env (node -> value), the model's parameters and the
    concrete sizes in symbols; `what` names the piece in errors ("the experts")."""
    needed, stack = set(), [output]
    while stack:
        node = stack.pop()
        if node not in needed and node not in env:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    env = dict(env)
    # A parameter an earlier pass released (release_bf16_weights) is read here: back for the replay.
    params = [ctx.parameter(node)[0] for node in needed if node.op == "placeholder" and ctx.parameter(node)]
    with release.temporarily_resident(params):
        for node in ctx.gm.graph.nodes:
            if node not in needed:
                continue
            if node.op == "placeholder":
                val = node.meta.get("val")
                if isinstance(val, torch.SymInt):
                    env[node] = concrete(val, symbols)
                elif ctx.parameter(node) is not None:
                    env[node] = ctx.parameter(node)[0]
                elif _is_constant(ctx.inputs.get(node, (None,))[0]):
                    env[node] = ctx.inputs[node][0]  # a module's float Dynamo passed as a 0-d tensor
                else:
                    raise ReplayError(f"{what} read graph input {node.name} besides the matched inputs")
            elif node.op == "get_attr":  # a constant the graph holds
                env[node] = getattr(ctx.gm, node.target)
            elif node.op == "call_function":
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                env[node] = node.target(*args, **kwargs)
            else:
                raise ReplayError(f"{what} read {node.op} {node.target}")
        out = env[output]
        # its own storage: a view of a parameter released again below would read nothing (small)
        return out.clone() if isinstance(out, torch.Tensor) else out


def _is_constant(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0
