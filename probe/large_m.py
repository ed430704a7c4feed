"""Temporary probe: the linear and gated-linear backends' times (quantization included) at
prefill sizes of M for dense models' shapes, on this GPU (autotune.time_us harness)."""
import json, os, sys, torch
from fp8compile import autotune

SHAPES = {  # name: (op, N, K)
    "llama8b.qkv": ("linear", 6144, 4096), "llama8b.o": ("linear", 4096, 4096),
    "llama8b.gate_up": ("linear", 28672, 4096), "llama8b.down": ("gated_linear", 4096, 14336),
    "qwen7b.qkv": ("linear", 4608, 3584), "qwen7b.o": ("linear", 3584, 3584),
    "qwen7b.gate_up": ("linear", 37888, 3584), "qwen7b.down": ("gated_linear", 3584, 18944),
    "qwen3moe.qkv": ("linear", 5120, 2048), "qwen3moe.o": ("linear", 2048, 4096),
}
MS = [int(m) for m in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1024, 1280, 1536, 1792, 2048, 2560, 3072, 4096, 8192]
BACKENDS = ("cublas", "deep_gemm", "triton")
dev = torch.device("cuda")
rows = []
for name, (op, n, k) in SHAPES.items():
    for m in MS:
        t = {b: autotune.time_us(op, b, n, k, m, dev, False) for b in BACKENDS}
        rows.append(dict(shape=name, op=op, n=n, k=k, m=m, **t))
        f = lambda v: f"{v:8.1f}" if v else "       -"
        print(f"{name:16s} M={m:5d} " + " ".join(f"{b}={f(t[b])}" for b in BACKENDS), flush=True)
out = os.environ.get("OUT", ".")
os.makedirs(f"{out}/probe", exist_ok=True)
json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(f"{out}/probe/large_m.json", "w"), indent=1)
