"""Continuous-batching coverage: every Hugging Face architecture with a tensor-parallel plan, run
through transformers' continuous batching (`generate_batch`, paged attention) with the pass.

    python benchmarks/coverage/cb_coverage.py                        # all of them, writes docs/coverage_cb.md
    python benchmarks/coverage/cb_coverage.py --only llama,aria_text  # a subset

Each causal-LM model type with a TP plan (`arfusion.check.architectures`) runs in a process of its
own (past --timeout it is killed and the row says so) under `arfusion.testing.fake_world(2)`: its
tiny config (`arfusion.hf.configs.tiny_config`), random fp32 weights (seed 0), loaded with TP=2 by
`arfusion.check.load_tp_model`. Greedy `generate_batch` of 3 prompts of different lengths, 6 new
tokens each, in a paged cache of 64 blocks and 64 batch tokens:
1. eager, with transformers' own paged-cache update (`arfusion.hf.release_paged_cache`): where this
   raises, transformers cannot run the model under continuous batching, and nothing else runs;
2. eager, with the cache `arfusion.hf.keep_paged_cache_in_graph` prepares;
3. compiled with the pass (backend "torch"): its tokens against step 2's, and what the pass did
   with every all-reduce, compared per compiled graph with the plain-forward sweep's row
   (docs/data/coverage.json, `hf_coverage.py`).
Writes --md and --json.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE)]  # the arfusion next to this script, then the sweep's helpers

import torch  # noqa: E402
import transformers  # noqa: E402
from coverage_report import run_lines, save_json  # noqa: E402
from hf_coverage import _machine, chosen_architectures  # noqa: E402
from hf_site_counter import fmt_counts  # noqa: E402

import arfusion  # noqa: E402
import arfusion.hf  # noqa: E402
from arfusion.check import load_tp_model, save_random_model  # noqa: E402
from arfusion.hf.configs import tiny_config  # noqa: E402
from arfusion.testing import describe_rewrites, fake_world, generate_batch  # noqa: E402

PROMPT_LENGTHS = (5, 3, 7)
NEW_TOKENS = 6
NUM_BLOCKS = BATCH_TOKENS = 64
COUNTS = ("all_reduces", "fused", "merged", "fast_path", "left_nccl")
PLAIN_JSON = ROOT / "docs" / "data" / "coverage.json"
SAME = "same as a plain forward"
# Why transformers' own continuous batching cannot run a model, from its error -> what it means.
LAYER_TYPE, HEAD_SIZE, HEAD_COUNT = "unsupported layer type", "K/V head size (MLA)", "K/V heads per rank"
OTHER = "other"
CAUSES = {
    LAYER_TYPE: "`Invalid layer type`: transformers' paged cache has pages for `full_attention` and "
                "`sliding_attention` layers only (no linear-attention, convolution or Mamba state; no chunked, "
                "indexed or compressed attention).",
    HEAD_SIZE: "`index_copy_` of slices of other shapes: the model caches other tensors than the "
               "num_key_value_heads × head_dim pages the cache allocates (MLA: its compressed latent and shared "
               "rope key).",
    HEAD_COUNT: "`index_copy_` of another number of heads: transformers shards the cache's heads only where "
                "the TP plan names `layers.*.self_attn.k_proj` and `v_proj`. A plan that gathers K and V after the "
                "projection (`colwise_gather_output`, for q/k norms over all heads) gives all heads to a sharded "
                "cache; a plan that names them otherwise (`h.*.attn.*`) gives half to a cache that holds all.",
    OTHER: "Other errors (the first request's, as `generate_batch` reports it):",
}


# ============================================================================ worker (one architecture)
def first_error(e: BaseException) -> str:
    """One line: the first request's error of a failed `generate_batch`, else the exception."""
    text = str(e)
    kind = type(e).__name__
    if text.startswith("generate_batch failed: "):  # {request: str(its exception)}
        with contextlib.suppress(ValueError, SyntaxError):
            text, kind = next(iter(ast.literal_eval(text.split(": ", 1)[1]).values())), "generate_batch"
    return f"{kind}: {text}".replace("\n", " ")[:300]


