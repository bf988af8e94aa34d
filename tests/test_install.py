"""Installs that work away from the checkout: the wheel ships the presets, the GPU pin set
resolves, and the README's GPU install line is the tested one."""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONSTRAINTS = "constraints/gpu.txt"
EXTRAS = ("dev", "gpu")
EXCLUDE_NEWER = "2026-11-26"
"""`uv pip compile --exclude-newer`: move it forward with constraints/gpu.txt."""
GPU_INSTALL = f'pip install -e ".[{",".join(EXTRAS)}]" -c {CONSTRAINTS}'
"""What `make setup-gpu` runs, the README shows and the resolver test resolves."""
# The packages verl 0.9.1's `verl[vllm]` extra pins, the GPU set it was tested with.
VERL_GPU_PINS = ("torch", "torchvision", "torchaudio", "vllm", "transformers")
WHEEL_SOURCES = {"pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "LICENSE", "omgrpo",
                 "experiments"}  # fmt: skip
"""The top-level files and folders setuptools reads to build the wheel: the metadata, setup.py's
presets hook (experiments/), MANIFEST.in, the readme and license the metadata names, the
package (its toy bases as package data). The rest of the tree (reports/, tests/, docs/, ...)
is not copied for the build."""


def _clean_env() -> dict[str, str]:
    """The environment without what points Python at this checkout."""
    return {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME"}}


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].split(";", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{path}: '{line}' is not an exact `name==version` pin"
            pins[name.strip().lower()] = version.strip()
    return pins


@pytest.mark.slow
@pytest.mark.e2e
def test_wheel_ships_the_presets_and_composes_them_outside_the_repo(tmp_path):
    """Build the wheel from a copy of the package's tracked files (`WHEEL_SOURCES`), install it
    into a fresh venv and compose a preset from a folder outside the repository with the
    installed package.

    The venv has no dependencies of its own: a `.pth` file puts this interpreter's
    site-packages (torch, hydra, ...) after the venv's, and the wheel is installed with
    `--no-deps`. Installing the dependencies for real would download and unpack torch (GBs, minutes)
    and test pip rather than the wheel; a plain path in a `.pth` file does not run the
    site-packages' own `.pth` files, so the editable install of the checkout stays inactive and
    `omgrpo` can only come from the wheel (asserted)."""
    src, dist, venv, outside = (tmp_path / d for d in ("src", "dist", "venv", "outside"))
    listing = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    if listing.returncode != 0:
        pytest.skip(
            f"not a git checkout (the wheel is built from its tracked files): {listing.stderr}"
        )
    files = [name for name in listing.stdout.split("\0") if name.split("/")[0] in WHEEL_SOURCES]
    for name in files:  # a copy: an in-tree build would leave build/ and *.egg-info behind
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)],
        check=True, env=_clean_env(),
    )  # fmt: skip
    (wheel,) = dist.glob("omgrpo-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    Path(purelib, "shared-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [*pip, "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True, env=_clean_env(),
    )  # fmt: skip
    outside.mkdir()
    script = (
        "import omgrpo.config as c\n"
        "cfg = c.compose(['experiment=toy_shortcut', 'method=mv'])\n"
        "print(c.__file__); print(c.EXPERIMENTS_DIR); print(cfg.run.experiment, cfg.method)\n"
        "print((c.EXPERIMENTS_DIR / 'verl' / 'paper.yaml').is_file())\n"
    )
    out = subprocess.run(
        [python, "-c", script], cwd=outside, capture_output=True, text=True, env=_clean_env()
    )
    assert out.returncode == 0, out.stderr[-3000:]
    module, presets, composed, verl_preset = out.stdout.strip().splitlines()[-4:]
    assert Path(module).is_relative_to(venv), f"omgrpo imported from {module}, not the venv"
    assert Path(presets) == Path(module).parent / "_presets"
    assert composed == "toy_shortcut mv"
    assert verl_preset == "True"


def test_gpu_pins_are_verls_tested_set():
    """constraints/gpu.txt pins what verl 0.9.1's own `verl[vllm]` extra pins, to the same
    versions (read from the installed verl's metadata)."""
    try:
        requires = metadata.requires("verl") or []
    except metadata.PackageNotFoundError:
        pytest.skip("verl is not installed (the `verl` extra)")
    pins = _pins(REPO / CONSTRAINTS)
    assert pins["verl"] == metadata.version("verl") == "0.9.1"
    declared = {}
    for req in requires:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^;\s]+)\s*;\s*extra\s*==\s*\"vllm\"", req)
        if match:
            declared[match[1].lower()] = match[2]
    assert set(VERL_GPU_PINS) <= set(declared), declared
    assert {k: pins.get(k) for k in declared} == declared


def test_readme_and_makefile_install_the_tested_gpu_set():
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile.split("\nsetup-gpu:", 1)[1].split("\n\n", 1)[0]
    assert f"$(PY) -m {GPU_INSTALL}" in recipe
    readme = (REPO / "README.md").read_text()
    assert "make setup-gpu" in readme and GPU_INSTALL in readme


@pytest.mark.slow
@pytest.mark.e2e
def test_gpu_pin_set_resolves(tmp_path):
    """uv's resolver accepts omgrpo's `dev` + `gpu` extras under constraints/gpu.txt for Linux
    x86_64 and this Python. It reads package metadata only (the registry's, or the wheel's
    central directory through range requests): no CUDA wheel is downloaded or installed. pip's
    own `--dry-run` would download every wheel (GBs) where the registry serves no separate
    metadata. Skips when uv is missing or the registry cannot be reached."""
    # the dev extra installs uv beside this interpreter; `make test` does not put the venv on PATH
    beside = Path(sys.executable).parent / "uv"
    uv = str(beside) if beside.is_file() else shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not installed (`pip install uv`, part of the dev extra)")
    out = tmp_path / "resolved.txt"
    python_version = f"{sys.version_info.major}.{sys.version_info.minor}"
    command = [uv, "pip", "compile", "pyproject.toml", "-c", CONSTRAINTS, "-o", str(out),
               "--python-version", python_version, "--python-platform", "x86_64-manylinux_2_28",
               "--no-header", "--quiet",
               # the registry as of a fixed day: a release after it cannot turn this red
               "--exclude-newer", EXCLUDE_NEWER]  # fmt: skip
    for extra in EXTRAS:
        command += ["--extra", extra]
    env = {**_clean_env(), "UV_HTTP_TIMEOUT": "30"}
    try:
        run = subprocess.run(
            command, cwd=REPO, capture_output=True, text=True, timeout=300, env=env
        )
    except subprocess.TimeoutExpired:
        pytest.skip("uv pip compile did not finish in 300 s: the package registry is unreachable")
    if run.returncode != 0:
        network = re.search(
            r"Failed to fetch|error sending request|dns error|Connection refused|timed out|"
            r"Network is unreachable",
            run.stderr,
        )
        if network and "No solution found" not in run.stderr:
            pytest.skip(f"the package registry is unreachable: {network[0]}")
        pytest.fail(f"the GPU pin set does not resolve:\n{run.stderr[-4000:]}")
    resolved = _pins(out)
    assert {k: resolved.get(k) for k in _pins(REPO / CONSTRAINTS)} == _pins(REPO / CONSTRAINTS)
