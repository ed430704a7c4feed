"""The shared memory a Triton kernel asks for, and the global loads, stores and atomics its PTX
makes, compiled for a GPU this machine need not have.

`python -m tests.sm_compile [shared|loads|stores|atomics]` reads a JSON list of launches on
stdin, each {"kernel": "module:name", "capability": 90, "pointers": {argument: Triton type,
pointer or scalar}, "constexprs": {...}, "ones": [integer arguments specialized to 1],
"num_warps": 4, "num_stages": 3}, compiles each with Triton's compiler for that target (ptxas
included, no GPU) and prints, for each, the bytes it asks for (shared), its PTX's global load
instructions (loads), global store instructions (stores) or atomic instructions (atomics).
Every other integer argument is taken as a multiple of 16, as a model's sizes and strides are:
loads pipelined, the most shared memory. It runs in a process of its own: the CPU tests' Triton
interpreter (TRITON_INTERPRET=1) patches triton.language, and the compiler does not run under it
(run() removes that variable).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys


def shared_bytes(launches: list[dict]) -> list[int]:
    """What each launch asks for, from a fresh process (the tests' entry point)."""
    return _run(launches, "shared")


def global_loads(launches: list[dict]) -> list[list[str]]:
    """Each launch's global load instructions ("ld.global.cg.v4.b32", "ld.volatile.global.b32",
    ...), in PTX order."""
    return _run(launches, "loads")


def global_stores(launches: list[dict]) -> list[list[str]]:
    """Each launch's global store instructions ("st.global.v4.b32", ...), in PTX order."""
    return _run(launches, "stores")


def atomics(launches: list[dict]) -> list[list[str]]:
    """Each launch's atomic instructions ("atom.global.release.sys.cas.b32", ...), in PTX order."""
    return _run(launches, "atomics")


def _run(launches: list[dict], what: str) -> list:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "tests.sm_compile", what],
        input=json.dumps(launches),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def _compile(launch: dict):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, _, name = launch["kernel"].partition(":")
    kernel = getattr(importlib.import_module(module), name)
    constexprs, pointers, ones = launch["constexprs"], launch["pointers"], set(launch.get("ones", ()))
    signature, constants, attrs = {}, {}, {}
    for i, arg in enumerate(kernel.arg_names):
        if arg in constexprs:
            signature[arg], constants[(i,)] = "constexpr", constexprs[arg]
        elif arg in pointers:
            signature[arg] = pointers[arg]
            if pointers[arg].startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg in ones:
            signature[arg], constants[(i,)] = "constexpr", 1
        else:
            signature[arg], attrs[(i,)] = "i32", [["tt.divisibility", 16]]
    options = dict(num_warps=launch["num_warps"], num_stages=launch["num_stages"])
    target = GPUTarget("cuda", launch["capability"], 32)
    return triton.compile(ASTSource(kernel, signature, constants, attrs), target=target, options=options)


def _answer(launch: dict, what: str):
    compiled = _compile(launch)
    if what == "loads":
        return re.findall(r"\bld\.(?:volatile\.)?global\.[a-z0-9.]+", compiled.asm["ptx"])
    if what == "stores":
        return re.findall(r"\bst\.global\.[a-z0-9.]+", compiled.asm["ptx"])
    if what == "atomics":
        return re.findall(r"\batom\.[a-z0-9._]+", compiled.asm["ptx"])
    return compiled.metadata.shared


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "shared"
    print(json.dumps([_answer(launch, what) for launch in json.load(sys.stdin)]))