def cause(error: str) -> tuple[str, str]:
    """(cause, detail) of transformers' own failure under continuous batching."""
    if m := re.search(r"Invalid layer type: (\w+)", error):
        return LAYER_TYPE, m[1]
    if m := re.search(r"Destination slice shape: (\d+) (\d+) .*source slice shape: (\d+) (\d+)", error):
        cache, given = m.group(1, 2), m.group(3, 4)
        if cache[1] != given[1]:
            return HEAD_SIZE, (f"the cache pages {cache[0]} heads × {cache[1]}, the model gives "
                               f"{given[0]} × {given[1]}")
        return HEAD_COUNT, f"the cache pages {cache[0]} heads per rank, the model gives {given[0]}"
    return OTHER, error


def run_one(model_type: str, row: dict) -> None:
    """Fills `row`; an exception leaves the step it stopped in under row["error"]."""
    step = "config"
    try:
        config = tiny_config(model_type)
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(1, config.get_text_config().vocab_size, (n,), generator=gen).tolist()
                   for n in PROMPT_LENGTHS]
        with fake_world(2), tempfile.TemporaryDirectory(prefix=f"cb-{model_type}-") as path:
            step = "load"
            save_random_model(config, path, dtype=torch.float32)
            model = load_tp_model(path, 2, dtype=torch.float32)  # and prepare_for_compile(model)
            step = "transformers' own paged cache, eager"
            arfusion.hf.release_paged_cache()
            try:
                own = generate_batch(model, prompts, NEW_TOKENS, compiled=False)
            except Exception as e:
                row["cb_error"] = first_error(e)
                row["cb_cause"], row["cb_detail"] = cause(row["cb_error"])
                return
            finally:
                arfusion.hf.keep_paged_cache_in_graph()
            row["transformers_s"] = round(own.seconds, 1)
            step = "eager"
            eager = generate_batch(model, prompts, NEW_TOKENS, compiled=False)
            row["eager_s"] = round(eager.seconds, 1)
            row["eager_same_as_transformers"] = eager.tokens == own.tokens
            step = "compile+pass"
            torch._dynamo.reset()
            got = generate_batch(model, prompts, NEW_TOKENS,
                                 config=arfusion.PassConfig(enable_allreduce_fusion=True, backend="torch"))
    except Exception as e:
        row["error"] = f"{step}: {first_error(e)}"
        if os.environ.get("CB_COVERAGE_TRACEBACK"):
            traceback.print_exc()
        return
    row["pass_s"] = round(got.seconds, 1)
    row["same_tokens"] = got.tokens == eager.tokens
    row["logprob_max_diff"] = max((abs(a - b) for k in got.logprobs for a, b in zip(got.logprobs[k],
                                                                                    eager.logprobs[k])), default=0.0)
    row.update(got.report.summary())


def worker(model_type: str, out: Path) -> None:
    if os.environ.get("CB_COVERAGE_TEST_HANG") == model_type:
        time.sleep(10**6)  # tests: an architecture that hangs
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    row, started = {"model_type": model_type}, time.perf_counter()
    run_one(model_type, row)
    row["seconds"] = round(time.perf_counter() - started, 1)
    out.write_text(json.dumps(row, default=str))


# ============================================================================ driver
def run_in_process(model_type: str, timeout: float, log_file) -> dict:
    """One architecture in a process of its own (its own session: killed whole past `timeout`)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryDirectory(prefix="cb-row-") as d:
        out = Path(d) / "row.json"
        log_file.write(f"==== {model_type}\n")
        log_file.flush()
        started = time.time()
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", model_type,
                                 "--row", str(out)], stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                cwd=ROOT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {"model_type": model_type, "error": f"timeout: more than {timeout:.0f} s",
                    "seconds": round(time.time() - started, 1)}
        if not out.exists():
            return {"model_type": model_type, "seconds": round(time.time() - started, 1),
                    "error": f"the process exited (code {proc.returncode}) without a row"}
        return json.loads(out.read_text())


def versus_plain(row: dict, plain: dict | None) -> str:
    """How the pass's split under continuous batching compares with the plain forward's, per
    compiled graph: `SAME`, or what differs."""
    if plain is None or plain.get("all_reduces") is None:
        return "no plain-forward row" + (f" ({plain['error'][:80]})" if plain and plain.get("error") else "")
    graphs, plain_graphs = row.get("graphs") or 0, plain.get("graphs") or 1
    if not graphs or graphs % plain_graphs:
        return f"{graphs} graphs, the plain forward {plain_graphs}"
    k = graphs // plain_graphs
    diff = [f"{key} {row[key]} (plain {plain[key]}{f' × {k}' if k > 1 else ''})" for key in COUNTS
            if row.get(key) != k * plain[key]]
    return SAME if not diff else "differs: " + ", ".join(diff)


# A row's outcome -> how the report names it.
OUTCOMES = {"ran": "ran", "cannot": "transformers cannot run it", "arfusion": "failed with arfusion",
            "load": "failed to load", "timeout": "timeout", "skipped": "skipped"}


def outcome(row: dict) -> str:
    """The row's key of OUTCOMES."""
    if row.get("skipped"):
        return "skipped"
    if row.get("cb_error"):
        return "cannot"
    error = row.get("error") or ""
    if error.startswith(("config", "load")):
        return "load"
    if error.startswith(("timeout", "the process exited")):
        return "timeout"
    return "arfusion" if error else "ran"


