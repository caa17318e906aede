"""Helpers the benchmarks share: what the fused op ran, errors, timing by difference, saving, plots.

Timing inside CUDA graphs (`time_in_graph`) and the progress bar (`Progress`) are the package's
own (`arfusion.tuning`); import them from there.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Callable, Sequence

import torch

# No NVLink multicast anywhere (NCCL NVLS, torch symmetric memory, NVSHMEM): as .device/setup.sh.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def no_multicast() -> None:
    """Set NO_MULTICAST before any communicator or symmetric buffer exists."""
    os.environ.update(NO_MULTICAST)


def rank0_print(rank: int) -> Callable[..., None]:
    """print (flushed) on rank 0, nothing elsewhere."""
    if rank != 0:
        return lambda *a, **k: None
    return lambda *a, **k: print(*a, **{"flush": True, **k})


def dispatch_since(before: dict) -> dict:
    """arfusion.stats()["dispatch"] counts added since `before` (an earlier arfusion.stats())."""
    import arfusion

    old = before["dispatch"]
    return {k: v - old.get(k, 0) for k, v in arfusion.stats()["dispatch"].items() if v != old.get(k, 0)}


# ----------------------------------------------------------------- errors


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative L2 error of the whole tensor, in fp32."""
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()


def rel_err_rows(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Relative L2 error of each row (over the last dim: a position's logits), in fp32."""
    got, want = got.float(), want.float()
    return (got - want).norm(dim=-1) / want.norm(dim=-1)


def top1_same(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """1.0 where both rows' argmax agree, else 0.0 (per row of the last dim)."""
    return (got.argmax(-1) == want.argmax(-1)).float()


# ----------------------------------------------------------------- timing


def sync(device: torch.device | str | None = None) -> None:
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


def wall_ms(fn: Callable[[], object], device=None) -> float:
    """Wall milliseconds of one fn() call, the device synchronised before and after."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3


def by_difference(long_n: int, long_value: float, short_n: int, short_value: float) -> tuple[float, float]:
    """(per token, fixed per call) from one quantity measured for two lengths of the same call:
    the slope long - short over the tokens between them, and what is left of the short call.
    A whole call divided by its tokens mixes the two (prefill, cache set-up, compile checks)."""
    per_token = (long_value - short_value) / (long_n - short_n)
    return per_token, short_value - short_n * per_token


def steady_state(samples: dict[int, Sequence[float]]) -> dict:
    """`samples[n]`: wall ms of calls making n new tokens, at two lengths, in pairs (rep i of each
    length ran back to back). Steady-state ms per token is the median over pairs of the difference
    between the two lengths; the fixed per-call cost is the short call's median less its tokens
    at that rate. `naive_ms_per_token` is the long call divided by its tokens (the old method)."""
    long_n, short_n = max(samples), min(samples)
    pairs = [by_difference(long_n, a, short_n, b)[0] for a, b in zip(samples[long_n], samples[short_n])]
    per_token = statistics.median(pairs)
    long_ms, short_ms = statistics.median(samples[long_n]), statistics.median(samples[short_n])
    return {"ms_per_token": round(per_token, 4), "fixed_ms": round(short_ms - short_n * per_token, 3),
            "lengths": [long_n, short_n], "call_ms": {str(long_n): round(long_ms, 3), str(short_n): round(short_ms, 3)},
            "ms_per_token_pairs": [round(p, 4) for p in pairs],
            "samples_ms": {str(n): [round(v, 3) for v in samples[n]] for n in (long_n, short_n)},
            "naive_ms_per_token": round(long_ms / long_n, 4), "method": "difference of two lengths"}


def per_token_counts(long_n: int, long_counts: dict, short_n: int, short_counts: dict) -> dict:
    """{name: {"per_token", "per_call"}} for counts (kernels, graph launches, replays) taken over
    one call at each of two lengths: per new token by difference, and the fixed rest per call."""
    out = {}
    for key in sorted(set(long_counts) | set(short_counts)):
        per_token, fixed = by_difference(long_n, long_counts.get(key, 0), short_n, short_counts.get(key, 0))
        out[key] = {"per_token": round(per_token, 3), "per_call": round(fixed, 3)}
    return out


# ----------------------------------------------------------------- results


def save_json(path: str, obj) -> str:
    """Write obj as indented JSON (folders made as needed); returns the path."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    return path


def rounded(row: dict, digits: int = 2) -> dict:
    """A row with its floats rounded, for one-line progress prints."""
    return {k: round(v, digits) if isinstance(v, float) else v for k, v in row.items()}


def pyplot():
    """matplotlib.pyplot drawing off-screen (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, png: str) -> None:
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")
