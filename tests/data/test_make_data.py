"""experiments.make_data: prepares tasks by name, reports examples/s, skips what is there,
and rejects options a task does not take."""

import numpy as np
import pytest
import tensorflow_datasets as tfds
from absl import flags

from attention_jax import data
from experiments import make_data


def _write_release(folder):
  folder.mkdir()
  for name, count in (("train", 5), ("eval", 2), ("test", 3)):
    rows = [f"{i % 2}\tA{i}\tB{i}\tfirst {name} {i}\tsecond {i}\n" for i in range(count)]
    (folder / f"new_aan_pairs.{name}.tsv").write_text("".join(rows))
  return folder


def test_retrieval_from_release_files_then_skipped(tmp_path, capsys):
  release = _write_release(tmp_path / "release")
  argv = ["--task=retrieval", f"--data_dir={tmp_path / 'out'}", f"--release_dir={release}",
          "--train_size=4", "--option=seq_len=16", "--quiet"]
  (line,) = make_data.main(argv)
  assert line.startswith("retrieval: wrote 9 examples (train 4, validation 2, test 3) in ")
  assert line.split(" s, ")[1].split()[1] == "examples/s"
  assert line in capsys.readouterr().out
  splits = data.get_task("retrieval", seq_len=16).splits(tmp_path / "out")
  assert {split: len(source) for split, source in splits.items()} == {
      "train": 4, "validation": 2, "test": 3}
  first = splits["train"].gather(np.array([0]))["inputs"][0]
  assert bytes((first[first > 0] - 1).tolist()) == b"first train 0"
  assert make_data.main(argv) == [f"retrieval: already prepared in {tmp_path / 'out' / 'retrieval'}"
                                  ", nothing to do."]


def test_image_through_tfds_mock_with_size_scale(tmp_path):
  # 45000 / 5000 / 10000 scaled by 1e-4: 4 (rounded half to even), 1 (at least one), 1.
  with tfds.testing.mock_data(num_examples=6):
    (line,) = make_data.main(["--task=image", f"--data_dir={tmp_path}", "--size_scale=0.0001",
                              "--quiet"])
  assert line.startswith("image: wrote 6 examples (train 4, validation 1, test 1)")
  assert np.load(tmp_path / "image" / "train" / "inputs.npy").shape == (4, 1024)


def test_tiny_listops_run(tmp_path):
  argv = ["--task=listops", f"--data_dir={tmp_path}", "--train_size=6", "--validation_size=2",
          "--test_size=2", "--seed=1", "--quiet"]
  (line,) = make_data.main(argv)
  assert line.startswith("listops: wrote 10 examples (train 6, validation 2, test 2)")
  assert len(data.get_task("listops").splits(tmp_path)["train"]) == 6


def test_options_a_task_does_not_take_are_named(tmp_path):
  with pytest.raises(ValueError, match="task 'text' does not take --release_dir; it takes: "
                                       "seq_len"):
    make_data.main(["--task=retrieval", "--task=text", f"--data_dir={tmp_path}",
                    f"--release_dir={tmp_path}"])
  assert not (tmp_path / "retrieval").exists()  # checked before anything is prepared
  with pytest.raises(ValueError, match=r"task 'listops' does not take --tfds_data_dir "
                                       r"\(data_dir_tfds\), --option=colour=\.\.\.;"):
    make_data.main(["--task=listops", f"--data_dir={tmp_path}", f"--tfds_data_dir={tmp_path}",
                    "--option=colour=3"])


def test_bad_flags_are_named(tmp_path):
  with pytest.raises(flags.IllegalFlagValueError,
                     match=r"flag --option=\['seq_len'\]: expected NAME=VALUE, got 'seq_len'"):
    make_data.main(["--task=image", f"--data_dir={tmp_path}", "--option=seq_len"])
  with pytest.raises(flags.IllegalFlagValueError, match="flag --size_scale=0.0: must be positive"):
    make_data.main(["--task=image", f"--data_dir={tmp_path}", "--size_scale=0"])
  with pytest.raises(flags.IllegalFlagValueError, match="flag --task=.*nope"):
    make_data.main(["--task=nope", f"--data_dir={tmp_path}"])
