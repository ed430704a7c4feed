"""MoE expert blocks in FP8: the op (op.py), the grouped Triton kernels (triton_moe.py), their
tile choices (tiles.py, triton-free for the passes), and the traced decode and Gluon launches
(decode_op.py, gluon_op.py); and an FP8 checkpoint's experts as one op (checkpoint.py)."""
