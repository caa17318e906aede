"""examples/serve_continuous_batching.py, run as a user runs it: torchrun, 2 processes, gloo on CPU."""

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
LAYERS = 2  # tiny_config("llama")


def test_continuous_batching_example_fuses_every_site_with_the_same_tokens():
    """examples/serve_continuous_batching.py: transformers' `generate_batch` without and with the
    pass (tiny Llama, 2 layers, fp32 on CPU): every all-reduce fused, the same tokens."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(ROOT / "examples" / "serve_continuous_batching.py"), "--requests", "3", "--new-tokens", "4"]
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # Nothing a newcomer would read as an error: no warning of ours (transformers' decode-compile and
    # NCCL graph-mixing lines came from our settings), no known third-party noise.
    assert stderr_for_a_user(done.stderr) == [], done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    sites = 2 * LAYERS + 1  # tiny_config("llama"): 2 layers
    # Every all-reduce of every graph compiled fused (transformers may compile the forward more than once).
    assert result["fused_sites"] == result["all_reduces"] == sites * result["graphs"] > 0, result
    assert result["why_not_codes"] == {} and result["tokens_verdict"] == "match", result  # fp32: the same tokens
    assert set(result["dispatch"]) == {"torch"} and result["dispatch"]["torch"] > 0, result  # the second call's
    assert result["tokens_per_s"]["off"] > 0 and result["tokens_per_s"]["on"] > 0
    assert "tokens: the same as without the pass, in all 3 requests" in done.stdout
    assert f"the {result['graphs']} graph" in done.stdout and f"{sites} all-reduces each" in done.stdout
