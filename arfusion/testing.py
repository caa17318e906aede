"""What the pass makes of a model, as a report you can print or assert on: no GPU, no torchrun.

    from arfusion.testing import fake_world, fusion_report

    with fake_world(2):                          # a world of 2 ranks in this one process
        model = build_my_tp_model()              # e.g. under parallelize_module
        report = fusion_report(model, (ids,))
    print(report)                                # one row per all-reduce, then the verdict
    report.assert_all_fused()

`fusion_report` compiles the module with the pass (backend "torch": what the matcher finds,
whatever the GPU kernels' size limits), runs it once on the example inputs and reads the
pass's decisions (`arfusion.stats.decisions()`): each all-reduce fused (with its form), merged
into another all-reduce, put on the fast path, or left (with the reason). Under torch's fake
process group collectives return at once and compute nothing, but the graphs are the real
ones, so what fuses is what fuses on GPUs.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
import os
import time
import types
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator
from unittest import mock

import torch
import torch.distributed as dist
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config
from torch.testing._internal.distributed.fake_pg import FakeStore

from . import graph_only
from .config import PassConfig
from .decisions import Fate
from .fusion_pass import inductor_options, not_fused_reasons
from .hf.continuous_batching import cb_config as hf_cb_config
from .stats import decisions as pass_decisions
from .stats import stats as pass_stats

# stats() counters of the rewrites made before matching, and how a report names them.
REWRITES = {"summed_all_reduces_merged": "merged", "gated_all_reduces_merged": "of them gated",
            "sums_moved_before_all_reduce": "sum moved before",
            "scaled_sums_distributed": "scaled sum split",
            "scaled_all_reduces_fused": "scaled (factor in the op)",
            "moe_combines_fused": "top-k combine fused"}
# How rows and verdicts name the fates.
FATES = {Fate.FUSED: "fused", Fate.MERGED: "merged", Fate.FAST_PATH: "fast path", Fate.NCCL: "left",
         Fate.CALLERS_STREAM: "left (caller's stream)"}
LEFT = (Fate.NCCL, Fate.CALLERS_STREAM)  # not fused, not on the fast path


@dataclass(frozen=True)
class Row:
    """One all-reduce: its `fate`, the fused form (FUSED) or the code of why it was not fused
    (`code`), and `detail` for people. `graph` numbers the compiled graphs from 1."""

    graph: int
    all_reduce: str
    fate: Fate
    code: str | None
    detail: str

    @property
    def outcome(self) -> str:
        """The fate's value (the name of the release before)."""
        return self.fate.value


def rows_from(decisions: list[dict]) -> list[Row]:
    """Rows from the pass's decisions of one compile (stats.decisions()), graphs numbered."""
    graphs: dict[str, int] = {}
    return [Row(graphs.setdefault(d["graph"], len(graphs) + 1), d["all_reduce"], Fate(d["fate"]), d["code"],
                d["detail"]) for d in decisions]


def describe_rewrites(rewrites: dict[str, int]) -> str:
    """{"summed_all_reduces_merged": 2} -> "2 merged"."""
    return ", ".join(f"{v} {REWRITES[k]}" for k, v in rewrites.items())


def _fmt_counts(counts: Counter) -> str:
    return "; ".join(f"{k} (×{v})" if v > 1 else k for k, v in counts.most_common())


