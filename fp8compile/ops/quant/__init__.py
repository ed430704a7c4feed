"""The activation's quantization: 1x128 token groups (triton_quant.py, which the GEMM kernels
fuse into their prologues) and whole rows for the rowwise recipe (triton_quant_rows.py)."""
