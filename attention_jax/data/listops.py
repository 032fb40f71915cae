"""ListOps (Nangia & Bowman 2018) at the Long-Range-Arena settings (Tay et al. 2021).

An example is a nested expression over the digits 0-9 and four operators, and its
label is the expression's value (10 classes):

  [MAX 2 9 [MIN 4 7 ] 0 ]   ->  9

  MAX, MIN  the largest / smallest argument;
  MED       int(numpy.median(args)): an even count averages the two middle
            values and truncates, so [MED 2 9 ] is 5 and [MED 1 2 ] is 1;
  SM        the sum of the arguments modulo 10.

The generator follows the LRA release's generator (lra_benchmarks/data/listops.py,
flags at their defaults):
  * a node at depth d < max_depth=10 (the root has depth 1) is an operator with
    probability 0.25, else a digit; nodes at depth 10 are digits. So at most 9
    operators are nested and trees have at most 10 levels. The root is always an
    operator here: the LRA generator draws a digit root 3 times in 4 and then
    rejects it (length 1), so conditioning on an operator root gives the same
    distribution of accepted trees.
  * an operator has 2..max_args=10 arguments (uniform), and is one of MIN, MAX,
    MED, SM (uniform); digits are uniform.
  * the length is the number of tokens without parentheses (digits, operators
    and closing brackets); a tree is kept when min_length < length < max_length,
    500 < length < 2000 at the release's settings, so 501..1999 tokens.
  * 96,000 / 2,000 / 2,000 examples for train / validation / test.
The release drew one deduplicated pool for all splits; here each split has its
own random stream (numpy, seeded by (seed, split)), so a split can be regenerated
alone. Duplicates are not removed: two trees of 500+ tokens carry 250+ uniform
digits each, so a repeat has probability below 1e-200.

The release's TSV files (`basic_{train,val,test}.tsv`, a header `Source\tTarget`)
write each tree with a pair of parentheses per curried application, e.g.
`[MAX 2 9 ]` is `( ( ( [MAX 2 ) 9 ) ] )` (an operator with n arguments gets n + 1
pairs, so a tree of length L has 3 L - 2 tokens with them). `to_release_source`
writes that form; the loader reads it with or without the parentheses.

Token formats (`token_format`), all over one fixed vocabulary:
  "brackets" (default): operators and closing brackets, no parentheses, e.g.
      `[MAX 2 9 ]`; unambiguous, and at most max_length - 1 tokens, so seq_len is
      max_length = 2000. This is the form most later LRA work trains on (e.g. S4's
      loader drops the parentheses and keeps `]`).
  "parens": the release's Source tokens as they are (seq_len 3 max_length - 5).
  "alphanumeric": what the original LRA input pipeline feeds the model: its
      `tfds.deprecated.text.Tokenizer()` keeps only alphanumeric runs, so `]` and
      the parentheses vanish (and `[MAX` becomes `MAX`). Closing brackets are then
      lost, which makes some expressions ambiguous; offered to reproduce LRA.

Vocabulary (`VOCAB`, id 0 is padding, real tokens are never 0):
  0 <pad>, 1..10 the digits 0..9 (id = digit + 1), 11 [MIN, 12 [MAX, 13 [MED, 14 [SM,
  15 ], 16 (, 17 ).   vocab_size = 18.
"""

from __future__ import annotations

import csv
import dataclasses
import pathlib
import time
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from attention_jax.data.base import (SPLITS, ArraySource, ExampleSource, Task, TaskInfo,
                                     load_splits)

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")  # The LRA generator's order.
CLOSE, OPEN_PAREN, CLOSE_PAREN = "]", "(", ")"
VOCAB: Tuple[str, ...] = (("<pad>",) + tuple(str(d) for d in range(10)) + OPERATORS
                          + (CLOSE, OPEN_PAREN, CLOSE_PAREN))
TOKEN_IDS: Dict[str, int] = {token: i for i, token in enumerate(VOCAB)}
TOKEN_IDS.update({op[1:]: TOKEN_IDS[op] for op in OPERATORS})  # "MAX" as LRA's tokenizer writes it
_ENCODE_IDS = {token: i for token, i in TOKEN_IDS.items() if i != 0}  # "<pad>" is no input
PAD_ID = 0
DIGIT_ID0 = TOKEN_IDS["0"]  # digit d has id d + 1
OP_ID0 = TOKEN_IDS[OPERATORS[0]]  # operator k (index in OPERATORS) has id OP_ID0 + k
CLOSE_ID, OPEN_PAREN_ID, CLOSE_PAREN_ID = (TOKEN_IDS[t] for t in (CLOSE, OPEN_PAREN, CLOSE_PAREN))
VOCAB_SIZE = len(VOCAB)
TOKEN_FORMATS = ("brackets", "parens", "alphanumeric")

