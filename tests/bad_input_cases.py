"""The awkward-input cases (docs/reliability.md), run by one rank of an initialised group.

`tests/test_bad_inputs.py` runs them on 2 gloo ranks on CPU with the `torch` backend;
`tests/gpu/check_bad_inputs.py` runs the same cases on GPUs through FlashInfer. Every case
compiles a small model with the pass and compares it with the same model run eagerly (unfused):
same shapes and dtypes, NaN and Inf at the same places, finite values within the gloo tests'
tolerance, inputs unmodified. A raised error is recorded (a clear error is an allowed outcome;
the callers say which cases may end so).
"""

from __future__ import annotations

import logging
import time
import traceback

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from .models import LlamaStyleRMSNorm, RowParallelThenNorm

BF16 = torch.bfloat16
TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}  # as tests/test_numerics_gloo.py


def _rel_err(actual, expected) -> float:
    if not expected.numel():
        return 0.0
    a, e = actual.float(), expected.float()
    return ((a - e).abs().max() / max(e.abs().max().item(), 1e-30)).item()


def compare(actual, expected) -> dict:
    """Shape/dtype equal; NaN and Inf at the same places (Inf with the same sign); the finite
    values within the relative tolerance of the existing gloo tests."""
    actual = actual if isinstance(actual, (list, tuple)) else [actual]
    expected = expected if isinstance(expected, (list, tuple)) else [expected]
    out = {"ok": True, "err": 0.0, "shapes": [list(a.shape) for a in actual], "problems": []}
    for i, (a, e) in enumerate(zip(actual, expected)):
        if a.shape != e.shape or a.dtype != e.dtype:
            out["problems"].append(f"output {i}: {a.dtype}{list(a.shape)} vs eager {e.dtype}{list(e.shape)}")
            continue
        if not torch.equal(a.isnan(), e.isnan()):
            out["problems"].append(f"output {i}: NaN masks differ ({int(a.isnan().sum())} vs {int(e.isnan().sum())})")
        inf_a, inf_e = a.isinf(), e.isinf()
        if not torch.equal(inf_a, inf_e) or not torch.equal(a[inf_a], e[inf_e]):
            out["problems"].append(f"output {i}: Inf masks or signs differ")
        finite = e.isfinite() & a.isfinite()
        err = _rel_err(a[finite], e[finite])
        out["err"] = max(out["err"], err)
        if err > TOL[e.dtype]:
            out["problems"].append(f"output {i}: relative error {err:.2e} > {TOL[e.dtype]:.0e}")
    out["ok"] = not out["problems"] and len(actual) == len(expected)
    out["nan"] = [int(a.isnan().sum()) for a in actual]
    out["inf"] = [int(a.isinf().sum()) for a in actual]
    return out


class Direct(nn.Module):
    """The all-reduce reads the graph input itself, so the fused op sees its strides."""

    def __init__(self, hidden):
        super().__init__()
        self.norm = LlamaStyleRMSNorm(hidden)

    def forward(self, y, residual):
        h = residual + funcol.all_reduce(y, "sum", dist.group.WORLD)
        return self.norm(h), h


class ScaledDirect(Direct):
    """Granite: the all-reduced value scaled by a number before the add (the op's input_scale)."""

    def forward(self, y, residual):
        h = residual + funcol.all_reduce(y, "sum", dist.group.WORLD) * 0.22
        return self.norm(h), h


class ScaledByBuffer(Direct):
    """Gemma: the all-reduced embedding times a 0-d bf16 buffer, normed, and the residual stream."""

    def __init__(self, hidden):
        super().__init__(hidden)
        self.register_buffer("normaliser", torch.tensor(hidden ** 0.5, dtype=BF16))

    def forward(self, y, residual):
        h = funcol.all_reduce(y, "sum", dist.group.WORLD) * self.normaliser
        return self.norm(h), h + residual


class ScaledByAttribute(Direct):
    """HF Granite's `* self.residual_multiplier`: under dynamic=True an fp32 0-d graph input."""

    residual_multiplier = 0.22

    def forward(self, y, residual):
        h = residual + funcol.all_reduce(y, "sum", dist.group.WORLD) * self.residual_multiplier
        return self.norm(h), h


class Fp32WeightNorm(nn.Module):
    """OLMo2-style norm (weight applied in fp32, one rounding) whose weight is an fp32 parameter
    while the activations are bf16: the kernels would misread it."""

    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(hidden))  # fp32
        self.eps = 1e-6

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


class Fp32WeightBlock(RowParallelThenNorm):
    def __init__(self, hidden):
        super().__init__(hidden)
        self.norm = Fp32WeightNorm(hidden)


