"""The quant tail of a site: the nodes after the norm output that compute FP8 / packed FP4
values from it alone, compared with each quant form (`quant.quantize`) on the same norm output.

Step 3 of `classify`: the norm site is found first, then its tail is evaluated on the same
probe and each exit given a role (the quantized values, their scale or its inverse), or the
tail stays outside the site.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import quant as quant_ref
from ..decisions import Reason, Why
from ..graph_utils import FP8_DTYPES, value
from . import forms
from .probe import Probe, ProbeError, Prober
from .region import ancestors_within


BOUNDED_MESSAGE = ("the quant after the norm computes {form} on ordinary rows but not at other magnitudes or "
                   "scales (a floor or ceiling on its scale, a clamp on a static scale, that the fused kernels do "
                   "not have): it stays outside the fused op")


@dataclass(frozen=True)
class QuantPlan:
    form: str
    scale_input: int | None  # local id of the static/global scale root
    scale_inverted: bool  # the graph multiplies by that input: the op's scale is its reciprocal
    emit_norm: bool  # the norm output is also read elsewhere
    nodes: frozenset[int]  # local ids absorbed with the quant
    exits: tuple[tuple[int, str], ...]  # (local id, role) read from outside
    refused: Reason | None = None  # form "none": a tail of a form's shape left outside, and why


def find(prober: Prober, quant_forms: tuple[str, ...], *, norm_out: int, node_ids: frozenset[int],
         residuals: tuple[int, ...], weight: int | None, eps_input: int | None) -> QuantPlan | None:
    """The quantization of the norm output the region computes next, if one of `quant_forms`.
    The norm site (`classify.Plan`): its output `norm_out`, its nodes `node_ids` and inputs, all
    local ids of `prober.enc`."""
    enc = prober.enc
    out = enc.nodes[norm_out]
    tail = {out}
    for node in enc.nodes[norm_out + 1:prober.region_size]:
        inside = [i for i in node.all_input_nodes if i in prober.members]
        if inside and all(i in tail for i in inside):
            tail.add(node)
    quantized = [n for n in tail if n is not out and isinstance(value(n), torch.Tensor)
                 and value(n).dtype in (*FP8_DTYPES, torch.uint8)]
    if not quantized:
        return None
    nodes = set().union(*(ancestors_within(n, tail) for n in quantized)) - {out}
    ids = enc.ids(nodes)
    roots = enc.site_roots(set(ids))
    if len(roots) > 1 or any(prober.role_of_root(r) != "scalar" for r in roots):
        return None
    scale_root = next(iter(roots), None)
    exits = [n for n in sorted(nodes, key=enc.local.get) if any(u not in nodes for u in n.users)]
    site_nodes = {enc.nodes[i] for i in node_ids}
    emit_norm = any(u not in nodes and u not in site_nodes for u in out.users)
    scalars = {} if scale_root is None else {scale_root: forms.QUANT_SCALE_PROBE}
    if eps_input is not None:
        scalars[eps_input] = forms.EPS_TENSOR_PROBES[0]
    try:
        probe = prober.inputs(residuals, weight, scalars)
        env = prober.run(node_ids | ids, probe, exact=False)
    except ProbeError:
        return None
    bounded = None
    for form in quant_forms:
        for inverted in (False, True) if scale_root is not None else (False,):
            roles = _roles(prober, form, env[out], probe, scale_root, inverted, exits, env)
            if roles is None:
                continue
            if not _holds_beyond_the_probe(prober, form, out, ids, scale_root, inverted, exits, roles):
                bounded = bounded or form
                continue
            return QuantPlan(form=form, scale_input=scale_root, scale_inverted=inverted,
                             emit_norm=emit_norm, nodes=ids,
                             exits=tuple((enc.local[n], r) for n, r in zip(exits, roles)))
    if bounded is None:
        return None
    # The tail stays outside; a plan of form "none" carries why, for the log (policy's notes).
    return QuantPlan(form="none", scale_input=None, scale_inverted=False, emit_norm=True, nodes=frozenset(),
                     exits=(), refused=Reason(Why.QUANT_BOUNDED, BOUNDED_MESSAGE.format(form=bounded)))


def _holds_beyond_the_probe(prober: Prober, form, out, ids, scale_root, inverted, exits, roles) -> bool:
    """Whether the tail still computes `form` on norm outputs spanning magnitudes (`forms.QUANT_SPAN_LOG10`)
    and, for a scale input, at each of `forms.QUANT_SCALE_CHECKS`: a floor or ceiling on a per-token
    scale, or a clamp on a static scale, is the identity on the ordinary rows at one scale. Compared on
    the rows where the form's own floor does not act (`_floor_free_rows`)."""
    enc = prober.enc
    gen = torch.Generator().manual_seed(forms.PROBE_SEED + 1)
    magnitudes = torch.logspace(*forms.QUANT_SPAN_LOG10, forms.PROBE_ROWS, dtype=torch.float64).unsqueeze(-1)
    normed64 = torch.randn(forms.PROBE_ROWS, prober.hidden, generator=gen, dtype=torch.float64) * magnitudes
    try:
        normed, normed_exact = prober.probe_value(normed64, out, True)
    except ProbeError:
        return False
    rows = _floor_free_rows(prober.rows(normed).float(), form)
    fp8 = next((value(n).dtype for n in exits if value(n).dtype in FP8_DTYPES), None)
    for scale in forms.QUANT_SCALE_CHECKS if scale_root is not None else (None,):
        probe = Probe({out: normed}, {out: normed_exact})
        if scale_root is not None:
            root = enc.nodes[scale_root]
            probe.real[root], probe.exact[root] = prober.probe_value(torch.tensor(scale, dtype=torch.float64),
                                                                      root, False)
        try:
            env = prober.run(ids, probe, exact=False)
            ref = quant_ref.quantize(normed, form, _scale_in(prober, probe, scale_root, inverted), fp8_dtype=fp8)
        except (ProbeError, RuntimeError, ValueError):
            return False
        wanted = _wanted(ref, form)
        if not all(_same_values(env[n], wanted[r], r, form, rows) for n, r in zip(exits, roles)):
            return False
    return True


