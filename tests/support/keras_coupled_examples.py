"""Issue 46's program shapes whose rows are coupled within a batch, each a shrunken copy of one
keras.io example or guide (named in its section) on offline data: a supervised contrastive
``Loss`` overriding ``__call__``, a token loss divided by the batch's real tokens, Keras' own
mask weighting of a per-token loss, ``reduction="mean_with_sample_weight"``, and batch
normalisation, per rank and ``synchronized=True``. ``keras_examples`` lists them with their
``Spec`` (the harness: ``programs.harness``).

One process reduces (or normalises) each batch of 32 rows as a whole; hvdtrain must compute the
same, or say in one line on rank 0 that each rank takes its own 16 rows (``Spec.coupled``).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from programs.harness import Context, Outcome, digits


# --- Supervised contrastive learning (keras.io/examples/vision/supervised-contrastive-learning)

def npairs_loss(y_true, y_pred):
    """The example's n-pairs loss: each row's softmax over the batch's similarities, against its
    same-label rows."""
    y_true = ops.expand_dims(ops.cast(y_true, y_pred.dtype), -1)
    y_true = ops.cast(ops.equal(y_true, ops.transpose(y_true)), y_pred.dtype)
    y_true = y_true / ops.sum(y_true, 1, keepdims=True)
    return ops.mean(ops.categorical_crossentropy(y_true, y_pred, from_logits=True))


class SupervisedContrastiveLoss(keras.losses.Loss):
    """The example's loss: overrides ``__call__`` (not ``call``), so Keras' reduction and sample
    weights never apply; every row's term depends on every other row of the batch."""

    def __init__(self, temperature: float = 1.0, name: str | None = None) -> None:
        super().__init__(name=name)
        self.temperature = temperature

    def __call__(self, labels, feature_vectors, sample_weight=None):
        normalized = feature_vectors / ops.maximum(
            ops.sqrt(ops.sum(ops.square(feature_vectors), axis=1, keepdims=True)), 1e-12)
        logits = ops.divide(ops.matmul(normalized, ops.transpose(normalized)), self.temperature)
        return npairs_loss(ops.squeeze(labels), logits)


def supervised_contrastive(ctx: Context) -> Outcome:
    """The first stage: an encoder and a projection head trained on the contrastive loss alone
    (the example's ResNet and augmentation shrunk to dense layers; its second stage, an ordinary
    classifier on the frozen encoder, left out): 256 digits, temperature 0.05."""
    x, y = digits()
    keras.utils.set_random_seed(204)
    encoder = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                                keras.layers.Dense(32, activation="relu")], name="encoder")
    inputs = keras.Input((8, 8, 1))
    projection = keras.layers.Dense(16, activation="relu")(encoder(inputs))
    model = keras.Model(inputs, projection, name="encoder_with_projection_head")
    model.compile(optimizer=ctx.optimizer(keras.optimizers.Adam(0.003)),
                  loss=SupervisedContrastiveLoss(0.05))
    x_train, y_train = ctx.shard(x[:256], y[:256])
    ctx.fit(model, x=x_train, y=y_train, batch_size=ctx.batch, epochs=2, shuffle=False)
    return Outcome({"model": model})


# --- Batch normalisation per rank
# (keras.io/examples/vision/image_classification_from_scratch)

def _residual_convnet() -> keras.Model:
    """The example's ``make_model``, shrunk: an entry convolution, one residual block with a
    separable convolution, each followed by batch normalisation, global pooling and a logit
    (its dropout left out)."""
    def normalised(layer: keras.layers.Layer, tensor: Any) -> Any:
        tensor = keras.layers.BatchNormalization()(layer(tensor))
        return keras.layers.Activation("relu")(tensor)

    inputs = keras.Input((8, 8, 1))
    x = normalised(keras.layers.Conv2D(8, 3, padding="same"), inputs)
    previous = x
    x = normalised(keras.layers.SeparableConv2D(16, 3, padding="same"), x)
    x = keras.layers.MaxPooling2D(3, strides=2, padding="same")(x)
    residual = keras.layers.Conv2D(16, 1, strides=2, padding="same")(previous)
    x = keras.layers.GlobalAveragePooling2D()(keras.layers.add([x, residual]))
    return keras.Model(inputs, keras.layers.Dense(1)(x))


def bn_convnet(ctx: Context) -> Outcome:
    """Even digits against odd as the example's cats against dogs: batched datasets for training
    (256 images) and validation (64), binary cross-entropy on logits. Batch normalisation
    without ``synchronized``: in one process it normalises by 32 images, on a rank by its 16."""
    x, y = digits()
    odd = (y % 2).astype(np.float32)
    keras.utils.set_random_seed(205)
    model = _residual_convnet()
    model.compile(optimizer=ctx.optimizer(keras.optimizers.Adam(0.003)),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[keras.metrics.BinaryAccuracy(name="acc")])
    train = tf.data.Dataset.from_tensor_slices((x[:256], odd[:256]))
    val = tf.data.Dataset.from_tensor_slices((x[1400:1464], odd[1400:1464])).batch(ctx.batch)
    ctx.fit(model, ctx.shard_dataset(train).batch(ctx.batch), epochs=2, validation_data=val)
    return Outcome({"model": model})


