"""Device probe: where the host time of a graphed microbatch goes (graph launch cost by node
count, and the forward / backward halves of a graphed graphfp8 block).

    PYTHONPATH=. python scripts/host_probe.py     (from the repository root: it uses benchmarks/)
"""

import statistics
import time

import torch

import graphfp8 as g8
from benchmarks.peers import G8Stack


def host_us(fn, iters=200):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - t0) / iters * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


x = torch.ones(16, device="cuda")
for nodes in (1, 10, 50, 200):
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x.add_(1)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for _ in range(nodes):
            x.add_(1)
    print(f"graph of {nodes:3d} tiny kernels: replay host {host_us(g.replay):6.1f} us", flush=True)
print(f"one eager tiny kernel: {host_us(lambda: x.add_(1)):.1f} us")
for layers in (1, 8):
    m = G8Stack(1024, layers)
    xin = torch.randn(2048, 1024, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dy = torch.randn_like(xin)
    gr = g8.make_graphed_callables(m, (xin,), fp8_enabled=True, fp8_weight_caching=True)
    r = m.graphed_runner.pair
    gr(xin, is_first_microbatch=True).backward(dy)

    def fwd(gr=gr, xin=xin):
        return gr(xin, is_first_microbatch=False)

    def fwd_bwd(gr=gr, xin=xin, dy=dy):
        gr(xin, is_first_microbatch=False).backward(dy)

    print(
        f"{layers} layers: fwd replay host {host_us(r.fwd_graph.replay, 50):.1f} us, "
        f"bwd replay {host_us(r.bwd_graph.replay, 50):.1f} us, "
        f"graphed fwd call {host_us(fwd, 50):.1f} us, fwd+bwd {host_us(fwd_bwd, 50):.1f} us",
        flush=True,
    )
