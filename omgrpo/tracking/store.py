"""The local run store: `runs/<name>/`, the source of truth that trackers and analysis read.

config.yaml            resolved config of the run
metrics.jsonl          one JSON object per step (`train/step` plus every metric)
metrics.jsonl.xz       the same bytes xz-compressed, in place of metrics.jsonl (`compact_metrics`,
                       `omgrpo compact`: the form the committed studies under reports/ keep);
                       every reader takes either, training expands it back before appending
rollouts/step_*.parquet sampled rollouts (prompt id, text, answer, rewards, advantage, ...)
problems.parquet       each validation problem at each validation (problem id, step, accuracy,
                       modal answer, its share: `omgrpo.core.problems`), appended per validation
checkpoints/step_*/    model, optimizer, scheduler and RNG state (for resume)
status.json            running / finished / failed / killed, the last step that completed
                       (`step`; `failed_step` where a step failed), and why it stopped
trackers.json          the ids the trackers gave this run (a moved or resumed run keeps them),
                       and `unsynced`: the trackers that missed steps (`omgrpo sync` fills in)
identity.json          the run's identity: `{"uuid": ...}`, made when the run starts fresh. The
                       trackers' ids derive from it, so a moved or copied directory is the same
                       run and a new run at a path used before is a different one. A store
                       written before identities existed gets one derived from its absolute path
                       (`legacy_run_uuid`, `"derived_from"` says so) on first use, then kept.
provenance.json        what produced the run: git commit and dirty flag, package versions, torch
                       build, devices (`omgrpo.tracking.provenance`)
"""

from __future__ import annotations

import contextlib
import json
import lzma
import os
import shutil
import traceback
import uuid
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

_ATTEMPT: ContextVar[str | None] = ContextVar("omgrpo_run_attempt", default=None)

DONE_STATES = ("finished", "collapsed")
"""Statuses of a run that ended on its own (its last step, or a collapse stop): `run.resume=auto`
and `omgrpo sweep` skip such a run instead of training it again."""
RESUME_CHOICES = (True, False, "auto")
"""The values of `run.resume` (`start_mode`)."""
CONFIG_SECTIONS = ("run", "model", "task", "tracking", "trainer", "rollout", "reward", "eval")
"""Sections of a run's config.yaml that are mappings when present (`RunStore.read_config`)."""
METRICS_FILES = ("metrics.jsonl", "metrics.jsonl.xz")
"""A run's metrics, as training writes them and compacted (`RunStore.compact_metrics`)."""


