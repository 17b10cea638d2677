"""What a non-editable install (``pip install .``, a wheel) ships: the files the package reads at run time without
an option must be package data, or ``dynabatch train`` works from a clone and fails once installed."""
import importlib
import os
import sys
from pathlib import Path

import dynabatch
from dynabatch.data.builtin import default_mixture_path

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = Path(os.path.abspath(dynabatch.__file__)).parent


def _pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _shipped() -> set[Path]:
    """The package's non-Python files a wheel holds: ``[tool.setuptools.package-data]`` globs of ``dynabatch``."""
    config = _pyproject()
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


def test_toml_files_read_on_python_3_10(monkeypatch):
    """``requires-python`` allows 3.10, whose standard library has no ``tomllib``: the reader falls back to
    ``tomli``, which the package then depends on."""
    from dynabatch.data import user_files

    config = _pyproject()
    if config["project"]["requires-python"].replace(" ", "") == ">=3.10":
        tomli = [d for d in config["project"]["dependencies"] if d.replace(" ", "").startswith("tomli")]
        assert tomli and "python_version<'3.11'" in tomli[0].replace(" ", "").replace('"', "'"), tomli

    parser = importlib.import_module("tomllib" if sys.version_info >= (3, 11) else "tomli")
    monkeypatch.setitem(sys.modules, "tomli", parser)  # tomli where it is not installed: the same parser
    monkeypatch.setitem(sys.modules, "tomllib", None)  # what Python 3.10 has: the import fails
    assert user_files._parse_toml('name = "m"\n', "spec m.toml") == {"name": "m"}