def fully_handled(row: dict) -> bool:
    """Tokens as eager; every all-reduce fused, merged or on the fast path, as in a plain forward."""
    return (outcome(row) == "ran" and row["same_tokens"] and row["eager_same_as_transformers"]
            and row["all_reduces"] > 0 and row["left_nccl"] == 0
            and row["versus_plain"] == SAME)


def summary(rows: list[dict]) -> dict:
    ran = [r for r in rows if outcome(r) == "ran"]
    causes = {}
    for r in rows:
        if outcome(r) == "cannot":
            causes[r["cb_cause"]] = causes.get(r["cb_cause"], 0) + 1
    return {"architectures": len(rows), **{k: sum(1 for r in rows if outcome(r) == k) for k in OUTCOMES},
            "same_tokens": sum(1 for r in ran if r["same_tokens"]), "fully_handled": sum(map(fully_handled, ran)),
            "same_as_plain": sum(1 for r in ran if r["versus_plain"] == SAME),
            **{k: sum(r.get(k) or 0 for r in ran) for k in COUNTS}, "transformers_causes": causes}


ROW_HEADER = ("| model type | outcome | tokens = eager | all-reduces: fused / merged / fast path / NCCL | graphs "
              "| vs a plain forward | all-reduces rewritten | split by graph breaks | why not fused / error | s |")


def table_row(row: dict) -> str:
    ran = outcome(row) == "ran"
    split = "-" if not ran else (
        f"{row['all_reduces']}: {row['all_reduces'] - row['merged'] - row['fast_path'] - row['left_nccl']} / "
        f"{row['merged']} / {row['fast_path']} / {row['left_nccl']}")
    why = row.get("skipped") or row.get("error") or (f"{row['cb_cause']}: {row['cb_detail']}" if row.get("cb_error")
                                                     else fmt_counts(row.get("why_not") or {}))
    why = why if len(why) <= 160 else why[:159] + "…"
    same = "-" if not ran else ("yes" if row["same_tokens"] else "**no**") + (
        "" if row["eager_same_as_transformers"] else " (eager with arfusion's cache ≠ transformers' own)")
    cells = [f"`{row['model_type']}`", OUTCOMES[outcome(row)], same,
             split, str(row.get("graphs") or "-"), row.get("versus_plain", "-"),
             describe_rewrites(row.get("rewrites") or {}), fmt_counts(row.get("split_by_graph_breaks") or {}),
             why, str(row.get("seconds", "-"))]
    return "| " + " | ".join(c.replace("|", "/") for c in cells) + " |"


WHAT = """\
Each architecture generates greedily through transformers' continuous batching (`model.generate_batch`,
its paged attention), as a serving engine built on it does, with the pass compiled into its
forward (`generate_batch`'s compile configs; without Flash Attention's block tables, as on this CPU,
transformers compiles its varlen path only and ignores the decode one). transformers 5.19 to 5.24
keep the paged-cache update out of compiled graphs (`torch.compiler.disable`): a graph break per
attention call, and no site fuses. `arfusion.hf.prepare_for_compile` keeps that update in the
graph (`arfusion/hf/paged_cache.py`). Each row first asks whether transformers itself runs the
model under continuous batching (eager, its own cache update). Then the same requests run eager
with arfusion's cache, then compiled with the pass. The tokens must match (fp32, greedy). Every
all-reduce must be fused, merged or on the fast path, as in a plain forward of the same tiny model
(`docs/coverage.md`, bf16, one 8-token row).
"""


