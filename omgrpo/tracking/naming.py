"""What a tracker is handed: secrets masked (`redact`), metric names MLflow accepts
(`sanitize_metric_name`), flat params (`flatten`), plain values (`as_float`) and the ids and
tags a run is known by (`stable_run_id` from the run's UUID, `run_method`, `run_scale`,
`run_group_tags`).

Secrets: `redact` masks secret-looking config values before any backend sees the config.
Names: `sanitize_metric_name` maps the metric names of the README/DESIGN contract onto what
MLflow accepts (`val/pass@4` -> `val/pass_at_4`); W&B gets the names unchanged.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# -- secrets -----------------------------------------------------------------------------------
MASK = "***"
# Key words that always mark a secret (matched against whole words of the key).
_SECRET_WORDS = set(
    """
    secret secrets password passwords passwd credential credentials auth authorization
    authentication apikey bearer
    """.split()  # noqa: SIM905 (a word list reads better as text)
)
# A key ending in `key` / `token` is a secret unless the word before says it is something else
# (`question_key` names a column, `pad_token` a vocabulary item, `max_new_tokens` a length).
_BENIGN_QUALIFIERS = set(
    """
    question answer label prompt response text column field sort cache group dict primary
    foreign pad eos bos unk sep cls mask special start end stop think image chat
    """.split()  # noqa: SIM905 (a word list reads better as text)
)
_SECRET_VALUE = re.compile(
    r"(?<![A-Za-z0-9_\-])(?:[0-9a-f]{40}"  # a W&B API key
    r"|[a-z0-9]+-[0-9a-f]{40}"  # a W&B key of a self-hosted server (local-...)
    r"|hf_[A-Za-z0-9]{20,}"  # Hugging Face
    r"|sk-[A-Za-z0-9_\-]{16,}"  # OpenAI-style
    r"|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_\w{20,}"  # GitHub
    r"|AKIA[0-9A-Z]{16})(?![A-Za-z0-9_\-])"  # AWS access key id
)
_URL_PASSWORD = re.compile(r"(\b[a-zA-Z][\w+.\-]*://[^:/@\s]+:)([^@\s/]+)(@)")
_COMMIT_WORDS = {"commit", "revision", "sha", "hash", "digest", "checksum"}


def _key_words(key: str) -> list[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", str(key))  # camelCase -> camel Case
    return [w for w in re.split(r"[^A-Za-z0-9]+", spaced.lower()) if w]


def is_secret_key(key: str) -> bool:
    """Whether a config key names a secret: `api_key`, `WANDB_API_KEY`, `hf_token`, `token`,
    `password`, `client_secret`, `authToken`, `credentials`, ... but not `question_key`,
    `pad_token` or `max_new_tokens` (whole words are matched, not substrings)."""
    words = _key_words(key)
    if not words:
        return False
    if any(w in _SECRET_WORDS or w.startswith("passw") for w in words):
        return True
    last, before = words[-1], (words[-2] if len(words) > 1 else None)
    if last in ("key", "token"):
        return before not in _BENIGN_QUALIFIERS
    if last in ("keys", "tokens"):
        return before in {"api", "access", "secret", "private", "hf", "wandb"}
    return last.endswith(("apikey", "accesskey", "secretkey", "privatekey", "accesstoken"))


def _mask_string(value: str, key_words: list[str]) -> str:
    # A 40-hex value under `commit` / `revision` is a git SHA, not a W&B key.
    if _COMMIT_WORDS & set(key_words) and re.fullmatch(r"\s*[0-9a-f]{40}\s*", value):
        return value
    value = _SECRET_VALUE.sub(MASK, value)
    return _URL_PASSWORD.sub(rf"\1{MASK}\3", value)


def redact(config: Any) -> Any:
    """A copy of `config` safe to hand to a tracker.

    Values under secret-looking keys (see `is_secret_key`; matched on whole words, case
    insensitive) become "***" (None and booleans are kept: they reveal nothing); anything in a
    string that looks like a credential (40-hex W&B keys, `hf_...`, `sk-...`, GitHub and AWS
    keys) becomes "***" wherever it is, and so do passwords in URLs (`scheme://user:pw@host`).
    """
    return _redact(config, [])


def _redact(value: Any, key_words: list[str]) -> Any:
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if is_secret_key(str(k)):
                out[k] = v if v is None or isinstance(v, bool) else MASK
            else:
                out[k] = _redact(v, _key_words(str(k)))
        return out
    if isinstance(value, tuple):
        return tuple(_redact(v, key_words) for v in value)
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):  # lists, ListConfig
        return [_redact(v, key_words) for v in value]
    if isinstance(value, str):
        return _mask_string(value, key_words)
    return value


# -- metric values and names -------------------------------------------------------------------
def plain_value(value: Any) -> Any:
    """Tensors / numpy scalars to Python."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    return value


