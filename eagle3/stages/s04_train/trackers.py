"""Stage 04's experiment trackers: the dashboards the field watches runs in.

`--report-to` names them, comma-separated: tensorboard, wandb, mlflow, trackio, or none;
`auto` (the default) is TensorBoard when it is installed and nothing else, as before.
Each tracker receives exactly what metrics.jsonl holds: every numeric field of a line as
`SPLIT/KEY` (`train/loss_0`, `eval/expected_accept_length`) at the line's `step`, and the
run's config (the stage's parameters, the store and vocab identities, the drafter's
shape) once at the start. None of them is a dependency of the pipeline: a tracker that is
chosen and not installed stops the stage before any work, naming the pip command.

Where they write (names from eagle3/artifacts/workdir.py):
    tensorboard   WorkDir.tensorboard_dir()
    wandb         WorkDir.tracker_dir()/wandb/ (WANDB_MODE=offline keeps it there; `wandb sync` uploads);
                  project $WANDB_PROJECT or "eagle3"; a resumed stage 04 continues the same run
    mlflow        $MLFLOW_TRACKING_URI, else WorkDir.tracker_dir()/mlruns (a local file store)
    trackio       trackio's own local store (its project: $TRACKIO_PROJECT or "eagle3")
Rank 0 only (eagle3/stages/s04_train/metrics.py opens them).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any

from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError

log = logging.getLogger(__name__)

TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")
CHOICES = (*TRACKERS, "auto", "none")
# The module each tracker imports, and the package pip installs it from.
MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}
DEFAULT_PROJECT = "eagle3"


def _installed(name: str) -> bool:
    return importlib.util.find_spec(MODULES[name]) is not None


def check_report_to(names: list[str]) -> None:
    """Refuse an unknown name, `none`/`auto` mixed with others, or a named tracker that is not
    installed (with the command that installs it). Called when the config is built, so the
    stage stops before any work."""
    unknown = [n for n in names if n not in CHOICES]
    if unknown or not names:
        raise PipelineError(f"--report-to {','.join(names)}: unknown tracker {unknown}; choose from "
                            f"{', '.join(CHOICES)} (comma-separated, e.g. --report-to tensorboard,wandb).")
    if len(names) > 1 and ({"none", "auto"} & set(names)):
        raise PipelineError(f"--report-to {','.join(names)}: `none` and `auto` stand alone; name the trackers "
                            f"instead (e.g. --report-to tensorboard,wandb).")
    missing = [n for n in names if n in TRACKERS and not _installed(n)]
    if missing:
        one = len(missing) == 1
        raise PipelineError(f"--report-to {','.join(names)}: {', '.join(missing)} {'is' if one else 'are'} not "
                            f"installed; install with `pip install {' '.join(PACKAGES[n] for n in missing)}`, or "
                            f"leave {'it' if one else 'them'} out of --report-to (metrics.jsonl is always written).")


def resolve(names: list[str]) -> list[str]:
    """The trackers to open: `auto` is TensorBoard when installed, `none` nothing."""
    check_report_to(names)
    if names == ["none"]:
        return []
    if names == ["auto"]:
        if _installed("tensorboard"):
            return ["tensorboard"]
        log.info("tensorboard is not installed; metrics go to metrics.jsonl only (--report-to names others: "
                 "%s)", ", ".join(TRACKERS))
        return []
    return list(dict.fromkeys(names))


def scalars(split: str, metrics: dict) -> dict[str, float]:
    """metrics.jsonl's numeric fields of one line, as the trackers name them: `SPLIT/KEY`."""
    return {f"{split}/{k}": float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def flat_config(config: dict, prefix: str = "") -> dict[str, Any]:
    """A nested run config flattened to `a.b.c` keys (MLflow's params are flat strings)."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_config(v, key + "."))
        else:
            out[key] = v if isinstance(v, (int, float, str, bool)) or v is None else json.dumps(v, default=str)
    return out


class Tracker:
    """One dashboard: `log` a metrics.jsonl line's scalars at its step; `close` at the end."""

    name = ""

    def log(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, workdir: WorkDir, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(str(workdir.tensorboard_dir()))
        self.w.add_text("run_config", "```\n" + json.dumps(config, indent=1, default=str) + "\n```", 0)

    def log(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.w.add_scalar(k, v, step)

    def close(self) -> None:
        self.w.close()


class WandbTracker(Tracker):
    """A W&B run in WorkDir.tracker_dir(); its id is kept there, so a resumed stage 04 logs
    into the same run. Offline (WANDB_MODE=offline) it writes only local files."""

    name = "wandb"

    def __init__(self, workdir: WorkDir, config: dict, run_name: str):
        import wandb

        root = workdir.tracker_dir()
        root.mkdir(parents=True, exist_ok=True)
        id_file = root / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", DEFAULT_PROJECT), name=run_name, id=run_id,
                              resume="allow", dir=str(root), config=config)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker(Tracker):
    """An MLflow run; without MLFLOW_TRACKING_URI, a local file store in WorkDir.tracker_dir()."""

    name = "mlflow"

    def __init__(self, workdir: WorkDir, config: dict, run_name: str):
        import mlflow

        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri((workdir.tracker_dir() / "mlruns").resolve().as_uri())
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_PROJECT))
        self.run = mlflow.start_run(run_name=run_name)
        # MLflow params are short strings: the flat config, each value cut to its limit.
        mlflow.log_params({k: str(v)[:500] for k, v in flat_config(config).items()})

    def log(self, step: int, values: dict[str, float]) -> None:
        self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class TrackioTracker(Tracker):
    """A trackio run (a local, W&B-compatible tracker)."""

    name = "trackio"

    def __init__(self, workdir: WorkDir, config: dict, run_name: str):
        import trackio

        self.trackio = trackio
        trackio.init(project=os.environ.get("TRACKIO_PROJECT", DEFAULT_PROJECT), name=run_name, config=config)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.trackio.log(values, step=step)

    def close(self) -> None:
        self.trackio.finish()


def open_trackers(names: list[str], workdir: WorkDir, config: dict) -> list[Tracker]:
    """The chosen trackers (names already `resolve`d), each given the run's config."""
    run_name = Path(workdir.root).resolve().name
    out: list[Tracker] = []
    for n in names:
        if n == "tensorboard":
            out.append(TensorBoardTracker(workdir, config))
        elif n == "wandb":
            out.append(WandbTracker(workdir, config, run_name))
        elif n == "mlflow":
            out.append(MlflowTracker(workdir, config, run_name))
        else:
            out.append(TrackioTracker(workdir, config, run_name))
        log.info("stage 04 reports to %s", n)
    return out
