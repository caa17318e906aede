"""Graph breaks in transformers' model code, removed for inference: the q/k-norm gradient hooks of
transformers <= 5.17 and LongCat-Flash's looped experts.

transformers is never imported here: these functions read the modules they are given.
"""

from __future__ import annotations

import logging
import types

import torch
import torch.nn.functional as F

log = logging.getLogger("arfusion")


# transformers <= 5.17 implements its `replicated_with_grad_allreduce` TP style (Qwen3's, Gemma 3's,
# ... per-head q_norm / k_norm) with a module-level full backward hook that all-reduces the norm's
# weight gradient. torch builds that hook's wrapper on every forward, under no_grad too, and Dynamo
# breaks the graph there: every layer compiles in pieces and no all-reduce meets its norm (nothing
# fuses). 5.23 uses parameter-level hooks, added only when grad is enabled, and compiles whole.
_GRAD_ALLREDUCE_HOOK = ("transformers.distributed.tensor_parallel", "ReplicatedWithGradAllReduce.")


def drop_grad_allreduce_hooks(model) -> int:
    """Removes those gradient-only hooks from a model loaded for inference, so that torch.compile
    sees whole graphs; returns how many it removed (0 on transformers versions without them).
    Other backward hooks are left alone. Do not call it on a model you will train."""
    dropped = 0
    for module in model.modules():
        for key, hook in list(module._backward_hooks.items()):
            qualname = getattr(hook, "__qualname__", "")
            if getattr(hook, "__module__", "") == _GRAD_ALLREDUCE_HOOK[0] and \
                    qualname.startswith(_GRAD_ALLREDUCE_HOOK[1]):
                del module._backward_hooks[key]
                dropped += 1
    if dropped:
        log.info(
            "arfusion: removed %d gradient all-reduce backward hook(s) of transformers' replicated_with_grad_allreduce "
            "TP style (inference only): Dynamo broke the graph at each", dropped)
    return dropped


# LongCat-Flash's experts (transformers' LongcatFlashExperts, not behind its experts interface)
# loop over the experts hit, with `nonzero` and `.item()`: Dynamo breaks the graph in every MoE
# layer, the MoE all-reduce is returned from a graph of its own and the norm after it is compiled
# in another, so nothing around it can fuse. Known by what the module holds: per-expert stacked
# weights plus identity ("zero") experts past the routed ones.
_LOOPED_EXPERTS_ATTRS = ("identity_expert", "num_routed_experts", "gate_up_proj", "down_proj", "act_fn")


