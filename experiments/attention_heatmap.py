r"""The attention weights of a trained RNN encoder-decoder on one test example,
as a heatmap (target step x source position).

  python -m experiments.attention_heatmap \
      --workdir=results/seq2seq_smoke/runs/reverse/additive/method/seed0 \
      --out=results/seq2seq_smoke/heatmap.png

The run's best checkpoint decodes the example greedily; the weights are those
of teacher forcing on that output (the same steps, `DecoderStep`), collected
from the "intermediates" that `MultiHeadAttention` sows. For string reversal
the alignment is the anti-diagonal.
"""

from __future__ import annotations

import functools
import pathlib
import sys
from typing import Sequence

import numpy as np
from absl import flags, logging

from experiments import cli


def define_flags(flag_values: flags.FlagValues, argv: Sequence[str]) -> None:
  """This script's flags (see `experiments.cli`)."""
  del argv
  flags.DEFINE_string("workdir", None, "a finished rnn_seq2seq run", flag_values=flag_values)
  flags.DEFINE_string("out", None, "the PNG to write", flag_values=flag_values)
  flags.DEFINE_integer("example", 0, "the index of the test example", lower_bound=0,
                       flag_values=flag_values)
  flags.mark_flags_as_required(["workdir", "out"], flag_values=flag_values)


def symbols(tokens: np.ndarray) -> list:
  """Token ids as labels: symbols from 0, "</s>" for EOS, nothing for padding."""
  from attention_jax.data import seq2seq  # pylint: disable=import-outside-toplevel
  labels = []
  for token in tokens:
    if token == seq2seq.PAD_ID:
      break
    labels.append("</s>" if token == seq2seq.EOS_ID else str(token - seq2seq.FIRST_SYMBOL))
  return labels


def heatmap(args: cli.Args) -> int:
  """Draws the heatmap; 0 on success, 2 when the run is not an attentive seq2seq one."""
  logging.set_verbosity(logging.WARNING)  # orbax logs every step of a restore
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from attention_jax.models import decoding  # pylint: disable=import-outside-toplevel
  from attention_jax.train.restore import restore_run  # pylint: disable=import-outside-toplevel
  from experiments.tables import report  # pylint: disable=import-outside-toplevel

  run = restore_run(args.workdir)
  if run.config.model.kind != "rnn_seq2seq" or not run.config.model.decoder_attention:
    print(f"error: {args.workdir} is not an rnn_seq2seq run with attention.", file=sys.stderr)
    return 2
  example = run.splits["test"].gather(np.array([args.example]))
  inputs, targets = jnp.asarray(example["inputs"]), jnp.asarray(example["targets"])
  tokens = decoding.decode(run.model, run.variables, inputs, max_length=targets.shape[1])
  teacher_forced = jax.jit(functools.partial(run.model.apply, mutable=["intermediates"]))
  _, state = teacher_forced(run.variables, inputs, tokens)
  (weights,) = state["intermediates"]["step"]["attention"]["attention_weights"]
  source, output = symbols(np.asarray(inputs[0])), symbols(np.asarray(tokens[0]))
  weights = np.asarray(weights)[0, :len(output), :, 0, :len(source)].mean(axis=1)  # over heads

  plt = report.pyplot()
  fig, ax = plt.subplots(figsize=(0.25 * len(source) + 2, 0.25 * len(output) + 1.5))
  image = ax.imshow(weights, cmap="viridis", aspect="auto")
  ax.set_xticks(range(len(source)), source, fontsize=7)
  ax.set_yticks(range(len(output)), output, fontsize=7)
  ax.set_xlabel("source")
  ax.set_ylabel("decoded output (greedy)")
  model = run.config.model
  right = output == symbols(np.asarray(targets[0]))
  ax.set_title(f"{model.attention} attention, {run.config.task} test example {args.example} "
               f"({'right' if right else 'wrong'})", fontsize=9)
  fig.colorbar(image, ax=ax, fraction=0.04)
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  report.save_figure(fig, out.parent, out.name)
  print(f"wrote {out} (step {run.step} of {args.workdir})")
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  """This script from Python: `argv` and errors as in `cli.parse`."""
  return heatmap(cli.parse(define_flags, argv, __name__))


if __name__ == "__main__":
  cli.run(define_flags, heatmap)
