"""benchmarks/coverage/cb_coverage.py: the continuous-batching sweep on three architectures (a dense
model, a MoE whose shared expert's all-reduce merges, a hybrid transformers cannot run under
continuous batching), a hung architecture, and the helpers that read errors and compare rows.

The sweep tests spawn one process per architecture (about a minute on a 2-core CPU): they are
`slow` and `multiproc`; the helpers' tests are quick.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "coverage"))

import cb_coverage  # noqa: E402
from hf_coverage import processes_with_env  # noqa: E402

SWEEP = ("llama", "aria_text", "qwen3_next")
SCRIPT = str(ROOT / "benchmarks" / "coverage" / "cb_coverage.py")


def _run(tmp, only: str, timeout: int, **env) -> subprocess.CompletedProcess:
    cmd = [sys.executable, SCRIPT, "--only", only, "--md", str(tmp / "cb.md"), "--json", str(tmp / "cb.json"),
           "--log", str(tmp / "cb.log"), "--quiet", "--timeout", str(timeout)]
    # --timeout bounds each architecture; this only catches a driver that hangs itself
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **env})


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("cb_coverage")
    done = _run(out, ",".join(SWEEP), 150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((out / "cb.json").read_text())
    return {"md": (out / "cb.md").read_text(), "rows": {r["model_type"]: r for r in data["rows"]}, "data": data,
            "log": (out / "cb.log").read_text()}


@pytest.mark.slow
@pytest.mark.multiproc
def test_dense_model_every_all_reduce_fused_tokens_as_eager(sweep):
    """Llama: per compiled graph the embedding all-reduce and two per layer, all fused, as in a
    plain forward; the paged-cache update split nothing; greedy fp32 tokens identical to eager's."""
    row = sweep["rows"]["llama"]
    assert cb_coverage.outcome(row) == "ran", (row, sweep["log"][-3000:])
    assert row["same_tokens"] and row["eager_same_as_transformers"], row
    graphs = row["graphs"]
    assert graphs >= 1 and row["all_reduces"] == row["fused"] == 5 * graphs, row
    assert row["merged"] == row["fast_path"] == row["left_nccl"] == 0, row
    assert row["split_by_graph_breaks"] == {} and row["why_not_codes"] == {} and row["nccl_codes"] == {}, row
    assert row["versus_plain"] == cb_coverage.SAME and row["plain"]["all_reduces"] == 5, row
    assert cb_coverage.fully_handled(row)


@pytest.mark.slow
@pytest.mark.multiproc
def test_moe_shared_expert_all_reduce_merges_as_in_a_plain_forward(sweep):
    """Aria: each MoE layer's routed and shared-expert all-reduces become one (2 merged per graph),
    the expert combine fused into its site."""
    row = sweep["rows"]["aria_text"]
    assert cb_coverage.outcome(row) == "ran", (row, sweep["log"][-3000:])
    assert row["same_tokens"], row
    graphs = row["graphs"]
    assert (row["all_reduces"], row["fused"], row["merged"]) == (7 * graphs, 5 * graphs, 2 * graphs), row
    assert row["rewrites"]["summed_all_reduces_merged"] == 2 * graphs, row
    assert row["left_nccl"] == 0 and row["versus_plain"] == cb_coverage.SAME, row


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_hybrid_transformers_cannot_run_stops_after_its_own_eager_run(sweep):
    row = sweep["rows"]["qwen3_next"]
    assert cb_coverage.outcome(row) == "cannot", row
    assert row["cb_error"] == "ValueError: Invalid layer type: linear_attention", row
    assert (row["cb_cause"], row["cb_detail"]) == (cb_coverage.LAYER_TYPE, "linear_attention"), row
    assert "all_reduces" not in row and "error" not in row and "eager_s" not in row, row


