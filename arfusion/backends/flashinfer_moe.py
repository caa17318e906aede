"""FlashInfer's MoE finalize kernel for `arfusion::moe_combine_allreduce_rmsnorm`: the top-k combine,
all-reduce, residual add and RMSNorm in one kernel (`trtllm_moe_finalize_allreduce_fusion`), on
workspaces of its own. Mixed into `FlashInferBackend`."""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import runtime
from ..decisions import Reason, Why
from ..core import Call, flatten_tokens
from ..runtime import outside_graph_pools
from . import flashinfer_dispatch as dispatch

log = logging.getLogger("arfusion")


@dataclass
class FinalizeWorkspaces:
    """The MoE finalize kernel's own workspaces: two, taken in turn, one call each.

    FlashInfer's finalize kernel (0.7.2.post1, trtllm_moe_allreduce_fusion.cuh) reads each peer's
    values from *that peer's* Lamport buffer, and every one-shot kernel re-arms its own buffer's
    region of the previous call at its next call on the same workspace. On a shared workspace a
    rank that finished could re-arm what a slower peer is still reading (both then wait forever:
    seen on two H200s and with two ranks on one H100). Here the next call on a workspace is always
    two finalize calls later, and the call in between (on the other one) cannot finish on any rank
    before every peer has finished the first: so nothing a peer still reads is re-armed. The plain
    kernel keeps the group's ordinary workspace and never touches these.

    Not closed by this alone: a CUDA graph replayed back to back whose only collectives on the
    group are an odd number of finalize calls (replay k ends on the workspace replay k+1 starts
    on). So the pass fuses the combine only into graphs with another collective on the group
    (`Capabilities.moe_combine_needs_other_collective`); in a decoder, the attention all-reduce."""

    pair: list
    capacity_elems: int  # input elements per rank each workspace holds
    calls: int = 0

    def next(self):
        workspace = self.pair[self.calls % 2]
        self.calls += 1
        return workspace


