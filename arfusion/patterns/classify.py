"""What a region computes, decided by evaluating it (the acceptance rule is in `forms`).

For each all-reduce region (`region.grow`):
1. The norm output is a region node with the activation's dtype and size whose computation
   reduces over the hidden dim; the latest such node that passes wins. Its site is the node
   and its ancestors in the region; the tensors the site reads from outside are traced back
   through pointwise preparation (`w.float()`, `1 + w`) to their roots, which get a role by
   shape: the residual (activation-sized), the weight (hidden-sized), eps (one element).
2. The site is evaluated on a probe, exactly and with its real dtypes, and compared with each
   norm form; eps is solved from the probe (or checked, when it is a graph input). Every site
   node read from outside must be the residual sum (or the norm output itself).
3. The quant tail: the nodes after the norm output that compute FP8 / packed FP4 values from it
   alone, compared with each quant form on the same norm output.

The answer depends only on the region's structure, so it is memoized by a signature of it:
a decoder's 2L + 1 sites are analysed two or three times, not 65.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import torch

from .. import quant as quant_ref
from .. import reference
from . import forms
from .probe import ProbeError, evaluate
from ..graph_utils import FP8_DTYPES
from .region import (CONSTANT_PRODUCERS, LIKE_OPS, OTHER_SHAPE_OPS, REDUCTIONS, SIZED_SHAPE_OPS, Region,
                     ancestors_within, hinted_shape, is_pointwise, probe_shape, value)

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
class QuantPlan:
    form: str
    scale_input: int | None  # local id of the static/global scale root
    scale_inverted: bool  # the graph multiplies by that input: the op's scale is its reciprocal
    emit_norm: bool  # the norm output is also read elsewhere
    nodes: frozenset[int]  # local ids absorbed with the quant
    exits: tuple[tuple[int, str], ...]  # (local id, role) read from outside


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


# ------------------------------------------------------------------ the region, canonically


CASTS = {torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default}


def _tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [i for i in node.all_input_nodes if isinstance(value(i), torch.Tensor)]


def activation_sized(shape: tuple[int, ...], region: Region) -> bool:
    """Whether a value of `shape` holds one of the site's activations ([tokens, hidden], however
    viewed). At one token a per-hidden vector (the norm weight) holds as many values; it is the one
    with fewer dims than the all-reduced value, which carries its token dims (`[1, 1, H]`)."""
    if math.prod(shape) != region.tokens * region.hidden:
        return False
    return region.tokens != 1 or len(shape) >= len(hinted_shape(region.start))


def _preparation(node: torch.fx.Node, region: Region) -> tuple[list[torch.fx.Node], torch.fx.Node | None]:
    """The pointwise chain that prepares an outside input (`1 + w.float()`), in order, and the
    tensor it starts from (None: a constant, e.g. `full([], 2**22)`). An activation-sized value
    is a residual term as computed, whatever computed it (MiniMax scales its residual by alpha):
    only casts are looked through there, so the dtype check sees the term's own dtype."""
    chain = []
    while True:
        if node.op == "call_function" and node.target in CONSTANT_PRODUCERS and not node.all_input_nodes:
            return [node, *reversed(chain)], None
        inputs = _tensor_inputs(node)
        computed_term = (node.target not in CASTS and isinstance(value(node), torch.Tensor)
                         and activation_sized(hinted_shape(node), region))
        if node.op == "call_function" and len(inputs) == 1 and (is_pointwise(node) or node.target in LIKE_OPS) \
                and len(node.all_input_nodes) == 1 and not computed_term:
            chain.append(node)
            node = inputs[0]
            continue
        return list(reversed(chain)), node


