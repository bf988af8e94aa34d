"""`omgrpo.errors.read_yaml` parses with libyaml where PyYAML has it: the data must be
`yaml.safe_load`'s, on real run configs and on YAML's awkward scalars."""

from __future__ import annotations

from pathlib import Path

import yaml

from omgrpo.errors import read_yaml

REPO = Path(__file__).resolve().parents[1]


def test_the_same_data_as_safe_load(tmp_path):
    configs = sorted((REPO / "reports" / "collapse-study-v3" / "runs").glob("*/config.yaml"))
    assert len(configs) >= 12
    for path in configs[:12]:
        assert read_yaml(path) == yaml.safe_load(path.read_text()), path
    awkward = tmp_path / "awkward.yaml"
    awkward.write_text(
        "a: 1e-5\nb: 1.0e-5\nc: .inf\nd: ~\ne: 'yes'\nf: yes\ng: 0o17\nh: 2026-11-27\n"
        "i: [1, {j: null}]\nk: '1'\nl: 0x1F\nm: -.5\n"
    )
    assert read_yaml(awkward) == yaml.safe_load(awkward.read_text())