def run_case(name, model, inputs, backend, results, messages, dynamic=False) -> None:
    import arfusion

    arfusion.reset_stats()
    torch._dynamo.reset()
    started = time.perf_counter()
    first_message = len(messages)
    options = arfusion.inductor_options(arfusion.PassConfig(enable_allreduce_fusion=True, backend=backend))
    before = [t.clone() for t in inputs]
    try:
        with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
            expected = model(*inputs)
            actual = torch.compile(model, options=options, dynamic=dynamic)(*inputs)
        result = compare(actual, expected)
        if not all(torch.equal(b.isnan(), t.isnan()) and torch.equal(b.nan_to_num(), t.nan_to_num())
                   for b, t in zip(before, inputs)):
            result["ok"] = False
            result["problems"].append("an input was modified")
    except Exception as e:
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000], "trace": traceback.format_exc()[-3000:]}
    stats = arfusion.stats()
    result["stats"] = {k: stats[k] for k in ("fused_sites", "unfused_sites", "why_not_codes", "dispatch", "by_pattern")}
    # What became of each all-reduce: its fate, the code of why it was not fused, and that reason's message.
    result["decisions"] = [{k: d[k] for k in ("fate", "code", "reason")} for d in arfusion.stats.decisions()]
    result["log"] = messages[first_message:]
    result["seconds"] = round(time.perf_counter() - started, 2)
    results[name] = result


def run_bad_inputs(rank: int, device: torch.device, backend: str, hidden: int = 64, tokens: int = 5,
                   progress=None) -> dict:
    """Every 2-rank case on this rank; returns {case: result}. `hidden` must be a multiple of 8
    (one case uses 36 on purpose)."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("arfusion").addHandler(handler)
    logging.getLogger("arfusion").setLevel(logging.INFO)
    results: dict = {}
    H, T = hidden, tokens

    def rand(*shape, dtype=BF16):
        return torch.randn(*shape, dtype=dtype).to(device)

    def case(name, model, inputs, dynamic=False):
        if progress:
            progress(name)
        run_case(name, model, inputs, backend, results, messages, dynamic)

    torch.manual_seed(0)  # same weights on every rank
    direct, block = Direct(H).to(device), RowParallelThenNorm(H).to(device)
    block36, fp32w = RowParallelThenNorm(36).to(device), Fp32WeightBlock(H).to(device)
    torch.manual_seed(100 + rank)  # different activations per rank

    # Non-contiguous: every other column of a wider buffer; the residual a transposed buffer.
    wide, tall = rand(T, 2 * H), rand(H, T)
    case("strided_slice", direct, (wide[:, ::2], tall.t()))
    # Transposed and transposed back (contiguous again, but through two views) into the matmul.
    case("transposed_back", block, (rand(H, T).t().t().t().contiguous().t().t(), rand(T, H)))
    # Offset views: x[1:] of a bigger buffer, as all-reduce input and as residual.
    buf, rbuf = rand(T + 1, H), rand(T + 3, H)
    case("offset_view", direct, (buf[1:], rbuf[3:]))
    # Zero tokens, static and dynamic shapes.
    case("zero_tokens", block, (rand(0, H), rand(0, H)))
    case("zero_tokens_dynamic", block, (rand(0, H), rand(0, H)), dynamic=True)
    # NaN and Inf: rank 0 puts a NaN in row 1, rank 1 +Inf in row 2 and -Inf in row 3 (of the
    # all-reduce input), and the residual has a NaN in row 4 on every rank.
    y, r = rand(T, H), rand(T, H)
    if rank == 0:
        y[1, 3] = float("nan")
    else:
        y[2, 5], y[3, 7] = float("inf"), float("-inf")
    r[4 % T, 0] = float("nan")
    case("nan_inf", direct, (y, r))
    # Negative zeros: FlashInfer's one-shot kernels mark "not written yet" with -0.0 in their
    # Lamport buffers, so an all-reduce input of -0.0 must not read as a missing peer (a hang)
    # or as garbage. Row 0 is -0.0 on every rank, row 1 on rank 0 only.
    y, r = rand(T, H), rand(T, H)
    y[0] = -0.0
    if rank == 0:
        y[1 % T] = -0.0
    case("negative_zero", direct, (y, r))
    # Granite's multiplier between the all-reduce and the add, static and dynamic shapes.
    scaled = ScaledDirect(H).to(device)
    case("scaled_input", scaled, (rand(T, H), rand(T, H)))
    case("scaled_input_dynamic", scaled, (rand(T + 2, H), rand(T + 2, H)), dynamic=True)
    # A 0-d tensor as the factor (the op's input_scale_tensor): Gemma's buffer, and a float
    # attribute, which dynamic=True turns into a graph input.
    case("scaled_by_a_buffer", ScaledByBuffer(H).to(device), (rand(T, H), rand(T, H)))
    case("scaled_by_an_attribute_dynamic", ScaledByAttribute(H).to(device), (rand(T + 2, H), rand(T + 2, H)),
         dynamic=True)
    # Hidden size 36 (not a multiple of 8).
    case("hidden_36", block36, (rand(T, 36), rand(T, 36)))
    # fp32 norm weight, bf16 activations.
    case("fp32_weight", fp32w, (rand(T, H), rand(T, H)))
    logging.getLogger("arfusion").removeHandler(handler)
    return results


def run_world_case(rank: int, device: torch.device, backend: str, hidden: int = 64) -> dict:
    """One fused site at whatever world size the group has (3 and 6 on CPU)."""
    torch.manual_seed(0)
    model = RowParallelThenNorm(hidden).to(device)
    torch.manual_seed(100 + rank)
    results: dict = {}
    name = f"world_{dist.get_world_size()}"
    inputs = (torch.randn(1, 4, hidden, dtype=BF16).to(device), torch.randn(1, 4, hidden, dtype=BF16).to(device))
    run_case(name, model, inputs, backend, results, [])
    results[name]["world_size"] = dist.get_world_size()
    return results