def as_float(value: Any) -> float | None:
    """The value as a finite float, or None (strings, None, NaN, inf, arrays)."""
    value = plain_value(value)
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        value = float(value)
        return value if math.isfinite(value) else None
    return None


_REPLACEMENTS = {
    "@": "_at_",
    "&": "_and_",
    "=": "_eq_",
    "%": "_pct_",
    "+": "_plus_",
    "<": "_lt_",
    ">": "_gt_",
    "#": "_n_",
    "(": "_",
    ")": "_",
    "[": "_",
    "]": "_",
    " ": "_",
    ":": "_",  # allowed by MLflow except on Windows
}
_ALLOWED = re.compile(r"[A-Za-z0-9_\-./]")


def sanitize_metric_name(name: str) -> str:
    """`name` as MLflow accepts it: only letters, digits, `_ - . /`, no empty or `.`/`..` path
    segments, at most 250 characters. `@` becomes `_at_`, `&` `_and_`, `=` `_eq_`, spaces and
    brackets `_`; anything else `_`. Names of the metric contract map to themselves except
    `val/pass@k` -> `val/pass_at_k` (injective on them; MLflowTracker also disambiguates any
    runtime collision).

    >>> sanitize_metric_name("val/pass@4")
    'val/pass_at_4'
    """
    out = "".join(c if _ALLOWED.fullmatch(c) else _REPLACEMENTS.get(c, "_") for c in str(name))
    # MLflow treats names as paths: no empty, "." or ".." segments.
    parts = [p.replace(".", "_") if p in (".", "..") else p for p in out.split("/") if p]
    out = "/".join(parts) or "_"
    if len(out) > 250:
        out = out[:233] + "_" + hashlib.sha1(str(name).encode()).hexdigest()[:16]
    return out


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts to `a.b.c` keys (lists stay values)."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 6000 else text[:5985] + "...[truncated]"


def run_scale(config: Mapping[str, Any]) -> str:
    """`toy` for the tiny toy model, else the base model's folder name."""
    path = (config.get("model") or {}).get("path") if isinstance(config, Mapping) else None
    return "toy" if not path else Path(str(path)).name or str(path)


def run_method(config: Mapping[str, Any]) -> str:
    return str(config.get("method") or (config.get("run") or {}).get("variant") or "unknown")


def run_dir_key(run_dir: Path) -> str:
    return str(Path(run_dir).expanduser().resolve())


def stable_run_id(run_uuid: str) -> str:
    """The W&B run id of the run with identity `run_uuid` (`RunStore.run_uuid()`): a resumed,
    moved or synced run lands in the same W&B run, a new run at a used path in a new one."""
    return str(run_uuid).replace("-", "")[:32]


SWEEP_ENV = "OMGRPO_SWEEP"
"""Set by `omgrpo sweep` for the runs it starts: the sweep's name, tagged `sweep`."""


def run_group_tags(config: Mapping[str, Any], env: Mapping[str, str] | None = None) -> dict:
    """The tags the MLflow UI groups a study's or sweep's runs by, where the config knows them:
    `arm` (the method preset), `seed`, `experiment` (`run.experiment`: a study's world and
    base), `unit` (`<experiment>/s<seed>`, the study's paired unit), `base` (the toy base's
    warm-start seed, or the base model's folder) and `sweep` ($OMGRPO_SWEEP, set by
    `omgrpo sweep`, or a W&B agent's $WANDB_SWEEP_ID). The run's own `run.tags` win over these."""
    env = os.environ if env is None else env
    if not isinstance(config, Mapping):
        return {}
    if "run" not in config and isinstance(config.get("omgrpo"), Mapping):
        config = config["omgrpo"]  # a verl run's store config nests omgrpo's
    run = config.get("run") if isinstance(config.get("run"), Mapping) else {}
    model = config.get("model") if isinstance(config.get("model"), Mapping) else {}
    tags = {}
    arm = config.get("method") or run.get("variant")
    if arm:
        tags["arm"] = str(arm)
    seed, experiment = config.get("seed"), run.get("experiment")
    if seed is not None:
        tags["seed"] = str(seed)
    if experiment:
        tags["experiment"] = str(experiment)
    if seed is not None and experiment:
        tags["unit"] = f"{experiment}/s{seed}"
    warm = model.get("warm_start") if isinstance(model.get("warm_start"), Mapping) else {}
    if model.get("path"):
        tags["base"] = run_scale(config)
    elif warm.get("seed") is not None:
        tags["base"] = f"toy/warm_start.seed={warm['seed']}"
    sweep = env.get(SWEEP_ENV) or env.get("WANDB_SWEEP_ID")  # a local sweep, or a W&B agent's
    if sweep:
        tags["sweep"] = str(sweep)
    return tags
