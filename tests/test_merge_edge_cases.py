"""Merges and moves across all-reduces that must not happen, on gloo ranks against eager.

Cases the edge-case review of 2026-12-08 found wrong (docs/patterns.md, section 0): a
column-parallel weight computed in the graph (an fp32 master weight cast to bf16, a dequant)
after a concatenation or stack of all-reduces was moved before the collective, so each rank's
shard was summed with the others'.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from .helpers import assert_close, compiled_vs_eager, run_workers

H = 64
BF = torch.bfloat16


class StackThenColumn(nn.Module):
    """Two row-parallel outputs, each all-reduced, then stacked or concatenated and projected by a
    column-parallel weight that the graph computes: each rank holds other columns, so the
    collective must stay before the GEMM. `spelling`: "cat" (features concatenated, a linear
    over them, a second sharded product added), "cat_dequant" (the same, the weight an int-like
    value times its scale) or "einsum" (the stack through `einsum("bseh,hk->bsek")`)."""

    def __init__(self, rank, spelling, world=2):
        super().__init__()
        self.spelling = spelling
        torch.manual_seed(0)
        w1, w2, w_lora = (torch.randn(H, H) / 8 for _ in range(3))
        w_col = torch.randn(H, 2 * H) / 8 if spelling != "einsum" else torch.randn(H, H) / 8
        shard = slice(rank * H // world, (rank + 1) * H // world)
        self.w1, self.w2 = (nn.Parameter(w[:, shard].to(BF).contiguous()) for w in (w1, w2))  # rows
        # fp32 master weight, this rank's columns ([H / world, 2H]; einsum: [H, H / world])
        self.w_col = nn.Parameter((w_col[shard] if spelling != "einsum" else w_col[:, shard]).contiguous())
        self.scale = nn.Parameter(torch.full((H // world, 1), 0.5, dtype=BF))
        self.w_lora = nn.Parameter(w_lora[shard].to(BF).contiguous())

    def forward(self, x_shard, other):
        outs = []
        for w in (self.w1, self.w2):
            y = x_shard @ w.t()
            dist.all_reduce(y)
            outs.append(y)
        if self.spelling == "einsum":
            stacked = torch.stack(outs, -2)  # [B, S, 2, H]
            return torch.einsum("bseh,hk->bsek", stacked, self.w_col.to(BF)) + other.unsqueeze(-2)
        w = self.w_col.to(BF) * self.scale if self.spelling == "cat_dequant" else self.w_col.to(BF)
        return torch.cat(outs, -1) @ w.t() + other @ self.w_lora.t()


def _column_after_stacked_all_reduces(rank, spelling):
    model = StackThenColumn(rank, spelling)
    torch.manual_seed(100 + rank)  # this rank's input shard
    x_shard = torch.randn(2, 3, H // 2, dtype=BF)
    torch.manual_seed(7)
    other = torch.randn(2, 3, H // 2 if spelling == "einsum" else H, dtype=BF)
    actual, expected, stats = compiled_vs_eager(model, (x_shard, other))
    assert stats["matmuls_moved_before_all_reduce"] == 0, (spelling, stats)
    assert_close(actual, expected, BF, spelling)


@pytest.mark.parametrize("spelling", ["cat", "cat_dequant", "einsum"])
@pytest.mark.multiproc
def test_a_computed_column_weight_stays_after_stacked_all_reduces(spelling):
    """The matmul move is for a dense MoE's weighted sum over its stacked experts (the contraction
    runs over the stack), never for a projection of the stacked values' features."""
    run_workers(_column_after_stacked_all_reduces, 2, spelling)
