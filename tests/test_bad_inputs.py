"""Awkward inputs through a compiled model with the pass, on real gloo ranks (CPU).

Every case must give the uncompiled (eager) result within the gloo tests' tolerance, or a clear
error: non-contiguous and offset-view inputs, zero tokens, NaN/Inf, negative zeros, a hidden size
that is not a multiple of 8, an fp32 norm weight with bf16 activations (must stay unfused), world
size 3. The cases live in tests/bad_input_cases.py (tests/gpu/check_bad_inputs.py runs the same on
GPUs). All 2-rank cases run in ONE spawn (compiles are the cost); each rank writes a dict of
results that the small tests below check. The soak script (tests/gpu/soak.py) gets one short CPU run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from arfusion.decisions import Why

from .bad_input_cases import run_bad_inputs, run_world_case
from .helpers import run_workers

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]


def _bad_inputs(rank, out_dir):
    results = run_bad_inputs(rank, torch.device("cpu"), "torch")
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results, indent=1, default=str))


def _world_of_3(rank, out_dir):
    results = run_world_case(rank, torch.device("cpu"), "torch")
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results, indent=1, default=str))


def _load(out_dir, world):
    return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    out = tmp_path_factory.mktemp("bad_inputs")
    run_workers(_bad_inputs, 2, str(out))
    return _load(out, 2)


@pytest.fixture(scope="module")
def world3(tmp_path_factory):
    out = tmp_path_factory.mktemp("world3")
    run_workers(_world_of_3, 3, str(out))
    return _load(out, 3)


def _ok(ranks, name):
    for rank, results in enumerate(ranks):
        r = results[name]
        assert r["ok"], f"rank {rank} {name}: {r.get('error') or r['problems']}\n{r.get('trace', '')}"
    return ranks[0][name]


# ------------------------------------------------------------------ tests


def _fused_once_by_torch(cases, *names):
    for name in names:
        r = _ok(cases, name)
        assert r["stats"]["fused_sites"] == 1 and r["stats"]["dispatch"] == {"torch": 1}, (name, r["stats"])
        assert r["stats"]["unfused_sites"] == 0 and r["stats"]["why_not_codes"] == {}, (name, r["stats"])
    return r


def test_non_contiguous_inputs(cases):
    _fused_once_by_torch(cases, "strided_slice", "transposed_back")


def test_offset_view_input(cases):
    _fused_once_by_torch(cases, "offset_view")


def test_zero_tokens_give_empty_results(cases):
    for name in ("zero_tokens", "zero_tokens_dynamic"):
        r = _ok(cases, name)
        assert r["shapes"] == [[0, 64], [0, 64]], r["shapes"]
        # Before the fix this crashed in the pass (ZeroDivisionError in the region walk); now the
        # zero-token graph is left unfused with its reason.
        assert r["stats"]["fused_sites"] == 0 and r["stats"]["unfused_sites"] == 1, r["stats"]
        assert r["stats"]["why_not_codes"] == {Why.ZERO_TOKENS.value: 1}, r["stats"]


def test_nan_and_inf_propagate_as_uncompiled(cases):
    r = _fused_once_by_torch(cases, "nan_inf")
    # Rows 1-4 went non-finite in both (checked equal to eager above), and some values are left.
    assert r["nan"][0] > 0 and r["nan"][1] > 0, r


def test_negative_zeros_reduce_as_zeros(cases):
    _fused_once_by_torch(cases, "negative_zero")


def test_a_scaled_all_reduce_fuses_with_its_factor(cases):
    _fused_once_by_torch(cases, "scaled_input", "scaled_input_dynamic", "scaled_by_a_buffer",
                         "scaled_by_an_attribute_dynamic")


def test_hidden_not_a_multiple_of_8(cases):
    # The torch reference takes any hidden size; FlashInfer declines it (shape_check).
    _fused_once_by_torch(cases, "hidden_36")


def test_fp32_norm_weight_with_bf16_activations_stays_unfused(cases):
    r = _ok(cases, "fp32_weight")
    assert r["stats"]["fused_sites"] == 0 and r["stats"]["unfused_sites"] == 1, r["stats"]
    assert r["stats"]["why_not_codes"] == {Why.WEIGHT_DTYPE.value: 1}, r["stats"]
    (decision,) = r["decisions"]
    assert decision["code"] == Why.WEIGHT_DTYPE.value and "torch.float32" in decision["reason"], decision
    assert any(decision["reason"] in line for line in r["log"]), r["log"]  # logged, for people


def test_world_size_3(world3):
    for rank, results in enumerate(world3):
        assert results["world_3"]["world_size"] == 3
    r = _ok(world3, "world_3")
    assert r["stats"]["fused_sites"] == 1 and r["stats"]["dispatch"] == {"torch": 1}, r["stats"]
    assert r["stats"]["unfused_sites"] == 0 and r["stats"]["why_not_codes"] == {}, r["stats"]


def test_soak_script_on_cpu(tmp_path):
    """tests/gpu/soak.py, 20 calls per mode on 2 gloo ranks: no mismatch, a JSON and a table."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(ROOT / "tests/gpu/soak.py"), "--device", "cpu", "--calls", "20", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    report = json.loads((tmp_path / "soak.json").read_text())
    assert (tmp_path / "soak.md").exists()
    for mode in report["modes"]:
        assert mode["calls"] == 20 and mode["mismatches"] == 0, mode
        assert mode["stats"]["dispatch"].get("torch", 0) > 0, mode  # some calls fused ...
        assert mode["stats"]["dispatch"].get("fallback", 0) + mode["stats"]["unfused_sites"] > 0, mode  # ... some not
