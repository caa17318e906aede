"""Pattern generation and registration: one loop over the product of the pieces.

Patterns are registered per process-group name, lazily, the first time a graph holding an
all_reduce on that group is compiled: the matcher compares strings literally, so the group
name is part of the pattern, and a TP subgroup must fuse with its own group.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
from dataclasses import dataclass
from typing import Callable

import torch
from torch._inductor.pattern_matcher import Match, PatternMatcherPass, fwd_only, register_replacement

from ..backends.base import Site
from . import pieces, trace_memo
from .quant import BOUND_SENTINELS, FP8_DTYPES, QUANT_SPELLINGS

log = logging.getLogger("arfusion")

# Stand-in eps for tracing. The matcher turns this exact constant into an argument, so any
# eps the model uses matches. It must differ from every other constant in the patterns.
EPS_SENTINEL = 3.14159e-7


@dataclass(frozen=True)
class PatternSpec:
    """One registered pattern: a choice of spelling for each piece."""

    residual: str  # key of pieces.RESIDUAL_SPELLINGS
    norm: str  # key of pieces.NORM_SPELLINGS
    quant: str  # key of QUANT_SPELLINGS
    eps: str  # key of pieces.EPS_SPELLINGS
    dtype: torch.dtype

    @property
    def site(self) -> Site:
        quant = QUANT_SPELLINGS[self.quant]
        return Site(residual=self.residual != "none", norm=pieces.NORM_SPELLINGS[self.norm][0],
                    quant=quant.form, emit_norm=quant.emit_norm)

    @property
    def fp8_dtype(self) -> torch.dtype | None:
        return QUANT_SPELLINGS[self.quant].fp8_dtype

    @property
    def input_names(self) -> tuple[str, ...]:
        # Tensors first: make_fx gives only tensors placeholders, and the matcher names the
        # placeholders by position, so a scalar among them would shift every later name.
        residual = () if self.residual == "none" else ("residual",)
        quant_inputs = QUANT_SPELLINGS[self.quant].inputs
        tensors = tuple(i for i in quant_inputs if i not in BOUND_SENTINELS)
        scalars = tuple(i for i in quant_inputs if i in BOUND_SENTINELS)
        return ("x", *residual, "weight", *tensors, "eps", *scalars)

    @property
    def output_names(self) -> tuple[str, ...]:
        """Pattern outputs, the last-computed first: the matcher anchors on the first one."""
        outs = self.site.outputs()
        return tuple(name for name in ("quant", "scale", "norm", "residual") if name in outs)

    def example_inputs(self) -> list:
        """Small stand-ins; only their dtypes and ranks matter (shapes are re-checked on match)."""
        tokens, hidden = 4, 256  # hidden: a multiple of the FP8 group size
        lead = (1, tokens) if QUANT_SPELLINGS[self.quant].token_dims == 2 else (tokens,)
        values = {
            "x": torch.empty(*lead, hidden, dtype=self.dtype),
            "residual": torch.empty(*lead, hidden, dtype=self.dtype),
            "weight": torch.empty(hidden, dtype=self.dtype),
            "eps": EPS_SENTINEL if self.eps == "literal" else torch.empty((), dtype=torch.float64),
            **QUANT_SPELLINGS[self.quant].example_inputs(tokens, hidden),
        }
        return [values[name] for name in self.input_names]

    def search_fn(self, group_name: str) -> Callable:
        add = pieces.RESIDUAL_SPELLINGS[self.residual]
        norm = pieces.NORM_SPELLINGS[self.norm][1]
        eps_of = pieces.EPS_SPELLINGS[self.eps]
        quant = QUANT_SPELLINGS[self.quant]

        def search(x, residual=None, weight=None, eps=None, **quant_inputs):
            reduced = pieces.all_reduce_sum(x, group_name)
            h = reduced if add is None else add(reduced, residual)
            normed = norm(h, weight, eps_of(eps))
            produced = {"residual": h, "norm": normed, **quant.apply(normed, **quant_inputs)}
            return tuple(produced[name] for name in self.output_names)

        return _positional(search, self.input_names)

    def replace_fn(self, group_name: str, backend: str, max_bytes: int) -> Callable:
        site = self.site
        outputs = site.outputs()
        literal_eps = self.eps == "literal"
        # The op keeps the activation's leading dims; a spelling that flattened them first
        # produced 2-D quant outputs, and its users expect those.
        flat_quant = QUANT_SPELLINGS[self.quant].token_dims == 2

        def shaped(name, out):
            return out.reshape(-1, out.shape[-1]) if flat_quant and name in ("quant", "scale") else out

        def replace(x, residual=None, weight=None, eps=None, scale=None, fmax=None, neg_fmax=None):
            outs = torch.ops.arfusion.fused_allreduce_rmsnorm(
                x, residual, weight, eps if literal_eps else 0.0, None if literal_eps else eps,
                group_name, site.norm, site.quant, scale, site.emit_norm, backend, max_bytes)
            return tuple(shaped(name, outs[outputs.index(name)]) for name in self.output_names)

        return _positional(replace, self.input_names)


def _positional(fn: Callable, names: tuple[str, ...]) -> Callable:
    """`fn` called positionally with `names`: the matcher reads argument names off the signature."""

    def wrapper(*args):
        return fn(**dict(zip(names, args)))

    wrapper.__signature__ = inspect.Signature(
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names])
    return wrapper


@dataclass(frozen=True)
class GraphFeatures:
    """What a graph contains that decides which specs can match in it. Registering only
    those keeps the pass's first-compile cost low (each spec is one trace)."""

    trace_dtypes: frozenset
    eps_forms: frozenset
    fp8_dtypes: frozenset
    has_amax: bool
    # NVFP4 spellings are big (~0.3 s to trace each): register only the variants present,
    # by activation rank (flattened or not) and global scale (amax / 6 divided by a tensor).
    all_reduce_ranks: frozenset = frozenset()
    nvfp4_global_scale: frozenset = frozenset()

    @classmethod
    def of(cls, graph: torch.fx.Graph) -> "GraphFeatures":
        all_reduce = torch.ops._c10d_functional.all_reduce.default
        convert = torch.ops.prims.convert_element_type.default
        dtypes, eps_forms, fp8, has_amax = set(), {"literal"}, set(), False
        ranks, global_scale = set(), set()
        for n in graph.nodes:
            val = n.meta.get("val")
            if n.target is all_reduce and isinstance(val, torch.Tensor):
                dtypes.add(torch.float32 if val.dtype == torch.float32 else torch.bfloat16)
                ranks.add(val.dim())
            elif n.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() == 0 \
                    and val.dtype == torch.float64:
                eps_forms.add("tensor")  # dynamic=True lifts float attributes (eps) to inputs
            elif n.target is convert and n.args[1] in FP8_DTYPES:
                fp8.add(n.args[1])
            elif n.target is torch.ops.aten.amax.default:
                has_amax = True
                global_scale.update(_divided_by_a_tensor(user) for user in n.users
                                    if user.target is torch.ops.aten.div.Tensor)
        return cls(frozenset(dtypes), frozenset(eps_forms), frozenset(fp8), has_amax,
                   frozenset(ranks), frozenset(global_scale))

    def may_match(self, spec: "PatternSpec") -> bool:
        quant = QUANT_SPELLINGS[spec.quant]
        if spec.dtype not in self.trace_dtypes or spec.eps not in self.eps_forms:
            return False
        if quant.form == "none":
            return True
        if quant.form == "nvfp4":  # E4M3 block scales from a per-block amax
            return (torch.float8_e4m3fn in self.fp8_dtypes and self.has_amax
                    and ("scale" in quant.inputs) in self.nvfp4_global_scale
                    and (quant.token_dims == 2) == any(r >= 3 for r in self.all_reduce_ranks))
        return quant.fp8_dtype in self.fp8_dtypes and (quant.form == "fp8_static" or self.has_amax)


