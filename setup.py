import re
from pathlib import Path

from setuptools import find_packages, setup

version = re.search(r'__version__ = "([^"]+)"', Path("arfusion/version.py").read_text()).group(1)

setup(
    name="arfusion",
    version=version,
    description="torch.compile pass fusing all_reduce -> residual add -> RMSNorm (-> quant) "
    "into one kernel (FlashInfer on CUDA, aiter on ROCm, PyTorch reference elsewhere)",
    long_description=Path("README.md").read_text(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["arfusion", "arfusion.*"]),
    python_requires=">=3.10",
    # 2.11 is the oldest torch CI runs (the quick loop; GPU runs used 2.11 too); CI also runs the full
    # suite on 2.13.0 and the quick loop on PyPI's newest release (.ci/run).
    install_requires=["torch>=2.11"],
    extras_require={
        "hf": ["transformers>=5.0", "accelerate"],
        "flashinfer": ["flashinfer-python==0.7.2.post1"],
        "plot": ["matplotlib"],
        "test": ["pytest>=8", "pytest-xdist>=3", "transformers>=5.0", "accelerate", "torchao>=0.18", "matplotlib"],
    },
    entry_points={"console_scripts": ["arfusion=arfusion.cli:main"]},
)
