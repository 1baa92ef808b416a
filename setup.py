"""Ships the top-level `conf/` inside the package as `speechattn/conf` (package data), so a
plain `pip install .` runs every command; everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["speechattn", "speechattn.*"]), "speechattn.conf"],
    package_dir={"speechattn.conf": "conf"},
)
