"""Rank-0 checkpoints that a crash cannot destroy, and weights-only restore.

A checkpoint (its files: ``Checkpoint``) is written under a temporary name, flushed to disk and
renamed into place in one atomic step, so the newest complete checkpoint is always on disk
whole; a write that fails (disk full, quota, permission) removes its partial directory and
stops the run with one line, the previous checkpoint untouched. A checkpoint whose files no
longer match their checksums is set aside on resume, for the one before. Restore reads weights
and arrays only: nothing in a checkpoint is executed. The run directory is locked
(``fcntl.flock`` on ``.lock``) by rank 0 for the whole run, so a second run on it is refused.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import os
import re
import shutil
import socket
import sys
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence, Union

import keras
import numpy as np

from hvdtrain.checkpoints.archives import (arrays, assigned_one_at_a_time, member_names,
                                           member_shapes, write_npz)
from hvdtrain.checkpoints.state import CheckpointState
from hvdtrain.errors import CheckpointWriteFailed, UserError
from hvdtrain.errors import os_error_reason as _why

CHECKPOINT_NAME = re.compile(r"epoch-(\d{4,})(?:-step-(\d{6,}))?")
WEIGHTS_FILE = "weights.npz"
LEGACY_WEIGHTS_FILE = "model.weights.h5"
OPTIMIZER_FILE = "optimizer.npz"
STATE_FILE = "state.json"
LOCK_FILE = ".lock"


class CheckpointError(UserError):
    """A checkpoint cannot be read or does not fit the configured model."""


class RunDirectoryBusy(UserError):
    """Another run holds the run directory's lock."""


def checkpoint_name(epoch: int, step: int = 0) -> str:
    """``epoch-0003`` after 3 epochs; ``epoch-0003-step-000120`` 120 steps into the 4th."""
    return f"epoch-{epoch:04d}" + (f"-step-{step:06d}" if step else "")


def _order(path: Path) -> tuple[int, int]:
    match = CHECKPOINT_NAME.fullmatch(path.name)
    return int(match.group(1)), int(match.group(2) or 0)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


_HELD_LOCKS: dict[Path, int] = {}


