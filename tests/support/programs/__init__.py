"""The program harness: users' Keras programs run on 2 ranks and in one process, compared.

A program is a function ``program(ctx: Context) -> Outcome`` written once, with a ``Spec``
(``harness``): the modes it runs in, its batch per rank, how closely it must match one
process. Three sets of programs use it: the Keras-example set (``keras_programs``,
``keras_pipelines``, ``keras_examples``, ``keras_coupled_examples``: issue 27's and issue 46's
shapes of real use and keras.io examples) and the user-program set (``user_programs``,
``user_data_programs``: a custom ``train_step``, a GAN, a VAE, preprocessing, callbacks, data
forms), and the ZeRO stage-3 set (``zero3_programs``: issue 47's keras.io shapes at stages 0
and 3, on 2 ranks only); ``sets`` names them.

``ranks`` runs every program of a mode one after the other in one job and writes per-rank
records; ``jobs`` is the test side: two launches per pytest session, each shared by the sets'
tests: 2 ranks running the ``hvdtrain`` mode, then the drop-in's, in the same processes; and
one process, the reference. The tests are ``tests/distributed/programs/test_keras_programs.py``,
``test_user_programs.py`` and ``test_zero3_programs.py``.
"""
