r"""Nadaraya-Watson kernel regression as attention pooling (the D2L chapter's
experiment), with `attention_jax.variants.scoring.nadaraya_watson_attention`.

  python -m experiments.nadaraya_watson --out=results/nadaraya_watson/

50 training points x_i ~ U(0, 5), sorted, y_i = 2 sin(x_i) + x_i^0.8 + N(0, 0.5^2);
queries on a grid of [0, 5). Three estimators, each the attention of the
queries (x) over the training keys (x_i) and values (y_i):

* average pooling (every key alike): the mean of y, a flat line;
* the Gaussian kernel with width 1 (non-parametric);
* the Gaussian kernel with a learned width, trained by Adam on the
  leave-one-out squared error of the training points (each point predicted
  from the others, so the width cannot shrink to interpolation).

Writes `nadaraya_watson.png` (the predictions, and the learned kernel's
attention weights as a heatmap) and `table.md` (mean squared error against
the noiseless function on the grid, and the learned width).
"""

from __future__ import annotations

import json
import pathlib
from typing import Dict, Sequence

import numpy as np
from absl import flags

from experiments import cli


def define_flags(flag_values: flags.FlagValues, argv: Sequence[str]) -> None:
  """This script's flags (see `experiments.cli`)."""
  del argv
  flags.DEFINE_string("out", None, "the folder of nadaraya_watson.png and table.md",
                      flag_values=flag_values)
  flags.DEFINE_integer("seed", 0, "the data's seed", flag_values=flag_values)
  flags.DEFINE_integer("steps", 200, "Adam steps on the learned width", lower_bound=1,
                       flag_values=flag_values)
  flags.mark_flags_as_required(["out"], flag_values=flag_values)

NUM_TRAIN = 50


def true_function(x: np.ndarray) -> np.ndarray:
  return 2 * np.sin(x) + x ** 0.8


def make_data(seed: int):
  """(x_train, y_train, x_grid), float32."""
  rng = np.random.default_rng(seed)
  x_train = np.sort(rng.uniform(0, 5, NUM_TRAIN)).astype(np.float32)
  y_train = (true_function(x_train) + rng.normal(0.0, 0.5, NUM_TRAIN)).astype(np.float32)
  return x_train, y_train, np.arange(0, 5, 0.1, dtype=np.float32)


def regress(queries, keys, values, *, kernel: str, width: float = 1.0, log_width=None,
            key_mask=None):
  """Nadaraya-Watson estimates at `queries` `[Tq]` from `keys`, `values` `[Tk]`;
  `key_mask` `[Tq, Tk]` (True: key used). Returns `[Tq]`."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from attention_jax.variants import scoring  # pylint: disable=import-outside-toplevel
  as_qkv = lambda a: jnp.asarray(a, jnp.float32)[None, :, None, None]  # [1, T, 1, 1]
  mask = None if key_mask is None else jnp.asarray(key_mask)[None, None]
  out = scoring.nadaraya_watson_attention(as_qkv(queries), as_qkv(keys), as_qkv(values),
                                          mask=mask, kernel=kernel, width=width,
                                          log_width=log_width)
  return out[0, :, 0, 0]


def learn_log_width(x_train, y_train, steps: int) -> float:
  """The log-width (on top of width 1) minimising the leave-one-out error."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  others = ~np.eye(NUM_TRAIN, dtype=bool)

  def loss(log_width):
    predicted = regress(x_train, x_train, y_train, kernel="gaussian", log_width=log_width,
                        key_mask=others)
    return jnp.mean(jnp.square(predicted - y_train))

  optimizer = optax.adam(0.05)
  log_width = jnp.zeros((1,), jnp.float32)
  state = optimizer.init(log_width)
  grad = jax.jit(jax.value_and_grad(loss))
  for _ in range(steps):
    _, gradient = grad(log_width)
    updates, state = optimizer.update(gradient, state)
    log_width = optax.apply_updates(log_width, updates)
  return float(log_width[0])


def experiment(args: cli.Args) -> int:
  """Fits the three estimators and writes the figure and the tables."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from attention_jax.variants import scoring  # pylint: disable=import-outside-toplevel
  from experiments.tables import report  # pylint: disable=import-outside-toplevel
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  x_train, y_train, x_grid = make_data(args.seed)
  log_width = learn_log_width(x_train, y_train, args.steps)
  estimates: Dict[str, np.ndarray] = {
      "average pooling": regress(x_grid, x_train, y_train, kernel="average"),
      "Gaussian, width 1": regress(x_grid, x_train, y_train, kernel="gaussian"),
      f"Gaussian, learned width {np.exp(log_width):.3f}": regress(
          x_grid, x_train, y_train, kernel="gaussian", log_width=jnp.array([log_width])),
  }
  truth = true_function(x_grid)
  errors = {name: float(np.mean((np.asarray(e) - truth) ** 2)) for name, e in estimates.items()}

  # The learned kernel's weights: attention of each grid query over the
  # training keys (one-hot values give the weights, as for any variant).
  as_qkv = lambda a: jnp.asarray(a, jnp.float32)[None, :, None, None]
  weights = scoring.nadaraya_watson_attention(
      as_qkv(x_grid), as_qkv(x_train), jnp.eye(NUM_TRAIN)[None, :, None, :],
      log_width=jnp.array([log_width]))[0, :, 0, :]

  plt = report.pyplot()
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  left.plot(x_grid, truth, "k--", label="truth 2 sin(x) + x^0.8")
  left.plot(x_train, y_train, "o", color="gray", alpha=0.5, markersize=3, label="training data")
  for name, estimate in estimates.items():
    left.plot(x_grid, np.asarray(estimate), label=f"{name} (MSE {errors[name]:.3f})")
  left.set_xlabel("x")
  left.set_ylabel("y")
  left.legend(fontsize=7)
  left.set_title("Nadaraya-Watson regression as attention pooling", fontsize=9)
  image = right.imshow(np.asarray(weights), aspect="auto", cmap="Reds",
                       extent=(0, NUM_TRAIN, x_grid[-1], x_grid[0]))
  right.set_xlabel("training key (sorted by x)")
  right.set_ylabel("query x")
  right.set_title("attention weights, learned width", fontsize=9)
  fig.colorbar(image, ax=right, fraction=0.04)
  report.save_figure(fig, out, "nadaraya_watson.png")

  command = "python -m experiments.nadaraya_watson " + " ".join(args.argv[1:])
  lines = ["# Nadaraya-Watson kernel regression as attention pooling", "",
           f"- command: `{command}`", f"- git revision: {_revision()}",
           f"- data: {NUM_TRAIN} noisy training points (seed {args.seed}), queries on "
           f"a 0.1 grid of [0, 5); the learned width by {args.steps} Adam steps on the "
           f"leave-one-out error", "",
           *report.markdown_head(["estimator", "MSE against the noiseless function"]),
           *[report.markdown_row([name, f"{error:.4f}"]) for name, error in errors.items()], ""]
  (out / "table.md").write_text("\n".join(lines))
  (out / "results.json").write_text(json.dumps(
      dict(errors=errors, learned_width=float(np.exp(log_width)), seed=args.seed,
           git_revision=_revision()), indent=1) + "\n")
  print("\n".join(lines))
  return 0


def _revision() -> str:
  from attention_jax.train.provenance import git_revision  # pylint: disable=import-outside-toplevel
  return git_revision() or "unknown"


def main(argv: Sequence[str] | None = None) -> int:
  """This script from Python: `argv` and errors as in `cli.parse`."""
  return experiment(cli.parse(define_flags, argv, __name__))


if __name__ == "__main__":
  cli.run(define_flags, experiment)
