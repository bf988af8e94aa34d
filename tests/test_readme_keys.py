"""The docs name config keys that exist (the README once said G for `rollout.n`)."""

import re
from pathlib import Path

import pytest

from omgrpo.config import compose, to_container

REPO = Path(__file__).resolve().parent.parent
# docs/verl.md is left out: it documents verl's own config, whose `trainer.*`, `reward.*` and
# `algorithm.*` sections hold other keys than omgrpo's (verl's `validate_config` checks those).
DOCS = [
    "README.md",
    "analysis/README.md",
    "sweeps/README.md",
    *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md") if p.name != "verl.md"),
]
FILE_SUFFIXES = {"safetensors", "bin", "json", "jsonl", "parquet", "yaml", "log", "md", "png", "py"}
# A dotted name preceded by `.`, `/` or a word character is part of a module path or a file name
# (`omgrpo.generation.rollout.sample`, `generation/rollout.py`), not a config key.
KEY = re.compile(r"(?<![\w./])([a-z_]+(?:\.[a-z_0-9]+)+)")


def _has(config: dict, key: str) -> bool:
    node = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _blocks(text: str) -> list[str]:
    """Fenced code blocks whole, and the paragraphs of prose between them."""
    blocks = []
    for i, part in enumerate(re.split(r"^```.*$", text, flags=re.M)):
        blocks += [part] if i % 2 else part.split("\n\n")
    return blocks


def named_keys(text: str, config: dict) -> set[str]:
    """The omgrpo config keys `text` names. A block (paragraph or code block) that mentions verl
    is left out: verl's own config has `trainer.*`, `algorithm.*`, `reward.*` and `data.*`
    sections of other keys (`trainer.n_gpus_per_node`), which verl's `validate_config` checks."""
    keys = set()
    for block in _blocks(text):
        if "verl" not in block:
            keys |= set(KEY.findall(block))
    return {k for k in keys if k.split(".")[0] in config and k.split(".")[-1] not in FILE_SUFFIXES}


@pytest.fixture(scope="module")
def config() -> dict:
    return to_container(compose([]))


@pytest.mark.parametrize("doc", DOCS)
def test_every_config_key_in_the_docs_exists(doc, config):
    keys = named_keys((REPO / doc).read_text(), config)
    assert sorted(k for k in keys if not _has(config, k)) == []


def test_the_user_facing_docs_name_config_keys(config):
    """Guards the check above against a pattern that silently stops matching."""
    for doc in ["README.md", "analysis/README.md", "sweeps/README.md", "docs/configuration.md"]:
        assert named_keys((REPO / doc).read_text(), config), f"{doc} names no config key"


def test_a_verl_block_is_exempt_and_a_native_one_is_checked(config):
    text = "omgrpo train trainer.nnodes=4\n\nomgrpo train backend=verl trainer.nnodes=4\n"
    assert named_keys(text, config) == {"trainer.nnodes"}
    assert named_keys("see `omgrpo.generation.rollout.sample` and rollout.py", config) == set()


def test_readme_names_the_rollout_count_by_its_key():
    text = (REPO / "README.md").read_text()
    assert "`rollout.n`" in text and not re.search(r"[×(] ?G\b|\bG rollouts|\bG −", text)
