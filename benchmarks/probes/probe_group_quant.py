"""How fast each way of compiling arfusion's unfused kernels runs inside CUDA graphs (one GPU):
the per-group quant after FlashInfer's norm, and the fallback's add+RMSNorm+quant.
(A first run also showed the compiled code does run inside captures under
set_stance("eager_on_recompile"): the slow part was the fully dynamic kernel.)

    python benchmarks/probes/probe_group_quant.py
"""

from __future__ import annotations

import json
import os

import torch

from arfusion import quant, runtime, tuning


def main():
    from arfusion import reference
    from arfusion.core import Form

    torch.cuda.set_device(0)
    site = Form(residual=True, norm="rms", quant="fp8_dynamic", emit_norm=False)
    weight = torch.ones(4096, device="cuda", dtype=torch.bfloat16)

    def norm_quant(fn):  # the compiled fallback's kernel: add + RMSNorm + per-token quant
        return lambda x: fn(x, x, weight, 1e-6, site, None)

    variants = {
        "group eager": quant.fp8_group,
        "group ops.compiled (token dims dynamic)": runtime.compiled(quant.fp8_group),
        "group dynamic=True": torch.compile(quant.fp8_group, dynamic=True),
        "group static": torch.compile(quant.fp8_group, dynamic=False),
        "fallback ops.compiled (token dims dynamic)": norm_quant(runtime.compiled(reference.add_rms_norm)),
        "fallback dynamic=True": norm_quant(torch.compile(reference.add_rms_norm, dynamic=True)),
        "fallback static": norm_quant(torch.compile(reference.add_rms_norm, dynamic=False)),
    }
    rows = []
    for t in (1, 8, 128, 2048, 8192):
        x = torch.randn(t, 4096, device="cuda", dtype=torch.bfloat16)
        row = {"tokens": t}
        for name, fn in variants.items():
            try:
                row[name] = round(tuning.time_in_graph(lambda: fn(x), calls=50, replays=20), 2)
            except Exception as e:
                row[name] = f"{type(e).__name__}: {str(e)[:150]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "probe_group_quant.json"), "w") as f:
            json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
