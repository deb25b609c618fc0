"""Issue 46's further program shapes, each a shrunken copy of one keras.io example or guide (named
in its section) on offline data, run by the program harness (``programs.harness``: ``Context``,
``Outcome``, ``Spec``, the modes, the example counters). Here: a siamese pair as a
list ``x`` under a loss function returning one value per batch, a shuffling ``PyDataset``,
lists of inputs, outputs, losses and loss weights, ``add_loss`` inside a layer, a summed Huber
loss with sample weights, label smoothing on one-hot targets and a custom metric class;
``keras_coupled_examples`` has those whose rows are coupled within a batch. ``PROGRAMS`` is
the Keras-example set: issue 27's programs and these.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras import ops

from keras_coupled_examples import (bn_convnet, fcn_synchronized_bn, masked_gru_tagger,
                                    mean_with_sample_weight, ner_token_loss, supervised_contrastive)
from keras_programs import PROGRAMS as FIRST_PROGRAMS
from programs.harness import (MODES, VAL_IDS, Context, Outcome, SeenIds, Spec, counter, digits,
                              echoed, example_id_input, ids)


# --- Siamese network, contrastive loss function (keras.io/examples/vision/siamese_contrastive)

def _pairs(x: np.ndarray, y: np.ndarray, count: int, seed: int) -> tuple[list, np.ndarray]:
    """The example's ``make_pairs``: alternately a same-digit pair (label 0) and a different-digit
    pair (label 1)."""
    rng = np.random.default_rng(seed)
    by_digit = [np.flatnonzero(y == digit) for digit in range(10)]
    first, second, labels = [], [], []
    for index in range(count):
        left = int(rng.integers(len(x)))
        same = index % 2 == 0
        digit = y[left] if same else (y[left] + int(rng.integers(1, 10))) % 10
        first.append(x[left])
        second.append(x[rng.choice(by_digit[digit])])
        labels.append(0.0 if same else 1.0)
    return [np.array(first), np.array(second)], np.array(labels, np.float32)


def contrastive(margin: float = 1.0):
    """The example's ``loss(margin)``: a function returning the batch's mean, one value."""
    def contrastive_loss(y_true, y_pred):
        square_pred = ops.square(y_pred)
        margin_square = ops.square(ops.maximum(margin - y_pred, 0))
        return ops.mean((1 - y_true) * square_pred + y_true * margin_square)

    return contrastive_loss


def siamese_contrastive(ctx: Context) -> Outcome:
    """Two images through one embedding tower, the Euclidean distance of the embeddings through a
    sigmoid, ``fit([x1, x2], y)``: 256 training pairs and 64 validation pairs, batches of equal
    size. The example's batch normalisation layers are left out (``keras_coupled_examples``
    has them)."""
    x, y = digits()
    train_x, train_y = _pairs(x[:1200], y[:1200], 256, 201)
    val_x, val_y = _pairs(x[1200:], y[1200:], 64, 202)
    keras.utils.set_random_seed(203)
    image = keras.Input((8, 8, 1))
    hidden = keras.layers.Conv2D(4, 3, activation="tanh")(image)
    hidden = keras.layers.AveragePooling2D(2)(hidden)
    tower = keras.Model(image, keras.layers.Dense(10, activation="tanh")(
        keras.layers.Flatten()(hidden)))
    first, second = keras.Input((8, 8, 1)), keras.Input((8, 8, 1))

    def euclidean_distance(vectors):
        left, right = vectors
        squares = ops.sum(ops.square(left - right), axis=1, keepdims=True)
        return ops.sqrt(ops.maximum(squares, keras.backend.epsilon()))

    distance = keras.layers.Lambda(euclidean_distance, output_shape=(1,))(
        [tower(first), tower(second)])
    siamese = keras.Model([first, second], keras.layers.Dense(1, activation="sigmoid")(distance))
    siamese.compile(loss=contrastive(margin=1.0),
                    optimizer=ctx.optimizer(keras.optimizers.RMSprop(0.003)),
                    metrics=["accuracy"])
    x_train, y_train = ctx.shard(train_x, train_y)
    ctx.fit(siamese, x_train, y_train, validation_data=(val_x, val_y), batch_size=ctx.batch,
            epochs=2, shuffle=False)
    return Outcome({"model": siamese})


# --- A shuffling PyDataset (keras.io/examples/vision/keypoint_detection) --------------

class KeyPointsDataset(keras.utils.PyDataset):
    """The example's dataset: ``on_epoch_end`` reshuffles its indexes with NumPy's generator for
    training; ``__len__`` drops a partial batch. Each batch carries its rows' ids (counted)."""

    def __init__(self, images: np.ndarray, points: np.ndarray, example_ids: np.ndarray,
                 batch_size: int, train: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.images, self.points, self.example_ids = images, points, example_ids
        self.batch_size, self.train = batch_size, train
        self.on_epoch_end()

    def __len__(self) -> int:
        return len(self.images) // self.batch_size

    def on_epoch_end(self) -> None:
        self.indexes = np.arange(len(self.images))
        if self.train:
            np.random.shuffle(self.indexes)

    def __getitem__(self, index: int):
        rows = self.indexes[index * self.batch_size:(index + 1) * self.batch_size]
        example = self.example_ids[rows]
        return ({"image": self.images[rows], "example_id": example},
                {"keypoints": self.points[rows].reshape(-1, 1, 1, 4), "ids": example})


def _ink_points(x: np.ndarray) -> np.ndarray:
    """Two keypoints per digit: the ink's centre of mass in the left and the right half,
    scaled to [0, 1]."""
    grid = np.arange(8, dtype=np.float32)
    points = []
    for half in (slice(0, 4), slice(4, 8)):
        ink = x[:, :, half, 0] + 1e-3
        rows = (ink.sum(axis=2) * grid).sum(axis=1) / ink.sum(axis=(1, 2))
        cols = (ink.sum(axis=1) * grid[half]).sum(axis=1) / ink.sum(axis=(1, 2))
        points += [rows / 7, cols / 7]
    return np.stack(points, axis=1).astype(np.float32)


def keypoints_pydataset(ctx: Context) -> Outcome:
    """Keypoint regression on a ``PyDataset``, fit with Keras' default ``shuffle=True`` (it
    shuffles the order of the batches too), ``mse`` and Adam; the example's MobileNet backbone
    shrunk to a convolution and two separable convolutions down to 1x1x4: 256 training digits,
    64 for validation."""
    x, _ = digits()
    points = _ink_points(x)
    keras.utils.set_random_seed(208)
    counts = counter(VAL_IDS + 64)
    image, example_id = keras.Input((8, 8, 1), name="image"), example_id_input()
    hidden = keras.layers.Conv2D(8, 3, activation="relu")(image)
    hidden = keras.layers.SeparableConv2D(8, 3, activation="relu")(hidden)
    output = keras.layers.SeparableConv2D(4, 4, activation="sigmoid", name="keypoints")(hidden)
    model = keras.Model({"image": image, "example_id": example_id},
                        {"keypoints": output, "ids": echoed(example_id)})
    model.compile(loss={"keypoints": "mse"}, optimizer=ctx.optimizer(keras.optimizers.Adam(0.003)),
                  metrics={"ids": [SeenIds(counts)]})
    train_images, train_points, train_ids = ctx.shard(x[:256], points[:256], ids(0, 256))
    train = KeyPointsDataset(train_images, train_points, train_ids, ctx.batch)
    val = KeyPointsDataset(x[1400:1464], points[1400:1464], ids(VAL_IDS, 64), ctx.batch,
                           train=False)
    ctx.fit(model, train, validation_data=val, epochs=2)
    return Outcome({"model": model}, {"ids": counts})


# --- Lists of inputs, outputs, losses and weights (keras.io/guides/functional_api) ----

def ticket_lists(ctx: Context) -> Outcome:
    """The guide's ticket classifier: a title and a body (token sequences of any length,
    embedded, one LSTM each) and tags; a priority (one logit) and a department (four logits);
    compiled with lists of losses, loss weights and per-output metrics, fit on lists
    ``[title, body, tags]`` and ``[priority, department]``: 256 tickets."""
    rng = np.random.default_rng(213)
    n = 256
    title = rng.integers(1, 40, (n, 10))
    body = rng.integers(1, 40, (n, 20))
    tags = rng.integers(0, 2, (n, 6)).astype(np.float32)
    priority = ((title[:, :3].mean(axis=1) / 40 + tags[:, 0]) / 2)[:, None].astype(np.float32)
    department = np.eye(4, dtype=np.float32)[(body[:, 0] + tags.argmax(axis=1)) % 4]
    keras.utils.set_random_seed(214)
    title_input = keras.Input((None,), name="title")
    body_input = keras.Input((None,), name="body")
    tags_input = keras.Input((6,), name="tags")
    title_features = keras.layers.LSTM(8)(keras.layers.Embedding(40, 8)(title_input))
    body_features = keras.layers.LSTM(4)(keras.layers.Embedding(40, 8)(body_input))
    joined = keras.layers.concatenate([title_features, body_features, tags_input])
    model = keras.Model([title_input, body_input, tags_input],
                        [keras.layers.Dense(1, name="priority")(joined),
                         keras.layers.Dense(4, name="department")(joined)])
    model.compile(optimizer=ctx.optimizer(keras.optimizers.RMSprop(3e-3)),
                  loss=[keras.losses.BinaryCrossentropy(from_logits=True),
                        keras.losses.CategoricalCrossentropy(from_logits=True)],
                  loss_weights=[1.0, 0.2],
                  metrics=[[keras.metrics.MeanAbsoluteError(name="mae")],
                           [keras.metrics.CategoricalAccuracy(name="acc")]])
    x_train, y_train = ctx.shard([title, body, tags], [priority, department])
    ctx.fit(model, x_train, y_train, epochs=2, batch_size=ctx.batch, shuffle=False)
    return Outcome({"model": model})


# --- add_loss inside a layer (keras.io/guides/making_new_layers_and_models_via_subclassing)

class Sampling(keras.layers.Layer):
    """z = z_mean + exp(z_log_var / 2) * epsilon, epsilon drawn from its own seed generator."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        epsilon = keras.random.normal(ops.shape(z_mean), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


class Encoder(keras.layers.Layer):
    """The guide's encoder; the KL divergence (the batch's mean) is added here with
    ``add_loss``, where the guide adds it in the model's ``call``."""

    def __init__(self, latent_dim: int, intermediate_dim: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dense_proj = keras.layers.Dense(intermediate_dim, activation="relu")
        self.dense_mean = keras.layers.Dense(latent_dim)
        self.dense_log_var = keras.layers.Dense(latent_dim)
        self.sampling = Sampling()

    def call(self, inputs):
        x = self.dense_proj(inputs)
        z_mean, z_log_var = self.dense_mean(x), self.dense_log_var(x)
        self.add_loss(-0.5 * ops.mean(z_log_var - ops.square(z_mean) - ops.exp(z_log_var) + 1))
        return self.sampling((z_mean, z_log_var))


class VariationalAutoEncoder(keras.Model):
    def __init__(self, original_dim: int, intermediate_dim: int, latent_dim: int) -> None:
        super().__init__()
        self.encoder = Encoder(latent_dim, intermediate_dim)
        self.decoder = keras.Sequential([keras.layers.Dense(intermediate_dim, activation="relu"),
                                         keras.layers.Dense(original_dim,
                                                            activation="sigmoid")])

    def call(self, inputs):
        return self.decoder(self.encoder(inputs))


def vae_add_loss(ctx: Context) -> Outcome:
    """``vae.compile(optimizer, loss=MeanSquaredError())``, ``vae.fit(x, x)``: the reported loss
    is the reconstruction's plus the layer's KL term; 320 flattened digits, 2 epochs. The
    sampling draws at random on every rank, so losses are compared within a tolerance."""
    x, _ = digits()
    flat = x.reshape(len(x), 64)
    keras.utils.set_random_seed(215)
    vae = VariationalAutoEncoder(64, 16, 2)
    vae.compile(ctx.optimizer(keras.optimizers.Adam(3e-3)), loss=keras.losses.MeanSquaredError())
    x_train = ctx.shard(flat[:320])
    ctx.fit(vae, x_train, x_train, epochs=2, batch_size=ctx.batch, shuffle=False)
    return Outcome({"model": vae})


# --- A summed Huber loss with sample weights (keras.io/examples/vision/retinanet's box loss)

def _ink_boxes(x: np.ndarray) -> np.ndarray:
    """Each digit's ink box (top, left, bottom, right), scaled to [0, 1]."""
    ink = x[..., 0] > 0.3
    edges = []
    for lines in (ink.any(axis=2), ink.any(axis=1)):          # rows, then columns
        edges += [lines.argmax(axis=1), 7 - lines[:, ::-1].argmax(axis=1)]
    top, bottom, left, right = edges
    return (np.stack([top, left, bottom, right], axis=1) / 7).astype(np.float32)


def huber_sum_boxes(ctx: Context) -> Outcome:
    """Box regression with the example's smooth-L1 as ``keras.losses.Huber(reduction="sum")``
    (the batch's sum, as RetinaNet sums its box loss before normalising), sample weights and a
    mean-absolute-error metric: 300 digits, 2 epochs, a short last batch."""
    x, y = digits()
    boxes = _ink_boxes(x)
    weights = np.where(np.isin(y, [0, 8]), 2.0, 1.0).astype(np.float32)
    keras.utils.set_random_seed(216)
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(8, 3, activation="relu"),
                              keras.layers.Flatten(), keras.layers.Dense(4)])
    model.compile(optimizer=ctx.optimizer(keras.optimizers.SGD(0.002)),
                  loss=keras.losses.Huber(delta=1.0, reduction="sum"), metrics=["mae"])
    x_train, y_train, w_train = ctx.shard(x[:300], boxes[:300], weights[:300])
    ctx.fit(model, x_train, y_train, sample_weight=w_train, batch_size=ctx.batch, epochs=2,
            shuffle=False)
    return Outcome({"model": model})


