"""One call of FlashInfer's all-reduce fusion kernel (flashinfer-python 0.7.2.post1) on a workspace.

`flashinfer.comm.trtllm_allreduce_fusion`, called directly without its deprecation wrapper. The
unified `allreduce_fusion` calls it on every call after checks for other backends' workspaces
and an allocation of an all-reduce output that the fused patterns never write
(trtllm_allreduce_fusion.cuh: kHasAllReduceOut is kAllReduce's only); with the wrapper's warning
that is ~28 us of host time a call on an H200 host (benchmarks/probes/probe_site_host_cost.py),
paid by every site of a step that is not a CUDA-graph replay. vLLM calls it directly too. It
still checks the call against the workspace's metadata (size, world, dtype). Where a FlashInfer
lacks it, the unified API runs instead.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from typing import Any

import torch

# The kernel's arguments that name one call's tensors and values, as `trtllm_allreduce_fusion`
# takes them; the unified `allreduce_fusion` names allreduce_out "output".
KERNEL_ARGS = ("allreduce_out", "residual_in", "residual_out", "norm_out", "quant_out", "scale_out", "rms_gamma",
               "rms_eps", "scale_factor", "layout_code", "weight_bias")


def comm_module():
    """`flashinfer.comm`, from sys.modules once imported (import_module's own lookup costs more)."""
    return sys.modules.get("flashinfer.comm") or importlib.import_module("flashinfer.comm")


@functools.lru_cache(maxsize=4)
def kernel_call(fic) -> Any:
    """`fic.trtllm_allreduce_fusion` without its deprecation wrapper, or None where it is missing."""
    entry = getattr(fic, "trtllm_allreduce_fusion", None)
    return None if entry is None else inspect.unwrap(entry)


def launch(fic, workspace, x2: torch.Tensor, pattern, tensors: dict, **knobs) -> None:
    """The kernel for `pattern` on `workspace` (a trtllm one): x2 a dense [T, H]; `tensors` named
    as KERNEL_ARGS (the rest None), each dense, since the kernel reads data pointers only;
    `knobs` launch_with_pdl, trigger_completion_at_end, fp32_acc and use_oneshot."""
    call = kernel_call(fic)
    if call is None:
        output = tensors.pop("allreduce_out", None)
        fic.allreduce_fusion(input=x2, workspace=workspace, pattern=pattern, output=output, **knobs, **tensors)
        return
    call(allreduce_in=x2, world_size=workspace.world_size, world_rank=workspace.rank, token_num=x2.shape[0],
         hidden_dim=x2.shape[1], workspace_ptrs=workspace.workspace_tensor, pattern_code=pattern,
         metadata=workspace.metadata, **knobs, **{name: tensors.get(name) for name in KERNEL_ARGS})
