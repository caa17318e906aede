"""What a region computes, decided by evaluating it (the acceptance rule is in `forms`).

For each all-reduce region (`region.grow`), numbered canonically (`encoding.Encoding`) and
evaluated on probes (`probe.Prober`):
1. The norm output is a region node with the activation's dtype and size whose computation
   reduces over the hidden dim; the latest such node that passes wins. Its site is the node
   and its ancestors in the region; the tensors the site reads from outside are traced back
   through pointwise preparation (`w.float()`, `1 + w`) to their roots, which get a role by
   shape: the residual (activation-sized), the weight (hidden-sized), eps (one element).
2. The site is evaluated on a probe, exactly and with its real dtypes, and compared with each
   norm form; eps is solved from the probe (or checked, when it is a graph input). Every site
   node read from outside must be the residual sum (or the norm output itself).
3. The quant tail (`quant_tail`): the nodes after the norm output that compute FP8 / packed FP4
   values from it alone, compared with each quant form on the same norm output.

The answer depends only on the region's structure, so it is memoized by a signature of it:
a decoder's 2L + 1 sites are analysed two or three times, not 65.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch

from .. import reference
from ..core import Form
from ..decisions import Reason, Why
from . import dropped, forms, quant_tail
from .dropped import BOUNDED_REASON, BOUNDS
from .encoding import Encoding, activation_sized
from .probe import Probe, ProbeError, Prober
from .quant_tail import QuantPlan
from ..graph_utils import value
from .region import OTHER_SHAPE_OPS, REDUCTIONS, SIZED_SHAPE_OPS, Region, ancestors_within, hinted_shape

aten, prims = torch.ops.aten, torch.ops.prims
_MEMO_SIZE = 256
SCALED_REASON = Reason(Why.SCALED, "the all-reduced value is scaled before the residual add / norm "
                                   "(e.g. Granite's multiplier)")
LAYERNORM_REASON = Reason(Why.LAYERNORM, "the norm subtracts the mean (LayerNorm), it is not an RMSNorm")
# x / ||x|| = RMSNorm(x) / sqrt(hidden): the kernels' weight is in the activation dtype, where
# 1/sqrt(hidden) rounds (exact only for powers of 4), so the product would not be exact.
L2_REASON = Reason(Why.L2_NORM, "the norm divides by the L2 norm (x/||x||, nGPT), not by the RMS: that is RMSNorm "
                                "times 1/sqrt(hidden), which the fused kernels' weight cannot carry exactly")
RETURNED_REASON = Reason(Why.GRAPH_OUTPUT, "no norm reads the all-reduced value in this graph, which returns it")


@dataclass(frozen=True)
class NoSite:
    """Why a region is not a site. `scaled`: the all-reduced value is multiplied or divided before
    the norm, and that is what kept it from being one (the pass then tries the product as the site)."""

    reason: Reason
    scaled: bool = False
    matched: bool = True  # False: it computes nothing like a site (other candidates' reasons say more)
    returned: bool = False  # the all-reduced value leaves the graph with no norm in it (graph_breaks)


SCALED = NoSite(SCALED_REASON, scaled=True)
NOT_RMS = NoSite(Reason(Why.NOT_RMS, "its computation does not match all_reduce [+ residual] -> RMSNorm numerically"),
                 matched=False)


def _no(code: Why, message: str) -> NoSite:
    return NoSite(Reason(code, message))


@dataclass(frozen=True)
class Plan:
    """A site in local ids of its region's `Encoding`: what `find_site` memoizes by the region's
    structure, and what a `Site` maps onto the graph's nodes."""

    norm_out: int
    node_ids: frozenset[int]  # the norm site's nodes (start included)
    exits: tuple[tuple[int, str], ...]  # (id, role) of each node read from outside: "residual", "norm", ...
    residuals: tuple[int, ...]  # the terms added to the all-reduced value (roots)
    weight: int | None
    eps: float
    eps_input: int | None
    norm: str
    quant: QuantPlan | None = None

    def without_quant(self) -> "Plan":
        """The same site with the quant tail left outside (the norm output read by it)."""
        if self.quant is None:
            return self
        exits = tuple((i, r) for i, r in self.exits if r in ("residual", "norm"))
        if not any(r == "norm" for _, r in exits):
            exits += ((self.norm_out, "norm"),)
        return replace(self, exits=exits, quant=None)


