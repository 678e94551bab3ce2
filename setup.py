"""Which folders become which import packages. Everything else about the project is in pyproject.toml.

The packages are discovered, never listed (STYLE.md, habit 15): every folder with an __init__.py under a root
below is in the wheel, so a new subpackage cannot be left out of the image while an editable checkout hides
it. tests/test_static_checks.py checks what this finds; tests/test_packaging.py builds, installs and runs it.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
# import package -> folder. engine/ and operator/ are stallfree.engine / stallfree.operator: a top-level
# package named "operator" would shadow the standard library, so never import it bare. experiments/ and
# tests/ are under no root, so they are never packaged.
ROOTS = {"stallfree": "stallfree", "stallfree.engine": "engine", "stallfree.operator": "operator"}
# The request-length CSVs (data/traces/) go into a wheel as stallfree/traces/, package data only (no code):
# stallfree.bench.traces reads the checkout's folder first, so an editable install uses data/traces/ as is.
DATA_PACKAGES = {
    "stallfree.traces": "data/traces",
    "stallfree.crds": "crds",
}  # local mode validates with the CRD
PACKAGE_DATA = {
    "": ["*.yaml", "*.json", "*.jinja"],
    "stallfree.engine.kernels": ["*.cpp"],  # the CPU kernels, built on the machine at first use
    "stallfree.traces": ["*.csv", "SOURCES.md"],
}


def discover(root: Path = HERE) -> list[str]:
    """Every import package the wheel holds: each root and each folder with an __init__.py under it."""
    packages = []
    for name, folder in ROOTS.items():
        packages += [name, *(f"{name}.{sub}" for sub in find_packages(str(root / folder)))]
    return sorted(packages + list(DATA_PACKAGES))


if __name__ == "__main__":
    setup(package_dir={**ROOTS, **DATA_PACKAGES}, packages=discover(), package_data=PACKAGE_DATA)
