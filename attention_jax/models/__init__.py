"""Models built from one `ModelConfig`: the encoder and its layer stack, the
classifiers (one sequence or a pair), the causal language model, the
encoder-decoders, section H's architectures, and `build_model`, which builds
the kind a config names from the table of kinds (`models/kinds.py`)."""

from __future__ import annotations

from typing import Any, Mapping, Union

from attention_jax.models.blocks import Block, make_mixer
from attention_jax.models.classifier import DualEncoderClassifier, SequenceClassifier
from attention_jax.models.config import (POOLINGS, REMAT_POLICIES, RESIDUALS, ModelConfig,
                                         default_model_config)
from attention_jax.models.encoder import Encoder, VectorEncoder
from attention_jax.models.encoder_decoder import TransformerEncoderDecoder
from attention_jax.models.funnel import FunnelTransformer
from attention_jax.models.hierarchical import HierarchicalTransformer
from attention_jax.models.kinds import KINDS, MODEL_KINDS, ModelKind, get_kind
from attention_jax.models.language_model import LanguageModel, MaskedLanguageModel
from attention_jax.models.seq2seq import RNNEncoderDecoder
from attention_jax.models.stack import LayerStack, initial_carry, run_layers
from attention_jax.models.vit import VisionTransformer

Model = Union[SequenceClassifier, DualEncoderClassifier, LanguageModel, MaskedLanguageModel,
              RNNEncoderDecoder,
              TransformerEncoderDecoder, VisionTransformer, FunnelTransformer,
              HierarchicalTransformer]


def build_model(config: Union[Mapping[str, Any], ModelConfig]) -> Model:
  """The model of `config.kind`, from a model config (a `ConfigDict`, a mapping
  with keys of `default_model_config()`, or a `ModelConfig`); missing keys take
  their defaults.

  "classifier" is a `SequenceClassifier`, "dual_classifier" a
  `DualEncoderClassifier`, "language_model" a `LanguageModel` (which ignores
  the classifier keys `num_classes`, `pooling` and `head_mlp_dim`),
  "masked_language_model" a `MaskedLanguageModel` (the same, its encoder
  run both ways), "rnn_seq2seq" an `RNNEncoderDecoder` (which reads only the keys its
  docstring lists), "transformer_seq2seq" a `TransformerEncoderDecoder`;
  "vit" a `VisionTransformer`, "funnel" a `FunnelTransformer`,
  "hierarchical" a `HierarchicalTransformer` (the `builder` of each in
  `KINDS`).

  Raises:
    ValueError: on an unknown key, name or option (with the closest valid
      one), or a value out of range: when the model is built, not at its first
      trace.
  """
  model_config = config if isinstance(config, ModelConfig) else ModelConfig.from_config(config)
  return get_kind(model_config.kind).builder(model_config)


__all__ = ["Block", "DualEncoderClassifier", "Encoder", "FunnelTransformer",
           "HierarchicalTransformer", "KINDS", "LanguageModel", "LayerStack", "MODEL_KINDS",
           "MaskedLanguageModel", "ModelConfig", "ModelKind", "POOLINGS", "REMAT_POLICIES",
           "RESIDUALS", "RNNEncoderDecoder", "SequenceClassifier", "TransformerEncoderDecoder",
           "VectorEncoder", "VisionTransformer", "build_model",
           "default_model_config", "get_kind", "initial_carry", "make_mixer", "run_layers"]
