"""Shim for torch 2.11 (the GPU machine's version), installed by the GPU scripts only.

torch 2.11's register_replacement hands `extra_check` the match of the re-traced pattern, whose
kwargs lack a literal eps (the re-trace bakes it in); torch 2.13 fills missing kwargs from the
first match. arfusion.fusion_pass.ArFusionPass._accept reads match.kwargs["eps"] and so raises
KeyError on 2.11. The fix belongs in _accept (read eps with .get(); missing means literal); until
then this wrapper supplies a stand-in float, whose value nothing reads (only its type is checked,
and the replacement is traced from the first match, which has the real eps).
"""

from __future__ import annotations


def install() -> None:
    from arfusion.fusion_pass import ArFusionPass

    accept = ArFusionPass._accept
    if getattr(accept, "_torch211_eps_shim", False):
        return

    def _accept(self, spec, match):
        if spec.eps == "literal" and "eps" not in match.kwargs:
            match.kwargs["eps"] = 0.0
        return accept(self, spec, match)

    _accept._torch211_eps_shim = True
    ArFusionPass._accept = _accept
