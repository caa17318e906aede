"""Coverage over every Hugging Face architecture with a tensor-parallel plan.

    python benchmarks/coverage/hf_coverage.py                       # all of them, writes docs/coverage.md
    python benchmarks/coverage/hf_coverage.py --only llama,olmo2    # a subset, written to a temporary directory
    python benchmarks/coverage/hf_coverage.py --tokens 1 --md docs/coverage_decode.md --json docs/data/coverage_decode.json

Each causal-LM model type with a TP plan (`arfusion.check.architectures`) as a tiny config
(`arfusion.hf.configs.tiny_config`), random bf16 weights written by rank 0 and loaded by 2 gloo ranks with TP=2
(`arfusion.check.load_tp_model`): the eager model under an independent site counter
(`hf_site_counter.py`), plain `torch.compile`, and `torch.compile` with the pass (backend "torch",
through `arfusion.testing.compile_and_run` as `arfusion check`); logits errors max|a-b|/max|b|.
One torchrun pair takes the architectures in turn; past --timeout (or a dead rank) the driver kills
it, records the architecture and starts a new pair. Ranks agree after each step. Writes --md, --json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
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
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from coverage_report import TOKENS, summary, with_update, write_reports  # noqa: E402
from hf_site_counter import count_sites  # noqa: E402

import arfusion  # noqa: E402
from arfusion.check import architectures, load_tp_model, one_line, save_random_model  # noqa: E402
from arfusion.hf.configs import tiny_config  # noqa: E402
from arfusion.testing import compile_and_run  # noqa: E402

TOKENS_ENV = "HF_COVERAGE_TOKENS"  # how the driver tells its ranks
PAIR_ENV = "HF_COVERAGE_PAIR"  # marks the processes of one torchrun pair

# ============================================================================ worker (one rank)
def _max_rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


class Worker:
    def __init__(self, progress: Path, ckpt_root: str):
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.progress, self.ckpt_root = progress, ckpt_root
        torch.set_num_threads(1)
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()

    def emit(self, event: dict) -> None:
        if self.rank == 0:
            with open(self.progress, "a") as f:
                f.write(json.dumps(event) + "\n")

    def agree(self, status: str | None) -> str | None:
        """Every rank's error (None = fine) -> the first error any rank had, on every rank."""
        statuses = [None] * self.world
        dist.all_gather_object(statuses, status)
        bad = [(r, s) for r, s in enumerate(statuses) if s is not None]
        return None if not bad else bad[0][1] if len(bad) == self.world else f"rank {bad[0][0]}: {bad[0][1]}"

    def run(self, model_types: list[str]) -> None:
        for model_type in model_types:
            self.emit({"event": "start", "arch": model_type, "t": time.time()})
            started, row = time.perf_counter(), {"model_type": model_type}
            try:
                self.one(model_type, row)
            except Exception as e:  # anything not caught by a step: the pair may be out of step now
                row.setdefault("error", f"worker: {one_line(e)}")
            finally:
                self.drop_groups()
            row["seconds"] = round(time.perf_counter() - started, 1)
            self.emit({"event": "done", "arch": model_type, "row": row})
        dist.barrier()
        dist.destroy_process_group()

    def drop_groups(self) -> None:
        """Each TP load makes a device mesh of new gloo groups: else ~1600 threads per rank by the end."""
        for group in list(dist.distributed_c10d._world.pg_map):
            if group is not dist.GroupMember.WORLD:
                with contextlib.suppress(Exception):
                    dist.destroy_process_group(group)

    def step(self, row: dict, name: str, fn, seconds: str = ""):
        """fn on every rank (row[seconds]: its time); where any rank fails, all record the error."""
        err, value, started = None, None, time.perf_counter()
        try:
            value = fn()
        except Exception as e:
            err = one_line(e)
            if os.environ.get("HF_COVERAGE_TRACEBACK"):
                traceback.print_exc()
        err = self.agree(err)
        if err is not None:
            row["error"] = f"{name}: {err}"
            return None, False
        if seconds:
            row[seconds] = round(time.perf_counter() - started, 1)
        return value, True

    def one(self, model_type: str, row: dict) -> None:
        if os.environ.get("HF_COVERAGE_TEST_HANG") == model_type and self.rank == 1:
            time.sleep(10**6)  # tests: a rank that hangs (rank 0 then waits in the next collective)
        config, ok = self.step(row, "config", lambda: tiny_config(model_type))
        if not ok:
            return
        text_config = config.get_text_config()  # Llama4Config and other composites keep it inside
        row["config"] = {k: getattr(text_config, k, None) for k in (
            "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size")}
        path, ok = self.step(row, "save", lambda: [save_random_model(config, tempfile.mkdtemp(
            prefix=f"cov-{model_type}-", dir=self.ckpt_root)) if self.rank == 0 else None])  # seed 0
        if not ok:
            return
        dist.broadcast_object_list(path, src=0)
        path = path[0]
        try:
            model, ok = self.step(row, "load", lambda: load_tp_model(path))  # and prepare_for_compile(model)
        finally:
            dist.barrier()
            if self.rank == 0:
                shutil.rmtree(path, ignore_errors=True)
        if not ok:
            return
        tokens = int(os.environ.get(TOKENS_ENV, TOKENS))
        ids = torch.randint(0, text_config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
        inputs = {"input_ids": ids, "use_cache": False}

        def forward(m):
            with torch.no_grad():
                out = m(**inputs)
            return out.logits.float()

        def compiled(config):  # plain Inductor (config None), or with the pass
            torch._dynamo.reset()
            with torch.no_grad():
                report = compile_and_run(model, kwargs=inputs, config=config)
            return report.output.logits.float(), report

        t0 = time.perf_counter()
        res, ok = self.step(row, "eager", lambda: count_sites(model, forward, text_config.hidden_size))
        if not ok:
            return
        eager, row["counter"] = res
        row["eager_s"], row["sites"] = round(time.perf_counter() - t0, 1), row["counter"]["sites"]
        res, ok = self.step(row, "compile", lambda: compiled(None), "compile_s")
        if not ok:
            return
        plain, _ = res
        row["err_compile_vs_eager"] = _max_rel_err(plain, eager)
        res, ok = self.step(row, "compile+pass", lambda: compiled(
            arfusion.PassConfig(enable_allreduce_fusion=True, backend="torch")), "pass_s")
        if not ok:
            return
        fused_logits, report = res
        row.update(report.summary())
        row["err_pass_vs_compile"] = _max_rel_err(fused_logits, plain)
        row["err_pass_vs_eager"] = _max_rel_err(fused_logits, eager)  # in the JSON: is the pass nearer the model?
        del model
        torch._dynamo.reset()


# ============================================================================ driver
def _launch(archs: list[str], progress: Path, ckpt_root: str, log_file) -> subprocess.Popen:
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(Path(__file__).resolve()), "--worker", "--archs", ",".join(archs),
           "--progress", str(progress), "--ckpt-root", ckpt_root]
    env[PAIR_ENV] = f"{os.getpid()}-{time.monotonic_ns()}"  # every process of the pair inherits it: _kill's mark
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    proc.pair = env[PAIR_ENV]
    return proc


