"""Every ``EngineConfig`` field as a command-line flag (``--max-num-seqs 64``, ``--enable-prefix-caching`` /
``--no-enable-prefix-caching`` / ``--disable-prefix-caching``, ``--token-buckets 16 32 64``), read from the
dataclass so no field is missed."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from typing import Any, Optional, Union

from jaxllm.entrypoints.vllm_flags import Switch, human_readable_int


def _precompile(value: str) -> Union[bool, str]:
    choices = {"true": True, "false": False, "background": "background"}
    if value.lower() not in choices:
        raise argparse.ArgumentTypeError(f"invalid choice {value!r}: true, false or background")
    return choices[value.lower()]


def _length_or_auto(value: str) -> Optional[int]:
    """``--max-model-len``: a size (``32k``) or ``auto`` / ``-1`` (vLLM's: fit the model's length; None here)."""
    return None if value.strip().lower() in ("auto", "-1") else human_readable_int(value)


# Fields whose flags take vLLM's sizes (``8k``, ``1G``), as vLLM's parser reads them.
SIZE_FLAGS = {"max_model_len": _length_or_auto, "max_num_batched_tokens": human_readable_int,
              "kv_cache_memory_bytes": human_readable_int}


def _flag_type(hint: Any) -> dict[str, Any]:
    """argparse keyword arguments for a field's type."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if hint is bool or (typing.get_origin(hint) is Union and args == [bool]):  # bool or Optional[bool]
        return dict(action=Switch)
    if typing.get_origin(hint) is Union and set(args) == {bool, str}:
        return dict(type=_precompile, metavar="{true,false,background}")
    if typing.get_origin(hint) is Union and len(args) == 1:
        hint = args[0]
    if typing.get_origin(hint) is not None and typing.get_args(hint) == (int,):  # Sequence[int]
        return dict(type=int, nargs="+", metavar="N")
    return dict(type=hint if hint in (int, float) else str)


def field_help(name: str) -> str:
    """The help of ``EngineConfig.<name>``'s flag: its description and default, ``%`` escaped for argparse.
    Raises KeyError: not an ``EngineConfig`` field."""
    from jaxllm.config import EngineConfig, field_docs

    doc = {d.name: d for d in field_docs(EngineConfig)}[name]
    return f"{doc.description} (default: {doc.default})".replace("%", "%%")


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Add one flag per ``EngineConfig`` field (but those in ``skip``), defaulting to the field's default, with
    :func:`field_help` as its help."""
    from jaxllm.config import EngineConfig

    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine (EngineConfig fields)")
    for field in dataclasses.fields(EngineConfig):
        if field.name in skip:
            continue
        kind = dict(type=SIZE_FLAGS[field.name]) if field.name in SIZE_FLAGS else _flag_type(hints[field.name])
        group.add_argument(f"--{field.name.replace('_', '-')}", dest=field.name, default=field.default,
                           help=field_help(field.name), **kind)


def engine_kwargs(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The ``EngineConfig`` keyword arguments the parsed flags hold."""
    from jaxllm.config import EngineConfig

    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if f.name not in skip}


def check_engine_args(args: argparse.Namespace) -> Optional[str]:
    """The error ``EngineConfig`` raises for these flags, with flag names, or None when they are fine."""
    from jaxllm.config import EngineConfig

    try:
        EngineConfig(**engine_kwargs(args))
    except ValueError as e:
        names = "|".join(f.name for f in dataclasses.fields(EngineConfig))
        return re.sub(rf"\b({names})=", lambda m: f"--{m[1].replace('_', '-')} ", str(e))
    return None


