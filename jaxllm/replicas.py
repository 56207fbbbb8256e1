"""Data parallelism: several engine replicas behind one engine interface.

Each replica is a whole ``LLMEngine`` (scheduler, KV cache, compiled steps)
on its own row of the ``(data, model)`` mesh, so replicas share nothing but
the host process. A new request goes to the replica holding the longest
cached prefix of its prompt (when prefix caching is on), ties broken by the
fewest unfinished requests; vLLM's data-parallel router and SGLang's
cache-aware router make the same two choices. Replicas step concurrently from
a thread pool: a step spends most of its time in XLA, which releases the GIL.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Optional, Sequence, Union

from jaxllm.config import EngineConfig
from jaxllm.engine import LLMEngine, PromptType
from jaxllm.outputs import RequestOutput
from jaxllm.sharding import make_mesh, replica_meshes
from jaxllm.tokenizer import Tokenizer
from scheduler import Request, SamplingParams


def cached_prefix_tokens(engine: LLMEngine, token_ids: Sequence[int], cache_salt: Optional[str] = None) -> int:
    """Prompt tokens ``engine`` would take from its prefix cache right now.

    Asks the replica's ``KVCacheManager.get_computed_blocks`` about a
    throwaway request, so the answer follows the scheduler's own rule (hash ->
    block map, the last token always computed); nothing is allocated.
    """
    probe = Request("prefix-probe", list(token_ids), SamplingParams(), cache_salt=cache_salt)
    return engine.scheduler.kv_cache_manager.get_computed_blocks(probe)[1]


class ReplicatedEngine:
    """``data_parallel_size`` LLMEngine replicas with the LLMEngine interface.

    Args:
      model: as for ``LLMEngine``; every replica loads its own copy onto its
        devices (each device reading only its slice).
      tokenizer: as for ``LLMEngine``.
      **kwargs: ``EngineConfig`` fields; ``data_parallel_size`` replicas of
        ``tensor_parallel_size`` devices each.

    Attributes:
      replicas: the engines, replica ``d`` on row ``d`` of the mesh.
      routed: request_id -> replica index of every unfinished request.
      num_routed: requests each replica has been given so far.

    Raises:
      ValueError: as ``LLMEngine``, or fewer devices than
        ``data_parallel_size * tensor_parallel_size``.
    """

    def __init__(self, model: Union[str, os.PathLike], tokenizer: Optional[Tokenizer] = None, **kwargs: Any):
        self.config = EngineConfig(**kwargs)
        mesh = make_mesh(self.config.tensor_parallel_size, self.config.data_parallel_size)
        replica_kwargs = {**kwargs, "data_parallel_size": 1}
        self.replicas = [LLMEngine(model, tokenizer, mesh=m, **replica_kwargs) for m in replica_meshes(mesh)]
        self.routed: dict[str, int] = {}
        self.num_routed = [0] * len(self.replicas)
        self._pool = ThreadPoolExecutor(max_workers=len(self.replicas), thread_name_prefix="jaxllm-replica")

    @property
    def tokenizer(self) -> Optional[Tokenizer]:
        """The shared tokenizer (replica 0's)."""
        return self.replicas[0].tokenizer

    @property
    def model_config(self):
        """The model's ``ModelConfig`` (the same in every replica)."""
        return self.replicas[0].model_config

    def choose_replica(self, token_ids: Sequence[int], cache_salt: Optional[str] = None) -> int:
        """Index of the replica a request with ``token_ids`` goes to: most
        cached prefix tokens first, then fewest unfinished requests, then lowest index."""
        def key(i: int) -> tuple[int, int, int]:
            engine = self.replicas[i]
            return (-cached_prefix_tokens(engine, token_ids, cache_salt),
                    engine.scheduler.num_unfinished_requests, i)

        return min(range(len(self.replicas)), key=key)

    def add_request(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams] = None,
                    **kwargs: Any) -> None:
        """Route and queue a request (``LLMEngine.add_request``'s arguments).

        Raises:
          ValueError: as ``LLMEngine.add_request``; a duplicate ``request_id``
            across all replicas.
        """
        if request_id in self.routed:
            raise ValueError(f"request_id {request_id!r} is already in use")
        _, ids = self.replicas[0].encode_prompt(prompt)
        index = self.choose_replica(ids, kwargs.get("cache_salt"))
        self.replicas[index].add_request(request_id, prompt, params, **kwargs)
        self.routed[request_id] = index
        self.num_routed[index] += 1

    def abort_request(self, request_id: Union[str, Iterable[str]]) -> None:
        """Abort requests in whichever replica holds them; their blocks are freed at once."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            index = self.routed.pop(rid, None)
            if index is not None:
                self.replicas[index].abort_request(rid)

    def wait_for_warmup(self, timeout: Optional[float] = None) -> bool:
        """Wait until every replica has built every step program (``LLMEngine.wait_for_warmup``)."""
        return all([engine.wait_for_warmup(timeout) for engine in self.replicas])

    def has_unfinished_requests(self) -> bool:
        """True while any replica has unfinished requests."""
        return any(engine.has_unfinished_requests() for engine in self.replicas)

    def step(self) -> list[RequestOutput]:
        """One step of every replica with work, concurrently; their outputs together."""
        busy = [engine for engine in self.replicas if engine.has_unfinished_requests()]
        outputs = [out for outs in self._pool.map(LLMEngine.step, busy) for out in outs]
        for out in outputs:
            if out.finished:
                self.routed.pop(out.request_id, None)
        return outputs
