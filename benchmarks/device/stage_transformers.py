"""Once, on the CPU machine, from the project root: stage a transformers release for the GPU machines
(no network there), small enough to travel with .device and .fa3 (a device call carries 64 MiB).

    python benchmarks/device/stage_transformers.py 5.25.0    # -> .whl/transformers-5.25.0-py3-none-any.whl, .whl/hub/

On the machine: TRANSFORMERS_WHEEL=.whl/transformers-5.25.0-py3-none-any.whl TRANSFORMERS_DEPS=.whl/hub
(benchmarks/device/device_run.sh and benchmarks/matrix.py install both apart from the machine's transformers).

The wheel is repacked without the files transformers never imports at run time, `models/*/modular_*.py`
(its own import scan skips them: they generate the modeling files) and each model's image and video
processors (a text model never loads them; the auto classes that name them stay): 13.8 MB becomes 10.5 MB. transformers 5.25 needs huggingface_hub
2.4, newer than the machines', and that needs httpx2: those wheels go to .whl/hub.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HUB = "huggingface_hub==2.4.0"  # what transformers 5.25 has run with on the GPU machines
HUB_NEEDS = ["httpx2>=2,<3", "click>=8.4.2,<9"]  # what hub 2.4 needs beyond the machines' packages, with their needs
HAVE = ("typing_extensions",)  # the machines have these (torch needs them): not carried
SKIP_PREFIXES = ("modular_", "image_processing_", "video_processing_")


def download(requirements: list[str], dest: Path, deps: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "-d", str(dest), *requirements]
    subprocess.run(cmd if deps else [*cmd[:4], "--no-deps", *cmd[4:]], check=True)


def slim(wheel: Path, out: Path) -> tuple[int, int]:
    """Copy `wheel` to `out` without the files SKIP_PREFIXES names under transformers/models/ and
    without their RECORD lines; returns (files dropped, bytes of the new wheel)."""
    dropped = set()
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
        for info in src.infolist():
            name = info.filename
            if "/models/" in name and "/models/auto/" not in name and name.rsplit("/", 1)[-1].startswith(SKIP_PREFIXES):
                dropped.add(name)
                continue
            data = src.read(info)
            if name.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if line.split(",", 1)[0] not in dropped).encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    return len(dropped), out.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", help="the transformers release, e.g. 5.25.0")
    parser.add_argument("--dest", type=Path, default=Path(".whl"))
    parser.add_argument("--no-hub", action="store_true", help="skip .whl/hub (releases before 5.25)")
    args = parser.parse_args()
    args.dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        download([f"transformers=={args.version}"], Path(tmp), deps=False)
        (wheel,) = Path(tmp).glob("transformers-*.whl")
        n, size = slim(wheel, args.dest / wheel.name)
        print(f"{args.dest / wheel.name}: {size / 1e6:.1f} MB ({wheel.stat().st_size / 1e6:.1f} MB before; {n} files left out)")
    if not args.no_hub:
        hub = args.dest / "hub"
        hub.mkdir(exist_ok=True)
        download([HUB], hub, deps=False)
        download(HUB_NEEDS, hub, deps=True)
        for p in hub.glob("*.whl"):
            if p.name.startswith(HAVE):
                p.unlink()
        print(f"{hub}: " + ", ".join(sorted(p.name.split("-")[0] for p in hub.glob("*.whl"))))


if __name__ == "__main__":
    main()
