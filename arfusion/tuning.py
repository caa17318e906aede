"""`arfusion tune`: measure where FlashInfer's fused kernel beats the unfused path, and cache it.

Run under torchrun, one process per GPU of the tensor-parallel group:

    torchrun --nproc-per-node 4 --no-python arfusion tune --hidden 4096

For each token count it times, inside CUDA graphs, (1) NCCL all_reduce in place + the
torch.compile'd add+RMSNorm (what a model runs when nothing is fused: its all-reduce input is a
matmul output, reduced in place), (2) the fused op with one-shot and (3) with two-shot, and with
`--quantized fp8` (4) the op's quantized all-reduce + compiled add+RMSNorm, and with `--knobs` (5)
FlashInfer's quantized all-reduce + that norm under each of its launch settings (`TUNE_KNOBS`) from
1 MiB per rank. Every rank then holds the slowest rank's numbers, so all derive the same crossover
points and knobs; rank 0 stores them in the JSON cache that dispatch reads
(`flashinfer_dispatch.cache_path()`), keyed by (GPU name, world size, hidden, dtype).
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from . import ops  # noqa: F401  (registers torch.ops.arfusion.*, called below)
from . import reference
from .backends import flashinfer_dispatch as dispatch
from .decisions import Reason
from .backends import get_backend
from .core import PLAIN, Call, Form

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048,
                  3072, 4096, 6144, 8192)
NORM_SITE = Form(residual=True, norm="rms")
# Launch knobs are timed from this size per rank: below it the quantized all-reduce lost to the exact
# path everywhere measured (0.52x at 1 MiB, 2xH200, TP=2; 0.90x at 1 MiB, 4xH200, TP=4).
KNOB_MIN_BYTES = dispatch.MiB
# A setting replaces FlashInfer's own only when this much faster: two runs of the pass on 2xH200 at
# 8 MiB (machines I and J, 2026-11-28) differed by 1.5%.
KNOB_MARGIN = 0.02


# ----------------------------------------------------------------- timing helpers


def time_in_graph(fn: Callable[[], object], group=None, calls: int = 20, replays: int = 30,
                  warmup: int = 3) -> float:
    """Median microseconds per `fn()` call, with `calls` calls captured in one CUDA graph and
    the graph replayed `replays` times (ranks aligned by a barrier before each replay).

    The warm-up runs eagerly on a side stream first: that is where lazily created resources
    (FlashInfer workspaces, compiled kernels) appear, never inside the capture.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    _barrier(group)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(replays):
        _barrier(group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / calls)
    del graph
    return statistics.median(samples)


def _barrier(group) -> None:
    if dist.is_initialized():  # one-GPU probes time without a process group
        dist.barrier(group=group)