class MoEFinalize:
    """The MoE half of the FlashInfer backend (needs its `facts`, `_groups`, `_new_workspace`)."""

    def moe_combine_why_not(self, call: Call, top_k: int, rows: int | None) -> Reason | None:
        """`trtllm_moe_finalize_allreduce_fusion` where the dispatch table says it pays (decode
        sizes); `why_not(call)` has already accepted the site itself."""
        if call.form.quant != "none":
            return Reason(Why.QUANT_FORM, "the MoE finalize kernel is used for unquantized sites only")
        if rows is not None and rows >= 2 ** 31:
            return Reason(Why.SHAPE, "more permuted rows than an int32 index addresses")
        sm = self.facts(call).sm[0]
        return dispatch.moe_finalize_problem(sm, call.world_size, call.tokens)

    def prepare_moe_combine(self, call: Call) -> Reason | None:
        reason = self._finalize_workspaces(call)
        return Reason(Why.RUNTIME, reason) if reason else None

    def _finalize_workspaces(self, call: Call) -> str | None:
        """The finalize kernel's two workspaces (`FinalizeWorkspaces`), sized for the dispatch
        table's token cap (after `prepare`, which made the ordinary one): made like the ordinary
        one (collectively, outside graph pools, never during capture); a failure leaves the
        combine to torch, not the whole group unfused."""
        state = self._groups.current(call.group_name)
        if state.finalize_failed:
            return state.finalize_failed
        have = state.finalize
        if have is not None and call.tokens * call.hidden <= have.capacity_elems:
            return None
        if runtime.capturing():
            return ("no MoE finalize workspaces yet and workspaces are never created during CUDA-graph "
                    "capture: run the model once eagerly first")
        # The table's cap, within what the ordinary workspace holds (a forced cap, as the GPU check
        # sets, is not a size to allocate), and never below this call.
        sm = self.facts(call).sm[0]
        cap = dispatch.MOE_FINALIZE_MAX_TOKENS.get((sm, call.world_size), 0)
        max_tokens = max(call.tokens, min(cap, state.capacity_elems // call.hidden))
        pair = []
        for _ in range(2):
            workspace, error = outside_graph_pools(call.device, lambda: self._new_workspace(call, max_tokens))
            if error:
                for made in pair:
                    made.destroy()
                state.finalize_failed = f"MoE finalize workspaces: {error}"
                return state.finalize_failed
            pair.append(workspace)
        if have is not None:
            state.retired.extend(have.pair)
        state.finalize = FinalizeWorkspaces(pair, max_tokens * call.hidden)
        log.info("arfusion: FlashInfer MoE finalize workspaces for group %s (world %d): 2 x %d tokens x %d",
                 call.group_name, call.world_size, max_tokens, call.hidden)
        return None

    def run_moe_combine(self, call, rows, scale, index, top_k, scale_first, residual, weight, eps, quant_scale,
                        shared=None, routed_scale=1.0, input_scale=1.0):
        """FlashInfer's MoE finalize: out[t] = sum_k scale[t, k] * rows[index[t, k]] (+ shared[t], its
        `shared_expert_output`, added in the activation dtype before the reduction), all-reduced,
        + residual, RMSNorm, in one kernel.
        On the group's finalize workspaces, taken in turn (`FinalizeWorkspaces`).
        index goes in as int32 [T, K]; the weights as [T, K] in the activation dtype (a per-row
        scale is gathered to token order first; fp32 router weights are rounded: the kernel's
        scale type is the activation type, and so is its accumulator). The kernel's one number,
        `routed_scaling_factor`, multiplies the routed sum before `shared` is added: it takes
        routed_scale * input_scale, and `shared` is multiplied by input_scale, since
        AR(routed * a + shared) * b = AR(routed * (a * b) + shared * b)."""
        finalize = importlib.import_module("flashinfer.comm.trtllm_ar").trtllm_moe_finalize_allreduce_fusion
        state = self._groups[call.group_name]
        tokens, hidden = call.tokens, call.hidden
        flat_scale = scale.reshape(-1)
        expert_scale = (flat_scale[index] if scale_first else flat_scale).reshape(tokens, top_k)
        expanded_to_permuted = index.reshape(tokens, top_k).to(torch.int32).contiguous()
        if residual is not None:
            residual_in = flatten_tokens(residual)
        elif call.dtype in state.zeros:
            residual_in = state.zeros[call.dtype][: tokens * hidden].view(tokens, hidden)
        else:  # first use of a residual-free site inside a capture: a memset in the graph
            residual_in = torch.zeros(tokens, hidden, dtype=call.dtype, device=rows.device)
        residual_out = torch.empty(tokens, hidden, dtype=call.dtype, device=rows.device)
        norm_out = torch.empty_like(residual_out)
        routed = float(routed_scale * input_scale)
        shared_in = shared if shared is None or input_scale == 1.0 else shared * input_scale
        group = dist.distributed_c10d._resolve_process_group(call.group_name)
        finalize(
            allreduce_in=flatten_tokens(rows), residual_in=residual_in, norm_weight=weight.contiguous(),
            expanded_idx_to_permuted_idx=expanded_to_permuted, norm_out=norm_out, residual_out=residual_out,
            quant_out=None, scale_out=None, workspace_ptrs=state.finalize.next().workspace_tensor,
            launch_with_pdl=self.launch_with_pdl, world_rank=group.rank(), world_size=group.size(),
            eps=float(eps), shared_expert_output=None if shared is None else flatten_tokens(shared_in).contiguous(),
            expert_scale_factor=expert_scale.to(call.dtype).contiguous(),
            routed_scaling_factor=None if routed == 1.0 else routed,
            weight_bias=1.0 if call.form.norm == "gemma_rms" else None)
        produced = {"residual": residual_out, "norm": norm_out}
        return [produced[name] for name in call.form.outputs()]
