"""Where a serving call's time goes (benchmarks/bench_serving.py; decode_host.py uses some): the
steps transformers' continuous batching made and their time on the host and on the GPU, Python's
garbage collections, what the host did (CPU time, neighbours, page faults), a fixed host probe,
CUDA graphs captured and Dynamo graphs compiled inside a call, cProfile of the generation thread,
torch.profiler's kernel table and timeline. Each hooks into transformers or torch while
installed; none changes what is computed.
"""

from __future__ import annotations

import contextlib
import gc
import os
import resource
import threading
import time
from pathlib import Path

import torch


def record_steps(into: list) -> None:
    """From now on every step transformers' schedulers make appends [query tokens, decode fast path
    or not, device events] to `into`: how a call's requests were cut into steps (prefill steps'
    sizes decide what the fused op can take) and, on a GPU, when each step's work began and ended
    on the compute stream. A transformers without that scheduler (before 5.24) records nothing."""
    try:
        from transformers.generation.continuous_batching import model_runner, scheduler
    except ImportError:
        return
    for cls in scheduler.Scheduler.__subclasses__():
        def recorded(self, *args, _made=cls.schedule_batch, **kwargs):
            made = _made(self, *args, **kwargs)  # 5.24: (requests, decode fast path, query tokens, kv read)
            if isinstance(made, tuple) and len(made) == 4 and made[0]:
                into.append([int(made[2]), bool(made[1]), None, None])
            return made

        cls.schedule_batch = recorded
    computed = model_runner.ModelRunner.compute_batch

    def timed(self, model, batch_data, _made=computed):
        stream = self.inputs_and_outputs.compute_stream
        cuda = stream is not None and stream.device.type == "cuda"
        start, end = ((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda
                      else (None, None))
        began = time.perf_counter()
        if cuda:
            start.record(stream)
        _made(self, model, batch_data)
        if cuda:
            end.record(stream)
        if into and into[-1][3] is None:
            into[-1][2:] = [(start, end) if cuda else None, (began, time.perf_counter())]

    model_runner.ModelRunner.compute_batch = timed


def step_summary(steps: list, admitted: float | None = None) -> dict:
    """{"decode_fast_path": steps on it, "varlen": query tokens of each other step, in order}; from
    the host's clock "host_ms": when each varlen step's launch began, from `admitted` (the call's
    first request), and how long its launch took; on a GPU also "device_ms": each varlen step's
    time on the compute stream ("varlen", in order), the decode fast path's in all, and "idle",
    the time that stream waited between steps (the host late with the next step), in all and in
    the steps up to the last varlen one ("idle_prefill")."""
    summary = {"decode_fast_path": sum(s[1] for s in steps), "varlen": [s[0] for s in steps if not s[1]]}
    hosted = [s for s in steps if s[3] is not None and not s[1]]
    if hosted and admitted is not None:
        summary["host_ms"] = {"began": [round(1e3 * (s[3][0] - admitted), 3) for s in hosted],
                              "launch": [round(1e3 * (s[3][1] - s[3][0]), 3) for s in hosted]}
    timed = [s for s in steps if s[2] is not None]
    if not timed:
        return summary
    torch.cuda.synchronize()
    ms = [s[2][0].elapsed_time(s[2][1]) for s in timed]
    idle = [0.0] + [prev[2][1].elapsed_time(s[2][0]) for prev, s in zip(timed, timed[1:])]
    last_varlen = max((i for i, s in enumerate(timed) if not s[1]), default=-1)
    summary["device_ms"] = {"varlen": [round(m, 3) for m, s in zip(ms, timed) if not s[1]],
                            "decode_fast_path": round(sum(m for m, s in zip(ms, timed) if s[1]), 3),
                            "idle": round(sum(idle), 3), "idle_prefill": round(sum(idle[:last_varlen + 1]), 3)}
    return summary


class GcPauses:
    """Python's garbage collections while installed (any thread): when each began, how long it
    took, its generation. A pause holds the host's generation loop: a gap the GPU may wait through.
    A context manager: leaving it (or close()) removes its gc callback."""

    def __init__(self):
        self.reset()
        gc.callbacks.append(self._seen)

    def close(self) -> None:
        if self._seen in gc.callbacks:
            gc.callbacks.remove(self._seen)

    def __enter__(self) -> "GcPauses":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reset(self) -> None:
        self.seen, self._began = [], None

    def _seen(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.seen.append((self._began, time.perf_counter() - self._began, info.get("generation")))
            self._began = None

    def summary(self, begin: float, end: float) -> dict:
        """In all, and inside [begin, end] (a call's first admission to its last token): how many,
        how many of generation 2, their ms; and each one inside as [ms from begin, ms, generation]."""
        inside = [(t, d, g) for t, d, g in self.seen if begin <= t <= end]
        return {"ms": round(1e3 * sum(d for _, d, _ in self.seen), 3), "collections": len(self.seen),
                "full": sum(g == 2 for *_, g in self.seen),
                "in_call": [[round(1e3 * (t - begin), 2), round(1e3 * d, 2), g] for t, d, g in inside]}


def _this_cpu() -> int | None:
    """The CPU this thread last ran on (Linux /proc), else None."""
    try:
        return int(Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return None


def _thread_ticks() -> dict:
    """{thread id: (name, CPU clock ticks used)} for this process's threads (Linux /proc), else {}."""
    ticks = {}
    for task in Path("/proc/self/task").glob("[0-9]*"):
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            ticks[task.name] = ((task / "comm").read_text().strip(), int(fields[11]) + int(fields[12]))
        except (OSError, IndexError, ValueError):
            continue
    return ticks


class HostUse:
    """What the host did over a span of the calling thread: its CPU time and share of the wall
    time, other threads' CPU time (and the busiest one), its context switches (involuntary: another
    task took its CPU), minor page faults, the CPUs it was on at the start and at the end. On
    machine V (2026-11-29) one config's every host call ran ~30% slower than the other's in the
    same process; these tell a busy neighbour, a moved thread or page faults from slower code."""

    def __init__(self):
        self._tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
        self.begin = self._now()

    def _now(self) -> dict:
        ru = resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF))
        return {"wall": time.perf_counter(), "thread": time.thread_time(), "process": time.process_time(),
                "nivcsw": ru.ru_nivcsw, "nvcsw": ru.ru_nvcsw, "minflt": ru.ru_minflt, "cpu": _this_cpu(),
                "threads": _thread_ticks()}

    def since(self) -> dict:
        a, b = self.begin, self._now()
        wall, main = b["wall"] - a["wall"], b["thread"] - a["thread"]
        others = {tid: (name, used - a["threads"].get(tid, (name, 0))[1]) for tid, (name, used) in b["threads"].items()}
        others.pop(str(threading.get_native_id()), None)
        busiest = max(others.values(), key=lambda t: t[1], default=("", 0))
        return {"main_cpu_ms": round(1e3 * main, 3), "main_cpu_share": round(main / wall, 3) if wall > 0 else None,
                "other_threads_cpu_ms": round(1e3 * max(0.0, b["process"] - a["process"] - main), 3),
                "busiest_other_thread": [busiest[0], round(busiest[1] * self._tick_ms, 1)],
                "involuntary_switches": b["nivcsw"] - a["nivcsw"], "voluntary_switches": b["nvcsw"] - a["nvcsw"],
                "minor_faults": b["minflt"] - a["minflt"], "cpus": [a["cpu"], b["cpu"]]}


def host_probe_us(device, n: int = 200) -> dict:
    """Microseconds per call of two fixed host tasks, run right after a config's call while it is
    still active: allocating a small tensor and viewing one (the dispatcher alone). Slower after
    one config's calls than the other's: the process's state is slower (allocator, caches, CPU);
    the same: the difference lies in what the config's own calls run."""
    x = torch.empty(256, device=device)
    out = {}
    for name, task in (("empty", lambda: torch.empty(256, device=device)), ("view", lambda: x.view(16, 16))):
        began = time.perf_counter()
        for _ in range(n):
            task()
        out[name] = round(1e6 * (time.perf_counter() - began) / n, 3)
    return out


@contextlib.contextmanager
def graph_work():
    """{"captured": CUDA graphs captured, "compiled": Dynamo graphs compiled} inside, filled at exit.
    A timed call that captures (transformers' continuous batching records a graph for each new
    padded size it meets, first call of a mix or not) or compiles is not a steady-state call."""
    import torch._dynamo.utils

    work = {"captured": 0, "compiled": 0}
    original = torch.cuda.CUDAGraph.capture_begin
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    def counted(self, *args, **kwargs):
        work["captured"] += 1
        return original(self, *args, **kwargs)

    torch.cuda.CUDAGraph.capture_begin = counted
    try:
        yield work
    finally:
        torch.cuda.CUDAGraph.capture_begin = original
        work["compiled"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs


@contextlib.contextmanager
def host_profile(path: Path):
    """cProfile of transformers' generation thread (where continuous batching spends its host time:
    scheduling, the TP group's sync, launches) over the calls inside; the top functions by
    cumulative and by own time go to `path`. The profiler's own cost inflates the total."""
    import cProfile
    import pstats

    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    original = ContinuousBatchingManager._run_generation_loop
    profiler = cProfile.Profile()

    def profiled(self, *args, **kwargs):
        profiler.enable()
        try:
            return original(self, *args, **kwargs)
        finally:
            profiler.disable()

    ContinuousBatchingManager._run_generation_loop = profiled
    try:
        yield
    finally:
        ContinuousBatchingManager._run_generation_loop = original
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for key, n in (("cumulative", 45), ("tottime", 30)):
                pstats.Stats(profiler, stream=f).sort_stats(key).print_stats(n)


@contextlib.contextmanager
def kernel_profile(path: Path, device: torch.device, into: dict, trace: Path | None = None):
    """torch.profiler over the calls inside: what ran on the device (CUDA kernels, also inside
    transformers' CUDA graphs; on CPU, the ops of every thread) by own time. The top 80 go to
    `path` as a table, the top 10 into `into["kernels"]` with their share of the total. With
    `trace`, the host's ops too, and the timeline of both goes there (Chrome trace, gzipped)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    if trace is not None and cuda:
        activities.append(ProfilerActivity.CPU)
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)  # the generation thread's ops
    with profile(activities=activities, experimental_config=config) as prof:
        yield
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    total = sum(getattr(e, key) for e in events) or 1.0
    top = sorted(events, key=lambda e: -getattr(e, key))
    into["kernels"] = [{"name": e.key[:120], "calls": e.count, "self_ms": round(getattr(e, key) / 1e3, 3),
                        "share": round(getattr(e, key) / total, 4)} for e in top[:10]]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(events.table(sort_by=key, row_limit=80))
    if trace is not None:
        import gzip
        import shutil

        plain = trace.with_suffix("")
        prof.export_chrome_trace(str(plain))
        with open(plain, "rb") as f, gzip.open(trace, "wb") as g:
            shutil.copyfileobj(f, g)
        plain.unlink()