@dataclass(frozen=True)
class Site:
    """A site found in the graph: its `Plan` on the region's nodes, ready to rewrite."""

    region: Region
    plan: Plan
    enc: Encoding

    def _node(self, i: int | None) -> torch.fx.Node | None:
        return None if i is None else self.enc.nodes[i]

    @property
    def norm_out(self) -> torch.fx.Node:
        return self.enc.nodes[self.plan.norm_out]

    @property
    def quant_nodes(self) -> set[torch.fx.Node]:
        return set() if self.plan.quant is None else {self.enc.nodes[i] for i in self.plan.quant.nodes}

    @property
    def nodes(self) -> set[torch.fx.Node]:
        """Every node the fused op replaces (the quant tail's too)."""
        return {self.enc.nodes[i] for i in self.plan.node_ids} | self.quant_nodes

    @property
    def exits(self) -> list[tuple[torch.fx.Node, str]]:
        q = self.plan.quant
        exits = [(self.enc.nodes[i], r) for i, r in self.plan.exits if r != "norm" or q is None or q.emit_norm]
        return exits + ([] if q is None else [(self.enc.nodes[i], r) for i, r in q.exits])

    @property
    def residuals(self) -> list[torch.fx.Node]:
        """Summed into the op's residual input."""
        return [self.enc.nodes[r] for r in self.plan.residuals]

    @property
    def weight(self) -> torch.fx.Node | None:
        return self._node(self.plan.weight)

    @property
    def eps(self) -> float:
        return self.plan.eps

    @property
    def eps_input(self) -> torch.fx.Node | None:
        return self._node(self.plan.eps_input)

    @property
    def norm(self) -> str:
        return self.plan.norm

    @property
    def quant(self) -> str:
        return "none" if self.plan.quant is None else self.plan.quant.form

    @property
    def quant_scale(self) -> torch.fx.Node | None:
        return None if self.plan.quant is None else self._node(self.plan.quant.scale_input)

    @property
    def scale_inverted(self) -> bool:
        return self.plan.quant is not None and self.plan.quant.scale_inverted

    @property
    def emit_norm(self) -> bool:
        return self.plan.quant is None or self.plan.quant.emit_norm

    @property
    def form(self) -> Form:
        """What the fused op computes for this site."""
        return Form(residual=bool(self.plan.residuals), norm=self.norm, quant=self.quant, emit_norm=self.emit_norm)

    def without_quant(self) -> "Site":
        return replace(self, plan=self.plan.without_quant())