# --- Label smoothing on one-hot targets (keras.io/examples/vision/cct) -----------------

class SequencePooling(keras.layers.Layer):
    """The example's attention pooling over the tokens (without the bias: see below)."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = keras.layers.Dense(1, use_bias=False)

    def call(self, x):
        weights = ops.transpose(ops.softmax(self.attention(x), axis=1), axes=(0, 2, 1))
        return ops.reshape(ops.matmul(weights, x), (-1, x.shape[-1]))


def cct_label_smoothing(ctx: Context) -> Outcome:
    """A compact convolutional transformer: a convolutional tokenizer, one transformer layer
    (its stochastic depth and dropout left out), sequence pooling; one-hot targets, cross-entropy
    on logits with ``label_smoothing=0.1``, accuracy and top-5 accuracy, AdamW,
    ``validation_split=0.1``: 320 digits, 2 epochs. The attention and the pooling have no
    biases here: the key bias and the pooling's bias get no gradient (a softmax ignores them), so
    Adam turns the rounding noise of their gradients, which depends on the order of summation,
    into full steps (measured: 1e-4 apart from one process with identical metrics)."""
    x, y = digits()
    one_hot = keras.utils.to_categorical(y, 10)
    keras.utils.set_random_seed(219)
    inputs = keras.Input((8, 8, 1))
    tokens = keras.layers.Conv2D(16, 3, padding="same", use_bias=False, activation="relu")(inputs)
    tokens = keras.layers.MaxPooling2D(3, 2, padding="same")(tokens)
    encoded = keras.layers.Reshape((16, 16))(tokens)
    attended = keras.layers.LayerNormalization(epsilon=1e-5)(encoded)
    attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=16, use_bias=False)(
        attended, attended)
    encoded = keras.layers.Add()([attended, encoded])
    mlp = keras.layers.Dense(16, activation="gelu")(
        keras.layers.LayerNormalization(epsilon=1e-5)(encoded))
    encoded = keras.layers.Add()([mlp, encoded])
    pooled = SequencePooling()(keras.layers.LayerNormalization(epsilon=1e-5)(encoded))
    model = keras.Model(inputs, keras.layers.Dense(10)(pooled))
    model.compile(optimizer=ctx.optimizer(keras.optimizers.AdamW(0.003, weight_decay=1e-4)),
                  loss=keras.losses.CategoricalCrossentropy(from_logits=True,
                                                            label_smoothing=0.1),
                  metrics=[keras.metrics.CategoricalAccuracy(name="accuracy"),
                           keras.metrics.TopKCategoricalAccuracy(5, name="top-5-accuracy")])
    ctx.fit(model, x=x[:320], y=one_hot[:320], batch_size=ctx.batch, epochs=2,
            validation_split=0.1, shuffle=False)
    return Outcome({"model": model})


# --- A custom metric class (keras.io/guides/training_with_built_in_methods) ------------

class CategoricalTruePositives(keras.metrics.Metric):
    """The guide's metric: a count of correct predictions, one variable added to per batch.
    (The guide compares labels of shape (N,) with predictions of shape (N, 1), which broadcasts
    to every pair of the batch; the labels are reshaped here.)"""

    def __init__(self, name: str = "categorical_true_positives", **kwargs: Any) -> None:
        super().__init__(name=name, **kwargs)
        self.true_positives = self.add_variable(shape=(), name="ctp", initializer="zeros")

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_pred = ops.reshape(ops.argmax(y_pred, axis=1), (-1, 1))
        values = ops.cast(ops.reshape(ops.cast(y_true, "int32"), (-1, 1))
                          == ops.cast(y_pred, "int32"), "float32")
        if sample_weight is not None:
            values = ops.multiply(values, ops.reshape(ops.cast(sample_weight, "float32"),
                                                      (-1, 1)))
        self.true_positives.assign_add(ops.sum(values))

    def result(self):
        return self.true_positives

    def reset_state(self):
        self.true_positives.assign(0)


def custom_metric_class(ctx: Context) -> Outcome:
    """The guide's MNIST MLP on flattened digits with RMSprop and the metric above: 320
    digits, 2 epochs."""
    x, y = digits()
    flat = x.reshape(len(x), 64)
    keras.utils.set_random_seed(220)
    inputs = keras.Input((64,), name="digits")
    hidden = keras.layers.Dense(32, activation="relu")(inputs)
    hidden = keras.layers.Dense(32, activation="relu")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(hidden))
    model.compile(optimizer=ctx.optimizer(keras.optimizers.RMSprop(1e-3)),
                  loss=keras.losses.SparseCategoricalCrossentropy(),
                  metrics=[CategoricalTruePositives()])
    x_train, y_train = ctx.shard(flat[:320], y[:320])
    ctx.fit(model, x_train, y_train, batch_size=ctx.batch, epochs=2, shuffle=False)
    return Outcome({"model": model})


# Where the drop-in runs a program (with one process): a list x under a per-batch loss, and a
# custom metric under MetricAverageCallback. Elsewhere its step, the mean of the ranks' means,
# shows little about these shapes that the hvdtrain run does not, and leaving it out pays for
# the suite's time (issue 46; measured passing with it: the PyDataset and the lists).
WITH_DROPIN = MODES
NO_DROPIN = ("hvdtrain", "keras")
NOT_THE_DROPINS = "drop-in: left out to pay for the suite's time (see WITH_DROPIN)"
SPLIT = "drop-in: validation_split of each rank's shard holds out other rows than one process's"
# Coupled rows: the loss tolerance is what each rank's own 16 rows give, measured by running
# the program under the drop-in (a mean of the ranks' batch losses): supervised contrastive
# 32% off one process (fewer rows to contrast with), batch normalisation 5.6%, the token loss
# 0.6%, Keras' mask weighting 0.03% (mean_with_sample_weight 1.7%, but hvdtrain is exact).
EXAMPLES: dict[str, Spec] = {
    "siamese_contrastive": Spec(siamese_contrastive, WITH_DROPIN),
    "supervised_contrastive": Spec(supervised_contrastive, NO_DROPIN, NOT_THE_DROPINS,
                                   tolerance=None, loss_tolerance=0.4,
                                   coupled=("SupervisedContrastiveLoss",
                                            "supervised_contrastive_loss")),
    "bn_convnet": Spec(bn_convnet, NO_DROPIN, NOT_THE_DROPINS, tolerance=None,
                       loss_tolerance=0.1, coupled=("by each rank's own batch",)),
    # Cross-rank batch statistics: one process's to 1e-5.
    "fcn_synchronized_bn": Spec(fcn_synchronized_bn, NO_DROPIN, SPLIT),
    # hvdtrain orders the batches itself: another shuffle of the same data (measured 1.3% off
    # one process, the drop-in 2%); every example once per epoch.
    "keypoints_pydataset": Spec(keypoints_pydataset, NO_DROPIN, NOT_THE_DROPINS, tolerance=None,
                                dropin_tolerance=None, loss_tolerance=0.05,
                                counted="once per epoch"),
    "masked_gru_tagger": Spec(masked_gru_tagger, NO_DROPIN, NOT_THE_DROPINS, tolerance=None,
                              loss_tolerance=0.01, coupled=("mask",)),
    "ner_token_loss": Spec(ner_token_loss, NO_DROPIN, NOT_THE_DROPINS, tolerance=None,
                           loss_tolerance=0.03,
                           coupled=("CustomNonPaddingTokenLoss", "custom_ner_loss")),
    "ticket_lists": Spec(ticket_lists, NO_DROPIN, NOT_THE_DROPINS),
    # Sampling draws per rank: hvdtrain/README.md promises within 10% (the drop-in's loss
    # measured 0.2% off one process).
    "vae_add_loss": Spec(vae_add_loss, NO_DROPIN, NOT_THE_DROPINS, tolerance=None,
                         loss_tolerance=0.1),
    "huber_sum_boxes": Spec(
        huber_sum_boxes, NO_DROPIN,
        "drop-in: Horovod averages the ranks' gradients, so a summed loss trains at half one "
        "process's rate (Horovod's rule: scale the rate)"),
    # One output: one process's to 1e-5 (measured so, and hvdtrain/README.md's promise).
    "mean_with_sample_weight": Spec(mean_with_sample_weight, NO_DROPIN, NOT_THE_DROPINS),
    "cct_label_smoothing": Spec(cct_label_smoothing, NO_DROPIN, SPLIT),
    "custom_metric_class": Spec(custom_metric_class, WITH_DROPIN,
                                rank_averaged={"categorical_true_positives": "count"}),
}

# The Keras-example set: issue 27's programs, then these.
PROGRAMS: dict[str, Spec] = {**FIRST_PROGRAMS, **EXAMPLES}