class Encoding:
    """The region's nodes numbered: 0 is the all-reduced value, then the region in graph order,
    then the preparation of outside inputs and their roots. `key` identifies the computation."""

    def __init__(self, region: Region):
        self.region = region
        self.nodes: list[torch.fx.Node] = [region.start, *region.nodes]
        self.local: dict[torch.fx.Node, int] = {n: i for i, n in enumerate(self.nodes)}
        self.prep: dict[int, list[int]] = {}  # local id of an outside input -> its preparation ids
        self.root_of: dict[int, int | None] = {}  # outside input -> root id (None: constant)
        self.roots: list[int] = []
        for node in region.nodes:
            for i in _tensor_inputs(node):
                if i not in region.members:
                    self._add_outside(i)
        self.key = (region.tokens, region.hidden, tuple(self._describe(i) for i in range(len(self.nodes))),
                    tuple(self.roots))

    def _add(self, node: torch.fx.Node) -> int:
        if node not in self.local:
            self.local[node] = len(self.nodes)
            self.nodes.append(node)
        return self.local[node]

    def _add_outside(self, node: torch.fx.Node) -> None:
        if node in self.local:
            return
        chain, root = _preparation(node, self.region)
        ids = [self._add(n) for n in chain]
        root_id = None if root is None else self._add(root)
        if root_id is not None and root_id not in self.roots:
            self.roots.append(root_id)
        self.prep[self.local[node]] = ids
        self.root_of[self.local[node]] = root_id

    def _describe(self, i: int) -> tuple:
        node = self.nodes[i]
        val = value(node)
        meta = (str(val.dtype), hinted_shape(node), val.device.type) if isinstance(val, torch.Tensor) else repr(val)
        # Which outputs are read outside the region decides the site's exits; being the graph's
        # output also decides the reason given when no norm follows (a graph break, likely).
        read_outside = ("graph output" if any(u.op == "output" for u in node.users)
                        else any(u not in self.region.members for u in node.users))
        if i in self.roots:
            return ("input", meta)
        if i == 0:
            return ("all_reduce", meta, read_outside)
        return (str(node.target), self._arg_key(node.args), self._arg_key(node.kwargs), meta, read_outside)

    def _arg_key(self, arg):
        if isinstance(arg, torch.fx.Node):
            if arg in self.local:
                return ("n", self.local[arg])
            val = value(arg)
            return ("sym", str(val)) if not isinstance(val, torch.Tensor) else ("?", arg.name)
        if isinstance(arg, (list, tuple)):
            return tuple(self._arg_key(a) for a in arg)
        if isinstance(arg, dict):
            return tuple(sorted((k, self._arg_key(v)) for k, v in arg.items()))
        return (type(arg).__name__, repr(arg))

    def ids(self, nodes) -> frozenset[int]:
        return frozenset(self.local[n] for n in nodes)

    def evaluation_order(self, site_ids: set[int]) -> list[torch.fx.Node]:
        """The preparation of every outside input the site reads, then the site in graph order."""
        order: list[int] = []
        for i in sorted(site_ids):
            if i == 0:
                continue
            for inp in _tensor_inputs(self.nodes[i]):
                j = self.local[inp]
                if j in self.prep:
                    order.extend(p for p in self.prep[j] if p not in order)
        order.extend(sorted(i for i in site_ids if i != 0 and i < len(self.region.nodes) + 1))
        return [self.nodes[i] for i in order]

    def site_roots(self, site_ids: set[int]) -> set[int]:
        """The roots of the outside inputs the site reads (through their preparation)."""
        roots = set()
        for i in site_ids:
            if i == 0:
                continue
            for inp in _tensor_inputs(self.nodes[i]):
                j = self.local[inp]
                if j < len(self.region.nodes) + 1:
                    continue
                if self.root_of.get(j) is not None:
                    roots.add(self.root_of[j])
        return roots


# ------------------------------------------------------------------ probes


@dataclass
class Probe:
    """Inputs for one evaluation: real-dtype values, and the same values in float64."""

    real: dict[torch.fx.Node, torch.Tensor]
    exact: dict[torch.fx.Node, torch.Tensor]


