"""The job's ``report:`` section: where the run's metrics go besides the run directory
(TensorBoard event files, an MLflow run), and the optional packages that needs."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from pydantic import Field, field_validator

from launcher.errors import SpecError
from launcher.spec.base import Strict

SERVER_SCHEMES = ("http://", "https://")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


class MlflowSpec(Strict):
    tracking_uri: str = Field(
        description="An MLflow tracking server (http:// or https://, written to through its REST API) or a store the mlflow package opens (sqlite:///FILE, postgresql://..., a folder). A relative file is taken from the job file's folder."
    )
    experiment: str | None = Field(
        None,
        min_length=1,
        description="The experiment the run goes into, made when missing. Default: the job's name.",
    )
    run_name: str | None = Field(
        None, min_length=1, description="The MLflow run's name. Default: the run directory's name."
    )

    @field_validator("tracking_uri")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError(
                "report.mlflow.tracking_uri is empty; give the tracking server "
                "(http://HOST:5000) or a folder for a file store"
            )
        return value.strip()

    @property
    def server(self) -> bool:
        """The tracking URI is a server reached over HTTP (no mlflow package needed)."""
        return self.tracking_uri.lower().startswith(SERVER_SCHEMES)


class ReportSpec(Strict):
    tensorboard: bool = Field(
        False,
        description="Write TensorBoard event files into tensorboard/ of the run directory: one TensorBoard run for the job, one per rank, one per GPU. Needs the tensorboard extra.",
    )
    mlflow: MlflowSpec | None = Field(
        None,
        description="Log the same metrics, and the resolved job spec as parameters, to an MLflow run: {tracking_uri, experiment, run_name}.",
    )


def check_packages(report: ReportSpec, source: str | None = None) -> None:
    """SpecError (exit 2) naming the extra to install where ``report`` needs a package that is
    not installed here: tensorboard for event files, mlflow for a store that is not a server."""
    if report.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise SpecError(
            "report.tensorboard writes TensorBoard event files with the 'tensorboard' package, "
            "which is not installed; install the extra (pip install -e '.[tensorboard]' in the "
            "launcher's folder, or pip install tensorboard), or set report.tensorboard: false. "
            "The metrics stay in metrics/rank<R>.jsonl of the run directory either way",
            source=source,
            field="report.tensorboard",
        )
    mlflow = report.mlflow
    if mlflow is not None and not mlflow.server and importlib.util.find_spec("mlflow") is None:
        raise SpecError(
            f"report.mlflow.tracking_uri {mlflow.tracking_uri!r} is a store that only the 'mlflow' "
            f"package opens, and it is not installed; install the extra (pip install -e "
            f"'.[mlflow]' in the launcher's folder), or point tracking_uri at a tracking server "
            f"(http://HOST:5000), which the launcher writes to without the package",
            source=source,
            field="report.mlflow.tracking_uri",
        )


def resolve_store(report: ReportSpec, base: Path) -> ReportSpec:
    """``report`` with a relative MLflow store (``mlruns``, ``file:mlruns``,
    ``sqlite:///mlflow.db``) taken from ``base``, the job file's folder, as the absolute path
    the driver will open."""
    mlflow = report.mlflow
    if mlflow is None or mlflow.server:
        return report
    uri = mlflow.tracking_uri
    if uri.startswith("sqlite:///"):  # sqlite:///relative.db, sqlite:////absolute.db
        path, prefix = uri.removeprefix("sqlite:///"), "sqlite:///"
    else:
        path, prefix = uri.removeprefix("file:"), ""
    if path.startswith("//") or _SCHEME.match(path) or not path or path == ":memory:":
        return report  # file:///abs, postgresql://..., databricks: as given
    resolved = mlflow.model_copy(
        update={"tracking_uri": prefix + str((base / Path(path).expanduser()).resolve())}
    )
    return report.model_copy(update={"mlflow": resolved})
