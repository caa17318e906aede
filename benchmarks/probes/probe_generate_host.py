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
import io
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
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
    print(text.getvalue())
    print(f"host-GPU synchronisations ({config}): {sum(sites.values())}")
    for where, n in sites.most_common(15):
        print(f"  {n:7d}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