def slowest_rank(values: Sequence[float], group=None) -> list[float]:
    """Each value's maximum over the group, so every rank decides from the same numbers."""
    t = torch.tensor(list(values), dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


class Progress:
    """tqdm when installed, else a one-line text bar; silent off rank 0."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.total, self.done, self.desc, self.enabled = total, 0, desc, enabled
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, file=sys.stderr)
            except ImportError:
                pass

    def update(self, note: str = "") -> None:
        self.done += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(note)
            self._bar.update(1)
            return
        filled = int(30 * self.done / self.total)
        print(f"\r{self.desc} [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} {note}",
              end="" if self.done < self.total else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# ----------------------------------------------------------------- the paths being compared


def compiled_add_rms_norm():
    """Inductor's own add+RMSNorm kernel, compiled for each token count as a model with static
    shapes gets it. (A dynamic-shape compile measured up to 13% slower on H200 at 64 MiB,
    which would bias the crossover towards fusing.)"""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    torch._dynamo.config.accumulated_recompile_limit = max(
        torch._dynamo.config.accumulated_recompile_limit, 4096)
    return torch.compile(reference.add_rms_norm, dynamic=False)


def unfused_step(x, residual, weight, eps, group, norm_fn):
    """NCCL all_reduce in place (as a model's row-parallel output is) + compiled add+RMSNorm."""
    dist.all_reduce(x, group=group)
    return norm_fn(x, residual, weight, eps, NORM_SITE)


def fused_step(x, residual, weight, eps, group_name, max_bytes, backend="flashinfer", codec=None):
    """The fused op; with a `codec` it always runs that quantized all-reduce (threshold 0)."""
    return torch.ops.arfusion.fused_allreduce_rmsnorm(
        x=x, residual=residual, weight=weight, eps=eps, eps_tensor=None, group_name=group_name, norm="rms",
        quant="none", quant_scale=None, emit_norm=True, backend=backend, max_bytes=max_bytes,
        codec=codec, codec_min_bytes=0 if codec else None)


def kernel_step(backend, call: Call, x, residual, weight, eps):
    """The backend's fused kernel for `call` (its `oneshot` says which), without the op around it."""
    return backend.run(call, x, residual, weight, eps, None)


# ----------------------------------------------------------------- deriving the crossover


@dataclass
class Measured:
    tokens: int
    unfused_us: float
    oneshot_us: float
    twoshot_us: float | None  # None where two-shot cannot run (tokens <= world size)
    quantized_us: float | None = None  # quantized all-reduce + compiled norm, where measured
    nccl_us: float | None = None  # NCCL all_reduce alone, in place (a plain all-reduce's unfused path)
    plain_us: float | None = None  # the backend's plain all-reduce (arfusion::all_reduce's fast path)
    knobs_us: list | None = None  # [[knobs, us], ...]: FlashInfer's quantized all-reduce + norm; {} its own knobs


def plain_crossover(rows: Iterable[Measured]) -> int:
    """Largest token count up to which the plain all-reduce beats NCCL at every measured count
    (0: at none), so it is never chosen where NCCL is faster."""
    best = 0
    for r in sorted(rows, key=lambda r: r.tokens):
        if r.plain_us is None or r.nccl_us is None or r.plain_us >= r.nccl_us:
            break
        best = r.tokens
    return best


def crossover(rows: Iterable[Measured], world_size: int) -> tuple[int, int]:
    """(oneshot_max_tokens, max_fused_tokens) from measurements sorted by tokens.

    One-shot runs while it is not slower than two-shot; the fused kernel (with that switch)
    is used while it is strictly faster than unfused. Both stop at the first token count that
    breaks the rule, so a later lucky point never re-enables a slower middle range.
    """
    rows = sorted(rows, key=lambda r: r.tokens)
    oneshot_max = 0
    for r in rows:
        if r.twoshot_us is None or r.oneshot_us <= r.twoshot_us:
            oneshot_max = r.tokens
        else:
            break
    max_fused = 0
    for r in rows:
        oneshot = r.tokens <= oneshot_max or r.tokens <= world_size or r.twoshot_us is None
        fused = r.oneshot_us if oneshot else r.twoshot_us
        if fused < r.unfused_us:
            max_fused = r.tokens
        else:
            break
    return oneshot_max, max_fused


def exact_us(r: Measured, oneshot_max: int, max_fused: int, world_size: int) -> float:
    """What arfusion's exact path costs at r.tokens once the crossover above is in place."""
    if r.tokens > max_fused:
        return r.unfused_us
    oneshot = r.tokens <= oneshot_max or r.tokens <= world_size or r.twoshot_us is None
    return r.oneshot_us if oneshot else r.twoshot_us


def quantized_crossover(rows: Iterable[Measured], oneshot_max: int, max_fused: int, world_size: int) -> int | None:
    """Smallest token count from which the quantized all-reduce beats the exact path at every
    larger measured count (None: nowhere), so it is never chosen where the exact path is faster."""
    start = None
    for r in sorted(rows, key=lambda r: r.tokens):
        if r.quantized_us is not None and r.quantized_us < exact_us(r, oneshot_max, max_fused, world_size):
            start = r.tokens if start is None else start
        else:
            start = None
    return start


def _setting(knobs: dict) -> frozenset:
    return frozenset(knobs.items())


def _own(r: Measured) -> list:
    """[{}, us]: FlashInfer's call at r.tokens with its own knobs."""
    return next(e for e in r.knobs_us if not e[0])


def _wins(r: Measured, margin: float) -> set[frozenset]:
    """The settings that beat FlashInfer's own knobs ({}) at r.tokens by more than `margin`."""
    own_us = _own(r)[1]
    return {_setting(k) for k, us in r.knobs_us if k and us < own_us * (1 - margin)}


def knob_choices(rows: Iterable[Measured], margin: float = KNOB_MARGIN) -> dict[int, tuple[dict, float]]:
    """{tokens: (knobs, us)} where knobs were swept: the fastest setting that beats FlashInfer's own
    knobs by more than `margin` both there and at a neighbouring measured count, else its own ({}).
    A win at one count alone is taken for noise: on 4xH200 (TP=4) single counts showed 2-5% wins
    between counts where the same setting lost by 4-7%."""
    swept = sorted((r for r in rows if r.knobs_us), key=lambda r: r.tokens)
    wins = [_wins(r, margin) for r in swept]
    choices = {}
    for i, r in enumerate(swept):
        near = set().union(*(wins[j] for j in (i - 1, i + 1) if 0 <= j < len(swept)))
        knobs, us = min((e for e in r.knobs_us if _setting(e[0]) in wins[i] & near), key=lambda e: e[1],
                        default=_own(r))
        choices[r.tokens] = (dict(knobs), us)
    return choices


def row_of(t: int, times: Sequence[float], swept: Sequence[dict] = ()) -> Measured:
    """One token count's measurements from its slowest-rank times, in the order tune() takes them:
    unfused, one-shot, two-shot (NaN: not run), NCCL, plain, [quantized], [each setting of `swept`].
    Where knobs were swept, the quantized time is FlashInfer's own knobs' until `choose_knobs`."""
    head, knob_times = (times[:-len(swept)], times[-len(swept):]) if swept else (times, [])
    unfused, one, two, nccl, plain_us, *quant = head
    r = Measured(t, unfused, one, None if two != two else two, quant[0] if quant else None, nccl, plain_us,
                 [[dict(k), us] for k, us in zip(swept, knob_times)] or None)
    if swept:
        r.quantized_us = _own(r)[1]
    return r


def choose_knobs(rows: Sequence[Measured], margin: float = KNOB_MARGIN) -> list[list]:
    """Sets each swept row's quantized time to its chosen setting's (what the pass then runs) and
    returns the steps [[from_tokens, knobs], ...], ascending, one wherever the choice changes;
    dispatch gives a message the last step it reaches (between two measured counts: the smaller's)."""
    choices = knob_choices(rows, margin)
    steps, current = [], {}
    for r in sorted(rows, key=lambda r: r.tokens):
        if r.tokens in choices:
            knobs, r.quantized_us = choices[r.tokens]
            if knobs != current:
                steps.append([r.tokens, knobs])
                current = knobs
    return steps


def save_entry(key: str, entry: dict, path: Path) -> None:
    """Merge one entry into the cache file, written atomically."""
    data = {"version": dispatch.CACHE_VERSION, "entries": {}}
    try:
        old = json.loads(path.read_text())
        if old.get("version") == dispatch.CACHE_VERSION:
            data["entries"].update(old.get("entries", {}))
    except (OSError, ValueError):
        pass
    data["entries"][key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)


# ----------------------------------------------------------------- tune


class CannotTune(RuntimeError):
    """This GPU or these arguments cannot be tuned; the message says why."""


def tune(hidden: int, dtype: torch.dtype = torch.bfloat16, tokens: Sequence[int] = DEFAULT_TOKENS,
         group=None, cache: str | os.PathLike | None = None, eps: float = 1e-6, calls: int = 20,
         replays: int = 30, progress: bool = True, quantized: str | None = None, knobs: bool = False) -> dict:
    """Measure and store the crossover points for this GPU model, group size, hidden and dtype
    (with `quantized`, also where that quantized all-reduce level starts to pay; with `knobs`, the
    launch knobs it runs fastest with, from KNOB_MIN_BYTES per rank).

    Collective: call on every rank of `group` (default WORLD), each on its own GPU. Returns the
    cache entry (identical on every rank).
    """
    if knobs and not quantized:
        raise ValueError("arfusion tune: launch knobs are the quantized all-reduce's: pass quantized='fp8' too")
    group = group or dist.group.WORLD
    group_name, world = group.group_name, group.size()
    rank = group.rank()
    device = torch.device("cuda", torch.cuda.current_device())
    backend = get_backend("flashinfer")
    if isinstance(backend, Reason):
        raise CannotTune(f"arfusion tune: FlashInfer cannot run here: {backend}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    tokens = sorted({t for t in tokens if 1 <= t and t * hidden * itemsize <= dispatch.HARD_MAX_FUSED_BYTES})
    max_bytes = max(tokens) * hidden * itemsize
    probe = Call.of_meta(NORM_SITE, (max(tokens), hidden), dtype, dtype, device, world, group_name)
    reason = backend.why_not(probe, max_bytes) or backend.prepare(probe, max_bytes)
    if reason:
        raise CannotTune(f"arfusion tune: FlashInfer cannot run here: {reason}")
    # Said before minutes of timing: otherwise the op would time its exact fallback as "quantized".
    reason = quantized and backend.codec_why_not(probe, quantized, min_bytes_override=0)
    if reason:
        raise CannotTune(f"arfusion tune --quantized {quantized}: {reason}")

    grid = [{}] + dispatch.knob_combinations(dispatch.TUNE_KNOBS) if knobs else []
    norm_fn = compiled_add_rms_norm()
    weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    rows: list[Measured] = []
    bar = Progress(len(tokens), f"tune world={world} hidden={hidden}", enabled=progress and rank == 0)
    try:
        for t in tokens:
            x = torch.randn(t, hidden, device=device, dtype=dtype)
            res = torch.randn(t, hidden, device=device, dtype=dtype)
            x_unfused = x.clone()  # reduced in place over and over; keep x itself finite
            times = [time_in_graph(lambda: unfused_step(x_unfused, res, weight, eps, group, norm_fn),
                                   group, calls, replays)]
            for oneshot in (True, False):
                if not oneshot and t <= world:
                    times.append(float("nan"))
                    continue
                call = replace(probe, tokens=t, oneshot=oneshot)
                times.append(time_in_graph(lambda: kernel_step(backend, call, x, res, weight, eps),
                                           group, calls, replays))
            # The plain all-reduce against NCCL alone (what an all-reduce that is not a site runs).
            times.append(time_in_graph(lambda: dist.all_reduce(x_unfused, group=group), group, calls, replays))
            plain = replace(probe, form=PLAIN, tokens=t, oneshot=True)
            times.append(time_in_graph(lambda: backend.all_reduce(plain, x), group, calls, replays))
            if quantized:
                times.append(time_in_graph(lambda: fused_step(x, res, weight, eps, group_name, max_bytes,
                                                              codec=quantized), group, calls, replays))
            swept = grid if x.numel() * x.element_size() >= KNOB_MIN_BYTES else []
            if swept:  # the op ran the quantized all-reduce above: its buffer exists
                module = importlib.import_module("flashinfer.comm.quantized_allreduce")
            for k in swept:  # FlashInfer's call under each setting ({}: its own), as the op runs it
                times.append(time_in_graph(lambda k=k: norm_fn(module.quantized_all_reduce(x, group, **k), res, weight,
                                                               eps, NORM_SITE), group, calls, replays))
            rows.append(r := row_of(t, slowest_rank(times, group), swept))
            bar.update(f"T={t} unfused {r.unfused_us:.1f}us one-shot {r.oneshot_us:.1f}us"
                       + ("" if r.twoshot_us is None else f" two-shot {r.twoshot_us:.1f}us")
                       + f" nccl {r.nccl_us:.1f}us plain {r.plain_us:.1f}us"
                       + (f" {quantized} {r.quantized_us:.1f}us" if quantized else "")
                       + (f" fastest knobs: {dispatch.knobs_text(min(r.knobs_us, key=lambda e: e[1])[0])}"
                          if swept else ""))
    finally:
        bar.close()

    steps = choose_knobs(rows) if knobs else None
    oneshot_max, max_fused = crossover(rows, world)
    gpu = torch.cuda.get_device_name(device)
    key = dispatch.tuned_key(gpu, world, hidden, dtype)
    old = dispatch.tuned_entries().get(key, {})
    entry = {
        "max_fused_tokens": max_fused, "oneshot_max_tokens": oneshot_max, "gpu": gpu,
        "plain_max_tokens": plain_crossover(rows),
        "quantized_min_tokens": {**old.get("quantized_min_tokens", {}), **(
            {quantized: quantized_crossover(rows, oneshot_max, max_fused, world)} if quantized else {})},
        "quantized_knobs": {**old.get("quantized_knobs", {}), **({quantized: steps} if knobs else {})},
        "world_size": world, "hidden": hidden, "dtype": str(dtype).removeprefix("torch."),
        "measured": [asdict(r) for r in rows],
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    path = Path(cache) if cache else dispatch.cache_path()
    if rank == 0:
        save_entry(key, entry, path)
    dist.barrier(group=group)
    dispatch.forget_cache()
    return entry


def format_rows(entry: dict) -> str:
    levels = entry.get("quantized_min_tokens", {})
    lines = [f"{'tokens':>7} {'unfused us':>11} {'one-shot us':>12} {'two-shot us':>12} {'quantized us':>13}  chosen"
             f"  {'nccl us':>8} {'plain us':>9}"]
    for r in entry["measured"]:
        t = r["tokens"]
        starts = [lv for lv, start in levels.items() if start is not None and t >= start]
        if starts:
            chosen = f"quantized {starts[0]}"
        elif t > entry["max_fused_tokens"]:
            chosen = "unfused"
        elif t <= entry["oneshot_max_tokens"] or r["twoshot_us"] is None:
            chosen = "fused one-shot"
        else:
            chosen = "fused two-shot"
        two = "-" if r["twoshot_us"] is None else f"{r['twoshot_us']:.1f}"
        quant = "-" if r.get("quantized_us") is None else f"{r['quantized_us']:.1f}"
        nccl = "-" if r.get("nccl_us") is None else f"{r['nccl_us']:.1f}"
        plain = "-" if r.get("plain_us") is None else f"{r['plain_us']:.1f}"
        lines.append(f"{t:>7} {r['unfused_us']:>11.1f} {r['oneshot_us']:>12.1f} {two:>12} {quant:>13}  {chosen:<15}"
                     f"  {nccl:>8} {plain:>9}")
    lines.append(f"fuse up to {entry['max_fused_tokens']} tokens; one-shot up to "
                 f"{entry['oneshot_max_tokens']} tokens"
                 + (f"; plain all-reduce up to {entry['plain_max_tokens']} tokens" if "plain_max_tokens" in entry else "")
                 + "".join(f"; {lv} quantized all-reduce " + (f"from {start} tokens" if start is not None else "never")
                           for lv, start in levels.items())
                 + "".join(f"; {lv} launch knobs: " + dispatch.steps_text(steps, "tokens")
                           for lv, steps in entry.get("quantized_knobs", {}).items()))
    return "\n".join(lines)
