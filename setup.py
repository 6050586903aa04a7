"""The model cards live in ``models/`` (the project's layout) and ship in the wheel as ``anytime.cards``."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["anytime", "anytime.*"]), "anytime.cards"],
    package_dir={"anytime.cards": "models"},
)
