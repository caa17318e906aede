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
import logging
import types
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config
from torch.testing._internal.distributed.fake_pg import FakeStore

from .config import PassConfig
from .fusion_pass import inductor_options
from .stats import decisions as pass_decisions
from .stats import stats as pass_stats

# stats() counters of the rewrites made before matching, and how a report names them.
REWRITES = {"summed_all_reduces_merged": "merged", "gated_all_reduces_merged": "of them gated",
            "sums_moved_before_all_reduce": "sum moved before",
            "scaled_sums_distributed": "scaled sum split",
            "scaled_all_reduces_fused": "scaled (factor in the op)",
            "moe_combines_fused": "top-k combine fused"}
# Rewrites that fold all-reduces into another one: each counts the all-reduces that went away.
MERGES = {"summed_all_reduces_merged": "summed with another: AR(a) + AR(b) -> AR(a + b)",
          "concatenated_all_reduces_merged": "concatenated with others: cat(AR(a), AR(b)) -> AR(cat(a, b))"}
# How rows and verdicts name the pass's outcomes; any other outcome is shown as it is spelt.
OUTCOMES = {"fused": "fused", "merged": "merged", "fast_path": "fast path", "nccl": "left"}


@dataclass(frozen=True)
class Row:
    """One all-reduce: `outcome` "fused" (detail: the site's form), "merged" (folded into another
    all-reduce), "fast_path" (not a site; on the fast plain all-reduce), "nccl" (left; detail:
    why) or any outcome the pass adds later. `graph` numbers the compiled graphs from 1 (0: the
    row was counted from stats, not named by the pass)."""

    graph: int
    all_reduce: str
    outcome: str
    detail: str


def rows_from(decisions: list[dict], stats: dict) -> list[Row]:
    """Rows from the pass's decisions of one compile, plus one row per all-reduce a rewrite
    folded into another (counted in `stats`, where the pass did not name it)."""
    graphs: dict[str, int] = {}
    rows = [Row(graphs.setdefault(d["graph"], len(graphs) + 1), d["all_reduce"], d["outcome"], d["detail"])
            for d in decisions]
    named = sum(1 for r in rows if r.outcome == "merged")
    for key, what in MERGES.items():
        for _ in range(stats.get(key, 0)):
            if named:
                named -= 1
                continue
            rows.append(Row(0, "-", "merged", what))
    return rows


def describe_rewrites(rewrites: dict[str, int]) -> str:
    """{"summed_all_reduces_merged": 2} -> "2 merged"."""
    return ", ".join(f"{v} {REWRITES[k]}" for k, v in rewrites.items())