def lock_run_dir(run_dir: Path) -> None:
    """Hold an exclusive lock on ``run_dir`` until this process ends, or raise RunDirectoryBusy.

    ``flock`` is released by the kernel when the process dies, however it dies, so a crashed
    run never leaves a stale lock behind. A second run in this same process (a notebook) reuses
    the lock it already holds.
    """
    key = Path(run_dir).resolve()
    if key in _HELD_LOCKS:
        return
    path = key / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunDirectoryBusy(f"run directory {run_dir} is in use by another run ({holder}); "
                               "wait for it to end or choose another --run-dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    _HELD_LOCKS[key] = fd


def _fsync_tree(directory: Path) -> None:
    for path in [*directory.iterdir(), directory]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write a file so readers see the old content or the new, never a torn one."""
    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)


# One optimizer (the model's ``optimizer``) or every optimizer the model owns, by attribute.
Optimizers = Union[keras.optimizers.Optimizer, dict[str, keras.optimizers.Optimizer]]


def _by_name(optimizers: Any) -> dict[str, keras.optimizers.Optimizer]:
    """``{attribute: optimizer}`` (one optimizer alone is the model's ``optimizer``)."""
    return optimizers if isinstance(optimizers, dict) else {"optimizer": optimizers}


def _optimizer_prefix(name: str) -> str:
    return "v" if name == "optimizer" else f"{name}.v"


def rank_local_variables(model: keras.Model) -> list[Any]:
    """The model's variables that are not weights: the random-generator states of seeded layers
    (dropout). Each rank keeps its own; they are never broadcast."""
    weights = {id(v) for v in model.weights}
    return [v for v in model.variables if id(v) not in weights]


def assign_rank_state(model: keras.Model, values: list[np.ndarray]) -> bool:
    """Give this rank's seeded layers the random-generator state it saved; False (nothing
    changed) when the state does not fit the model."""
    variables = rank_local_variables(model)
    if len(values) != len(variables) or any(
            tuple(np.shape(value)) != tuple(v.shape) for v, value in zip(variables, values)):
        return False
    for variable, value in zip(variables, values):
        variable.assign(value)
    return True


def build_optimizers(model: keras.Model, optimizers: dict[str, keras.optimizers.Optimizer],
                     built_for: dict[str, list[str] | None]) -> None:
    """Build each optimizer not yet built for the model variables (by path) a checkpoint says
    it was built for, so its state can be restored, or broadcast to it."""
    by_path = {v.path: v for v in model.variables}
    for name, paths in built_for.items():
        optimizer = optimizers.get(name)
        if optimizer is None or optimizer.built or paths is None:
            continue
        missing = [p for p in paths if p not in by_path]
        if missing:
            raise CheckpointError(f"the checkpoint's optimizer '{name}' was built for variables "
                                  f"this model lacks ({', '.join(missing[:3])}); resume with "
                                  "the same --model")
        optimizer.build([by_path[p] for p in paths])


def _built_for(optimizer: keras.optimizers.Optimizer) -> list[str]:
    from hvdtrain.keras_internals import optimizer_variables_built_for

    return [v.path for v in optimizer_variables_built_for(optimizer)]


def _write_files(directory: Path, model: keras.Model,
                 optimizers: dict[str, keras.optimizers.Optimizer], state: CheckpointState,
                 rank_states: list[list[np.ndarray]],
                 whole: dict[str, Iterable[np.ndarray]] | None,
                 weights: Iterable[np.ndarray] | None = None) -> None:
    """A checkpoint's files in ``directory``, flushed to disk: the weights and random-generator
    states, every built optimizer's variables (``whole``: a sharded optimizer's, gathered one
    at a time as they are written), and ``state`` with what each optimizer was built for and
    the files' checksums."""
    rng = ((f"rng{rank:04d}_{i:04d}", value) for rank, values in enumerate(rank_states)
           for i, value in enumerate(values))
    if weights is None:
        weights = (weight.numpy() for weight in model.weights)
    write_npz(directory / WEIGHTS_FILE, itertools.chain(
        ((f"w{i:04d}", value) for i, value in enumerate(weights)), rng))
    built = {name: optimizer for name, optimizer in optimizers.items() if optimizer.built}
    whole = whole or {}
    write_npz(directory / OPTIMIZER_FILE, (
        (f"{_optimizer_prefix(name)}{i:04d}", value)
        for name, optimizer in built.items()
        for i, value in enumerate(whole[name] if name in whole else
                                  (v.numpy() for v in optimizer.variables))))
    files = {name: sha256_of(directory / name) for name in (WEIGHTS_FILE, OPTIMIZER_FILE)}
    optimizer_state = {name: _built_for(optimizer) for name, optimizer in built.items()}
    with open(directory / STATE_FILE, "w") as handle:
        handle.write(replace(state, optimizers=optimizer_state, files=files).to_json())
    _fsync_tree(directory)


def drain(gathers: Iterable[Any], quietly: bool = False) -> None:
    """Take part in the all-gathers of sharded state (ZeRO) that ``gathers`` has left unread:
    every rank takes part in each, so rank 0 finishes them after a failed write before it
    reports it. ``quietly``: while another error is on its way (the write's, or a peer gone),
    a failure here does not replace it."""
    try:
        for _ in gathers:
            pass
    except Exception:
        if not quietly:
            raise


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint directory: its state, whether its files are intact, and restoring it.
    It prints as its path (messages name the directory).

    ``checkpoints/epoch-NNNN`` (after NNNN whole epochs) or ``epoch-NNNN-step-SSSSSS`` (SSSSSS
    steps into the next) holds ``weights.npz`` (``w*`` in ``model.weights`` order, and each
    rank's random-generator state ``rng<rank>_*``, which ``get_weights`` leaves out, so every
    rank draws the masks an uninterrupted run would, followed there by the rank's
    ``--compression powersgd`` state, its Q matrices and error buffers; earlier versions'
    ``model.weights.h5`` is still read), ``optimizer.npz`` (``v*`` for ``model.optimizer``,
    ``<attribute>.v*`` for others such as a GAN's ``d_optimizer``, step counters and rates
    included) and ``state.json`` (a ``CheckpointState``, with the SHA-256 of the other two).
    NumPy, not HDF5: an HDF5 file whose write failed stays open in the library and fails
    again, or crashes the process, when Python exits."""

    path: Path

    def __str__(self) -> str:
        return str(self.path)

    @property
    def name(self) -> str:
        return self.path.name

    def read_state(self) -> CheckpointState:
        try:
            return CheckpointState.from_json((self.path / STATE_FILE).read_text())
        except (OSError, ValueError) as error:
            raise CheckpointError(f"checkpoint {self.path} is unreadable ({error}); delete it "
                                  "to resume from the one before") from error

    def damage(self) -> str | None:
        """What is wrong with the checkpoint's files, or None when they match their checksums.
        Checkpoints written before checksums existed are taken as they are."""
        try:
            state = CheckpointState.from_json((self.path / STATE_FILE).read_text())
        except (OSError, ValueError) as error:
            return f"{STATE_FILE} is unreadable: {error}"
        for name, expected in state.files.items():
            try:
                actual = sha256_of(self.path / name)
            except OSError as error:
                return f"{name}: {_why(error)}"
            if actual != expected:
                return f"{name} does not match its SHA-256"
        return None

    def restore(self, model: keras.Model, optimizers: Optimizers) -> None:
        """Load the weights and the variables of every optimizer; an optimizer not yet built
        (a GAN's builds at its first step) is built first for the model variables it was saved
        with. Random-generator states are each rank's: see ``rank_states``."""
        path = self.path
        try:
            if (path / WEIGHTS_FILE).exists():
                assigned_one_at_a_time(path / WEIGHTS_FILE, "w", model.weights)
            else:
                model.load_weights(path / LEGACY_WEIGHTS_FILE)
            saved_for = self.read_state().optimizers
            for name, optimizer in _by_name(optimizers).items():
                if name in saved_for:
                    self._restore_optimizer(model, name, optimizer, saved_for[name])
        except (OSError, ValueError, zipfile.BadZipFile) as error:
            raise CheckpointError(f"checkpoint {path} does not fit this model or is unreadable "
                                  f"({error}); check --model or start a new --run-dir") from error

    def rank_states(self) -> list[list[np.ndarray]]:
        """Every rank's saved random-generator state, in rank order (empty for checkpoints of
        earlier versions)."""
        weights = self.path / WEIGHTS_FILE
        if not weights.exists():
            return []
        states = []
        while values := arrays(weights, f"rng{len(states):04d}_"):
            states.append(values)
        return states

    def _restore_optimizer(self, model: keras.Model, name: str,
                           optimizer: keras.optimizers.Optimizer,
                           built_for: list[str] | None) -> None:
        if built_for is not None:
            build_optimizers(model, {name: optimizer}, {name: built_for})
        try:
            assigned_one_at_a_time(self.path / OPTIMIZER_FILE, _optimizer_prefix(name),
                                   optimizer.variables)
        except ValueError as error:
            raise self._other_state(name) from error

    def _other_state(self, name: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {self.path} holds state of another shape for "
                               f"optimizer '{name}'; resume with the same --optimizer and "
                               "--model")

    def check_optimizer_shapes(self, name: str, shapes: Sequence[tuple[int, ...]]) -> None:
        """That the checkpoint holds ``name``'s state in these (whole) shapes, from the
        arrays' headers alone."""
        try:
            with np.load(self.path / OPTIMIZER_FILE, allow_pickle=False) as archive:
                saved = member_shapes(archive, _optimizer_prefix(name))
        except (OSError, ValueError, zipfile.BadZipFile) as error:
            raise CheckpointError(f"checkpoint {self.path} is unreadable ({error}); delete it "
                                  "to resume from the one before") from error
        if saved != [tuple(s) for s in shapes]:
            raise self._other_state(name)

    def optimizer_values(self, name: str) -> Iterator[np.ndarray]:
        """``name``'s state variables in order, read one at a time as they are asked for."""
        with np.load(self.path / OPTIMIZER_FILE, allow_pickle=False) as archive:
            for member in member_names(archive, _optimizer_prefix(name)):
                yield archive[member]


class CheckpointStore:
    """The checkpoints of one run directory: which are complete, saving a new one atomically
    (pruned to the newest ``keep``), recovering from a crash mid-write, and setting damaged
    ones aside."""

    def __init__(self, run_dir: Path, keep: int) -> None:
        self.directory = Path(run_dir) / "checkpoints"
        self.keep = keep

    def complete(self) -> list[Checkpoint]:
        """Finished checkpoints, oldest first (by epoch, then step within the epoch)."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir()
                 if CHECKPOINT_NAME.fullmatch(p.name) and (p / STATE_FILE).is_file()]
        return [Checkpoint(path) for path in sorted(found, key=_order)]

    def latest(self) -> Checkpoint | None:
        found = self.complete()
        return found[-1] if found else None

    def save(self, model: keras.Model, optimizers: Optimizers, state: CheckpointState,
             rank_states: list[list[np.ndarray]] | None = None,
             whole: dict[str, Iterable[np.ndarray]] | None = None,
             weights: Iterable[np.ndarray] | None = None) -> Checkpoint:
        """Write checkpoint ``checkpoint_name(state.epoch, state.step)`` atomically and prune
        old ones; a failed write raises CheckpointWriteFailed and leaves the checkpoints on
        disk as they were. ``rank_states``: every rank's ``rank_local_variables`` values, in
        rank order (default: this process's); ``whole``: the state of sharded optimizers (ZeRO),
        by attribute, each gathered as it is written (every rank takes part: a failed write
        still completes the gathers); ``weights``: the model's weights, likewise (ZeRO stage
        3; default: the model's own values)."""
        final = self.directory / checkpoint_name(state.epoch, state.step)
        partial = self.directory / f".partial-{final.name}-{os.getpid()}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._recover_leftovers()
            partial.mkdir()
            if rank_states is None:
                rank_states = [[v.numpy() for v in rank_local_variables(model)]]
            _write_files(partial, model, _by_name(optimizers), state, rank_states, whole,
                         weights)
        except OSError as error:
            shutil.rmtree(partial, ignore_errors=True)
            previous = self.latest()
            kept = f"the previous checkpoint {previous} is whole" if previous else \
                "no earlier checkpoint exists"
            raise CheckpointWriteFailed(
                f"could not write checkpoint {final.name} in {self.directory}: {_why(error)}; "
                f"{kept}; free space or fix the quota or permissions, then continue with "
                "--resume auto") from error
        finally:
            in_flight = sys.exc_info()[1]
            for values in [weights or iter(()), *(whole or {}).values()]:
                drain(values, quietly=in_flight is not None)
        return self._move_into_place(partial, final)

    def _move_into_place(self, partial: Path, final: Path) -> Checkpoint:
        if final.exists():  # a re-run of the same epoch: keep the old one until the swap
            stale = self.directory / f".stale-{final.name}-{os.getpid()}"
            os.rename(final, stale)
            os.rename(partial, final)
            shutil.rmtree(stale)
        else:
            os.rename(partial, final)
        _fsync_tree(self.directory)
        for old in self.complete()[:-self.keep]:
            shutil.rmtree(old.path)
        return Checkpoint(final)

    def _recover_leftovers(self) -> None:
        """After a crash mid-write: drop partial checkpoints; put back a replaced checkpoint
        whose replacement never landed (a crash between the two renames of a swap)."""
        for partial in self.directory.glob(".partial-*"):
            shutil.rmtree(partial, ignore_errors=True)
        for stale in self.directory.glob(".stale-*"):
            name = CHECKPOINT_NAME.search(stale.name)
            original = self.directory / name.group(0) if name else None
            if original is not None and not original.exists():
                os.rename(stale, original)
            else:
                shutil.rmtree(stale, ignore_errors=True)

    def newest_intact(self, report: Callable[[str], None]) -> Checkpoint | None:
        """The newest checkpoint whose files match the checksums in its state. Each damaged
        newer one is set aside and reported. Raises CheckpointError, changing nothing, when
        checkpoints exist but none is intact."""
        found = self.complete()
        damaged = []
        for checkpoint in reversed(found):
            problem = checkpoint.damage()
            if problem is None:
                for bad, why in damaged:
                    aside = self.set_aside(bad)
                    report(f"checkpoint {bad} is damaged ({why}); set aside as {aside.name}, "
                           f"resuming from {checkpoint.name}")
                return checkpoint
            damaged.append((checkpoint, problem))
        if found:
            raise CheckpointError(f"no intact checkpoint in {self.directory} (" + "; ".join(
                f"{bad.name}: {why}" for bad, why in damaged) + "); start a new --run-dir")
        return None

    def set_aside(self, checkpoint: Checkpoint) -> Path:
        """Rename a damaged checkpoint ``.damaged-NAME`` (replacing an earlier one of that
        name): kept for inspection, never listed or loaded again."""
        aside = self.directory / f".damaged-{checkpoint.name}"
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(checkpoint.path, aside)
        return aside
