"""Why per-group FP8 after FlashInfer's norm is slow in CUDA graphs: the quant kernel alone,
one GPU, per call inside a CUDA graph, for each way of running arfusion.quant.fp8_group.

    python tests/gpu/probe_group_quant.py
"""

from __future__ import annotations

import json
import os

import torch

from arfusion import ops, quant


def in_graph_us(fn, x, calls=50, replays=20):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            out = fn(x)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / calls)
    return sorted(times)[len(times) // 2], out


def marker(x):  # 1 where compiled code ran, 0 where eager
    return x[:1, :1].float() * 0 + (1.0 if torch.compiler.is_compiling() else 0.0)


def main():
    torch.cuda.set_device(0)
    dyn = torch.compile(quant.fp8_group, dynamic=True)
    static = torch.compile(quant.fp8_group, dynamic=False)
    mark_dyn = torch.compile(marker, dynamic=True)

    def with_stance(fast, stance):
        def run(x):
            if torch.cuda.is_current_stream_capturing():
                with torch.compiler.set_stance(stance):
                    return fast(x)
            return fast(x)
        return run

    variants = {
        "eager": quant.fp8_group,
        "ops.compiled (eager_on_recompile in capture)": ops.compiled(quant.fp8_group),
        "dynamic, fail_on_recompile in capture": with_stance(dyn, "fail_on_recompile"),
        "dynamic, no stance": dyn,
        "static, no stance": static,
    }
    rows = []
    for t in (1, 8, 128, 2048):
        x = torch.randn(t, 4096, device="cuda", dtype=torch.bfloat16)
        row = {"tokens": t}
        for name, fn in variants.items():
            try:
                row[name] = round(in_graph_us(fn, x)[0], 2)
            except Exception as e:
                row[name] = f"{type(e).__name__}: {str(e)[:150]}"
        for stance in ("eager_on_recompile", "fail_on_recompile", None):
            fn = mark_dyn if stance is None else with_stance(mark_dyn, stance)
            try:
                _, out = in_graph_us(fn, x, calls=1, replays=1)
                row[f"compiled code ran in capture ({stance})"] = bool(out.item() == 1.0)
            except Exception as e:
                row[f"compiled code ran in capture ({stance})"] = f"{type(e).__name__}: {str(e)[:150]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "probe_group_quant.json"), "w") as f:
            json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
