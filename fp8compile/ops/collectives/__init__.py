"""Collectives of a tensor-parallel decode step: the sum all-reduce after a row-sharded linear
(o and down projections), on our kernel that pushes each rank's row into its peers' symmetric
buffers at the sizes a decode step moves (triton_push.py), on symmetric memory's one-shot and
two-shot kernels past those (symmetric.py), on the process group's own collective (NCCL, gloo)
elsewhere (reference.py); the op the all_reduce pass puts in the graph (op.py). And that
all-reduce, the residual add and the RMSNorm after it in the same kernel, the op the
all_reduce_norm pass puts in the graph."""