@dataclass
class FusionReport:
    """What the pass did with every all-reduce of one compile. `stats` holds the
    `arfusion.stats()` counters this compile added; `log` the `arfusion` logger's lines;
    `output` what the compiled module returned."""

    rows: list[Row]
    stats: dict = field(default_factory=dict)
    log: list[str] = field(default_factory=list)
    output: Any = field(default=None, repr=False)
    title: str = ""

    def count(self, *fates: Fate) -> int:
        return sum(1 for r in self.rows if r.fate in fates)

    @property
    def all_reduces(self) -> int:
        return len(self.rows)

    @property
    def fused(self) -> int:
        return self.count(Fate.FUSED)

    @property
    def merged(self) -> int:
        return self.count(Fate.MERGED)

    @property
    def forms(self) -> Counter:
        """Fused form -> how many all-reduces fused in it."""
        return Counter(r.detail for r in self.rows if r.fate is Fate.FUSED)

    @property
    def codes(self) -> Counter:
        """Why an all-reduce was not fused, by code -> how many (every fate but FUSED and MERGED)."""
        return Counter(r.code for r in self.rows if r.fate not in (Fate.FUSED, Fate.MERGED))

    @property
    def left_codes(self) -> Counter:
        """Why an all-reduce left to NCCL was not fused, by code -> how many."""
        return Counter(r.code for r in self.rows if r.fate in LEFT)

    @property
    def rewrites(self) -> dict[str, int]:
        return {k: self.stats[k] for k in REWRITES if self.stats.get(k)}

    @property
    def graphs(self) -> int:
        return self.stats.get("graphs", 0)

    @property
    def verdict(self) -> str:
        """One line: "5 of 7 all-reduces fused, 2 merged into another" and so on."""
        if not self.rows:
            why = _fmt_counts(Counter(self.stats.get("why_not") or {}))
            return "no all-reduce to fuse" + (f": {why}" if why else " (is the model tensor-parallel, over a world "
                                                                      "of more than one rank?)")
        parts = [f"{self.fused} of {self.all_reduces} all-reduce{'s' * (self.all_reduces > 1)} fused"]
        if self.merged:
            parts.append(f"{self.merged} merged into another")
        for fate in (Fate.FAST_PATH, Fate.CALLERS_STREAM, Fate.NCCL):
            n = self.count(fate)
            if n:
                details = _fmt_counts(Counter(r.detail for r in self.rows if r.fate is fate))
                name = {Fate.NCCL: "left", Fate.FAST_PATH: "on the fast path",
                        Fate.CALLERS_STREAM: "left on the caller's stream"}[fate]
                parts.append(f"{n} {name}" + (f": {details}" if details else ""))
        return ", ".join(parts)

    def table(self) -> str:
        head = ("graph", "all-reduce", "outcome", "detail")
        cells = [(str(r.graph or "-"), r.all_reduce, FATES[r.fate], r.detail) for r in self.rows]
        widths = [max(len(c[i]) for c in [head, *cells]) for i in range(3)]
        return "\n".join("  ".join(c[i].ljust(widths[i]) for i in range(3)) + "  " + c[3] for c in [head, *cells])

    def __str__(self) -> str:
        lines = [self.title] if self.title else []
        if self.rows:
            lines.append(self.table())
        if self.rewrites:
            lines.append(f"rewrites: {describe_rewrites(self.rewrites)}")
        if self.graphs > 1:
            lines.append(f"{self.graphs} graphs compiled (graph breaks, or recompiles for new shapes): an all-reduce "
                         "and its norm in different graphs cannot fuse")
        splits = self.stats.get("split_by_graph_breaks") or {}
        if splits:
            lines.append("graph breaks that split sites: " + ", ".join(
                f"{function} splits {n} all-reduce{'s' * (n > 1)} from {'their norms' if n > 1 else 'its norm'}"
                for function, n in sorted(splits.items(), key=lambda kv: -kv[1])))
        lines.append(f"verdict: {self.verdict}")
        return "\n".join(lines)

    def assert_all_fused(self) -> None:
        """At least one all-reduce, and every one fused or merged into one that fused; raises
        AssertionError with the report otherwise."""
        if not self.rows:
            raise AssertionError(f"arfusion: {self.verdict}\n{self}")
        assert_fused(self, left=0)

    def summary(self) -> dict:
        """The coverage sweeps' fields of a model (docs/data/coverage*.json): all_reduces (per
        forward, as the pass met them, merged ones included), merged, fast_path, left_nccl and
        nccl_codes (why each one left on NCCL was not fused, by code), fused (sites, as stats
        count them), by_pattern, unfused_sites, why_not_codes (every reason by code), why_not
        (the same by message, for people), rewrites, graphs, not_fused_log (the log's "not fused"
        lines by reason) and log (its first 20 lines about fusing)."""
        s = self.stats
        return {"all_reduces": self.all_reduces, "merged": self.merged, "fast_path": self.count(Fate.FAST_PATH),
                "left_nccl": self.count(*LEFT), "nccl_codes": dict(self.left_codes),
                "fused": s.get("fused_sites", 0), "by_pattern": s.get("by_pattern", {}),
                "unfused_sites": s.get("unfused_sites"), "why_not_codes": s.get("why_not_codes", {}),
                "why_not": s.get("why_not", {}), "rewrites": self.rewrites,
                "graphs": s.get("graphs"), "split_by_graph_breaks": s.get("split_by_graph_breaks", {}),
                "not_fused_log": not_fused_reasons(self.log),
                "log": [line for line in self.log if "fused" in line][:20]}

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "rows": [{**r.__dict__, "fate": r.fate.value} for r in self.rows],
                **self.summary()}


