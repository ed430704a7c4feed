"""FP8 ops, one folder per thing computed: quant/ (the activation's and the weight's
quantization), linear/ (linears and gated linears, three recipes), moe/ (routed experts),
mqa_logits/ (sparse-attention indexer logits), attention/ (grouped-query decode attention),
collectives/ (a tensor-parallel step's all-reduce).
Each holds its torch.library ops with their fakes (op.py), its pure-PyTorch reference, its
kernels and its vendor adapters. Shared beside them: the MLP activations (activations.py), the
torch.library namespace (library.py), the kernel table the registry fills (kernels.py), the
Triton launcher (launch.py), the traced launches (traced.py) and the vendor libraries' checks
(vendors.py)."""

# importing them registers torch.ops.fp8compile.*
from .collectives import op as collectives_op  # noqa: F401
from .linear import checkpoint as checkpoint_op  # noqa: F401
from .moe import checkpoint as checkpoint_experts_op  # noqa: F401
from .linear import op as linear_op  # noqa: F401
from .moe import op as moe_op  # noqa: F401
from .mqa_logits import op as mqa_logits_op  # noqa: F401
from .quant import op as quant_op  # noqa: F401
