"""``SpeculativeConfig``: which proposer drafts tokens and how many (vLLM's ``speculative_config`` dict)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

from jaxllm.json_config import dataclass_from_json

METHODS = ("ngram", "draft_model")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings, named as vLLM's ``speculative_config`` keys.

    Attributes:
      method: "ngram" (prompt lookup) or "draft_model" (a smaller model, same vocabulary, greedy).
      num_speculative_tokens: drafts per decode step, >= 1.
      prompt_lookup_min, prompt_lookup_max: n-gram sizes (ngram only; one alone sets both, default 5).
      model: the draft model's path (draft_model only).

    Raises:
      ValueError: an unknown method or key, a value out of range (named), a missing or extra ``model``.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: Optional[int] = None
    prompt_lookup_max: Optional[int] = None
    model: Optional[str] = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method={self.method!r} must be one of {list(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config num_speculative_tokens={k!r} must be an int >= 1")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError(f"speculative_config model={self.model!r} is for method 'draft_model', not 'ngram'")
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                value = getattr(self, name)
                if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                    raise ValueError(f"speculative_config {name}={value!r} must be an int >= 1")
            low = self.prompt_lookup_min if self.prompt_lookup_min is not None else self.prompt_lookup_max
            high = self.prompt_lookup_max if self.prompt_lookup_max is not None else self.prompt_lookup_min
            low, high = (5, 5) if low is None else (low, high)
            if low > high:
                raise ValueError(f"speculative_config prompt_lookup_min={low} exceeds prompt_lookup_max={high}")
            object.__setattr__(self, "prompt_lookup_min", low)
            object.__setattr__(self, "prompt_lookup_max", high)
        else:
            if not self.model:
                raise ValueError("speculative_config method 'draft_model' needs model (a path to the draft model)")
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise ValueError("speculative_config prompt_lookup_min/max are for method 'ngram', not 'draft_model'")
            object.__setattr__(self, "model", str(self.model))

    @classmethod
    def parse(cls, value: Union["SpeculativeConfig", dict[str, Any], str, None]) -> Optional["SpeculativeConfig"]:
        """A config from a dict, its JSON text (the CLI's ``--speculative-config``), or itself; None stays None.

        Raises:
          ValueError: bad JSON, a key that is not a field, or a bad value (see the class).
        """
        return dataclass_from_json(cls, value, "speculative_config", required=("method", "num_speculative_tokens"))
