"""The two sets of programs the harness runs, in the order every job runs them."""

from __future__ import annotations

from keras_examples import PROGRAMS as KERAS
from programs.harness import Spec
from user_programs import PROGRAMS as USER

# One job runs both sets, so a name may mean one program only.
assert not set(KERAS) & set(USER), set(KERAS) & set(USER)
SETS: dict[str, dict[str, Spec]] = {"keras": KERAS, "user": USER}
ALL: dict[str, Spec] = {**KERAS, **USER}
