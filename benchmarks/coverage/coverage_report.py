"""The coverage sweep's reports (hf_coverage.py): the JSON, and the markdown table with its header."""

from __future__ import annotations

import io
import json
from pathlib import Path

from hf_site_counter import HOW_IT_WORKS, fmt_counts, other_shapes

from arfusion.testing import describe_rewrites

TOKENS = 8  # one batch row of this many tokens; --tokens 1 is the shape of a batch-1 decode step


def _fmt_err(x) -> str:
    return "-" if x is None else f"{x:.1e}"


def why_not(row: dict) -> str:
    if row.get("error"):
        return row["error"]
    if row.get("why_not") or row.get("not_fused_log"):
        return fmt_counts(row.get("why_not") or row["not_fused_log"])
    if row.get("sites", 0) > (row.get("fused") or 0):
        return f"{row.get('unfused_sites', '?')} all_reduce left unfused, no reason logged"
    return ""


def summary(rows: list[dict]) -> dict:
    ran, compiled = [r for r in rows if "sites" in r], [r for r in rows if "sites" in r and "fused" in r]
    totals = {k: sum(r.get(k) or 0 for r in compiled) for k in ("fused", "all_reduces", "merged", "fast_path", "left_nccl")}
    return {"architectures": len(rows), "counted": len(ran), "compiled_with_pass": len(compiled), **totals,
            "sites": sum(r["sites"] for r in ran), "with_sites": sum(1 for r in ran if r["sites"] > 0),
            "fully_fused": sum(1 for r in compiled if r["sites"] > 0 and r["fused"] >= r["sites"]),
            "failed": sum(1 for r in rows if r.get("error"))}


NOISY_ERR = 2e-2  # the logits bar of the MoE GPU checks (2e-2); rows above it get a line in the header
ROW_HEADER = ("| model type | sites (counter) | fused | all-reduces: fused / merged / fast path / NCCL "
              "| other AR shapes / look-alikes | all-reduces rewritten "
              "| err pass vs compile | err compile vs eager | why not fused | why left on NCCL |")


def table_row(row: dict) -> str:
    split = "-" if "all_reduces" not in row else (
        f"{row['all_reduces']}: {row['all_reduces'] - row['merged'] - row['fast_path'] - row['left_nccl']} / "
        f"{row['merged']} / {row['fast_path']} / {row['left_nccl']}")
    cells = [f"`{row['model_type']}`", str(row.get("sites", "-")), str(row.get("fused", "-")), split,
             other_shapes(row.get("counter") or {}), describe_rewrites(row.get("rewrites") or {}),
             _fmt_err(row.get("err_pass_vs_compile")), _fmt_err(row.get("err_compile_vs_eager")), why_not(row),
             fmt_counts(row.get("nccl_codes") or row.get("nccl_reasons") or {})]
    return "| " + " | ".join(c.replace("|", "/") for c in cells) + " |"


def with_update(meta: dict, run: dict, rows: list[str]) -> dict:
    """The meta after `run` (--update) reran `rows`: the first sweep's header stays, each update is named."""
    update = {**run, "command": f"{run['command']} --update", "rows": rows}
    return {**meta, "updates": [*meta.get("updates", []), update]}


def save_json(js: Path, meta: dict, s: dict, rows: list[dict]) -> None:
    """A sweep's JSON: its run (meta), its summary and its rows; the markdown's folder made too."""
    js.parent.mkdir(parents=True, exist_ok=True)
    js.write_text(json.dumps({"meta": meta, "summary": s, "rows": rows}, indent=1, default=str) + "\n")


def run_lines(meta: dict) -> str:
    """The markdown lines that say which command made a sweep, when, and on which versions."""
    return (f"- command: `{meta['command']}`\n- date: {meta['date']}; wall time {meta['wall_s'] / 60:.1f} min\n- torch "
            f"{meta['torch']}, transformers {meta['transformers']}, arfusion {meta['arfusion']} (commit {meta['commit']})\n")