def processes_with_env(entry: bytes) -> list[int]:
    """Processes whose environment holds `entry` (b"NAME=value")."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/environ", "rb") as f:
            if entry in f.read().split(b"\0"):
                found.append(int(pid))
    return found


def _kill(proc: subprocess.Popen) -> None:
    """torchrun and its ranks (which torchrun starts in sessions of their own): every process of the pair."""
    for pid in {proc.pid, *processes_with_env(f"{PAIR_ENV}={proc.pair}".encode())}:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def sweep(archs: list[str], timeout: float, log_path: Path, show_progress: bool = True) -> dict[str, dict]:
    """Run the architectures on torchrun pairs; restart a pair past a hung or dead architecture."""
    from tqdm import tqdm

    rows, todo = {}, list(archs)
    bar = tqdm(total=len(archs), unit="arch", disable=not show_progress, file=sys.stderr)
    ckpt_root = tempfile.mkdtemp(prefix="arfusion-coverage-")

    def done(arch: str, row: dict, note: str) -> None:
        rows[arch] = row
        todo.remove(arch)
        bar.update(1)
        bar.write(f"{arch:>24}: {note}")

    with open(log_path, "w") as log_file:
        while todo:
            progress = Path(tempfile.mktemp(prefix="progress-", suffix=".jsonl", dir=ckpt_root))
            progress.touch()
            proc = _launch(todo, progress, ckpt_root, log_file)
            current, current_t, seen, failure = None, time.time(), 0, None
            while True:
                time.sleep(0.5)
                lines = progress.read_text().splitlines()
                for event in map(json.loads, lines[seen:]):
                    if event["event"] == "start":
                        current, current_t = event["arch"], time.time()
                        bar.set_postfix_str(current)
                        continue
                    row, current = event["row"], None
                    done(event["arch"], row, f"sites {row.get('sites', '-')}, fused {row.get('fused', '-')}, "
                         f"{row['seconds']} s" + (f"  [{row['error'][:90]}]" if row.get("error") else ""))
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
                done(current, {"model_type": current, "error": failure, "seconds": round(time.time() - current_t, 1)},
                     failure)
            elif todo and proc.returncode != 0:  # died between architectures: the next one takes it, the sweep ends
                done(todo[0], {"model_type": todo[0], "seconds": 0.0,
                               "error": f"rank process exited (code {proc.returncode}) before it"}, "rank exited")
    bar.close()
    shutil.rmtree(ckpt_root, ignore_errors=True)
    return rows


# ============================================================================ report
def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def chosen_architectures(only: str | None) -> tuple[list[str], dict[str, str]] | None:
    """The model types a sweep covers (all with a TP plan, or `--only`'s comma list) and why some are
    skipped; None, with a line to stderr, where --only names a type without a plan."""
    all_archs = architectures()
    skipped = {m: why for m, why in all_archs if why}
    wanted = [m for m, _ in all_archs]
    if only:
        picked = [m.strip() for m in only.split(",") if m.strip()]
        unknown = [m for m in picked if m not in wanted]
        if unknown:
            print(f"unknown or planless model types: {unknown}", file=sys.stderr)
            return None
        wanted = picked
    return wanted, skipped


def driver_main(args) -> int:
    if (chosen := chosen_architectures(args.only)) is None:
        return 2
    wanted, skipped = chosen
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
    # The code the ranks import is the tree's at the start (commits made during a sweep do not count);
    # a run from an exported tree names its commit in HF_COVERAGE_COMMIT.
    commit = "?"
    with contextlib.suppress(OSError):
        commit = os.environ.get("HF_COVERAGE_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip() or "?"
    date, started = datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), time.time()
    results = sweep(to_run, args.timeout, Path(args.log), show_progress=not args.quiet) if to_run else {}
    wall = time.time() - started
    fresh = {m: ({"model_type": m, "error": skipped[m]} if m in skipped else results[m]) for m in wanted}
    rows = [fresh.get(m, r) for m, r in previous.items()] + [r for m, r in fresh.items() if m not in previous]
    command = "python benchmarks/coverage/hf_coverage.py" + (f" --only {args.only}" if args.only else "") + \
        (f" --tokens {args.tokens}" if args.tokens != TOKENS else "") + args.outputs_given
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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated model types (default: all)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per architecture before it is killed")
    p.add_argument("--md", help="default: docs/coverage.md; with --only (no --update), a temporary directory")
    p.add_argument("--json", help="default: docs/data/coverage.json; with --only (no --update), a temporary directory")
    p.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "arfusion-coverage-ranks.log"),
                   help="where the ranks' stdout/stderr go")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--tokens", type=int, default=TOKENS, help="tokens of the batch row (1: a batch-1 decode step)")
    p.add_argument("--update", action="store_true", help="rerun the --only rows of the --json report, keep the others")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one rank of the pair, with:
    for internal in ("--archs", "--progress", "--ckpt-root"):
        p.add_argument(internal, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    args.outputs_given = "".join(f" --{k} {getattr(args, k)}" for k in ("md", "json") if getattr(args, k))
    # A few rows (--only) never replace the committed full sweep, unless --update merges them into it.
    if args.only and not args.update and not (args.md and args.json):
        out = Path(tempfile.mkdtemp(prefix="arfusion-coverage-"))
        args.md, args.json = args.md or str(out / "coverage.md"), args.json or str(out / "coverage.json")
        print(f"--only: the reports go to {out} (--md, --json to choose)", file=sys.stderr)
    args.md = args.md or str(ROOT / "docs" / "coverage.md")
    args.json = args.json or str(ROOT / "docs" / "data" / "coverage.json")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        Worker(Path(args.progress), args.ckpt_root).run(args.archs.split(","))
        return 0
    return driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
