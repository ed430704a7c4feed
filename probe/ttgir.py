import sys, re, importlib, subprocess, tempfile, os
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sys.path.insert(0, "probe")
mod = importlib.import_module(sys.argv[1])
fn = mod.kern if hasattr(mod, "kern") else mod._mqa_logits_kernel
kw = dict(a.split("=") for a in sys.argv[2:])
warps = int(kw.pop("warps", 8))
consts = {k: int(v) for k, v in kw.items()}
sig = {}
for name in fn.arg_names:
    if name in consts:
        sig[name] = "constexpr"
    elif name.endswith("_ptr"):
        sig[name] = "*fp8e4nv" if name in ("q_ptr", "k_ptr") else ("*i32" if name in ("ks_ptr", "ke_ptr") else "*fp32")
    else:
        sig[name] = "i32"
div = [n for n in fn.arg_names if n.endswith("_ptr") or n.startswith("stride") or n in ("N", "M")]
attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div}
src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs)
c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
ttgir = c.asm["ttgir"]
open("/tmp/k.ttgir", "w").write(ttgir); open("/tmp/k.ptx", "w").write(c.asm["ptx"])
print("shared", c.metadata.shared, "convert_layout", ttgir.count("convert_layout"), "wgmma", c.asm["ptx"].count("wgmma.mma_async"),
      "local_alloc", ttgir.count("local_alloc"), "async_copy", ttgir.count("async_copy"), "tma", ttgir.count("tma"))
open("/tmp/k.cubin", "wb").write(c.asm["cubin"])
bin = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
r = subprocess.run([bin, "--dump-resource-usage", "/tmp/k.cubin"], capture_output=True, text=True)
print([l.strip() for l in r.stdout.splitlines() if "REG" in l])
