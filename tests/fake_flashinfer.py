"""A stand-in for FlashInfer's all-reduce fusion API, for CPU tests (no GPU, no FlashInfer).

`install_fake_flashinfer()` registers `flashinfer`, `flashinfer.comm`, `flashinfer.comm.trtllm_ar`
and `flashinfer.comm.mnnvl` in sys.modules with the calls arfusion makes: the workspace
(`create_allreduce_fusion_workspace`, whose handle exchange runs over the group as the real one's
does), `allreduce_fusion` for the pattern codes arfusion may pass (computed with arfusion's
reference math over the group's real all-reduce, gloo on CPU), `trtllm_allreduce_fusion` (the
kernel call under it, behind a deprecation wrapper, as in 0.7.2.post1), and the JIT module build.
It returns the call log ("direct" counts kernel calls that skipped the unified API), which also
injects failures. `remove_fake_flashinfer()` takes it out again.
`H200` and `B200` are the device facts of a pretend SM90 and SM100 GPU.

Used by tests/test_flashinfer_backend.py, tests/fault_cases.py and tests/test_moe_combine.py.
Nothing here says anything about FlashInfer's kernels.
"""

from __future__ import annotations

import functools
import importlib.machinery
import os
import sys
import types
import warnings

import torch
import torch.distributed as dist

from arfusion import quant, reference
from arfusion.backends import flashinfer as fi

H200 = fi.DeviceFacts((9, 0), "NVIDIA H200", "GPU-fake-0")
B200 = fi.DeviceFacts((10, 0), "NVIDIA B200", "GPU-fake-0")


class FlashInferDeprecation(DeprecationWarning):
    """The warning of the stand-in's deprecated entry point (a class of its own, so tests can
    count it among torch's)."""


class FakeWorkspace:
    def __init__(self, world_size, rank, max_token_num, hidden_dim, dtype, group):
        self.world_size, self.rank, self.group = world_size, rank, group
        self.max_token_num, self.hidden_dim, self.dtype = max_token_num, hidden_dim, dtype
        self.destroyed = False
        self.pointers = torch.zeros(3, dtype=torch.int64)  # the real one: the peers' buffer addresses
        self.metadata = {"max_token_num": max_token_num, "tp_size": world_size, "hidden_dim": hidden_dim,
                         "use_fp32_lamport": dtype == torch.float32}

    @property
    def workspace_tensor(self):
        return self.pointers

    def is_buffer_size_sufficient(self, tp_size, num_tokens, hidden_dim, dtype):
        return (tp_size == self.world_size and num_tokens * hidden_dim <= self.max_token_num * self.hidden_dim
                and (dtype == torch.float32) == (self.dtype == torch.float32))

    def destroy(self):
        self.destroyed = True


