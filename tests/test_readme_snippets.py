"""Every Python block of the README runs: the three below with checks of what they
promise, the rest in order, in one namespace, by `test_the_other_readme_blocks_run`."""

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"

# The sections whose block a test of its own runs and checks.
CHECKED_SECTIONS = ("### Attention inside your own RNN", "### Generating from a language model",
                    "### Segment recurrence (Transformer-XL)")
# Where the README shows a size only an accelerator needs, the test runs a smaller one:
# (the text as written, the text run). Each must occur, so a README edit cannot make
# the substitution silently stop applying.
SMALLER_SIZES = (("max_length=4096", "max_length=256"),
                 ("tokens = jnp.ones((2, 4096), jnp.int32)", "tokens = jnp.ones((2, 256), jnp.int32)"))


def _python_blocks():
  """Every ```python block of the README: (the heading above it, its code), in order."""
  text = README.read_text()
  blocks = []
  for match in re.finditer(r"```python\n(.*?)```", text, re.S):
    headings = re.findall(r"^#+ .*$", text[:match.start()], re.M)
    blocks.append((headings[-1], match.group(1)))
  return blocks


def _python_block_after(heading: str) -> str:
  matching = [code for section, code in _python_blocks() if section == heading]
  assert len(matching) == 1, f"expected one Python block under {heading!r}, found {len(matching)}"
  return matching[0]


def test_the_other_readme_blocks_run():
  """The blocks no test below checks run in the README's order in one namespace (later
  blocks use the arrays of "Using it"), in a process with 8 CPU devices for the ring's
  mesh."""
  blocks = [code for section, code in _python_blocks() if section not in CHECKED_SECTIONS]
  assert len(blocks) >= 5, "the README's blocks were not found"
  program = "\n".join(blocks)
  for written, run in SMALLER_SIZES:
    assert written in program, f"README no longer contains {written!r}: update SMALLER_SIZES"
    program = program.replace(written, run)
  program += textwrap.dedent("""
      assert out.shape == q.shape and y.shape == (2, 128, 512) and logits.shape == (2, 2)
      print("README blocks ran")
      """)
  env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") +
             " --xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          env=env, timeout=600, check=False)
  assert result.returncode == 0 and "README blocks ran" in result.stdout, (
      result.stdout[-3000:] + result.stderr[-3000:])
  # A `print(...)` followed by a `# ...` line shows its output: it must be what printed.
  shown = re.findall(r"^print\(.*\)\n# (.*)$", program, re.M)
  assert shown, "the README's shown outputs were not found"
  printed = result.stdout.splitlines()
  for output in shown:
    assert output in printed, f"README shows {output!r}; the block printed {printed}"


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
