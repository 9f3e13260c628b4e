"""Package discovery for the build; everything else (metadata, dependencies, scripts) is in
pyproject.toml.

Every folder with an ``__init__.py`` under hpcllm/, kernels/ and datasets/ is a package of the
wheel, so a new package cannot be left out. kernels/ and datasets/ stay at the top of the
repository but install as ``hpcllm.kernels`` and ``hpcllm.datasets``, so nothing installs a
top-level ``kernels`` or ``datasets`` that would shadow the PyPI packages of those names.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent

# Import name of each package root -> its folder, relative to this file.
PACKAGE_DIR = {"hpcllm": "hpcllm", "hpcllm.kernels": "kernels", "hpcllm.datasets": "datasets"}


def discover_packages(package_dir: dict[str, str]) -> list[str]:
    """Each root and every package below it (folders with ``__init__.py`` all the way down)."""
    packages = []
    for name, folder in package_dir.items():
        packages.append(name)
        packages += [f"{name}.{sub}" for sub in find_packages(str(HERE / folder))]
    return sorted(packages)


setup(package_dir=PACKAGE_DIR, packages=discover_packages(PACKAGE_DIR))
