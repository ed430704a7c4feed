"""The torch.library namespace of every fp8compile op, `fp8compile`, defined once here; each op
family (quant/, linear/, moe/, mqa_logits/) adds its ops to it.

Each op is defined from its Python signature and registered with one kernel for every device
(CompositeExplicitAutograd; the ops serve inference, so there is no autograd formula) through a
plain `torch.library.Library`, not `torch.library.custom_op`: outside a CUDA graph every call
pays its host cost, and custom_op's wrappers (autograd dispatch, Dynamo guard, alias check)
measured 33 us per call on the H200 machine against 6 us for this registration, around a decode
GEMM of 11 us (`bench host`; BENCHMARKS.md, "Host cost").
"""

from __future__ import annotations

import torch

LIB = torch.library.Library("fp8compile", "DEF")


def op(fn=None, *, schema: str | None = None):
    """Define fp8compile::<fn's name> with the schema of fn's signature (or `schema`, where
    infer_schema cannot say it: a defaulted Tensor list); fn is its kernel."""
    if fn is None:
        return lambda f: op(f, schema=schema)
    LIB.define(fn.__name__ + (schema or torch.library.infer_schema(fn, mutates_args=())))
    LIB.impl(fn.__name__, fn, "CompositeExplicitAutograd")
    return fn


def fake(fn):
    """Decorator: the fake (meta) implementation of the op `fn` defines."""
    return torch.library.register_fake(f"fp8compile::{fn.__name__}", lib=LIB)
