"""The GRPO runner's loggers besides stdout and JSONL: wandb (NeMo-RL's `logger.wandb_enabled`
/ `logger.wandb:`) in wandb's offline mode, the records it writes to
`log_dir/wandb/.../run-*.wandb` read back; TensorBoard through a recording SummaryWriter."""

import io
import json
import struct
import sys
import time
from pathlib import Path

import pytest

from policyworker.errors import ConfigError
from policyworker.functional.grpo import STEP_METRICS, run_summary
from policyworker.grpo import load_run_config, run_grpo
from policyworker.grpo.config import LoggerSection, WandbSection
from policyworker.grpo.logger import RunLogger
from tests.shell.test_grpo_run import _run_file


def _records(path: Path):
    """The protobuf records of a .wandb file (wandb's LevelDB-style log: a 7-byte file header,
    32 KiB blocks, each record chunk behind a 7-byte crc/length/type header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), (ident, magic)
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += room
            continue
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = pb.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def _items(items) -> dict:
    # wandb writes a key either flat (`key`) or as its path (`nested_key`).
    return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}


def _offline_run(log_dir: Path) -> tuple[dict[int, dict], dict, dict]:
    """(history by step, config, summary) of the one offline run under `log_dir/wandb`.

    wandb's service process writes the file behind `finish()`: read until its exit record is
    there (30 s at most)."""
    deadline = time.monotonic() + 30
    while True:
        found = list((log_dir / "wandb").glob("wandb/offline-run-*/run-*.wandb"))
        records = list(_records(found[0])) if len(found) == 1 else []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        assert time.monotonic() < deadline, f"no finished offline run in {log_dir}: {found}"
        time.sleep(0.2)
    history, config, summary = {}, {}, {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history[record.history.step.num] = _items(record.history.item)
        elif kind == "config":
            config.update(_items(record.config.update))
        elif kind == "summary":
            summary.update(_items(record.summary.update))
        elif kind == "run":
            config.update(_items(record.run.config.update))
            config.update({"_project": record.run.project, "_name": record.run.display_name})
    return history, config, summary


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))


def test_each_step_reaches_the_wandb_run_under_nemo_rl_names(tmp_path, offline):
    section = LoggerSection(
        log_dir=str(tmp_path / "logs"),
        wandb_enabled=True,
        wandb=WandbSection(project="proj", name="run-a"),
    )
    logger = RunLogger(section, out=io.StringIO(), resume_step=0, hyperparams={"grpo": {"seed": 5}})
    metrics = dict.fromkeys(STEP_METRICS, 1.0)
    history = [{**metrics, "reward_mean": step / 10, "kl": 0.5} for step in (1, 2, 3)]
    for step, m in enumerate(history, start=1):
        logger.step(step, 3, m)
    logger.summary(run_summary(history), resumed_from=0)
    logger.close()
    history, config, summary = _offline_run(tmp_path / "logs")
    assert sorted(history) == [1, 2, 3]
    assert [history[s]["train/reward_mean"] for s in (1, 2, 3)] == [0.1, 0.2, 0.3]
    assert all(history[s]["train/kl"] == 0.5 for s in (1, 2, 3))
    assert config["grpo"] == {"seed": 5}
    assert (config["_project"], config["_name"]) == ("proj", "run-a")
    assert summary["summary/steps"] == 3.0


@pytest.mark.slow
def test_a_run_logs_its_steps_to_wandb(tmp_path, tiny_tokenizer_model_path, offline):
    path = _run_file(tmp_path, tiny_tokenizer_model_path)
    overrides = ["grpo.max_num_steps=2", "++logger.wandb_enabled=true", "++logger.wandb.name=r"]
    run_grpo(load_run_config(path, overrides), out=io.StringIO())
    logged = [json.loads(x) for x in (tmp_path / "logs/metrics.jsonl").read_text().splitlines()]
    history, config, _ = _offline_run(tmp_path / "logs")
    assert sorted(history) == [1, 2]
    for line in logged:
        for key in ("reward_mean", "kl", "loss", "tokens_per_s", "refit_ms"):
            assert history[line["step"]][f"train/{key}"] == pytest.approx(line[key]), key
    assert config["grpo"]["num_generations_per_prompt"] == 4
    assert config["policy"]["model_name"] == tiny_tokenizer_model_path


def test_wandb_enabled_without_wandb_is_a_config_problem(tmp_path, monkeypatch):
    path = _run_file(tmp_path, "/no/model")
    monkeypatch.setitem(sys.modules, "wandb", None)  # find_spec then reports it missing
    with pytest.raises(ConfigError) as info:
        load_run_config(path, ["++logger.wandb_enabled=true"])
    text = str(info.value)
    assert "wandb is not installed; pip install 'policyworker[grpo]'" in text
    assert "@ logger.wandb_enabled" in text
    with pytest.raises(ConfigError, match=r"projekt: did you mean 'project'\?\) @ logger\.wandb$"):
        load_run_config(path, ["++logger.wandb.projekt=x"])


class _Writer:
    """Stands in for torch's SummaryWriter (tensorboard is not in the test extra)."""

    made: list["_Writer"] = []

    def __init__(self, log_dir):
        self.log_dir, self.scalars, self.closed = log_dir, [], False
        _Writer.made.append(self)

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def close(self):
        self.closed = True


def test_tensorboard_gets_each_metric_as_train_scalars(tmp_path, monkeypatch):
    import types

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = _Writer  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    section = LoggerSection(log_dir=str(tmp_path / "logs"), tensorboard_enabled=True)
    logger = RunLogger(section, out=io.StringIO(), resume_step=0)
    for step in (1, 2):
        logger.step(step, 2, {**dict.fromkeys(STEP_METRICS, 0.0), "kl": step / 4})
    logger.close()
    (writer,) = _Writer.made
    assert writer.log_dir == str(tmp_path / "logs/tensorboard") and writer.closed
    assert ("train/kl", 0.25, 1) in writer.scalars and ("train/kl", 0.5, 2) in writer.scalars
    assert len(writer.scalars) == 2 * len(STEP_METRICS)
