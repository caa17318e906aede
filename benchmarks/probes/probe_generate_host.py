"""Where a default-mode generate() step's host time goes, one config at a time. Not collected by pytest.

    python benchmarks/probes/probe_generate_host.py on|off [bench_hf_decode arguments]

Runs benchmarks/bench_hf_decode.py (phase generate, --generate-mode default, --fake-world 2,
--flashinfer-host-path unless given otherwise) for one config under cProfile, with CUDA's
synchronisation debug mode on: prints the functions with the most own time, and every place that
synchronised the host with the GPU (counted by call site).
"""

from __future__ import annotations

import cProfile
import collections
import pstats
import sys
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_hf_decode  # noqa: E402


def main() -> int:
    config, extra = sys.argv[1], sys.argv[2:]
    argv = ["--fake-world", "2", "--phases", "generate", "--generate-mode", "default", "--configs", config,
            "--pairs", "2", *extra]
    if "--backend" not in extra:
        argv.append("--flashinfer-host-path")
    sites: collections.Counter = collections.Counter()

    def on_warning(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack()[:-2] if "site-packages/torch" not in f.filename]
            sites[" <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[-4:])] += 1

    warnings.simplefilter("always")
    warnings.showwarning = on_warning
    torch.cuda.set_sync_debug_mode("warn")
    profile = cProfile.Profile()
    profile.enable()
    bench_hf_decode.main(argv)
    profile.disable()
    torch.cuda.set_sync_debug_mode(0)
    # What runs on every step: the functions called at least 1,000 times, by own time.
    stats = pstats.Stats(profile).stats
    steady = sorted(((tt, nc, ct, f"{Path(file).name}:{line}({name})") for (file, line, name), (_, nc, tt, ct, _)
                     in stats.items() if nc >= 1000), reverse=True)
    print(f"{'own s':>8} {'calls':>8} {'cum s':>8}  function (called >= 1,000 times)")
    for tt, nc, ct, where in steady[:45]:
        print(f"{tt:8.3f} {nc:8d} {ct:8.3f}  {where}")
    print(f"host-GPU synchronisations ({config}): {sum(sites.values())}")
    for where, n in sites.most_common(15):
        print(f"  {n:7d}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
