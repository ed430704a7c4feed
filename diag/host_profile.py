"""Temporary: host cost of a compiled decode step, bf16 Inductor vs fp8, default mode."""
import cProfile, io, json, os, pstats, sys, time
import torch, fp8compile
from fp8compile.bench.model import build
out = os.environ.get("OUT", "/tmp")
layers = int(sys.argv[1]) if len(sys.argv) > 1 else 4
model = build("llama-3-8b", layers, "cuda")
res = {}
def wall(fn, n=50):
    for _ in range(5): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n * 1e6
def gpu(fn, n=20):
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    return None
with torch.no_grad():
    for b in (1, 16):
        ids = torch.randint(0, 1000, (b, 1), device="cuda")
        for name, backend in (("bf16_inductor", "inductor"), ("fp8", fp8compile.backend())):
            torch._dynamo.reset()
            c = torch.compile(model, backend=backend, dynamic=True)
            f = lambda: c(ids, use_cache=False, logits_to_keep=1)
            f(); f()
            res[f"{name}_B{b}_us"] = wall(f)
            # host only: time to enqueue (no sync inside)
            torch.cuda.synchronize(); t = time.perf_counter()
            for _ in range(20): f()
            res[f"{name}_B{b}_enqueue_us"] = (time.perf_counter() - t) / 20 * 1e6
            torch.cuda.synchronize()
            if b == 1:
                pr = cProfile.Profile(); pr.enable()
                for _ in range(30): f()
                pr.disable(); torch.cuda.synchronize()
                s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(35)
                open(f"{out}/profile_{name}.txt", "w").write(s.getvalue())
                s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(45)
                open(f"{out}/profile_{name}.txt", "a").write(s.getvalue())
    # the decode kernel's launch alone
    from fp8compile.ops import triton_gemm, reference
    w = model.model.layers[0].mlp.down_proj.weight
    w8 = reference.quant_weight_block(w)
    x = torch.randn(1, w.shape[1], device="cuda", dtype=torch.bfloat16)
    res["linear_small_m_us"] = wall(lambda: triton_gemm.linear_small_m(x, *w8), 200)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(200): triton_gemm.linear_small_m(x, *w8)
    res["linear_small_m_enqueue_us"] = (time.perf_counter() - t) / 200 * 1e6
    torch.cuda.synchronize()
    op = torch.ops.fp8compile.linear.default
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(200): op(x, w, None, False, "triton_small_m")
    res["op_enqueue_us"] = (time.perf_counter() - t) / 200 * 1e6
    torch.cuda.synchronize()
    pr = cProfile.Profile(); pr.enable()
    for _ in range(200): triton_gemm.linear_small_m(x, *w8)
    pr.disable(); torch.cuda.synchronize()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    open(f"{out}/profile_launch.txt", "w").write(s.getvalue())
print(json.dumps(res, indent=1))
json.dump(res, open(f"{out}/host.json", "w"), indent=1)
