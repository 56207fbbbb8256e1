"""Host-side scheduler for jaxllm: requests, paged KV blocks, continuous batching. Pure Python and numpy (plus
xxhash); never imports JAX or jaxllm."""

from scheduler.batch import BatchDescriptor, build_batch
from scheduler.buckets import BucketTable, geometric_ladder
from scheduler.config import SchedulerConfig
from scheduler.degradation import DegradationController, GracefulDegradation
from scheduler.diagnostics import kv_cache_report
from scheduler.kv.block_pool import BlockPool, FreeBlockQueue, KVBlock
from scheduler.kv.kv_cache_manager import KVCacheManager
from scheduler.output import ScheduledRequest, SchedulerOutput, SchedulerStats
from scheduler.persistent_batch import PersistentBatch
from scheduler.policy import (
    AgingPolicy, FCFSPolicy, LoadAwarePolicy, Policy, PredictedPolicy, PriorityPolicy, SJFPolicy, get_policy,
)
from scheduler.predictor import OutputLengthPredictor
from scheduler.request import Request, RequestStatus
from scheduler.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from scheduler.scheduler import Scheduler, UnknownRequestError

__all__ = [
    "AgingPolicy",
    "BatchDescriptor",
    "BlockPool",
    "BucketTable",
    "DegradationController",
    "FCFSPolicy",
    "FreeBlockQueue",
    "GracefulDegradation",
    "KVBlock",
    "KVCacheManager",
    "LoadAwarePolicy",
    "OutputLengthPredictor",
    "PersistentBatch",
    "Policy",
    "PredictedPolicy",
    "PriorityPolicy",
    "Request",
    "RequestOutputKind",
    "RequestStatus",
    "SJFPolicy",
    "SamplingParams",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "StructuredOutputsParams",
    "UnknownRequestError",
    "build_batch",
    "geometric_ladder",
    "get_policy",
    "kv_cache_report",
]
