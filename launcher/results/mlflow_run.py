"""A run's metrics and parameters logged to one MLflow run, in batches: a tracking server through
its REST API, any other store through the mlflow package (docs/diagnosis.md, "MLflow")."""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import math
import os
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any
from urllib.parse import unquote

from launcher.results.scalars import JOB, RESTART, Point
from launcher.util import first_line, mask_urls

log = logging.getLogger(__name__)

MAX_METRICS = 1000  # per log-batch request (MLflow's limit)
MAX_PARAMS = 100
PARAM_VALUE_CHARS = 500  # the smallest limit of the MLflow versions in use
MAX_PENDING = 200_000  # values held while the store does not answer; the oldest go first
TIMEOUT_S = 10.0
RETRY_S = 30.0  # between tries while the store does not answer
_NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}  # protobuf's JSON names
STATUS = {"succeeded": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}


class Unreachable(Exception):
    """The store did not answer (connection, timeout, 5xx): try again later."""


class Refused(Exception):
    """The store answered no (4xx, a bad value): trying again sends the same no."""


class MlflowRun:
    """One MLflow run, made at the first flush, fed by ``write`` and ended by ``close``."""

    def __init__(
        self,
        tracking_uri: str,
        *,
        experiment: str,
        run_name: str,
        params: dict[str, str],
        tags: dict[str, str],
        store: RestStore | ClientStore | None = None,
    ):
        self.where = mask_urls(tracking_uri)
        self.store = store or (
            RestStore(tracking_uri)
            if tracking_uri.lower().startswith(("http://", "https://"))
            else ClientStore(tracking_uri)
        )
        self.experiment, self.run_name, self.tags = experiment, run_name, tags
        self.run_id: str | None = None
        self._params = [(k[:250], v[:PARAM_VALUE_CHARS]) for k, v in params.items()]
        self._metrics: deque[dict[str, Any]] = deque()
        self._dropped = 0
        self._down: str | None = None  # why the store is not answering, once said
        self._retry_at = 0.0
        self._refused = False  # the run cannot be made: nothing more is tried

    def write(self, points: Iterable[Point]) -> None:
        """Take points and send what is waiting."""
        for p in points:
            if p.key == RESTART:  # MLflow keeps every value of a step
                continue
            key = p.key if p.series == JOB else f"{p.series}/{p.key}"
            self._metrics.append(
                {
                    "key": _metric_key(key),
                    "value": p.value if math.isfinite(p.value) else _NON_FINITE[str(p.value)],
                    "timestamp": int(p.time * 1e3),
                    "step": p.step,
                }
            )
        while len(self._metrics) > MAX_PENDING:
            self._metrics.popleft()
            self._dropped += 1
        self.flush()

    def flush(self, *, now: bool = False) -> None:
        """Send what waits; while the store does not answer, every ``RETRY_S`` (or ``now``)."""
        if self._refused:
            self._metrics.clear()
            return
        if self._down is not None and not now and time.monotonic() < self._retry_at:
            return
        try:
            self._send()
        except Unreachable as err:
            self._retry_at = time.monotonic() + RETRY_S
            if self._down is None:
                log.warning(
                    "MLflow at %s did not answer (%s); the run goes on, its metrics stay in the "
                    "run directory, and they are sent when the server answers",
                    self.where,
                    err,
                )
            self._down = str(err)
            return
        if self._down is not None:
            log.warning("MLflow at %s answers again; the metrics held are sent", self.where)
            self._down = None

    def close(self, status: str) -> None:
        """Send what waits and end the run with ``status`` (succeeded, failed, interrupted)."""
        self.flush(now=True)
        if self.run_id is not None and self._down is None and not self._refused:
            try:
                self.store.finish(
                    self.run_id, STATUS.get(status, "FINISHED"), {"launcher.status": status}
                )
            except (Unreachable, Refused) as err:
                log.warning("MLflow at %s: the run was not marked %s: %s", self.where, status, err)
        unsent = len(self._metrics) + self._dropped
        if unsent and not self._refused:
            log.warning(
                "MLflow at %s: %d metric value(s) were not sent (%s); they are in the run "
                "directory's metrics/",
                self.where,
                unsent,
                self._down or "the store dropped the oldest while it did not answer",
            )

    def _send(self) -> None:
        if self.run_id is None:
            try:
                experiment_id = self.store.experiment_id(self.experiment)
                self.run_id = self.store.create_run(experiment_id, self.run_name, self.tags)
            except Refused as err:
                self._refused = True
                log.warning(
                    "MLflow at %s refused the run (%s); nothing is logged there, the metrics stay "
                    "in the run directory",
                    self.where,
                    err,
                )
                return
        while self._params:
            self._batch([], self._params[:MAX_PARAMS])
            del self._params[:MAX_PARAMS]
        while self._metrics:
            metrics = [self._metrics[i] for i in range(min(MAX_METRICS, len(self._metrics)))]
            self._batch(metrics, [])
            for _ in metrics:
                self._metrics.popleft()

    def _batch(self, metrics: list[dict[str, Any]], params: list[tuple[str, str]]) -> None:
        assert self.run_id is not None
        try:
            self.store.log_batch(self.run_id, metrics, params)
        except Refused as err:  # this batch only: the next may pass
            what = f"{len(metrics)} metric value(s)" if metrics else f"{len(params)} parameter(s)"
            log.warning("MLflow at %s refused %s: %s", self.where, what, err)


