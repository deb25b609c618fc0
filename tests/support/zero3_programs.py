"""ZeRO stage 3 (issue 47) on programs written the way keras.io's examples are, run by the
program harness (``programs.harness``) in its ``hvdtrain`` mode, in the same job as the other
sets: at stage 3 (``<name>@3``) and, where the other sets do not already, at stage 0
(``<name>``). Stage 3 must end where stage 0 ends (1e-5 relative), or refuse in one line
naming the layer's variable and a fix; ``tests/distributed/programs/test_zero3_programs.py``
compares them.

Here: keras.io's text classification with a Transformer (a token and position embedding,
``MultiHeadAttention``, ``LayerNormalization``, ``Dropout``, ``GlobalAveragePooling1D``), whose
trainable embeddings' sparse gradients stage 3 refuses, and the same model fine-tuned over
frozen embeddings (keras.io's pretrained word embeddings), which it trains; and the guide
"Customizing what happens in fit": a model with its own ``train_step``, ``test_step`` and
metric trackers. The convnet with batch normalisation is the Keras-example set's
(``keras_coupled_examples.bn_convnet``), compared at stage 3 with its stage-0 run there.

Dropout draws the same masks at both stages (a layer without weights is not wrapped; a
wrapped layer's recomputation replays its draws), so the comparison is exact although each
rank draws its own.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from keras_coupled_examples import bn_convnet
from programs.harness import Context, Outcome, Spec

STAGE_3 = {"zero_stage": 3}
HVDTRAIN = ("hvdtrain",)
WHY = "stage 3 against stage 0, both on 2 ranks (dropout draws per rank)"


# --- keras.io/examples/nlp/text_classification_with_transformer ------------------------------

class TransformerBlock(keras.layers.Layer):
    def __init__(self, embed_dim: int, num_heads: int, ff_dim: int, rate: float = 0.1,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.att = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([keras.layers.Dense(ff_dim, activation="relu"),
                                     keras.layers.Dense(embed_dim)])
        self.layernorm1 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = keras.layers.Dropout(rate)
        self.dropout2 = keras.layers.Dropout(rate)

    def call(self, inputs, training=None):
        attn_output = self.dropout1(self.att(inputs, inputs), training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.dropout2(self.ffn(out1), training=training)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(keras.layers.Layer):
    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, trainable_tokens: bool,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.token_emb = keras.layers.Embedding(input_dim=vocab_size, output_dim=embed_dim,
                                                trainable=trainable_tokens)
        self.pos_emb = keras.layers.Embedding(input_dim=maxlen, output_dim=embed_dim,
                                              trainable=trainable_tokens)

    def call(self, x):
        positions = self.pos_emb(ops.arange(0, ops.shape(x)[-1], 1))
        return self.token_emb(x) + positions


def _reviews(count: int = 192, maxlen: int = 12, vocab: int = 40) -> tuple[np.ndarray, ...]:
    """IMDB's shape, synthetic: padded token ids (0 pads), positive when more of tokens 2-6
    than of 7-11 appear."""
    rng = np.random.default_rng(301)
    lengths = rng.integers(6, maxlen + 1, count)
    tokens = rng.integers(2, vocab, (count, maxlen)) * (np.arange(maxlen) < lengths[:, None])
    good = ((tokens >= 2) & (tokens < 7)).sum(axis=1)
    bad = ((tokens >= 7) & (tokens < 12)).sum(axis=1)
    return tokens.astype(np.int64), (good >= bad).astype(np.int64)


def _transformer_classifier(ctx: Context, trainable_tokens: bool) -> Outcome:
    """The example's model, shrunk (embedding 16, 2 heads, feed-forward 16), Adam, sparse
    cross-entropy, validation data: 128 reviews, 2 epochs."""
    x, y = _reviews()
    maxlen, vocab = x.shape[1], 40
    keras.utils.set_random_seed(302)
    inputs = keras.Input(shape=(maxlen,))
    hidden = TokenAndPositionEmbedding(maxlen, vocab, 16, trainable_tokens)(inputs)
    hidden = TransformerBlock(16, 2, 16)(hidden)
    hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    hidden = keras.layers.Dropout(0.1)(hidden)
    hidden = keras.layers.Dense(20, activation="relu")(hidden)
    hidden = keras.layers.Dropout(0.1)(hidden)
    model = keras.Model(inputs, keras.layers.Dense(2, activation="softmax")(hidden))
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return _fitted_or_refused(ctx, model, x[:128], y[:128], batch_size=ctx.batch, epochs=2,
                              shuffle=False, validation_data=(x[128:], y[128:]))


def transformer_text(ctx: Context) -> Outcome:
    """Token and position embeddings trained with the rest."""
    return _transformer_classifier(ctx, trainable_tokens=True)


def transformer_frozen_embeddings(ctx: Context) -> Outcome:
    """The embeddings frozen (as pretrained ones are), the Transformer and the head trained."""
    return _transformer_classifier(ctx, trainable_tokens=False)


# --- keras.io/guides/custom_train_step_in_tensorflow ----------------------------------------

class CustomModel(keras.Model):
    """The guide's model with its own steps and metric trackers (``metrics`` lists them, so
    Keras resets them each epoch)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = keras.losses.mean_squared_error(y, y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        self.loss_tracker.update_state(keras.losses.mean_squared_error(y, y_pred))
        self.mae_metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


def own_train_step(ctx: Context) -> Outcome:
    """The guide's functional ``CustomModel(inputs, outputs)`` (a hidden layer added),
    ``compile(optimizer="adam")`` without a loss, validation data: 128 rows, 2 epochs."""
    rng = np.random.default_rng(303)
    x = rng.random((192, 32), dtype=np.float32)
    y = (x @ rng.normal(size=(32, 1)) + 0.1 * rng.normal(size=(192, 1))).astype(np.float32)
    keras.utils.set_random_seed(304)
    inputs = keras.Input(shape=(32,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    model = CustomModel(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer="adam")
    return _fitted_or_refused(ctx, model, x[:128], y[:128], batch_size=ctx.batch, epochs=2,
                              shuffle=False, validation_data=(x[128:], y[128:]))


def _fitted_or_refused(ctx: Context, model: keras.Model, *args: Any, **kwargs: Any) -> Outcome:
    """``ctx.fit(model, ...)``; a refusal is recorded for the test to judge (its type, its
    whole message, and whether the model still holds its initial weights, whole)."""
    initial = model.get_weights()
    try:
        ctx.fit(model, *args, **kwargs)
    except Exception as error:
        from hvdtrain.errors import UserError

        after = model.get_weights()
        kept = [w.shape for w in after] == [w.shape for w in initial] and all(
            np.array_equal(now, then) for now, then in zip(after, initial))
        return Outcome({"model": model}, notes={"refused": {
            "type": type(error).__name__, "message": str(error),
            "user_error": isinstance(error, UserError), "weights_kept": kept,
            "shapes": [[list(w.shape) for w in ws] for ws in (after, initial)]}})
    return Outcome({"model": model}, notes={"refused": None})


def _pair(build: Callable[[Context], Outcome]) -> dict[str, Spec]:
    """A new program at stage 0 and at stage 3, on 2 ranks only."""
    name = build.__name__
    return {name: Spec(build, HVDTRAIN, WHY),
            f"{name}@3": Spec(build, HVDTRAIN, WHY, options=STAGE_3)}


# Each stage-3 program that trains -> its stage-0 run (the convnet's: the Keras-example set's).
STAGE_0_OF = {"transformer_frozen_embeddings@3": "transformer_frozen_embeddings",
              "own_train_step@3": "own_train_step", "bn_convnet@3": "bn_convnet"}

PROGRAMS: dict[str, Spec] = {
    # Refused before its first step: no stage-0 run to compare with.
    "transformer_text@3": Spec(transformer_text, HVDTRAIN, WHY, options=STAGE_3),
    **_pair(transformer_frozen_embeddings), **_pair(own_train_step),
    "bn_convnet@3": Spec(bn_convnet, HVDTRAIN, WHY, options=STAGE_3),
}
