"""The architectures that carry the variants (section H), each trained by its
smoke config: the architectures table.

  python -m experiments.reproduce --table=configs/tables/architectures.py \
      --results=results/architectures/

One row per architecture, on the task it is built for: the encoder's layer
stacks (reversible, Universal Transformer with ACT, LayerDrop), feed-forward
layers and norms on smoke ListOps beside the plain encoder they modify; the
Funnel and hierarchical Transformers on the same ListOps; ViT on generated
shapes (configs/lra/image.py's `shapes` preset: the image task's format,
since CIFAR-10 cannot be downloaded here) and on smoke Pathfinder, where it
stays at chance (docs/gpu.md, section 4: on a GPU too); the Transformer encoder-decoder on string reversal; the dual
encoder with Sentence-BERT's pooled-pair features on generated document
matching (configs/matching/dual_encoder.py: LRA retrieval's shape and smoke
model over pairs made here, since the AAN release files cannot be fetched).
2 seeds each; the verdict is whether every seed beats the task's chance level
(the majority class of a classification's test split, or the stated level of
a sequence task).
"""

from __future__ import annotations

import ml_collections

LISTOPS = "configs/lra/listops.py:dot_product,smoke"
MATCHING = "configs/matching/dual_encoder.py:dot_product,smoke"
REVERSE = "configs/seq2seq/transformer.py:dot_product,smoke"
# A reversed string of 20 to 30 symbols from 10, guessed symbol by symbol.
REVERSE_CHANCE = dict(chance=10.0, chance_reason="one symbol of 10 guessed uniformly, per "
                      "decoded token")


def _model(**fields):
  return {"model": fields}


ROWS = {
    "encoder": dict(config=LISTOPS, chance="majority"),
    "reversible": dict(config=LISTOPS, chance="majority", overrides=_model(stack="reversible")),
    "universal_act": dict(config=LISTOPS, chance="majority", overrides=_model(stack="universal")),
    "layer_drop": dict(config=LISTOPS, chance="majority", overrides=_model(layer_drop_rate=0.2)),
    "mixture_of_experts": dict(config=LISTOPS, chance="majority", overrides=_model(
        feed_forward="moe", feed_forward_options=dict(num_experts=4, top_k=2))),
    "product_key_memory": dict(config=LISTOPS, chance="majority", overrides=_model(
        feed_forward="product_key", feed_forward_options=dict(num_keys=32, top_k=4))),
    # Mean pooling: 100 tokens without a [CLS] split into chunks of 20.
    "chunked_feed_forward": dict(config=LISTOPS, chance="majority", overrides=_model(
        pooling="mean", feed_forward_options=dict(chunk_size=20))),
    "swiglu": dict(config=LISTOPS, chance="majority", overrides=_model(activation="swiglu")),
    "scalenorm": dict(config=LISTOPS, chance="majority", overrides=_model(norm="scalenorm")),
    "powernorm": dict(config=LISTOPS, chance="majority", overrides=_model(norm="powernorm")),
    "adanorm": dict(config=LISTOPS, chance="majority", overrides=_model(norm="adanorm")),
    "funnel": dict(config="configs/lra/listops.py:dot_product,funnel,smoke", chance="majority"),
    "hierarchical": dict(config="configs/lra/listops.py:dot_product,hierarchical,smoke",
                         chance="majority"),
    # ViT on generated shapes (the image task's format; CIFAR-10 cannot be downloaded
    # here) and on smoke Pathfinder, where it stays at chance (docs/gpu.md, section 4).
    "vit_image": dict(config="configs/lra/image.py:dot_product,vit,smoke,shapes",
                      chance="majority"),
    "vit_pathfinder": dict(config="configs/lra/pathfinder32.py:dot_product,vit,smoke",
                           chance="majority"),
    "encoder_decoder": dict(config=REVERSE, metric="decoded_token_accuracy", **REVERSE_CHANCE),
    "transparent_attention": dict(config="configs/seq2seq/transformer.py:dot_product,"
                                  "transparent,smoke", metric="decoded_token_accuracy",
                                  **REVERSE_CHANCE),
    "sentence_bert_cls": dict(config=MATCHING, chance="majority", overrides=_model(
        pair_features="sentence_bert", pooling="cls")),
    "sentence_bert_mean": dict(config=MATCHING, chance="majority", overrides=_model(
        pair_features="sentence_bert", pooling="mean")),
    "sentence_bert_max": dict(config=MATCHING, chance="majority", overrides=_model(
        pair_features="sentence_bert", pooling="max")),
}


def get_config():
  config = ml_collections.ConfigDict()
  config.name = "architectures"
  config.kind = "architectures"
  config.description = "Architectures of section H, smoke configs (CPU)"
  config.rows = ROWS
  config.row_order = tuple(ROWS)
  config.seeds = (0, 1)
  config.flags = ()
  return config
