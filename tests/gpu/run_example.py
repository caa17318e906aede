"""Run examples/compile_hf_model.py with the torch 2.11 shim (see compat_torch211.py).

    torchrun --nproc-per-node 2 tests/gpu/run_example.py --backend flashinfer
"""

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compat_torch211  # noqa: E402

compat_torch211.install()
example = Path(__file__).resolve().parents[2] / "examples" / "compile_hf_model.py"
sys.argv = [str(example), *sys.argv[1:]]
runpy.run_path(str(example), run_name="__main__")
