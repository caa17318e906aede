"""GPU tests of the FlashInfer backend on one GPU per rank (NCCL): the op against the reference,
the first fused call inside CUDA graphs, and the HF example end to end. Skipped with the reason
where there are not enough NVIDIA GPUs or no FlashInfer (tests/gpu/conftest.py).

    python -m pytest tests/gpu -q        # on a machine with >= 2 NVIDIA GPUs and FlashInfer
"""

from __future__ import annotations

import json

import pytest

from gpu_launch import needs


def failed_checks(results: list[dict]) -> list[dict]:
    """The failed rows of a check_flashinfer-style result list (one row per check)."""
    assert results, "no checks recorded"
    return [r for r in results if not r["ok"]]


@pytest.mark.parametrize("world", [pytest.param(2, marks=needs(gpus=2)), pytest.param(4, marks=needs(gpus=4))])
def test_fused_op_matches_reference_on_gpus(world, launch):
    """check_flashinfer.py (device_run.sh checks2 / checks4)."""
    done = launch("tests/gpu/check_flashinfer.py", nproc=world, timeout=600)
    assert done.returncode == 0, done.tail()
    assert not failed_checks(done.json(f"gpu_checks_w{world}.json"))


def summary_of(done) -> dict:
    return json.loads(next(line for line in reversed(done.output.splitlines()) if line.startswith("{")))


@needs(gpus=2, modules=("transformers",))
def test_hf_example_runs_fused_on_two_gpus(launch):
    """examples/compile_hf_model.py at TP=2 (device_run.sh hf2)."""
    done = launch("examples/compile_hf_model.py", "--backend", "flashinfer", nproc=2, timeout=300)
    assert done.returncode == 0, done.tail()
    summary = summary_of(done)
    assert summary["fused_sites"] > 0 and summary["dispatch"].get("flashinfer", 0) > 0, summary
    assert summary["dispatch"].get("fallback", 0) == 0, summary
    assert summary["max_rel_diff"] < 5e-2, summary


@needs(gpus=2, modules=("transformers",))
@pytest.mark.parametrize("model_type", ["mixtral", "olmo2"])
def test_hf_example_fuses_every_site_by_meaning(model_type, launch):
    """Shapes the literal matcher missed (MoE view before the add, weight in fp32), 2 layers: every
    all-reduce is a site (2L, or 2L + 1 where the embedding is vocab-parallel, transformers >= 5.18)
    and every one fuses (device_run.sh meaning2)."""
    done = launch("examples/compile_hf_model.py", "--backend", "flashinfer", "--model-type", model_type,
                  "--layers", "2", "--steps", "4", nproc=2, timeout=400)
    assert done.returncode == 0, done.tail()
    summary = summary_of(done)
    print("SUMMARY", json.dumps(summary))
    assert summary["fused_sites"] in (4, 5) and summary["unfused_sites"] == 0, summary
    assert summary["dispatch"].get("flashinfer", 0) > 0 and summary["dispatch"].get("fallback", 0) == 0, summary
    assert summary["max_rel_diff"] < 5e-2, summary


@pytest.mark.parametrize("world", [pytest.param(2, marks=needs(gpus=2)), pytest.param(4, marks=needs(gpus=4))])
def test_first_fused_call_inside_reduce_overhead(world, launch):
    """check_first_call_in_cudagraphs.py (device_run.sh first2 / first4)."""
    done = launch("tests/gpu/check_first_call_in_cudagraphs.py", nproc=world, timeout=300)
    assert done.returncode == 0, done.tail()
    assert "FIRST CALL IN CUDAGRAPHS world=" in done.output and "0 failed on the worst rank" in done.output, \
        done.tail(3000)
    assert not failed_checks(done.json(f"gpu_first_call_w{world}.json"))
