"""The NumPy archives a checkpoint is made of (``weights.npz``, ``optimizer.npz``), written and
read one array at a time, so neither a save nor a restore holds a second copy of the model or
of the optimizer's state (for ZeRO's stage 3, whose model fits a rank only in pieces, the
difference between fitting and not). No pickles: nothing in an archive is executed."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np


def write_npz(path: Path, arrays: Iterable[tuple[str, np.ndarray]]) -> None:
    """A NumPy archive as ``np.savez`` writes it, one array at a time as ``arrays`` yields
    them, so a checkpoint never holds a second copy of the model or the optimizer's state."""
    with zipfile.ZipFile(path, "w", allowZip64=True) as archive:
        for name, value in arrays:
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(value), allow_pickle=False)


def member_names(archive: Any, prefix: str) -> list[str]:
    """The names of a NumPy archive's arrays that are ``prefix`` and a number, in the order
    they were saved."""
    pattern = re.compile(re.escape(prefix) + r"\d{4,}")
    return [key for key in sorted(archive.files) if pattern.fullmatch(key)]


def arrays(path: Path, prefix: str) -> list[np.ndarray]:
    """The arrays of a NumPy archive whose names are ``prefix`` and a number, in the order they
    were saved (no pickles)."""
    with np.load(path, allow_pickle=False) as archive:
        return [archive[key] for key in member_names(archive, prefix)]


def assigned_one_at_a_time(path: Path, prefix: str, variables: Sequence[Any],
                           shapes: Sequence[tuple[int, ...]] | None = None) -> None:
    """Each of ``variables`` given its array of the archive (``prefix`` and a number), read
    one at a time, so a restore never holds a second copy of the model or of the optimizer's
    state. ``shapes``: what the arrays must be (default: the variables' shapes); a count or
    shape that does not fit raises ValueError before anything is assigned."""
    shapes = [tuple(v.shape) for v in variables] if shapes is None else shapes
    with np.load(path, allow_pickle=False) as archive:
        names = member_names(archive, prefix)
        saved = member_shapes(archive, prefix)
        if len(names) != len(variables) or any(
                tuple(s) != tuple(w) for s, w in zip(saved, shapes)):
            raise ValueError(f"{path.name} holds {len(names)} arrays under '{prefix}', "
                             f"{len(variables)} of other shapes expected")
        for variable, name in zip(variables, names):
            variable.assign(archive[name])


def member_shapes(archive: Any, prefix: str) -> list[tuple[int, ...]]:
    """The shapes of the archive's arrays under ``prefix``, in order, from their headers."""
    return [member_shape(archive, name) for name in member_names(archive, prefix)]


def member_shape(archive: Any, name: str) -> tuple[int, ...]:
    """An archived array's shape, from its header alone."""
    with archive.zip.open(f"{name}.npy") as member:
        major, _ = np.lib.format.read_magic(member)
        read = (np.lib.format.read_array_header_1_0 if major == 1 else
                np.lib.format.read_array_header_2_0)
        return tuple(read(member)[0])
