"""Where the rowwise MLP's time goes at M = 4096 (fast accumulation): GPU time per kernel."""

import json, os, torch
import fp8compile
from fp8compile.demo import GatedMLP
from torch.profiler import profile, ProfilerActivity

out = {}
for name, (h, i) in {"llama3-8b": (4096, 14336), "qwen2.5-7b": (3584, 18944)}.items():
    mlp = GatedMLP(h, i).cuda().to(torch.bfloat16)
    x = torch.randn(4096, h, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for fast in (True, False):
            torch._dynamo.reset()
            f = torch.compile(mlp, backend=fp8compile.backend(recipe="rowwise", fast_accum=fast))
            for _ in range(5):
                f(x)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                for _ in range(10):
                    f(x)
                torch.cuda.synchronize()
            rows = [
                (e.key, e.device_time_total / 10, e.count // 10)
                for e in p.key_averages()
                if e.device_time_total > 0
            ]
            rows.sort(key=lambda r: -r[1])
            key = f"{name} fast={fast}"
            out[key] = rows
            print(key, "total us", sum(r[1] for r in rows))
            for r in rows[:8]:
                print(f"  {r[1]:9.1f} us x{r[2]}  {r[0][:110]}")
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "rowwise_mlp_profile.json"), "w"), indent=1)
