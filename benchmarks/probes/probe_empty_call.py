"""FlashInfer's kernel and arfusion's ops with 0 tokens (an empty batch), two ranks on one GPU. Not
collected by pytest.

    source .device/setup.sh && torchrun --nproc-per-node 2 benchmarks/probes/probe_empty_call.py

The ops first (the fused op, then the plain fast all-reduce, at 8 then 0 tokens), then the backend's
kernel called directly at 0 tokens, as the ops did before 642201a, and the calls after it. Each
rank writes what each step gave to $OUT/rank<r>.json (docs/data/empty_call_shared_gpu_h100_w2.json,
docs/history/2026-12-08-audit-runtime-inputs.md).
"""
import os, sys, time, json
sys.path.insert(0, "tests/gpu")
import torch, torch.distributed as dist
import shared_gpu
device = shared_gpu.init(True, hang_s=150)
rank = dist.get_rank()
import arfusion, arfusion.ops
from arfusion import reference
from arfusion.core import Call, Form
from arfusion.backends import get_backend
g = dist.group.WORLD.group_name
be = get_backend("flashinfer")
out = {}
w = torch.ones(1024, dtype=torch.bfloat16, device=device)
def step(name, fn):
    try:
        r = fn(); torch.cuda.synchronize(); out[name] = "ok " + str(r)
    except Exception as e:
        out[name] = f"ERR {type(e).__name__}: {str(e)[:300]}"
    print(rank, name, out[name], flush=True)
    try:
        torch.cuda.synchronize()
    except Exception as e:
        print(rank, "sync after", name, type(e).__name__, str(e)[:200], flush=True)
form = Form(residual=True, norm="rms")
def op(T):
    x = torch.randn(T, 1024, dtype=torch.bfloat16, device=device); r = torch.randn_like(x)
    got = torch.ops.arfusion.fused_allreduce_rmsnorm(x=x, residual=r, weight=w, eps=1e-6, eps_tensor=None, group_name=g, norm="rms", quant="none", quant_scale=None, emit_norm=True, backend="flashinfer")
    return [list(t.shape) for t in got], arfusion.stats()["dispatch"]
def plain(T):
    x = torch.randn(T, 1024, dtype=torch.bfloat16, device=device)
    got = torch.ops.arfusion.all_reduce(x=x, group_name=g, backend="flashinfer")
    return list(got.shape), arfusion.stats()["dispatch"]
def kernel_direct(T):  # what the op did before the fix: the backend's kernel at T tokens
    x = torch.randn(T, 1024, dtype=torch.bfloat16, device=device); r = torch.randn_like(x)
    call = Call.of_tensors(form, x, w, 2, g)
    assert be.why_not(call) is None and be.prepare(call) is None
    got = be.run(call, x, r, w, 1e-6, None)
    return [list(t.shape) for t in got]
def plain_direct(T):
    x = torch.randn(T, 1024, dtype=torch.bfloat16, device=device)
    call = Call.of_tensors(Form(residual=False, norm="none"), x, None, 2, g)
    return list(be.all_reduce(call, x.reshape(-1, 1024)).shape)
step("op T=8", lambda: op(8))
step("op T=0", lambda: op(0))
step("plain T=8", lambda: plain(8))
step("plain T=0", lambda: plain(0))
step("op T=8 again", lambda: op(8))
step("kernel direct T=0", lambda: kernel_direct(0))
step("kernel direct T=8 after", lambda: kernel_direct(8))
step("plain direct T=0", lambda: plain_direct(0))
step("op T=8 last", lambda: op(8))
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), f"rank{rank}.json"), "w"), indent=1)
dist.barrier()
os._exit(0)
