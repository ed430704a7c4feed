import time, torch, fp8compile, sys
from torch import nn
from fp8compile import registry
from tests.conftest import RANGES

def null(x, w_fp8, w_scale, bias=None, e8m0=False, **kw):
    return x.new_empty(x.shape[0], w_fp8.shape[0])

ops = {"linear": null}
def serving(lo, hi):
    def why_not(r):
        if r.m_min < lo or (hi is not None and (r.m_max is None or r.m_max > hi)):
            return "range"
    return why_not
registry.register(registry.Backend("n_small", ops, serving(1, 32)))
registry.register(registry.Backend("n_medium", ops, serving(33, 64)))
registry.register(registry.Backend("n_large", ops, serving(65, None)))
B = ("n_small", "n_medium", "n_large")
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(8)]).to(torch.bfloat16)

def timeit(fn, x, n=3000):
    for _ in range(50): fn(x)
    best = []
    for rep in range(5):
        t = time.perf_counter()
        for _ in range(n): fn(x)
        best.append((time.perf_counter() - t) / n * 1e6 / 8)
    return min(best)

res = {}
with torch.no_grad():
  if len(sys.argv) == 1:
   for name, kw, dyn in [("static", {}, False), ("functions", {}, True), ("inline", {"inline_conds": True}, True)]:
        torch._dynamo.reset()
        c = torch.compile(model, backend=fp8compile.backend(backends=B, **RANGES, **kw), dynamic=dyn)
        for m in (4, 40, 100):
            x = torch.randn(m, 256, dtype=torch.bfloat16)
            res[(name, m)] = timeit(c, x)
        print(name, {m: round(res[(name, m)], 2) for m in (4, 40, 100)}, flush=True)
from torch._inductor.utils import run_and_get_code
if len(sys.argv) > 1:
    torch._dynamo.reset()
    c = torch.compile(model, backend=fp8compile.backend(backends=B, **RANGES, inline_conds=sys.argv[1] == "inline"), dynamic=True)
    with torch.no_grad():
        c(torch.randn(4, 256, dtype=torch.bfloat16))
        _, (code, *_) = run_and_get_code(c, torch.randn(40, 256, dtype=torch.bfloat16))
    i = code.index("def call(self, args)")
    print(code[i:i+3000])
