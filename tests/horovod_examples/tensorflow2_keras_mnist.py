# Horovod's examples/tensorflow2/tensorflow2_keras_mnist.py, rewritten for hvdtrain's tests.
# Changes from Horovod's script, each marked below:
#   * the import line (hvdtrain.keras instead of horovod.tensorflow.keras);
#   * Keras 3: compile() has no `experimental_run_tf_function`, and ModelCheckpoint wants a
#     `.keras` file name;
#   * embedded data (scikit-learn's 8x8 digits instead of downloading MNIST), fewer steps
#     and epochs, and a test hook at the end that saves each rank's weights and history.
import json
import os

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import hvdtrain.keras as hvd            # was: import horovod.tensorflow.keras as hvd


def main():
    # Horovod: initialize Horovod.
    hvd.init()

    # Horovod: pin GPU to be used to process local rank (one GPU per process)
    gpus = tf.config.experimental.list_physical_devices('GPU')
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')

    digits = load_digits()                  # was: tf.keras.datasets.mnist.load_data(...)
    mnist_images, mnist_labels = digits.images / 16.0, digits.target

    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.cast(mnist_images[..., tf.newaxis], tf.float32),
         tf.cast(mnist_labels, tf.int64))
    )
    dataset = dataset.repeat().shuffle(10000).batch(128)

    mnist_model = tf.keras.Sequential([
        tf.keras.layers.Conv2D(32, [3, 3], activation='relu'),
        tf.keras.layers.Conv2D(64, [3, 3], activation='relu'),
        tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation='relu'),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(10, activation='softmax')
    ])

    # Horovod: adjust learning rate based on number of GPUs.
    scaled_lr = 0.001 * hvd.size()
    opt = tf.optimizers.Adam(scaled_lr)

    # Horovod: add Horovod DistributedOptimizer.
    opt = hvd.DistributedOptimizer(
        opt, backward_passes_per_step=1, average_aggregated_gradients=True)

    mnist_model.compile(loss=tf.losses.SparseCategoricalCrossentropy(),
                        optimizer=opt,
                        metrics=['accuracy'])   # Keras 3: no experimental_run_tf_function

    callbacks = [
        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),

        # Horovod: average metrics among workers at the end of every epoch.
        hvd.callbacks.MetricAverageCallback(),

        # Horovod: scale the learning rate `lr = 1.0` ---> `lr = 1.0 * hvd.size()` during
        # the first three epochs.
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1),
    ]

    # Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
    if hvd.rank() == 0:
        # Keras 3: a model checkpoint is a `.keras` file (was './checkpoint-{epoch}.h5').
        callbacks.append(tf.keras.callbacks.ModelCheckpoint('./checkpoint-{epoch}.keras'))

    # Horovod: write logs on worker 0.
    verbose = 1 if hvd.rank() == 0 else 0

    # Train the model.
    # Horovod: adjust number of steps based on number of GPUs.
    history = mnist_model.fit(dataset, steps_per_epoch=48 // hvd.size(), callbacks=callbacks,
                              epochs=5, verbose=verbose)   # was 500 // size steps, 24 epochs

    # Test hook (not in Horovod's example): every rank saves its weights and history.
    np.savez(f"weights-{hvd.rank()}.npz", *mnist_model.get_weights())
    with open(f"history-{hvd.rank()}.json", "w") as handle:
        json.dump({k: [float(x) for x in v] for k, v in history.history.items()}, handle)
    print("final learning rate", float(opt.learning_rate), "on", os.getcwd())


if __name__ == '__main__':
    main()
