"""experiments.make_data: prepares tasks by name, reports examples/s, skips what is there,
and rejects options a task does not take."""

import numpy as np
import pytest
import tensorflow_datasets as tfds
import urllib3
from absl import flags

import tfds_offline
from attention_jax import data
from experiments import cli, make_data


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


def test_text_downloads_and_prepares_through_the_real_builder(tmp_path):
  # The command a machine with network runs; here tfds's download manager is served a
  # written aclImdb_v1.tar.gz instead of the URL, everything else is the real path.
  archive = tfds_offline.write_imdb_archive(tmp_path / "downloads", {
      "aclImdb/train/pos/0_9.txt": b"loved it", "aclImdb/train/neg/0_2.txt": b" hated it\n",
      "aclImdb/train/unsup/0_0.txt": b"?", "aclImdb/test/neg/0_1.txt": b"no",
      "aclImdb/test/pos/0_8.txt": b"yes", "aclImdb/test/pos/1_7.txt": b"yes!"})
  argv = ["--task=text", f"--data_dir={tmp_path / 'out'}", f"--tfds_data_dir={tmp_path / 'tfds'}",
          "--option=seq_len=10", "--quiet"]
  with tfds_offline.downloads_from({tfds_offline.IMDB_URL: archive}):
    (line,) = make_data.main(argv)
  assert line.startswith("text: wrote 8 examples (train 2, validation 3, test 3) in ")
  train = data.get_task("text", seq_len=10).splits(tmp_path / "out")["train"]
  batch = train.gather(np.arange(2))
  got = {bytes((row[row > 0] - 1).tolist()): int(label)
         for row, label in zip(batch["inputs"], batch["label"])}
  assert got == {b"loved it": 1, b"hated it": 0}
  assert (tmp_path / "tfds" / "imdb_reviews" / "plain_text").is_dir()


def test_image_downloads_and_prepares_through_the_real_builder(tmp_path):
  # One image per training batch file and two test images; image i is the grey level i * 10
  # (r = g = b: grey int(i * 10 / 255 * 0.9999 * 255.5), i * 10 for these) with label i.
  def record(i):
    return i, np.full((32, 32, 3), i * 10, np.uint8)

  files = {f"data_batch_{i}.bin": [record(i)] for i in range(1, 6)}
  files["test_batch.bin"] = [record(7), record(8)]
  archive = tfds_offline.write_cifar10_archive(tmp_path / "downloads", files)
  argv = ["--task=image", f"--data_dir={tmp_path / 'out'}", f"--tfds_data_dir={tmp_path / 'tfds'}",
          "--quiet"]
  with tfds_offline.downloads_from({tfds_offline.CIFAR10_URL: archive}):
    (line,) = make_data.main(argv)
  assert line.startswith("image: wrote 7 examples (train 4, validation 1, test 2) in ")
  splits = data.get_task("image").splits(tmp_path / "out")
  seen = []
  for split in data.SPLITS:
    batch = splits[split].gather(np.arange(len(splits[split])))
    for tokens, label in zip(batch["inputs"], batch["label"]):
      np.testing.assert_array_equal(tokens, np.full(1024, label * 10 + 1))
      seen.append((split if split == "test" else "train", int(label)))
  assert sorted(seen) == [("test", 7), ("test", 8), *(("train", i) for i in range(1, 6))]


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


def test_offline_text_is_one_line_naming_the_download_and_where_to_place_it(
    tmp_path, monkeypatch, capsys):
  # No network: every request goes to a closed port on this machine and fails at once.
  for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
    monkeypatch.setenv(proxy, "http://127.0.0.1:9")
  for variable in ("NO_PROXY", "no_proxy"):
    monkeypatch.delenv(variable, raising=False)
  # tensorflow-datasets retries 10 times with exponential back-off (about 3.5 minutes
  # offline); the test keeps the retries and drops the waits between them.
  monkeypatch.setattr(urllib3.util.retry.Retry, "get_backoff_time", lambda retry: 0.0)
  tfds_dir = tmp_path / "tfds"
  args = cli.parse(make_data.define_flags, ["--task=text", f"--data_dir={tmp_path / 'out'}",
                                            f"--tfds_data_dir={tfds_dir}", "--quiet"])
  assert make_data.command_line(args) == 1
  (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
  manual_dir = tfds_dir / "downloads" / "manual"
  assert "'imdb_reviews'" in line and f"{tfds_offline.IMDB_URL} failed" in line
  assert f"place it in {manual_dir}/" in line and "Download aclImdb_v1.tar.gz" in line
  # The instruction is the one tensorflow-datasets follows: a file placed there is read
  # instead of the download (this one is not the real archive, so its checksum is refused).
  tfds_offline.write_imdb_archive(manual_dir, {"aclImdb/train/pos/0_9.txt": b"placed by hand"})
  with pytest.raises(RuntimeError, match=r"(?i)checksum"):
    make_data.main(["--task=text", f"--data_dir={tmp_path / 'out'}",
                    f"--tfds_data_dir={tfds_dir}", "--quiet"])