def _grouped_mm(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return (getattr(F, "grouped_mm", None) or torch._grouped_mm)(rows, weight, offs=offsets)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a TP-sharded DTensor parameter


def _grouped_mm_works(experts) -> bool:
    """The loop-free forward needs a grouped GEMM for these weights as they are (dtype, device,
    shard shapes and strides): bf16 only (torch 2.11-2.13's fake kernel, which torch.compile
    traces with, refuses other dtypes even where eager takes them), CUDA SM90+ or CPU, sizes the
    kernel aligns. Tried once on 16 tokens through both projections of the first expert."""
    gate_up, down = _local(experts.gate_up_proj), _local(experts.down_proj)
    if gate_up.dtype != torch.bfloat16 or down.dtype != torch.bfloat16:
        return False
    try:
        offsets = torch.tensor([16], device=gate_up.device, dtype=torch.int32)
        x = torch.zeros(16, gate_up.shape[-1], device=gate_up.device, dtype=gate_up.dtype)
        h = _grouped_mm(x, gate_up[:1].transpose(-2, -1), offsets)
        out = _grouped_mm(h[:, :down.shape[-1]].contiguous(), down[:1].transpose(-2, -1), offsets)
        return tuple(out.shape) == (16, down.shape[1])
    except (RuntimeError, AttributeError, NotImplementedError, ValueError):
        return False


def _loop_free_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The looped forward's sum without data-dependent shapes: the (token, k) slots sorted by
    expert, one grouped GEMM per projection over the routed experts (rows routed to identity
    experts sort last, past the offsets, and take the token itself), then the top-k combine in
    the form transformers' grouped experts use (weights in their dtype, one rounding at the end;
    the loop rounds after each expert's index_add_, so this is the more exact of the two)."""
    if top_k_index.numel() == 0:
        return torch.zeros_like(hidden_states)
    tokens, hidden = hidden_states.shape
    top_k = top_k_index.size(-1)
    routed = self.num_routed_experts if self.gate_up_proj is not None else 0
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    token_of_row = perm // top_k
    # Called on the module, as the loop does: under TP its pre-hook divides by the TP size,
    # since the experts' all-reduce sums the identity's output over ranks.
    rows = self.identity_expert(hidden_states)[token_of_row]
    if routed:
        ends = torch.arange(1, routed + 1, device=expert_ids.device, dtype=expert_ids.dtype)
        offsets = torch.searchsorted(expert_ids, ends, out_int32=True)
        gate, up = _grouped_mm(hidden_states[token_of_row], self.gate_up_proj[:routed].transpose(-2, -1),
                               offsets).chunk(2, dim=-1)
        expert_rows = _grouped_mm(self.act_fn(gate) * up, self.down_proj.transpose(-2, -1), offsets)
        # grouped_mm leaves rows past the last offset unwritten: select, never multiply them.
        rows = torch.where((expert_ids >= routed).unsqueeze(-1), rows, expert_rows)
    weighted = rows * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return weighted[inverse].view(tokens, top_k, hidden).sum(1).to(hidden_states.dtype)


def _replace_innermost_forward(module, function) -> bool:
    """Makes `function` the module's forward under whatever wraps it. transformers' TP styles
    replace `module.forward` by a closure that transforms inputs and outputs (the experts'
    all-reduce) around the forward it held before, in a variable `original_forward`; the
    replacement goes in that innermost place, so those transforms still run."""
    bound = types.MethodType(function, module)
    wrapper = module.__dict__.get("forward")
    if wrapper is None:
        module.forward = bound
        return True
    for _ in range(8):  # wrappers around wrappers; a cycle would be a bug elsewhere
        code = getattr(wrapper, "__code__", None)
        cells = dict(zip(code.co_freevars, wrapper.__closure__ or ())) if code is not None else {}
        cell = cells.get("original_forward")
        if cell is None:
            return False
        inner = cell.cell_contents
        if getattr(inner, "__self__", None) is module and getattr(inner, "__func__", None) is type(module).forward:
            cell.cell_contents = bound
            return True
        wrapper = inner
    return False


def loop_free_experts(model) -> int:
    """Gives looped experts modules (LongCat-Flash's) the loop-free forward above, so torch.compile
    sees each decoder layer whole; returns how many it changed. Left as they are where the
    device has no grouped GEMM for the weights' dtype (the model then compiles in pieces, as
    before, and stays correct)."""
    changed = 0
    for module in model.modules():
        if not all(hasattr(module, a) for a in _LOOPED_EXPERTS_ATTRS):
            continue
        if module.gate_up_proj is not None and not _grouped_mm_works(module):
            log.info("arfusion: %s keeps its looped forward: no grouped GEMM for its %s weights %s on %s",
                     type(module).__name__, module.gate_up_proj.dtype, tuple(_local(module.gate_up_proj).shape),
                     module.gate_up_proj.device)
            continue
        if not _replace_innermost_forward(module, _loop_free_experts_forward):
            log.info("arfusion: %s keeps its looped forward: its forward is wrapped in a way arfusion does not know",
                     type(module).__name__)
            continue
        changed += 1
    if changed:
        log.info("arfusion: %d experts module(s) now run loop-free (grouped GEMM), with no graph break per MoE layer",
                 changed)
    return changed
