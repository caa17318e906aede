"""A default-mode generate() step's host time by operator, off and on side by side. Not collected by pytest.

    python benchmarks/probes/probe_generate_ops.py [bench_hf_decode arguments]

Runs benchmarks/bench_hf_decode.py (phase generate, --generate-mode default, --fake-world 2,
--flashinfer-host-path unless --backend is given, both configs in one process) on a GPU. Its
profiled calls (one of each length per config, after the pairs) also go through this probe: each
operator's and CUDA runtime call's host time per new token, by difference of the two lengths, off
next to on, largest difference first. Writes the long calls' Chrome traces to --out.

--cprofile: Python's profiler (cProfile) over those calls instead: each function's own time, the
same C function's time per call in off and on (a state that slows everything one config runs shows
there), into --out as cprof_CONFIG_N.txt.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_hf_decode  # noqa: E402
import decode_host  # noqa: E402

# (config, new tokens) -> {operator: [calls, self host us]}
_seen: dict[tuple[str, int], dict[str, list]] = {}
_order: list[str] = []


def _next_config() -> str:
    """The config of the next profiled call: profile_variant profiles off's two lengths, then on's."""
    _order.append("on" if len(_order) >= 2 else "off")
    return _order[-1]


def main() -> int:
    extra = sys.argv[1:]
    python_profile = "--cprofile" in extra
    extra = [a for a in extra if a != "--cprofile"]
    argv = ["--fake-world", "2", "--phases", "generate", "--generate-mode", "default", "--configs", "off", "on",
            "--pairs", "4", *extra]
    if "--backend" not in extra:
        argv.append("--flashinfer-host-path")
    out = Path(extra[extra.index("--out") + 1] if "--out" in extra else os.environ.get("OUT", "."))

    profile_call = decode_host.profile_call

    def seen(prof, n):
        config = _next_config()
        _seen[config, n] = {e.key: [e.count, e.self_cpu_time_total] for e in prof.key_averages()
                            if e.self_cpu_time_total > 0}
        if n == max(ns for c, ns in _seen if c == config):
            prof.export_chrome_trace(str(out / f"trace_{config}_{n}.json"))

    if python_profile:  # no torch profile to count kernels in: GPU busy time unknown
        decode_host.profile_call = lambda call, n: python_profiled(call, n, out)
        decode_host.per_token_counts = lambda *a: {"gpu_busy_ms": {"per_token": float("nan")}}
        bench_hf_decode.main(argv)
        return 0
    decode_host.profile_call = lambda call, n: profile_call(call, n, inspect=seen)
    bench_hf_decode.main(argv)
    lengths = sorted({n for _, n in _seen})
    if len(lengths) != 2 or len(_seen) != 4:
        print(f"profiled calls: {sorted(_seen)}: expected two lengths per config")
        return 1
    short, long = lengths

    def per_token(config):
        a, b = _seen[config, long], _seen[config, short]
        return {k: ((a.get(k, [0, 0])[0] - b.get(k, [0, 0])[0]) / (long - short),
                    (a.get(k, [0, 0])[1] - b.get(k, [0, 0])[1]) / (long - short)) for k in set(a) | set(b)}

    off, on = per_token("off"), per_token("on")
    rows = sorted(((on.get(k, (0, 0))[1] - off.get(k, (0, 0))[1], k) for k in set(off) | set(on)),
                  key=lambda r: -abs(r[0]))
    total = {c: sum(v[1] for v in t.values()) for c, t in (("off", off), ("on", on))}
    print(f"self host time per new token (us, profiler on): off {total['off']:.0f}, on {total['on']:.0f}")
    print(f"{'on-off us':>10} {'off calls':>9} {'off us':>8} {'on calls':>9} {'on us':>8}  operator")
    for diff, k in rows[:40]:
        (oc, ou), (nc, nu) = off.get(k, (0, 0)), on.get(k, (0, 0))
        print(f"{diff:10.1f} {oc:9.1f} {ou:8.1f} {nc:9.1f} {nu:8.1f}  {k[:90]}")
    (out / "generate_ops.json").write_text(json.dumps(
        {"lengths": [short, long], "per_token": {"off": off, "on": on}}, indent=1))
    return 0


def python_profiled(call, n: int, out: Path) -> dict:
    """One call under cProfile (functions by own time, into out/cprof_CONFIG_N.txt)."""
    import torch

    config = _next_config()
    profile = cProfile.Profile()
    profile.enable()
    call(n)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(60)
    (out / f"cprof_{config}_{n}.txt").write_text(text.getvalue())
    return {}


if __name__ == "__main__":
    sys.exit(main())
