r"""flex_attention against jax.nn and our plain blockwise kernel, on the same masks (#37).

The committed JSON is made on CPU, from a clean tree, in one run:

  python -m experiments.benchmark_flex --lengths=4096,8192,16384,32768 --heads=1 \
      --head_dim=64 --batch=1 --repeats=5 --out=benchmarks/flex_cpu.json

and on a GPU, with the Triton kernels on both sides, in bfloat16:

  python -m experiments.benchmark_flex --implementation=pallas_gpu --dtype=bfloat16 \
      --lengths=8192,32768 --heads=8 --head_dim=128 --repeats=10 --out=benchmarks/flex_gpu.json

For each case (`CASES`) at each sequence length T (self-attention, batch
`--batch`, `--heads` heads of `--head_dim`, `--dtype`), in both passes
(``fwd``: the output; ``fwd_bwd``: the gradients of sum(out^2) in q, k and v),
three forms of the same function are timed:

* ``flex``: `attention_jax.flex_attention(implementation=--implementation)`
  ("blockwise", the default, or "pallas_gpu"), with the case's mods from
  `attention_jax.mods` and a block mask from `create_block_mask` (made once,
  outside the timed call, and passed in);
* ``blockwise``: the plain kernel of the same family (recorded under this name
  whichever it is): `attention_jax.dot_product_attention(implementation=
  "blockwise")`, or with `--implementation=pallas_gpu` our Triton kernel
  (`flash_dot_product_attention`) in the flex kernel's blocks, with what it
  can express: `is_causal`, `local_window_size`,
  `segment_ids`; ALiBi and prefix-LM only through a materialised `[B|1, H|1, T, T]`
  bias or mask (marked "materialised", and skipped above `--max_dense_bytes`);
  "n/a" where it cannot (the soft cap);
* ``jax_nn``: `jax.nn.dot_product_attention(implementation="xla")` with the
  mask or bias materialised (its `is_causal` and `local_window_size` where they
  apply), skipped where the logits and their gradient would pass
  `--max_dense_bytes`; "n/a" for the soft cap, which jax.nn does not have.

Both kernels use the same blocks: the plain kernel's default forward blocks
for this implementation, head dim and dtype (`--block_size` overrides it for
both; flex takes one block size for both passes). Each form is compiled once (not
timed) and run once to warm up; then flex and the plain kernel are timed in
`--repeats` rounds after an untimed one, each round running both once (with
`jax.block_until_ready`), first one then the other, the order reversed every
other round, and each reports its median wall time: on a shared machine
whose speed drifts during a cell, both meet the same drift, so their ratio
holds where the times wander. jax.nn is timed apart, after them: run between
them, its gigabytes of logits slowed the kernel that followed. Every record carries the block
mask's density (the fraction of (query block, key block) tiles the flex kernel
visits), the ratio flex / blockwise, measured in this run, and each peer's
largest absolute difference from flex's output (fwd) or gradients (fwd_bwd),
which says that both sides computed the same function; nothing is asserted. The JSON carries the provenance the other benchmarks record (git
revision, with "+dirty" for an unclean tree, CPU model, JAX version).
"""

from __future__ import annotations

import datetime
import functools
import json
import pathlib
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments import benchmark_attention as common
from experiments import cli

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
CASES = ("causal", "sliding_window", "document", "alibi", "softcap", "prefix_lm")
PASSES = ("fwd", "fwd_bwd")
FORMS = ("flex", "blockwise", "jax_nn")
# The forms timed in rounds together (`time_in_rounds`): flex and its plain kernel.
PAIRED = ("flex", "blockwise")
SOFTCAP = 50.0  # Gemma 2's attention soft cap.
GIB = float(1 << 30)
# flex_attention's implementations timed here, each with its plain kernel.
PLAIN_KERNELS = {"blockwise": "blockwise", "pallas_gpu": "pallas"}


