"""The speed goals of the matrix (issue 44), each against every matrix row that measures it.

    python benchmarks/matrix_goals.py docs/data/matrix/matrix_*.json          # a markdown table
    python benchmarks/matrix_goals.py docs/data/matrix/matrix_*.json --plot docs/data/matrix/goals.png

A goal names the rows it reads (path, model, TP, case) and a bar on one number of each row:
the share of time saved (1 - on/off, for times), the gain (on/off - 1, for rates), the on/off
speed, the share of the all-reduces' time removed, or (the quantized all-reduce) the speed against
the exact path arfusion takes without quantization. A goal with no row says "not measured".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import pyplot  # noqa: E402
from matrix import BAR  # noqa: E402


def saved(row: dict) -> float:
    """Time saved, as a share of "off" (a row of times: speed = off / on)."""
    return 1 - 1 / row["speed"]


def gain(row: dict) -> float:
    """More per second, as a share of "off" (a row of rates: speed = on / off)."""
    return row["speed"] - 1


@dataclasses.dataclass(frozen=True)
class Goal:
    what: str
    path: str  # the row's path starts with this
    model: str  # ... its model with this (a regular expression)
    tp: int
    case: str  # ... its case with this
    measure: str  # "saved", "gain", "speed", "removed" or "vs_exact"
    bar: float

    def value(self, row: dict) -> float | None:
        if self.measure == "removed":
            return None if row.get("comm_removed_pct") is None else row["comm_removed_pct"] / 100
        if self.measure == "vs_exact":
            return row.get("vs_exact")
        return {"saved": saved, "gain": gain, "speed": lambda r: r["speed"]}[self.measure](row)

    def rows(self, rows: list[dict]) -> list[dict]:
        return [r for r in rows if r["path"].startswith(self.path) and re.match(self.model, r["model"])
                and r["tp"] == self.tp and r["case"].startswith(self.case) and not r.get("stand_in")]

    def target(self) -> str:
        return {"saved": f"≥ {self.bar:.0%} less time", "gain": f"≥ {self.bar:.0%} more",
                "speed": f"≥ {self.bar:g}×", "removed": f"≥ {self.bar:.0%} removed",
                "vs_exact": f"≥ {self.bar:g}× the exact path"}[self.measure]

    def shown(self, v: float) -> str:
        return f"{v:.3f}×" if self.measure in ("speed", "vs_exact") else f"{v:.1%}"


# The 70B shape: 20 of its 80 layers, or all 80 from 20 layers' weights ("llama 80L h8192 (20 unique)").
STEP, LLAMA8B, LLAMA70B = "decode step (CUDA graph)", "llama 32L h4096", r"llama (20|80)L h8192"
GOALS = (
    Goal("decode step, Llama-3-8B, batch 1, TP=2", STEP, LLAMA8B, 2, "batch 1", "saved", 0.15),
    Goal("decode step, Llama-3-8B, batch 1, TP=4", STEP, LLAMA8B, 4, "batch 1", "saved", 0.22),
    Goal("decode step, Llama-3-70B shape, batch 1, TP=4", STEP, LLAMA70B, 4, "batch 1", "saved", 0.10),
    *(Goal(f"all-reduce time removed, {name}, batch 1, TP={tp}", STEP, model, tp, "batch 1", "removed", 0.75)
      for name, model, tp in (("Llama-3-8B", LLAMA8B, 2), ("Llama-3-8B", LLAMA8B, 4), ("Llama-3-70B shape", LLAMA70B, 4))),
    Goal("generate_batch, 16 requests, tokens/s, TP=2", "generate_batch", LLAMA8B, 2, "16 requests, tokens/s", "gain", 0.08),
    Goal("generate_batch, 64 requests, tokens/s, TP=2", "generate_batch", LLAMA8B, 2, "64 requests, tokens/s", "gain", 0.08),
    Goal("generate_batch, 1 request, inter-token latency, TP=2", "generate_batch", LLAMA8B, 2, "1 requests, ms inter-token",
         "saved", 0.05),
    *(Goal(f"HF generate(), never slower, TP={tp}", "HF generate()", "llama", tp, "", "speed", BAR) for tp in (2, 4)),
    # "faster where the step is GPU-bound": the 70B shape at TP=4 (the case), and at TP=2 (beyond it).
    *(Goal(f"HF generate(), faster, Llama-3-70B shape, TP={tp}", "HF generate()", LLAMA70B, tp, "", "speed", 1.0)
      for tp in (4, 2)),
    Goal("MoE decode step, Qwen3-30B-A3B shape, batch 1, TP=2", STEP, "qwen3_moe", 2, "batch 1", "saved", 0.10),
    Goal("quantized all-reduce, 8 MiB per rank, TP=2", "site, quantized all-reduce", "", 2, "8 MiB", "vs_exact", 1.2),
    # "TP=4 measured": no bar of its own; never slower than the exact path.
    Goal("quantized all-reduce, 8 MiB per rank, TP=4", "site, quantized all-reduce", "", 4, "8 MiB", "vs_exact", BAR),
)


def goals_table(rows: list[dict]) -> str:
    lines = ["| goal | target | measured | spread | machine | met |", "|---|---|---|---|---|---|"]
    for goal in GOALS:
        found = goal.rows(rows)
        if not found:
            lines.append(f"| {goal.what} | {goal.target()} | not measured | | | |")
        for r in found:
            v = goal.value(r)
            if v is None:  # a decode row measured without its floor, a quantized row without the exact path
                lines.append(f"| {goal.what} | {goal.target()} | not in this row ({r['case']}) | | {r['machine']} | |")
                continue
            spread = (f"{r['spread'][0]:.3f}–{r['spread'][1]:.3f}× ({r['pairs']} pairs)" if "spread" in r else "")
            versions = r["versions"]  # transformers where the row ran a model, else torch
            version = versions.get("transformers") or (f"torch {versions['torch']}" if versions.get("torch") else "")
            model = f"{r['model']}, " if r["model"] != goal.model else ""  # the goal names a family: which model
            lines.append(f"| {goal.what} | {goal.target()} | {goal.shown(v)} ({model}{r['case']}, {version}) "
                         f"| {spread} | {r['machine']} | {'yes' if v >= goal.bar else '**no**'} |")
    return "\n".join(lines)


def goals_plot(rows: list[dict], png: Path) -> None:
    """One strip per goal: each machine's measurement (its letter above the dot), the target dotted;
    green where the row meets it, red where not."""
    plt = pyplot()
    fig, axes = plt.subplots(len(GOALS), 1, figsize=(10, 0.62 * len(GOALS) + 0.4))
    for ax, goal in zip(axes, GOALS):
        percent = goal.measure in ("saved", "gain", "removed")
        scale = 100 if percent else 1
        points = [(r["machine"].rsplit("_", 1)[-1].upper(), v * scale) for r in goal.rows(rows)
                  if (v := goal.value(r)) is not None]
        target = goal.bar * scale
        ax.axvline(target, color="red", ls=":", lw=1)
        values = [v for _, v in points] + [target]
        pad = 0.08 * (max(values) - min(values)) + (1 if percent else 0.02)
        ax.set_xlim(min(values) - pad, max(values) + pad)
        near, below = 0.015 * (max(values) - min(values) + 2 * pad), False
        ordered = sorted(points, key=lambda p: p[1])
        for i, (machine, v) in enumerate(ordered):
            ax.plot(v, 0, "o", ms=5, alpha=0.75, color="tab:green" if v >= target else "tab:red")
            below = i > 0 and not below and v - ordered[i - 1][1] < near  # close to the last: the other side
            ax.annotate(machine, (v, 0), xytext=(0, -10 if below else 4), textcoords="offset points", fontsize=6,
                        ha="center")
        ax.set_ylim(-1, 1.6)
        ax.set_yticks([])
        ax.tick_params(axis="x", labelsize=6, pad=1)
        ax.xaxis.set_major_formatter(f"{{x:g}}{'%' if percent else '×'}")
        ax.set_title(f"{goal.what}: {goal.target()}" + ("" if points else " (not measured)"), fontsize=7, loc="left",
                     pad=2)
        for side in ("left", "right", "top"):
            ax.spines[side].set_visible(False)
    fig.tight_layout(h_pad=0.3)
    fig.savefig(str(png), dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path, help="matrix_<machine>.json files (matrix.py report)")
    p.add_argument("--plot", type=Path, help="also draw the goals, a strip each, to this PNG")
    args = p.parse_args(argv)
    rows = [r for f in args.files for r in json.loads(f.read_text())["rows"]]
    print(goals_table(rows))
    if args.plot:
        goals_plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
