"""The model kinds: one table of what `config.model.kind` can name.

  kind = get_kind("funnel")
  kind.builder(model_config)     # what `build_model` does
  kind.objective                 # "classify": how the trainer calls and scores it

Each `ModelKind` says what builds the model, which objective of
`attention_jax.train.objectives` trains it, which task shapes it fits, and
which `ModelConfig` fields only some kinds read. `ModelConfig.check`, the
objectives and the trainer's task check read this table, so a new kind is
one row here (and its objective, if it needs a new one) and no list elsewhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Tuple

import flax.linen as nn

from attention_jax import registry
from attention_jax.models.classifier import DualEncoderClassifier, SequenceClassifier
from attention_jax.models.config import ModelConfig
from attention_jax.models.encoder_decoder import TransformerEncoderDecoder
from attention_jax.models.funnel import FunnelTransformer
from attention_jax.models.hierarchical import HierarchicalTransformer
from attention_jax.models.language_model import LanguageModel, MaskedLanguageModel
from attention_jax.models.seq2seq import RNNEncoderDecoder
from attention_jax.models.vit import VisionTransformer

# What a task gives a model (see `task_shape`): one token sequence per
# example, a pair of them (retrieval, matching), a source and a target
# sequence, or consecutive segments of one stream of text.
TASK_SHAPES = ("sequence", "pair", "seq2seq", "stream")

# The fields of a classifier head (read by every kind that classifies).
_CLASSIFIER_FIELDS = ("num_classes", "pooling", "pooling_options", "head_mlp_dim")


@dataclasses.dataclass(frozen=True)
class ModelKind:
  """One model kind.

  Attributes:
    name: the `config.model.kind` that selects it.
    builder: `ModelConfig -> nn.Module`, the model's class.
    objective: the name of its objective in `attention_jax.train.objectives`
      (how the trainer calls the model on a batch and scores its logits).
    tasks: the `TASK_SHAPES` it can be trained on, the one it is made for first.
    fields: the `ModelConfig` fields that only some kinds read, here those this
      kind reads; each is checked only for the kinds that read it.
    stacked: its blocks run on `stack.run_layers`, so `model.stack` may choose
      the reversible or universal stack.
    causal: what in it needs causal self-attention (for the error naming it);
      "" when nothing does.
    bidirectional: what in it attends both ways (an encoder), which a
      causal-only variant cannot run; "" when nothing does.
    encodes_vectors: an encoder of it reads vectors (image patches, chunk
      vectors) rather than tokens, which a word embedding cannot encode.
    added_tokens: ids it appends to the task's vocabulary (the masked
      language model's [MASK], the last id), counted in `model.vocab_size`.
  """

  name: str
  builder: Callable[[ModelConfig], nn.Module]
  objective: str
  tasks: Tuple[str, ...]
  fields: Tuple[str, ...] = ()
  stacked: bool = False
  causal: str = ""
  bidirectional: str = "its encoder"
  encodes_vectors: bool = False
  added_tokens: int = 0


# The order is that of the error that lists the kinds.
KINDS = {kind.name: kind for kind in (
    ModelKind("classifier", SequenceClassifier, "classify", ("sequence",),
              fields=_CLASSIFIER_FIELDS, stacked=True),
    ModelKind("dual_classifier", DualEncoderClassifier, "classify_pair", ("pair",),
              fields=_CLASSIFIER_FIELDS + ("pair_features",), stacked=True),
    # Made for streams, and trained as well on the tokens of one-sequence
    # tasks (the recall tasks score the tokens their target_mask marks).
    ModelKind("language_model", LanguageModel, "next_token", ("stream", "sequence"),
              stacked=True, causal="a language model", bidirectional=""),
    ModelKind("rnn_seq2seq", RNNEncoderDecoder, "teacher_forced", ("seq2seq",),
              fields=("rnn_cell", "decoder_attention", "beam_size")),
    ModelKind("transformer_seq2seq", TransformerEncoderDecoder, "teacher_forced", ("seq2seq",),
              fields=("cross_attention", "transparent_attention", "beam_size"),
              causal="the Transformer decoder's self-attention"),
    # Section H's architectures, each a classifier of one sequence: a Vision
    # Transformer over image patches, a Funnel Transformer (the sequence pooled
    # between stages), a hierarchical Transformer (chunks, then the chunk vectors).
    ModelKind("vit", VisionTransformer, "classify", ("sequence",),
              fields=_CLASSIFIER_FIELDS + ("patch_size",), encodes_vectors=True),
    ModelKind("funnel", FunnelTransformer, "classify", ("sequence",),
              fields=_CLASSIFIER_FIELDS + ("funnel_blocks", "funnel_decoder_blocks",
                                           "funnel_pool_queries_only")),
    ModelKind("hierarchical", HierarchicalTransformer, "classify", ("sequence",),
              fields=_CLASSIFIER_FIELDS + ("chunk_length", "sentence_layers"),
              encodes_vectors=True),
    # Trained on the tokens of one-sequence tasks (self-pretraining's
    # "masked" objective, `train.pretrain`); its encoder is the classifier's.
    ModelKind("masked_language_model", MaskedLanguageModel, "masked_token", ("sequence",),
              fields=("mask_rate",), stacked=True, added_tokens=1),
)}
MODEL_KINDS = tuple(KINDS)


def get_kind(name: str) -> ModelKind:
  """The kind called `name`; a ValueError lists the valid ones otherwise."""
  if name not in KINDS:
    raise registry.unknown_name_error("model kind", name, MODEL_KINDS)
  return KINDS[name]


def kinds_reading(field: str) -> Tuple[str, ...]:
  """The kinds whose `fields` include `field`."""
  return tuple(name for name, kind in KINDS.items() if field in kind.fields)


def stacked_kinds() -> Tuple[str, ...]:
  """The kinds built on the layer stack (whose `model.stack` may be chosen)."""
  return tuple(name for name, kind in KINDS.items() if kind.stacked)


def task_shape(info: Any) -> str:
  """Which of `TASK_SHAPES` a task is, from its `attention_jax.data.TaskInfo`."""
  if info.dual:
    return "pair"
  if info.target_len:
    return "seq2seq"
  return "stream" if info.stream else "sequence"


def kinds_for_task(info: Any) -> Tuple[str, ...]:
  """The kinds that can train on a task (its `TaskInfo`): those made for its
  shape first, then those that also fit it."""
  shape = task_shape(info)
  made_for = [name for name, kind in KINDS.items() if kind.tasks[0] == shape]
  also = [name for name, kind in KINDS.items() if shape in kind.tasks[1:]]
  return tuple(made_for + also)
