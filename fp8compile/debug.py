"""Graph dumps for debug_dir: each compiled graph as Dynamo captured it, as ATen before and
after our passes, the diff between those two, and Dynamo's rewritten bytecode decompiled by
depyf (what actually runs in place of the model's forward)."""

from __future__ import annotations

import difflib
import itertools
import threading
from pathlib import Path

import torch.fx as fx

_counters: dict[Path, itertools.count] = {}
_lock = threading.Lock()
_pending: list[Path] = []  # dirs waiting for the bytecode of the frame being compiled
_hook = None


def graph_listing(gm: fx.GraphModule) -> list[str]:
    """One line per node, `name = target(args)`, stable enough to diff and to keep as a golden;
    subgraphs (torch.cond branches, nested ones too) follow, indented under their attribute name."""
    lines = _node_lines(gm)
    for name, sub in gm.named_children():
        if isinstance(sub, fx.GraphModule):
            lines += [f"{name}:", *("    " + line for line in graph_listing(sub))]
    return lines


def _node_lines(gm: fx.GraphModule) -> list[str]:
    lines = []
    for node in gm.graph.nodes:
        args = ", ".join(map(_fmt, node.args)) + "".join(f", {k}={_fmt(v)}" for k, v in node.kwargs.items())
        if node.op == "placeholder":
            lines.append(f"{node.name} = input")
        elif node.op == "get_attr":
            lines.append(f"{node.name} = self.{node.target}")
        elif node.op == "output":
            lines.append(f"return {args}")
        else:
            lines.append(f"{node.name} = {_target(node.target)}({args})")
    return lines


def _target(target) -> str:
    name = str(target)
    for prefix in ("torch.ops.", "<built-in function "):
        name = name.removeprefix(prefix)
    return name.rstrip(">").removesuffix(".default")


def _fmt(arg) -> str:
    if isinstance(arg, fx.Node):
        return arg.name
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(map(_fmt, arg))
        return f"[{inner}]" if isinstance(arg, list) else f"({inner}{',' if len(arg) == 1 else ''})"
    return repr(arg)


def graph_diff(before: list[str], after: list[str]) -> str:
    return "\n".join(difflib.unified_diff(before, after, "before", "after", lineterm="", n=0))


class DebugDump:
    def __init__(self, root: str):
        self.dir = Path(root).resolve()
        self.dir.mkdir(parents=True, exist_ok=True)
        with _lock:
            self.index = next(_counters.setdefault(self.dir, itertools.count()))
        self._before: list[str] = []
        _register_bytecode_hook()
        _pending.append(self.dir)

    def _write(self, suffix: str, text: str) -> None:
        (self.dir / f"graph_{self.index:03d}_{suffix}").write_text(text + "\n")

    def dynamo(self, gm: fx.GraphModule) -> None:
        self._write("dynamo.py", gm.print_readable(print_output=False))

    def before(self, gm: fx.GraphModule) -> None:
        self._before = graph_listing(gm)
        self._write("aten_before.py", gm.print_readable(print_output=False))

    def after(self, gm: fx.GraphModule) -> None:
        self._write("aten_after.py", gm.print_readable(print_output=False))
        self._write("diff.txt", graph_diff(self._before, graph_listing(gm)))


def _register_bytecode_hook() -> None:
    global _hook
    if _hook is None:
        from torch._dynamo.convert_frame import register_bytecode_hook

        _hook = register_bytecode_hook(_write_decompiled)


def _write_decompiled(code, new_code):
    dirs = list(dict.fromkeys(_pending))
    _pending.clear()
    for d in dirs:
        index = next(_counters.setdefault(d / ".code", itertools.count()))
        name = f"__transformed_code_{index}_for_{code.co_name}.py"
        try:
            import depyf

            text = depyf.decompile(new_code)
        except Exception as e:  # depyf missing or unable to decompile: say so, keep compiling
            text = f"# depyf could not decompile {code.co_name}: {type(e).__name__}: {e}\n"
        (d / name).write_text(text)
    return None
