"""The README's example, run as a user runs it: torchrun, 2 processes, gloo on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import stderr_for_a_user

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "compile_hf_model.py"
LAYERS = 2
STEPS = 4
CALLS = 1 + STEPS  # the compiled model's forwards: the first (compile), then one per greedy step


def run_example(model_type: str, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", str(EXAMPLE), "--model-type", model_type,
           "--layers", str(LAYERS), "--steps", str(STEPS), *extra]
    # This checkout's arfusion, also where another one is installed (the script's folder is examples/).
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # Nothing a newcomer would read as an error: no warning of ours, no known third-party noise.
    assert stderr_for_a_user(done.stderr) == [], done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert lines[-3].startswith("verdict: tokens "), lines[-3:]
    return result


@pytest.mark.parametrize("name", ["compile_hf_model.py", "compile_torch_tp.py", "serve_continuous_batching.py"])
def test_an_example_run_without_torchrun_says_how_to_run_it(name):
    """`python examples/X.py`: one line with the torchrun command and exit 2, not torch's ValueError."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(ROOT / "examples" / name)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr[-3000:]
    assert stderr_for_a_user(done.stderr) == [f"{name}: run it under torchrun, one process per rank: "
                                              f"torchrun --nproc-per-node 2 examples/{name}"], done.stderr


# The example as the README runs it (Llama). Which architectures fuse is the coverage sweep's
# question, not the example's: Qwen3-MoE (its MoE all-reduces [T, H], viewed back to [B, S, H] before
# the add), Granite's scaled sites and OLMo2's post-norm are tests/test_hf_coverage.py's rows, through
# the same loading (arfusion.check.load_tp_model) on two gloo ranks.
def test_example_fuses_every_site_and_matches_eager():
    sites = 2 * LAYERS + 1
    result = run_example("llama")
    assert result["fused_sites"] == sites, result
    # Every site fused in every forward, on the torch backend.
    assert result["unfused_sites"] == 0, result
    assert result["dispatch"] == {"torch": sites * CALLS}, result
    assert result["max_rel_diff"] < 2e-2  # bf16 noise: a few ulps of the largest logit
    assert result["graphs"] == 1 and result["all_reduces"] == sites, result  # one graph serves every forward
    # Tokens equal up to the first difference, and that one at a near tie (random weights make them).
    assert result["tokens_verdict"] in ("match", "near_tie"), result
    assert "tokens_match" not in result and "near_tie" not in result  # one verdict field
    first = result["first_different_token"]  # counted from 1, as the verdict line counts
    assert (result["tokens_verdict"] == "match") == (first is None), result
    if first is not None:
        assert result["tokens"][:first - 1] == result["ref_tokens"][:first - 1], result
        assert result["tokens"][first - 1] != result["ref_tokens"][first - 1], result


def test_example_fuses_the_fp8_quant_after_each_norm():
    result = run_example("llama", "--quant", "fp8-dynamic")
    # Every norm feeding q/k/v or gate/up carries the quant; the final norm (lm_head) does not.
    assert result["by_pattern"] == {"allreduce_rmsnorm_fp8_dynamic": 1,
                                    "allreduce_add_rmsnorm_fp8_dynamic": 2 * LAYERS - 1,
                                    "allreduce_add_rmsnorm": 1}, result
    assert result["max_rel_diff"] < 5e-2  # FP8 rounding of the activations, not bf16 noise

