"""Coverage over every Hugging Face architecture with a tensor-parallel plan (issue 12, item 3).

    python benchmarks/hf_coverage.py                       # all of them, writes docs/coverage.md
    python benchmarks/hf_coverage.py --only llama,olmo2    # a subset
    python benchmarks/hf_coverage.py --tokens 1 --md docs/coverage_decode.md --json docs/data/coverage_decode.json
                                                           # one token: a batch-1 decode step's shape

For every model type of the installed transformers that has a causal-LM class and a non-empty
`base_model_tp_plan`: a tiny config (`hf_tiny_configs.py`: 2 layers, hidden 128), random bf16
weights written once by rank 0, loaded by 2 ranks with TP=2 on gloo (CPU). Per architecture:

  1. the eager model runs once under an independent site counter (`hf_site_counter.py`: it
     marks all-reduce outputs at dispatch and reads them at RMSNorm modules; it does not use
     arfusion's matcher): how many all-reduce -> [residual add] -> RMSNorm sites there are;
  2. `torch.compile` without the pass (plain Inductor);
  3. `torch.compile` with `arfusion.enable(PassConfig(enable_allreduce_fusion=True,
     backend="torch"))`: `arfusion.stats()` and the `arfusion` logger's "not fused" lines;
  4. logits errors max|a-b|/max|b|: pass vs plain compile, and plain compile vs eager.

The ranks are one long-lived torchrun pair that takes the architectures in turn; this driver
watches it and, when an architecture runs past --timeout (or a rank dies), kills the pair,
records that architecture and starts a new pair for the rest. Within a pair, both ranks compare
their status after each step (all_gather_object) and skip the rest of an architecture together.

Writes --md (docs/coverage.md) and --json (docs/data/coverage.json).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TOKENS = 8  # one batch row of this many tokens; --tokens 1 is the shape of a batch-1 decode step
TOKENS_ENV = "HF_COVERAGE_TOKENS"  # how the driver tells its ranks
SEED = 0


# ============================================================================ architectures
def architectures() -> list[tuple[str, str | None]]:
    """(model type, why it is skipped or None) for every causal-LM model type with a TP plan,
    plus those with only an expert-parallel plan (a row saying so)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            config_cls = CONFIG_MAPPING[model_type]
        except KeyError:
            continue
        if getattr(config_cls, "base_model_tp_plan", None):
            out.append((model_type, None))
        elif getattr(config_cls, "base_model_ep_plan", None):
            out.append((model_type, "expert-parallel plan only (no base_model_tp_plan)"))
    return out


# ============================================================================ worker (one rank)
def _short(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}".replace("\n", " ")
    return msg[:300]


def _rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _not_fused_reasons(lines: list[str]) -> dict[str, int]:
    reasons = Counter()
    for line in lines:
        if "not fused" not in line:
            continue
        reason = line.split("not fused", 1)[1].lstrip(" :;-")
        reasons[reason.strip() or line] += 1
    return dict(reasons)