def not_fused_reasons(lines: list[str]) -> dict[str, int]:
    """The `arfusion` logger's "... not fused: <reason>" lines, counted by reason."""
    reasons = Counter()
    for line in lines:
        if "not fused" not in line:
            continue
        reason = line.split("not fused", 1)[1].lstrip(" :;-")
        reasons[reason.strip() or line] += 1
    return dict(reasons)


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

    def count(self, outcome: str) -> int:
        return sum(1 for r in self.rows if r.outcome == outcome)

    @property
    def all_reduces(self) -> int:
        return len(self.rows)

    @property
    def fused(self) -> int:
        return self.count("fused")

    @property
    def merged(self) -> int:
        return self.count("merged")

    @property
    def forms(self) -> Counter:
        """Fused form -> how many all-reduces fused in it."""
        return Counter(r.detail for r in self.rows if r.outcome == "fused")

    @property
    def reasons(self) -> Counter:
        """Why an all-reduce was left (outcome "nccl") -> how many."""
        return Counter(r.detail for r in self.rows if r.outcome == "nccl")

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
        for outcome, n in Counter(r.outcome for r in self.rows).items():
            if outcome in ("fused", "merged"):
                continue
            details = _fmt_counts(Counter(r.detail for r in self.rows if r.outcome == outcome))
            name = {"nccl": "left", "fast_path": "on the fast path"}.get(outcome, outcome)
            parts.append(f"{n} {name}" + (f": {details}" if details else ""))
        return ", ".join(parts)

    def table(self) -> str:
        head = ("graph", "all-reduce", "outcome", "detail")
        cells = [(str(r.graph or "-"), r.all_reduce, OUTCOMES.get(r.outcome, r.outcome), r.detail) for r in self.rows]
        widths = [max(len(c[i]) for c in [head, *cells]) for i in range(3)]
        return "\n".join("  ".join(c[i].ljust(widths[i]) for i in range(3)) + "  " + c[3] for c in [head, *cells])

    def __str__(self) -> str:
        lines = [self.title] if self.title else []
        if self.rows:
            lines.append(self.table())
        if self.rewrites:
            lines.append(f"rewrites: {describe_rewrites(self.rewrites)}")
        if self.graphs > 1:
            lines.append(f"{self.graphs} graphs: Dynamo broke the model's forward; an all-reduce and its norm in "
                         "different graphs cannot fuse")
        lines.append(f"verdict: {self.verdict}")
        return "\n".join(lines)

    def assert_all_fused(self) -> None:
        """At least one all-reduce, and every one fused or merged into one that fused; raises
        AssertionError with the report otherwise."""
        if not self.rows:
            raise AssertionError(f"arfusion: {self.verdict}\n{self}")
        assert_fused(self, left=0)

    def summary(self) -> dict:
        """The coverage sweep's fields of a model (docs/data/coverage.json): all_reduces (per
        forward, as the pass met them, merged ones included), merged, fast_path, left_nccl and
        nccl_reasons (why each left one is not on the fast path), fused (sites, as stats count
        them), by_pattern, unfused_sites, why_not, rewrites, graphs, not_fused_log (the log's
        "not fused" lines by reason) and log (its first 20 lines about fusing)."""
        s = self.stats
        return {"all_reduces": self.all_reduces, "merged": self.merged, "fast_path": self.count("fast_path"),
                "left_nccl": self.count("nccl"), "nccl_reasons": dict(self.reasons),
                "fused": s.get("fused_sites", 0), "by_pattern": s.get("by_pattern", {}),
                "unfused_sites": s.get("unfused_sites"), "why_not": s.get("why_not", {}), "rewrites": self.rewrites,
                "graphs": s.get("graphs"), "not_fused_log": not_fused_reasons(self.log),
                "log": [line for line in self.log if "fused" in line][:20]}

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "rows": [r.__dict__ for r in self.rows], **self.summary()}


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
    collectives return at once and compute nothing; graphs are real), destroyed on exit. Where a
    process group exists already, that one is used and left alone. Yields the world size."""
    if dist.is_initialized():
        yield dist.get_world_size()
        return
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield world_size
    finally:
        dist.destroy_process_group()


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def _arfusion_log() -> Iterator[list[str]]:
    """The `arfusion` logger's INFO lines meanwhile (its level restored afterwards)."""
    log = logging.getLogger("arfusion")
    handler, level = _Lines(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


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
                    config: PassConfig | None = None, title: str = "") -> FusionReport:
    """Compiles `fn` (static shapes, no FX-graph or AOT cache: every graph meets the pass) with
    the pass under `config` (None: no pass at all, plain Inductor), calls it once and reports.
    Inductor's global config is left as it was; stats are read as what this compile added."""
    before, seen = pass_stats(), {d["graph"] for d in pass_decisions()}
    options = inductor_options(config) if config is not None else {}
    compiled = torch.compile(_fresh(lambda *a, **k: fn(*a, **k)), dynamic=False, options=options)
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False), \
            _arfusion_log() as lines:
        output = compiled(*args, **(kwargs or {}))
    delta = _delta(pass_stats(), before)
    decisions = [d for d in pass_decisions() if d["graph"] not in seen] if config is not None else []
    return FusionReport(rows_from(decisions, delta), delta, list(lines), output, title)


def fusion_report(module: Callable, example_inputs: Any = (), world_size: int = 2, *,
                  config: PassConfig | None = None, grad: bool = False) -> FusionReport:
    """Compiles `module` with the pass, runs it once on `example_inputs` (a tuple of positional
    arguments, a dict of keyword arguments, or one tensor) and reports every all-reduce.

    Uses the process group that exists (build a torch-native TP model under `fake_world` or your
    own group first); where there is none, makes a fake one of `world_size` ranks for the call.
    `config` defaults to `PassConfig(enable_allreduce_fusion=True, backend="torch")`. Runs
    under `torch.no_grad()` unless `grad`. Leaves Inductor's config, Dynamo's caches of your
    other compiles and arfusion's stats as they were (the stats gain this compile's counts)."""
    config = config or PassConfig(enable_allreduce_fusion=True, backend="torch")
    if isinstance(example_inputs, dict):
        args, kwargs = (), example_inputs
    else:
        args, kwargs = (example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)), {}
    with fake_world(world_size), torch.set_grad_enabled(grad):
        return compile_and_run(module, args, kwargs, config=config)