def write_reports(rows: list[dict], md: Path, js: Path, meta: dict) -> None:
    s = summary(rows)
    save_json(js, meta, s, rows)
    md.parent.mkdir(parents=True, exist_ok=True)
    failed = [r for r in rows if r.get("error")]
    out = io.StringIO()
    w = out.write
    w("# Coverage: every Hugging Face architecture with a tensor-parallel plan\n\n")
    w(f"**{s['architectures']} architectures, {s['sites']} sites (counter), {s['fused']} fused, "
      f"{s['fully_fused']} fully fused** (of {s['with_sites']} with at least one site; "
      f"{s['failed']} did not complete). Of their {s['all_reduces']} all-reduces, {s['fused']} fused into sites, "
      f"{s['merged']} merged into another, {s['fast_path']} on the fast path, {s['left_nccl']} left on NCCL.\n\n")
    w(run_lines(meta))
    for u in meta.get("updates", []):
        w(f"- rows {', '.join(f'`{m}`' for m in u['rows'])} rerun: `{u['command']}`, {u['date']}, "
          f"{u['wall_s'] / 60:.1f} min, torch {u['torch']}, transformers {u['transformers']} (commit {u['commit']})\n")
    w(f"- machine: {meta['machine']}; TP=2 on gloo, bf16, random weights, 2 layers, hidden 128, 1 × "
      f"{meta.get('tokens', TOKENS)} tokens; each model loaded with `tp_plan=\"auto\"` (`arfusion.hf.tp_kwargs`: with expert "
      "parallelism over the same ranks where the TP plan leaves the experts whole), then `arfusion.hf.prepare_for_"
      "compile(model)` as the README asks of users (it removes graph breaks in transformers' own code)\n")
    w("- columns: *sites* = all-reduce [views] [+ residual] → RMSNorm calls counted in the eager model (see "
      "below); *fused* = `arfusion.stats()['fused_sites']` with `PassConfig(enable_allreduce_fusion=True, "
      "backend=\"torch\")`; *all-reduces rewritten* = MoE ends changed before matching (`merged`: AR(a) + AR(b) "
      "became one all-reduce, one collective fewer per layer; `sum moved before`: sum(AR(x)) became AR(sum(x)); "
      "`scaled sum split`: (AR(a) + b) * f became AR(a) * f + b * f; `scaled (factor in the op)`: f * AR(x) sites "
      "whose op takes f, a number or a 0-d tensor; `top-k combine fused`: the expert combine runs inside the "
      "site's op). *fused* can exceed *sites*: merged and split all-reduces give sites the counter files under "
      "other shapes, and the counter does not see Gemma's embedding all-reduce (its 0-d normaliser: fused here); "
      "errors are max|a−b|/max|b| of the logits (pass vs plain `torch.compile`, plain `torch.compile` vs eager: "
      "Inductor alone deviates on some MoE models, where a top-k router can turn a last-bit difference into "
      "another expert); *why not* = `stats()['why_not']` (the messages; the JSON also has them by code, "
      "`why_not_codes`), else the `arfusion` logger's \"not fused\" lines, else the error that stopped the row; *all-reduces* = every all-reduce the pass met in the compiled forward: fused "
      "into a site, merged into another (one collective fewer), on the fast path (`arfusion::all_reduce`: "
      "FlashInfer's one-shot kernel or aiter's custom all-reduce on GPUs; the torch reference here, which takes "
      "every size, as a GPU backend does below its cap: every all-reduce of these 2-layer, 128-wide models is "
      "far below the caps of H200's table, 4 MiB per rank at TP=2), or left on NCCL (*why left on NCCL*, by "
      "reason code: docs/usage.md).\n\n")
    noisy = [r for r in rows if (r.get("err_pass_vs_compile") or 0) > NOISY_ERR]
    if noisy:
        w(f"- pass vs compile above {NOISY_ERR:g}: " + ", ".join(
            f"`{r['model_type']}` {_fmt_err(r['err_pass_vs_compile'])} (pass vs eager "
            f"{_fmt_err(r.get('err_pass_vs_eager'))}, compile vs eager {_fmt_err(r.get('err_compile_vs_eager'))})"
            for r in noisy) + ". Random weights turn last-bit differences into percent-level logits noise; "
          "where pass vs eager is below compile vs eager, the pass is nearer the model than plain "
          "Inductor is.\n\n")
    w(ROW_HEADER + "\n|" + "---|" * ROW_HEADER.count(" | ") + "---|\n")
    for row in rows:
        w(table_row(row) + "\n")
    if failed:
        w("\n## Architectures that did not complete\n\n")
        for r in failed:
            w(f"- `{r['model_type']}`: {r['error']}\n")
    w("\n" + HOW_IT_WORKS)
    link = js.relative_to(md.parent) if js.is_relative_to(md.parent) else js
    w(f"\nRaw results (counter details per norm call, stats, log lines, timings): [{link}]({link}).\n")
    md.write_text(out.getvalue())