class Worker:
    def __init__(self, progress: Path, ckpt_root: str):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.progress = progress
        self.ckpt_root = ckpt_root
        torch.set_num_threads(1)
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()

    def emit(self, event: dict) -> None:
        if self.rank == 0:
            with open(self.progress, "a") as f:
                f.write(json.dumps(event) + "\n")

    def agree(self, status: str | None) -> str | None:
        """Every rank's error (None = fine) -> the first error any rank had, on every rank."""
        statuses = [None] * self.world
        self.dist.all_gather_object(statuses, status)
        bad = [(r, s) for r, s in enumerate(statuses) if s is not None]
        if not bad:
            return None
        r, s = bad[0]
        return s if len(bad) == self.world else f"rank {r}: {s}"

    def run(self, model_types: list[str]) -> None:
        for model_type in model_types:
            self.emit({"event": "start", "arch": model_type, "t": time.time()})
            started = time.perf_counter()
            row = {"model_type": model_type}
            try:
                self.one(model_type, row)
            except Exception as e:  # anything not caught by a step: the pair may be out of step now
                row.setdefault("error", f"worker: {_short(e)}")
            finally:
                self.drop_groups()
            row["seconds"] = round(time.perf_counter() - started, 1)
            self.emit({"event": "done", "arch": model_type, "row": row})
        self.dist.barrier()
        self.dist.destroy_process_group()

    def drop_groups(self) -> None:
        """Every TP load makes a device mesh with new gloo groups (5-6 threads each); without this
        a sweep ends with ~1600 threads per rank."""
        from torch.distributed import distributed_c10d as c10d

        for group in list(c10d._world.pg_map):
            if group is not c10d.GroupMember.WORLD:
                with contextlib.suppress(Exception):
                    self.dist.destroy_process_group(group)

    def step(self, row: dict, name: str, fn):
        """Run fn on every rank; if any rank fails, all record the error and return None."""
        err, value = None, None
        try:
            value = fn()
        except Exception as e:
            err = _short(e)
            if os.environ.get("HF_COVERAGE_TRACEBACK"):
                traceback.print_exc()
        err = self.agree(err)
        if err is not None:
            row["error"] = f"{name}: {err}"
            return None, False
        return value, True

    def one(self, model_type: str, row: dict) -> None:
        torch, dist = self.torch, self.dist
        if os.environ.get("HF_COVERAGE_TEST_HANG") == model_type and self.rank == 1:
            time.sleep(10**6)  # tests: a rank that hangs (rank 0 then waits in the next collective)
        import arfusion
        from arfusion.hf import prepare_for_compile, tp_kwargs
        from transformers import AutoModelForCausalLM

        sys.path.insert(0, str(HERE))
        from hf_site_counter import SiteCounter, classify_norms
        from hf_tiny_configs import tiny_config

        config, ok = self.step(row, "config", lambda: tiny_config(model_type))
        if not ok:
            return
        text_config = config.get_text_config()  # Llama4Config and other composites keep it inside
        row["config"] = {k: getattr(text_config, k, None) for k in (
            "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size")}

        def save():
            path = [None]
            if self.rank == 0:
                torch.manual_seed(SEED)
                model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
                path[0] = tempfile.mkdtemp(prefix=f"cov-{model_type}-", dir=self.ckpt_root)
                model.save_pretrained(path[0])
                del model
            return path

        path, ok = self.step(row, "save", save)
        if not ok:
            return
        dist.broadcast_object_list(path, src=0)
        path = path[0]
        try:
            model, ok = self.step(row, "load", lambda: AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.bfloat16, **tp_kwargs("auto")).eval())
            if ok:
                prepare_for_compile(model)  # graph breaks in HF code: q/k norm hooks (<= 5.17), looped experts
        finally:
            dist.barrier()
            if self.rank == 0:
                shutil.rmtree(path, ignore_errors=True)
        if not ok:
            return

        tokens = int(os.environ.get(TOKENS_ENV, TOKENS))
        ids = torch.randint(0, text_config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))

        def forward(m):
            with torch.no_grad():
                out = m(input_ids=ids, use_cache=False)
            return out.logits.float()

        # 1. eager, counted
        def counted():
            kinds = classify_norms(model, text_config.hidden_size)
            counter = SiteCounter()
            counter.hook_norms(model, kinds)
            try:
                with counter:
                    logits = forward(model)
            except Exception as e:
                counter.remove_hooks()
                forward(model)  # fails too: the model's own error (reported as "eager: ...")
                raise RuntimeError(f"the site counter failed, the model alone did not: {_short(e)}") from e
            finally:
                counter.remove_hooks()
            summary = counter.summary()
            summary["norm_kinds"] = dict(Counter(f"{type(m).__name__}: {kinds[n]}" for n, m in model.named_modules()
                                                 if n in kinds))
            summary["calls"] = counter.norm_calls
            return logits, summary

        t0 = time.perf_counter()
        res, ok = self.step(row, "eager", counted)
        if not ok:
            return
        eager, row["counter"] = res
        row["eager_s"] = round(time.perf_counter() - t0, 1)
        row["sites"] = row["counter"]["sites"]

        # 2. plain compile
        def compiled(with_pass: bool):
            torch._dynamo.reset()
            torch._inductor.config.fx_graph_cache = False
            arfusion.reset_stats()
            if with_pass:
                arfusion.enable(arfusion.PassConfig(enable_allreduce_fusion=True, backend="torch"))
            else:
                arfusion.disable()
            log = logging.getLogger("arfusion")
            handler = _Collect()
            log.addHandler(handler)
            old_level = log.level
            log.setLevel(logging.INFO)
            try:
                logits = forward(torch.compile(model))
            finally:
                log.removeHandler(handler)
                log.setLevel(old_level)
                arfusion.disable()
            return logits, arfusion.stats(), handler.lines

        t0 = time.perf_counter()
        res, ok = self.step(row, "compile", lambda: compiled(False))
        if not ok:
            return
        plain, _, _ = res
        row["compile_s"] = round(time.perf_counter() - t0, 1)
        row["err_compile_vs_eager"] = _rel_err(plain, eager)

        # 3. compile with the pass
        t0 = time.perf_counter()
        res, ok = self.step(row, "compile+pass", lambda: compiled(True))
        if not ok:
            return
        fused_logits, stats, lines = res
        row["pass_s"] = round(time.perf_counter() - t0, 1)
        row["fused"] = stats["fused_sites"]
        row["by_pattern"] = stats["by_pattern"]
        row["unfused_sites"] = stats.get("unfused_sites")
        row["why_not"] = stats.get("why_not", {})
        row["rewrites"] = {k: stats[k] for k in REWRITES if stats.get(k)}
        row["graphs"] = stats.get("graphs")
        row["not_fused_log"] = _not_fused_reasons(lines)
        row["log"] = [ln for ln in lines if "fused" in ln][:20]
        row["err_pass_vs_compile"] = _rel_err(fused_logits, plain)
        row["err_pass_vs_eager"] = _rel_err(fused_logits, eager)  # in the JSON: is the pass nearer the model?
        del model
        torch._dynamo.reset()


