"""MetricsLogger / read_metrics / peak_memory: JSON lines, resume truncation, TensorBoard
event files, the progress bar, disabled hosts and argument checks."""

import json
import struct
import time

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX import crc32c
from tensorboardX.proto import event_pb2

from attention_jax.train import metrics
from attention_jax.train.metrics import MetricsLogger, peak_memory, read_metrics


def _masked_crc(data: bytes) -> int:
  # The TFRecord framing's masking: rotate right by 15 bits, add a constant.
  crc = crc32c.crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _read_event_file(path):
  """The `Event` protos of one event file, checking the TFRecord framing and CRCs."""
  data = path.read_bytes()
  events, pos = [], 0
  while pos < len(data):
    header = data[pos:pos + 8]
    (length,) = struct.unpack("<Q", header)
    (header_crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
    assert header_crc == _masked_crc(header), f"{path}: bad length CRC at byte {pos}"
    body = data[pos + 12:pos + 12 + length]
    assert len(body) == length, f"{path}: truncated record at byte {pos}"
    (body_crc,) = struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])
    assert body_crc == _masked_crc(body), f"{path}: bad data CRC at byte {pos}"
    event = event_pb2.Event()
    event.ParseFromString(body)
    events.append(event)
    pos += 16 + length
  return events


def _event_files(workdir):
  files = sorted((workdir / "tensorboard").glob("events.out.tfevents.*"))
  assert files, f"no event file under {workdir / 'tensorboard'}"
  return files


def _scalars(events):
  """{(tag, step): (value, wall_time)} of the scalar summaries."""
  return {(value.tag, event.step): (value.simple_value, event.wall_time)
          for event in events if event.HasField("summary") for value in event.summary.value}


def _write_steps(workdir, steps, start_step=0, total_steps=10):
  with MetricsLogger(workdir, total_steps=total_steps, start_step=start_step,
                     progress=False) as logger:
    for step in steps:
      logger.write(step, "train", {"loss": 1.0 / step})
      if step % 5 == 0:
        logger.write(step, "validation", {"loss": 2.0 / step})


def test_jsonl_records_have_the_fields_and_plain_python_types(tmp_path):
  before = time.time()
  logger = MetricsLogger(tmp_path, total_steps=100, progress=False)
  logger.write(np.int64(3), "train", {
      "loss": np.float32(0.25), "accuracy": jnp.float32(0.1), "tokens": np.int64(4096),
      "lr": 1e-3, "count": 7, "finite": np.bool_(True), "note": "warm-up",
      "bf16": jnp.asarray(1.5, jnp.bfloat16)})
  # Flushed after each write: readable before close.
  [record] = read_metrics(tmp_path)
  logger.close()
  assert set(record) == {"step", "split", "time", "loss", "accuracy", "tokens", "lr", "count",
                         "finite", "note", "bf16"}
  assert record["step"] == 3 and type(record["step"]) is int
  assert record["split"] == "train"
  assert type(record["time"]) is float and before <= record["time"] <= time.time()
  assert type(record["loss"]) is float and record["loss"] == 0.25
  assert type(record["accuracy"]) is float and record["accuracy"] == float(np.float32(0.1))
  assert type(record["tokens"]) is int and record["tokens"] == 4096
  assert record["lr"] == 1e-3 and record["count"] == 7 and type(record["count"]) is int
  assert record["finite"] is True and record["note"] == "warm-up" and record["bf16"] == 1.5
  # The file itself is one standard JSON object a line.
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == 1 and json.loads(lines[0]) == record


def test_read_metrics_keeps_file_order_and_filters_by_split(tmp_path):
  _write_steps(tmp_path, range(1, 11))
  everything = read_metrics(tmp_path)
  assert [(r["step"], r["split"]) for r in everything] == (
      [(s, "train") for s in range(1, 5)] + [(5, "train"), (5, "validation")]
      + [(s, "train") for s in range(6, 10)] + [(10, "train"), (10, "validation")])
  validation = read_metrics(tmp_path, split="validation")
  assert [(r["step"], r["loss"]) for r in validation] == [(5, 2.0 / 5), (10, 2.0 / 10)]
  assert [r["step"] for r in read_metrics(tmp_path, "train")] == list(range(1, 11))
  assert read_metrics(tmp_path, "test") == []


def test_read_metrics_of_a_missing_file_is_empty(tmp_path):
  assert read_metrics(tmp_path / "nowhere") == []


def test_read_metrics_names_the_file_and_line_of_a_malformed_record(tmp_path):
  (tmp_path / "metrics.jsonl").write_text(
      '{"step": 1, "split": "train", "loss": 1.0}\n{"step": 2, "spl\n'
      '{"step": 3, "split": "train", "loss": 0.5}\n')
  with pytest.raises(ValueError, match=r"metrics\.jsonl:2"):
    read_metrics(tmp_path)
  (tmp_path / "metrics.jsonl").write_text('[1, 2]\n')
  with pytest.raises(ValueError, match=r"metrics\.jsonl:1"):
    read_metrics(tmp_path)


