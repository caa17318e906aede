"""GPU tests: run the torchrun-driven checks when this machine has the GPUs (skipped otherwise).

    python -m pytest tests/gpu -q        # on a machine with >= 2 NVIDIA GPUs and FlashInfer
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() and not torch.version.hip else 0


def torchrun(nproc: int, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run under torchrun, echoing its output as it comes (a hang then shows where it is)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *args]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        lines.append(line)
    proc.wait(timeout=timeout)
    return subprocess.CompletedProcess(cmd, proc.returncode, "".join(lines), "")


@pytest.mark.parametrize("world", [2, 4])
def test_fused_op_matches_reference_on_gpus(world):
    if GPUS < world:
        pytest.skip(f"needs {world} NVIDIA GPUs, found {GPUS}")
    done = torchrun(world, "tests/gpu/check_flashinfer.py")
    assert done.returncode == 0, done.stdout[-5000:]


def test_hf_example_runs_fused_on_two_gpus():
    if GPUS < 2:
        pytest.skip(f"needs 2 NVIDIA GPUs, found {GPUS}")
    done = torchrun(2, "examples/compile_hf_model.py", "--backend", "flashinfer")
    assert done.returncode == 0, done.stdout[-5000:]
    summary = json.loads(next(line for line in reversed(done.stdout.splitlines()) if line.startswith("{")))
    assert summary["fused_sites"] > 0 and summary["dispatch"].get("flashinfer", 0) > 0, summary
    assert summary["dispatch"].get("fallback", 0) == 0, summary
    assert summary["max_rel_diff"] < 5e-2, summary


@pytest.mark.parametrize("model_type", ["mixtral", "olmo2"])
def test_hf_example_fuses_every_site_by_meaning(model_type):
    """Shapes the literal matcher missed (MoE view before the add, weight in fp32), 2 layers: every
    all-reduce is a site (2L, or 2L + 1 where the embedding is vocab-parallel, transformers >= 5.18)
    and every one fuses."""
    if GPUS < 2:
        pytest.skip(f"needs 2 NVIDIA GPUs, found {GPUS}")
    done = torchrun(2, "examples/compile_hf_model.py", "--backend", "flashinfer", "--model-type", model_type,
                    "--layers", "2", "--steps", "4")
    assert done.returncode == 0, done.stdout[-5000:]
    summary = json.loads(next(line for line in reversed(done.stdout.splitlines()) if line.startswith("{")))
    print("SUMMARY", json.dumps(summary))
    assert summary["fused_sites"] in (4, 5) and summary["unfused_sites"] == 0, summary
    assert summary["dispatch"].get("flashinfer", 0) > 0 and summary["dispatch"].get("fallback", 0) == 0, summary
    assert summary["max_rel_diff"] < 5e-2, summary


@pytest.mark.parametrize("world", [2, 4])
def test_first_fused_call_inside_reduce_overhead(world):
    if GPUS < world:
        pytest.skip(f"needs {world} NVIDIA GPUs, found {GPUS}")
    done = torchrun(world, "tests/gpu/check_first_call_in_cudagraphs.py", timeout=300)
    assert done.returncode == 0, done.stdout[-5000:]
    assert "FIRST CALL IN CUDAGRAPHS world=" in done.stdout and "0 failed on the worst rank" in done.stdout, \
        done.stdout[-3000:]