class Classifier(Prober):
    """Classifies one encoded region; see the module docstring."""

    def __init__(self, enc: Encoding, quant_forms: tuple[str, ...], device: torch.device):
        super().__init__(enc, device)
        self.quant_forms = quant_forms

    def classify(self) -> Plan | NoSite:
        enc = self.enc
        if value(enc.nodes[0]).dim() < 2:
            return _no(Why.NO_TOKEN_DIM, "the all-reduced tensor has no token dim")
        candidates = [i for i in range(self.region_size - 1, 0, -1) if self._may_be_norm_output(i)]
        if not candidates:
            streams = self._broadcast_streams()
            if streams:
                return _no(Why.HYPER_CONNECTIONS, f"the all-reduced value is multiplied into {streams} streams before "
                           "any norm (hyper-connections: each stream has its own per-token weight), not all_reduce "
                           "[+ residual] -> RMSNorm")
            widened = {value(enc.nodes[i]).dtype for i in range(1, self.region_size)
                       if self._may_be_norm_output(i, any_dtype=True)}
            if widened:
                return _no(Why.RESIDUAL_DTYPE, f"the norm reads a {'/'.join(map(str, widened))} sum of the all-reduced "
                                               f"{self.dtype} value (a residual stream of another dtype): the fused op "
                                               "keeps one dtype")
            if (random := dropped.in_region(enc, self.region_size)) is not None:
                return NoSite(random)
            if enc.region.hints:
                return _no(Why.NO_NORM, f"no RMSNorm over the hidden dim reads the all-reduced value "
                                        f"({'; '.join(enc.region.hints)})")
            if any(u.op == "output" for n in enc.nodes[:self.region_size] for u in n.users):
                return NoSite(RETURNED_REASON, returned=True)
            return _no(Why.NO_NORM, "no RMSNorm over the hidden dim reads the all-reduced value")
        reasons = []
        for i in candidates:
            found = self._norm_site(i)
            if isinstance(found, Plan):
                return replace(found, quant=self._quant(found) if self.quant_forms else None)
            reasons.append(found)
        return _most_telling(reasons)

    def _broadcast_streams(self) -> int:
        """k > 1 where a product in the region spreads the all-reduced value over k copies of
        itself (DeepSeek-V4's `post * AR(x).unsqueeze(-2)`), else 0."""
        size = self.tokens * self.hidden
        for node in self.enc.nodes[1:self.region_size]:
            val = value(node)
            if node.target is aten.mul.Tensor and isinstance(val, torch.Tensor) and val.dim() > 0:
                numel = math.prod(hinted_shape(node))
                if numel > size and numel % size == 0 and hinted_shape(node)[-1] == self.hidden:
                    return numel // size
        return 0

    def _may_be_norm_output(self, i: int, any_dtype: bool = False) -> bool:
        node = self.enc.nodes[i]
        val = value(node)
        if not isinstance(val, torch.Tensor) or val.dim() == 0 or not val.dtype.is_floating_point \
                or (val.dtype != self.dtype and not any_dtype):
            return False
        if node.target in SIZED_SHAPE_OPS or node.target in OTHER_SHAPE_OPS:
            return False  # a view of the norm output is not where the norm ends
        shape = hinted_shape(node)
        if not activation_sized(shape, self.enc.region) or shape[-1] != self.hidden:
            return False
        return any(n.target in REDUCTIONS for n in ancestors_within(node, self.members))

    def _activation_sized(self, i: int) -> bool:
        val = value(self.enc.nodes[i])
        return isinstance(val, torch.Tensor) and val.dim() > 0 and \
            activation_sized(hinted_shape(self.enc.nodes[i]), self.enc.region)

    def _norm_site(self, out: int) -> Plan | NoSite:
        enc = self.enc
        ids = enc.ids(ancestors_within(enc.nodes[out], self.members) | {enc.nodes[0]})
        if self._subtracts_mean(ids):
            return NoSite(LAYERNORM_REASON)
        if any(self.enc.nodes[i].target in BOUNDS and self._activation_sized(i) for i in ids):
            return NoSite(BOUNDED_REASON)
        if (random := dropped.in_site(enc, ids)) is not None:
            return NoSite(random)
        by_role: dict[str, list[int]] = {}
        for r in enc.site_roots(set(ids)):
            by_role.setdefault(self.role_of_root(r), []).append(r)
        if by_role.get("other"):
            shapes = [hinted_shape(enc.nodes[r]) for r in by_role["other"]]
            return _no(Why.OTHER_INPUTS, f"the norm also reads tensors of shape {shapes}")
        residuals = tuple(sorted(by_role.get("activation", [])))
        if len(residuals) > forms.MAX_RESIDUAL_TERMS:
            return _no(Why.RESIDUAL_TERMS, f"more than {forms.MAX_RESIDUAL_TERMS} activation-sized terms are added")
        if len(by_role.get("vector", [])) > 1 or len(by_role.get("scalar", [])) > 1:
            return _no(Why.NORM_INPUTS, "the norm reads more than one weight or scalar")
        weight = (by_role.get("vector") or [None])[0]
        eps_input = (by_role.get("scalar") or [None])[0]
        if any(value(enc.nodes[r]).dtype != self.dtype for r in residuals):
            return _no(Why.RESIDUAL_DTYPE, "a term added to the all-reduced value has another dtype")
        try:
            found = self._norm_numerics(ids, out, residuals, weight, eps_input)
            if isinstance(found, NoSite):
                return found
            norm, eps, probe, env = found
            if weight is not None and value(enc.nodes[weight]).dtype != self.dtype:
                return _no(Why.WEIGHT_DTYPE, f"the norm weight is {value(enc.nodes[weight]).dtype}, the activations "
                                             f"{self.dtype} (the fused kernels need one dtype; vllm#48324)")
            exits = self._norm_exits(ids, out, residuals, probe, env)
        except ProbeError as e:
            return _no(Why.PROBE_FAILED, f"could not evaluate the norm candidate: {e}")
        if isinstance(exits, NoSite):
            return exits
        return Plan(norm_out=out, node_ids=ids, exits=exits, residuals=residuals, weight=weight,
                    eps=0.0 if eps_input is not None else eps, eps_input=eps_input, norm=norm)

    def _residual_sum(self, probe: Probe, residuals) -> tuple[torch.Tensor, torch.Tensor | float]:
        """(what the op's residual output holds, how far the graph's own sum may lie from it).

        The op sums the terms in order, then adds the all-reduced value, rounding each time. With
        one term the graph rounds once too: it must agree to RESIDUAL_ULPS. With k terms in all
        (an MoE shared expert's output, say) the graph may add them in another order; each order
        rounds k - 1 times at magnitudes up to the sum of the terms' magnitudes, so two orders
        may differ by (k - 1) ulp there."""
        reduced = self.given(probe, 0, False)
        terms = [self.given(probe, r, False) for r in residuals]
        total = None
        for t in terms:
            total = t if total is None else total + t
        h = reduced if total is None else total + reduced
        if len(terms) < 2:
            return h, 0.0
        magnitude = sum(x.abs().double() for x in (reduced, *terms))
        return h, len(terms) * forms.ulp(magnitude, self.dtype)

    def _norm_numerics(self, ids, out, residuals, weight, eps_input):
        """(norm form, eps, probe, real values) or the reason it is not an RMSNorm."""
        y_node = self.enc.nodes[out]
        kinds = ("plain", "offset") if weight is not None else ("none",)
        eps_values = forms.EPS_TENSOR_PROBES if eps_input is not None else (None,)
        probes = [self.inputs(residuals, weight, {} if e is None else {eps_input: e}) for e in eps_values]
        h64 = self.given(probes[0], 0, True) + sum((self.given(probes[0], r, True) for r in residuals), 0)
        w64 = self.given(probes[0], weight, True)
        exact_outputs = [self.rows(self.run(ids, p, exact=True)[y_node]) for p in probes]
        for kind in kinds:
            factor = forms.weight_factor(kind, w64)
            solved = [forms.solve_eps(h64, y64, factor) for y64 in exact_outputs]
            if any(e is None or not forms.close_exact(y64, forms.exact_rms(h64, factor, e))
                   for e, y64 in zip(solved, exact_outputs)):
                continue
            # The eps each probe gave, as its dtype holds it (a bf16 buffer rounds 1e-5).
            given = [self.given(p, eps_input, True).item() for p in probes] if eps_input is not None else []
            if any(abs(e - g) > 1e-6 * g for e, g in zip(solved, given)):
                return SCALED if self._scaled_start() else _no(Why.EPS_SCALAR,
                                                                "a scalar input other than eps changes the norm")
            break
        else:
            if self._is_l2_norm(h64, w64, exact_outputs, kinds):
                return NoSite(L2_REASON)
            return self._not_rms_reason(ids)
        # With the real dtypes: within the rounding of the fused kernels, which normalise the
        # rounded residual sum in fp32 and round once.
        probe, eps = probes[-1], self._written_eps(ids, solved[-1])
        env = self.run(ids, probe, exact=False)
        y_real = self.rows(env[y_node])
        h_rounded, order_slack = self._residual_sum(probe, residuals)
        kernel = forms.exact_rms(h_rounded.double(), factor, eps)
        # The graph normalises its own sum: a difference there reaches the norm, normalised.
        rms = torch.sqrt(h_rounded.double().pow(2).mean(-1, keepdim=True) + eps)
        carried = order_slack * torch.as_tensor(factor, dtype=torch.float64).abs() / rms
        if not forms.within_ulps(y_real, kernel, self.dtype, forms.NORM_ULPS[self.dtype], extra=carried):
            if self._scaled_start():
                return SCALED
            return _no(Why.ROUNDING, "computes RMSNorm, but rounds differently from the fused kernels by more than "
                                     f"{forms.NORM_ULPS[self.dtype]} ulp (e.g. normalised in {self.dtype}, not fp32)")
        w_real = self.given(probe, weight, False)

        def mismatches(norm: str) -> int:
            return int((reference.rms_norm(h_rounded, w_real, eps, norm) != y_real).sum())

        return min(forms.NORM_FORMS_BY_WEIGHT[kind], key=mismatches), eps, probe, env

    def _is_l2_norm(self, h64, w64, exact_outputs, kinds) -> bool:
        for kind in kinds:
            factor = forms.weight_factor(kind, w64) * self.hidden ** -0.5
            solved = [forms.solve_eps(h64, y64, factor) for y64 in exact_outputs]
            if all(e is not None and forms.close_exact(y64, forms.exact_rms(h64, factor, e))
                   for e, y64 in zip(solved, exact_outputs)):
                return True
        return False

    def _written_eps(self, ids, solved: float) -> float:
        """The float literal of the site that `solved` recovered (exact, as the model wrote it),
        or `solved` itself when eps is not written as one literal."""
        literals = [a for i in ids for a in self.enc.nodes[i].args if type(a) is float]
        near = [a for a in literals if abs(a - solved) <= forms.EPS_SNAP_RTOL * max(abs(a), 1e-300)]
        return min(near, key=lambda a: abs(a - solved)) if near else solved

    def _subtracts_mean(self, ids) -> bool:
        targets = {self.enc.nodes[i].target for i in ids}
        return bool(targets & {aten.var_mean.correction, aten.var.correction, aten.native_layer_norm.default})

    def _not_rms_reason(self, ids) -> NoSite:
        if self._subtracts_mean(ids) or any(self._centres(i) for i in ids):
            return NoSite(LAYERNORM_REASON)
        if self._scaled_start():
            return SCALED
        return NOT_RMS

    def _centres(self, i: int) -> bool:
        """A per-token value (a mean, [..., 1]) subtracted from the hidden states: a LayerNorm
        written by hand. `y - r` of two hidden-state tensors is not one."""
        node = self.enc.nodes[i]
        if node.target is not aten.sub.Tensor:
            return False
        shapes = [hinted_shape(a) if isinstance(a, torch.fx.Node) else () for a in node.args[:2]]
        return any(shape and shape[-1] == 1 for shape in shapes) and self._activation_sized(i)

    def _scaled_start(self) -> bool:
        start = self.enc.nodes[0]
        return any(u in self.members and u.target in (aten.mul.Tensor, aten.div.Tensor) for u in start.users)

    def _norm_exits(self, ids, out, residuals, probe, env):
        """Every node of the site read from outside gets a role, or the reason why one cannot."""
        enc = self.enc
        site_nodes = {enc.nodes[i] for i in ids}
        h, order_slack = self._residual_sum(probe, residuals)
        exits = []
        for i in sorted(ids):
            node = enc.nodes[i]
            if i == out:
                exits.append((i, "norm"))
                continue
            if all(u in site_nodes for u in node.users):
                continue
            val = env[node]
            if isinstance(val, torch.Tensor) and val.dtype == self.dtype and val.numel() == h.numel() and \
                    forms.within_ulps(self.rows(val), h, self.dtype, forms.RESIDUAL_ULPS, extra=order_slack):
                exits.append((i, "residual"))
                continue
            if i == 0 and residuals:
                return _no(Why.READ_ELSEWHERE, "the all-reduced value itself is also read elsewhere (only its sum "
                                               "with the residual can be)")
            return _no(Why.READ_ELSEWHERE, f"an intermediate of the norm ({node.name}, {node.target}) is also read "
                                           "outside it (in grad mode: saved for backward; compile under "
                                           "torch.no_grad() or torch.inference_mode())")
        return tuple(exits)

    def _quant(self, plan: Plan) -> QuantPlan | None:
        return quant_tail.find(self, self.quant_forms, norm_out=plan.norm_out, node_ids=plan.node_ids,
                               residuals=plan.residuals, weight=plan.weight, eps_input=plan.eps_input)


def _most_telling(failed: list[NoSite]) -> NoSite:
    """The reason of the candidate that came closest (an RMSNorm with a problem beats 'no match')."""
    return next((n for n in failed if n.matched), failed[0])


# ------------------------------------------------------------------ entry point

_memo: "OrderedDict[tuple, Plan | NoSite]" = OrderedDict()


def find_site(region: Region, quant_forms: tuple[str, ...]) -> Site | NoSite:
    """The site `region` computes, or why it is none."""
    enc = Encoding(region)
    key = (enc.key, quant_forms, tuple(region.hints), tuple(region.random))  # both name nodes outside the region
    found = _memo.get(key)
    if found is None:
        device = value(region.start).device
        found = Classifier(enc, quant_forms, device).classify()
        _memo[key] = found
        if len(_memo) > _MEMO_SIZE:
            _memo.popitem(last=False)
    else:
        _memo.move_to_end(key)
    return found if isinstance(found, NoSite) else Site(region, found, enc)


clear_memo = _memo.clear
