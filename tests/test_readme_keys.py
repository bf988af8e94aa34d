"""The docs name config keys that exist (issue 10: the README said G for `rollout.n`)."""

import re
from pathlib import Path

import pytest

from omgrpo.config import compose, to_container

REPO = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "analysis/README.md", "sweeps/README.md"]
FILE_SUFFIXES = {"safetensors", "bin", "json", "jsonl", "parquet", "yaml", "log", "md", "png", "py"}


def _has(config: dict, key: str) -> bool:
    node = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


@pytest.mark.parametrize("doc", DOCS)
def test_every_config_key_in_the_docs_exists(doc):
    config = to_container(compose([]))
    text = (REPO / doc).read_text()
    keys = set(re.findall(r"\b([a-z_]+(?:\.[a-z_0-9]+)+)", text))
    keys = {k for k in keys if k.split(".")[0] in config and k.split(".")[-1] not in FILE_SUFFIXES}
    assert keys, f"{doc} names no config key"
    assert sorted(k for k in keys if not _has(config, k)) == []


def test_readme_names_the_rollout_count_by_its_key():
    text = (REPO / "README.md").read_text()
    assert "`rollout.n`" in text and not re.search(r"[×(] ?G\b|\bG rollouts|\bG −", text)
