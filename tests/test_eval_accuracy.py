"""The accuracy harness's --tiny mode, as CI runs it: train a tiny Llama on stdlib sources, then
evaluate it with torchrun, 2 processes, gloo on CPU (benchmarks/eval_accuracy.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SLACK = 5e-3  # a 2-layer, hidden-128 model: its bf16 errors are a few 1e-3, so is one rounding's difference


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("acc")
    ckpt, out = tmp / "ckpt", tmp / "out"
    done = subprocess.run([sys.executable, str(BENCH / "train_tiny_llama.py"), "--tiny", "--out", str(ckpt)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                           str(BENCH / "eval_accuracy.py"), "--tiny", "--model", str(ckpt), "--out", str(out),
                           "--abs-slack", str(SLACK)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {"train": json.loads((ckpt / "train_meta.json").read_text()),
            "eval": json.loads((out / "accuracy_llama_w2.json").read_text()),
            "md": (out / "accuracy_llama_w2.md").read_text(), "stdout": done.stdout}


def test_training_reduced_heldout_loss(run):
    t = run["train"]
    assert t["heldout_loss_after"] < t["heldout_loss_before"] - 0.5
    assert t["heldout_files"] > 0 and t["train_files"] > 10 * t["heldout_files"]


def test_every_configuration_reported(run):
    rows = run["eval"]["configurations"]
    assert set(rows) == {"fp32", "eager", "compiled", "arfusion_exact", "arfusion_fp8"}
    for name, r in rows.items():
        assert math.isfinite(r["perplexity"]) and r["perplexity"] > 1, name
        for key in ("ppl_rel_vs_fp32", "ppl_rel_vs_compiled", "logits_rel_err_max", "top1_agreement"):
            assert math.isfinite(r[key]), (name, key)
    assert rows["arfusion_exact"]["fused_sites"] == 2 * run["eval"]["meta"]["layers"] + 1
    # every fused-op call ran the torch backend (none fell back), and the row says so
    assert set(rows["arfusion_exact"]["dispatch"]) == {"torch"} and rows["arfusion_exact"]["dispatch"]["torch"] > 0
    assert "| arfusion_exact |" in run["md"] and "| arfusion_exact |" in run["stdout"]


def test_arfusion_exact_within_bars(run):
    rows = run["eval"]["configurations"]
    a, c = rows["arfusion_exact"], rows["compiled"]
    assert a["logits_rel_err_max"] <= 1.1 * c["logits_rel_err_max"] + SLACK
    assert abs(a["ppl_rel_vs_compiled"]) <= 1e-3
    assert a["top1_agreement"] >= 0.95
    ch = run["eval"]["checks"]["arfusion_exact"]
    assert ch["logits_ok"] and ch["ppl_ok"]


def test_fp8_quantized_all_reduce_measured(run):
    """Every site quantized (--quantized-min-mb 0, the default), emulated by the torch backend."""
    rows = run["eval"]["configurations"]
    q, layers = rows["arfusion_fp8"], run["eval"]["meta"]["layers"]
    assert q["fused_sites"] == 2 * layers + 1 and q["quantized_calls"] >= 2 * layers + 1
    assert rows["arfusion_exact"]["quantized_calls"] == 0
    assert q["logits_rel_err_mean"] > rows["arfusion_exact"]["logits_rel_err_mean"]  # lossy, and it shows
    ch = run["eval"]["checks"]["arfusion_fp8"]
    assert ch["ppl_ok"] and abs(q["ppl_rel_vs_compiled"]) <= 1e-2