# --- Synchronized batch normalisation
# (keras.io/examples/timeseries/timeseries_classification_from_scratch)

def _series(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """FordA's shape, synthetic: a univariate series of 32 readings, two classes of frequency."""
    rng = np.random.default_rng(seed)
    label = rng.integers(0, 2, count)
    steps = np.arange(32, dtype=np.float32)
    phase = rng.uniform(0, 2 * np.pi, count)[:, None]
    series = np.sin(steps * (0.3 + 0.25 * label[:, None]) + phase) + rng.normal(0, 0.3, (count, 32))
    return series.astype(np.float32)[..., None], label.astype(np.int64)


def fcn_synchronized_bn(ctx: Context) -> Outcome:
    """The example's fully convolutional classifier (three Conv1D, batch normalisation, ReLU),
    here with ``BatchNormalization(synchronized=True)``, its callbacks (the best model saved,
    ``ReduceLROnPlateau`` and ``EarlyStopping`` on the validation loss, patience shrunk to the
    run) and ``validation_split=0.2``: 200 series, 2 epochs. The convolutions have no bias
    here: batch normalisation removes it, so its gradient is rounding noise that depends on the
    order of summation, and Adam turns that into full steps (measured: the biases, and the
    moving means with them, 1e-3 apart from one process while every other weight was 1e-7)."""
    x, y = _series(200, 206)
    keras.utils.set_random_seed(207)
    inputs = keras.Input((32, 1))
    hidden = inputs
    for _ in range(3):
        hidden = keras.layers.Conv1D(8, 3, padding="same", use_bias=False)(hidden)
        hidden = keras.layers.BatchNormalization(synchronized=True)(hidden)
        hidden = keras.layers.ReLU()(hidden)
    hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    model = keras.Model(inputs, keras.layers.Dense(2, activation="softmax")(hidden))
    model.compile(optimizer=ctx.optimizer(keras.optimizers.Adam(0.01)),
                  loss="sparse_categorical_crossentropy",
                  metrics=["sparse_categorical_accuracy"])
    callbacks = [*ctx.writers(keras.callbacks.ModelCheckpoint(
                     str(ctx.directory / "best_model.keras"), save_best_only=True,
                     monitor="val_loss")),
                 keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1,
                                                   min_lr=0.0001),
                 keras.callbacks.EarlyStopping(monitor="val_loss", patience=2)]
    ctx.fit(model, x, y, batch_size=ctx.batch, epochs=2, callbacks=callbacks,
            validation_split=0.2, shuffle=False)
    return Outcome({"model": model}, notes={"saved": (ctx.directory / "best_model.keras").exists()})


# --- Embedding(mask_zero=True) and a GRU tagging tokens
# (keras.io/guides/understanding_masking_and_padding)

def _tagged(count: int, seed: int, length: int = 12) -> tuple[list, list]:
    """Sequences of 3 to 12 tokens (1-29; 0 pads), each token tagged by its value and its
    predecessor's (tags 1-3; 0 pads)."""
    rng = np.random.default_rng(seed)
    tokens, tags = [], []
    for _ in range(count):
        sequence = rng.integers(1, 30, int(rng.integers(3, length + 1)))
        before = np.concatenate([[0], sequence[:-1]])
        tokens.append(sequence.tolist())
        tags.append((1 + (sequence + (before > 15)) % 3).tolist())
    return tokens, tags


def masked_gru_tagger(ctx: Context) -> Outcome:
    """``pad_sequences`` to 12, ``Embedding(mask_zero=True)``, a GRU returning sequences and a
    softmax per token: the mask reaches the loss, which Keras weights per batch so that its
    mean is over the batch's real tokens (the guide's masked LSTM, tagging tokens as in the
    IMDB bidirectional-LSTM example's shape): 256 sequences, 64 for validation."""
    tokens, tags = _tagged(320, 209)
    x = keras.utils.pad_sequences(tokens, maxlen=12, padding="post")
    y = keras.utils.pad_sequences(tags, maxlen=12, padding="post") - 1
    y = np.maximum(y, 0)             # padding's target: masked, any class
    keras.utils.set_random_seed(210)
    inputs = keras.Input((12,), dtype="int32")
    hidden = keras.layers.Embedding(30, 8, mask_zero=True)(inputs)
    hidden = keras.layers.GRU(8, return_sequences=True)(hidden)
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))
    model.compile(optimizer=ctx.optimizer(keras.optimizers.Adam(0.01)),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    x_train, y_train = ctx.shard(x[:256], y[:256])
    ctx.fit(model, x_train, y_train, batch_size=ctx.batch, epochs=2, shuffle=False,
            validation_data=(x[256:], y[256:]))
    return Outcome({"model": model})


# --- A token loss over the batch's real tokens (keras.io/examples/nlp/ner_transformers)

class TokenAndPositionEmbedding(keras.layers.Layer):
    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int) -> None:
        super().__init__()
        self.token_emb = keras.layers.Embedding(vocab_size, embed_dim)
        self.pos_emb = keras.layers.Embedding(maxlen, embed_dim)

    def call(self, inputs):
        positions = ops.arange(0, ops.shape(inputs)[-1], 1)
        return self.token_emb(inputs) + self.pos_emb(positions)


