"""Count all-reduce -> [residual add] -> RMSNorm sites in an EAGER tensor-parallel model.

Written independently of arfusion's matcher (nothing here imports arfusion): it watches the
eager model run, not a compiled graph.

- A `TorchDispatchMode` marks every tensor an all-reduce produces: in-place `c10d.allreduce_`
  (what HF's `dist.all_reduce(t, group=...)` dispatches to) and functional
  `_c10d_functional.all_reduce` (DTensor's redistribute, funcol), through `wait_tensor`.
- The mark follows view/reshape-only ops (and same-dtype copies), and adds: the mark of a sum
  records its terms - how many all-reduced terms, how many other full-size terms (the residual,
  a replicated shared expert), broadcast terms (a bias) and scaled all-reduced terms (Granite's
  `residual_multiplier`, Gemma's embedding scale).
- Forward pre-hooks on norm modules read the mark of the norm's input and classify it; a norm
  ends the chain (the tensor it read is a plain residual from then on).
- Which modules are RMSNorm is decided by what they compute on a random input
  (`norm_kind`): x/rms(x)*w, x/rms(x)*(1+w), x/rms(x); LayerNorm is a look-alike; anything
  else with "norm" in its class name is "other" and not hooked.

Input provenance labels: "ar" (all-reduce [views] -> norm), "ar+add" (all-reduce [views] +
residual -> norm), "ar+ar" (all-reduce + another all-reduce's output -> norm), "ar*s" / "ar*s+add"
(the same, scaled by a number first) - the site shapes: one all-reduce and at most one add -, and
e.g. "ar+ar+add" (two all-reduces summed: routed +
shared experts), "ar+replicated+add" (an extra non-all-reduced term), "ar*s+add" (scaled before
the add), "ar+bias+add".
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections import Counter, defaultdict
from typing import Callable

import torch
import torch.distributed._functional_collectives  # noqa: F401  (registers the _c10d_functional ops below)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

# One all-reduce [views] and at most one add before the norm. "ar+ar": two all-reduces summed and
# normed without a residual (a MoE block's own post-norm): the second is an all-reduce + "residual".
# "ar*s", "ar*s+add": the all-reduce scaled by a number first (Granite's multipliers, MiniCPM's depth
# scale), which arfusion's op takes as its input scale.
SITE_LABELS = ("ar", "ar+add", "ar+ar", "ar*s", "ar*s+add")
RMS_KINDS = ("rmsnorm", "rmsnorm(1+w)", "rmsnorm(no weight)")
LAYERNORM_KINDS = ("layernorm", "layernorm(1+w)")

_ops = torch.ops
_AR_INPLACE = {_ops.c10d.allreduce_.default}
_AR_FUNCTIONAL = {_ops._c10d_functional.all_reduce.default}
if hasattr(_ops._c10d_functional, "all_reduce_"):
    _AR_INPLACE_FUNCTIONAL = {_ops._c10d_functional.all_reduce_.default}
else:
    _AR_INPLACE_FUNCTIONAL = set()
_PASS_THROUGH = {_ops._c10d_functional.wait_tensor.default}
if hasattr(_ops._c10d_functional, "_wrap_tensor_autograd"):
    _PASS_THROUGH.add(_ops._c10d_functional._wrap_tensor_autograd.default)
# Ops that only change the view of the same values (or copy them unchanged).
_VIEWS = {getattr(_ops.aten, n) for n in (
    "view", "_unsafe_view", "reshape", "_reshape_alias", "alias", "detach", "squeeze", "unsqueeze",
    "flatten", "unflatten", "clone", "contiguous", "as_strided", "view_as", "lift_fresh")
    if hasattr(_ops.aten, n)}
_ADDS = {_ops.aten.add.Tensor, _ops.aten.add_.Tensor}
_SCALES = {_ops.aten.mul.Tensor, _ops.aten.mul_.Tensor, _ops.aten.div.Tensor, _ops.aten.div_.Tensor,
           _ops.aten.mul.Scalar, _ops.aten.div.Scalar}
_COPIES = {_ops.aten._to_copy.default}


@dataclasses.dataclass(frozen=True)
class Mark:
    """The terms a tensor is the sum of, where at least one is an all-reduce output."""
    ars: int = 0        # all-reduced terms
    scaled: int = 0     # all-reduced terms multiplied by a scalar ("ar*s")
    gated: int = 0      # all-reduced terms multiplied by a broadcast tensor, e.g. a per-token gate ("ar*g")
    full: int = 0       # other full-size terms (residual, replicated shared expert, ...)
    bias: int = 0       # broadcast terms (bias)
    cast: bool = False  # a dtype conversion on the way
    ids: frozenset = frozenset()  # which all-reduce calls

    def __add__(self, other: "Mark") -> "Mark":
        return Mark(self.ars + other.ars, self.scaled + other.scaled, self.gated + other.gated,
                    self.full + other.full, self.bias + other.bias, self.cast or other.cast, self.ids | other.ids)

    def label(self) -> str:
        parts = ["ar"] * self.ars + ["ar*s"] * self.scaled + ["ar*g"] * self.gated + ["bias"] * self.bias
        if self.full == 2:
            parts.append("replicated")  # a second non-all-reduced term: a replicated shared expert, ...
        if self.full:
            # more than 2: a chain of residual adds (e.g. the embedding's all-reduce of a post-norm
            # model reaching the final norm)
            parts.append("add" if self.full <= 2 else f"add×{self.full}")
        return "+".join(parts) + (" (dtype cast)" if self.cast else "")


def _is_scalar(x) -> bool:
    return isinstance(x, (int, float)) or (isinstance(x, torch.Tensor) and x.numel() == 1)


class SiteCounter(TorchDispatchMode):
    """Use as a context manager around one eager forward, after `hook_norms(model)`."""

    def __init__(self):
        super().__init__()
        self.marks = WeakTensorKeyDictionary()
        self._ids = itertools.count()
        self.all_reduces = 0
        self.norm_calls: list[dict] = []
        self.fates: dict[int, Counter] = defaultdict(Counter)  # all-reduce id -> what consumed it
        self.norm_depth = 0
        self._handles = []

    # ---------------------------------------------------------------- marks
    def _get(self, t):
        if not isinstance(t, torch.Tensor):
            return None
        m = self.marks.get(t)
        if m is None and hasattr(t, "elem") and isinstance(t.elem, torch.Tensor):  # AsyncCollectiveTensor
            m = self.marks.get(t.elem)
        return m

    def _new_ar(self, t):
        self.all_reduces += 1
        self.marks[t] = Mark(ars=1, ids=frozenset({next(self._ids)}))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _AR_INPLACE:
            for t in args[0]:
                self._new_ar(t)
            return out
        if func in _AR_FUNCTIONAL:
            self._new_ar(out)
            return out
        if func in _AR_INPLACE_FUNCTIONAL:
            self._new_ar(args[0])
            return out
        tensors = [a for a in itertools.chain(args, kwargs.values()) if isinstance(a, torch.Tensor)]
        marked = [(a, self._get(a)) for a in tensors if self._get(a) is not None]
        if not marked:
            return out
        first = self._get(args[0]) if args else None
        packet = getattr(func, "overloadpacket", None)
        if func in _PASS_THROUGH or packet in _VIEWS:
            if first is not None and isinstance(out, torch.Tensor):
                self.marks[out] = first
                return out
        elif func in _COPIES:
            if first is not None and isinstance(out, torch.Tensor):
                cast = out.dtype != args[0].dtype
                self.marks[out] = dataclasses.replace(first, cast=first.cast or cast)
                return out
        elif func in _ADDS and len(args) >= 2 and kwargs.get("alpha", 1) == 1:
            a, b = args[0], args[1]
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
                res = args[0] if func is _ops.aten.add_.Tensor else out
                self.marks[res] = self._term(a, res) + self._term(b, res)
                return out
        elif func in _SCALES and len(args) >= 2:
            a, b = args[0], args[1]
            m, other = (self._get(a), b) if self._get(a) is not None else (self._get(b), a)
            pure = m.full == 0 and m.bias == 0 and isinstance(out, torch.Tensor)
            res = args[0] if func in (_ops.aten.mul_.Tensor, _ops.aten.div_.Tensor) else out
            if _is_scalar(other) and float(other) == 1.0 and isinstance(out, torch.Tensor):
                self.marks[res] = m  # x * 1.0 (a multiplier left at its default): no scale at all
                return out
            if m.bias == 0 and isinstance(out, torch.Tensor) and _is_scalar(other):
                # (AR + t) * s is AR * s + t * s: Granite-4 scales the MoE output plus a replicated
                # shared MLP's by its residual multiplier.
                self.marks[res] = Mark(scaled=m.ars + m.scaled, gated=m.gated, full=m.full, cast=m.cast, ids=m.ids)
                return out
            if (pure and isinstance(other, torch.Tensor) and self._get(other) is None
                    and other.numel() < out.numel()):
                self.marks[res] = Mark(gated=m.ars + m.scaled + m.gated, cast=m.cast, ids=m.ids)
                return out
        if self.norm_depth == 0:
            name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
            for _, m in marked:
                for i in m.ids:
                    self.fates[i][f"op:{name}"] += 1
        return out

    def _term(self, t, out) -> Mark:
        m = self._get(t)
        if m is not None:
            return m
        if tuple(t.shape) == tuple(out.shape):
            return Mark(full=1)
        return Mark(bias=1)

    # ---------------------------------------------------------------- norm hooks
    def hook_norms(self, model: torch.nn.Module, kinds: dict[str, str]) -> None:
        """kinds: module path -> norm kind (from `classify_norms`); hooks every RMSNorm/LayerNorm."""
        for name, module in model.named_modules():
            kind = kinds.get(name)
            if kind is None or kind == "other":
                continue
            self._handles.append(module.register_forward_pre_hook(
                lambda mod, args, kw, name=name, kind=kind: self._pre(name, mod, kind, args, kw),
                with_kwargs=True))
            self._handles.append(module.register_forward_hook(lambda *a: self._post()))

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, name, module, kind, args, kwargs):
        self.norm_depth += 1
        if self.norm_depth > 1:  # a norm inside a norm sees the same input: count the outer one
            return None
        tensors = [a for a in itertools.chain(args, kwargs.values()) if isinstance(a, torch.Tensor)]
        if not tensors:
            return None
        x = tensors[0]
        m = self._get(x)
        gated = len(tensors) > 1
        call = {"module": name, "class": type(module).__name__, "kind": kind + (" gated" if gated else ""),
                "label": m.label() if m is not None else None}
        self.norm_calls.append(call)
        if m is not None:
            for i in m.ids:
                self.fates[i][f"norm:{call['kind']}:{call['label']}"] += 1
            del self.marks[x]  # a norm ends the chain: from here on x is a plain residual
            if hasattr(x, "elem") and self.marks.get(x.elem) is not None:
                del self.marks[x.elem]
        return None

    def _post(self):
        self.norm_depth -= 1
        return None

    # ---------------------------------------------------------------- summary
    def summary(self) -> dict:
        sites = [c for c in self.norm_calls if c["label"] in SITE_LABELS and c["kind"] in RMS_KINDS]
        other = Counter(c["label"] for c in self.norm_calls
                        if c["label"] and c["kind"] in RMS_KINDS and c["label"] not in SITE_LABELS)
        gated = Counter(c["label"] for c in self.norm_calls if c["label"] and c["kind"].endswith(" gated"))
        layernorm = Counter(c["label"] for c in self.norm_calls if c["label"] and c["kind"] in LAYERNORM_KINDS)
        no_norm = Counter()
        for i in range(self.all_reduces):
            fate = self.fates.get(i, Counter())
            if not any(k.startswith("norm:") for k in fate):
                no_norm[", ".join(sorted(fate)) or "unused (logits / discarded)"] += 1
        return {
            "sites": len(sites),
            "site_labels": dict(Counter(c["label"] for c in sites)),
            "other_shapes": dict(other),
            "gated_norm_lookalikes": dict(gated),
            "layernorm_lookalikes": dict(layernorm),
            "all_reduces": self.all_reduces,
            "all_reduces_not_reaching_a_norm": dict(no_norm),
            "norm_calls": len(self.norm_calls),
        }


# ---------------------------------------------------------------------------- which norms
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _eps(module) -> float:
    for attr in ("variance_epsilon", "eps", "epsilon", "rms_norm_eps"):
        v = getattr(module, attr, None)
        if isinstance(v, (int, float)):
            return float(v)
    return 1e-6


def norm_kind(module: torch.nn.Module, hidden: int, dtype=torch.bfloat16) -> str:
    """What a module with "norm" in its class name computes on a random input:
    "rmsnorm" (x/rms(x)*w), "rmsnorm(1+w)", "rmsnorm(no weight)", "layernorm", "layernorm(1+w)"
    (Nemotron's LayerNorm1P) or "other" (grouped or gated norms, norms returning a factor, ...)."""
    weight = getattr(module, "weight", None)
    dim = weight.shape[-1] if isinstance(weight, torch.Tensor) and weight.dim() >= 1 else hidden
    try:
        probe = copy.deepcopy(module)
        with torch.no_grad():
            w = getattr(probe, "weight", None)
            if isinstance(w, torch.Tensor) and not hasattr(w, "to_local"):
                w.copy_(torch.rand(w.shape, generator=torch.Generator().manual_seed(3)) + 0.5)
            b = getattr(probe, "bias", None)
            if isinstance(b, torch.Tensor) and not hasattr(b, "to_local"):
                b.copy_(torch.rand(b.shape, generator=torch.Generator().manual_seed(4)) - 0.5)
            g = torch.Generator().manual_seed(5)
            x = (torch.randn(2, 5, dim, generator=g) * 2 + 0.7).to(dtype)
            y = probe(x)
            if isinstance(y, (tuple, list)):
                y = y[0]
            if not isinstance(y, torch.Tensor) or y.shape != x.shape:
                return "other"
            y = _local(y).float()
            xf = x.float()
            rms = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + _eps(probe))
            cands = {"rmsnorm(no weight)": rms}
            w = getattr(probe, "weight", None)
            if isinstance(w, torch.Tensor) and w.shape[-1] == dim:
                wf = _local(w).float()
                cands["rmsnorm"] = rms * wf
                cands["rmsnorm(1+w)"] = rms * (1 + wf)
                bias = getattr(probe, "bias", None)
                bf = _local(bias).float() if isinstance(bias, torch.Tensor) else None
                cands["layernorm"] = torch.nn.functional.layer_norm(xf, (dim,), wf, bf, _eps(probe))
                cands["layernorm(1+w)"] = torch.nn.functional.layer_norm(xf, (dim,), 1 + wf, bf, _eps(probe))
            else:
                cands["layernorm"] = torch.nn.functional.layer_norm(xf, (dim,), None, None, _eps(probe))
            for kind, ref in cands.items():
                if ((y - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item() < 2e-2:
                    return kind
            return "other"
    except Exception:
        return "other"


def classify_norms(model: torch.nn.Module, hidden: int, dtype=torch.bfloat16) -> dict[str, str]:
    """Module path -> norm kind, for every module whose class name contains "norm"."""
    kinds, by_class = {}, {}
    for name, module in model.named_modules():
        if "norm" not in type(module).__name__.lower() or not name:
            continue
        weight = getattr(module, "weight", None)
        key = (type(module), tuple(weight.shape) if isinstance(weight, torch.Tensor) else None)
        if key not in by_class:
            by_class[key] = norm_kind(module, hidden, dtype)
        kinds[name] = by_class[key]
    return kinds


def count_sites(model: torch.nn.Module, forward: Callable, hidden: int) -> tuple[object, dict]:
    """(forward(model), the counter's summary) for one eager forward of `model`, its norms
    hooked; the summary also names the norm kinds and lists every norm call. Where the counted
    forward fails, the model runs alone: its own error is raised, else a RuntimeError saying
    the counter failed."""
    kinds = classify_norms(model, hidden)
    counter = SiteCounter()
    counter.hook_norms(model, kinds)
    try:
        with counter:
            out = forward(model)
    except Exception as e:
        counter.remove_hooks()
        forward(model)  # fails too: the model's own error
        raise RuntimeError(f"the site counter failed, the model alone did not: {type(e).__name__}: {e}") from e
    finally:
        counter.remove_hooks()
    summary = counter.summary()
    summary["norm_kinds"] = dict(Counter(f"{type(m).__name__}: {kinds[n]}" for n, m in model.named_modules()
                                         if n in kinds))
    summary["calls"] = counter.norm_calls
    return out, summary


def fmt_counts(d: dict) -> str:
    """{"ar+add": 2, "ar": 1} -> "ar, ar+add ×2"."""
    return ", ".join(f"{k} ×{v}" if v > 1 else k for k, v in sorted(d.items())) if d else ""


def other_shapes(summary: dict) -> str:
    """What the counter saw that is not a site: other shapes and look-alikes, one cell."""
    parts = []
    if summary.get("other_shapes"):
        parts.append(fmt_counts(summary["other_shapes"]))
    if summary.get("gated_norm_lookalikes"):
        parts.append("gated norm: " + fmt_counts(summary["gated_norm_lookalikes"]))
    if summary.get("layernorm_lookalikes"):
        parts.append("LayerNorm: " + fmt_counts(summary["layernorm_lookalikes"]))
    if summary.get("all_reduces_not_reaching_a_norm"):
        parts.append("no norm: " + fmt_counts(summary["all_reduces_not_reaching_a_norm"]))
    return "; ".join(parts)


# How the counter works, as benchmarks/coverage/hf_coverage.py's report explains it.
HOW_IT_WORKS = """\
## How the counter works

`benchmarks/coverage/hf_site_counter.py` counts sites in the **eager** model and imports nothing from
arfusion, so it checks the matcher rather than repeating it.

- A `TorchDispatchMode` marks the tensors all-reduces produce: HF's in-place
  `dist.all_reduce(t, group=...)` dispatches as `c10d.allreduce_`, DTensor/funcol as
  `_c10d_functional.all_reduce` (+ `wait_tensor`).
- A mark follows view/reshape-only ops (view, reshape, squeeze, clone, contiguous) and adds:
  the mark of a sum counts its terms (all-reduced terms, other full-size terms, broadcast terms,
  all-reduced terms multiplied by a scalar `ar*s` or by a broadcast tensor such as a per-token
  gate `ar*g`; × 1.0, a multiplier left at its default, is no scale). A dtype conversion keeps
  the mark but flags it `(dtype cast)`.
- Forward pre-hooks on norm modules read the mark of the norm's input. A norm ends a chain:
  the tensor it read counts as a plain residual afterwards.
- Which modules are RMSNorm is decided by running each norm class once on a random input
  (weights randomised on a copy) and comparing with x/rms(x)·w, x/rms(x)·(1+w), x/rms(x),
  LayerNorm and LayerNorm·(1+w) (look-alikes). Grouped norms, gated norms whose gate is not
  optional, and norms that return a factor come out as "other" and are not hooked; a norm
  called with a second tensor (a gate) is reported as a gated-norm look-alike.
- **Sites** = RMSNorm calls whose input is one all-reduce [views] with at most one add:
  `ar` (all-reduce → norm), `ar+add` (all-reduce + residual → norm), `ar+ar` (the sum of two
  all-reduces normed without a residual, e.g. a MoE block's own post-norm: the second is an
  all-reduce + "residual" like any other), and `ar*s`, `ar*s+add` (the all-reduce scaled by a
  scalar first: Granite's multipliers, MiniCPM's depth scale, Gemma's embedding normaliser).
  Other shapes are listed, not counted: `ar+ar+add`
  (routed + shared experts, both all-reduced, then the residual), `ar+replicated+add` (an extra
  non-all-reduced term, e.g. a replicated shared expert), `ar*s+replicated+add` and the like,
  `ar*g…`, `ar+bias…`, `… (dtype cast)`,
  `ar+add×N` (a chain of residual adds, e.g. a post-norm model's embedding all-reduce reaching the
  final norm). "no norm" lists all-reduces whose value never reached a norm, with the op that
  consumed it.

Limits: it sees only what runs in the eager forward of this tiny config (2 layers; the layer
kinds kept are those of the first layer and of the first layer that differs from it, so e.g. a
hybrid model's third kind of layer is not seen); a norm written inline (not a module) is not
hooked: its all-reduce shows under "no norm"; a reduction (Llama-4's sum over experts of
all-reduced rows) ends a mark; it counts module calls, so a norm module applied twice counts
twice. Every row is one forward of one batch row (its tokens are in the header); the counter is
not a proof that the compiled graph has the same shape (Inductor's decompositions can differ), which is what the "fused"
column then shows.
"""