def install_fake_flashinfer():
    """Register `flashinfer`, `flashinfer.comm`, `flashinfer.comm.trtllm_ar`; return the call log
    (its "fail_build" / "fail_create" entries inject failures)."""
    calls = {"create": [], "fusion": [], "build": 0, "direct": 0, "unchecked": 0, "fail_build": False,
             "fail_create": False}
    workspaces = {}  # id of a workspace's metadata -> the workspace

    def module(name):
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = m
        return m

    root, comm, trtllm = module("flashinfer"), module("flashinfer.comm"), module("flashinfer.comm.trtllm_ar")
    mnnvl = module("flashinfer.comm.mnnvl")
    root.comm, comm.trtllm_ar, comm.mnnvl = comm, trtllm, mnnvl

    class TorchDistBackend:  # FlashInfer's handle-exchange backend: object collectives over the group
        def __init__(self, group=None):
            self._group = group

        def allgather(self, data):
            out = [None] * dist.get_world_size(self._group)
            dist.all_gather_object(out, data, group=self._group)
            return out

        def bcast(self, data, root):
            box = [data]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self._group, root), group=self._group)
            return box[0]

        def barrier(self):
            dist.barrier(group=self._group)

    mnnvl.TorchDistBackend = TorchDistBackend

    def get_trtllm_comm_module():
        calls["build"] += 1
        if calls["fail_build"]:
            raise RuntimeError("nvcc exploded")
        return object()

    def create_allreduce_fusion_workspace(**kw):
        calls["create"].append({**{k: (v.group_name if k == "group" else v) for k, v in kw.items()},
                                "symm_mem_multicast_off": os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST")})
        if calls["fail_create"]:
            raise RuntimeError("cuMemCreate failed")
        # As the real one: the buffers' handles are exchanged over the group (the peers of a rank
        # that failed above wait here).
        (kw.get("comm_backend") or TorchDistBackend(kw["group"])).allgather(("handle", kw["rank"]))
        workspace = FakeWorkspace(kw["world_size"], kw["rank"], kw["max_token_num"], kw["hidden_dim"],
                                  kw["dtype"], kw["group"])
        workspaces[id(workspace.metadata)] = workspace
        return workspace

    def allreduce_fusion(*, input, workspace, pattern, use_oneshot, fp32_acc, launch_with_pdl,
                         trigger_completion_at_end, residual_in=None, residual_out=None, norm_out=None,
                         rms_gamma=None, rms_eps=1e-6, weight_bias=0.0, quant_out=None, scale_out=None,
                         scale_factor=None, output=None, **rest):
        if input.shape[0] == 0:  # the launcher's grid is sized by the tokens: a grid of 0 does not launch
            raise RuntimeError("CUDA error: invalid configuration argument (a kernel grid of 0 blocks)")
        if pattern == 0:  # kAllReduce: writes `output` only, reads nothing else
            calls["fusion"].append(dict(pattern=0, use_oneshot=use_oneshot, fp32_acc=fp32_acc, tokens=input.shape[0],
                                        trigger_at_end=trigger_completion_at_end, output=output is not None,
                                        residual_in=residual_in is not None, rms_gamma=rms_gamma is not None))
            assert input.dim() == 2 and input.is_contiguous() and output.shape == input.shape
            assert isinstance(use_oneshot, bool) and (use_oneshot or input.shape[0] > workspace.world_size)
            assert workspace.is_buffer_size_sufficient(workspace.world_size, *input.shape, input.dtype)
            summed = input.float()
            dist.all_reduce(summed, group=workspace.group)
            output.copy_(summed.to(input.dtype))
            return output
        calls["fusion"].append(dict(pattern=pattern, use_oneshot=use_oneshot, fp32_acc=fp32_acc,
                                    weight_bias=weight_bias, rms_eps=rms_eps, pdl=launch_with_pdl,
                                    trigger_at_end=trigger_completion_at_end, tokens=input.shape[0],
                                    residual_all_zero=bool((residual_in == 0).all()),
                                    norm_out=norm_out is not None, quant_out=quant_out is not None,
                                    scale_out=None if scale_out is None else (list(scale_out.shape), str(scale_out.dtype)),
                                    scale_factor=None if scale_factor is None else dict(
                                        type=type(scale_factor).__name__, dtype=str(scale_factor.dtype),
                                        shape=list(scale_factor.shape), device=str(scale_factor.device),
                                        same_device=scale_factor.device == input.device,
                                        value=float(scale_factor.flatten()[0])), **rest))
        assert input.dim() == 2 and input.is_contiguous() and residual_in is not None
        assert isinstance(use_oneshot, bool) and (use_oneshot or input.shape[0] > workspace.world_size)
        assert workspace.is_buffer_size_sufficient(workspace.world_size, *input.shape, input.dtype)
        assert rms_gamma.dtype == input.dtype
        # What each pattern reads and writes (read in FlashInfer 0.7.2.post1's
        # csrc/trtllm_allreduce_fusion.cu; the table in docs/flashinfer.md, "What is fused").
        writes_norm, quant_kind = FAKE_PATTERNS[pattern]
        assert (norm_out is not None) == writes_norm
        assert (quant_out is not None) == (quant_kind is not None)
        assert (scale_factor is not None) == (quant_kind in ("static", "nvfp4"))
        assert (scale_out is not None) == (quant_kind in ("dynamic", "nvfp4"))
        assert (rest.get("layout_code") is not None) == (quant_kind == "nvfp4")
        summed = input.float()
        dist.all_reduce(summed, group=workspace.group)
        h = (summed + residual_in.float()).to(input.dtype)
        residual_out.copy_(h)
        normed = (reference.rms_normalize(h, rms_eps) * (rms_gamma.float() + weight_bias)).to(input.dtype)
        if norm_out is not None:
            norm_out.copy_(normed)
        if quant_kind == "static":
            assert quant_out.dtype == torch.float8_e4m3fn and quant_out.shape == input.shape
            quant_out.copy_((normed.float() * (1 / scale_factor)).clamp(-448, 448).to(torch.float8_e4m3fn))
        elif quant_kind == "dynamic":
            assert quant_out.dtype == torch.float8_e4m3fn and scale_out.dtype == torch.float32
            assert scale_out.shape == (input.shape[0], 1) and scale_out.is_contiguous()
            scale = torch.maximum(normed.float().abs().amax(-1, keepdim=True) / 448,
                                  torch.tensor(1 / (512 * 448)))
            scale_out.copy_(scale)
            quant_out.copy_((normed.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn))
        elif quant_kind == "nvfp4":
            fake_fp4_kernel(normed, quant_out, scale_out, scale_factor, rest["layout_code"])
        return norm_out if norm_out is not None else quant_out

    def kernel_call(*, allreduce_in, world_size, world_rank, token_num, hidden_dim, workspace_ptrs,
                    launch_with_pdl, use_oneshot, trigger_completion_at_end, fp32_acc, pattern_code,
                    allreduce_out, residual_in, residual_out, norm_out, quant_out, scale_out, rms_gamma, rms_eps,
                    scale_factor, layout_code, metadata=None, block_quant_group_size=None, weight_bias=None):
        """0.7.2.post1's signature (every argument by name, as arfusion passes them); checked
        against the workspace the pointers (and metadata, where given) came from, then the unified
        fake. As the kernel, which reads data pointers only: tensors of token_num x hidden_dim
        elements in any dense shape."""
        if metadata is None:  # FlashInfer checks nothing then; the kernel reads the pointers
            calls["unchecked"] += 1
            workspace = next(w for w in workspaces.values() if w.workspace_tensor is workspace_ptrs
                             or not isinstance(workspace_ptrs, torch.Tensor) and w.workspace_tensor == workspace_ptrs)
        else:
            workspace = workspaces[id(metadata)]
            # As check_trtllm_allreduce_fusion_workspace_metadata (0.7.2.post1 and 0.7.4): capacity
            # in elements, and the Lamport buffers' dtype.
            assert metadata["tp_size"] == world_size
            assert token_num * hidden_dim <= metadata["max_token_num"] * metadata["hidden_dim"]
            assert metadata["use_fp32_lamport"] == (allreduce_in.dtype == torch.float32)
        assert not workspace.destroyed, "a kernel call on a destroyed workspace"
        assert (world_size, world_rank) == (workspace.world_size, workspace.rank)
        assert workspace_ptrs is workspace.workspace_tensor or workspace_ptrs == workspace.workspace_tensor
        assert allreduce_in.numel() == token_num * hidden_dim and allreduce_in.is_contiguous()

        def rows(t):  # [token_num, hidden_dim] over the same memory, as the kernel sees it
            return t.view(token_num, hidden_dim) if t is not None and t.numel() == token_num * hidden_dim else t

        allreduce_in, allreduce_out, residual_in, residual_out, norm_out = (
            rows(t) for t in (allreduce_in, allreduce_out, residual_in, residual_out, norm_out))
        calls["direct"] += 1
        return allreduce_fusion(input=allreduce_in, workspace=workspace, pattern=pattern_code, use_oneshot=use_oneshot,
                                fp32_acc=fp32_acc, launch_with_pdl=launch_with_pdl,
                                trigger_completion_at_end=trigger_completion_at_end, residual_in=residual_in,
                                residual_out=residual_out, norm_out=norm_out, rms_gamma=rms_gamma, rms_eps=rms_eps,
                                weight_bias=0.0 if weight_bias is None else weight_bias, quant_out=quant_out,
                                scale_out=scale_out, scale_factor=scale_factor, output=allreduce_out,
                                layout_code=layout_code)

    @functools.wraps(kernel_call)  # as FlashInfer's @deprecated: a warning, then the call
    def trtllm_allreduce_fusion(*args, **kwargs):
        warnings.warn("use the unified API allreduce.py instead. It will internally call trtllm_allreduce_fusion.",
                      FlashInferDeprecation, stacklevel=2)
        return kernel_call(*args, **kwargs)

    comm.AllReduceFusionPattern = types.SimpleNamespace(
        kAllReduce=0, kARResidualRMSNorm=1, kARResidualRMSNormFP8Quant=2, kARResidualRMSNormFP4Quant=3,
        kARResidualRMSNormOutFP8Quant=4, kARResidualRMSNormOutFP4Quant=5,
        kARResidualRMSNormPerTokenGroupFP8PackedQuant=8, kARResidualRMSNormOutPerTokenGroupFP8PackedQuant=9,
        kARResidualRMSNormDynamicFP8Quant=10, kARResidualRMSNormOutDynamicFP8Quant=11)
    comm.create_allreduce_fusion_workspace = create_allreduce_fusion_workspace
    comm.allreduce_fusion = allreduce_fusion
    comm.trtllm_allreduce_fusion = trtllm_allreduce_fusion
    trtllm.get_trtllm_comm_module = get_trtllm_comm_module
    return calls


def fake_fp4_kernel(normed, quant_out, scale_out, scale_factor, layout_code):
    """Codes 3/5 as trtllm_allreduce_fusion.cuh (0.7.2.post1) computes them on SM100: the block
    SF is e4m3(scale_factor * amax / 6) and values are scaled by scale_factor / SF, i.e.
    scale_factor is the *quantizing* global scale (the FP8 codes invert theirs instead).
    LINEAR layout (2): SF row-major [T, H/16], one byte each."""
    tokens, hidden = normed.shape
    assert layout_code == 2
    assert quant_out.dtype == torch.uint8 and tuple(quant_out.shape) == (tokens, hidden // 2)
    assert scale_out.dtype == torch.float8_e4m3fn and tuple(scale_out.shape) == (tokens, hidden // 16)
    assert scale_factor.dtype == torch.float32 and scale_factor.numel() == 1
    blocks = normed.float().reshape(tokens, hidden // 16, 16)
    sf = (scale_factor * (blocks.abs().amax(-1) * (1 / 6))).to(torch.float8_e4m3fn)
    output_scale = torch.where(sf.float() != 0, scale_factor / sf.float(), torch.zeros(()))
    codes = quant.e2m1_codes((blocks * output_scale.unsqueeze(-1)).reshape(tokens, hidden))
    quant_out.copy_(quant.pack_nibbles(codes))
    scale_out.copy_(sf)


# pattern code -> (writes norm_out, quant kind) for the codes arfusion may call
FAKE_PATTERNS = {1: (True, None), 2: (False, "static"), 3: (False, "nvfp4"), 4: (True, "static"),
                 5: (True, "nvfp4"), 10: (False, "dynamic"), 11: (True, "dynamic")}


def remove_fake_flashinfer():
    for name in ("flashinfer.comm.trtllm_ar", "flashinfer.comm.mnnvl", "flashinfer.comm", "flashinfer"):
        sys.modules.pop(name, None)
