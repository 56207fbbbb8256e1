"""The adapter a request runs under (vLLM's ``vllm.lora.request.LoRARequest``)."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """A LoRA adapter for a request, as vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)``.

    Attributes:
      lora_name: the adapter's name (the served model name in the OpenAI server).
      lora_int_id: its id, an int >= 1, unique per adapter in one engine (0 is the base model).
      lora_path: a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``); "" for an adapter
        given as arrays (``LLM.update_lora``) and already known to the engine.

    Raises:
      ValueError: ``lora_int_id`` not an int >= 1, or an empty ``lora_name``.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id={self.lora_int_id!r} must be an int >= 1")
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest: lora_name={self.lora_name!r} must be a non-empty string")

    @property
    def name(self) -> str:
        """``lora_name`` (vLLM's alias)."""
        return self.lora_name

    @property
    def path(self) -> str:
        """``lora_path`` (vLLM's alias)."""
        return self.lora_path
