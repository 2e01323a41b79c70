# Why the speculative CPU step runs at ~2.7 Gparam/s during backward and ~6.3 after it: CPU Adam (out of place, as
# the speculative worker steps) in a side thread, alone and while the GPU copies into pinned host memory (the grads'
# D2H), and while the main thread launches kernels.
import json, sys, threading, time, torch
sys.path.insert(0, ".")
from fsdpzero.ops import cpu_adam
n_chunk, chunks = 25 * 2**20, 16
P = [torch.randn(n_chunk) for _ in range(chunks)]; M = [torch.zeros(n_chunk) for _ in range(chunks)]
V = [torch.zeros(n_chunk) for _ in range(chunks)]
P2 = [torch.empty(n_chunk) for _ in range(chunks)]; M2 = [torch.empty(n_chunk) for _ in range(chunks)]
V2 = [torch.empty(n_chunk) for _ in range(chunks)]
G = [torch.randn(n_chunk).bfloat16().pin_memory() for _ in range(chunks)]
O = [torch.empty(n_chunk, dtype=torch.bfloat16).pin_memory() for _ in range(chunks)]
kw = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=3)
dev = torch.device("cuda")
src = torch.randn(2**30 // 2, device=dev, dtype=torch.bfloat16)       # 1 GiB
dst = torch.empty(src.shape, dtype=torch.bfloat16).pin_memory()
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

def adam(threads, into, out):
    def body():
        torch.set_num_threads(threads)
        t = time.perf_counter()
        for k in range(chunks):
            if into:
                cpu_adam.adam_step_(P2[k], G[k], M2[k], V2[k], O[k], src=(P[k], M[k], V[k]), **kw)
            else:
                cpu_adam.adam_step_(P[k], G[k], M[k], V[k], O[k], **kw)
        out["gparam_s"] = n_chunk * chunks / (time.perf_counter() - t) / 1e9
    th = threading.Thread(target=body); th.start(); return th

rows = []
for threads in (11, 15):
    for into in (True, False):
        for kind in ("none", "d2h", "gemm", "both"):
            out = {}
            adam(threads, into, {}).join()      # warm
            th = adam(threads, into, out)
            t0 = time.perf_counter()
            copies = 0
            if kind != "none":
                while th.is_alive():   # the main thread loads the GPU/DMA while the worker steps
                    if kind in ("d2h", "both"):
                        dst.copy_(src, non_blocking=True); copies += 1
                    if kind in ("gemm", "both"):
                        for _ in range(4):
                            a @ a
                    torch.cuda.synchronize()
            th.join()
            el = time.perf_counter() - t0
            r = dict(threads=threads, out_of_place=into, load=kind, gparam_s=round(out["gparam_s"], 3),
                     d2h_GBps=round(copies * 1.0737 / el, 1))
            rows.append(r); print(json.dumps(r), flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
