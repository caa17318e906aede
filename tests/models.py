"""Small tensor-parallel building blocks written the way HF transformers writes them."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class LlamaStyleRMSNorm(nn.Module):
    """LlamaRMSNorm; `weight_last` flips the final multiply's operand order."""

    def __init__(self, hidden, eps=1e-6, dtype=torch.bfloat16, weight_last=False):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(hidden).to(dtype))
        self.variance_epsilon = eps
        self.weight_last = weight_last

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight_last:
            return hidden_states.to(input_dtype) * self.weight
        return self.weight * hidden_states.to(input_dtype)


class GemmaStyleRMSNorm(nn.Module):
    def __init__(self, hidden, eps=1e-6, dtype=torch.bfloat16):
        super().__init__()
        self.weight = nn.Parameter(0.1 * torch.randn(hidden).to(dtype))
        self.eps = eps

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


def make_norm(kind: str, hidden: int, eps: float, dtype: torch.dtype) -> nn.Module:
    if kind == "gemma":
        return GemmaStyleRMSNorm(hidden, eps, dtype)
    return LlamaStyleRMSNorm(hidden, eps, dtype, weight_last=(kind == "llama_weight_last"))


class RowParallelThenNorm(nn.Module):
    """o_proj (row parallel) -> all_reduce -> [residual add] -> norm, as in an HF decoder layer.

    residual: "first" (residual + y, HF), "last" (y + residual) or "none" (norm reads the
    all-reduce directly). Returns (norm_out, residual_sum) so the sum is consumed later,
    or only norm_out when `sum_unused`.
    """

    def __init__(self, hidden, norm="llama", residual="first", eps=1e-6, dtype=torch.bfloat16,
                 group=None, sum_unused=False):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden, bias=False, dtype=dtype)
        self.norm = make_norm(norm, hidden, eps, dtype)
        self.residual, self.group, self.sum_unused = residual, group, sum_unused

    def forward(self, x, residual):
        y = self.proj(x)
        dist.all_reduce(y, group=self.group)
        if self.residual == "first":
            h = residual + y
        elif self.residual == "last":
            h = y + residual
        else:
            h = y
        out = self.norm(h)
        return out if self.sum_unused else (out, h)


class EpsBufferNorm(nn.Module):
    """An RMSNorm whose eps is a 0-d buffer (`+ self.eps`), made in fp32 with the weight in `dtype`.
    `model.to(dtype)` rounds the buffer to the model's dtype, as loading a checkpoint in bf16 does;
    a model made in its dtype keeps it in fp32."""

    def __init__(self, hidden, eps=1e-6, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(hidden, dtype=dtype))
        self.register_buffer("eps", torch.tensor(eps))

    def forward(self, h):
        hf = h.float()
        return self.weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + self.eps)).to(h.dtype)


class EpsBufferSite(nn.Module):
    """o_proj -> all_reduce -> + residual -> an RMSNorm with a buffer eps (fp32 unless the model is
    moved to another dtype). tests/gpu/check_fast_all_reduce.py runs it on GPUs, made in bf16."""

    def __init__(self, hidden, dtype=None):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden, bias=False, dtype=dtype)
        self.norm = EpsBufferNorm(hidden, dtype=dtype)

    def forward(self, x, residual):
        y = self.proj(x)
        dist.all_reduce(y)
        h = residual + y
        return self.norm(h), h


class TinyDecoder(nn.Module):
    """Embedding all-reduce -> norm, then per layer two all-reduce -> add -> norm sites.

    Sites: 1 + 2 * layers. The final norm's residual sum has no later user.
    """

    def __init__(self, hidden=64, layers=2, dtype=torch.bfloat16, eps=1e-5, norm="llama", group=None):
        super().__init__()
        self.embed = nn.Linear(hidden, hidden, bias=False, dtype=dtype)
        self.attn = nn.ModuleList(nn.Linear(hidden, hidden, bias=False, dtype=dtype) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Linear(hidden, hidden, bias=False, dtype=dtype) for _ in range(layers))
        self.norms = nn.ModuleList(make_norm(norm, hidden, eps, dtype) for _ in range(2 * layers + 1))
        self.group = group

    def forward(self, x):
        h = self.embed(x)
        dist.all_reduce(h, group=self.group)
        residual = h
        normed = self.norms[0](h)
        for i, (attn, mlp) in enumerate(zip(self.attn, self.mlp)):
            for j, proj in enumerate((attn, mlp)):
                y = proj(normed)
                dist.all_reduce(y, group=self.group)
                residual = residual + y
                normed = self.norms[1 + 2 * i + j](residual)
        return normed


# ------------------------------------------------------------------ FP8 activation quant
# In the style of FP8 checkpoints' activation quant (static per-tensor, per-group 128), written
# the way such code writes it: int clamp bounds, a 0-d or 1-element fp32 scale.