def _floor_free_rows(normed: torch.Tensor, form: str) -> torch.Tensor:
    """The rows (of a [PROBE_ROWS, H] norm output) where the form's own floor on its scales does not
    act: there every spelling of the form agrees, whatever floor it writes below the kernels'."""
    rows = normed.reshape(forms.PROBE_ROWS, -1).abs()
    if form == "fp8_dynamic":
        return rows.amax(-1) > 2 * quant_ref.MIN_DYNAMIC_SCALE_TIMES_FMAX
    if form == "fp8_group":
        return rows.unflatten(-1, (-1, quant_ref.GROUP_SIZE)).amax(-1).amin(-1) > 2 * quant_ref.MIN_GROUP_AMAX
    return torch.ones(forms.PROBE_ROWS, dtype=torch.bool)


def _scale_in(prober: Prober, probe: Probe, scale_root, inverted: bool) -> torch.Tensor | None:
    """The static scale the op would take, as the probe set its graph input (None: no scale input)."""
    if scale_root is None:
        return None
    scale = probe.real[prober.enc.nodes[scale_root]].float()
    return 1.0 / scale if inverted else scale


def _wanted(ref: dict, form: str) -> dict:
    """The values a tail of `form` may hand out, by role, from the reference quant `ref`."""
    wanted = {"quant": ref["quant"]}
    if "scale" in ref:
        wanted["scale"] = ref["scale"]
        if form != "nvfp4":
            wanted["inv_scale"] = 1.0 / ref["scale"]
    return wanted


def _roles(prober: Prober, form, normed, probe, scale_root, inverted, exits, env) -> list[str] | None:
    """Each exit's role if the tail computes `form` from `normed` (None if it does not)."""
    if (scale_root is not None) != (form == "fp8_static") and form != "nvfp4":
        return None
    scale_in = _scale_in(prober, probe, scale_root, inverted)
    fp8 = None
    if form != "nvfp4":
        fp8 = next((value(n).dtype for n in exits if value(n).dtype in FP8_DTYPES), None)
        if fp8 != quant_ref.fp8_dtype(prober.device):
            return None  # the op would produce this device's FP8 type, not the graph's
    try:
        ref = quant_ref.quantize(normed, form, scale_in, fp8_dtype=fp8)
    except Exception:  # e.g. hidden not a multiple of the group
        return None
    wanted = _wanted(ref, form)
    roles = []
    for node in exits:
        role = next((r for r, want in wanted.items() if _same_values(env[node], want, r, form)), None)
        if role is None:
            return None
        roles.append(role)
    return roles if roles.count("quant") == 1 and len(set(roles)) == len(roles) else None


def _same_values(got: torch.Tensor, want: torch.Tensor, role: str, form: str, rows=None) -> bool:
    """Equal under the quant part of the rule, on `rows` of the probe (its ordinary rows by default)."""
    if not isinstance(got, torch.Tensor) or got.numel() != want.numel() or got.dtype != want.dtype:
        return False
    rows = forms.ordinary_rows() if rows is None else rows
    g = got.reshape(forms.PROBE_ROWS, -1)[rows]
    w = want.reshape(forms.PROBE_ROWS, -1)[rows]
    if form == "nvfp4":  # bit for bit, as torchao
        return bool((g.view(torch.uint8) == w.view(torch.uint8)).all())
    if role == "quant":
        return forms.fp8_within_steps(g, w)
    return bool(torch.isfinite(g).all() and ((g - w).abs() <= forms.SCALE_RTOL * w.abs()).all())