def assert_fused(report: FusionReport, *, all_reduces: int | None = None, fused: int | None = None,
                 forms: dict[str, int] | None = None, left: int | None = None) -> None:
    """Asserts what the report must show; `left` counts every all-reduce neither fused nor merged
    (left to NCCL, on the fast path, ...). The message is the report itself."""
    not_fused = report.all_reduces - report.fused - report.merged
    wrong = [f"{name}: expected {want}, got {got}" for name, want, got in (
        ("all-reduces", all_reduces, report.all_reduces), ("fused", fused, report.fused),
        ("forms", forms, dict(report.forms)), ("left (not fused, not merged)", left, not_fused))
        if want is not None and want != got]
    if wrong:
        raise AssertionError("arfusion: " + "; ".join(wrong) + "\n" + str(report))


@contextlib.contextmanager
def fake_world(world_size: int = 2) -> Iterator[int]:
    """A process group of `world_size` ranks in this one process (torch's fake backend:
    collectives return at once and compute nothing; graphs are real), destroyed on exit, with
    `fake_gloo_groups` meanwhile, and torchrun's RANK, LOCAL_RANK and WORLD_SIZE for rank 0 where
    unset (transformers picks a TP load's GPU by LOCAL_RANK). Where a process group exists already,
    that one is used and left alone. Yields the world size."""
    if dist.is_initialized():
        yield dist.get_world_size()
        return
    rank_zero = {k: os.environ.get(k, v) for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"),
                                                      ("WORLD_SIZE", str(world_size)))}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        with fake_gloo_groups(), mock.patch.dict(os.environ, rank_zero):
            yield world_size
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_gloo_groups() -> Iterator[None]:
    """Under a fake process group: groups asked for with the gloo backend get the fake one
    (transformers' continuous batching makes one for its scheduling messages)."""
    new_group = dist.new_group

    @functools.wraps(new_group)
    def make(*args, backend=None, **kwargs):
        return new_group(*args, backend="fake" if backend == "gloo" else backend, **kwargs)

    dist.new_group = make
    try:
        yield
    finally:
        dist.new_group = new_group


class LogLines(logging.Handler):
    """Keeps the messages of the records it handles, at `level` and above, in `lines`."""

    def __init__(self, level: int = logging.INFO):
        super().__init__(level)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def _arfusion_log() -> Iterator[list[str]]:
    """The `arfusion` logger's INFO lines meanwhile; the user's handlers get what they got before."""
    log = logging.getLogger("arfusion")
    handler, level, propagate = LogLines(), log.level, log.propagate
    up = logging.Handler(log.getEffectiveLevel() if propagate else logging.CRITICAL + 1)
    up.emit = log.parent.callHandlers  # propagation, of what the logger's level let through before
    log.addHandler(handler)
    log.addHandler(up)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield handler.lines
    finally:
        log.removeHandler(handler)
        log.removeHandler(up)
        log.setLevel(level)
        log.propagate = propagate


def _delta(after: dict, before: dict) -> dict:
    out = {}
    for key, value in after.items():
        if isinstance(value, dict):
            out[key] = {k: v for k, v in (Counter(value) - Counter(before.get(key, {}))).items() if v}
        elif isinstance(value, (int, float)):
            out[key] = value - before.get(key, 0)
        else:
            out[key] = value
    return out


