"""Packaging for replicate."""

import re
from pathlib import Path

import setuptools

_HERE = Path(__file__).parent
_VERSION = re.search(r'__version__ = "([^"]+)"',
                     (_HERE / "replicate" / "__init__.py").read_text()).group(1)

# tf.estimator ships up to TensorFlow 2.15; 2.13 is the oldest line tested.
_TF_RANGE = ">=2.13,<2.16"

setuptools.setup(
    name="replicate",
    version=_VERSION,
    description=("Run a TensorFlow Estimator model_fn on every local GPU with "
                 "single-device results."),
    long_description=(_HERE / "README.md").read_text() if (
        _HERE / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    packages=["replicate"],
    python_requires=">=3.9,<3.12",
    install_requires=[
        f"tensorflow-estimator{_TF_RANGE}",
        "numpy<2",
        "absl-py>=1.0",
    ],
    extras_require={
        # TensorFlow itself is chosen by the user: the CPU-only wheel, or the
        # full one (GPU capable; add [and-cuda] for pip-installed CUDA).
        "cpu": [f"tensorflow-cpu{_TF_RANGE}"],
        "gpu": [f"tensorflow[and-cuda]{_TF_RANGE}"],
        "tests": [f"tensorflow-cpu{_TF_RANGE}", "pytest>=7", "hypothesis>=6",
                  "pytest-xdist>=3", "scikit-learn>=1.0", "tf-slim>=1.1"],
        "examples": [f"tensorflow-cpu{_TF_RANGE}", "scikit-learn>=1.0"],
        "benchmarks": [f"tensorflow-cpu{_TF_RANGE}", "matplotlib>=3.5"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: Apache Software License",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
