"""The locked environment (constraints/lock.txt, written by `make lock`): pyproject.toml's ranges
admit every pin, the Makefile installs under it, and the resolver reproduces it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the lock installs tomli there
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "constraints" / "lock.txt"
LOCK_IN = REPO / "constraints" / "lock.in"
EXTRAS = ("dev", "verl", "notebooks")
"""The extras `make lock` resolves (the Makefile's LOCK_EXTRAS)."""


def lock_pins(text: str) -> list[tuple[str, Version, Marker | None]]:
    """(name, version, environment marker) of every `name==version[ ; marker]` line."""
    pins = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"lock.txt: '{line}' is not a pin"
        pins.append((canonicalize_name(req.name), Version(specs[0].version), req.marker))
    return pins


def lock_date(text: str) -> str:
    found = re.search(r"--exclude-newer (\d{4}-\d{2}-\d{2})", text)
    assert found, "lock.txt's header does not record the resolver's --exclude-newer date"
    return found.group(1)


def requirements() -> list[Requirement]:
    """pyproject.toml's dependencies and the locked extras' requirements."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in EXTRAS:
        lines += project["optional-dependencies"][extra]
    lines += [line for line in LOCK_IN.read_text().splitlines() if line.split("#")[0].strip()]
    return [Requirement(line.split("#")[0].strip()) for line in lines]


def test_pins_parse_and_carry_markers():
    pins = lock_pins("a==1.0\n    # via b\nB_c==2.0 ; python_full_version < '3.11'\n")
    assert pins[0] == ("a", Version("1.0"), None)
    assert (
        pins[1][:2] == ("b-c", Version("2.0")) and str(pins[1][2]) == 'python_full_version < "3.11"'
    )
    with pytest.raises(AssertionError, match="not a pin"):
        lock_pins("torch>=2.4\n")


def test_pyprojects_ranges_admit_every_locked_version():
    """Each requirement's range admits the version locked for every Python the lock covers (a
    package locked per Python version appears once per version, each with its marker)."""
    pins = lock_pins(LOCK.read_text())
    locked = {name for name, _, _ in pins}
    refused = []
    for req in requirements():
        name = canonicalize_name(req.name)
        assert name in locked, f"{req.name} (pyproject.toml / lock.in) is missing from lock.txt"
        refused += [
            f"{req.name}=={version} not in '{req.specifier}'"
            for pinned, version, _ in pins
            if pinned == name and not req.specifier.contains(version, prereleases=True)
        ]
    assert not refused, refused


def test_makefile_installs_under_the_lock_and_torch_from_lock_in():
    makefile = (REPO / "Makefile").read_text()
    # every editable install (through uv, falling back to pip: the INSTALL function) is
    # constrained by the lock, and uv itself is the lock's pin
    installs = [line for line in makefile.splitlines() if "$(INSTALL) -e" in line]
    assert len(installs) == 2 and all("-c $(LOCK)" in line for line in installs), installs
    assert "INSTALL = install() { $(VENV)/bin/uv pip install" in makefile
    assert '|| $(PY) -m pip install -q --no-compile "$$@"; }; install' in makefile
    assert """$(PIP_INSTALL) "$$(grep '^uv==' $(LOCK))\"""" in makefile
    assert (
        "LOCK := constraints/lock.txt" in makefile
        and "LOCK_EXTRAS := " + " ".join(EXTRAS) in makefile
    )
    torch_in = [v for n, v, _ in lock_pins(LOCK_IN.read_text()) if n == "torch"]
    torch_locked = [v for n, v, _ in lock_pins(LOCK.read_text()) if n == "torch"]
    assert torch_in and torch_locked == torch_in


def test_the_running_environment_is_the_locked_one():
    """`make test` runs in the environment `make setup` installed under the lock: every locked
    package that is installed here has the locked version (a local build tag such as torch's
    `+cpu` aside)."""
    from importlib import metadata

    from packaging.markers import default_environment

    env = default_environment()
    differ = []
    for name, version, marker in lock_pins(LOCK.read_text()):
        if marker is not None and not marker.evaluate(env):
            continue
        try:
            installed = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            continue
        if Version(installed.public) != version:
            differ.append(f"{name}: installed {installed}, locked {version}")
    if differ and not Path(sys.prefix, ".installed").exists():
        pytest.skip(f"not the Makefile's venv ({sys.prefix}); differs from the lock: {differ}")
    assert not differ, f"`make setup` did not install the lock (rerun it): {differ}"


@pytest.mark.e2e
@pytest.mark.slow
def test_lock_resolves_again_to_the_same_pins(tmp_path):
    """uv, at the lock's cut-off date, resolves pyproject.toml + lock.in to exactly lock.txt's
    pins: the lock is a resolver's output, not a hand edit. Skips when uv is missing or the
    package registry cannot be reached."""
    beside = Path(sys.executable).parent / "uv"
    uv = str(beside) if beside.is_file() else shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not installed (`pip install uv`, part of the dev extra)")
    text = LOCK.read_text()
    out = tmp_path / "lock.txt"
    command = [uv, "pip", "compile", "pyproject.toml", str(LOCK_IN)]
    for extra in EXTRAS:
        command += ["--extra", extra]
    command += ["--universal", "--python-version", "3.10", "--exclude-newer", lock_date(text)]
    command += ["--no-header", "-q", "-o", str(out)]
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.skip("uv pip compile did not finish in 300 s: the package registry is unreachable")
    if done.returncode != 0 and re.search(
        r"(?i)connect|network|dns|offline|timed out", done.stderr
    ):
        pytest.skip(f"the package registry is unreachable: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr
    assert sorted(map(str, lock_pins(out.read_text()))) == sorted(map(str, lock_pins(text)))


def test_setup_leaves_bytecode_to_first_use_and_make_writes_it():
    """Setup compiles nothing at install (a fresh machine's setup took 120-170 s compiling the
    whole environment, 45-50 s without); make's commands then write each module's bytecode on
    its first import, whatever the caller's PYTHONDONTWRITEBYTECODE."""
    makefile = (REPO / "Makefile").read_text()
    assert "--compile-bytecode" not in makefile
    assert "\nunexport PYTHONDONTWRITEBYTECODE\n" in makefile
    assert "PIP_INSTALL := $(PY) -m pip install -q --no-compile" in makefile
    torch_installs = [ln for ln in makefile.splitlines() if '"torch==$(TORCH_VERSION)' in ln]
    assert torch_installs and all("$(PIP_INSTALL)" in ln for ln in torch_installs), torch_installs