def worker_main(args) -> None:
    w = Worker(Path(args.progress), args.ckpt_root)
    w.run(args.archs.split(","))


# ============================================================================ driver
def _launch(archs: list[str], progress: Path, ckpt_root: str, log_file) -> subprocess.Popen:
    # The ranks import the arfusion next to this script (not another installed copy).
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(Path(__file__).resolve()), "--worker", "--archs", ",".join(archs),
           "--progress", str(progress), "--ckpt-root", ckpt_root]
    return subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill(proc: subprocess.Popen) -> None:
    """torchrun and its ranks (which torchrun starts in sessions of their own)."""
    pids = [proc.pid] + _descendants(proc.pid)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def sweep(archs: list[str], timeout: float, log_path: Path, show_progress: bool = True) -> dict[str, dict]:
    """Run the architectures on torchrun pairs; restart a pair past a hung or dead architecture."""
    from tqdm import tqdm

    rows: dict[str, dict] = {}
    todo = list(archs)
    bar = tqdm(total=len(archs), unit="arch", disable=not show_progress, file=sys.stderr)
    ckpt_root = tempfile.mkdtemp(prefix="arfusion-coverage-")
    with open(log_path, "w") as log_file:
        while todo:
            progress = Path(tempfile.mktemp(prefix="progress-", suffix=".jsonl", dir=ckpt_root))
            progress.touch()
            proc = _launch(todo, progress, ckpt_root, log_file)
            current, current_t, seen = None, time.time(), 0
            failure = None
            while True:
                time.sleep(0.5)
                lines = progress.read_text().splitlines()
                for line in lines[seen:]:
                    event = json.loads(line)
                    if event["event"] == "start":
                        current, current_t = event["arch"], time.time()
                        bar.set_postfix_str(current)
                    else:
                        rows[event["arch"]] = event["row"]
                        todo.remove(event["arch"])
                        current = None
                        bar.update(1)
                        row = event["row"]
                        bar.write(f"{event['arch']:>24}: sites {row.get('sites', '-')}, fused "
                                  f"{row.get('fused', '-')}, {row['seconds']} s"
                                  + (f"  [{row['error'][:90]}]" if row.get("error") else ""))
                seen = len(lines)
                if proc.poll() is not None:
                    if current is not None:
                        failure = f"rank process exited (code {proc.returncode}) during this architecture"
                    break
                if current is not None and time.time() - current_t > timeout:
                    failure = f"timeout: more than {timeout:.0f} s"
                    _kill(proc)
                    break
            if failure is not None:
                rows[current] = {"model_type": current, "error": failure,
                                 "seconds": round(time.time() - current_t, 1)}
                todo.remove(current)
                bar.update(1)
                bar.write(f"{current:>24}: {failure}")
            elif todo and proc.returncode != 0:
                # died between architectures: count it against the next one so the sweep ends
                nxt = todo.pop(0)
                rows[nxt] = {"model_type": nxt, "error": f"rank process exited (code {proc.returncode}) before it",
                             "seconds": 0.0}
                bar.update(1)
    bar.close()
    shutil.rmtree(ckpt_root, ignore_errors=True)
    return rows