def test_resume_drops_the_records_after_the_restored_step(tmp_path):
  _write_steps(tmp_path, range(1, 11))
  # The run was killed after its checkpoint of step 6: 7..10 are about to be re-run.
  logger = MetricsLogger(tmp_path, total_steps=10, start_step=6, progress=False)
  assert [r["step"] for r in read_metrics(tmp_path, "train")] == [1, 2, 3, 4, 5, 6]
  assert [r["step"] for r in read_metrics(tmp_path, "validation")] == [5]
  for step in (7, 8):
    logger.write(step, "train", {"loss": -float(step)})
  logger.close()
  train = read_metrics(tmp_path, "train")
  assert [r["step"] for r in train] == list(range(1, 9))
  assert [r["loss"] for r in train] == [1.0 / s for s in range(1, 7)] + [-7.0, -8.0]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "tensorboard"]


def test_resume_drops_a_partial_last_line(tmp_path):
  _write_steps(tmp_path, range(1, 7))
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 7, "split": "train", "lo')  # killed mid-write
  with pytest.raises(ValueError):
    read_metrics(tmp_path)
  with MetricsLogger(tmp_path, total_steps=10, start_step=6, progress=False) as logger:
    assert [r["step"] for r in read_metrics(tmp_path, "train")] == [1, 2, 3, 4, 5, 6]
    logger.write(7, "train", {"loss": 0.5})
  assert [r["step"] for r in read_metrics(tmp_path, "train")] == [1, 2, 3, 4, 5, 6, 7]


def test_a_fresh_start_keeps_earlier_records_but_repairs_a_partial_line(tmp_path):
  _write_steps(tmp_path, range(1, 4))
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 4, "split"')
  with MetricsLogger(tmp_path, total_steps=10, progress=False) as logger:
    logger.write(1, "test", {"accuracy": 0.75})
  assert [(r["step"], r["split"]) for r in read_metrics(tmp_path)] == [
      (1, "train"), (2, "train"), (3, "train"), (1, "test")]


def test_resume_refuses_to_prune_a_damaged_file(tmp_path):
  text = ('{"step": 1, "split": "train"}\nnot json\n'
          '{"step": 2, "split": "train"}\n{"step": 3, "split": "train"}\n')
  (tmp_path / "metrics.jsonl").write_text(text)
  with pytest.raises(ValueError, match=r"metrics\.jsonl:2"):
    MetricsLogger(tmp_path, total_steps=10, start_step=2, progress=False)
  assert (tmp_path / "metrics.jsonl").read_text() == text


def test_tensorboard_scalars_are_written_with_tags_steps_and_values(tmp_path):
  with MetricsLogger(tmp_path, total_steps=10, progress=False) as logger:
    logger.write(1, "train", {"loss": 0.75, "accuracy": np.float32(0.5), "note": "text"})
    logger.write(2, "train", {"loss": jnp.float32(0.625), "accuracy": 0.5625})
    logger.write(2, "validation", {"loss": 0.875, "accuracy": 0.25, "examples": 512})
  [path] = _event_files(tmp_path)
  events = _read_event_file(path)
  assert events[0].file_version == "brain.Event:2"
  scalars = _scalars(events)
  values = {key: value for key, (value, _) in scalars.items()}
  # Strings stay out of TensorBoard; every number is a scalar "<split>/<name>".
  assert values == {
      ("train/loss", 1): 0.75, ("train/accuracy", 1): 0.5,
      ("train/loss", 2): 0.625, ("train/accuracy", 2): 0.5625,
      ("validation/loss", 2): 0.875, ("validation/accuracy", 2): 0.25,
      ("validation/examples", 2): 512.0,
  }
  # The events carry the same wall time as the JSON lines.
  times = {(f"{r['split']}/loss", r["step"]): r["time"] for r in read_metrics(tmp_path)}
  for key, when in times.items():
    assert scalars[key][1] == pytest.approx(when)
  # A fresh run asks TensorBoard to purge nothing.
  assert not any(event.HasField("session_log") for event in events)


def test_tensorboard_purges_the_stale_steps_after_a_resume(tmp_path):
  _write_steps(tmp_path, range(1, 11))
  with MetricsLogger(tmp_path, total_steps=10, start_step=6, progress=False) as logger:
    logger.write(7, "train", {"loss": 0.125})
  first, second = _event_files(tmp_path)
  first_events = _read_event_file(first)
  assert {step for (tag, step) in _scalars(first_events) if tag == "train/loss"} == set(
      range(1, 11))
  second_events = _read_event_file(second)
  starts = [event for event in second_events if event.HasField("session_log")]
  # TensorBoard drops the earlier files' events at steps >= 7 when it meets this.
  assert len(starts) == 1
  assert starts[0].session_log.status == event_pb2.SessionLog.START and starts[0].step == 7
  assert {key: value for key, (value, _) in _scalars(second_events).items()} == {
      ("train/loss", 7): 0.125}


