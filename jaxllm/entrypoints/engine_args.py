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


class EngineArgs:
    """vLLM's ``EngineArgs``: a model and the engine's keywords, checked when made, from which
    ``LLMEngine.from_engine_args`` builds an engine (``AsyncLLM.from_engine_args`` from :class:`AsyncEngineArgs`).

    Args:
      model: as ``LLMEngine``'s (None: the default model). tokenizer: a path or name, or None (the model's).
      served_model_name: the model's name in the metrics (None: ``model``).
      **kwargs: ``EngineConfig`` fields and vLLM's ``EngineArgs`` keywords
        (``jaxllm.entrypoints.vllm_flags.vllm_engine_kwargs``).

    Attributes: ``model``, ``tokenizer``, ``served_model_name``, each keyword given, and every other
    ``EngineConfig`` field (its default).

    Raises:
      TypeError: a keyword neither an ``EngineConfig`` field nor one of vLLM's, or a server flag (named).
      ValueError: a value out of range or refused (named).
    """

    def __init__(self, model: Optional[str] = None, tokenizer: Optional[str] = None,
                 served_model_name: Optional[str] = None, **kwargs: Any) -> None:
        from jaxllm.config import EngineConfig
        from jaxllm.entrypoints.vllm_flags import vllm_engine_kwargs

        self.model, self.tokenizer, self.served_model_name = model, tokenizer, served_model_name
        self.kwargs = dict(kwargs)
        EngineConfig(**vllm_engine_kwargs(self.kwargs))  # refused now, as vLLM's dataclass refuses

    def __getattr__(self, name: str) -> Any:
        from jaxllm.config import EngineConfig

        kwargs = self.__dict__.get("kwargs", {})
        if name in kwargs:
            return kwargs[name]
        defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
        if name in defaults:
            return defaults[name]
        raise AttributeError(f"{type(self).__name__} has no {name!r}")

    def engine_kwargs(self) -> dict[str, Any]:
        """The keywords ``LLMEngine`` / ``AsyncLLM`` / ``LLM`` take for these arguments."""
        return {"model": self.model, "tokenizer": self.tokenizer, "served_model_name": self.served_model_name,
                **self.kwargs}

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add the engine's flags to ``parser`` (every ``EngineConfig`` field, and vLLM's flags by their rules,
        ``--model`` among them), as vLLM's ``EngineArgs.add_cli_args``; returns ``parser``."""
        from jaxllm.entrypoints.vllm_flags import add_vllm_flags

        add_engine_args(parser)
        add_vllm_flags(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """The arguments :meth:`add_cli_args`'s flags parsed into ``args`` (vLLM's flags applied first).
        Raises ValueError: a refused flag value or a contradiction, naming the flag."""
        from jaxllm.entrypoints.vllm_flags import apply_vllm_flags

        apply_vllm_flags(args)
        return cls(model=args.model, tokenizer=getattr(args, "tokenizer", None), **engine_kwargs(args, ("tokenizer",)))


class AsyncEngineArgs(EngineArgs):
    """vLLM's ``AsyncEngineArgs``: :class:`EngineArgs` for ``AsyncLLM.from_engine_args``; ``enable_log_requests``
    is accepted (the server's ``--enable-log-requests`` logs requests; ``AsyncLLM`` does not)."""

    def __init__(self, model: Optional[str] = None, tokenizer: Optional[str] = None,
                 served_model_name: Optional[str] = None, enable_log_requests: bool = False, **kwargs: Any) -> None:
        super().__init__(model, tokenizer, served_model_name, **kwargs)
        self.enable_log_requests = enable_log_requests