class TransformerBlock(keras.layers.Layer):
    """The example's block: self-attention and a feed-forward layer, each with a residual and
    ``LayerNormalization`` (its dropout left out)."""

    def __init__(self, embed_dim: int, num_heads: int, ff_dim: int) -> None:
        super().__init__()
        self.att = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([keras.layers.Dense(ff_dim, activation="relu"),
                                     keras.layers.Dense(embed_dim)])
        self.layernorm1 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = keras.layers.LayerNormalization(epsilon=1e-6)

    def call(self, inputs):
        out1 = self.layernorm1(inputs + self.att(inputs, inputs))
        return self.layernorm2(out1 + self.ffn(out1))


class NERModel(keras.Model):
    def __init__(self, num_tags: int, vocab_size: int, maxlen: int, embed_dim: int = 16,
                 num_heads: int = 2, ff_dim: int = 16) -> None:
        super().__init__()
        self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
        self.transformer_block = TransformerBlock(embed_dim, num_heads, ff_dim)
        self.ff = keras.layers.Dense(ff_dim, activation="relu")
        self.ff_final = keras.layers.Dense(num_tags, activation="softmax")

    def call(self, inputs):
        return self.ff_final(self.ff(self.transformer_block(self.embedding_layer(inputs))))


class CustomNonPaddingTokenLoss(keras.losses.Loss):
    """The example's loss: the summed cross-entropy of real tokens (tag > 0) over their count in
    the batch, one value per batch."""

    def __init__(self, name: str = "custom_ner_loss") -> None:
        super().__init__(name=name)

    def call(self, y_true, y_pred):
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=False, reduction=None)
        loss = loss_fn(y_true, y_pred)
        mask = ops.cast((y_true > 0), dtype="float32")
        return ops.sum(loss * mask) / ops.sum(mask)


def ner_token_loss(ctx: Context) -> Outcome:
    """A subclassed ``NERModel`` (token and position embeddings, a transformer block) on a
    ``padded_batch`` dataset of variable-length sentences, the loss ignoring padding: 256
    sentences, 2 epochs. The example pads each batch to its longest sentence and attends over
    the padding; padded to 12 here, so that one process's batches and the ranks' have one
    shape."""
    tokens, tags = _tagged(256, 211)
    keras.utils.set_random_seed(212)
    model = NERModel(num_tags=4, vocab_size=30, maxlen=12)
    model.compile(optimizer=ctx.optimizer(keras.optimizers.Adam(0.005)),
                  loss=CustomNonPaddingTokenLoss())
    sentence = tf.TensorSpec([None], tf.int64)
    sentences = tf.data.Dataset.from_generator(lambda: zip(tokens, tags),
                                               output_signature=(sentence, sentence))
    train = ctx.shard_dataset(sentences).padded_batch(ctx.batch, padded_shapes=([12], [12]))
    ctx.fit(model, train, epochs=2)
    return Outcome({"model": model})


# --- reduction="mean_with_sample_weight"
# (keras.io/examples/structured_data/imbalanced_classification)

def mean_with_sample_weight(ctx: Context) -> Outcome:
    """The fraud-detection shape with a weight per transaction instead of per class, and a
    loss divided by the batch's summed weights (``reduction="mean_with_sample_weight"``), so
    each row's share depends on the other rows of its batch: 320 transactions."""
    rng = np.random.default_rng(217)
    x = rng.normal(size=(320, 12)).astype(np.float32)
    y = (x[:, 0] * 1.5 + x[:, 1] + rng.normal(0, 0.5, 320) > 2.0).astype(np.float32)
    weights = np.where(y == 1, 4.0, 1.0).astype(np.float32) * rng.uniform(0.5, 1.5, 320).astype(
        np.float32)
    keras.utils.set_random_seed(218)
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=ctx.optimizer(keras.optimizers.Adam(0.01)),
                  loss=keras.losses.BinaryCrossentropy(reduction="mean_with_sample_weight"),
                  weighted_metrics=["accuracy"])
    x_train, y_train, w_train = ctx.shard(x, y, weights)
    ctx.fit(model, x_train, y_train, sample_weight=w_train, batch_size=ctx.batch, epochs=2,
            shuffle=False)
    return Outcome({"model": model})
