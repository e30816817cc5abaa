"""Device experiment: which variant of a graphed Linear invalidates a CUDA capture. Each case
runs in its own process (a failed capture poisons the CUDA state of the process)."""

import subprocess
import sys

CASE = r"""
import gc, sys, torch, graphfp8 as g8
from graphfp8.graphs import backends
req, bias, mode, nogc = (sys.argv[1] == "1", sys.argv[2] == "1", sys.argv[3], sys.argv[4] == "1")
if mode != "global":
    orig = torch.cuda.graph.__init__
    def patched(self, g, pool=None, stream=None, capture_error_mode="global"):
        orig(self, g, pool=pool, stream=stream, capture_error_mode=mode)
    torch.cuda.graph.__init__ = patched
if nogc:
    gc.disable()
m = g8.Linear(32, 32, bias=bias, params_dtype=torch.bfloat16, device="cuda")
x = torch.ones(48, 32, dtype=torch.bfloat16, device="cuda", requires_grad=req)
try:
    g = g8.make_graphed_callables(m, (x,), fp8_enabled=True,
        fp8_recipe=g8.DelayedScaling(amax_history_len=4), fp8_weight_caching=True)
    g(x, is_first_microbatch=True).float().sum().backward()
    torch.cuda.synchronize()
    print("OK")
except Exception as e:
    print("FAIL", type(e).__name__, str(e).splitlines()[0][:150])
"""

for req in ("1", "0"):
    for bias in ("1", "0"):
        for mode, nogc in (
            ("global", "0"),
            ("global", "1"),
            ("thread_local", "0"),
            ("relaxed", "0"),
        ):
            out = subprocess.run(
                [sys.executable, "-c", CASE, req, bias, mode, nogc], capture_output=True, text=True
            )
            last = (out.stdout.strip().splitlines() or [out.stderr.strip().splitlines()[-1]])[-1]
            print(f"requires_grad={req} bias={bias} mode={mode} gc_off={nogc}: {last}", flush=True)
