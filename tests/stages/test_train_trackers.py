"""Stage 04's trackers (--report-to, eagle3/stages/s04_train/trackers.py) get metrics.jsonl's keys
and steps and the run's config; a chosen tracker that is not installed stops the stage with the
pip command; the run ends with one block naming the best step and the checkpoint stage 05 exports.

wandb runs for real, offline (WANDB_MODE=offline): its run file (.wandb, a log of protobuf
records) is read back and compared with metrics.jsonl. MLflow and trackio need a package this
machine may not have: their adapters are fed stand-in modules that record the calls."""
from __future__ import annotations

import importlib.machinery
import json
import logging
import struct
import sys
import types
from pathlib import Path

import pytest
from fixtures import copy_stages

from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.stages.s04_train import trackers
from eagle3.stages.s04_train.config import TrainConfig
from eagle3.stages.s04_train.run import train_drafter

SMALL = dict(batch_tokens=1024, max_seq_len=256, log_every=1, eval_every=2, save_every=1000, ttt_steps=2,
             warmup_steps=2, max_steps=4, learning_rate=2e-3)


def wandb_records(path: Path) -> list:
    """The protobuf records of a wandb run file: a 7-byte header (":W&B", magic, version), then
    LevelDB-log records (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last) in
    32 KiB blocks whose tails shorter than a record header are zero padding."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    i, buf, out, block = 7, b"", [], 32768
    while i + 7 <= len(data):
        if block - i % block < 7:
            i += block - i % block
            continue
        _, n, kind = struct.unpack("<IHB", data[i:i + 7])
        chunk, i = data[i + 7:i + 7 + n], i + 7 + n
        if kind == 0:
            break
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(buf)
            out.append(r)
            buf = b""
    return out


def test_wandb_offline_logs_metrics_jsonl_keys_steps_and_the_run_config(tmp_path, stages_123, tiny_llama,
                                                                        monkeypatch, caplog):
    import wandb  # noqa: F401  requirements-dev.txt; scripts/setup_cpu.sh installs it (CI must have it: no skip)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    work = copy_stages(stages_123, tmp_path / "w")
    with caplog.at_level(logging.INFO, logger="eagle3"):
        train_drafter(TrainConfig(work_dir=work, target_model=str(tiny_llama), report_to=["wandb"], **SMALL))
    workdir = WorkDir(work)
    lines = [json.loads(x) for x in workdir.train_metrics().read_text().splitlines()]
    runs = sorted((workdir.tracker_dir() / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    records = wandb_records(runs[0])
    history: dict[int, dict] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            history.setdefault(int(r.history.step.num), {}).update(row)
    # Every numeric field of every metrics.jsonl line, as SPLIT/KEY at its step, and nothing else of ours.
    expected: dict[int, dict] = {}
    for line in lines:
        for k, v in line.items():
            if k not in ("split", "step"):
                expected.setdefault(line["step"], {})[f"{line['split']}/{k}"] = v
    assert sorted(history) == sorted(expected) == [0, 1, 2, 3, 4]
    for step, row in expected.items():
        ours = {k: v for k, v in history[step].items() if not k.startswith("_")}
        assert ours.keys() == row.keys(), step
        for k, v in row.items():
            assert ours[k] == pytest.approx(v, rel=1e-6), (step, k)
    assert {"eval/expected_accept_length", "train/loss_0", "train/lr"} <= set(history[2])
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    manifest = json.loads(workdir.manifest("train").read_text())
    assert config["params"]["ttt_steps"] == 2 and config["settings"]["report_to"] == ["wandb"]
    assert config["inputs"] == manifest["inputs"]  # the store and vocab identities stage 04 recorded
    assert config["identity"] and config["drafter_config"]["draft_vocab_size"] > 0
    # The block at the end of the run: best step, its figures, where stage 05 exports from.
    text = caplog.text
    best = manifest["record"]["best_step"]
    assert "stage 04 finished: 4 steps, K = 2 train-time-test steps" in text
    assert f"best held-out step {best}: expected accept length " in text
    assert f"the exported drafter will come from {workdir.best_checkpoint()} (step {best})" in text


def test_a_chosen_tracker_that_is_not_installed_stops_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr(trackers, "_installed", lambda name: name == "tensorboard")
    with pytest.raises(PipelineError, match=r"mlflow is not installed; install with `pip install mlflow`"):
        TrainConfig(work_dir=tmp_path, target_model="t", report_to=["tensorboard", "mlflow"])
    with pytest.raises(PipelineError, match=r"wandb, trackio are not installed; install with `pip install wandb "
                                            r"trackio`"):
        TrainConfig(work_dir=tmp_path, target_model="t", report_to=["wandb", "trackio"])
    with pytest.raises(PipelineError, match="unknown tracker"):
        TrainConfig(work_dir=tmp_path, target_model="t", report_to=["wandbb"])
    with pytest.raises(PipelineError, match="stand alone"):
        TrainConfig(work_dir=tmp_path, target_model="t", report_to=["none", "wandb"])
    # The default stays what it was: TensorBoard when installed, nothing (and no error) otherwise.
    assert TrainConfig(work_dir=tmp_path, target_model="t").report_to == ["auto"]
    assert trackers.resolve(["auto"]) == ["tensorboard"] and trackers.resolve(["none"]) == []
    monkeypatch.setattr(trackers, "_installed", lambda name: False)
    assert trackers.resolve(["auto"]) == []


def stand_in(name: str, calls: list) -> types.ModuleType:
    """A module that records every call made on it (for a tracker package not installed here)."""
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for fn in ("set_tracking_uri", "set_experiment", "start_run", "log_params", "log_metrics", "end_run",
               "init", "log", "finish"):
        setattr(mod, fn, (lambda f: lambda *a, **k: calls.append((f, a, k)))(fn))
    return mod


@pytest.mark.parametrize("name", ["mlflow", "trackio"])
def test_mlflow_and_trackio_adapters_send_the_same_keys_and_steps(tmp_path, monkeypatch, name):
    calls: list = []
    monkeypatch.setitem(sys.modules, name, stand_in(name, calls))
    workdir = WorkDir(tmp_path / "w")
    config = {"params": {"ttt_steps": 2}, "inputs": {"extract": "abc"}}
    (t,) = trackers.open_trackers([name], workdir, config)
    values = trackers.scalars("eval", {"loss_0": 1.5, "expected_accept_length": 1.7, "num_valid": 10.0})
    t.log(50, values)
    t.close()
    logged = [(a, k) for f, a, k in calls if f in ("log_metrics", "log")]
    assert logged == [((values,), {"step": 50})]
    assert values == {"eval/loss_0": 1.5, "eval/expected_accept_length": 1.7, "eval/num_valid": 10.0}
    if name == "mlflow":
        params = next(a[0] for f, a, _ in calls if f == "log_params")
        assert params == {"params.ttt_steps": "2", "inputs.extract": "abc"}
        uri = next(a[0] for f, a, _ in calls if f == "set_tracking_uri")
        assert uri.startswith("file:") and uri.endswith("04_train/trackers/mlruns")
    else:
        assert next(k for f, _, k in calls if f == "init")["config"] == config
