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
from dataclasses import dataclass, field, replace

import torch

from .. import reference
from . import forms, quant_tail
from .encoding import Encoding, activation_sized
from .probe import Probe, ProbeError, Prober
from .quant_tail import QuantPlan
from .region import OTHER_SHAPE_OPS, REDUCTIONS, SIZED_SHAPE_OPS, Region, ancestors_within, hinted_shape, value

aten, prims = torch.ops.aten, torch.ops.prims
_MEMO_SIZE = 256
SCALED_REASON = "the all-reduced value is scaled before the residual add / norm (e.g. Granite's multiplier)"
LAYERNORM_REASON = "the norm subtracts the mean (LayerNorm), it is not an RMSNorm"
# x / ||x|| = RMSNorm(x) / sqrt(hidden): the kernels' weight is in the activation dtype, where
# 1/sqrt(hidden) rounds (exact only for powers of 4), so the product would not be exact.
L2_REASON = ("the norm divides by the L2 norm (x/||x||, nGPT), not by the RMS: that is RMSNorm times "
             "1/sqrt(hidden), which the fused kernels' weight cannot carry exactly")
STREAMS_REASON = ("the all-reduced value is multiplied into {k} streams before any norm (hyper-connections: "
                  "each stream has its own per-token weight), not all_reduce [+ residual] -> RMSNorm")


@dataclass(frozen=True)
class NoSite:
    """Why a region is not a site. `scaled`: the all-reduced value is multiplied or divided before
    the norm, and that is what kept it from being one (the pass then tries the product as the site)."""

    reason: str
    scaled: bool = False
    matched: bool = True  # False: it computes nothing like a site (other candidates' reasons say more)


SCALED = NoSite(SCALED_REASON, scaled=True)
NOT_RMS = NoSite("its computation does not match all_reduce [+ residual] -> RMSNorm numerically", matched=False)



@dataclass(frozen=True)
class Plan:
    """A site in local ids (see `Encoding`); `reason` set when there is none."""

    reason: str = ""
    scaled: bool = False  # see NoSite
    matched: bool = True  # see NoSite
    norm_out: int = -1
    nodes: frozenset[int] = frozenset()  # the norm site's nodes (start included)
    exits: tuple[tuple[int, str], ...] = ()
    residuals: tuple[int, ...] = ()  # the terms added to the all-reduced value (roots)
    weight: int | None = None
    eps: float = 0.0
    eps_input: int | None = None
    norm: str = ""
    quant: QuantPlan | None = None


@dataclass
class Match:
    """A site found in the graph (its nodes and inputs), ready to rewrite."""

    region: Region
    norm_out: torch.fx.Node
    nodes: set[torch.fx.Node]
    exits: list[tuple[torch.fx.Node, str]]
    residuals: list[torch.fx.Node]  # summed into the op's residual input
    weight: torch.fx.Node | None
    eps: float
    eps_input: torch.fx.Node | None
    norm: str
    quant: str = "none"
    quant_scale: torch.fx.Node | None = None
    scale_inverted: bool = False
    emit_norm: bool = True
    quant_nodes: set[torch.fx.Node] = field(default_factory=set)

    def without_quant(self) -> "Match":
        """The same site with the quant tail left outside (the norm output read by it)."""
        exits = [(n, r) for n, r in self.exits if r in ("residual", "norm")]
        if not any(r == "norm" for _, r in exits):
            exits.append((self.norm_out, "norm"))
        return replace(self, exits=exits, quant="none", quant_scale=None, scale_inverted=False,
                       emit_norm=True, nodes=self.nodes - self.quant_nodes, quant_nodes=set())