class Classifier:
    """Classifies one encoded region; see the module docstring."""

    def __init__(self, enc: Encoding, quant_forms: tuple[str, ...], device: torch.device):
        self.enc, self.quant_forms, self.device = enc, quant_forms, device
        region = enc.region
        self.tokens, self.hidden = region.tokens, region.hidden
        self.dtype = value(region.start).dtype
        gen = torch.Generator().manual_seed(forms.PROBE_SEED)
        rows = forms.PROBE_ROWS
        self.reduced64 = forms.probe_activation(rows, self.hidden, self.dtype, gen).double()
        self.terms64 = [forms.probe_activation(rows, self.hidden, self.dtype, gen).double()
                        for _ in range(forms.MAX_RESIDUAL_TERMS)]
        self.weight64 = torch.rand(self.hidden, generator=gen, dtype=torch.float64) * 3 - 1.5
        self.region_size = len(region.nodes) + 1
        self.members = set(enc.nodes[:self.region_size])

    # ---------------------------------------------------------------- roles and probes

    def _role_of_root(self, i: int) -> str:
        shape = hinted_shape(self.enc.nodes[i])
        numel = math.prod(shape)
        if shape and shape[-1] == self.hidden and activation_sized(shape, self.enc.region):
            return "activation"
        if shape and shape[-1] == self.hidden and numel == self.hidden:
            return "vector"
        return "scalar" if numel == 1 else "other"

    def _probe_value(self, values64: torch.Tensor, node: torch.fx.Node, carries_tokens: bool):
        shape = hinted_shape(node)
        if carries_tokens:
            shape = probe_shape(shape, self.tokens, forms.PROBE_ROWS)
            if shape is None:
                raise ProbeError(f"cannot rescale {node.name} to {forms.PROBE_ROWS} rows")
        real = values64.reshape(shape).to(value(node).dtype)
        return real, real.double()

    def _inputs(self, residuals: tuple[int, ...], weight: int | None, scalars: dict[int, float]) -> Probe:
        probe = Probe({}, {})
        given = [(0, self.reduced64, True), *((r, t, True) for r, t in zip(residuals, self.terms64)),
                 (weight, self.weight64, False),
                 *((i, torch.tensor(v, dtype=torch.float64), False) for i, v in scalars.items())]
        for i, values64, carries_tokens in given:
            if i is not None:
                node = self.enc.nodes[i]
                probe.real[node], probe.exact[node] = self._probe_value(values64, node, carries_tokens)
        return probe

    def _run(self, site_ids, probe: Probe, exact: bool) -> dict:
        nodes = self.enc.evaluation_order(site_ids)
        return evaluate(nodes, probe.exact if exact else probe.real, exact=exact, tokens=self.tokens,
                        rows=forms.PROBE_ROWS)

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(forms.PROBE_ROWS, -1)

    def _given(self, probe: Probe, i: int | None, exact: bool) -> torch.Tensor | None:
        if i is None:
            return None
        t = (probe.exact if exact else probe.real)[self.enc.nodes[i]]
        return self._rows(t) if i == 0 or self._role_of_root(i) == "activation" else t.reshape(-1)

    # ---------------------------------------------------------------- the norm site

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
            by_role.setdefault(self._role_of_root(r), []).append(r)
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
        reduced = self._given(probe, 0, False)
        terms = [self._given(probe, r, False) for r in residuals]
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
        probes = [self._inputs(residuals, weight, {} if e is None else {eps_input: e}) for e in eps_values]
        h64 = self._given(probes[0], 0, True) + sum((self._given(probes[0], r, True) for r in residuals), 0)
        w64 = self._given(probes[0], weight, True)
        exact_outputs = [self._rows(self._run(site, p, exact=True)[y_node]) for p in probes]
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
        env = self._run(site, probe, exact=False)
        y_real = self._rows(env[y_node])
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
        w_real = self._given(probe, weight, False)

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
                    forms.within_ulps(self._rows(val), h, self.dtype, forms.RESIDUAL_ULPS, extra=order_slack):
                exits.append((i, "residual"))
                continue
            if i == 0 and residuals:
                return "the all-reduced value itself is also read elsewhere (only its sum with the residual can be)"
            return f"an intermediate ({node.name}, {node.target}) is also read outside the site"
        return tuple(exits)

    # ---------------------------------------------------------------- the quant tail

    def _quant(self, plan: Plan) -> QuantPlan | None:
        """The quantization of the norm output the region computes next, if one of the forms."""
        enc = self.enc
        norm_out = enc.nodes[plan.norm_out]
        tail = {norm_out}
        for node in enc.nodes[plan.norm_out + 1:self.region_size]:
            inside = [i for i in node.all_input_nodes if i in self.members]
            if inside and all(i in tail for i in inside):
                tail.add(node)
        quantized = [n for n in tail if n is not norm_out and isinstance(value(n), torch.Tensor)
                     and value(n).dtype in (*FP8_DTYPES, torch.uint8)]
        if not quantized:
            return None
        nodes = set().union(*(ancestors_within(n, tail) for n in quantized)) - {norm_out}
        ids = enc.ids(nodes)
        roots = enc.site_roots(set(ids))
        if len(roots) > 1 or any(self._role_of_root(r) != "scalar" for r in roots):
            return None
        scale_root = next(iter(roots), None)
        exits = [n for n in sorted(nodes, key=enc.local.get) if any(u not in nodes for u in n.users)]
        site_nodes = {enc.nodes[i] for i in plan.nodes}
        emit_norm = any(u not in nodes and u not in site_nodes for u in norm_out.users)
        scalars = {} if scale_root is None else {scale_root: forms.QUANT_SCALE_PROBE}
        if plan.eps_input is not None:
            scalars[plan.eps_input] = forms.EPS_TENSOR_PROBES[0]
        try:
            probe = self._inputs(plan.residuals, plan.weight, scalars)
            env = self._run(plan.nodes | ids, probe, exact=False)
        except ProbeError:
            return None
        for form in self.quant_forms:
            for inverted in (False, True) if scale_root is not None else (False,):
                roles = self._quant_roles(form, env[norm_out], probe, scale_root, inverted, exits, env)
                if roles is not None:
                    return QuantPlan(form=form, scale_input=scale_root, scale_inverted=inverted,
                                     emit_norm=emit_norm, nodes=ids,
                                     exits=tuple((enc.local[n], r) for n, r in zip(exits, roles)))
        return None

    def _quant_roles(self, form, normed, probe, scale_root, inverted, exits, env) -> list[str] | None:
        """Each exit's role if the tail computes `form` from `normed` (None if it does not)."""
        if (scale_root is not None) != (form == "fp8_static") and form != "nvfp4":
            return None
        scale_in = None
        if scale_root is not None:
            scale_in = probe.real[self.enc.nodes[scale_root]].float()
            scale_in = 1.0 / scale_in if inverted else scale_in
        fp8 = None
        if form != "nvfp4":
            fp8 = next((value(n).dtype for n in exits if value(n).dtype in FP8_DTYPES), None)
            if fp8 != quant_ref.fp8_dtype(self.device):
                return None  # the op would produce this device's FP8 type, not the graph's
        try:
            ref = quant_ref.quantize(normed, form, scale_in, fp8_dtype=fp8)
        except Exception:  # e.g. hidden not a multiple of the group
            return None
        wanted = {"quant": ref["quant"]}
        if "scale" in ref:
            wanted["scale"] = ref["scale"]
            if form != "nvfp4":
                wanted["inv_scale"] = 1.0 / ref["scale"]
        roles = []
        for node in exits:
            role = next((r for r, want in wanted.items() if _same_values(env[node], want, r, form)), None)
            if role is None:
                return None
            roles.append(role)
        return roles if roles.count("quant") == 1 and len(set(roles)) == len(roles) else None


def _same_values(got: torch.Tensor, want: torch.Tensor, role: str, form: str) -> bool:
    """Equal under the quant part of the rule, on the probe's ordinary rows."""
    if not isinstance(got, torch.Tensor) or got.numel() != want.numel() or got.dtype != want.dtype:
        return False
    rows = forms.ordinary_rows()
    g = got.reshape(forms.PROBE_ROWS, -1)[rows]
    w = want.reshape(forms.PROBE_ROWS, -1)[rows]
    if form == "nvfp4":  # bit for bit, as torchao
        return bool((g.view(torch.uint8) == w.view(torch.uint8)).all())
    if role == "quant":
        return forms.fp8_within_steps(g, w)
    return bool(torch.isfinite(g).all() and ((g - w).abs() <= forms.SCALE_RTOL * w.abs()).all())


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
