"""Linears and gated linears in FP8: their ops (op.py), the
block recipe's decode and prefill kernels (triton_gemm.py, gluon_gemm.py, decode_op.py,
scaled_mm_op.py), and the rowwise and tensor recipes (reference_scaled.py, triton_scaled*.py,
scaled_cublas.py, scaled_gated_mm.py); and an FP8 checkpoint's linear as transformers runs it
(checkpoint.py)."""