def define_flags(flag_values: flags.FlagValues, argv: Sequence[str]) -> None:
  """This script's flags (see `experiments.cli`)."""
  del argv
  positive = flags.IntegerParser(lower_bound=1)
  cli.DEFINE_list_of(positive, "lengths", [4096, 8192, 16384, 32768],
                     "sequence lengths T (queries and keys alike)", flag_values)
  flags.DEFINE_integer("heads", 2, "heads H", lower_bound=1, flag_values=flag_values)
  flags.DEFINE_integer("head_dim", 64, "head dim D", lower_bound=1, flag_values=flag_values)
  flags.DEFINE_integer("batch", 1, "batch B", lower_bound=1, flag_values=flag_values)
  flags.DEFINE_integer("repeats", 3, "timed runs per cell (the median is reported)",
                       lower_bound=1, flag_values=flag_values)
  flags.DEFINE_integer("window", 1024, "the sliding window: each query sees itself and the "
                       "window - 1 keys before it", lower_bound=1, flag_values=flag_values)
  flags.DEFINE_integer("block_size", None, "both kernels' query and key blocks (default: the "
                       "plain blockwise kernel's default)", lower_bound=8,
                       flag_values=flag_values)
  flags.DEFINE_float("max_dense_bytes", 4 * GIB,
                     "skip a materialised form (jax.nn's logits and their gradient, the plain "
                     "kernel's materialised bias or mask) that would need more bytes",
                     lower_bound=0, flag_values=flag_values)
  cli.DEFINE_list_of(flags.EnumParser(list(CASES)), "cases", None,
                     "only these cases (default: all)", flag_values)
  flags.DEFINE_enum("implementation", "blockwise", list(PLAIN_KERNELS),
                    "flex_attention's implementation; the plain kernel is its counterpart",
                    flag_values=flag_values)
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "q, k and v's dtype",
                    flag_values=flag_values)
  flags.DEFINE_string("out", None, "JSON output (default: benchmarks/flex_<backend>.json)",
                      flag_values=flag_values)
  flags.DEFINE_string("from_json", None, "print the tables of this saved run and stop (how "
                      "the README's tables are made)", flag_values=flag_values)


# ---------------------------------------------------------------------------
# The cases: one function, three forms.
# ---------------------------------------------------------------------------


