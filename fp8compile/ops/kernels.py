"""The kernel an op runs for the backend its `backend` argument names.

Every fp8compile op takes a `backend` (the name of a kernel family: "triton_small_m",
"deep_gemm", "reference", ...) that the passes fixed at compile time, and calls
`implementation(op, backend)` for the function that computes it. Which backends exist, what each
serves and which one a call site gets is the registry's business (fp8compile/registry.py): it
installs its lookup here when it is imported, so that no op imports the registry above it.
"""

from __future__ import annotations

from collections.abc import Callable

_lookup: Callable[[str, str], Callable] | None = None


def install(lookup: Callable[[str, str], Callable]) -> None:
    """Set the function that maps (op, backend) to a kernel (the registry's `implementation`)."""
    global _lookup
    _lookup = lookup


def implementation(op: str, backend: str) -> Callable:
    if _lookup is None:
        raise RuntimeError(
            f"no kernel table for fp8compile::{op} (backend {backend!r}): `import fp8compile`, "
            "which loads the registry of kernels, before calling the ops"
        )
    return _lookup(op, backend)
