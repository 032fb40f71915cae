"""experiments.benchmark_ring on tiny lengths, in a subprocess (it needs its
simulated devices before jax initialises): records, and the ring's smaller
per-device memory (XLA's memory analysis, not a timing)."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_one_tiny_run_records_every_length_and_mode(tmp_path):
  out = tmp_path / "ring.json"
  result = subprocess.run(
      [sys.executable, "-m", "experiments.benchmark_ring", "--lengths=256,512", "--devices=4",
       "--block_size=32", "--time_max_length=256", "--repeats=1", f"--out={out}"],
      cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  payload = json.loads(out.read_text())
  records = {(r["length"], r["mode"]): r for r in payload["records"]}
  assert set(records) == {(t, m) for t in (256, 512) for m in ("fwd", "fwd_bwd")}
  for (length, _), record in records.items():
    # A quarter of the sequence per device, with the visiting chunk and the
    # zig-zag copies (about 0.5-0.6 here): under the single device's sequence.
    assert record["ring_peak_mib"] < 0.75 * record["blockwise_peak_mib"], record
    assert ("ring_ms" in record) == (length <= 256)
  assert payload["settings"]["devices"] == 4 and payload["devices"]["count"] == 8


def test_more_devices_than_jax_sees_is_refused():
  result = subprocess.run(
      [sys.executable, "-m", "experiments.benchmark_ring", "--lengths=64", "--devices=16",
       "--repeats=1"], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode != 0
  assert "--devices=16 but jax sees 8 devices" in result.stderr
