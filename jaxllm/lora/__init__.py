"""LoRA adapters: the request naming one (:class:`LoRARequest`, light, imported by the front end) and the PEFT
folder reader (:mod:`jaxllm.lora.peft`, numpy only). The device slots live in ``jaxllm.worker.lora``."""

from jaxllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
