"""Toy bases shipped in omgrpo/bases/: what a preset asks for, installed intact, never trusted
when damaged, and reproducible by the project's own command."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from omgrpo.config import compose
from omgrpo.models.base_key import recipe_key, toy_base_key
from omgrpo.models.bases import MANIFEST, SHIPPED_DIR, install_shipped, ship_base, shipped_base
from omgrpo.models.toy import ensure_toy_base

SHIPPED = sorted(SHIPPED_DIR.glob("toy-base-*"))


def _overrides(manifest: dict) -> list[str]:
    return manifest["command"].split()[2:]  # "omgrpo base <overrides>"


@pytest.mark.parametrize("base", SHIPPED, ids=[p.name for p in SHIPPED])
@pytest.mark.slow
def test_a_shipped_base_is_what_its_command_asks_for(base):
    """The manifest's recipe hashes to the directory's key, and composing the manifest's
    command today gives that key: a change to a preset or to the recipe cannot silently leave a
    stale shipped base in use (its key would no longer be asked for)."""
    manifest = json.loads((base / MANIFEST).read_text())
    assert (
        base.name == f"toy-base-{manifest['key']}" == f"toy-base-{recipe_key(manifest['recipe'])}"
    )
    cfg = compose(_overrides(manifest))
    assert toy_base_key(cfg.model, cfg.task) == manifest["key"]
    assert shipped_base(manifest["key"]) == base  # every file matches its sha256
    assert json.loads((base / "checks.json").read_text())["passed"]


def test_the_shortcut_preset_has_a_shipped_base():
    cfg = compose(["experiment=toy_shortcut"])
    assert shipped_base(toy_base_key(cfg.model, cfg.task)) is not None


SHIPPED_PRMS = sorted(SHIPPED_DIR.glob("toy-prm-*"))


@pytest.mark.parametrize("prm", SHIPPED_PRMS, ids=[p.name for p in SHIPPED_PRMS])
def test_a_shipped_toy_prm_is_what_its_command_asks_for(prm):
    """As for the bases: the manifest's recipe hashes to the directory's key, today's config
    composed from its command (`omgrpo prm train <overrides>`) asks for that key, every file is
    intact, and it passed its acceptance check."""
    from omgrpo.models.toy_prm import toy_prm_recipe

    manifest = json.loads((prm / MANIFEST).read_text())
    assert prm.name == f"toy-prm-{manifest['key']}" == f"toy-prm-{recipe_key(manifest['recipe'])}"
    assert manifest["command"].startswith("omgrpo prm train")
    cfg = compose(manifest["command"].split()[3:])
    assert recipe_key(toy_prm_recipe(cfg.model, cfg.task, cfg.reward.prm.toy)) == manifest["key"]
    assert shipped_base(manifest["key"], prefix="toy-prm") == prm
    assert json.loads((prm / "checks.json").read_text())["passed"]


def test_the_shortcut_preset_has_a_shipped_toy_prm():
    """`method=prm` in the shortcut world uses a shipped toy PRM, not one trained on first use."""
    from omgrpo.models.toy_prm import toy_prm_recipe

    cfg = compose(["experiment=toy_shortcut", "method=prm"])
    key = recipe_key(toy_prm_recipe(cfg.model, cfg.task, cfg.reward.prm.toy))
    assert shipped_base(key, prefix="toy-prm") is not None


def _fake_base(root: Path, key: str, passed: bool = True) -> Path:
    base = root / f"toy-base-{key}"
    base.mkdir(parents=True)
    (base / "config.json").write_text("{}")
    (base / "model.safetensors").write_bytes(b"weights")
    (base / "checks.json").write_text(json.dumps({"passed": passed}))
    return base


def test_install_copies_an_intact_shipped_base(tmp_path, capsys):
    shipped = tmp_path / "bases"
    ship_base(_fake_base(tmp_path / "trained", "abc"), {"r": 1}, "omgrpo base x=1", shipped)
    out = tmp_path / "cache" / "toy-base-abc"
    out.parent.mkdir()
    assert install_shipped("abc", out, shipped)
    assert (out / "model.safetensors").read_bytes() == b"weights"
    assert (
        "using the shipped base toy-base-abc (made by `omgrpo base x=1`)" in capsys.readouterr().out
    )
    assert not install_shipped("other", tmp_path / "cache" / "toy-base-other", shipped)


def test_a_damaged_shipped_base_is_named_and_not_used(tmp_path):
    shipped = tmp_path / "bases"
    dest = ship_base(_fake_base(tmp_path / "trained", "abc"), {"r": 1}, "omgrpo base", shipped)
    (dest / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\n")
    with pytest.warns(
        UserWarning, match=r"toy-base-abc: model.safetensors is missing or its sha256"
    ):
        assert shipped_base("abc", shipped) is None


def test_only_a_base_that_passed_its_checks_is_shipped(tmp_path):
    with pytest.raises(ValueError, match="failed its checks"):
        ship_base(_fake_base(tmp_path, "bad", passed=False), {}, "omgrpo base", tmp_path / "out")


def test_ensure_uses_the_shipped_base_unless_told_not_to(tiny_overrides, tmp_path, monkeypatch):
    """With a shipped base of the asked key, no SFT runs; `model.warm_start.shipped=false`
    trains (and the setting is not part of the key)."""
    import omgrpo.models.toy as toy

    cfg = compose([*tiny_overrides, f"model.cache_dir={tmp_path / 'cache'}"])
    key = toy_base_key(cfg.model, cfg.task)
    shipped = tmp_path / "bases"
    ship_base(_fake_base(tmp_path / "trained", key), {}, "omgrpo base", shipped)
    monkeypatch.setattr(
        toy, "install_shipped", lambda k, out: install_shipped(k, out, shipped_dir=shipped)
    )
    trained = []
    monkeypatch.setattr(toy, "_train_toy_base", lambda *a: trained.append(a[-1]) or a[-1])
    assert (ensure_toy_base(cfg.model, cfg.task, set()) / "model.safetensors").read_bytes() == (
        b"weights"
    )
    assert not trained
    off = compose(
        [
            *tiny_overrides,
            f"model.cache_dir={tmp_path / 'cache2'}",
            "model.warm_start.shipped=false",
        ]
    )
    assert toy_base_key(off.model, off.task) == key
    ensure_toy_base(off.model, off.task, set())
    assert trained == [tmp_path / "cache2" / f"toy-base-{key}"]


def _sft_steps(base: Path) -> int:
    return json.loads((base / MANIFEST).read_text())["recipe"]["warm_start"]["steps"]


# CI retrains the cheapest shipped base (minutes); OMGRPO_RETRAIN_ALL_BASES=1 retrains them all
# (the 1200-step shortcut base takes 8-20 min on 2 cores).
RETRAINED = (
    SHIPPED if os.environ.get("OMGRPO_RETRAIN_ALL_BASES") else sorted(SHIPPED, key=_sft_steps)[:1]
)


@pytest.mark.slow
@pytest.mark.parametrize("base", RETRAINED, ids=[p.name for p in RETRAINED])
def test_retraining_a_shipped_base_meets_its_acceptance_checks(base, tmp_path):
    """`omgrpo base <command> model.warm_start.shipped=false` trains the base again (one
    thread, minutes) and its own acceptance checks pass, as the shipped base's did. The bytes
    need not match: the shortcut base predates one-thread base training (its manifest's note),
    and float kernels differ between CPUs."""
    from omgrpo.models.basecheck import read_base_checks
    from omgrpo.models.loading import base_model_dir
    from omgrpo.tasks.registry import load_task

    manifest = json.loads((base / MANIFEST).read_text())
    cfg = compose(
        [*_overrides(manifest), "model.warm_start.shipped=false", f"model.cache_dir={tmp_path}"]
    )
    retrained = Path(base_model_dir(cfg.model, cfg.task, load_task(cfg.task)))
    assert retrained.name == base.name
    checks = read_base_checks(retrained)
    shipped_checks = read_base_checks(base)
    assert checks["passed"], checks
    assert [c["check"] for c in checks["checks"]] == [c["check"] for c in shipped_checks["checks"]]
    shutil.rmtree(retrained)
