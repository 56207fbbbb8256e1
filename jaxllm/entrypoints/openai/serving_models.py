"""The models a server serves: its base model and the LoRA adapters over it (vLLM's ``OpenAIServingModels``).

Adapters come from ``--lora-modules`` at start-up and, when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true, from
``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``; a request's ``model`` names the base model or one of
them. Each loaded adapter gets a fresh ``lora_int_id`` (never reused, so no prefix-cache block of an unloaded
adapter is read for a later one).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import time
from typing import Any, Optional

from jaxllm.entrypoints.openai.protocol import APIError
from jaxllm.lora import LoRARequest

# vLLM's switch for the load / unload routes: they let any client make the server read a folder of its disk.
RUNTIME_LORA_UPDATING_VARIABLE = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating() -> bool:
    """Whether ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is "1" or "true" (any case), as vLLM reads it."""
    return os.environ.get(RUNTIME_LORA_UPDATING_VARIABLE, "0").strip().lower() in ("1", "true")


@dataclasses.dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry (vLLM's): the adapter's served ``name``, its PEFT folder ``path``, and vLLM's
    ``base_model_name`` (accepted; the server serves one base model, every adapter's ``parent``)."""

    name: str
    path: str
    base_model_name: Optional[str] = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """A ``--lora-modules`` value: ``name=path`` or JSON ``{"name", "path", "base_model_name"?}`` (vLLM's forms).

    Raises:
      argparse.ArgumentTypeError: neither form, or JSON without ``name`` and ``path`` (the value named).
    """
    if text.lstrip().startswith("{"):
        try:
            fields = json.loads(text)
            return LoRAModulePath(str(fields["name"]), str(fields["path"]), fields.get("base_model_name"))
        except (ValueError, KeyError, TypeError) as e:
            raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object with 'name' and 'path' ({e!r})")
    name, eq, path = text.partition("=")
    if not eq or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is neither name=path nor JSON {{\"name\": .., \"path\": ..}}")
    return LoRAModulePath(name, path)


class OpenAIServingModels:
    """The served base model and adapters; answers ``/v1/models`` and the adapter load / unload routes.

    Args:
      engine: the ``AsyncLLM`` (its ``add_lora`` / ``remove_lora``). base_model_name: ``--served-model-name``.
      root: the base model as given (its path or id; ``/v1/models``' ``root``). max_model_len: the engine's.
      lora_modules: the ``--lora-modules`` adapters, loaded by :meth:`init_static_loras`.
      aliases: more names of the base model (``--served-model-name``'s after the first), each served as it is.
    """

    def __init__(self, engine: Any, base_model_name: str, root: str, max_model_len: int,
                 lora_modules: tuple[LoRAModulePath, ...] = (), aliases: tuple[str, ...] = ()) -> None:
        self.engine, self.base_model_name, self.root = engine, base_model_name, root
        self.base_model_names = (base_model_name, *aliases)
        self.max_model_len, self.static_lora_modules = max_model_len, lora_modules
        self.lora_requests: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()
        self.created = int(time.time())

    async def init_static_loras(self) -> None:
        """Load the ``--lora-modules`` adapters. Raises ValueError: one fails (named, with why)."""
        for module in self.static_lora_modules:
            try:
                await self.load_lora_adapter(module.name, module.path)
            except APIError as e:
                raise ValueError(f"--lora-modules {module.name}={module.path}: {e.message}") from None

    def lora_request(self, model: Optional[str]) -> Optional[LoRARequest]:
        """The adapter a request's ``model`` names, None for the base model (or no ``model``).

        Raises:
          APIError: 404 for a name that is neither the base model nor a loaded adapter.
        """
        if model is None or model in self.base_model_names:
            return None
        found = self.lora_requests.get(model)
        if found is None:
            served = ", ".join(f"`{name}`" for name in (*self.base_model_names, *self.lora_requests))
            raise APIError(404, f"The model `{model}` does not exist; this server serves {served}.", "model",
                           "model_not_found")
        return found

    def model_name(self, model: Optional[str]) -> str:
        """The ``model`` a response names: the name its request gave (checked by :meth:`lora_request_for` when it
        started, so an adapter unloaded while the request runs is still named), else the base model's."""
        return model or self.base_model_name

    def show_available_models(self) -> dict:
        """``GET /v1/models``: the base model, then each adapter with ``parent`` (its base) and ``root`` (its path)."""
        cards = [{"id": name, "object": "model", "created": self.created, "owned_by": "jaxllm",
                  "root": self.root, "parent": None, "max_model_len": self.max_model_len}
                 for name in self.base_model_names]
        cards += [{"id": name, "object": "model", "created": self.created, "owned_by": "jaxllm",
                   "root": request.lora_path, "parent": self.base_model_name, "max_model_len": self.max_model_len}
                  for name, request in self.lora_requests.items()]
        return {"object": "list", "data": cards}

    async def load_lora_adapter(self, lora_name: str, lora_path: str, *, load_inplace: bool = False) -> str:
        """Read the PEFT folder ``lora_path`` into the engine and serve it as ``lora_name`` (vLLM's route).

        With ``load_inplace``, a loaded ``lora_name`` is replaced: new requests get the new folder, requests
        running under the old one finish under it.

        Returns:
          vLLM's success message.

        Raises:
          APIError: 400 for an empty name or path, a name already served (without ``load_inplace``), or an
            adapter the engine refuses (its message: rank above ``max_lora_rank``, an unknown target module, a
            PEFT option it does not run); 404 when no adapter is found at ``lora_path``.
        """
        if not lora_name or not lora_path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", "lora_name" if not lora_name
                           else "lora_path")
        async with self._lock:
            old = self.lora_requests.get(lora_name)
            if lora_name in self.base_model_names or (old is not None and not load_inplace):
                raise APIError(400, f"The lora adapter '{lora_name}' has already been loaded"
                                    + (" (it is the base model's name)." if old is None else
                                       "; set load_inplace to replace it."), "lora_name")
            request = LoRARequest(lora_name, next(self._ids), lora_path)
            if old is not None:
                await self.engine.remove_lora(old.lora_int_id)  # its name is free for the new adapter
            try:
                await self.engine.add_lora(request)
            except ValueError as e:
                if old is not None:
                    await self.engine.add_lora(old)
                not_found = "No adapter found" in str(e)
                raise APIError(404 if not_found else 400, str(e), "lora_path" if not_found else "lora_name",
                               "not_found" if not_found else None) from None
            self.lora_requests[lora_name] = request
        return f"Success: LoRA adapter '{lora_name}' added successfully."

    async def unload_lora_adapter(self, lora_name: Optional[str]) -> str:
        """Stop serving adapter ``lora_name`` and forget it in the engine; requests running under it finish
        under it (vLLM's route).

        Raises:
          APIError: 400 without a name, 404 for a name not loaded.
        """
        if not lora_name:
            raise APIError(400, "'lora_name' must be provided.", "lora_name")
        async with self._lock:
            request = self.lora_requests.pop(lora_name, None)
            if request is None:
                raise APIError(404, f"The lora adapter '{lora_name}' cannot be found.", "lora_name", "not_found")
            await self.engine.remove_lora(request.lora_int_id)
        return f"Success: LoRA adapter '{lora_name}' removed successfully."
