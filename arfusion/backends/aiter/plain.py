"""aiter's plain custom all-reduce (`CustomAllreduce.custom_all_reduce(input)`): which calls it
takes, and the sum through torch's all-reduce wherever it gives nothing.

Eager mode and CUDA graphs. aiter's own communicator (COMM all_reduce) calls
`custom_all_reduce(input_)`, and aiter's graph capture (aiter/dist/parallel_state.py
graph_capture) wraps the capture in `ca.capture()`, inside which aiter reduces from the input's
own address and registers those addresses with the peers after capture (a collective). arfusion
never enters `ca.capture()`: torch captures torch.compile's CUDA graphs, and arfusion has no
place for that collective. So every call, captured or not, takes aiter's eager path: the input
is copied into the communicator's registered buffer (a fixed address, exchanged at set-up) and
reduced from there. It is the copy-in path aiter itself takes during capture with
`enable_register_for_capturing=False` (aiter#2075), on gfx1250 and under expandable segments
(aiter#4621). Never run on AMD hardware.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import reference
from ...core import Call
from ...decisions import Reason, Why
from ...runtime import log_once
from ..base import over_cap
from .limits import CUSTOM_AR_MIN_SIZE_ENV, LIMITS, custom_ar_window


def plain_problem(call: Call, max_bytes_override: int | None = None) -> Reason | None:
    """Why aiter's custom all-reduce does not take `call`, or None: from facts the same on every
    rank (dtype, world size, bytes, aiter's window from the environment, the user's cap).
    Tokens None (compile time): decided at run time. Bounds as aiter's: (low, high]."""
    if call.dtype not in LIMITS.plain_dtypes:
        return Reason(Why.DTYPE, f"aiter's custom all-reduce takes {[str(d) for d in LIMITS.plain_dtypes]}, "
                                 f"not {call.dtype}")
    if call.world_size not in LIMITS.plain_world_sizes:
        return Reason(Why.WORLD_SIZE, "aiter's custom all-reduce takes world sizes "
                                      f"{list(LIMITS.plain_world_sizes)}, not {call.world_size}")
    low, high = custom_ar_window()
    source = "aiter's custom all-reduce window"
    if max_bytes_override is not None and max_bytes_override < high:
        high, source = max_bytes_override, "the configured plain_max_size_mb"
    if high <= low:
        return Reason(Why.SIZE_CAP, f"aiter's custom all-reduce takes no size: ({low}, {high}] is empty ({source})")
    nbytes = call.nbytes
    if nbytes is None:
        return None
    if nbytes == 0:
        return Reason(Why.SHAPE, "no tokens")
    if nbytes % LIMITS.plain_align_bytes:
        return Reason(Why.SHAPE, f"{nbytes} bytes per rank is not a multiple of {LIMITS.plain_align_bytes} "
                                 "(aiter's custom all-reduce)")
    if nbytes <= low:
        return Reason(Why.SIZE_CAP, f"{nbytes} bytes per rank <= {low} ({CUSTOM_AR_MIN_SIZE_ENV}): aiter leaves it "
                                    "to RCCL")
    return over_cap(call, high, source)


def sum_or_torch(comm: Any, x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of `x` over the group: aiter's custom all-reduce, or torch's all-reduce where aiter
    gives nothing (None: disabled, or the input outside its window; or an exception), logged
    once. aiter's None depends only on sizes and on the communicator being disabled, the same
    on every rank, so all ranks take the same path."""
    try:
        reduced = comm.custom_all_reduce(x)
    except Exception as e:
        log_once(f"arfusion: aiter plain all-reduce raised {type(e).__name__}: {e}; using torch's")
        reduced = None
    else:
        if reduced is None:
            log_once("arfusion: aiter's custom all-reduce returned None (disabled, or the input is outside "
                     "its window); using torch's")
    if reduced is None:
        reduced = reference.all_reduce_sum(x, group_name)
    return reduced