OPERATOR_PROBABILITY = 0.25  # LRA's VALUE_P: a node below max_depth is a digit when r > 0.25.
RELEASE_FILES = {"train": "basic_train.tsv", "validation": "basic_val.tsv",
                 "test": "basic_test.tsv"}
RELEASE_SIZES = {"train": 96_000, "validation": 2_000, "test": 2_000}

Tokens = Sequence[Union[str, int]]


# ----------------------------------------------------------------------------------------
# Evaluation: a stack machine over tokens.

def apply_operator(op: str, args: Sequence[int]) -> int:
  """The value of operator `op` (e.g. "[MED") on the digits `args`, as LRA defines it."""
  if not args:
    raise ValueError(f"operator {op} has no arguments.")
  if op == "[MIN":
    return min(args)
  if op == "[MAX":
    return max(args)
  if op == "[SM":
    return sum(args) % 10
  if op == "[MED":
    # int(np.median(args)): the mean of the two middle values for an even count,
    # truncated (values are non-negative, so floor division is the same).
    ordered = sorted(args)
    return (ordered[(len(ordered) - 1) // 2] + ordered[len(ordered) // 2]) // 2
  raise ValueError(f"unknown operator {op!r}; expected one of {OPERATORS}.")


def _as_strings(tokens: Union[str, Tokens, np.ndarray]) -> List[str]:
  """Token strings from a source string, a list of strings, or token ids (pads dropped)."""
  if isinstance(tokens, str):
    return tokens.split()
  if isinstance(tokens, np.ndarray) or (len(tokens) and not isinstance(tokens[0], str)):
    return decode(np.asarray(tokens))
  return list(tokens)


def evaluate(tokens: Union[str, Tokens, np.ndarray]) -> int:
  """The value of one expression.

  Args:
    tokens: a source string (`"[MAX 2 9 ]"`, parentheses allowed and checked for
      balance), its token strings, or its token ids `[T]` (padding ignored).

  Returns:
    The value, 0..9.

  Raises:
    ValueError: an unknown token, an unbalanced bracket or parenthesis, an operator
      without arguments, or anything left after the expression.
  """
  frames: List[Tuple[str, List[int]]] = []  # the open operators and their arguments so far
  result: Optional[int] = None
  parens = 0
  for position, token in enumerate(_as_strings(tokens)):
    if token == OPEN_PAREN:
      parens += 1
      continue
    if token == CLOSE_PAREN:
      parens -= 1
      if parens < 0:
        raise ValueError(f"unmatched ')' at token {position}.")
      continue
    if result is not None:
      raise ValueError(f"token {token!r} at {position} follows a complete expression.")
    if token in OPERATORS:
      frames.append((token, []))
      continue
    if token == CLOSE:
      if not frames:
        raise ValueError(f"unmatched ']' at token {position}.")
      op, args = frames.pop()
      value = apply_operator(op, args)
    elif len(token) == 1 and token.isdigit():
      value = int(token)
    else:
      raise ValueError(f"unknown token {token!r} at {position}; expected a digit, one of "
                       f"{OPERATORS}, ']', '(' or ')'.")
    if frames:
      frames[-1][1].append(value)
    else:
      result = value
  if frames:
    raise ValueError(f"{len(frames)} operator(s) not closed by ']'.")
  if parens:
    raise ValueError(f"{parens} '(' not closed.")
  if result is None:
    raise ValueError("empty expression.")
  return result


# ----------------------------------------------------------------------------------------
# Tokenizer.

def encode(tokens: Union[str, Tokens], seq_len: Optional[int] = None,
           token_format: str = "brackets") -> np.ndarray:
  """Token ids of an expression in `token_format`, padded with 0 to `seq_len`.

  Args:
    tokens: a source string (with or without parentheses) or its token strings.
    seq_len: pad to this length; None for no padding. A longer expression is an
      error (LRA truncated silently, which changes the value of the expression).
    token_format: "brackets", "parens" or "alphanumeric" (see the module docstring).

  Returns:
    `[seq_len]` (or `[T]`) uint8 ids.
  """
  if token_format not in TOKEN_FORMATS:
    raise ValueError(f"token_format={token_format!r}; expected one of {TOKEN_FORMATS}.")
  dropped = {"brackets": (OPEN_PAREN, CLOSE_PAREN), "parens": (),
             "alphanumeric": (OPEN_PAREN, CLOSE_PAREN, CLOSE)}[token_format]
  try:
    ids = [_ENCODE_IDS[token] for token in _as_strings(tokens) if token not in dropped]
  except KeyError as error:
    raise ValueError(f"unknown token {error.args[0]!r}; the ListOps vocabulary is "
                     f"{VOCAB[1:]}.") from None
  if seq_len is None:
    return np.asarray(ids, np.uint8)
  if len(ids) > seq_len:
    raise ValueError(f"the expression has {len(ids)} tokens in the {token_format!r} format, "
                     f"more than seq_len={seq_len}.")
  out = np.zeros(seq_len, np.uint8)
  out[:len(ids)] = ids
  return out


def decode(ids: np.ndarray) -> List[str]:
  """Token strings of ids `[T]`, padding dropped."""
  ids = np.asarray(ids)
  if ids.size and (ids.min() < 0 or ids.max() >= VOCAB_SIZE):
    raise ValueError(f"token ids must be in [0, {VOCAB_SIZE}), got {ids.min()}..{ids.max()}.")
  return [VOCAB[i] for i in ids.tolist() if i != PAD_ID]


def _parse(tokens: List[str], position: int = 0):
  """(tree, next position) for the expression at `position` of bracket-format tokens;
  a tree is a digit or (operator, [subtrees])."""
  token = tokens[position]
  if token not in OPERATORS:
    return int(token), position + 1
  children, position = [], position + 1
  while tokens[position] != CLOSE:
    child, position = _parse(tokens, position)
    children.append(child)
  return (token, children), position + 1


def _render_release(tree) -> str:
  if isinstance(tree, int):
    return str(tree)
  op, children = tree
  # LRA curries: ((op a1) a2) ... an) ]) -- n + 1 parenthesised applications.
  text = "( " * len(children) + op
  for child in children:
    text += " " + _render_release(child) + " )"
  return "( " + text + " ] )"


def to_release_source(tokens: Union[str, Tokens, np.ndarray]) -> str:
  """The Source column of the LRA release for an expression, e.g. "[MAX 2 9 ]" ->
  "( ( ( [MAX 2 ) 9 ) ] )"."""
  strings = [t for t in _as_strings(tokens) if t not in (OPEN_PAREN, CLOSE_PAREN)]
  evaluate(strings)  # validates the structure
  return _render_release(_parse(strings)[0])


# ----------------------------------------------------------------------------------------
# Generator: trees grown a level at a time for a batch of candidates at once.

@dataclasses.dataclass
class _Level:
  """The nodes at one depth of a batch of trees, children grouped by parent in order.

  Attributes: all `[n]` int arrays.
    tree: which candidate tree.
    parent: index of the parent in the previous level (-1 at the roots).
    op: operator index into OPERATORS, or -1 for a digit.
    digit: the digit (meaningful where op == -1).
    nargs: number of children (0 for digits).
  """
  tree: np.ndarray
  parent: np.ndarray
  op: np.ndarray
  digit: np.ndarray
  nargs: np.ndarray

  def select(self, keep: np.ndarray, parent_map: Optional[np.ndarray]) -> "_Level":
    parent = self.parent[keep] if parent_map is None else parent_map[self.parent[keep]]
    return _Level(self.tree[keep], parent, self.op[keep], self.digit[keep], self.nargs[keep])


def _grow(rng: np.random.Generator, count: int, max_depth: int, max_args: int,
          max_length: int) -> Tuple[List[_Level], np.ndarray]:
  """Grows `count` candidate trees (roots are operators).

  Returns:
    The levels, and each tree's length `[count]` (tokens without parentheses);
    a tree whose length reached max_length stops growing (it will be rejected, and
    its length is then only a lower bound).
  """
  levels: List[_Level] = []
  length = np.zeros(count, np.int64)
  tree, parent = np.arange(count), np.full(count, -1)
  for depth in range(1, max_depth + 1):
    n = len(tree)
    if depth == 1:
      is_op = np.ones(n, bool)
    elif depth < max_depth:
      is_op = rng.random(n) <= OPERATOR_PROBABILITY
    else:
      is_op = np.zeros(n, bool)
    op = np.where(is_op, rng.integers(0, len(OPERATORS), n), -1)
    digit = rng.integers(0, 10, n)
    nargs = np.where(is_op, rng.integers(2, max_args + 1, n), 0)
    levels.append(_Level(tree, parent, op, digit, nargs))
    length += np.bincount(tree, weights=np.where(is_op, 2, 1), minlength=count).astype(np.int64)
    # Only trees still shorter than max_length are worth growing further.
    expand = np.flatnonzero(is_op & (length[tree] < max_length))
    if not len(expand):
      break
    parent = np.repeat(expand, nargs[expand])
    tree = tree[parent]
  return levels, length


def _keep_trees(levels: List[_Level], accepted: np.ndarray) -> List[_Level]:
  """The levels restricted to the accepted trees, tree ids renumbered 0..K-1."""
  row = np.cumsum(accepted) - 1
  kept, parent_map = [], None
  for level in levels:
    keep = accepted[level.tree]
    if not keep.any():
      break
    new = level.select(keep, parent_map)
    new.tree = row[new.tree]
    parent_map = np.cumsum(keep) - 1
    kept.append(new)
  return kept


def _segment_starts(nargs: np.ndarray) -> np.ndarray:
  """Start of each operator's children in the next level (operators in order)."""
  counts = nargs[nargs > 0]
  return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


def _operator_values(op: np.ndarray, values: np.ndarray, starts: np.ndarray,
                     counts: np.ndarray) -> np.ndarray:
  """The value of each operator `[m]` from its children's values (contiguous segments)."""
  segment = np.repeat(np.arange(len(starts)), counts)
  ordered = values[np.lexsort((values, segment))]  # sorted within each segment
  median = (ordered[starts + (counts - 1) // 2] + ordered[starts + counts // 2]) // 2
  candidates = np.stack([np.minimum.reduceat(values, starts), np.maximum.reduceat(values, starts),
                         median, np.add.reduceat(values, starts) % 10])
  return candidates[op, np.arange(len(op))]


def _render(levels: List[_Level], num_trees: int, seq_len: int) -> Tuple[np.ndarray, np.ndarray]:
  """Bracket-format token ids `[num_trees, seq_len]` uint8 and values `[num_trees]` uint8."""
  # Bottom-up: subtree sizes (tokens) and values.
  sizes, values = [None] * len(levels), [None] * len(levels)
  for depth in reversed(range(len(levels))):
    level = levels[depth]
    size = np.where(level.op >= 0, 2, 1).astype(np.int64)
    value = level.digit.astype(np.int64)
    is_op = level.op >= 0
    if is_op.any():
      starts, counts = _segment_starts(level.nargs), level.nargs[is_op]
      size[is_op] += np.add.reduceat(sizes[depth + 1], starts)
      value[is_op] = _operator_values(level.op[is_op], values[depth + 1], starts, counts)
    sizes[depth], values[depth] = size, value
  # Top-down: the position of each node's first token. A child starts after its
  # parent's operator token and its elder siblings.
  tokens = np.zeros((num_trees, seq_len), np.uint8)
  start = np.zeros(len(levels[0].tree), np.int64)
  for depth, level in enumerate(levels):
    if depth:
      size = sizes[depth]
      before = np.cumsum(size) - size  # sizes of all earlier nodes of the level
      first_child = np.searchsorted(level.parent, level.parent)  # start of each node's group
      start = start_prev[level.parent] + 1 + before - before[first_child]
    is_op = level.op >= 0
    tokens[level.tree, start] = np.where(is_op, OP_ID0 + level.op, DIGIT_ID0 + level.digit)
    tokens[level.tree[is_op], (start + sizes[depth] - 1)[is_op]] = CLOSE_ID
    start_prev = start
  return tokens, values[0].astype(np.uint8)


def generate_chunk(seed: Sequence[int], candidates: int, *, max_depth: int = 10,
                   max_args: int = 10, min_length: int = 500, max_length: int = 2000
                   ) -> Tuple[np.ndarray, np.ndarray]:
  """The accepted trees among `candidates` grown from `numpy.random.default_rng(seed)`.

  Returns:
    `inputs [K, max_length]` uint8 bracket-format ids (padded with 0) and
    `label [K]` uint8, K <= candidates; deterministic in `seed`.
  """
  rng = np.random.default_rng(seed)
  levels, length = _grow(rng, candidates, max_depth, max_args, max_length)
  accepted = (length > min_length) & (length < max_length)
  if not accepted.any():
    return np.zeros((0, max_length), np.uint8), np.zeros(0, np.uint8)
  return _render(_keep_trees(levels, accepted), int(accepted.sum()), max_length)


_CANDIDATES_PER_CHUNK = 256


def generate(count: int, seed: Sequence[int], *, max_depth: int = 10, max_args: int = 10,
             min_length: int = 500, max_length: int = 2000, progress: bool = False,
             description: str = "listops") -> Tuple[np.ndarray, np.ndarray]:
  """`count` examples: `inputs [count, max_length]` uint8 (bracket format), `label [count]`.

  Chunk i of candidates is grown from `default_rng([*seed, i])`, so the result is a
  pure function of the arguments.
  """
  if not 0 <= min_length < max_length:
    raise ValueError(f"need 0 <= min_length < max_length, got {min_length}, {max_length}.")
  if max_depth < 2 or max_args < 2:
    raise ValueError(f"need max_depth >= 2 and max_args >= 2, got {max_depth}, {max_args}.")
  inputs = [np.zeros((0, max_length), np.uint8)]
  labels, have, chunk = [np.zeros(0, np.uint8)], 0, 0
  bar = _progress_bar(count, description) if progress else None
  while have < count:
    x, y = generate_chunk([*seed, chunk], _CANDIDATES_PER_CHUNK, max_depth=max_depth,
                          max_args=max_args, min_length=min_length, max_length=max_length)
    x, y = x[:count - have], y[:count - have]
    inputs.append(x)
    labels.append(y)
    have += len(y)
    chunk += 1
    if bar is not None:
      bar.update(len(y))
    if chunk > 1000 and have == 0:
      raise ValueError(f"no tree of length in ({min_length}, {max_length}) among "
                       f"{chunk * _CANDIDATES_PER_CHUNK} candidates; widen the range.")
  if bar is not None:
    bar.close()
  return np.concatenate(inputs), np.concatenate(labels)


def _progress_bar(total: int, description: str):
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  return tqdm(total=total, desc=description, unit="ex", smoothing=0.1)


def convert_format(inputs: np.ndarray, token_format: str, seq_len: int) -> np.ndarray:
  """Bracket-format ids `[N, T]` -> `token_format` ids `[N, seq_len]`."""
  if token_format == "brackets":
    return inputs
  if token_format == "alphanumeric":
    out = np.zeros((len(inputs), seq_len), inputs.dtype)
    keep = (inputs != CLOSE_ID) & (inputs != PAD_ID)
    # Stable compaction: each row's kept tokens move to the front.
    positions = np.cumsum(keep, axis=1) - 1
    rows = np.broadcast_to(np.arange(len(inputs))[:, None], inputs.shape)
    out[rows[keep], positions[keep]] = inputs[keep]
    return out
  return np.stack([encode(to_release_source(row), seq_len, "parens") for row in inputs])


# ----------------------------------------------------------------------------------------
# The LRA release files.

def read_release_tsv(path: pathlib.Path, seq_len: int, token_format: str = "brackets"
                     ) -> Tuple[np.ndarray, np.ndarray]:
  """Reads one LRA release TSV file (header `Source\\tTarget`).

  Returns:
    `inputs [N, seq_len]` uint8 ids and `label [N]` uint8.

  Raises:
    FileNotFoundError: no such file.
    ValueError: a malformed file, naming the file and line.
  """
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"expected the LRA ListOps release file {path}.")
  inputs, labels = [], []
  with open(path, newline="", encoding="utf-8") as f:
    reader = csv.reader(f, delimiter="\t")
    header = next(reader, None)
    if header is None or "Source" not in header or "Target" not in header:
      raise ValueError(f"{path}, line 1: expected the header 'Source<TAB>Target', got "
                       f"{header!r}.")
    source_column, target_column = header.index("Source"), header.index("Target")
    for row in reader:
      line = reader.line_num
      if not row:
        continue
      if len(row) != len(header):
        raise ValueError(f"{path}, line {line}: expected {len(header)} tab-separated fields "
                         f"({', '.join(header)}), got {len(row)}.")
      try:
        label = int(row[target_column])
        if not 0 <= label <= 9:
          raise ValueError(f"Target {label} is not in 0..9")
        inputs.append(encode(row[source_column], seq_len, token_format))
      except ValueError as error:
        raise ValueError(f"{path}, line {line}: {error}") from None
      labels.append(label)
  if not labels:
    raise ValueError(f"{path}: no examples after the header.")
  return np.stack(inputs), np.asarray(labels, np.uint8)


# ----------------------------------------------------------------------------------------
# The task.

class ListOpsTask(Task):
  """ListOps generated at the LRA settings, or converted from the release files."""

  def __init__(self, *, sizes: Dict[str, int], seed: int, max_depth: int, max_args: int,
               min_length: int, max_length: int, token_format: str,
               release_dir: Optional[pathlib.Path]):
    if token_format not in TOKEN_FORMATS:
      raise ValueError(f"token_format={token_format!r}; expected one of {TOKEN_FORMATS}.")
    self.sizes, self.seed = sizes, seed
    self.max_depth, self.max_args = max_depth, max_args
    self.min_length, self.max_length = min_length, max_length
    self.token_format = token_format
    self.release_dir = None if release_dir is None else pathlib.Path(release_dir)
    # Bracket-format lengths are < max_length; with parentheses a tree of length L
    # has 3 L - 2 tokens.
    seq_len = 3 * (max_length - 1) - 2 if token_format == "parens" else max_length
    self.info = TaskInfo(name="listops", vocab_size=VOCAB_SIZE, num_classes=10,
                         seq_len=seq_len, split_sizes=dict(RELEASE_SIZES))

  def _folder(self, data_dir: pathlib.Path, split: str) -> pathlib.Path:
    return pathlib.Path(data_dir) / self.info.name / split

  def _complete(self, folder: pathlib.Path, split: str) -> bool:
    files = [folder / "inputs.npy", folder / "label.npy"]
    if not all(f.is_file() for f in files):
      return False
    if self.release_dir is not None:
      return True
    # A split generated at another size is stale.
    return all(len(np.load(f, mmap_mode="r")) == self.sizes[split] for f in files)

  def prepare(self, data_dir: pathlib.Path, *, progress: bool = True) -> Dict[str, int]:
    written = {}
    for index, split in enumerate(SPLITS):
      folder = self._folder(data_dir, split)
      if self._complete(folder, split):
        written[split] = 0
        continue
      began = time.perf_counter()
      if self.release_dir is not None:
        inputs, label = read_release_tsv(self.release_dir / RELEASE_FILES[split],
                                         self.info.seq_len, self.token_format)
      else:
        inputs, label = generate(self.sizes[split], (self.seed, index), max_depth=self.max_depth,
                                 max_args=self.max_args, min_length=self.min_length,
                                 max_length=self.max_length, progress=progress,
                                 description=f"listops {split}")
        inputs = convert_format(inputs, self.token_format, self.info.seq_len)
      ArraySource({"inputs": inputs, "label": label}).save(folder)
      written[split] = len(label)
      if progress:
        seconds = time.perf_counter() - began
        print(f"listops {split}: {len(label)} examples in {seconds:.1f} s "
              f"({len(label) / max(seconds, 1e-9):.0f} examples/s) -> {folder}")
    return written

  def splits(self, data_dir: pathlib.Path) -> Dict[str, ExampleSource]:
    return load_splits(data_dir, self.info.name)


def make_task(train_size: int = RELEASE_SIZES["train"],
              validation_size: int = RELEASE_SIZES["validation"],
              test_size: int = RELEASE_SIZES["test"], seed: int = 0, max_depth: int = 10,
              max_args: int = 10, min_length: int = 500, max_length: int = 2000,
              token_format: str = "brackets",
              release_dir: Optional[Union[str, pathlib.Path]] = None) -> ListOpsTask:
  """ListOps; the defaults are the LRA release's settings.

  Args:
    train_size, validation_size, test_size: examples generated per split (ignored
      with `release_dir`, whose files fix them).
    seed: the generator's seed.
    max_depth, max_args, min_length, max_length: the LRA generator's flags (trees
      of at most max_depth levels, 2..max_args arguments per operator, and
      min_length < tokens < max_length, parentheses not counted).
    token_format: "brackets", "parens" or "alphanumeric" (module docstring).
    release_dir: a folder with the LRA release's basic_{train,val,test}.tsv;
      `prepare` converts them instead of generating.
  """
  return ListOpsTask(sizes={"train": train_size, "validation": validation_size,
                            "test": test_size}, seed=seed, max_depth=max_depth,
                     max_args=max_args, min_length=min_length, max_length=max_length,
                     token_format=token_format, release_dir=release_dir)
