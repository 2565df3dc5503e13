"""A run's environment: a built-in (`builtin.py`) or a user's `module.path:Class` whose module
the deployment allows, exactly as user rewards are (services/tasks/reward_choice.py).

Importing code is never decided by a request alone: `check_allowed` refuses a module that is not
on the coordinator's allow list, and only `load` imports it (in an environment process, never in
the coordinator).
"""

import importlib
from collections.abc import Collection
from dataclasses import dataclass

from services.environments.builtin import BUILTIN_ENVIRONMENTS
from services.environments.protocol import Environment, check_environment
from services.tasks.base import TaskError
from services.tasks.reward_choice import describe


class EnvironmentNotAllowed(TaskError):
    """A user environment whose module is not on the deployment's allow list."""


class EnvironmentLoadError(TaskError):
    """A user environment that cannot be imported or built, or has not the protocol's shape."""


@dataclass(frozen=True)
class EnvironmentChoice:
    name: str  # a built-in's name, or module.path:Class

    @property
    def builtin(self) -> bool:
        return self.name in BUILTIN_ENVIRONMENTS

    @property
    def module(self) -> str | None:
        return None if self.builtin else self.name.partition(":")[0]

    def check_allowed(self, allowed: Collection[str]) -> None:
        """Raise EnvironmentNotAllowed unless a user environment's module is in `allowed`."""
        if self.module is not None and self.module not in allowed:
            raise EnvironmentNotAllowed(
                f"environment module {self.module!r} is not on the coordinator's allow list "
                "(SPOTRL_ENVIRONMENT_MODULES)"
            )

    def load(self) -> Environment:
        """The environment built with no arguments; imports a user class's module
        (EnvironmentLoadError when it cannot, or when what it builds lacks the protocol)."""
        factory = BUILTIN_ENVIRONMENTS.get(self.name) or import_class(self.name)
        try:
            env = factory()
        except Exception as exc:  # the user's constructor may raise anything
            raise EnvironmentLoadError(f"environment {self.name}: {describe(exc)}") from None
        problem = check_environment(env)
        if problem is not None:
            raise EnvironmentLoadError(f"environment {self.name}: {problem}")
        return env


def import_class(ref: str) -> type:
    """`module.path:Class` imported; EnvironmentLoadError saying what is missing."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise EnvironmentLoadError(f"environment {ref!r} is neither a built-in nor module:Class")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the module's own code may raise anything
        raise EnvironmentLoadError(f"environment module {module_name!r}: {describe(exc)}") from None
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise EnvironmentLoadError(f"environment module {module_name!r} has no class {attr!r}")
    return cls
