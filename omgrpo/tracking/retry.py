"""Which tracker errors are worth retrying, and the retry policy (tenacity) for them.

A tracking server that restarts, a proxy that drops a connection, a SQLite store locked for a
moment: these pass, so a call that fails with them is retried with exponential backoff for up
to `RETRY_S` seconds. Anything else (a deleted run, an invalid value, a bug) fails at once.
MLflow's HTTP client retries too (7 times with backoff, ~4 min per call by default): a
tracker sets `MLFLOW_HTTP_REQUEST_MAX_RETRIES=0` and `MLFLOW_HTTP_REQUEST_TIMEOUT=30` in its
process unless they are set (`quiet_mlflow_http_retries`), so that this policy is the one that
decides how long a call may hold up its caller.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import tenacity

RETRY_S = 5.0
"""A failing call is retried (0.25 s, 0.5 s, 1 s, 2 s apart) until this many seconds passed."""
MLFLOW_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
"""MLflow's HTTP settings a tracker process uses unless the environment sets them."""


def is_transient(error: BaseException) -> bool:
    """Whether `error` may pass if the call is made again: a connection or timeout error (not
    any OSError: a missing folder or a file where a directory belongs stays so), or an
    MLflow error whose HTTP status is 5xx or 429 (MLflow reports an unreachable server as
    INTERNAL_ERROR (500) and a locked SQLite store as TEMPORARILY_UNAVAILABLE (503))."""
    if isinstance(error, ConnectionError | TimeoutError):  # not a missing file or a bad path
        return True
    try:
        from requests.exceptions import ConnectionError as RequestsConnectionError
        from requests.exceptions import Timeout
    except ImportError:  # pragma: no cover - requests comes with mlflow and wandb
        pass
    else:
        if isinstance(error, RequestsConnectionError | Timeout):
            return True
    status = getattr(error, "get_http_status_code", None)
    if callable(status):
        try:
            code = int(status())
        except (TypeError, ValueError):
            return False
        return code >= 500 or code == 429
    return False


def retrying(seconds: float = RETRY_S, give_up: Callable[[], bool] | None = None):
    """A tenacity `Retrying` for transient errors: exponential backoff from 0.25 s to 2 s, for
    at most `seconds` seconds, or until `give_up()` says so; then the last error is raised."""
    stop = tenacity.stop_after_delay(seconds)
    if give_up is not None:
        stop = stop | (lambda _state: give_up())
    return tenacity.Retrying(
        retry=tenacity.retry_if_exception(is_transient),
        wait=tenacity.wait_exponential(multiplier=0.25, max=2.0),
        stop=stop,
        reraise=True,
    )


def quiet_mlflow_http_retries() -> None:
    """Leave retrying to `retrying` (see the module docstring); explicit settings win."""
    for var, value in MLFLOW_HTTP_DEFAULTS.items():
        os.environ.setdefault(var, value)