class Classifier(Prober):
    """Classifies one encoded region; see the module docstring."""

    def __init__(self, enc: Encoding, quant_forms: tuple[str, ...], device: torch.device):
        super().__init__(enc, device)
        self.quant_forms = quant_forms

    def classify(self) -> Plan:
        enc = self.enc
        if value(enc.nodes[0]).dim() < 2:
            return Plan(reason="the all-reduced tensor has no token dim")
        candidates = [i for i in range(self.region_size - 1, 0, -1) if self._may_be_norm_output(i)]
        if not candidates:
            streams = self._broadcast_streams()
            if streams:
                return Plan(reason=STREAMS_REASON.format(k=streams))
            if enc.region.hints:
                return Plan(reason=f"no RMSNorm over the hidden dim reads the all-reduced value "
                                   f"({'; '.join(enc.region.hints)})")
            if any(u.op == "output" for n in enc.nodes[:self.region_size] for u in n.users):
                return Plan(reason="no norm reads the all-reduced value in this graph, which returns it "
                                   "(after a graph break, the next norm is compiled in another graph; "
                                   "arfusion.hf.prepare_for_compile(model) removes the graph breaks of "
                                   "transformers' own code: looped experts, q/k-norm hooks on <= 5.17)")
            return Plan(reason="no RMSNorm over the hidden dim reads the all-reduced value")
        reasons = []
        for i in candidates:
            plan = self._norm_site(i)
            if not plan.reason:
                return replace(plan, quant=self._quant(plan) if self.quant_forms else None)
            reasons.append(plan)
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

    def _may_be_norm_output(self, i: int) -> bool:
        node = self.enc.nodes[i]
        val = value(node)
        if not isinstance(val, torch.Tensor) or val.dtype != self.dtype or val.dim() == 0:
            return False
        if node.target in SIZED_SHAPE_OPS or node.target in OTHER_SHAPE_OPS:
            return False  # a view of the norm output is not where the norm ends
        shape = hinted_shape(node)
        if not activation_sized(shape, self.enc.region) or shape[-1] != self.hidden:
            return False
        return any(n.target in REDUCTIONS for n in ancestors_within(node, self.members))

    def _norm_site(self, out: int) -> Plan:
        enc = self.enc
        site = enc.ids(ancestors_within(enc.nodes[out], self.members) | {enc.nodes[0]})
        if self._subtracts_mean(site):
            return Plan(reason=LAYERNORM_REASON)
        by_role: dict[str, list[int]] = {}
        for r in enc.site_roots(set(site)):
            by_role.setdefault(self.role_of_root(r), []).append(r)
        if by_role.get("other"):
            shapes = [hinted_shape(enc.nodes[r]) for r in by_role["other"]]
            return Plan(reason=f"the norm also reads tensors of shape {shapes}")
        residuals = tuple(sorted(by_role.get("activation", [])))
        if len(residuals) > forms.MAX_RESIDUAL_TERMS:
            return Plan(reason=f"more than {forms.MAX_RESIDUAL_TERMS} activation-sized terms are added")
        if len(by_role.get("vector", [])) > 1 or len(by_role.get("scalar", [])) > 1:
            return Plan(reason="the norm reads more than one weight or scalar")
        weight = (by_role.get("vector") or [None])[0]
        eps_input = (by_role.get("scalar") or [None])[0]
        if any(value(enc.nodes[r]).dtype != self.dtype for r in residuals):
            return Plan(reason="a term added to the all-reduced value has another dtype")
        try:
            found = self._norm_numerics(site, out, residuals, weight, eps_input)
            if isinstance(found, NoSite):
                return Plan(reason=found.reason, scaled=found.scaled, matched=found.matched)
            norm, eps, probe, env = found
            if weight is not None and value(enc.nodes[weight]).dtype != self.dtype:
                return Plan(reason=f"the norm weight is {value(enc.nodes[weight]).dtype}, the activations "
                                   f"{self.dtype} (the fused kernels need one dtype; vllm#48324)")
            exits = self._norm_exits(site, out, residuals, probe, env)
        except ProbeError as e:
            return Plan(reason=f"could not evaluate the norm candidate: {e}")
        if isinstance(exits, str):
            return Plan(reason=exits)
        return Plan(norm_out=out, nodes=site, exits=exits, residuals=residuals, weight=weight,
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

    def _norm_numerics(self, site, out, residuals, weight, eps_input):
        """(norm form, eps, probe, real values) or the reason it is not an RMSNorm."""
        y_node = self.enc.nodes[out]
        kinds = ("plain", "offset") if weight is not None else ("none",)
        eps_values = forms.EPS_TENSOR_PROBES if eps_input is not None else (None,)
        probes = [self.inputs(residuals, weight, {} if e is None else {eps_input: e}) for e in eps_values]
        h64 = self.given(probes[0], 0, True) + sum((self.given(probes[0], r, True) for r in residuals), 0)
        w64 = self.given(probes[0], weight, True)
        exact_outputs = [self.rows(self.run(site, p, exact=True)[y_node]) for p in probes]
        for kind in kinds:
            factor = forms.weight_factor(kind, w64)
            solved = [forms.solve_eps(h64, y64, factor) for y64 in exact_outputs]
            if any(e is None or not forms.close_exact(y64, forms.exact_rms(h64, factor, e))
                   for e, y64 in zip(solved, exact_outputs)):
                continue
            if eps_input is not None and any(abs(e - g) > 1e-6 * g for e, g in zip(solved, eps_values)):
                return SCALED if self._scaled_start() else NoSite("a scalar input other than eps changes the norm")
            break
        else:
            if self._is_l2_norm(h64, w64, exact_outputs, kinds):
                return NoSite(L2_REASON)
            return self._not_rms_reason(site)
        # With the real dtypes: within the rounding of the fused kernels, which normalise the
        # rounded residual sum in fp32 and round once.
        probe, eps = probes[-1], self._written_eps(site, solved[-1])
        env = self.run(site, probe, exact=False)
        y_real = self.rows(env[y_node])
        h_rounded, order_slack = self._residual_sum(probe, residuals)
        kernel = forms.exact_rms(h_rounded.double(), factor, eps)
        # The graph normalises its own sum: a difference there reaches the norm, normalised.
        rms = torch.sqrt(h_rounded.double().pow(2).mean(-1, keepdim=True) + eps)
        carried = order_slack * torch.as_tensor(factor, dtype=torch.float64).abs() / rms
        if not forms.within_ulps(y_real, kernel, self.dtype, forms.NORM_ULPS[self.dtype], extra=carried):
            if self._scaled_start():
                return SCALED
            return NoSite("computes RMSNorm, but rounds differently from the fused kernels by more than "
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

    def _written_eps(self, site, solved: float) -> float:
        """The float literal of the site that `solved` recovered (exact, as the model wrote it),
        or `solved` itself when eps is not written as one literal."""
        literals = [a for i in site for a in self.enc.nodes[i].args if type(a) is float]
        near = [a for a in literals if abs(a - solved) <= forms.EPS_SNAP_RTOL * max(abs(a), 1e-300)]
        return min(near, key=lambda a: abs(a - solved)) if near else solved

    def _subtracts_mean(self, site) -> bool:
        targets = {self.enc.nodes[i].target for i in site}
        return bool(targets & {aten.var_mean.correction, aten.var.correction, aten.native_layer_norm.default})

    def _not_rms_reason(self, site) -> NoSite:
        if self._subtracts_mean(site) or aten.sub.Tensor in {self.enc.nodes[i].target for i in site}:
            return NoSite(LAYERNORM_REASON)
        if self._scaled_start():
            return SCALED
        return NOT_RMS

    def _scaled_start(self) -> bool:
        start = self.enc.nodes[0]
        return any(u in self.members and u.target in (aten.mul.Tensor, aten.div.Tensor) for u in start.users)

    def _norm_exits(self, site, out, residuals, probe, env):
        """Every site node read from outside gets a role, or the reason why one cannot."""
        enc = self.enc
        site_nodes = {enc.nodes[i] for i in site}
        h, order_slack = self._residual_sum(probe, residuals)
        exits = []
        for i in sorted(site):
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
                return "the all-reduced value itself is also read elsewhere (only its sum with the residual can be)"
            return f"an intermediate ({node.name}, {node.target}) is also read outside the site"
        return tuple(exits)

    def _quant(self, plan: Plan) -> QuantPlan | None:
        return quant_tail.find(self, self.quant_forms, norm_out=plan.norm_out, site=plan.nodes,
                               residuals=plan.residuals, weight=plan.weight, eps_input=plan.eps_input)


def _most_telling(plans: list[Plan]) -> Plan:
    """The failed plan of the candidate that came closest (an RMSNorm with a problem beats 'no match')."""
    return next((p for p in plans if p.matched), plans[0])


# ------------------------------------------------------------------ entry point

_memo: "OrderedDict[tuple, Plan]" = OrderedDict()


def find_site(region: Region, quant_forms: tuple[str, ...]) -> Match | NoSite:
    """The site `region` computes, or why it is none."""
    enc = Encoding(region)
    key = (enc.key, quant_forms, tuple(region.hints))  # hints name nodes outside the region
    plan = _memo.get(key)
    if plan is None:
        device = value(region.start).device
        plan = Classifier(enc, quant_forms, device).classify()
        _memo[key] = plan
        if len(_memo) > _MEMO_SIZE:
            _memo.popitem(last=False)
    else:
        _memo.move_to_end(key)
    if plan.reason:
        return NoSite(plan.reason, plan.scaled, plan.matched)
    return _materialize(plan, enc)


def _materialize(plan: Plan, enc: Encoding) -> Match:
    node = enc.nodes.__getitem__
    site = Match(region=enc.region, norm_out=node(plan.norm_out), nodes={node(i) for i in plan.nodes},
                exits=[(node(i), r) for i, r in plan.exits],
                residuals=[node(r) for r in plan.residuals],
                weight=None if plan.weight is None else node(plan.weight), eps=plan.eps,
                eps_input=None if plan.eps_input is None else node(plan.eps_input), norm=plan.norm)
    q = plan.quant
    if q is None:
        return site
    quant_nodes = {node(i) for i in q.nodes}
    exits = [(n, r) for n, r in site.exits if r != "norm" or q.emit_norm] + [(node(i), r) for i, r in q.exits]
    return replace(site, nodes=site.nodes | quant_nodes, quant_nodes=quant_nodes, exits=exits, quant=q.form,
                   quant_scale=None if q.scale_input is None else node(q.scale_input),
                   scale_inverted=q.scale_inverted, emit_norm=q.emit_norm)


clear_memo = _memo.clear
