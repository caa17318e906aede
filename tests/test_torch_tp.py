"""torch-native tensor parallelism (parallelize_module, DTensor, torchtitan's plans) with
torch.nn.RMSNorm / F.rms_norm: every all-reduce -> [add] -> norm site fuses; with sequence
parallelism (reduce-scatter + all-gather) nothing fuses, the output is unchanged and the log
says why. gloo, 2 ranks, CPU. The model is the one examples/compile_torch_tp.py builds."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .helpers import assert_close, compiled_vs_eager, run_workers

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "compile_torch_tp.py"
LAYERS, HIDDEN, TOKENS = 1, 64, 8
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def _example():
    spec = importlib.util.spec_from_file_location("compile_torch_tp", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model_and_ids(dtype, norm, sequence_parallel):
    """The example's decoder, parallelized with its plan on a 1-D mesh over the world."""
    from torch.distributed.device_mesh import init_device_mesh

    ex = _example()
    args = argparse.Namespace(layers=LAYERS, hidden=HIDDEN, vocab=128, dtype=DTYPE_NAMES[dtype], norm=norm,
                              sequence_parallel=sequence_parallel)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    model = ex.build(args, mesh, torch.device("cpu"))  # same weights on every rank (seeded)
    torch.manual_seed(1)  # the same token ids on every rank, as a TP model expects
    ids = torch.randint(0, args.vocab, (1, TOKENS))
    return model, ids, ex.row_parallel_sites(args)


def _fuses_every_site(rank, dtype, norm):
    model, ids, sites = _model_and_ids(dtype, norm, sequence_parallel=False)
    assert sites == 2 * LAYERS + 1  # embedding (vocab-parallel) + o_proj and down_proj of each layer
    actual, expected, stats = compiled_vs_eager(model, (ids,))
    assert stats["fused_sites"] == sites, stats
    assert stats["dispatch"] == {"torch": sites}, stats
    assert_close(actual, expected, dtype, f"logits ({norm}, {dtype})")


def _sequence_parallel_left_alone(rank):
    import arfusion  # noqa: F401  (the logger below is arfusion's)

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("arfusion")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    model, ids, sites = _model_and_ids(torch.bfloat16, "rmsnorm", sequence_parallel=True)
    assert sites == 0
    actual, expected, stats = compiled_vs_eager(model, (ids,))
    assert stats["fused_sites"] == 0 and stats["dispatch"] == {}, stats
    assert_close(actual, expected, torch.bfloat16, "logits (sequence parallel)")
    assert any("sequence parallel" in m.lower() for m in messages), messages


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_nn_rmsnorm_under_parallelize_module_fuses_every_site(dtype):
    run_workers(_fuses_every_site, 2, dtype, "rmsnorm")


def test_functional_rms_norm_fuses_every_site():
    run_workers(_fuses_every_site, 2, torch.bfloat16, "functional")


def test_sequence_parallel_is_left_unfused_and_logged():
    run_workers(_sequence_parallel_left_alone, 2)


@pytest.mark.parametrize("experts", [0, 4])
def test_example_script_via_torchrun(experts):
    """With --experts, each expert's output is all-reduced by DTensor (4 per layer): the pass makes
    them one all-reduce of the gated sum, which then fuses like the MLP's."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(EXAMPLE), "--layers", str(LAYERS), "--hidden", str(HIDDEN), "--backend", "torch",
           "--experts", str(experts)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    sites = 2 * LAYERS + 1
    assert result["sites"] == sites and result["fused_sites"] == sites, result
    assert result["dispatch"] == {"torch": sites}, result
    assert result["all_reduces_merged"] == LAYERS * max(experts - 1, 0), result
    assert result["max_rel_diff"] < 2e-2, result  # bf16 noise