def write_reports(rows: list[dict], md: Path, js: Path, meta: dict) -> None:
    s = summary(rows)
    save_json(js, meta, s, rows)
    md.parent.mkdir(parents=True, exist_ok=True)
    out = io.StringIO()
    w = out.write
    w("# Coverage under continuous batching: every Hugging Face architecture with a tensor-parallel plan\n\n")
    w(run_lines(meta) +
      f"- machine: {meta['machine']}; one process per architecture, TP=2 in `arfusion.testing.fake_world(2)` "
      f"(torch's fake process group: real graphs, collectives compute nothing), fp32, random weights, 2 layers, "
      f"hidden 128; {len(PROMPT_LENGTHS)} prompts of {', '.join(map(str, PROMPT_LENGTHS))} tokens, "
      f"{NEW_TOKENS} new tokens each, greedy; paged cache of {NUM_BLOCKS} blocks, {BATCH_TOKENS} batch tokens; "
      f"backend \"torch\"; timeout {meta['timeout_s']:.0f} s per architecture\n\n")
    w("## What this is\n\n" + WHAT + "\n")
    causes = "; ".join(f"{n} {c}" for c, n in sorted(s["transformers_causes"].items(), key=lambda kv: -kv[1]))
    w(f"**{s['architectures']} architectures: {s['ran']} ran under continuous batching, {s['same_tokens']} with "
      f"tokens identical to eager, {s['fully_handled']} fully handled (every all-reduce fused, merged or on the "
      f"fast path, split as in a plain forward). {s['cannot']} transformers itself cannot run "
      f"under continuous batching ({causes or 'none'}). {s['arfusion']} failed only with arfusion, "
      f"{s['load']} did not load, {s['timeout']} timed out, {s['skipped']} skipped.** Of the "
      f"{s['all_reduces']} all-reduces met in the compiled graphs, {s['fused']} fused into sites, {s['merged']} "
      f"merged into another, {s['fast_path']} on the fast path, {s['left_nccl']} left on NCCL.\n\n")
    w("Columns: *tokens = eager*: the compiled tokens against eager's with arfusion's cache; *all-reduces*: "
      "every all-reduce the pass met in all the graphs compiled during the run (Dynamo compiles the forward again "
      "where a guard fails; *graphs* counts the graphs); *vs a plain forward*: those counts against the "
      "plain-forward sweep's row times *graphs* (the plain row's graphs per forward); *split by graph breaks*: "
      "the function whose graph break split an all-reduce from its norm (`stats()['split_by_graph_breaks']`); "
      "*s*: the architecture's wall time, load and all three runs.\n\n")
    again = [f"`{r['model_type']}`" for r in rows if outcome(r) == "ran" and r["versus_plain"] == SAME
             and r["graphs"] > ((r.get("plain") or {}).get("graphs") or 1)]
    if again:
        w(f"*graphs* above the plain forward's ({', '.join(again)}): the whole forward compiled again, each graph "
          "with every all-reduce of a forward (the counts scale with it; a graph break would split them). For "
          "`gemma2`, `gpt_oss` and `cohere2`, `TORCH_LOGS=recompiles` names the cause: models with "
          "sliding-window layers get a full-attention mask whose key length changes between batches.\n\n")
    w(ROW_HEADER + "\n|" + "---|" * ROW_HEADER.count(" | ") + "---|\n")
    for row in rows:
        w(table_row(row) + "\n")
    cannot = [r for r in rows if outcome(r) == "cannot"]
    if cannot:
        w("\n## Architectures transformers itself cannot run under continuous batching\n\n"
          "Eager, with transformers' own paged-cache update: arfusion plays no part. By cause:\n\n")
        for c, what in CAUSES.items():
            details: dict[str, list[str]] = {}
            for r in cannot:
                if r["cb_cause"] == c:
                    details.setdefault(r["cb_detail"], []).append(f"`{r['model_type']}`")
            if details:
                w(f"### {c} ({sum(map(len, details.values()))})\n\n{what}\n\n" + "".join(
                    f"- {', '.join(archs)}: {detail}\n" for detail, archs in details.items()) + "\n")
    failed = [r for r in rows if outcome(r) in ("load", "arfusion", "timeout")]
    if failed:
        w("\n## Architectures that did not complete\n\n")
        for r in failed:
            w(f"- `{r['model_type']}` ({OUTCOMES[outcome(r)]}): {r['error']}\n")
    differs = [r for r in rows if outcome(r) == "ran" and not fully_handled(r)]
    if differs:
        w("\n## Rows not fully handled\n\n")
        for r in differs:
            w(f"- `{r['model_type']}`: tokens {'identical' if r['same_tokens'] else '**differ**'}"
              f"{'' if r['eager_same_as_transformers'] else ' (eager with arfusion cache differs from transformers)'}; "
              f"{r['versus_plain']}; {r['left_nccl']} left on NCCL\n")
    link = js.relative_to(md.parent) if js.is_relative_to(md.parent) else js
    w(f"\nRaw results (reports, log lines, timings, transformers' errors): [{link}]({link}).\n")
    md.write_text(out.getvalue())