def _fresh(fn: Callable) -> Callable:
    """`fn` with a code object of its own: Dynamo's cache (kept per code object) starts empty."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def compile_and_run(fn: Callable, args: tuple = (), kwargs: dict | None = None, *,
                    config: PassConfig | None = None, title: str = "", kernels: bool = True) -> FusionReport:
    """Compiles `fn` (static shapes, no FX-graph or AOT cache: every graph meets the pass) with
    the pass under `config` (None: no pass at all, plain Inductor), calls it once and reports.
    `kernels=False`: no kernels built (`arfusion.graph_only`). Inductor's global config is left
    as it was; stats are read as what this compile added."""
    before, seen = pass_stats(), {d["graph"] for d in pass_decisions()}
    options = inductor_options(config) if config is not None else {}
    unlowered = None if kernels else graph_only.backend(options)
    compiled = torch.compile(_fresh(lambda *a, **k: fn(*a, **k)), dynamic=False,
                             **({"backend": unlowered} if unlowered else {"options": options}))
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False), \
            _arfusion_log() as lines:
        output = compiled(*args, **(kwargs or {}))
    delta = _delta(pass_stats(), before)
    decisions = [d for d in pass_decisions() if d["graph"] not in seen] if config is not None else []
    return FusionReport(rows_from(decisions), delta, list(lines), output, title)


def fusion_report(module: Callable, example_inputs: Any = (), world_size: int = 2, *,
                  config: PassConfig | None = None, grad: bool = False) -> FusionReport:
    """Compiles `module` with the pass, runs it once on `example_inputs` (a tuple of positional
    arguments, a dict of keyword arguments, or one tensor) and reports every all-reduce.

    Uses the process group that exists (build a torch-native TP model under `fake_world` or your
    own group first); where there is none, makes a fake one of `world_size` ranks for the call.
    `config` defaults to `PassConfig(enable_allreduce_fusion=True, backend="torch")`. Runs
    under `torch.no_grad()` unless `grad`. Leaves Inductor's config, Dynamo's caches of your
    other compiles and arfusion's stats as they were (the stats gain this compile's counts).
    Under the fake process group nothing computes, so no kernels are built (`arfusion.graph_only`)."""
    config = config or PassConfig(enable_allreduce_fusion=True, backend="torch")
    if isinstance(example_inputs, dict):
        args, kwargs = (), example_inputs
    else:
        args, kwargs = (example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)), {}
    with fake_world(world_size), torch.set_grad_enabled(grad):
        return compile_and_run(module, args, kwargs, config=config, kernels=dist.get_backend() != "fake")


# ----------------------------------------------------------------------------- continuous batching
@dataclass
class BatchRun:
    """One `generate_batch` call: greedy tokens and their log-probabilities per request, what the
    pass did meanwhile (`report`), the call's wall time, and transformers' outputs themselves."""

    tokens: dict[str, list[int]]
    logprobs: dict[str, list[float]]
    report: FusionReport
    seconds: float
    outputs: dict = field(default_factory=dict, repr=False)

    def in_order(self) -> list[str]:
        """The request ids in the order the prompts were given (a kept manager numbers on)."""
        return sorted(self.tokens, key=lambda k: int(k.rsplit("_", 1)[-1]))


def generate_batch(model, prompts: list[list[int]], max_new_tokens: int = 8, *, config: PassConfig | None = None,
                   compiled: bool = True, cuda_graphs: bool = False, num_blocks: int | None = 64,
                   max_batch_tokens: int | None = 64, record_timestamps: bool = False, persistent: bool = False,
                   **cb_options) -> BatchRun:
    """Greedy `model.generate_batch(prompts)` through transformers' continuous batching, with its
    varlen path (and its decode path, where transformers has one: `arfusion.hf.continuous_batching`)
    compiled with the pass under `config` (None: plain Inductor, or the pass `arfusion.enable`
    installed; `compiled=False`: eager) and its own CUDA graphs if `cuda_graphs`. The cache is
    sized by `num_blocks` and `max_batch_tokens` (None: transformers sizes it from free memory,
    most of it by default); `cb_options` go to `ContinuousBatchingConfig`;
    `record_timestamps` keeps each token's time in the outputs; `persistent` keeps transformers'
    manager (its compiled paths, CUDA graphs and cache) for the next call, which then reuses it
    (`model.destroy_cached_continuous_batching_manager()` ends it). Call
    `arfusion.hf.prepare_for_compile(model)` first, as for any compile."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import CompileConfig

    options = inductor_options(config) if config is not None else {}
    compile_config = CompileConfig(mode=None, options=options, fullgraph=False) if compiled else None
    cb_config = hf_cb_config(model, compile_config, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                             use_cuda_graph=cuda_graphs, return_logprobs=True, **cb_options)
    generation = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    before, seen = pass_stats(), {d["graph"] for d in pass_decisions()}
    started = time.perf_counter()
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False), \
            _arfusion_log() as lines, torch.no_grad():
        out = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=cb_config,
                                   progress_bar=False, record_timestamps=record_timestamps,
                                   persistent_manager=persistent)
    seconds = time.perf_counter() - started
    if not persistent:
        # The finished manager's CUDA-graph memory pool, freed now rather than by a garbage collection
        # that may fall inside the next manager's capture (torch 2.11 aborts there).
        gc.collect()
    failed = {k: o.error for k, o in out.items() if o.error}
    if failed:
        raise RuntimeError(f"generate_batch failed: {failed}")
    delta = _delta(pass_stats(), before)
    decisions = [d for d in pass_decisions() if d["graph"] not in seen]
    report = FusionReport(rows_from(decisions), delta, list(lines), None, "continuous batching:")
    return BatchRun({k: list(o.generated_tokens) for k, o in out.items()},
                    {k: list(o.logprobs) for k, o in out.items()}, report, seconds, out)


