"""The aiter backend (AMD Instinct GPUs), by concern; imports point down the list:

* `limits`: every number it decides by (`LIMITS`), the environment variables it reads, aiter's
  custom all-reduce window (`custom_ar_window`);
* `detection`: whether aiter can run here and what the installed version offers (`detect`);
* `communicator`: aiter's CustomAllreduce on the matched TP group and its gloo twin;
* `plain`: the plain all-reduce through aiter's custom all-reduce (which calls it takes, and the
  sum with torch's all-reduce where aiter gives nothing);
* `stages`: the fused stages of one call and the plan of which to try;
* `quick_reduce`: aiter's quick all-reduce (the opt-in quantized all-reduce) and its set-up;
* `backend`: `AiterBackend`, which puts them together.

aiter itself is never imported when this package is imported (see `detection`).
"""

from .backend import AiterBackend

__all__ = ["AiterBackend"]
