"""Command line: ``hvdtrain [train] [options]``, ``hvdtrain doctor``, ``hvdtrain --version``.

With no subcommand, ``hvdtrain`` (and ``python -m hvdtrain``) trains, so the README's
``horovodrun -np 2 python -m hvdtrain`` runs the embedded default job. A user mistake ends with
one line on stderr and exit code 2; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from hvdtrain import __version__, convert, inference
from hvdtrain.config import add_arguments, config_from_args
from hvdtrain.errors import UserError

SUBCOMMANDS = ("train", "doctor", "evaluate", "predict", "convert")
USER_ERROR_EXIT = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hvdtrain",
        description="Data-parallel training of Keras 3 models with Horovod. Launch with "
                    "horovodrun -np N python -m hvdtrain [options].")
    parser.add_argument("--version", action="version", version=f"hvdtrain {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = commands.add_parser("train", help="train a model (the default command)",
                                description="Train a model data-parallel across the ranks.")
    add_arguments(train)
    commands.add_parser("doctor", help="check the installation on every rank",
                        description="Print versions, Horovod's build, MPI and rank facts on "
                                    "every rank, and a verdict.")
    inference.add_evaluate_arguments(commands.add_parser(
        "evaluate", help="exact (distributed) evaluation of a finished run",
        description="Evaluate a run's final model on its validation split or a given set."))
    inference.add_predict_arguments(commands.add_parser(
        "predict", help="class predictions of a finished run's model for a few inputs",
        description="Predict classes for the examples in a .npz or .npy file."))
    convert.add_arguments(commands.add_parser(
        "convert", help="write a .npz or an image folder as sharded TFRecord files",
        description="Convert data into sharded TFRecord files for --dataset tfrecord."))
    return parser


def _with_default_command(argv: list[str]) -> list[str]:
    if argv and (argv[0] in SUBCOMMANDS or argv[0] in ("-h", "--help", "--version")):
        return argv
    return ["train", *argv]


def _run(args: argparse.Namespace) -> int:
    if args.command == "doctor":
        from hvdtrain import doctor

        return doctor.main()
    if args.command in ("evaluate", "predict"):
        return getattr(inference, args.command)(args)
    if args.command == "convert":
        return convert.main(args)
    config = config_from_args(args)
    # Run directories and checkpoints stay private to the user on a shared cluster.
    os.umask(0o077)
    from hvdtrain.training.run import train

    train(config)
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(_with_default_command(argv))
    debug = getattr(args, "debug", False) or "--debug" in argv
    try:
        return _run(args)
    except UserError as error:
        if debug:
            traceback.print_exc()
        print(f"hvdtrain: error: {error}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT
