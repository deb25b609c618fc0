"""A user's code named as ``package.module:function`` (models, data, optimizers, callbacks).

The module is imported on every rank from the ranks' ``PYTHONPATH``; the function is called by
the part of hvdtrain that asked for it. Import failures become one line naming the module.
"""

from __future__ import annotations

import importlib
import re
from typing import Callable

from hvdtrain.errors import UserError

PLUGIN = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


class PluginError(UserError):
    """A ``package.module:function`` cannot be imported or is not a function."""


def is_plugin(name: str) -> bool:
    """True for ``package.module:function``, the form every user hook takes."""
    return bool(PLUGIN.fullmatch(name))


def load_callable(path: str, what: str) -> Callable[..., object]:
    """The function ``path`` names; ``what`` says what it is for, in the error."""
    module_name, _, function_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any import failure is the user's to fix
        raise PluginError(f"cannot import {what} module '{module_name}' "
                          f"({type(error).__name__}: {error}); check the name and that it is "
                          "on PYTHONPATH") from error
    function = getattr(module, function_name, None)
    if not callable(function):
        raise PluginError(f"module '{module_name}' has no function '{function_name}'; give "
                          f"the {what} as package.module:function")
    return function


def load_callbacks(paths: list[str] | tuple[str, ...]) -> list[object]:
    """The Keras callbacks that each ``module:fn`` in ``paths`` returns (one or a list)."""
    import keras

    found: list[object] = []
    for path in paths:
        made = load_callable(path, "callbacks")()
        made = list(made) if isinstance(made, (list, tuple)) else [made]
        wrong = [type(c).__name__ for c in made if not isinstance(c, keras.callbacks.Callback)]
        if wrong:
            raise UserError(f"'{path}' returned {', '.join(wrong)}, not Keras callbacks; "
                            "return a list of keras.callbacks.Callback")
        found += made
    return found