def _metric_key(key: str) -> str:
    """MLflow's names take letters, digits and ``_ - . / space``; anything else becomes ``_``."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in key)


class RestStore:
    """A tracking server through MLflow's REST API (``/api/2.0/mlflow/...``), with credentials
    from the environment as the mlflow client reads them (docs/diagnosis.md lists them)."""

    def __init__(self, tracking_uri: str):
        parts = urllib.parse.urlsplit(tracking_uri)
        netloc = parts.netloc.rpartition("@")[2]  # a user and password in it go in a header
        self.base = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
        self.headers = {"Content-Type": "application/json"}
        user = os.environ.get("MLFLOW_TRACKING_USERNAME") or unquote(parts.username or "")
        password = os.environ.get("MLFLOW_TRACKING_PASSWORD") or unquote(parts.password or "")
        if token := os.environ.get("MLFLOW_TRACKING_TOKEN"):
            self.headers["Authorization"] = f"Bearer {token}"
        elif user:
            basic = base64.b64encode(f"{user}:{password}".encode()).decode()
            self.headers["Authorization"] = f"Basic {basic}"
        self.context: ssl.SSLContext | None = None
        if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() == "true":
            self.context = ssl._create_unverified_context()
        elif cafile := os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH"):
            self.context = ssl.create_default_context(cafile=cafile)

    def experiment_id(self, name: str) -> str:
        try:
            found = self._call("GET", "experiments/get-by-name", {"experiment_name": name})
        except Refused as err:
            if "RESOURCE_DOES_NOT_EXIST" not in str(err):
                raise
        else:
            experiment = found["experiment"]
            if experiment.get("lifecycle_stage") == "deleted":
                raise Refused(
                    f"experiment {name!r} is deleted; restore it, or set report.mlflow.experiment "
                    f"to another name"
                )
            return str(experiment["experiment_id"])
        try:
            return str(self._call("POST", "experiments/create", {"name": name})["experiment_id"])
        except Refused as err:  # another run made it meanwhile
            if "RESOURCE_ALREADY_EXISTS" not in str(err):
                raise
            found = self._call("GET", "experiments/get-by-name", {"experiment_name": name})
            return str(found["experiment"]["experiment_id"])

    def create_run(self, experiment_id: str, run_name: str, tags: dict[str, str]) -> str:
        start = int(time.time() * 1e3)
        body = {"experiment_id": experiment_id, "run_name": run_name, "start_time": start}
        answer = self._call("POST", "runs/create", {**body, "tags": _key_values(tags.items())})
        return str(answer["run"]["info"]["run_id"])

    def log_batch(
        self, run_id: str, metrics: list[dict[str, Any]], params: list[tuple[str, str]]
    ) -> None:
        body = {"run_id": run_id, "metrics": metrics, "params": _key_values(params)}
        self._call("POST", "runs/log-batch", body)

    def finish(self, run_id: str, status: str, tags: dict[str, str]) -> None:
        if tags:
            self._call(
                "POST", "runs/log-batch", {"run_id": run_id, "tags": _key_values(tags.items())}
            )
        end = int(time.time() * 1e3)
        self._call("POST", "runs/update", {"run_id": run_id, "status": status, "end_time": end})

    def _call(self, method: str, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        url = f"{self.base}/api/2.0/mlflow/{endpoint}"
        data = None
        if method == "GET":
            url += "?" + urllib.parse.urlencode(body)
        else:
            data = json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method, headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=self.context) as answer:
                raw = answer.read()
        except urllib.error.HTTPError as err:
            text = err.read().decode("utf-8", "replace")[:500]
            if err.code >= 500 or err.code == 429:
                raise Unreachable(f"HTTP {err.code} from {endpoint}: {text}") from None
            raise Refused(f"HTTP {err.code} from {endpoint}: {text}") from None
        except (OSError, ValueError) as err:  # URLError, refused, reset, timeout, bad address
            reason = getattr(err, "reason", err)
            raise Unreachable(f"{type(reason).__name__}: {reason}") from None
        try:
            return json.loads(raw or b"{}")
        except ValueError:
            raise Unreachable(f"{endpoint} answered with something other than JSON") from None


def _key_values(pairs: Iterable[tuple[str, str]]) -> list[dict[str, str]]:
    """MLflow's REST form of params and tags."""
    return [{"key": k, "value": v} for k, v in pairs]


class ClientStore:
    """Any tracking URI the mlflow package opens (a folder, file:, sqlite:, databricks, ...)."""

    def __init__(self, tracking_uri: str):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)

    def experiment_id(self, name: str) -> str:
        with _refusals():
            found = self.client.get_experiment_by_name(name)
            if found is not None:
                return str(found.experiment_id)
            return str(self.client.create_experiment(name))

    def create_run(self, experiment_id: str, run_name: str, tags: dict[str, str]) -> str:
        with _refusals():
            run = self.client.create_run(experiment_id, run_name=run_name, tags=tags)
            return str(run.info.run_id)

    def log_batch(
        self, run_id: str, metrics: list[dict[str, Any]], params: list[tuple[str, str]]
    ) -> None:
        from mlflow.entities import Metric, Param

        with _refusals():
            self.client.log_batch(
                run_id,
                metrics=[
                    Metric(m["key"], float(m["value"]), m["timestamp"], m["step"]) for m in metrics
                ],
                params=[Param(k, v) for k, v in params],
            )

    def finish(self, run_id: str, status: str, tags: dict[str, str]) -> None:
        with _refusals():
            for k, v in tags.items():
                self.client.set_tag(run_id, k, v)
            self.client.set_terminated(run_id, status)


@contextlib.contextmanager
def _refusals() -> Iterator[None]:
    """The mlflow package's errors as ``Refused``: a local store that fails fails again."""
    try:
        yield
    except Exception as err:
        raise Refused(f"{type(err).__name__}: {first_line(err)[:300]}") from err
