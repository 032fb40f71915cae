"""MixtureOfExperts against a token-by-token loop over the routing rules, its
load-balancing loss against the formula, and the layer sharded over 8
simulated devices against one device."""

import json
import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.layers import MixtureOfExperts
from attention_jax.models import build_model
from attention_jax.train.steps import sown_losses
from attention_testing import assert_close, jit_apply, jit_init, perturbed

B, T, E, F = 2, 10, 8, 12


def _inputs(seed=0):
  return jax.random.normal(jax.random.PRNGKey(seed), (B, T, E))


def _softmax(z):
  z = np.exp(z - z.max(-1, keepdims=True))
  return z / z.sum(-1, keepdims=True)


def _gelu(h):
  from scipy.special import erf  # pylint: disable=import-outside-toplevel
  return 0.5 * h * (1 + erf(h / np.sqrt(2)))


def _loop_reference(x, params, num_experts, top_k, capacity):
  """Token by token: every first choice in sequence order, then every second
  choice, ...; an expert with `capacity` tokens of this example takes no more."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  x = np.asarray(x, np.float64)
  probs = _softmax(x @ p["router"]["kernel"])
  out = np.zeros_like(x)
  for b in range(x.shape[0]):
    taken = np.zeros(num_experts, int)
    for choice in range(top_k):
      for t in range(x.shape[1]):
        chosen = np.argsort(-probs[b, t], kind="stable")[:top_k]
        expert = chosen[choice]
        gate = probs[b, t, expert] / (probs[b, t, chosen].sum() if top_k > 1 else 1.0)
        if taken[expert] < capacity:
          taken[expert] += 1
          hidden = _gelu(x[b, t] @ p["wi"][expert] + p["bi"][expert])
          out[b, t] += gate * (hidden @ p["wo"][expert] + p["bo"][expert])
  return out


def _module_and_params(**options):
  module = MixtureOfExperts(F, **options)
  params = perturbed(nn.meta.unbox(jit_init(module, jax.random.PRNGKey(1), _inputs()))["params"])
  return module, params


@pytest.mark.parametrize("num_experts,top_k,capacity_factor", [
    (4, 1, 4.0),   # Switch routing, room for every token
    (4, 2, 4.0),   # top-2, room for every choice
    (4, 2, 0.5),   # top-2 with tokens dropped: capacity 3 of an example's 20 choices
    (3, 3, 0.7),   # every expert chosen, few slots
])
def test_output_equals_the_token_by_token_routing_loop(num_experts, top_k, capacity_factor):
  module, params = _module_and_params(num_experts=num_experts, top_k=top_k,
                                      capacity_factor=capacity_factor)
  capacity = max(1, int(np.ceil(capacity_factor * top_k * T / num_experts)))
  x = _inputs()
  got = jax.jit(lambda p, x: module.apply({"params": p}, x))(params, x)
  assert_close(got, _loop_reference(x, params, num_experts, top_k, capacity), atol=1e-5)


def test_dropped_tokens_get_zero_and_the_router_is_trained():
  """With one slot per expert most tokens are dropped (their output is 0, the
  residual carries them); the kept ones' gates pass gradient to the router."""
  module, params = _module_and_params(num_experts=2, top_k=1, capacity_factor=0.1)
  x = _inputs()
  out = np.asarray(jit_apply(module, {"params": params}, x))
  kept = np.any(out != 0.0, axis=-1)
  assert set(kept.sum(axis=1).tolist()) <= {1, 2}  # one slot in each of 2 experts
  grad = jax.grad(lambda p: jnp.sum(jit_apply(module, {"params": p}, x) ** 2))(params)
  assert np.abs(grad["router"]["kernel"]).max() > 0


def test_load_balancing_loss_is_sown_and_equals_n_sum_f_times_p():
  module, params = _module_and_params(num_experts=4, top_k=2, load_balancing_weight=0.3)
  x = _inputs()
  _, sown = jit_apply(module, {"params": params}, x, mutable=["losses"])
  probs = _softmax(np.asarray(x, np.float64) @ np.asarray(params["router"]["kernel"], np.float64))
  fraction = np.bincount(probs.argmax(-1).ravel(), minlength=4) / (B * T)
  expected = 0.3 * 4 * np.sum(fraction * probs.mean(axis=(0, 1)))
  np.testing.assert_allclose(float(sown_losses(sown)), expected, rtol=1e-5)
  # Weight 0 sows nothing.
  quiet, params = _module_and_params(num_experts=4, load_balancing_weight=0.0)
  assert not jit_apply(quiet, {"params": params}, x, mutable=["losses"])[1]