class RunStore:
    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir)
        self.metrics_path = self.dir / METRICS_FILES[0]
        self.compact_metrics_path = self.dir / METRICS_FILES[1]
        self.rollouts_dir = self.dir / "rollouts"
        self.checkpoints_dir = self.dir / "checkpoints"
        self.problems_path = self.dir / "problems.parquet"

    # -- config ---------------------------------------------------------------------------
    def write_config(self, config: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))

    def read_config(self) -> dict[str, Any]:
        """The run's config.yaml; InputError naming it when it is not a YAML mapping (empty,
        truncated, not UTF-8), FileNotFoundError when there is none."""
        from omgrpo.errors import InputError, read_mapping

        path = self.dir / "config.yaml"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: is {self.dir} a run directory?")
        config = read_mapping(path, "a run's resolved config (a YAML mapping)")
        for section in CONFIG_SECTIONS:  # every reader takes these as mappings
            if not isinstance(config.get(section) or {}, dict):
                found = config[section]
                raise InputError(file=path, key=section, found=found, expected="a mapping")
        return config

    def has_progress(self) -> bool:
        return self.has_metrics() or self.checkpoints_dir.exists()

    def has_metrics(self) -> bool:
        """metrics.jsonl or its compact form is here."""
        return self.metrics_path.is_file() or self.compact_metrics_path.is_file()

    def start_mode(self, resume: bool | str) -> str:
        """What a training run started with `run.resume=resume` does with this run directory:
        `new` (nothing trained here yet), `resume` (continue its newest intact checkpoint;
        without one the run starts over), or `skip` (`auto` and the run already ended on its
        own, `DONE_STATES`). `false` on a directory that holds a run raises FileExistsError."""
        if resume not in RESUME_CHOICES:
            raise ValueError(f"run.resume={resume!r}: use auto, true or false")
        if not self.has_progress():
            return "new"
        if resume is False:
            raise FileExistsError(
                f"{self.dir} already holds a run; pass run.resume=auto (continue it unless it "
                "finished) or run.resume=true to continue it, or choose another run.name / "
                "run.root"
            )
        if resume == "auto" and self.read_status().get("state") in DONE_STATES:
            return "skip"
        return "resume"

    # -- metrics --------------------------------------------------------------------------
    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"train/step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self.dir.mkdir(parents=True, exist_ok=True)
        self._expand_metrics()
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()

    def read_metrics(self) -> pd.DataFrame:
        """All metric rows as a DataFrame indexed by nothing, one row per step."""
        return pd.DataFrame([{"train/step": step, **row} for step, row in self.metric_rows()])

    def metric_rows(self, up_to: int | None = None) -> list[tuple[int, dict[str, Any]]]:
        """(step, metrics) per line of metrics.jsonl (or of its compact form), as written (a
        row keeps only the metrics it has), steps <= `up_to` if given. A half-written last line
        (a run killed mid-write) is skipped; any other invalid line raises, naming the file and
        line."""
        from omgrpo.errors import InputError

        source, lines = self._metric_lines()
        rows = []
        for lineno, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:  # JSONDecodeError, or an integer past 4300 digits
                if lineno != len(lines) - 1:
                    raise InputError(
                        f"invalid JSON ({e})", file=source, row=f"line {lineno + 1}"
                    ) from e
                continue
            step = row.pop("train/step", lineno) if isinstance(row, dict) else None
            if isinstance(step, float) and step.is_integer():
                step = int(step)  # written by another tool as 3.0
            if isinstance(step, bool) or not isinstance(step, int):
                raise InputError(
                    "not a metrics row",
                    file=source,
                    row=f"line {lineno + 1}",
                    found=f"{line[:80]}",
                    expected='a JSON object with an integer "train/step"',
                )
            if up_to is None or step <= up_to:
                rows.append((step, row))
        return rows

    def _metric_lines(self) -> tuple[Path, list[str]]:
        """The metrics file read (metrics.jsonl, else metrics.jsonl.xz) and its lines; a file
        that is not UTF-8 or not xz is named (InputError)."""
        from omgrpo.errors import InputError

        path = self.metrics_path if self.metrics_path.exists() else self.compact_metrics_path
        if not path.exists():
            return self.metrics_path, []
        try:
            data = path.read_bytes()
            if path == self.compact_metrics_path:
                data = lzma.decompress(data)
            return path, data.decode("utf-8").splitlines()
        except lzma.LZMAError as e:
            raise InputError(f"not an xz file ({e}): truncated or damaged", file=path) from e
        except UnicodeDecodeError as e:
            raise InputError(f"not UTF-8 text ({e.reason} at byte {e.start})", file=path) from e

    def compact_metrics(self) -> bool:
        """Replace metrics.jsonl by metrics.jsonl.xz, its bytes xz-compressed (about 7x smaller;
        `xz -dk` restores the file): the form a finished run is committed in. Every reader
        takes either form; training that continues the run expands it back first. Returns
        whether metrics.jsonl was replaced (False: there was none). Deterministic: the same
        metrics give the same bytes."""
        if not self.metrics_path.exists():
            return False
        data = self.metrics_path.read_bytes()
        old = self.compact_metrics_path
        if not (old.exists() and lzma.decompress(old.read_bytes()) == data):
            packed = lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)
            if lzma.decompress(packed) != data:  # never drop metrics on a faulty round trip
                raise OSError(f"{self.metrics_path}: xz round trip changed the metrics; kept")
            tmp = self.dir / f".{METRICS_FILES[1]}.{os.getpid()}.tmp"
            tmp.write_bytes(packed)
            tmp.replace(self.compact_metrics_path)
        self.metrics_path.unlink()  # after the compact form is complete: a kill loses nothing
        return True

    def _expand_metrics(self) -> None:
        """Before metrics.jsonl is written: a compacted run's rows back into metrics.jsonl."""
        if not self.compact_metrics_path.exists():
            return
        if not self.metrics_path.exists():  # both: a compaction was cut short; plain is whole
            tmp = self.metrics_path.with_name(self.metrics_path.name + ".tmp")
            tmp.write_bytes(lzma.decompress(self.compact_metrics_path.read_bytes()))
            tmp.replace(self.metrics_path)
        self.compact_metrics_path.unlink()

    def truncate_metrics(self, last_step: int) -> None:
        """Drop rows after `last_step` (a resumed run recomputes them): metrics, rollout tables
        and `problems.parquet` rows."""
        if self.problems_path.exists():
            problems = self.read_problems()
            self._write_problems(problems[problems["step"] <= last_step])
        self._expand_metrics()
        if not self.metrics_path.exists():
            return
        keep = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("train/step", 0) <= last_step:
                keep.append(line)
        tmp = self.metrics_path.with_name(self.metrics_path.name + ".tmp")
        tmp.write_text("".join(x + "\n" for x in keep))
        tmp.replace(self.metrics_path)  # a kill while rewriting keeps the old file
        for step, path in self.rollout_files():
            if step > last_step:
                path.unlink()

    # -- rollouts -------------------------------------------------------------------------
    def log_rollouts(self, step: int, table: pd.DataFrame) -> Path:
        self.rollouts_dir.mkdir(parents=True, exist_ok=True)
        path = self.rollouts_dir / f"step_{step:06d}.parquet"
        table.to_parquet(path, index=False)
        return path

    def read_rollouts(self) -> pd.DataFrame:
        files = [path for _, path in self.rollout_files()]
        return (
            pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
            if files
            else (pd.DataFrame())
        )

    def rollout_files(self, up_to: int | None = None) -> list[tuple[int, Path]]:
        """(step, parquet file) of the rollout tables, by step (steps <= `up_to` if given)."""
        files = sorted(self.rollouts_dir.glob("step_*.parquet"))
        steps = [(step_number(f.stem), f) for f in files]
        return [(s, f) for s, f in steps if s is not None and (up_to is None or s <= up_to)]

    # -- per-problem history --------------------------------------------------------------
    def log_problems(self, step: int, table: pd.DataFrame) -> None:
        """Append one validation's per-problem rows (`omgrpo.core.problems.problem_table`),
        replacing any rows of the same `step` (a resumed run validates that step again)."""
        old = self.read_problems()
        if not old.empty:
            old = old[old["step"] != int(step)]
        parts = [t for t in (old, table) if not t.empty]
        self._write_problems(pd.concat(parts, ignore_index=True) if parts else table)

    def read_problems(self) -> pd.DataFrame:
        """`problems.parquet` (empty without one), sorted by step."""
        if not self.problems_path.exists():
            return pd.DataFrame()
        df = pd.read_parquet(self.problems_path)
        return df.sort_values("step", kind="stable", ignore_index=True)

    def _write_problems(self, table: pd.DataFrame) -> None:
        tmp = self.problems_path.with_name(self.problems_path.name + ".tmp")
        table.to_parquet(tmp, index=False)
        tmp.replace(self.problems_path)  # a kill while writing keeps the old file

    # -- checkpoints ----------------------------------------------------------------------
    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints_dir / f"step_{step:06d}"

    def complete_checkpoints(self) -> list[Path]:
        """Checkpoint folders whose writing finished, newest first (their files may still be
        damaged: `omgrpo.backends.native.checkpoint.load_latest_intact_checkpoint` verifies them)."""
        done = [p for p in self._checkpoint_folders() if (p / "COMPLETE").exists()]
        return sorted(done, key=lambda p: step_number(p.name) or 0, reverse=True)

    def _checkpoint_folders(self) -> list[Path]:
        """checkpoints/step_N folders; anything else there (`step_N.tmp` being written, a copy
        named `step_x`) is not a checkpoint."""
        paths = self.checkpoints_dir.glob("step_*")
        return [p for p in paths if step_number(p.name) is not None and p.is_dir()]

    def latest_checkpoint(self) -> Path | None:
        done = self.complete_checkpoints()
        return done[0] if done else None

    def checkpoints_by_step(self) -> dict[int, Path]:
        """Step -> folder of every completely written checkpoint, oldest first."""
        return {step_number(p.name) or 0: p for p in reversed(self.complete_checkpoints())}

    def best_checkpoint(self, metric: str) -> tuple[int, float, dict[int, float]] | None:
        """The complete checkpoint whose step logged the highest `metric` (ties: the later
        step): (step, value, every candidate step -> value), or None if none logged it."""
        df = self.read_metrics()
        if metric not in df.columns:
            return None
        values = pd.to_numeric(df.set_index("train/step")[metric], errors="coerce").dropna()
        candidates = {s: float(values[s]) for s in self.checkpoints_by_step() if s in values}
        if not candidates:
            return None
        step = max(candidates, key=lambda s: (candidates[s], s))
        return step, candidates[step], candidates

    def prune_checkpoints(self, keep: int, keep_best: str | None = None) -> None:
        """Keep the newest `keep` checkpoints, and with `keep_best` also the best one by that
        metric (so `omgrpo eval --checkpoint best` finds it after later ones are written)."""
        done = sorted(self._checkpoint_folders(), key=lambda p: step_number(p.name) or 0)
        best = self.best_checkpoint(keep_best) if keep_best else None
        protect = self.checkpoint_dir(best[0]) if best else None
        for path in done[: max(0, len(done) - keep)]:
            if path != protect:
                shutil.rmtree(path, ignore_errors=True)

    # -- status ---------------------------------------------------------------------------
    def write_status(self, **status: Any) -> None:
        """Replace status.json (atomically: a kill never leaves half a file). Inside
        `recording_failures` the attempt's id goes in as `attempt`, so a failure is recorded
        only for a run this attempt started."""
        if (attempt := _ATTEMPT.get()) is not None:
            status["attempt"] = attempt
        _write_json_atomic(self.dir / "status.json", status)

    def read_status(self) -> dict[str, Any]:
        """status.json ({} when there is none); InputError naming it when it is not a JSON
        object (truncated, empty, a list)."""
        from omgrpo.errors import read_mapping

        path = self.dir / "status.json"
        return read_mapping(path, "a run's status (a JSON object)") if path.exists() else {}

    @contextlib.contextmanager
    def recording_failures(self) -> Iterator[RunStore]:
        """Mark the run `failed` (an exception: its type, message and the last lines of its
        traceback) or `killed` (Ctrl-C) when the body raises after this process set the run
        `running`; re-raise. A refusal before the run started (e.g. a config change on
        resume) leaves the status of the run on disk alone."""
        attempt = uuid.uuid4().hex
        token = _ATTEMPT.set(attempt)
        try:
            yield self
        except BaseException as e:
            status = self.read_status()
            ours = status.get("attempt") == attempt and "error" not in status
            if ours and status.get("state") in ("running", "failed"):
                killed = isinstance(e, KeyboardInterrupt | SystemExit)
                status["state"] = "killed" if killed else "failed"
                status["error"] = {
                    "type": type(e).__name__,
                    "message": str(e),
                    "step": status.get("step"),  # the last step that completed
                    "traceback": traceback.format_exception(e)[-3:],
                }
                self.write_status(**status)
            raise
        finally:
            _ATTEMPT.reset(token)

    # -- identity -----------------------------------------------------------------------
    def new_identity(self) -> str:
        """Give the run a fresh UUID (a run starting from scratch); returns it."""
        run_uuid = uuid.uuid4().hex
        _write_json_atomic(self.dir / "identity.json", {"uuid": run_uuid})
        (self.dir / "trackers.json").unlink(missing_ok=True)  # ids of the run it replaces
        return run_uuid

    def run_uuid(self) -> str:
        """The run's UUID (32 hex digits). A store without one gets it now: derived from its
        path if it holds an older run (so resuming it finds its tracker runs), else fresh.
        Two processes racing here agree: the first file written wins."""
        path = self.dir / "identity.json"
        if (known := self.peek_uuid()) is not None and path.exists():
            return known
        ident = (
            {"uuid": known, "derived_from": str(self.dir.resolve())}
            if known is not None
            else {"uuid": uuid.uuid4().hex}
        )
        try:
            _write_json_exclusive(path, ident)
        except FileExistsError:
            return str(json.loads(path.read_text())["uuid"])
        except OSError:  # a read-only store: an id derived from the path holds for every call
            return legacy_run_uuid(self.dir)
        return ident["uuid"]

    def peek_uuid(self) -> str | None:
        """The run's UUID without writing anything: identity.json's, else the one derived for
        an older run store (config.yaml or trackers.json but no identity), else None."""
        path = self.dir / "identity.json"
        if path.exists():
            return str(json.loads(path.read_text())["uuid"])
        if (self.dir / "config.yaml").exists() or (self.dir / "trackers.json").exists():
            return legacy_run_uuid(self.dir)
        return None

    # -- provenance -----------------------------------------------------------------------
    def write_provenance(self, provenance: dict[str, Any]) -> None:
        """Record what produced this (segment of the) run; a resumed run that differs keeps
        the earlier records under `earlier`."""
        old = self.read_provenance()
        earlier = old.pop("earlier", [])
        if old and old != provenance:
            earlier.append(old)
        _write_json_atomic(
            self.dir / "provenance.json",
            {**provenance, **({"earlier": earlier} if earlier else {})},
        )

    def read_provenance(self) -> dict[str, Any]:
        path = self.dir / "provenance.json"
        return json.loads(path.read_text()) if path.exists() else {}

    # -- tracker ids ----------------------------------------------------------------------
    def tracker_ids(self) -> dict[str, str]:
        """backend -> the id of this run there (`trackers.json`)."""
        return {k: v for k, v in self._trackers_json().items() if isinstance(v, str)}

    def set_tracker_id(self, backend: str, run_id: str) -> None:
        _write_json_atomic(self.dir / "trackers.json", {**self._trackers_json(), backend: run_id})

    def unsynced(self) -> list[str]:
        """The backends that missed some of this run while training (their server did not
        answer, or fell too far behind): `omgrpo sync RUN --to BACKEND` fills them in."""
        return list(self._trackers_json().get("unsynced", []))

    def mark_unsynced(self, backend: str, missing: bool = True) -> None:
        """Record (`missing`) or clear that `backend` lacks some of this run (`unsynced`)."""
        data = self._trackers_json()
        names = [b for b in data.get("unsynced", []) if b != backend] + ([backend] * missing)
        if names:
            data["unsynced"] = names
        else:
            data.pop("unsynced", None)
        _write_json_atomic(self.dir / "trackers.json", data)

    def _trackers_json(self) -> dict[str, Any]:
        path = self.dir / "trackers.json"
        return json.loads(path.read_text()) if path.exists() else {}


def step_number(name: str) -> int | None:
    """N of a `step_N` checkpoint folder or `step_N.parquet` stem (N >= 0), else None."""
    head, _, digits = name.partition("_")
    return int(digits) if head == "step" and digits.isdigit() and digits.isascii() else None


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(path)


def legacy_run_uuid(run_dir: Path) -> str:
    """The identity of a run store written before identities existed: a UUID5 of its absolute
    path, the key such runs were known by (stable, so every resume derives the same one)."""
    return uuid.uuid5(uuid.NAMESPACE_URL, str(Path(run_dir).expanduser().resolve())).hex


def _write_json_exclusive(path: Path, data: dict[str, Any]) -> None:
    """Write `path` only if it does not exist (FileExistsError otherwise), never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    try:
        os.link(tmp, path)  # atomic and fails if the target exists
    except FileExistsError:
        raise
    except OSError:  # a file system without hard links: exclusive create (not atomic)
        with open(path, "x") as f:
            f.write(tmp.read_text())
    finally:
        tmp.unlink(missing_ok=True)


def _plain(value: Any) -> Any:
    """Tensors / numpy scalars to Python (non-finite floats are written as NaN / Infinity)."""
    return value.item() if hasattr(value, "item") else value
