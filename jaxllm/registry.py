"""Architectures registered from outside jaxllm, and the plugins that register them (vLLM's ``ModelRegistry``
and ``vllm.general_plugins``: entry points ``jaxllm.general_plugins``, filtered by ``$JAXLLM_PLUGINS``).
Imports no JAX, so a front end can replay registrations in its core processes.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
from importlib.metadata import entry_points
from typing import Any, Optional

PLUGIN_GROUP = "jaxllm.general_plugins"
PLUGINS_ENV = "JAXLLM_PLUGINS"


@dataclasses.dataclass(frozen=True)
class Registration:
    """One registered architecture: ``model_type``, its ``family`` (a ``Family`` or ``"module:attr"``) and the
    ``hf_architectures`` that select it (none: any config of this ``model_type``).
    """

    model_type: str
    family: Any
    hf_architectures: tuple[str, ...] = ()

    def import_string(self) -> str:
        """``"module:attr"`` under which another process finds this family. Raises ValueError: none holds it."""
        if isinstance(self.family, str):
            return self.family
        module = getattr(self.family.layer, "__module__", None)
        holder = sys.modules.get(module) if module != "__main__" else None
        found = [name for name, value in vars(holder).items() if value is self.family] if holder else []
        if not found:
            raise ValueError(
                f"register_model({self.model_type!r}, ...): the family object is not an attribute of an importable "
                f"module (its layer is defined in {module!r}), so the engine-core processes (jaxllm serve, "
                "data_parallel_size > 1) cannot import it; define it in a module and register it as "
                "'module:attr', or run the core in this process (LLM with data_parallel_size=1)")
        return f"{module}:{found[0]}"


_REGISTERED: dict[str, Registration] = {}
# model_type -> the object its import string named, once imported.
_IMPORTED: dict[str, Any] = {}
_plugins_loaded = False


def add(registration: Registration) -> None:
    """Record ``registration``, replacing an earlier one of its ``model_type``."""
    _REGISTERED[registration.model_type] = registration
    _IMPORTED.pop(registration.model_type, None)


def registered(model_type: str) -> Optional[Registration]:
    """The registration of ``model_type``, None when nothing registered it."""
    return _REGISTERED.get(model_type)


def registrations() -> list[Registration]:
    """Every registration, in the order made."""
    return list(_REGISTERED.values())


def architecture_owner(architecture: str) -> Optional[str]:
    """The registered ``model_type`` that lists ``architecture``, or None."""
    return next((r.model_type for r in _REGISTERED.values() if architecture in r.hf_architectures), None)


def resolve_family(model_type: str) -> Any:
    """The registered family object of ``model_type`` (its import string imported now, once).
    Raises KeyError: nothing registered; ValueError: an import string that fails (module and attribute named)."""
    registration = _REGISTERED[model_type]
    if not isinstance(registration.family, str):
        return registration.family
    if model_type not in _IMPORTED:
        module, _, attr = registration.family.partition(":")
        try:
            _IMPORTED[model_type] = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"model_type {model_type!r} is registered as {registration.family!r}, which does not "
                             f"import: {type(e).__name__}: {e}") from None
    return _IMPORTED[model_type]


def registrations_json() -> str:
    """Every registration as JSON of import strings, for an engine-core process (:func:`replay_registrations`).
    Raises ValueError: a family object no importable module holds."""
    return json.dumps([[r.model_type, r.import_string(), list(r.hf_architectures)] for r in _REGISTERED.values()])


def replay_registrations(text: str) -> None:
    """Make in this process the registrations :func:`registrations_json` wrote in another."""
    for model_type, family, archs in json.loads(text):
        add(Registration(model_type, family, tuple(archs)))


def load_general_plugins() -> None:
    """Call every ``jaxllm.general_plugins`` entry point (filtered by ``$JAXLLM_PLUGINS``) once per process."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    allowed = os.environ.get(PLUGINS_ENV)
    names = None if allowed is None else {n.strip() for n in allowed.split(",") if n.strip()}
    for plugin in entry_points(group=PLUGIN_GROUP):
        if names is None or plugin.name in names:
            try:
                plugin.load()()
            except Exception as e:
                raise RuntimeError(f"jaxllm plugin {plugin.name!r} ({plugin.value}) failed: "
                                   f"{type(e).__name__}: {e}") from e
