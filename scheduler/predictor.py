"""Predicted output lengths: what a request will generate, learned from the requests that shared its prefix."""

from __future__ import annotations

import collections

from scheduler.block_hash import extend_block_hashes
from scheduler.request import Request


class OutputLengthPredictor:
    """Predicts a request's output tokens at arrival from earlier finished requests sharing its prefix or salt.

    An exponential moving average is kept per key: the chained hashes of the prompt's first ``key_blocks`` full
    blocks (one key per depth), the ``cache_salt``, and a global one starting at ``prior_tokens``. A prediction uses
    the deepest key with history, bounded to ``[max(min_tokens, 1), max_tokens or what max_model_len leaves]``, and
    is that maximum when the request cannot stop early (``ignore_eos``, no stop ids or strings).

    Args:
      block_size: tokens per KV block, >= 1.
      key_blocks: prompt blocks the deepest key covers, >= 1.
      alpha: weight of a new observation, in (0, 1].
      prior_tokens: the global average before any finish, >= 1.
      max_keys: prefix and salt keys kept (LRU), >= 1.

    Attributes: num_observed (finished requests learned from), predicted_output_tokens, actual_output_tokens,
    abs_error_tokens (their sums, tokens). Raises ValueError naming an argument out of range.
    """

    def __init__(self, block_size: int, key_blocks: int = 4, alpha: float = 0.25, prior_tokens: float = 128.0,
                 max_keys: int = 4096) -> None:
        for name, value in (("block_size", block_size), ("key_blocks", key_blocks), ("max_keys", max_keys)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"OutputLengthPredictor: {name}={value!r} must be an int >= 1")
        if not 0 < alpha <= 1:
            raise ValueError(f"OutputLengthPredictor: alpha={alpha!r} must be in (0, 1]")
        if not prior_tokens >= 1:
            raise ValueError(f"OutputLengthPredictor: prior_tokens={prior_tokens!r} must be >= 1")
        self.block_size = block_size
        self.key_blocks = key_blocks
        self.alpha = alpha
        self.max_keys = max_keys
        self.global_mean = float(prior_tokens)
        self._history: collections.OrderedDict[bytes | str, float] = collections.OrderedDict()
        self.num_observed = 0
        self.predicted_output_tokens = 0
        self.actual_output_tokens = 0
        self.abs_error_tokens = 0

    def predict(self, request: Request) -> int:
        """Predicted output tokens of ``request`` in all (its ``length_limit`` must be set), in
        ``[1, length_limit - num_prompt_tokens]``."""
        sp = request.sampling_params
        most = max(request.length_limit - request.num_prompt_tokens, 1)
        if sp.ignore_eos and not sp.stop_token_ids and not sp.stop:
            return most
        mean = self.global_mean
        for key in self._keys(request):
            if key in self._history:
                self._history.move_to_end(key)
                mean = self._history[key]
                break
        return min(max(round(mean), sp.min_tokens, 1), most)

    def stats(self) -> dict[str, int]:
        """Its ``SchedulerStats`` fields."""
        return dict(num_predicted_finished=self.num_observed, predicted_output_tokens=self.predicted_output_tokens,
                    actual_output_tokens=self.actual_output_tokens, prediction_abs_error_tokens=self.abs_error_tokens)

    def observe(self, request: Request) -> None:
        """Learn from a finished ``request`` (stopped or length-capped) whose ``predicted_output_tokens`` is set."""
        predicted, actual = request.predicted_output_tokens, request.num_output_tokens
        self.num_observed += 1
        self.predicted_output_tokens += predicted
        self.actual_output_tokens += actual
        self.abs_error_tokens += abs(predicted - actual)
        self.global_mean += self.alpha * (actual - self.global_mean)
        history = self._history
        for key in self._keys(request):
            old = history.pop(key, None)
            history[key] = actual if old is None else old + self.alpha * (actual - old)
        while len(history) > self.max_keys:
            history.popitem(last=False)

    def _keys(self, request: Request) -> list[bytes | str]:
        """Its history keys, deepest first: prefix hashes of its first full blocks, then its salt."""
        bs = self.block_size
        depth = min(self.key_blocks, request.num_prompt_tokens // bs)
        hashes = request.block_hashes
        if len(hashes) < depth:
            # Prefix caching is off (or these blocks are not hashed yet): the same digests, computed here.
            hashes = []
            extend_block_hashes(hashes, request.prompt_token_ids, depth, bs, request.cache_salt, request.prompt_array)
        keys: list[bytes | str] = hashes[:depth][::-1]
        if request.cache_salt is not None:
            keys.append("salt:" + request.cache_salt)
        return keys
