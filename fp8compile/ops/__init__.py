"""FP8 ops: pure-PyTorch references (reference*.py) and their torch.library registrations
(custom.py: linears, gated linears, MoE; custom_mqa.py: indexer logits)."""

from . import custom, custom_mqa, reference  # noqa: F401  (importing them registers torch.ops.fp8compile.*)
