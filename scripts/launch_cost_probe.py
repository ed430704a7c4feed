"""Probe (one session): host time of one kernel launch by each path, and of the pieces of our
Launcher (ops/launch.py), on a one-program kernel of 12 arguments. Each is called N times
without a sync; us per call. Writes $OUT/launch_cost_probe.json."""
import json
import os
import time

import torch
import triton
import triton.language as tl
from triton.runtime import driver

from fp8compile.ops import launch

N = 2000


@triton.jit
def _tiny(x_ptr, y_ptr, z_ptr, n, a, b, c, d, e, f, g, h, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, v + a + b + c + d + e + f + g + h, mask=offs < n)


def per_call(fn) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(N):
        fn()
    us = (time.perf_counter() - start) / N * 1e6
    torch.cuda.synchronize()
    return us


x = torch.randn(1024, device="cuda")
y = torch.empty_like(x)
z = torch.empty_like(x)
args = (x, y, z, 1000, 1, 2, 3, 4, 5, 6, 7, 8)
constexprs = dict(BLOCK=1024, FLAG=True)
launcher = launch.Launcher(_tiny)
launcher((1,), args, constexprs, num_warps=4)
compiled, tail = next(iter(launcher.compiled.values()))
active = driver.active
stream = active.get_current_stream(active.get_current_device())
results = {
    "triton kernel[grid](...)": per_call(lambda: _tiny[(1,)](*args, **constexprs, num_warps=4)),
    "our Launcher": per_call(lambda: launcher((1,), args, constexprs, num_warps=4)),
    "compiled.run, stream looked up": per_call(lambda: compiled.run(
        1, 1, 1, active.get_current_stream(active.get_current_device()), compiled.function,
        compiled.packed_metadata, None, None, None, *args, *tail)),
    "compiled.run, stream given": per_call(lambda: compiled.run(
        1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *args, *tail)),
    "Launcher piece: _signature": per_call(lambda: launch._signature(args)),
    "Launcher piece: _no_hooks": per_call(launch._no_hooks),
    "Launcher piece: stream lookup": per_call(lambda: active.get_current_stream(active.get_current_device())),
    "torch.cuda.current_stream().cuda_stream": per_call(lambda: torch.cuda.current_stream().cuda_stream),
    "aten add out= (eager launch)": per_call(lambda: torch.add(x, 1, out=y)),
    "torch.empty(1024) on cuda": per_call(lambda: torch.empty(1024, device="cuda")),
    "python: tuple of 12 ints": per_call(lambda: tuple(int(i) for i in range(12))),
}
try:
    from torch._inductor.runtime.static_cuda_launcher import StaticallyLaunchedCudaKernel

    static = StaticallyLaunchedCudaKernel(compiled)
    static.load_kernel(0)
    results["torch static launcher (Inductor's)"] = per_call(lambda: static.run(1, 1, 1, stream, *args))
except Exception as error:  # noqa: BLE001  (a probe: say why and go on)
    results["torch static launcher (Inductor's)"] = repr(error)[:200]
for name, us in results.items():
    print(f"{name:45s} {us if isinstance(us, str) else round(us, 2)}")
json.dump(results, open(os.path.join(os.environ.get("OUT", "."), "launch_cost_probe.json"), "w"), indent=1)
