"""One call of FlashInfer's all-reduce fusion kernel (flashinfer-python 0.7.2.post1) on a workspace.

`flashinfer.comm.trtllm_allreduce_fusion`, called directly without its deprecation wrapper. The
unified `allreduce_fusion` calls it on every call after checks for other backends' workspaces
and an allocation of an all-reduce output that the fused patterns never write
(trtllm_allreduce_fusion.cuh: kHasAllReduceOut is kAllReduce's only); with the wrapper's warning
that is ~28 us of host time a call on an H200 host (benchmarks/probes/probe_site_host_cost.py),
paid by every site of a step that is not a CUDA-graph replay. vLLM calls it directly too. It
still checks the call against the workspace's metadata (size, world, dtype). Where a FlashInfer
lacks it, the unified API runs instead.

`bound` fixes everything but the tensors for later calls of one signature (a site's op cost ~100 us
of host time in a default-mode compile on an H200 host before it; benchmarks/probes/probe_generate_ops.py).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from typing import Any, Callable

import torch

# The kernel's arguments that name one call's tensors and values, as `trtllm_allreduce_fusion`
# takes them; the unified `allreduce_fusion` names allreduce_out "output".
KERNEL_ARGS = ("allreduce_out", "residual_in", "residual_out", "norm_out", "quant_out", "scale_out", "rms_gamma",
               "rms_eps", "scale_factor", "layout_code", "weight_bias")
NVFP4_LINEAR_LAYOUT = 2  # layout_code: block scales row-major [T, H/16], as the reference and torchao's unswizzled quantizer


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


def bound(fic, state, pattern, tokens: int, hidden: int, residual_zeros: torch.Tensor | None = None,
          **fixed) -> Callable[..., Any] | None:
    """The kernel for `pattern` (kAllReduce, or kARResidualRMSNorm: no quantization) bound to
    `state.workspace` as it is now, for calls of `tokens` x `hidden`: fn(x) -> the sum (kAllReduce)
    or fn(x, residual, weight, eps) -> [residual, norm], each in x's shape, or None once
    `state.workspace` is another (grown, or freed by close()). `fixed`: the knobs (and
    weight_bias); `residual_zeros` stands in for a site's missing residual. Bound after a call of
    the signature ran through `launch`, whose metadata check it skips; None where only the unified
    API exists. The kernel reads data pointers only: any dense shape of tokens x hidden will do."""
    call, workspace = kernel_call(fic), state.workspace
    if call is None or workspace is None:
        return None
    fixed.update(world_size=workspace.world_size, world_rank=workspace.rank, token_num=tokens, hidden_dim=hidden,
                 workspace_ptrs=workspace.workspace_tensor, pattern_code=pattern, metadata=None, quant_out=None,
                 scale_out=None, scale_factor=None, layout_code=None)
    if pattern == fic.AllReduceFusionPattern.kAllReduce:
        fixed.update({name: None for name in KERNEL_ARGS if name not in fixed and name != "allreduce_out"})

        def all_reduce(x: torch.Tensor):
            if state.workspace is not workspace:
                return None
            x = x.contiguous()
            out = torch.empty_like(x)
            call(allreduce_in=x, allreduce_out=out, **fixed)
            return out

        return all_reduce

    def run(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
        if state.workspace is not workspace:
            return None
        x = x.contiguous()
        residual_out, norm_out = torch.empty_like(x), torch.empty_like(x)
        call(allreduce_in=x, allreduce_out=None, residual_in=residual_zeros if residual is None else residual.contiguous(),
             residual_out=residual_out, norm_out=norm_out, rms_gamma=weight.contiguous(), rms_eps=float(eps), **fixed)
        return [residual_out, norm_out]

    return run


def fp4_scale_factor(global_scale: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """FlashInfer's FP4 `scale_factor` from the site's global scale.

    The FP4 kernel multiplies by scale_factor (block SF = e4m3(scale_factor * amax / 6), values
    times scale_factor / SF), unlike the FP8 one, which inverts it. torchao's per-tensor scale
    is the dequantizing side (amax / (448 * 6)), so FlashInfer gets its reciprocal; no global
    scale means 1. A device tensor, so a captured graph follows updates to the scale."""
    if global_scale is None:
        return torch.ones(1, dtype=torch.float32, device=device)
    return torch.reciprocal(global_scale.to(device=device, dtype=torch.float32).reshape(1))
