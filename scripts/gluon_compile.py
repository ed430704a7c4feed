"""Compile the Gluon GEMM for sm_90 without a GPU and print what ptxas made of it.

    python scripts/gluon_compile.py [--m 4096 --n 4096 --k 7168] [--config '{"OVERLAP": true}'] [--ptx f] [--loops]

Catches Gluon API drift (the GPU kit runs Triton 3.6, CI 3.9) and shows registers, spills and
serialized wgmma warnings before a device is spent on it (tests/test_gluon_gemm.py does too).
"""
import argparse
import json

import triton

from fp8compile.ops import gluon_gemm


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--k", type=int, default=7168)
    p.add_argument("--bias", action="store_true")
    p.add_argument("--config", type=json.loads, default=None, help="keys of gluon_gemm.CONFIG, as JSON")
    p.add_argument("--ptx", help="write the PTX here")
    p.add_argument("--loops", action="store_true", help="count the instructions of the consumers' main loops")
    a = p.parse_args()
    kernel = gluon_gemm.compile_sm90(a.m, a.n, a.k, a.bias, a.config)
    print(f"triton {triton.__version__}: shared memory {kernel.metadata.shared} bytes")
    print(gluon_gemm.ptxas_report(kernel.asm["ptx"]))
    if a.loops:
        print(gluon_gemm.main_loop_report(kernel.asm["cubin"]))
    if a.ptx:
        with open(a.ptx, "w") as f:
            f.write(kernel.asm["ptx"])


if __name__ == "__main__":
    main()
