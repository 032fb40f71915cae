"""Smoke test of experiments/benchmark_chunkwise.py on tiny shapes: bookkeeping, not speed
(no timing or ratio is asserted)."""

import json
import math
import pathlib
import sys

import jax
import numpy as np
import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # experiments/ is a script folder, not installed.
  sys.path.insert(0, str(REPO_ROOT))

from experiments import benchmark_chunkwise  # pylint: disable=g-import-not-at-top

from attention_jax.variants.chunkwise import engine  # pylint: disable=g-import-not-at-top

LENGTHS = (64, 128)
MIXERS = ("gla", "delta_net")
MODES = ("fwd", "fwd_bwd")
EXACT = benchmark_chunkwise.EXACT
SHAPE = ["--heads=2", "--key_dim=8", "--value_dim=8", "--chunk_size=32", "--repeats=1"]


@pytest.fixture(scope="module")
def payload(tmp_path_factory):
  # In this process (--noisolate) for speed; the scan is capped at T = 64 so
  # that its T = 128 cells are skipped.
  out = tmp_path_factory.mktemp("chunkwise") / "chunkwise.json"
  benchmark_chunkwise.main([f"--mixers={','.join(MIXERS)}",
                            f"--lengths={','.join(map(str, LENGTHS))}", *SHAPE,
                            "--max_recurrent_length=64", "--noisolate", f"--out={out}"])
  return json.loads(out.read_text())


def test_every_cell_is_measured_or_skipped_with_its_reason(payload):
  assert payload["arguments"]["mixers"] == list(MIXERS)
  assert payload["exact_attention"]["implementation"] == "blockwise"
  assert payload["environment"]["git_revision"] is not None
  records = {(r["mixer"], r["form"], r["seq_len"], r["mode"]): r for r in payload["records"]}
  expected = {(EXACT, EXACT, t, m) for t in LENGTHS for m in MODES}
  expected |= {(x, f, t, m) for x in MIXERS for f in ("chunkwise", "recurrent")
               for t in LENGTHS for m in MODES}
  assert set(records) == expected and len(payload["records"]) == len(expected)
  for (mixer, form, length, mode), record in records.items():
    if form == "recurrent" and length > 64:
      assert record["status"] == "skipped"
      assert "max_recurrent_length" in record["reason"]
      continue
    assert record["status"] == "ok" and record["reason"] is None, record
    assert record["ms"] > 0 and record["memory"]["peak_delta_bytes"] >= 0


def test_summary_per_mixer_and_mode(payload):
  rows = {(row["mixer"], row["mode"]): row for row in payload["summary"]}
  assert set(rows) == {(x, m) for x in MIXERS for m in MODES}
  for (mixer, mode), row in rows.items():
    assert row["lengths"] == list(LENGTHS)
    assert set(row["ms"]) == set(row["peak_bytes"]) == set(benchmark_chunkwise.FORMS)
    assert row["ms"]["recurrent"][1] is None  # skipped
    assert row["crossover_length"] is None or row["crossover_length"] in LENGTHS
    assert row["memory_slope"] is None or math.isfinite(row["memory_slope"])
    assert math.isfinite(row["time_slope"])
    # The ratios are those of the records of this run.
    ms = {(r["form"], r["seq_len"]): r.get("ms") for r in payload["records"]
          if r["mode"] == mode and r["mixer"] in (mixer, EXACT)}
    assert row["speedup_vs_exact"] == pytest.approx(
        [ms[EXACT, t] / ms["chunkwise", t] for t in LENGTHS])
    assert row["speedup_vs_recurrent"][0] == pytest.approx(
        ms["recurrent", 64] / ms["chunkwise", 64])
    assert row["speedup_vs_recurrent"][1] is None