FP8 = torch.float8_e4m3fn


def quant_static(y, scale, fp32_divide=False):
    y = y.float() if fp32_divide else y
    return (y / scale).clamp(-448, 448).to(FP8)


def quant_group(y, group=128):
    x = y.float()
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / 448.0
    return (groups / scale).clamp(-448, 448).to(FP8).reshape(x.shape), scale.squeeze(-1)


class NormThenQuant(RowParallelThenNorm):
    """all_reduce -> [add] -> norm -> FP8 quant. `keep_norm` also returns the bf16 norm output
    (it is used elsewhere), so the fused op must produce it too."""

    def __init__(self, hidden, quant="static", residual="first", keep_norm=False, dtype=torch.bfloat16,
                 scale_shape=(), clamp=448):
        super().__init__(hidden, residual=residual, dtype=dtype)
        self.quant, self.keep_norm, self.clamp = quant, keep_norm, clamp
        self.register_buffer("scale", torch.full(scale_shape, 0.02))

    def forward(self, x, residual):
        normed, h = super().forward(x, residual)
        if self.quant == "static":
            outs = ((normed / self.scale).clamp(-self.clamp, self.clamp).to(FP8),)
        elif self.quant == "static_fp32":
            outs = (quant_static(normed, self.scale, fp32_divide=True),)
        else:
            outs = quant_group(normed)
        return (*outs, h, normed) if self.keep_norm else (*outs, h)


def looped_longcat_experts() -> bool:
    """transformers <= 5.24's LongCat-Flash experts loop over the experts hit, identity experts
    inside (what arfusion.hf.loop_free_experts replaces); 5.25 moved them to transformers' experts
    interface, with the identity experts outside: no loop to replace."""
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashExperts

    from arfusion.hf.configs import tiny_config

    return hasattr(LongcatFlashExperts(tiny_config("longcat_flash")), "identity_expert")


def experts_sum_float64(experts, x, index, weights):
    """LongCat-Flash's experts' top-k sum in float64, token by token: routed experts (SiLU-gated
    MLPs from the stacked weights), identity experts passing the token, each weighted."""
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for k, e in enumerate(index[t].tolist()):
            row = x[t].double()
            if e < experts.num_routed_experts:
                gate, up = (experts.gate_up_proj[e].double() @ row).chunk(2)
                row = experts.down_proj[e].double() @ (torch.nn.functional.silu(gate) * up)
            out[t] += weights[t, k].double() * row
    return out


def op_arguments(node) -> dict:
    """An op node's arguments by schema name, defaults filled in (the pass calls arfusion's ops by
    keyword; an op that mutates an input through auto_functionalized, whose kwargs they are)."""
    wrapped = node.target is torch.ops.higher_order.auto_functionalized
    op, args = (node.args[0], ()) if wrapped else (node.target, node.args)
    names = [a.name for a in op._schema.arguments]
    given = dict(zip(names, args), **node.kwargs)
    return {a.name: given.get(a.name, a.default_value) for a in op._schema.arguments}


def unfused_all_reduces(graph) -> int:
    """All-reduces a graph still has outside the fused ops: Inductor's functional ones and those the
    pass put on the fast path (arfusion::all_reduce)."""
    left = (torch.ops._c10d_functional.all_reduce.default, torch.ops.arfusion.all_reduce.default)
    return sum(1 for n in graph.nodes if n.target in left)


class LayerNormBlock(RowParallelThenNorm):
    """o_proj -> all_reduce -> + residual -> LayerNorm (Cohere, StarCoder2, GPT-NeoX, Phi)."""

    def __init__(self, hidden, dtype=torch.bfloat16):
        super().__init__(hidden, dtype=dtype)
        self.ln = nn.LayerNorm(hidden, dtype=dtype)

    def forward(self, x, residual):
        y = self.proj(x)
        dist.all_reduce(y)
        h = residual + y
        return self.ln(h), h


class HyperConnections(nn.Module):
    """DeepSeek-V4's hyper-connection post-mix: the all-reduced sublayer output spread over `k`
    residual streams with per-token weights, a per-token mix of the streams, then an RMSNorm."""

    def __init__(self, hidden, k=4, dtype=torch.bfloat16):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden, bias=False, dtype=dtype)
        self.post = nn.Linear(hidden, k, bias=False, dtype=dtype)
        self.norm = nn.RMSNorm(hidden, eps=1e-6, dtype=dtype)

    def forward(self, x, streams):  # x [B, S, H], streams [B, S, k, H]
        y = self.proj(x)
        dist.all_reduce(y)
        post = torch.sigmoid(self.post(x)).unsqueeze(-1)  # [B, S, k, 1]
        mixed = streams + post * y.unsqueeze(-2)
        return self.norm(mixed.sum(-2)), mixed
