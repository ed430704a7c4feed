"""Grouped-query decode attention over a static KV cache, without repeating K/V per query head:
the op (op.py) and its split-KV Triton kernel (triton_attention.py)."""