def test_a_disabled_logger_creates_nothing_and_prints_nothing(tmp_path, capsys):
  workdir = tmp_path / "run"
  logger = MetricsLogger(workdir, total_steps=10, enabled=False, description="x")
  logger.advance(1, loss=0.5)
  logger.write(1, "train", {"loss": 0.5})
  logger.message("saved checkpoint 1")
  logger.close()
  assert not workdir.exists()
  assert capsys.readouterr() == ("", "")


def test_enabled_defaults_to_the_first_host(tmp_path):
  # One process here: process_index() == 0, so the default logger writes.
  with MetricsLogger(tmp_path, total_steps=5, progress=False) as logger:
    assert logger.enabled
    logger.write(1, "train", {"loss": 1.0})
  assert len(read_metrics(tmp_path)) == 1


def test_progress_bar_shows_steps_loss_and_rate_and_messages_go_above_it(tmp_path, capsys):
  logger = MetricsLogger(tmp_path, total_steps=10, start_step=4, description="listops/dense")
  out, err = capsys.readouterr()
  assert "listops/dense" in err and "4/10" in err
  for step in range(5, 11):
    logger.advance(step, loss=jnp.float32(1.0 / step), lr=np.float64(1.23456e-4), phase="main")
  logger.message("saved checkpoint 10")
  logger.close()
  out, err = capsys.readouterr()
  assert "saved checkpoint 10" in out
  # The bar's last state: absolute step, the postfix (compact floats), tqdm's rate.
  last = err.replace("\r", "\n").strip().splitlines()[-1]
  assert "10/10" in last and "step/s" in last
  assert "loss=0.1" in last and "lr=0.0001235" in last and "phase=main" in last


def test_without_a_bar_advance_is_silent_and_messages_are_printed(tmp_path, capsys):
  with MetricsLogger(tmp_path, total_steps=10, progress=False) as logger:
    logger.advance(3, loss=0.5)
    logger.message("evaluating")
  out, err = capsys.readouterr()
  assert out == "evaluating\n" and err == ""


def test_a_closed_logger_refuses_writes(tmp_path):
  with MetricsLogger(tmp_path, total_steps=10, progress=False) as logger:
    pass
  logger.close()  # a second close does nothing
  with pytest.raises(RuntimeError, match="closed"):
    logger.write(1, "train", {"loss": 1.0})


@pytest.mark.parametrize("kwargs, name", [
    (dict(total_steps=0), "total_steps"),
    (dict(total_steps=2.5), "total_steps"),
    (dict(total_steps=True), "total_steps"),
    (dict(total_steps=10, start_step=-1), "start_step"),
    (dict(total_steps=10, start_step="3"), "start_step"),
])
def test_bad_constructor_arguments_raise(tmp_path, kwargs, name):
  with pytest.raises(ValueError, match=name):
    MetricsLogger(tmp_path / "run", progress=False, **kwargs)
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("step, split, values, match", [
    (-1, "train", {"loss": 1.0}, "step"),
    (1.5, "train", {"loss": 1.0}, "step"),
    (1, "", {"loss": 1.0}, "split"),
    (1, None, {"loss": 1.0}, "split"),
    (1, "train", {"step": 1.0}, "reserved"),
    (1, "train", {"": 1.0}, "metric names"),
    (1, "train", {"loss": np.ones(3)}, "'loss'"),
    (1, "train", {"loss": None}, "'loss'"),
    (1, "train", {"loss": 1 + 2j}, "'loss'"),
])
def test_bad_write_arguments_raise_and_write_nothing(tmp_path, step, split, values, match):
  with MetricsLogger(tmp_path, total_steps=10, progress=False) as logger:
    with pytest.raises(ValueError, match=match):
      logger.write(step, split, values)
  assert read_metrics(tmp_path) == []


def test_read_metrics_rejects_an_empty_split(tmp_path):
  with pytest.raises(ValueError, match="split"):
    read_metrics(tmp_path, split="")


def test_peak_memory_on_cpu_is_the_process_peak_rss():
  # Touch 64 MB so that the process peak is at least that much.
  block = np.ones(8 * 1024 * 1024, np.float64)
  result = peak_memory()
  del block
  assert set(result) == {"peak_memory_bytes", "memory_source"}
  assert result["memory_source"] == "host_rss"
  assert type(result["peak_memory_bytes"]) is int
  assert 64 * 1024 * 1024 <= result["peak_memory_bytes"] < 1 << 40


def test_peak_memory_takes_the_largest_device_peak(monkeypatch):
  class FakeDevice:

    def __init__(self, stats):
      self.stats = stats

    def memory_stats(self):
      return self.stats

  devices = [FakeDevice({"peak_bytes_in_use": 300, "bytes_in_use": 10}),
             FakeDevice({"peak_bytes_in_use": 700}), FakeDevice(None)]
  monkeypatch.setattr(metrics.jax, "local_devices", lambda: devices)
  assert peak_memory() == {"peak_memory_bytes": 700, "memory_source": "device"}