def _divided_by_a_tensor(amax_over: torch.fx.Node) -> bool:
    """Whether `amax / c` is divided again by a tensor (NVFP4's global scale)."""
    return any(u.target is torch.ops.aten.div.Tensor and isinstance(u.args[1], torch.fx.Node)
               for u in amax_over.users)


@functools.cache  # thousands of combinations: built once per quant-form selection
def all_specs(quant_forms: tuple[str, ...]) -> list[PatternSpec]:
    """Every pattern, largest first: a quant pattern must win over the norm alone."""
    quants = [name for name, q in QUANT_SPELLINGS.items() if q.form == "none" or q.form in quant_forms]
    quants.sort(key=lambda name: QUANT_SPELLINGS[name].priority)
    return [PatternSpec(residual, norm, quant, eps, dtype)
            for quant, residual, norm, eps, dtype in itertools.product(
                quants, pieces.RESIDUAL_SPELLINGS, pieces.NORM_SPELLINGS, pieces.EPS_SPELLINGS,
                pieces.TRACE_DTYPES)
            if QUANT_SPELLINGS[quant].traces_with(dtype)]


def trace_like_post_grad(fn: Callable, args, **kwargs) -> torch.fx.GraphModule:
    """fwd_only, then views as reshapes: Inductor rewrites every view to a reshape before the
    custom passes run, so that is what the patterns meet."""
    gm = fwd_only(fn, args, **kwargs)
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
    gm.recompile()
    return gm


def _per_tensor_scale(match: Match) -> bool:
    """A scale input must hold one value: the patterns are traced with a 0-d scale, and a
    [T, 1] one would broadcast through the same ops (the kernels take exactly one float)."""
    scale = match.kwargs.get("scale")
    return not isinstance(scale, torch.fx.Node) or scale.meta["val"].numel() == 1


def register(patterns: PatternMatcherPass, specs: list[PatternSpec], group_name: str, backend: str,
             max_bytes: int, extra_check: Callable[[PatternSpec, Match], bool]) -> None:
    """Add `specs` to `patterns`, traced under fake tensors so no collective runs and no live
    process group is needed."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

    with unset_fake_temporarily(), torch._guards.tracing(None), FakeTensorMode():
        for spec in specs:
            register_replacement(
                trace_memo.search_function(spec.search_fn(group_name)),
                spec.replace_fn(group_name, backend, max_bytes),
                spec.example_inputs(),
                trace_memo.memoized(trace_like_post_grad),
                [patterns],
                extra_check=lambda match, spec=spec: _per_tensor_scale(match) and extra_check(spec, match),
                scalar_workaround={**({"eps": EPS_SENTINEL} if spec.eps == "literal" else {}),
                                   **QUANT_SPELLINGS[spec.quant].scalar_workaround},
                # FP8 spellings differing only in dtype and clamp bound are one pattern until
                # the exact re-trace on a match; the first one registered serves both.
                skip_duplicates=True,
            )