# ============================================================================ report
def _fmt_err(x) -> str:
    return "-" if x is None else f"{x:.1e}"


def _fmt_counts(d: dict) -> str:
    return ", ".join(f"{k} ×{v}" if v > 1 else k for k, v in sorted(d.items())) if d else ""


def why_not(row: dict) -> str:
    if row.get("error"):
        return row["error"]
    parts = []
    if row.get("why_not"):
        parts.append(_fmt_counts(row["why_not"]))
    elif row.get("not_fused_log"):
        parts.append(_fmt_counts(row["not_fused_log"]))
    elif row.get("sites", 0) > (row.get("fused") or 0):
        parts.append(f"{row.get('unfused_sites', '?')} all_reduce left unfused, no reason logged")
    return "; ".join(parts)


def other_shapes(row: dict) -> str:
    c = row.get("counter") or {}
    parts = []
    if c.get("other_shapes"):
        parts.append(_fmt_counts(c["other_shapes"]))
    if c.get("gated_norm_lookalikes"):
        parts.append("gated norm: " + _fmt_counts(c["gated_norm_lookalikes"]))
    if c.get("layernorm_lookalikes"):
        parts.append("LayerNorm: " + _fmt_counts(c["layernorm_lookalikes"]))
    if c.get("all_reduces_not_reaching_a_norm"):
        parts.append("no norm: " + _fmt_counts(c["all_reduces_not_reaching_a_norm"]))
    return "; ".join(parts)


def summary(rows: list[dict]) -> dict:
    ran = [r for r in rows if "sites" in r]
    compiled = [r for r in ran if "fused" in r]
    return {
        "architectures": len(rows),
        "counted": len(ran),
        "compiled_with_pass": len(compiled),
        "sites": sum(r["sites"] for r in ran),
        "fused": sum(r.get("fused", 0) for r in compiled),
        "fully_fused": sum(1 for r in compiled if r["sites"] > 0 and r["fused"] >= r["sites"]),
        "with_sites": sum(1 for r in ran if r["sites"] > 0),
        "failed": sum(1 for r in rows if r.get("error")),
    }


NOISY_ERR = 2e-2  # the logits bar of the MoE issue; rows above it get a line in the header
ROW_HEADER = ("| model type | sites (counter) | fused | other AR shapes / look-alikes | all-reduces rewritten "
              "| err pass vs compile | err compile vs eager | why not |")
# stats() counters of the MoE rewrites, and how the table names them
REWRITES = {"summed_all_reduces_merged": "merged", "gated_all_reduces_merged": "of them gated",
            "sums_moved_before_all_reduce": "sum moved before",
            "scaled_sums_distributed": "scaled sum split",
            "scaled_all_reduces_fused": "scaled (factor in the op)",
            "moe_combines_fused": "top-k combine fused"}


def rewrites(row: dict) -> str:
    return ", ".join(f"{v} {REWRITES[k]}" for k, v in (row.get("rewrites") or {}).items())


