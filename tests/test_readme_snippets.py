"""The README's code for users' own models runs as written."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _python_block_after(heading: str) -> str:
  text = README.read_text()
  section = text[text.index(heading):]
  return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_rnn_step_with_a_scoring_function_runs_and_ignores_padding():
  namespace = {}
  exec(_python_block_after("### Attention inside your own RNN"), namespace)  # pylint: disable=exec-used
  step = namespace["AttentiveGRUStep"]()
  state, x = jnp.zeros((2, 64)), jnp.ones((2, 16))
  encoder_states = jax.random.normal(jax.random.PRNGKey(0), (2, 10, 32))
  lengths = jnp.array([10, 6])
  params = step.init(jax.random.PRNGKey(1), state, x, encoder_states, lengths)
  new_state, out = step.apply(params, state, x, encoder_states, lengths)
  assert new_state.shape == (2, 64) and out.shape == (2, 64)
  # Row 1's states past its length are padding: changing them changes nothing.
  _, changed = step.apply(params, state, x, encoder_states.at[1, 6:].set(5.0), lengths)
  np.testing.assert_allclose(changed[1], out[1], rtol=1e-6, atol=1e-6)
  _, moved = step.apply(params, state, x, encoder_states.at[1, 2].set(5.0), lengths)
  assert not np.allclose(moved[1], out[1])


def test_the_generation_snippet_runs():
  namespace = {}
  exec(_python_block_after("### Generating from a language model"), namespace)  # pylint: disable=exec-used
  greedy, sampled = namespace["greedy"], namespace["sampled"]
  assert greedy.shape == sampled.shape == (2, 12)
  np.testing.assert_array_equal(greedy[:, :4], 1)
  np.testing.assert_array_equal(sampled[:, :4], 1)


def test_the_segment_recurrence_snippet_runs_and_fills_the_memory():
  namespace = {}
  exec(_python_block_after("### Segment recurrence (Transformer-XL)"), namespace)  # pylint: disable=exec-used
  assert namespace["logits"].shape == (2, 16, 64)
  filled = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(namespace["memory"])[0]
            if path[-1].key == "filled"]
  assert [int(f) for f in filled] == [16, 16]
