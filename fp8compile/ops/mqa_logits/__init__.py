"""Sparse-attention indexer logits (DeepSeek-V3.2's lightning indexer) in FP8: the ops (op.py),
their reference (reference.py), our Triton kernels (triton_mqa.py) and DeepGEMM's (vendors.py)."""
