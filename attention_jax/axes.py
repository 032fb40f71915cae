"""Logical axis names, and the default rules that map them to mesh axes.

Weights and activations have names of their own (as in MaxText): a parameter's
"embed" dimension may be split over "fsdp" (ZeRO-3), while the activations'
"activation_embed" stays whole and their "activation_batch" takes the
data-parallel axes. With one name for both, the rules' order decided which
claim won. The trainer reads its rules from `config.logical_axis_rules`, whose
default is `DEFAULT_RULES`.
"""

# Weights.
EMBED = "embed"
HEADS = "heads"
KV = "kv"  # the per-head feature dimension
MLP = "mlp"
VOCAB = "vocab"
CLASSES = "classes"
RELPOS_BUCKETS = "relpos_buckets"
LAYERS = "layers"  # the stacked axis of scanned layers
EXPERT = "expert"  # a mixture of experts' expert axis
PRODUCT_KEYS = "product_keys"  # the value table of a product-key memory

# Activations.
ACTIVATION_BATCH = "activation_batch"
ACTIVATION_LENGTH = "activation_length"
ACTIVATION_EMBED = "activation_embed"
ACTIVATION_HEADS = "activation_heads"
ACTIVATION_KV = "activation_kv"
ACTIVATION_MLP = "activation_mlp"
ACTIVATION_VOCAB = "activation_vocab"

# Mesh axes (`train.partitioning.MESH_AXES`): "data" (replicated parameters),
# "fsdp" (data parallel, parameters split along "embed"), "tensor"
# (Megatron-style model parallel over heads, MLP units and the vocabulary).
DATA_AXES = ("data", "fsdp")
# The mesh axis a sequence is split over (`config.sequence_shards`): only in
# meshes made for it, where the activations' length takes it and exact
# attention runs as ring attention (kernels/flash_attention/ring.py).
SEQUENCE_AXIS = "sequence"

DEFAULT_RULES = (
    # Expert parallelism (GShard): each "fsdp" device holds its share of the
    # experts, whose other weight axes are then whole. First, so that an
    # expert weight's "embed" does not claim "fsdp" before its "expert" axis.
    (EXPERT, "fsdp"),
    (EMBED, "fsdp"),
    (HEADS, "tensor"),
    (MLP, "tensor"),
    (VOCAB, "tensor"),
    # The head size is small and its heads are already split; classes and
    # relative-position buckets are a handful of rows; each scanned layer's
    # weights live where an unrolled layer's would.
    (KV, None),
    (CLASSES, None),
    (RELPOS_BUCKETS, None),
    (LAYERS, None),
    # A product-key memory's value table is one large lookup table, split by
    # rows as an embedding table is.
    (PRODUCT_KEYS, "tensor"),
    (ACTIVATION_BATCH, DATA_AXES),
    # Split over SEQUENCE_AXIS only with `config.sequence_shards` > 1
    # (`train.partitioning.sequence_parallel_rules`): every other variant would
    # need to handle a split sequence.
    (ACTIVATION_LENGTH, None),
    (ACTIVATION_EMBED, None),
    (ACTIVATION_HEADS, "tensor"),
    (ACTIVATION_KV, None),
    (ACTIVATION_MLP, "tensor"),
    (ACTIVATION_VOCAB, "tensor"),
)