def table_row(row: dict) -> str:
    cells = [f"`{row['model_type']}`", str(row.get("sites", "-")), str(row.get("fused", "-")),
             other_shapes(row), rewrites(row), _fmt_err(row.get("err_pass_vs_compile")), _fmt_err(row.get("err_compile_vs_eager")),
             why_not(row)]
    return "| " + " | ".join(c.replace("|", "/") for c in cells) + " |"


HOW_IT_WORKS = """\
## How the counter works

`benchmarks/hf_site_counter.py` counts sites in the **eager** model and imports nothing from
arfusion, so it checks the matcher rather than repeating it.

- A `TorchDispatchMode` marks the tensors all-reduces produce: HF's in-place
  `dist.all_reduce(t, group=...)` dispatches as `c10d.allreduce_`, DTensor/funcol as
  `_c10d_functional.all_reduce` (+ `wait_tensor`).
- A mark follows view/reshape-only ops (view, reshape, squeeze, clone, contiguous) and adds:
  the mark of a sum counts its terms (all-reduced terms, other full-size terms, broadcast terms,
  all-reduced terms multiplied by a scalar `ar*s` or by a broadcast tensor such as a per-token
  gate `ar*g`; × 1.0, a multiplier left at its default, is no scale). A dtype conversion keeps
  the mark but flags it `(dtype cast)`.
- Forward pre-hooks on norm modules read the mark of the norm's input. A norm ends a chain:
  the tensor it read counts as a plain residual afterwards.
- Which modules are RMSNorm is decided by running each norm class once on a random input
  (weights randomised on a copy) and comparing with x/rms(x)·w, x/rms(x)·(1+w), x/rms(x),
  LayerNorm and LayerNorm·(1+w) (look-alikes). Grouped norms, gated norms whose gate is not
  optional, and norms that return a factor come out as "other" and are not hooked; a norm
  called with a second tensor (a gate) is reported as a gated-norm look-alike.
- **Sites** = RMSNorm calls whose input is one all-reduce [views] with at most one add:
  `ar` (all-reduce → norm), `ar+add` (all-reduce + residual → norm), `ar+ar` (the sum of two
  all-reduces normed without a residual, e.g. a MoE block's own post-norm: the second is an
  all-reduce + "residual" like any other), and `ar*s`, `ar*s+add` (the all-reduce scaled by a
  scalar first: Granite's multipliers, MiniCPM's depth scale, Gemma's embedding normaliser).
  Other shapes are listed, not counted: `ar+ar+add`
  (routed + shared experts, both all-reduced, then the residual), `ar+replicated+add` (an extra
  non-all-reduced term, e.g. a replicated shared expert), `ar*s+replicated+add` and the like,
  `ar*g…`, `ar+bias…`, `… (dtype cast)`,
  `ar+add×N` (a chain of residual adds, e.g. a post-norm model's embedding all-reduce reaching the
  final norm). "no norm" lists all-reduces whose value never reached a norm, with the op that
  consumed it.

Limits: it sees only what runs in the eager forward of this tiny config (2 layers; the layer
kinds kept are those of the first layer and of the first layer that differs from it, so e.g. a
hybrid model's third kind of layer is not seen); a norm written inline (not a module) is not
hooked: its all-reduce shows under "no norm"; a reduction (Llama-4's sum over experts of
all-reduced rows) ends a mark; it counts module calls, so a norm module applied twice counts
twice. Every row is one forward of one batch row (its tokens are in the header); the counter is
not a proof that the compiled graph has the same shape (Inductor's decompositions can differ), which is what the "fused"
column then shows.
"""


def with_update(meta: dict, run: dict, rows: list[str]) -> dict:
    """The report's meta after `run` (--update) reran `rows`: the other rows are still the first
    sweep's, so its header stays and each update says which rows it reran, from which tree."""
    update = {**run, "command": f"{run['command']} --update", "rows": rows}
    return {**meta, "updates": [*meta.get("updates", []), update]}