def _first_difference(got: list[int], want: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)


def _top_two_gap(model, ids: list[int]) -> tuple[float, float]:
    """(gap between the model's two best next-token logits, its largest |logit|), eagerly."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1]), float(logits.abs().max())


def greedy_departures(model, prompts: list[list[int]], want: BatchRun, got: BatchRun, *,
                      noise: BatchRun | None = None, tie_ulps: int = 4) -> list[dict]:
    """Per prompt of two `generate_batch` runs of `prompts`: where `got`'s greedy tokens first
    differ from `want`'s, and whether that is allowed: at a near tie of the model run eagerly on
    `want`'s prefix (its two best logits within `tie_ulps` ulp, in the model's dtype, of its
    largest logit), or where `noise` (e.g. Inductor alone) departed already, at that step or before.
    fp32 models allow no difference. Also the largest |log-prob difference| of the tokens both
    chose. Every rank of a TP model must call it (the tie check runs the model)."""
    dtype = next(model.parameters()).dtype
    runs = [want, got] + ([noise] if noise is not None else [])
    rows = []
    for i, keys in enumerate(zip(*(r.in_order() for r in runs))):
        wanted, gotten = want.tokens[keys[0]], got.tokens[keys[1]]
        at = _first_difference(gotten, wanted)
        noise_at = _first_difference(noise.tokens[keys[2]], wanted) if noise is not None else None
        row = {"request": i, "departs_at": at, "noise_departs_at": noise_at, "ok": at is None}
        if at is not None:
            gap, largest = _top_two_gap(model, prompts[i] + wanted[:at])
            tolerance = tie_ulps * torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(largest, 1e-30)))
            row.update(gap=gap, tie_tolerance=tolerance, near_tie=dtype != torch.float32 and gap <= tolerance)
            row["ok"] = row["near_tie"] or (noise_at is not None and noise_at <= at)
        same = at if at is not None else len(wanted)
        row["max_logprob_diff"] = max((abs(a - b) for a, b in zip(got.logprobs[keys[1]][:same],
                                                                  want.logprobs[keys[0]][:same])), default=0.0)
        rows.append(row)
    return rows
