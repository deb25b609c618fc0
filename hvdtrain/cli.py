"""Command line: ``hvdtrain [train] [options]``, ``hvdtrain doctor``, ``hvdtrain track``, ...

With no subcommand, ``hvdtrain`` (and ``python -m hvdtrain``) trains, so the README's
``horovodrun -np 2 python -m hvdtrain`` runs the embedded default job. A user mistake ends with
one line on stderr and exit code 2; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, NoReturn

from hvdtrain import __version__, inference, streams
from hvdtrain.bench import benchmark
from hvdtrain.collectives import ended_by_another_rank
from hvdtrain.collectives.horovod_backend import leave_horovod
from hvdtrain.data import convert
from hvdtrain.errors import PeerFailed, UserError
from hvdtrain.options import add_arguments, config_from_args
from hvdtrain.startup import hide_native_notices
from hvdtrain.tracking import upload

# A rank whose collective failed because another rank left waits this long before it exits.
AFTER_ANOTHER_RANK_S = 1.0


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a mistake is one line that names it (and the closest valid flag), and
    no prefix of a flag is taken for the flag (a typo must not pass for an option)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        unknown = re.search(r"unrecognized arguments: (--?[\w-]+)", message)
        if unknown:
            flags = [f for action in self._all_actions() for f in action.option_strings]
            close = difflib.get_close_matches(unknown.group(1), flags, n=1, cutoff=0.6)
            if close:
                message += f"; did you mean {close[0]}?"
        self.exit(2, f"hvdtrain: error: {message} (see '{self.prog} --help')\n")

    def _all_actions(self) -> list[argparse.Action]:
        actions = list(self._actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    actions += sub._actions
        return actions


def _train(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    from hvdtrain.liveness.watch import liveness_for

    # Installed before TensorFlow loads (seconds), so a stop requested meanwhile is honoured
    # too; the run uninstalls it when it ends.
    with liveness_for(config, process_exits=args.process_exits).installed() as liveness:
        from hvdtrain.training.run import train

        train(config, liveness)
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from hvdtrain.install import doctor

    return doctor.main()


@dataclass(frozen=True)
class Command:
    help: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None] | None
    run: Callable[[argparse.Namespace], int]


COMMANDS = {
    "train": Command("train a model (the default command)",
                     "Train a model data-parallel across the ranks.", add_arguments, _train),
    "doctor": Command("check the installation on every rank",
                      "Print versions, Horovod's build, MPI and rank facts on every rank, and "
                      "a verdict.", None, _doctor),
    "evaluate": Command("exact (distributed) evaluation of a finished run",
                        "Evaluate a run's final model on its validation split or a given set.",
                        inference.add_evaluate_arguments, inference.evaluate),
    "predict": Command("class predictions of a finished run's model for a few inputs",
                       "Predict classes for the examples in a .npz or .npy file.",
                       inference.add_predict_arguments, inference.predict),
    "benchmark": Command("training throughput on synthetic data",
                         "Time hvdtrain's training step on synthetic data, warm-up excluded.",
                         benchmark.add_arguments, benchmark.main),
    "track": Command("send a run directory to MLflow",
                     "Send a run directory's params, epoch metrics and final files to an MLflow "
                     "run (continuing the one it was tracked in), e.g. after the server was "
                     "down.", upload.add_arguments, upload.track),
    "convert": Command("write a .npz or an image folder as sharded TFRecord files",
                       "Convert data into sharded TFRecord files for --dataset tfrecord.",
                       convert.add_arguments, convert.main),
}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="hvdtrain",
        description="Data-parallel training of Keras 3 models on Horovod's or TensorFlow's "
                    "collectives. Launch with horovodrun -np N python -m hvdtrain [options].")
    parser.add_argument("--version", action="version", version=f"hvdtrain {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND",
                                     parser_class=OneLineParser)
    for name, command in COMMANDS.items():
        sub = commands.add_parser(name, help=command.help, description=command.description)
        if command.add_arguments is not None:
            command.add_arguments(sub)
    return parser


def _with_default_command(argv: list[str]) -> list[str]:
    if argv and (argv[0] in COMMANDS or argv[0] in ("-h", "--help", "--version")):
        return argv
    return ["train", *argv]


def entry() -> NoReturn:
    """The console script and ``python -m hvdtrain``: ``main`` with TensorFlow's native
    start-up notices filtered out of stderr, and output that a lost launcher cannot break."""
    hide_native_notices()
    streams.install()
    launcher = os.getppid()
    code = main(process_exits=True)
    from hvdtrain.launchers import launched_by_a_launcher

    launcher_gone = launched_by_a_launcher() and os.getppid() != launcher
    if launcher_gone or (code and launched_by_a_launcher()):
        # MPI's finalisation would wait: for the dead launcher's daemon, or for the other ranks'
        # own finalisation, which after an error here makes the launcher report whichever rank
        # leaves first. Leaving without it (Horovod shut down first, so no rank waits for this
        # one) makes the launcher report this rank's code, the first (measured).
        if not launcher_gone:
            leave_horovod()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def main(argv: list[str] | None = None, process_exits: bool = False) -> int:
    """Run one command; return its exit code. ``process_exits``: the process ends right after
    (the console script), so a training run leaves the stop signals ignored, not restored."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(_with_default_command(argv))
    except SystemExit as exit_request:   # --help, --version, or a one-line usage error
        return int(exit_request.code or 0)
    args.process_exits = process_exits
    debug = getattr(args, "debug", False) or "--debug" in argv
    try:
        return COMMANDS[args.command].run(args)
    except PeerFailed as error:
        # Another rank failed and says why; the job's error is shown once. Leave after it, so
        # that the launcher reports its exit code (the first non-zero one), not this rank's.
        if debug:
            traceback.print_exc()
        time.sleep(AFTER_ANOTHER_RANK_S)
        return error.exit_code
    except UserError as error:
        if debug:
            traceback.print_exc()
        print(f"hvdtrain: error: {error}", file=sys.stderr, flush=True)
        return error.exit_code
    except Exception as error:
        if debug or not ended_by_another_rank(error):
            raise
        # Another rank failed and said why: leave quietly, after it, so that the launcher
        # reports its exit code (the first non-zero one), not this rank's.
        leave_horovod()
        time.sleep(AFTER_ANOTHER_RANK_S)
        return 1