def test_model_with_moe_feed_forward_sows_one_loss_per_layer_and_names_expert_axes():
  model = build_model(dict(vocab_size=16, num_classes=3, num_layers=2, embed_dim=E,
                           num_heads=2, mlp_dim=F, max_length=T, feed_forward="moe",
                           feed_forward_options=dict(num_experts=4)))
  batch = jnp.ones((B, T), jnp.int32)
  variables = jit_init(model, jax.random.PRNGKey(0), batch)
  wi = variables["params"]["encoder"]["block_0"]["mlp"]["wi"]
  assert wi.names == ("expert", None, "mlp") and wi.value.shape == (4, E, F)
  _, sown = jit_apply(model, {"params": nn.meta.unbox(variables["params"])}, batch,
                        mutable=["losses"])
  assert len(jax.tree.leaves(sown)) == 2 and float(sown_losses(sown)) > 0


@pytest.mark.parametrize("options,message", [
    (dict(num_experts=0), r"num_experts must be a positive integer, got 0"),
    (dict(num_experts=4, top_k=5), r"top_k must be an integer in \[1, num_experts=4\], got 5"),
    (dict(capacity_factor=0.0), r"capacity_factor must be positive, got 0.0"),
    (dict(load_balancing_weight=-1.0), r"load_balancing_weight must be >= 0, got -1.0"),
])
def test_bad_options_raise_naming_the_option(options, message):
  with pytest.raises(ValueError, match=message):
    MixtureOfExperts(F, **options).init(jax.random.PRNGKey(0), _inputs())


def test_sharded_over_eight_devices_trains_as_one_device():
  """Expert weights split over "fsdp" (8 experts on a 1x8x1 mesh: one per
  device; 2x2x2: 4 per device, hidden units over "tensor") train step for step
  as on one device."""
  script = pathlib.Path(__file__).with_name("moe_sharded_run.py")
  result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=600, check=True)
  out = json.loads(result.stdout.strip().splitlines()[-1])
  assert out["device_count"] == 8
  reference = out["losses"]["one device"]
  for mesh in ("1,8,1", "2,2,2"):
    np.testing.assert_allclose(out["losses"][mesh], reference, rtol=1e-5)
    assert out["params"][mesh] < 1e-5
    assert out["specs"][mesh][0] == "fsdp"
  # [experts, embed, mlp] = [8, 16, 32] in the script's model.
  assert out["shard_shapes"]["1,8,1"] == [[1, 16, 32]]
  assert out["shard_shapes"]["2,2,2"] == [[4, 16, 16]]


def test_causal_routing_is_each_token_to_all_its_top_k_experts():
  """`is_causal=True`: no capacity, so no token competes with another for a
  slot (a later token's first choice would otherwise take the slot an earlier
  token's second choice needed). Reference: the loop with room for every choice."""
  module, params = _module_and_params(num_experts=4, top_k=2, capacity_factor=0.5)
  x = _inputs()
  got = jax.jit(lambda p, x: module.apply({"params": p}, x, is_causal=True))(params, x)
  assert_close(got, _loop_reference(x, params, 4, 2, capacity=2 * T), atol=1e-5)


def test_causal_language_model_with_moe_does_not_see_the_future():
  """With capacity-limited routing, changing tokens 8.. moved the logits at
  positions 0..7 of a causal language model by ~0.5; they must not move."""
  model = build_model(dict(kind="language_model", vocab_size=50, embed_dim=16, num_heads=2,
                           mlp_dim=32, num_layers=2, max_length=16, feed_forward="moe",
                           feed_forward_options=dict(num_experts=4, top_k=2,
                                                     capacity_factor=0.5)))
  tokens = jax.random.randint(jax.random.PRNGKey(0), (4, 16), 1, 50)
  changed = tokens.at[:, 8:].set(tokens[:, 8:] * 7 % 49 + 1)
  variables = jit_init(model, jax.random.PRNGKey(1), tokens)
  before, after = (jit_apply(model, variables, t) for t in (tokens, changed))
  np.testing.assert_array_equal(np.asarray(before[:, :8]), np.asarray(after[:, :8]))
  assert np.abs(np.asarray(before[:, 8:] - after[:, 8:])).max() > 0
