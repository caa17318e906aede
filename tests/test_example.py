"""The README's example, run as a user runs it: torchrun, 2 processes, gloo on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "compile_hf_model.py"
LAYERS = 2


def run_example(model_type: str, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", str(EXAMPLE), "--model-type", model_type,
           "--layers", str(LAYERS), "--steps", "4", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model_type, sites", [
    ("llama", 2 * LAYERS + 1),
    ("qwen3", 2 * LAYERS + 1),
    # Not among the models the patterns were written against: fuses without code changes.
    ("qwen2", 2 * LAYERS + 1),
    # Granite scales the all-reduced output before the residual add (by 0.22, as its checkpoints
    # do; the example sets it): every site fuses, the op taking the factor.
    ("granite", 2 * LAYERS + 1),
    # Spellings the first matcher missed: OLMo2 multiplies its weight in fp32 and adds the
    # residual after the norm (post-norm: no site after the embedding's all-reduce); MoE blocks
    # all-reduce [T, H] and view it back to [B, S, H] before the residual add.
    ("olmo2", 2 * LAYERS),
    ("mixtral", 2 * LAYERS + 1),
    ("qwen3_moe", 2 * LAYERS + 1),
])
def test_example_fuses_every_site_and_matches_eager(model_type, sites):
    result = run_example(model_type)
    assert result["fused_sites"] == sites, result
    # Fused calls on the torch backend; OLMo2's embedding all-reduce (no site: post-norm) on the fast path.
    fast = {"torch all-reduce": result["dispatch"]["torch all-reduce"]} if model_type == "olmo2" else {}
    assert result["dispatch"] == {"torch": result["dispatch"]["torch"], **fast}, result
    assert result["max_rel_diff"] < 2e-2  # bf16 noise: a few ulps of the largest logit


def test_example_fuses_the_fp8_quant_after_each_norm():
    result = run_example("llama", "--quant", "fp8-dynamic")
    # Every norm feeding q/k/v or gate/up carries the quant; the final norm (lm_head) does not.
    assert result["by_pattern"] == {"allreduce_rmsnorm_fp8_dynamic": 1,
                                    "allreduce_add_rmsnorm_fp8_dynamic": 2 * LAYERS - 1,
                                    "allreduce_add_rmsnorm": 1}, result
    assert result["max_rel_diff"] < 5e-2  # FP8 rounding of the activations, not bf16 noise
