"""The sets of programs the harness runs, in the order every job runs them."""

from __future__ import annotations

from keras_examples import PROGRAMS as KERAS
from programs.harness import Spec
from user_programs import PROGRAMS as USER
from zero3_programs import PROGRAMS as ZERO3

# One job runs every set, so a name may mean one program only.
assert not set(KERAS) & set(USER), set(KERAS) & set(USER)
assert not (set(KERAS) | set(USER)) & set(ZERO3), (set(KERAS) | set(USER)) & set(ZERO3)
SETS: dict[str, dict[str, Spec]] = {"keras": KERAS, "user": USER, "zero3": ZERO3}
ALL: dict[str, Spec] = {**KERAS, **USER, **ZERO3}
