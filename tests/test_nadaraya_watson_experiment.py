"""experiments.nadaraya_watson: the learned width beats the fixed one on the
leave-one-out error it is trained on, and the script writes its figure."""

import json

import numpy as np

from experiments import nadaraya_watson


def _leave_one_out_error(x, y, log_width):
  others = ~np.eye(len(x), dtype=bool)
  predicted = nadaraya_watson.regress(x, x, y, kernel="gaussian", key_mask=others,
                                      log_width=np.array([log_width], np.float32))
  return float(np.mean((np.asarray(predicted) - y) ** 2))


def test_the_learned_width_lowers_the_leave_one_out_error():
  x, y, _ = nadaraya_watson.make_data(seed=3)
  log_width = nadaraya_watson.learn_log_width(x, y, steps=60)
  assert log_width != 0.0
  assert _leave_one_out_error(x, y, log_width) < _leave_one_out_error(x, y, 0.0)


def test_the_script_writes_the_figure_and_the_table(tmp_path):
  assert nadaraya_watson.main([f"--out={tmp_path}", "--steps=20"]) == 0
  assert (tmp_path / "nadaraya_watson.png").stat().st_size > 1000
  results = json.loads((tmp_path / "results.json").read_text())
  assert set(results["errors"]) >= {"average pooling", "Gaussian, width 1"}
  assert "| average pooling |" in (tmp_path / "table.md").read_text()
