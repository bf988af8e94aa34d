"""The package's layers (README "Architecture"): each part of omgrpo/ imports only the parts
below it. Every import statement counts, those inside functions too, so a lazy import cannot
hide an upward dependency."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "omgrpo"

# part -> the parts it may import (itself always). Longest prefix wins. The algorithm imports
# nothing of omgrpo: the types a task hands it (Problem, TaskProbe) and the prompt template are
# its own (`omgrpo.core.task`, `omgrpo.core.prompt`), the tasks (toy world, file loaders) sit
# above it.
BELOW = {
    "omgrpo.errors": set(),  # the one error type of bad input: usable everywhere
    "omgrpo.staging": set(),  # all-or-nothing writes (temporary, then rename): usable everywhere
    "omgrpo.console": set(),
    "omgrpo.tracking": set(),
    "omgrpo.core": set(),
    "omgrpo.tasks": {"omgrpo.core"},
    "omgrpo.generation": {"omgrpo.core", "omgrpo.tasks"},
    "omgrpo.models": {"omgrpo.core", "omgrpo.generation", "omgrpo.tasks", "omgrpo.console"},
    "omgrpo.config": {"omgrpo.core", "omgrpo.tasks", "omgrpo.tracking"},
}
for _part_name in BELOW:
    if _part_name not in ("omgrpo.errors", "omgrpo.staging"):
        BELOW[_part_name].add("omgrpo.errors")
LOWER = set(BELOW)
BELOW["omgrpo.backends"] = LOWER
BELOW["omgrpo.analysis"] = LOWER
BELOW["omgrpo.eval"] = LOWER | {"omgrpo.backends", "omgrpo.analysis"}
# the commands on top may import anything
TOP = ("omgrpo.cli", "omgrpo.sweep", "omgrpo.tools", "omgrpo.__main__", "omgrpo")


def _part(module: str, parts) -> str | None:
    """The longest listed part that `module` belongs to."""
    hits = [p for p in parts if module == p or module.startswith(p + ".")]
    return max(hits, key=len) if hits else None


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from omgrpo import x` imports the submodule omgrpo.x
            base = node.module
            names += [f"{base}.{a.name}" if base == "omgrpo" else base for a in node.names]
    return [n for n in names if n == "omgrpo" or n.startswith("omgrpo.")]


def upward_imports() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        if _part(module, TOP) and not _part(module, BELOW):
            continue
        own = _part(module, BELOW)
        assert own is not None, f"{module} is in no layer: add it to BELOW or TOP"
        allowed = BELOW[own] | {own}
        for name in _imports(path):
            target = _part(name, BELOW) or name
            if target not in allowed and not any(target.startswith(a + ".") for a in allowed):
                found.append(f"{module} imports {name}")
    return found


def test_every_import_points_down_the_layers():
    assert upward_imports() == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """Core modules importing the engine or a task are reported (the check is not vacuous)."""
    (tmp_path / "omgrpo" / "core").mkdir(parents=True)
    (tmp_path / "omgrpo" / "core" / "x.py").write_text(
        "def f():\n    from omgrpo.generation.engine import decode\n"
    )
    (tmp_path / "omgrpo" / "core" / "y.py").write_text("from omgrpo.tasks.toy import ToyProbe\n")
    (tmp_path / "omgrpo" / "core" / "z.py").write_text("from omgrpo.core.task import Problem\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path / "omgrpo")
    assert upward_imports() == [
        "omgrpo.core.x imports omgrpo.generation.engine",
        "omgrpo.core.y imports omgrpo.tasks.toy",
    ]


def test_train_finds_backends_by_folder(capsys):
    """`backend=NAME` is the folder omgrpo/backends/NAME/ with a launch.py; others are named."""
    from omgrpo import cli

    assert cli.available_backends() == ["native", "verl"]
    assert cli.main(["train", "backend=nope", "trainer.steps=1"]) == 2
    assert "unknown backend 'nope' (native, verl)" in capsys.readouterr().err
