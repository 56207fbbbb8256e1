"""Config dataclasses given as a dict, as that dict's JSON text (a CLI flag's value) or as themselves."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence, TypeVar

T = TypeVar("T")


def dataclass_from_json(cls: type[T], value: Any, name: str, required: Sequence[str] = ()) -> T | None:
    """``cls`` (a dataclass) from ``value``: an instance, a dict of its fields or its JSON text; None stays None.

    ``name`` is the option named in errors; ``required`` the keys the dict must have.

    Raises:
      ValueError: bad JSON, not a dict, an unknown key (named with the fields), a missing required key, or
        what ``cls`` refuses.
    """
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} {value!r} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}={value!r} must be a dict (or its JSON)")
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ValueError(f"{name} has unknown field {unknown[0]!r}; the fields are {fields}")
    missing = [key for key in required if key not in value]
    if missing:
        raise ValueError(f"{name} needs {' and '.join(repr(k) for k in required)}")
    return cls(**value)
