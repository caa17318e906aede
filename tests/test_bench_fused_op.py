"""benchmarks/bench_fused_op.py's --codec-knobs: the grid of FlashInfer's quantized all-reduce
launch knobs it times (the timing itself needs GPUs), and how its result reads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import bench_fused_op  # noqa: E402
import matrix  # noqa: E402
from fused_op_cases import knob_grid  # noqa: E402
from arfusion.backends.flashinfer_dispatch import CODEC_KNOBS  # noqa: E402
from fused_op_report import format_codec_table  # noqa: E402

sys.path.remove(str(BENCH))

# flashinfer.comm.quantized_allreduce._select_params (0.7.2.post1, 0.7.4) above 1 MiB and below 32 MiB of
# bf16 per rank (48 blocks up to 1 MiB, P2P phase 3 from 32 MiB)
FLASHINFER_OWN = {"block_size": 4096, "max_num_blocks": 132, "num_warps": 16, "p2p_phase3": False}


def test_the_whole_grid_holds_flashinfers_own_choice_once():
    grid = knob_grid([])
    assert len(grid) == 24 and len({tuple(k.items()) for k in grid}) == 24
    assert FLASHINFER_OWN in grid
    assert set(grid[0]) == set(CODEC_KNOBS)


def test_a_listed_knob_narrows_the_grid_and_a_wrong_one_is_refused():
    grid = knob_grid(["block_size=8192", "p2p_phase3=1"])
    assert len(grid) == 4 and all(k["block_size"] == 8192 and k["p2p_phase3"] is True for k in grid)
    for bad in ("scale_group=512", "block_size", "warps=8"):  # the scale group changes the numbers: not a knob
        with pytest.raises(SystemExit, match="--codec-knobs"):
            knob_grid([bad])


def test_the_matrix_stage_asks_for_the_whole_grid():
    stage = matrix.STAGES["quantizedknobs2"]
    args = bench_fused_op.parse_args(stage.args.split())
    assert args.quantized == "fp8" and args.mib == [4, 8, 16] and args.codec_knobs == []
    assert knob_grid(args.codec_knobs) == knob_grid([])
    assert bench_fused_op.parse_args(["--quantized", "fp8"]).codec_knobs is None  # no sweep unless asked


def test_the_table_names_the_fastest_knobs_and_the_exact_path_against_them():
    faster = {**FLASHINFER_OWN, "p2p_phase3": True}
    row = {"mib": 8, "tokens": 1024, "a0_us": 55.1, "c_us": 42.1, "fi_q_us": 35.6, "exact_path": "fused one-shot",
           "knobs": [{"knobs": FLASHINFER_OWN, "fi_q_us": 35.6}, {"knobs": faster, "fi_q_us": 31.0}],
           "knobs_best_us": 31.0, "knobs_best": faster, "ex_vs_knobs_best": 42.1 / 31.0}
    last = format_codec_table([row]).splitlines()[-1]
    assert "35.6 us with its own knobs, 31.0 us at best of 2" in last and "p2p_phase3=True" in last
    assert last.endswith("1.358x")
