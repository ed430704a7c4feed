"""FP8 ops: pure-PyTorch references (reference.py) and their torch.library registrations (custom.py)."""

from . import custom, reference  # noqa: F401  (importing custom registers torch.ops.fp8compile.*)
