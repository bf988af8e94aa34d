"""OmegaConf (and Hydra) read YAML with libyaml (omgrpo.config.read_yaml_with_libyaml): the same
data and errors as OmegaConf's own pure-Python loader, for every YAML file omgrpo composes."""

from __future__ import annotations

import io
from pathlib import Path

import omegaconf._utils as omegaconf_utils
import pytest
import yaml
from omegaconf import OmegaConf

import omgrpo.config
from omgrpo.config import read_yaml_with_libyaml

REPO = Path(__file__).resolve().parents[1]


def _python_loader() -> type:
    """OmegaConf's loader with PyYAML's pure-Python parser (the libyaml class's second base)."""
    read_yaml_with_libyaml()
    loader = omegaconf_utils.get_yaml_loader()
    assert loader.__mro__[1] is yaml.CSafeLoader
    return next(base for base in loader.__mro__ if base.__module__.startswith("omegaconf"))


def _yaml_files() -> list[Path]:
    import hydra
    import verl

    roots = [REPO / "experiments", REPO / "sweeps", Path(verl.__file__).parent / "trainer/config"]
    files = [f for root in roots for f in sorted(root.rglob("*.yaml"))]
    files += sorted((Path(hydra.__file__).parent / "conf").rglob("*.yaml"))
    return files + sorted((REPO / "reports").glob("*/runs/*/config.yaml"))[:20]


def test_every_yaml_file_loads_to_the_same_data():
    python, libyaml = _python_loader(), omegaconf_utils.get_yaml_loader()
    files = _yaml_files()
    assert len(files) > 150
    for path in files:
        text = path.read_text()
        expected = yaml.load(text, Loader=python)
        assert yaml.load(text, Loader=libyaml) == expected, path
        assert repr(yaml.load(text, Loader=libyaml)) == repr(expected), path  # types too


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("a: 1\na: 2\n", "found duplicate key a"),
        ("a: [1, 2\n", "while parsing a flow sequence"),
        ("x: 'open\n", "while scanning a quoted scalar"),
    ],
)
def test_errors_name_the_problem_and_its_line(text, error, tmp_path):
    read_yaml_with_libyaml()
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(yaml.YAMLError, match=error) as raised:
        OmegaConf.load(path)
    assert "line 1" in str(raised.value) or "line 2" in str(raised.value)


def test_omegaconfs_own_rules_hold():
    """Floats without a dot, no timestamps, Paths: OmegaConf's resolvers and constructors."""
    text = "a: 1e-3\nb: .5\nc: 1_000\nd: 2001-01-01\ne: !!python/object/apply:pathlib.Path [x]\n"
    read_yaml_with_libyaml()
    data = yaml.load(io.StringIO(text), Loader=omegaconf_utils.get_yaml_loader())
    assert data == {"a": 0.001, "b": 0.5, "c": 1000, "d": "2001-01-01", "e": Path("x")}


def test_composing_uses_libyaml():
    omgrpo.config.compose(["experiment=toy"])
    assert omegaconf_utils.get_yaml_loader().__mro__[1] is yaml.CSafeLoader
