"""What a non-editable install (``pip install .``, a wheel) ships: the files the package reads at run time without
an option must be package data, or ``dynabatch train`` works from a clone and fails once installed."""
import os
import tomllib
from pathlib import Path

import dynabatch
from dynabatch.data.builtin import default_mixture_path

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = Path(os.path.abspath(dynabatch.__file__)).parent


def _shipped() -> set[Path]:
    """The package's non-Python files a wheel holds: ``[tool.setuptools.package-data]`` globs of ``dynabatch``."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["dynabatch"]
    return {Path(os.path.abspath(p)) for pattern in patterns for p in PACKAGE.glob(pattern) if p.is_file()}


def test_the_built_in_mixture_spec_is_package_data():
    path = Path(os.path.abspath(default_mixture_path()))  # not resolved: a path reached through data/'s link fails
    assert path.is_relative_to(PACKAGE), f"{path} lies outside the package: a wheel would not hold it"
    assert path in _shipped(), f"{path} is not matched by [tool.setuptools.package-data]"


def test_the_built_in_tokenizer_is_package_data():
    tokenizer = PACKAGE / "assets" / "tokenizer"
    assert {tokenizer / "tokenizer.json", tokenizer / "tokenizer_config.json"} <= _shipped()


def test_the_repository_path_of_the_built_in_mixture_still_reads_it():
    """Docs and commands run from a clone name ``data/flan_mini.yaml``; it links to the package's copy."""
    assert os.path.samefile(ROOT / "data" / "flan_mini.yaml", default_mixture_path())