def write_reports(rows: list[dict], md: Path, js: Path, meta: dict) -> None:
    s = summary(rows)
    js.parent.mkdir(parents=True, exist_ok=True)
    js.write_text(json.dumps({"meta": meta, "summary": s, "rows": rows}, indent=1, default=str) + "\n")
    md.parent.mkdir(parents=True, exist_ok=True)
    failed = [r for r in rows if r.get("error")]
    out = io.StringIO()
    w = out.write
    w("# Coverage: every Hugging Face architecture with a tensor-parallel plan\n\n")
    w(f"**{s['architectures']} architectures, {s['sites']} sites (counter), {s['fused']} fused, "
      f"{s['fully_fused']} fully fused** (of {s['with_sites']} with at least one site; "
      f"{s['failed']} did not complete).\n\n")
    w(f"- command: `{meta['command']}`\n")
    w(f"- date: {meta['date']}; wall time {meta['wall_s'] / 60:.1f} min\n")
    w(f"- torch {meta['torch']}, transformers {meta['transformers']}, arfusion {meta['arfusion']} "
      f"(commit {meta['commit']})\n")
    for u in meta.get("updates", []):
        w(f"- rows {', '.join(f'`{m}`' for m in u['rows'])} rerun: `{u['command']}`, {u['date']}, "
          f"{u['wall_s'] / 60:.1f} min, torch {u['torch']}, transformers {u['transformers']} (commit {u['commit']})\n")
    w(f"- machine: {meta['machine']}; TP=2 on gloo, bf16, random weights, 2 layers, hidden 128, "
      f"1 × {meta.get('tokens', TOKENS)} tokens; each model loaded with `tp_plan=\"auto\"`, then "
      "`arfusion.hf.prepare_for_compile(model)` as the README asks of users (it removes graph "
      "breaks in transformers' own code: looped experts, q/k-norm gradient hooks)\n")
    w("- columns: *sites* = all-reduce [views] [+ residual] → RMSNorm calls counted in the eager "
      "model (see below); *fused* = `arfusion.stats()['fused_sites']` with "
      "`PassConfig(enable_allreduce_fusion=True, backend=\"torch\")`; *all-reduces rewritten* = MoE "
      "ends changed before matching (`merged`: AR(a) + AR(b) became one all-reduce, one collective "
      "fewer per layer; `sum moved before`: sum(AR(x)) became AR(sum(x)); `scaled sum split`: "
      "(AR(a) + b) * f became AR(a) * f + b * f; `scaled (factor in the op)`: f * AR(x) sites whose op "
      "takes f, a number or a 0-d tensor; `top-k combine fused`: the expert combine runs inside the "
      "site's op). *fused* can exceed *sites*: merged and split all-reduces give sites the counter "
      "files under other shapes, and the counter does not see Gemma's embedding all-reduce (its 0-d "
      "normaliser: fused here); errors are max|a−b|/max|b| of "
      "the logits (pass vs plain `torch.compile`, plain `torch.compile` vs eager: Inductor alone "
      "deviates on some MoE models, where a top-k router can turn a last-bit difference into another "
      "expert); *why not* = `stats()['why_not']`, else the `arfusion` logger's \"not fused\" lines, "
      "else the error that stopped the row.\n\n")
    noisy = [r for r in rows if (r.get("err_pass_vs_compile") or 0) > NOISY_ERR]
    if noisy:
        w(f"- pass vs compile above {NOISY_ERR:g}: " + ", ".join(
            f"`{r['model_type']}` {_fmt_err(r['err_pass_vs_compile'])} (pass vs eager "
            f"{_fmt_err(r.get('err_pass_vs_eager'))}, compile vs eager {_fmt_err(r.get('err_compile_vs_eager'))})"
            for r in noisy) + ". Random weights turn last-bit differences into percent-level logits noise; "
          "where pass vs eager is below compile vs eager, the pass is nearer the model than plain "
          "Inductor is.\n\n")
    w(ROW_HEADER + "\n|---|---|---|---|---|---|---|---|\n")
    for row in rows:
        w(table_row(row) + "\n")
    if failed:
        w("\n## Architectures that did not complete\n\n")
        for r in failed:
            w(f"- `{r['model_type']}`: {r['error']}\n")
    w("\n" + HOW_IT_WORKS)
    w("\nRaw results (counter details per norm call, stats, log lines, timings): "
      f"[{js.relative_to(md.parent) if js.is_relative_to(md.parent) else js}]"
      f"({js.relative_to(md.parent) if js.is_relative_to(md.parent) else js}).\n")
    md.write_text(out.getvalue())


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def driver_main(args) -> int:
    sys.path.insert(0, str(ROOT))
    import torch
    import transformers

    all_archs = architectures()
    skipped = {m: why for m, why in all_archs if why}
    wanted = [m for m, _ in all_archs]
    if args.only:
        only = [m.strip() for m in args.only.split(",") if m.strip()]
        unknown = [m for m in only if m not in wanted]
        if unknown:
            print(f"unknown or planless model types: {unknown}", file=sys.stderr)
            return 2
        wanted = only
    to_run = [m for m in wanted if m not in skipped]
    # --update: rerun some rows of an existing report, keep the others
    report = json.loads(Path(args.json).read_text()) if args.update else {"rows": []}
    if args.update and report["meta"].get("tokens", TOKENS) != args.tokens:
        print(f"--update: {args.json} was swept at {report['meta'].get('tokens', TOKENS)} tokens, not "
              f"{args.tokens}", file=sys.stderr)
        return 2
    os.environ[TOKENS_ENV] = str(args.tokens)
    previous = {r["model_type"]: r for r in report["rows"]}
    print(f"{len(wanted)} architectures ({len(to_run)} to run), timeout {args.timeout:.0f} s each; "
          f"rank logs in {args.log}", file=sys.stderr)
    # The code the ranks import is the tree's at the start (commits made during a sweep do not count).
    commit = os.environ.get("HF_COVERAGE_COMMIT")  # a run from an exported tree names its commit
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True).stdout.strip() or "?"
        except OSError:
            commit = "?"
    date = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    started = time.time()
    results = sweep(to_run, args.timeout, Path(args.log), show_progress=not args.quiet) if to_run else {}
    wall = time.time() - started
    fresh = {m: ({"model_type": m, "error": skipped[m]} if m in skipped else results[m]) for m in wanted}
    rows = [fresh.get(m, r) for m, r in previous.items()] + [r for m, r in fresh.items() if m not in previous]
    import arfusion

    command = "python benchmarks/hf_coverage.py" + (f" --only {args.only}" if args.only else "") + \
        (f" --tokens {args.tokens}" if args.tokens != TOKENS else "")
    run = {"tokens": args.tokens, "command": command, "date": date, "wall_s": round(wall, 1),
           "torch": torch.__version__, "transformers": transformers.__version__, "arfusion": arfusion.__version__,
           "commit": commit}
    if args.update:
        meta = with_update(report["meta"], run, sorted(fresh))
    else:
        meta = {**run, "machine": _machine(), "timeout_s": args.timeout}
    write_reports(rows, Path(args.md), Path(args.json), meta)
    s = summary(rows)
    print(f"{s['architectures']} architectures, {s['sites']} sites, {s['fused']} fused, {s['fully_fused']} fully "
          f"fused, {s['failed']} failed; wall {wall / 60:.1f} min -> {args.md}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated model types (default: all)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per architecture before it is killed")
    p.add_argument("--md", default=str(ROOT / "docs" / "coverage.md"))
    p.add_argument("--json", default=str(ROOT / "docs" / "data" / "coverage.json"))
    p.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "arfusion-coverage-ranks.log"),
                   help="where the ranks' stdout/stderr go")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--tokens", type=int, default=TOKENS,
                   help="tokens of the one batch row each model runs (1: a batch-1 decode step's shape)")
    p.add_argument("--update", action="store_true",
                   help="rerun the --only rows of the existing --json report and rewrite it with the others kept")
    # internal: one rank of the pair
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--archs", help=argparse.SUPPRESS)
    p.add_argument("--progress", help=argparse.SUPPRESS)
    p.add_argument("--ckpt-root", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker_main(args)
        return 0
    return driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
