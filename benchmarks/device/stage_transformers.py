"""Once, on the CPU machine, from the project root: stage a transformers release for the GPU machines
(no network there), small enough to travel with .device and .fa3 (a device call carries 64 MiB).

    python benchmarks/device/stage_transformers.py 5.25.0    # -> .whl/transformers-5.25.0.tar.xz

On the machine, TRANSFORMERS_WHEEL=.whl/transformers-5.25.0.tar.xz makes benchmarks/device/device_run.sh
and benchmarks/matrix.py unpack it into a folder of its own, ahead of the machine's transformers.

The tarball holds the release installed as `pip install --target` leaves it, with huggingface_hub 2.4 and
httpx2 (transformers 5.25 needs that hub, newer than the machines'). Nothing is left out: xz packs the
many similar model files 3× tighter than the wheel's zip (5.25 with its hub: 4.6 MB against 14.6 MB).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HUB = ["huggingface_hub==2.4.0"]  # what transformers 5.25 has run with on the GPU machines
HUB_NEEDS = ["httpx2>=2,<3", "click>=8.4.2,<9"]  # hub 2.4's needs beyond the machines' packages, with theirs
HAVE = ("typing_extensions",)  # the machines have these (torch needs them): not carried


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args, "-q"], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", help="the transformers release, e.g. 5.25.0")
    parser.add_argument("--dest", type=Path, default=Path(".whl"))
    parser.add_argument("--no-hub", action="store_true", help="without huggingface_hub (releases before 5.25)")
    args = parser.parse_args()
    args.dest.mkdir(parents=True, exist_ok=True)
    out = args.dest / f"transformers-{args.version}.tar.xz"
    with tempfile.TemporaryDirectory() as tmp:
        wheels, site = Path(tmp, "wheels"), Path(tmp, "site")
        pip("download", "--no-deps", "-d", str(wheels), f"transformers=={args.version}")
        if not args.no_hub:
            pip("download", "--no-deps", "-d", str(wheels), *HUB)
            pip("download", "-d", str(wheels), *HUB_NEEDS)
        carried = sorted(str(p) for p in wheels.glob("*.whl") if not p.name.startswith(HAVE))
        pip("install", "--no-deps", "--no-compile", "--target", str(site), *carried)
        with tarfile.open(out, "w:xz", preset=9) as tar:
            for path in sorted(site.iterdir()):
                tar.add(path, arcname=path.name)
    print(f"{out}: {out.stat().st_size / 1e6:.1f} MB: " + ", ".join(Path(p).name for p in carried))


if __name__ == "__main__":
    main()