@pytest.mark.slow
@pytest.mark.multiproc
def test_report(sweep):
    md, s = sweep["md"], sweep["data"]["summary"]
    assert (s["architectures"], s["ran"], s["cannot"], s["fully_handled"], s["same_tokens"]) == (3, 2, 1, 2, 2), s
    assert s["left_nccl"] == 0 and s["transformers_causes"] == {cb_coverage.LAYER_TYPE: 1}, s
    meta = sweep["data"]["meta"]
    assert meta["command"] == f"python benchmarks/coverage/cb_coverage.py --only {','.join(SWEEP)}", meta
    assert f"- torch {torch.__version__}, transformers " in md and f"(commit {meta['commit']})" in md
    assert re.search(r"\*\*3 architectures: 2 ran under continuous batching, 2 with tokens identical to eager, "
                     r"2 fully handled .*1 transformers itself cannot run under continuous batching "
                     r"\(1 unsupported layer type\)", md)
    assert cb_coverage.ROW_HEADER in md
    rows = [line for line in md.splitlines() if line.startswith("| `")]
    assert [re.match(r"\| `([^`]+)` \|", line).group(1) for line in rows] == list(SWEEP)
    for model_type in SWEEP:
        assert cb_coverage.table_row(sweep["rows"][model_type]) in md
    assert "| `qwen3_next` | transformers cannot run it | - |" in md
    assert "## Architectures transformers itself cannot run under continuous batching" in md
    assert "### unsupported layer type (1)" in md and "- `qwen3_next`: linear_attention" in md
    assert "## Architectures that did not complete" not in md and "## Rows not fully handled" not in md


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_hung_architecture_is_killed_and_recorded(tmp_path):
    done = _run(tmp_path, "llama", 10, CB_COVERAGE_TEST_HANG="llama")
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads((tmp_path / "cb.json").read_text())["rows"]
    assert row["error"] == "timeout: more than 10 s" and cb_coverage.outcome(row) == "timeout", row
    assert "- `llama` (timeout): timeout: more than 10 s" in (tmp_path / "cb.md").read_text()
    assert not processes_with_env(b"CB_COVERAGE_TEST_HANG=llama")


# ------------------------------------------------------------------------- the helpers alone
def test_causes_of_transformers_own_failures():
    copy = "index_copy_(): Source/destination tensor must have same slice shapes. Destination slice shape: {} " \
           "at dimension 0 and source slice shape: {} at dimension 0."
    assert cb_coverage.cause("ValueError: Invalid layer type: conv") == (cb_coverage.LAYER_TYPE, "conv")
    assert cb_coverage.cause(copy.format("4 16", "1 32"))[0] == cb_coverage.HEAD_SIZE
    assert cb_coverage.cause(copy.format("1 32", "2 32")) == (
        cb_coverage.HEAD_COUNT, "the cache pages 1 heads per rank, the model gives 2")
    assert cb_coverage.cause("generate_batch: 'cu_seq_lens_k'") == (cb_coverage.OTHER,
                                                                    "generate_batch: 'cu_seq_lens_k'")


def test_first_error_reads_the_first_requests():
    failed = RuntimeError("generate_batch failed: {'req_0': 'bad shape\\nhere', 'req_1': 'bad shape'}")
    assert cb_coverage.first_error(failed) == "generate_batch: bad shape here"
    assert cb_coverage.first_error(ValueError("Invalid layer type: conv")) == "ValueError: Invalid layer type: conv"


def test_versus_plain_compares_per_compiled_graph():
    plain = {"all_reduces": 7, "fused": 5, "merged": 2, "fast_path": 0, "left_nccl": 0, "graphs": 1}
    row = {"all_reduces": 14, "fused": 10, "merged": 4, "fast_path": 0, "left_nccl": 0, "graphs": 2}
    assert cb_coverage.versus_plain(row, plain) == cb_coverage.SAME
    assert cb_coverage.versus_plain({**row, "fused": 8, "left_nccl": 2}, plain) == \
        "differs: fused 8 (plain 5 × 2), left_nccl 2 (plain 0 × 2)"
    assert cb_coverage.versus_plain({**row, "graphs": 3}, {**plain, "graphs": 2}) == "3 graphs, the plain forward 2"
    assert cb_coverage.versus_plain(row, {"error": "eager: boom"}) == "no plain-forward row (eager: boom)"