def test_cells_in_their_own_processes_and_exact_attention_capped(tmp_path):
  out = tmp_path / "isolated.json"
  benchmark_chunkwise.main(["--mixers=gla", "--lengths=64", "--modes=fwd", *SHAPE,
                            "--max_exact_length=32", f"--out={out}"])
  records = {r["form"]: r for r in json.loads(out.read_text())["records"]}
  assert records[EXACT]["status"] == "skipped"
  assert "max_exact_length" in records[EXACT]["reason"]
  for form in ("chunkwise", "recurrent"):
    assert records[form]["status"] == "ok", records[form]
    assert records[form]["ms"] > 0 and records[form]["memory"]["method"] == "process"
    assert records[form]["memory"]["peak_delta_bytes"] >= 0


def test_crossover_length():
  lengths = [1, 2, 4, 8]
  crossover = benchmark_chunkwise.crossover_length
  assert crossover(lengths, [5, 3, 2, 1], [1, 4, 3, 9]) == 2
  # Faster at 2 but not at 4: the crossover is from 8 on.
  assert crossover(lengths, [5, 3, 4, 1], [1, 4, 3, 9]) == 8
  assert crossover(lengths, [5, 3, 2, 9], [1, 4, 3, 9]) is None
  # Lengths where either was not measured are left out.
  assert crossover(lengths, [5, 3, None, 1], [1, 4, 3, None]) == 2
  assert crossover(lengths, [None] * 4, [1, 2, 3, 4]) is None


@pytest.mark.parametrize("mixer", sorted(benchmark_chunkwise.MIXERS))
def test_each_kind_of_input_is_a_recurrence_the_forms_agree_on(mixer):
  cell = dict(batch=1, seq_len=12, heads=2, key_dim=4, value_dim=3, dtype="float32",
              mixer=mixer)

  def both_forms(q, k, v, gates):  # one program for the two forms
    arguments = benchmark_chunkwise.engine_arguments(mixer, q, k, v, gates)
    return engine.chunkwise_form(*arguments, chunk_size=8)[0], engine.recurrent_form(*arguments)[0]

  chunkwise, recurrent = jax.jit(both_forms)(*benchmark_chunkwise.make_inputs(cell))
  np.testing.assert_allclose(chunkwise, recurrent, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mixer", ["gla", "gated_delta_net"])
def test_the_kernel_form_computes_the_engine_s_recurrence(mixer):
  # --chunkwise_implementation=pallas_gpu times the Triton chunk kernels
  # (interpreted off a GPU); their step equals the engine's on the same inputs.
  cell = dict(batch=1, seq_len=40, heads=2, key_dim=8, value_dim=8, dtype="float32",
              mixer=mixer, mode="fwd", chunk_size=16, exact_implementation="blockwise")
  kernel_step, inputs = benchmark_chunkwise.make_step(
      dict(cell, form="chunkwise", chunkwise_implementation="pallas_gpu"))
  engine_step, _ = benchmark_chunkwise.make_step(
      dict(cell, form="chunkwise", chunkwise_implementation="engine"))
  assert "pallas_call" in str(jax.make_jaxpr(kernel_step)(*inputs))
  assert "pallas_call" not in str(jax.make_jaxpr(engine_step)(*inputs))
  np.testing.assert_allclose(kernel_step(*inputs), engine_step(*inputs), rtol=1e-4, atol=1e-5)


def test_the_exact_implementation_is_recorded(tmp_path):
  out = tmp_path / "exact.json"
  benchmark_chunkwise.main(["--mixers=gla", "--lengths=64", "--modes=fwd", *SHAPE,
                            "--exact_implementation=xla", "--max_recurrent_length=1",
                            "--noisolate", f"--out={out}"])
  payload = json.loads(out.read_text())
  assert payload["exact_attention"]["implementation"] == "xla"
  exact = [r for r in payload["records"] if r["mixer"] == EXACT]
  assert [r["exact_implementation"] for r in exact] == ["xla"] and exact[0]["status"] == "ok"


def test_a_saved_run_prints_its_table(payload, capsys, tmp_path):
  saved = tmp_path / "saved.json"
  saved.write_text(json.dumps(payload))
  benchmark_chunkwise.main([f"--from_json={saved}"])
  printed = capsys.readouterr().out
  assert "exact attention: blockwise" in printed
  assert all(f"{mixer:<16} {mode:>8}" in printed for mixer in MIXERS for mode in MODES)