class _EngineArgsCalls:
    """The calls of :class:`EngineArgs` (a dataclass made from ``EngineConfig``'s fields and vLLM's keywords)."""

    def __post_init__(self) -> None:
        from jaxllm.config import EngineConfig
        from jaxllm.entrypoints.vllm_flags import vllm_engine_kwargs

        EngineConfig(**vllm_engine_kwargs(self._engine_keywords()))  # refused now, as vLLM's dataclass refuses

    def _engine_keywords(self) -> dict[str, Any]:
        """The engine's keywords these arguments set: fields off their defaults, vLLM keywords not None."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in _OWN_FIELDS and getattr(self, f.name) != f.default}

    def engine_kwargs(self) -> dict[str, Any]:
        """The keywords ``LLMEngine`` / ``AsyncLLM`` / ``LLM`` take for these arguments."""
        return {"model": self.model, "tokenizer": self.tokenizer, "served_model_name": self.served_model_name,
                **self._engine_keywords()}

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add the engine's flags to ``parser`` (every ``EngineConfig`` field, and vLLM's flags by their rules,
        ``--model`` and ``--served-model-name`` among them), as vLLM's ``EngineArgs.add_cli_args``; returns
        ``parser``."""
        from jaxllm.entrypoints.vllm_flags import add_vllm_flags

        add_engine_args(parser)
        add_vllm_flags(parser)
        parser.add_argument("--served-model-name", nargs="+", default=None,
                            help="the model's name in the metrics (the first of those given)")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace):
        """The arguments :meth:`add_cli_args`'s flags parsed into ``args`` (vLLM's flags applied first).
        Raises ValueError: a refused flag value or a contradiction, naming the flag."""
        from jaxllm.entrypoints.vllm_flags import apply_vllm_flags

        apply_vllm_flags(args)
        names = getattr(args, "served_model_name", None)
        extra = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                 if f.name in _ASYNC_FIELDS and getattr(args, f.name, None) is not None}
        return cls(model=args.model, tokenizer=getattr(args, "tokenizer", None),
                   served_model_name=names[0] if isinstance(names, list) and names else names,
                   **engine_kwargs(args, ("tokenizer",)), **extra)


# EngineArgs' fields that are not engine keywords: the model and its names.
_OWN_FIELDS = ("model", "tokenizer", "served_model_name", "enable_log_requests")
# AsyncEngineArgs' own fields (vLLM's), which the server's flags of the same names set.
_ASYNC_FIELDS = ("enable_log_requests",)


def _engine_args_fields() -> list[tuple[str, Any, Any]]:
    """EngineArgs' fields: the model and its names, every ``EngineConfig`` field with its default, then each
    other keyword of vLLM's ``EngineArgs`` jaxllm takes (``vllm_flags`` rules), None or vLLM's default."""
    from jaxllm.config import EngineConfig
    from jaxllm.entrypoints.vllm_flags import LLM_RULES, RULES

    fields = [(name, Optional[str], dataclasses.field(default=None)) for name in _OWN_FIELDS[:3]]
    own = {f.name for f in dataclasses.fields(EngineConfig)}
    for f in dataclasses.fields(EngineConfig):
        if f.name != "tokenizer":
            fields.append((f.name, Any, dataclasses.field(default=f.default, metadata=f.metadata)))
    vllm = {name: rule for name, rule in {**RULES, **LLM_RULES}.items()
            if rule.engine and name not in own and name not in _OWN_FIELDS}
    fields += [(name, Any, dataclasses.field(default=_VLLM_DEFAULTS.get(name))) for name in vllm]
    return fields


# vLLM's EngineArgs defaults that are not None, for keywords jaxllm reads (LLM's generation_config).
_VLLM_DEFAULTS = {"generation_config": "auto"}


EngineArgs = dataclasses.make_dataclass("EngineArgs", _engine_args_fields(), bases=(_EngineArgsCalls,))
EngineArgs.__module__ = __name__
EngineArgs.__doc__ = """vLLM's ``EngineArgs``, a dataclass: ``model``, ``tokenizer``, ``served_model_name``, every
``EngineConfig`` field (its default) and each other keyword of vLLM's ``EngineArgs`` jaxllm takes (None: not given),
checked when made. ``LLMEngine.from_engine_args`` builds an engine from them (``AsyncLLM.from_engine_args`` from
:class:`AsyncEngineArgs`); ``LLM(**dataclasses.asdict(args))`` works as in vLLM.

Raises:
  TypeError: an unknown keyword. ValueError: a value out of range or refused (named).
"""

AsyncEngineArgs = dataclasses.make_dataclass(
    "AsyncEngineArgs", [("enable_log_requests", bool, dataclasses.field(default=False))], bases=(EngineArgs,))
AsyncEngineArgs.__module__ = __name__
AsyncEngineArgs.__doc__ = """vLLM's ``AsyncEngineArgs``: :class:`EngineArgs` for ``AsyncLLM.from_engine_args``, and
``enable_log_requests``, accepted (the server's ``--enable-log-requests`` logs requests; ``AsyncLLM`` does not)."""
