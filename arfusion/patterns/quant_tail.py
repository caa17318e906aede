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
from ..graph_utils import FP8_DTYPES, value
from . import forms
from .probe import ProbeError, Prober
from .region import ancestors_within


@dataclass(frozen=True)
class QuantPlan:
    form: str
    scale_input: int | None  # local id of the static/global scale root
    scale_inverted: bool  # the graph multiplies by that input: the op's scale is its reciprocal
    emit_norm: bool  # the norm output is also read elsewhere
    nodes: frozenset[int]  # local ids absorbed with the quant
    exits: tuple[tuple[int, str], ...]  # (local id, role) read from outside


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
    for form in quant_forms:
        for inverted in (False, True) if scale_root is not None else (False,):
            roles = _roles(prober, form, env[out], probe, scale_root, inverted, exits, env)
            if roles is not None:
                return QuantPlan(form=form, scale_input=scale_root, scale_inverted=inverted,
                                 emit_norm=emit_norm, nodes=ids,
                                 exits=tuple((enc.local[n], r) for n, r in zip(exits, roles)))
    return None


def _roles(prober: Prober, form, normed, probe, scale_root, inverted, exits, env) -> list[str] | None:
    """Each exit's role if the tail computes `form` from `normed` (None if it does not)."""
    if (scale_root is not None) != (form == "fp8_static") and form != "nvfp4":
        return None
    scale_in = None
    if scale_root is not None:
        scale_in = probe.real[prober.enc.nodes[scale_root]].float()
        scale_in = 1.0 / scale_in if inverted else scale_in
    fp8 = None
    if form != "nvfp4":
        fp8 = next((value(n).dtype for n in exits if value(n).dtype in FP8_DTYPES), None)
        if fp8 != quant_ref.fp8_dtype(prober.device):
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