class Case:
  """One mask/mod at one shape: the three forms as `fn(q, k, v, operands)`, with
  the operands each needs (arrays passed to the compiled call, never constants).

  A form is None with a reason in `unavailable[form]` when it cannot express
  the case; `materialised[form]` is the bytes of the `T x T` arrays it needs
  beside its logits (a materialised bias or mask), or 0.
  """

  def __init__(self, name: str, batch: int, heads: int, length: int, window: int,
               blocks: Tuple[int, int], explicit_blocks: bool,
               implementation: str = "blockwise"):
    # pylint: disable=import-outside-toplevel
    import attention_jax
    from attention_jax import mods, positional
    # pylint: enable=import-outside-toplevel
    self.name = name
    self.forms: Dict[str, Optional[Callable]] = {}
    self.operands: Dict[str, Any] = {}
    self.unavailable: Dict[str, str] = {}
    self.materialised: Dict[str, int] = {"flex": 0, "blockwise": 0, "jax_nn": 0}
    self.notes: Dict[str, str] = {}
    t = length
    # pylint: disable-next=import-outside-toplevel
    from attention_jax.kernels.flash_attention import blockwise as kernel, common as kc
    blockwise = functools.partial(attention_jax.dot_product_attention,
                                  implementation="blockwise")
    if implementation == "pallas_gpu":  # Triton on both sides, in flex's blocks
      blockwise = functools.partial(attention_jax.kernels.flash_dot_product_attention,
                                    block_sizes=kc.BlockSizes(*blocks))
    elif explicit_blocks:  # --block_size: the plain kernel in those blocks too
      blockwise = functools.partial(kernel.blockwise_dot_product_attention,
                                    block_sizes=kc.BlockSizes(*blocks))
    jax_nn = functools.partial(jax.nn.dot_product_attention, implementation="xla")
    positions = jnp.arange(t, dtype=jnp.int32)
    score_mod, softcap = None, None

    if name == "causal":
      mask_mod, mask_batch = mods.causal_mask, None
      self.forms["blockwise"] = lambda q, k, v, x: blockwise(q, k, v, is_causal=True)
      self.forms["jax_nn"] = lambda q, k, v, x: jax_nn(q, k, v, is_causal=True)
    elif name == "sliding_window":
      window = (window - 1, 0)
      mask_mod, mask_batch = mods.sliding_window(*window), None
      self.forms["blockwise"] = lambda q, k, v, x: blockwise(q, k, v, local_window_size=window)
      self.forms["jax_nn"] = lambda q, k, v, x: jax_nn(q, k, v, local_window_size=window)
      self.notes["window"] = f"query i sees keys i - {window[0]} .. i"
    elif name == "document":
      ids = jnp.asarray(document_ids(batch, t))
      mask_mod, mask_batch = mods.document_mask(ids), batch
      self.operands["blockwise"] = ids
      self.forms["blockwise"] = lambda q, k, v, x: blockwise(q, k, v, segment_ids=x)
      self.operands["jax_nn"] = ids
      self.forms["jax_nn"] = lambda q, k, v, x: jax_nn(
          q, k, v, mask=x[:, None, :, None] == x[:, None, None, :])
      self.materialised["jax_nn"] = batch * t * t  # bool
      self.notes["documents"] = (f"{int(ids[0].max()) + 1} documents per row, "
                                 "bidirectional inside each")
    elif name == "alibi":
      slopes = positional.alibi_slopes(heads)
      score_mod, mask_mod, mask_batch = mods.alibi(slopes), mods.causal_mask, None
      bias = lambda: (-slopes[:, None, None]
                      * jnp.abs(positions[:, None] - positions[None, :]).astype(jnp.float32))[None]
      self.operands["blockwise"] = self.operands["jax_nn"] = jax.ShapeDtypeStruct(
          (1, heads, t, t), jnp.float32)
      self.operands["_bias"] = bias
      self.forms["blockwise"] = lambda q, k, v, x: blockwise(q, k, v, x, is_causal=True)
      self.forms["jax_nn"] = lambda q, k, v, x: jax_nn(q, k, v, x, is_causal=True)
      self.materialised["blockwise"] = self.materialised["jax_nn"] = heads * t * t * 4
      self.notes["blockwise"] = "materialised [1, H, T, T] ALiBi bias, is_causal"
      self.notes["alibi"] = "causal, ALiBi with the paper's slopes"
    elif name == "softcap":
      softcap, mask_mod, mask_batch = SOFTCAP, mods.causal_mask, None
      self.unavailable["blockwise"] = "n/a: the plain kernel has no soft cap"
      self.unavailable["jax_nn"] = "n/a: jax.nn has no soft cap"
      self.notes["softcap"] = f"causal, logits soft-capped at {SOFTCAP:g}"
    elif name == "prefix_lm":
      prefix = jnp.full((batch,), t // 4, jnp.int32)
      mask_mod, mask_batch = mods.prefix_lm_mask(prefix), batch
      dense_mask = lambda: ((positions[None, :] < prefix[:, None, None])
                            | (positions[None, :] <= positions[:, None]))[:, None]
      self.operands["blockwise"] = self.operands["jax_nn"] = jax.ShapeDtypeStruct(
          (batch, 1, t, t), jnp.bool_)
      self.operands["_mask"] = dense_mask
      self.forms["blockwise"] = lambda q, k, v, x: blockwise(q, k, v, mask=x)
      self.forms["jax_nn"] = lambda q, k, v, x: jax_nn(q, k, v, mask=x)
      self.materialised["blockwise"] = self.materialised["jax_nn"] = batch * t * t
      self.notes["blockwise"] = "materialised [B, 1, T, T] prefix-LM mask"
      self.notes["prefix_lm"] = f"prefix of {t // 4} keys seen by every query, causal after"
    else:
      raise ValueError(f"unknown case {name!r}")

    self.block_mask = attention_jax.create_block_mask(mask_mod, mask_batch, None, t, t, blocks)
    self.operands["flex"] = self.block_mask
    self.forms["flex"] = lambda q, k, v, x: attention_jax.flex_attention(
        q, k, v, score_mod=score_mod, block_mask=x, softcap=softcap,
        implementation=implementation)
    for form in self.unavailable:
      self.forms[form] = None

  def density(self) -> float:
    return float(self.block_mask.density())

  def operand(self, form: str) -> Any:
    """The form's operands, materialising a `T x T` bias or mask only now."""
    x = self.operands.get(form)
    if isinstance(x, jax.ShapeDtypeStruct):
      return self.operands["_bias" if x.dtype == jnp.float32 else "_mask"]()
    return x


def document_ids(batch: int, length: int, seed: int = 0) -> np.ndarray:
  """`[B, T]` int32 document ids: max(2, T // 1024) documents per row, cut at
  random (seeded) positions, so the mean document is about 1024 tokens."""
  rng = np.random.default_rng(seed)
  count = max(2, length // 1024)
  rows = []
  for _ in range(batch):
    cuts = np.sort(rng.choice(np.arange(1, length), size=min(count, length) - 1, replace=False))
    ids = np.zeros(length, np.int32)
    ids[cuts] = 1
    rows.append(np.cumsum(ids, dtype=np.int32))
  return np.stack(rows)


def kernel_blocks(length: int, block_size: Optional[int], implementation: str = "blockwise",
                  head_dim: int = 64, dtype: str = "float32"):
  """The blocks both kernels use at this length: (block_q, block_k)."""
  # pylint: disable-next=import-outside-toplevel
  from attention_jax.kernels.flash_attention import blockwise, common as kernel_common, pallas_gpu
  if block_size is not None:
    blocks = kernel_common.BlockSizes(block_size, block_size)
  elif implementation == "pallas_gpu":
    blocks = pallas_gpu.default_block_sizes_gpu(head_dim, jnp.dtype(dtype))
  else:
    blocks = blockwise.default_block_sizes(length, length)
  blocks = blockwise.fitted_block_sizes(blocks, length, length)
  return blocks.block_q, blocks.block_k


def make_step(fn: Callable, mode: str) -> Callable:
  """The jitted forward, or the gradients of sum(out^2) in q, k and v."""
  if mode == "fwd":
    return jax.jit(fn)
  return jax.jit(jax.grad(lambda q, k, v, x: jnp.sum(fn(q, k, v, x) ** 2), argnums=(0, 1, 2)))


def dense_bytes(form: str, case: Case, mode: str, batch: int, heads: int, length: int) -> int:
  """What a form materialises: jax.nn's float32 logits (and their gradient in
  fwd_bwd) and any materialised bias or mask (and the plain kernel's gradient
  of its bias, which its backward pass makes whether or not it is asked for)."""
  per_pass = 1 if mode == "fwd" else 2
  logits = batch * heads * length * length * 4 if form == "jax_nn" else 0
  extra = case.materialised[form]
  bias_grad = extra if (mode == "fwd_bwd" and form == "blockwise" and case.name == "alibi") else 0
  return per_pass * logits + extra + bias_grad


def compile_and_warm(step: Callable, inputs: tuple) -> Dict[str, Any]:
  """Compile once (timed apart) and run once to warm up; its result is kept,
  for the comparison of the forms."""
  start = time.perf_counter()
  compiled = step.lower(*inputs).compile()
  compile_s = time.perf_counter() - start
  values = jax.block_until_ready(compiled(*inputs))
  return dict(run=functools.partial(compiled, *inputs), compile_s=compile_s, values=values)


def time_in_rounds(runs: Dict[str, Callable], repeats: int) -> Dict[str, List[float]]:
  """An untimed round, then `repeats` rounds, each running every form once, in
  turns whose order is reversed every other round, and each form's wall times
  (ms): a drift of the
  machine's speed during the cell (another process, frequency scaling) meets
  every form alike, and so does whatever one form leaves the next (freed
  buffers, cold caches), so the ratios of their medians hold where the times
  themselves wander."""
  times: Dict[str, List[float]] = {form: [] for form in runs}
  order = list(runs)
  # One untimed round first, in the order of the last timed round's turn: the
  # first call after another program's warm-up (jax.nn's gigabytes freed, say)
  # ran up to 30% slow, and with three rounds that one call moved a median.
  for form in order[::-1]:
    jax.block_until_ready(runs[form]())
  for round_index in range(repeats):
    for form in (order if round_index % 2 == 0 else order[::-1]):
      start = time.perf_counter()
      jax.block_until_ready(runs[form]())
      times[form].append((time.perf_counter() - start) * 1e3)
  return times


def max_abs_difference(a, b) -> float:
  """The largest |a - b| over every leaf (an output, or the gradients)."""
  return max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
             for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def run_case(name: str, length: int, args: cli.Args) -> List[Dict[str, Any]]:
  """The records of one case at one length: one per pass, each with every form."""
  block_q, block_k = kernel_blocks(length, args.block_size, args.implementation,
                                   args.head_dim, args.dtype)
  case = Case(name, args.batch, args.heads, length, args.window, (block_q, block_k),
              explicit_blocks=args.block_size is not None, implementation=args.implementation)
  shape = (args.batch, length, args.heads, args.head_dim)
  q, k, v = (jax.random.normal(key, shape, jnp.dtype(args.dtype))
             for key in jax.random.split(jax.random.key(length), 3))
  density = case.density()
  records = []
  flex_values = None
  for mode in PASSES:
    record: Dict[str, Any] = dict(case=name, length=length, mode=mode, batch=args.batch,
                                  heads=args.heads, head_dim=args.head_dim, dtype=args.dtype,
                                  implementation=args.implementation,
                                  plain_kernel=PLAIN_KERNELS[args.implementation],
                                  block_q=block_q, block_k=block_k, density=density,
                                  notes=dict(case.notes))
    prepared: Dict[str, Dict[str, Any]] = {}
    for form in FORMS:
      fn = case.forms[form]
      if fn is None:
        record[form] = dict(status=case.unavailable[form])
        continue
      need = dense_bytes(form, case, mode, args.batch, args.heads, length)
      if need > args.max_dense_bytes:
        record[form] = dict(status=f"skipped: would materialise {need / GIB:.1f} GiB",
                            materialised_bytes=need)
        continue
      try:
        prepared[form] = compile_and_warm(make_step(fn, mode), (q, k, v, case.operand(form)))
      except Exception as error:  # pylint: disable=broad-except
        # A form that does not compile or run here (a kernel's lowering
        # refusing a mod, say) is recorded, and the sweep goes on.
        record[form] = dict(status=f"failed: {type(error).__name__}: {str(error)[:500]}",
                            materialised_bytes=need)
        continue
      record[form] = dict(status="ok", materialised_bytes=need,
                          compile_s=prepared[form]["compile_s"])
    # flex and its plain kernel, the ratio of interest, in rounds together;
    # jax.nn apart: its materialised logits (gigabytes) slowed whichever kernel
    # ran after it (the sliding window at 16K, forward+backward, on this 2-core
    # CPU: flex at 1.59x the plain kernel's time with jax.nn in the rounds,
    # 0.99x with the two alone).
    paired = {form: p["run"] for form, p in prepared.items() if form in PAIRED}
    times = time_in_rounds(paired, args.repeats)
    for form, p in prepared.items():
      if form not in PAIRED:
        times.update(time_in_rounds({form: p["run"]}, args.repeats))
    flex_values = prepared["flex"]["values"] if "flex" in prepared else None
    for form, p in prepared.items():
      record[form].update(ms=statistics.median(times[form]), times_ms=times[form])
      if form != "flex" and flex_values is not None:
        # The same function: how far from flex's output (gradients).
        record[form]["max_abs_diff_from_flex"] = max_abs_difference(p["values"], flex_values)
    del prepared
    flex_values = None
    flex_ms = record["flex"].get("ms")
    blockwise_ms = record["blockwise"].get("ms")
    record["flex_over_blockwise"] = (flex_ms / blockwise_ms
                                     if flex_ms and blockwise_ms else None)
    records.append(record)
    print(f"  {name} T={length} {mode}: " + ", ".join(
        f"{form} {_cell(record[form])}" for form in FORMS), flush=True)
  return records


def _cell(result: Dict[str, Any]) -> str:
  if result.get("status") == "ok":
    return f"{result['ms']:.1f}"
  return result["status"].split(":")[0]


def format_tables(records: List[Dict[str, Any]]) -> str:
  """One table per pass: case, length, flex ms, the plain kernel's ms (the
  records' "blockwise" form), flex / plain, jax.nn ms, density. "*" marks a
  materialised bias or mask."""
  lines = []
  for mode in PASSES:
    title = "forward" if mode == "fwd" else "forward+backward (grads of sum(out^2) in q, k, v)"
    lines += ["", f"## {title}",
              f"{'case':<15} {'T':>6} {'flex ms':>10} {'plain ms':>13} "
              f"{'flex/plain':>15} {'jax.nn ms':>10} {'density':>8}"]
    for r in (r for r in records if r["mode"] == mode):
      star = "*" if r["blockwise"].get("status") == "ok" and r["blockwise"]["materialised_bytes"] else ""
      ratio = "-" if r["flex_over_blockwise"] is None else f"{r['flex_over_blockwise']:.2f}"
      lines.append(f"{r['case']:<15} {r['length']:>6} {_cell(r['flex']):>10} "
                   f"{_cell(r['blockwise']) + star:>13} {ratio:>15} "
                   f"{_cell(r['jax_nn']):>10} {r['density']:>8.3f}")
  lines.append("* the plain kernel with a materialised bias or mask")
  return "\n".join(lines)


def benchmark(args: cli.Args) -> Dict[str, Any]:
  """Times every case x length x pass x form, prints the tables, writes the JSON."""
  if args.from_json:
    payload = json.loads(pathlib.Path(args.from_json).read_text())
    environment = payload["environment"]
    print(f"{args.from_json}: {environment['device_kind']}, git {environment['git_revision']}")
    print(format_tables(payload["records"]))
    return payload
  environment = common.environment()
  if environment["git_revision"] and environment["git_revision"].endswith("+dirty"):
    print(f"warning: uncommitted changes ({environment['git_revision']}), recorded in the JSON",
          file=sys.stderr)
  cases = args.cases or list(CASES)
  print(f"B={args.batch} H={args.heads} D={args.head_dim} {args.dtype}, flex on "
        f"{args.implementation} against {PLAIN_KERNELS[args.implementation]}, "
        f"{environment['device_kind']} ({environment['cpu_model']}), repeats {args.repeats}",
        flush=True)
  start = time.perf_counter()
  out = pathlib.Path(args.out or REPO_ROOT / "benchmarks" / f"flex_{jax.default_backend()}.json")
  arguments = dict(vars(args), out=str(out), cases=cases)
  payload = dict(
      environment=environment,
      command=" ".join(["python -m experiments.benchmark_flex"]
                       + [f"--{k}={','.join(map(str, v)) if isinstance(v, list) else v}"
                          for k, v in sorted(arguments.items()) if v is not None]),
      arguments=arguments,
      softcap=SOFTCAP,
      records=[])
  for length in args.lengths:
    for name in cases:
      payload["records"] += run_case(name, length, args)
      # Written after every case: a run stopped early (a lent machine's time
      # running out) keeps what it measured; `complete` says whether it ended.
      payload.update(timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                     wall_time_s=time.perf_counter() - start, complete=False)
      common.write_json(out, payload)
  payload["complete"] = True
  common.write_json(out, payload)
  print(format_tables(payload["records"]))
  print(f"wrote {len(payload['records'])} records to {out} in {payload['wall_time_s']:.0f} s")
  return payload


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  """This script from Python: `argv` and errors as in `cli.parse`."""
  return benchmark(cli.parse(define_flags, argv, __name__))


if __name__ == "__main__":
  cli.run(define_flags, benchmark)