def _commit() -> str:
    with contextlib.suppress(OSError):
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip() or "?"
    return "?"


def sweep(archs: list[str], timeout: float, log_path: Path, show_progress: bool) -> dict[str, dict]:
    from tqdm import tqdm

    plain = {r["model_type"]: r for r in json.loads(PLAIN_JSON.read_text())["rows"]}
    rows = {}
    bar = tqdm(total=len(archs), unit="arch", disable=not show_progress, file=sys.stderr)
    with open(log_path, "w") as log_file:
        for arch in archs:
            bar.set_postfix_str(arch)
            row = run_in_process(arch, timeout, log_file)
            if outcome(row) == "ran":
                row["plain"] = {k: plain[arch].get(k) for k in (*COUNTS, "graphs")} if arch in plain else None
                row["versus_plain"] = versus_plain(row, plain.get(arch))
            rows[arch] = row
            bar.update(1)
            note = row.get("versus_plain") or row.get("cb_cause") or row.get("error", "")
            bar.write(f"{arch:>24}: {OUTCOMES[outcome(row)]}, {note[:90]}, {row['seconds']} s", file=sys.stderr)
    bar.close()
    return rows


def driver_main(args) -> int:
    if (chosen := chosen_architectures(args.only)) is None:
        return 2
    wanted, skipped = chosen
    to_run = [m for m in wanted if m not in skipped]
    print(f"{len(wanted)} architectures ({len(to_run)} to run), timeout {args.timeout:.0f} s each; "
          f"their output in {args.log}", file=sys.stderr)
    commit = _commit()  # the code the processes import is the tree's at the start
    date, started = datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), time.time()
    results = sweep(to_run, args.timeout, Path(args.log), show_progress=not args.quiet)
    wall = time.time() - started
    rows = [{"model_type": m, "skipped": skipped[m]} if m in skipped else results[m] for m in wanted]
    meta = {"command": "python benchmarks/coverage/cb_coverage.py" + (f" --only {args.only}" if args.only else ""),
            "date": date, "wall_s": round(wall, 1), "torch": torch.__version__,
            "transformers": transformers.__version__, "arfusion": arfusion.__version__, "commit": commit,
            "machine": _machine(), "timeout_s": args.timeout}
    write_reports(rows, Path(args.md), Path(args.json), meta)
    s = summary(rows)
    print(f"{s['architectures']} architectures: {s['ran']} ran ({s['fully_handled']} fully handled), "
          f"{s['cannot']} transformers cannot run, {s['arfusion']} failed with "
          f"arfusion; wall {wall / 60:.1f} min -> {args.md}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated model types (default: all)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per architecture before it is killed")
    p.add_argument("--md", default=str(ROOT / "docs" / "coverage_cb.md"))
    p.add_argument("--json", default=str(ROOT / "docs" / "data" / "coverage_cb.json"))
    p.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "arfusion-coverage-cb.log"),
                   help="where each architecture's process writes its stdout/stderr")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # one architecture's process, with:
    p.add_argument("--row", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, Path(args.row))
        return 0
    return driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
