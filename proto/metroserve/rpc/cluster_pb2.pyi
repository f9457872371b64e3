from metroserve.rpc import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RequestLimits(_message.Message):
    __slots__ = ("vocab_size", "max_model_len", "max_num_seqs", "block_size", "num_blocks")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    block_size: int
    num_blocks: int
    def __init__(self, vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class RunningPlacement(_message.Message):
    __slots__ = ("placement_id", "request_id", "gateway_id", "base_index", "num_seqs")
    PLACEMENT_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    placement_id: str
    request_id: str
    gateway_id: str
    base_index: int
    num_seqs: int
    def __init__(self, placement_id: _Optional[str] = ..., request_id: _Optional[str] = ..., gateway_id: _Optional[str] = ..., base_index: _Optional[int] = ..., num_seqs: _Optional[int] = ...) -> None: ...

class Register(_message.Message):
    __slots__ = ("worker_id", "epoch", "model", "limits", "pid", "host", "address", "running")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    model: str
    limits: RequestLimits
    pid: int
    host: str
    address: str
    running: _containers.RepeatedCompositeFieldContainer[RunningPlacement]
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., model: _Optional[str] = ..., limits: _Optional[_Union[RequestLimits, _Mapping]] = ..., pid: _Optional[int] = ..., host: _Optional[str] = ..., address: _Optional[str] = ..., running: _Optional[_Iterable[_Union[RunningPlacement, _Mapping]]] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ...) -> None: ...

class PlacementOutput(_message.Message):
    __slots__ = ("placement_id", "num_cached_tokens", "seqs", "request_id", "base_index", "num_tokens", "prompt_logprobs")
    PLACEMENT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    placement_id: str
    num_cached_tokens: int
    seqs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.SequenceDelta]
    request_id: str
    base_index: int
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprobs]
    def __init__(self, placement_id: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., seqs: _Optional[_Iterable[_Union[_generation_pb2.SequenceDelta, _Mapping]]] = ..., request_id: _Optional[str] = ..., base_index: _Optional[int] = ..., num_tokens: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class Rejection(_message.Message):
    __slots__ = ("placement_id", "message", "param")
    PLACEMENT_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    placement_id: str
    message: str
    param: str
    def __init__(self, placement_id: _Optional[str] = ..., message: _Optional[str] = ..., param: _Optional[str] = ...) -> None: ...

class PlacementFinish(_message.Message):
    __slots__ = ("placement_id", "finish_reasons", "num_tokens", "num_cached_tokens")
    PLACEMENT_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    placement_id: str
    finish_reasons: _containers.RepeatedScalarFieldContainer[str]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    def __init__(self, placement_id: _Optional[str] = ..., finish_reasons: _Optional[_Iterable[str]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("register", "rejected", "load", "blocks_stored", "blocks_removed", "draining", "handed_back", "finished")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    HANDED_BACK_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    register: Register
    rejected: _containers.RepeatedCompositeFieldContainer[Rejection]
    load: LoadReport
    blocks_stored: _containers.RepeatedScalarFieldContainer[bytes]
    blocks_removed: _containers.RepeatedScalarFieldContainer[bytes]
    draining: bool
    handed_back: _containers.RepeatedScalarFieldContainer[str]
    finished: _containers.RepeatedCompositeFieldContainer[PlacementFinish]
    def __init__(self, register: _Optional[_Union[Register, _Mapping]] = ..., rejected: _Optional[_Iterable[_Union[Rejection, _Mapping]]] = ..., load: _Optional[_Union[LoadReport, _Mapping]] = ..., blocks_stored: _Optional[_Iterable[bytes]] = ..., blocks_removed: _Optional[_Iterable[bytes]] = ..., draining: _Optional[bool] = ..., handed_back: _Optional[_Iterable[str]] = ..., finished: _Optional[_Iterable[_Union[PlacementFinish, _Mapping]]] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("placement_id", "prompt_token_ids", "resume_token_ids", "params", "priority", "cache_salt", "trace_context", "request_id", "gateway_id", "base_index")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PLACEMENT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_INDEX_FIELD_NUMBER: _ClassVar[int]
    placement_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _generation_pb2.SamplingParams
    priority: int
    cache_salt: str
    trace_context: _containers.ScalarMap[str, str]
    request_id: str
    gateway_id: str
    base_index: int
    def __init__(self, placement_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., request_id: _Optional[str] = ..., gateway_id: _Optional[str] = ..., base_index: _Optional[int] = ...) -> None: ...

class PlacementEnd(_message.Message):
    __slots__ = ("placement_id", "finish_reasons", "num_tokens")
    PLACEMENT_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    placement_id: str
    finish_reasons: _containers.RepeatedScalarFieldContainer[str]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, placement_id: _Optional[str] = ..., finish_reasons: _Optional[_Iterable[str]] = ..., num_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class SchedulerMessage(_message.Message):
    __slots__ = ("assign", "end", "heartbeat_interval_s", "report_interval_s")
    ASSIGN_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    REPORT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    assign: _containers.RepeatedCompositeFieldContainer[Assignment]
    end: _containers.RepeatedCompositeFieldContainer[PlacementEnd]
    heartbeat_interval_s: float
    report_interval_s: float
    def __init__(self, assign: _Optional[_Iterable[_Union[Assignment, _Mapping]]] = ..., end: _Optional[_Iterable[_Union[PlacementEnd, _Mapping]]] = ..., heartbeat_interval_s: _Optional[float] = ..., report_interval_s: _Optional[float] = ...) -> None: ...

class Submission(_message.Message):
    __slots__ = ("request", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request: _generation_pb2.GenerateRequest
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, request: _Optional[_Union[_generation_pb2.GenerateRequest, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GatewayRegister(_message.Message):
    __slots__ = ("gateway_id", "in_flight")
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    gateway_id: str
    in_flight: _containers.RepeatedCompositeFieldContainer[Submission]
    def __init__(self, gateway_id: _Optional[str] = ..., in_flight: _Optional[_Iterable[_Union[Submission, _Mapping]]] = ...) -> None: ...

class ResumeState(_message.Message):
    __slots__ = ("placement_id", "tokens", "finish_reasons")
    PLACEMENT_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    placement_id: str
    tokens: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenIds]
    finish_reasons: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, placement_id: _Optional[str] = ..., tokens: _Optional[_Iterable[_Union[_generation_pb2.TokenIds, _Mapping]]] = ..., finish_reasons: _Optional[_Iterable[str]] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("request_id", "finish_reasons", "num_tokens", "num_cached_tokens", "held_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HELD_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    finish_reasons: _containers.RepeatedScalarFieldContainer[str]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    held_s: float
    def __init__(self, request_id: _Optional[str] = ..., finish_reasons: _Optional[_Iterable[str]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ..., held_s: _Optional[float] = ...) -> None: ...

class GatewayMessage(_message.Message):
    __slots__ = ("register", "submit", "abort", "resume", "completed")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    register: GatewayRegister
    submit: _containers.RepeatedCompositeFieldContainer[Submission]
    abort: _containers.RepeatedCompositeFieldContainer[_generation_pb2.AbortRequest]
    resume: _containers.RepeatedCompositeFieldContainer[ResumeState]
    completed: _containers.RepeatedCompositeFieldContainer[Completion]
    def __init__(self, register: _Optional[_Union[GatewayRegister, _Mapping]] = ..., submit: _Optional[_Iterable[_Union[Submission, _Mapping]]] = ..., abort: _Optional[_Iterable[_Union[_generation_pb2.AbortRequest, _Mapping]]] = ..., resume: _Optional[_Iterable[_Union[ResumeState, _Mapping]]] = ..., completed: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ...) -> None: ...

class RequestStatus(_message.Message):
    __slots__ = ("request_id", "code", "message", "retry_after_s", "param")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: str
    message: str
    retry_after_s: int
    param: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[str] = ..., message: _Optional[str] = ..., retry_after_s: _Optional[int] = ..., param: _Optional[str] = ...) -> None: ...

class ResumeQuery(_message.Message):
    __slots__ = ("placement_id", "request_id", "base_index", "num_seqs")
    PLACEMENT_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    placement_id: str
    request_id: str
    base_index: int
    num_seqs: int
    def __init__(self, placement_id: _Optional[str] = ..., request_id: _Optional[str] = ..., base_index: _Optional[int] = ..., num_seqs: _Optional[int] = ...) -> None: ...

class WorkerEndpoint(_message.Message):
    __slots__ = ("worker_id", "epoch", "address")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    address: str
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class GatewayControl(_message.Message):
    __slots__ = ("status", "resume", "workers_changed", "workers", "models", "requests_waiting")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    WORKERS_CHANGED_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    status: _containers.RepeatedCompositeFieldContainer[RequestStatus]
    resume: _containers.RepeatedCompositeFieldContainer[ResumeQuery]
    workers_changed: bool
    workers: _containers.RepeatedCompositeFieldContainer[WorkerEndpoint]
    models: _containers.RepeatedCompositeFieldContainer[_generation_pb2.ModelInfo]
    requests_waiting: bool
    def __init__(self, status: _Optional[_Iterable[_Union[RequestStatus, _Mapping]]] = ..., resume: _Optional[_Iterable[_Union[ResumeQuery, _Mapping]]] = ..., workers_changed: _Optional[bool] = ..., workers: _Optional[_Iterable[_Union[WorkerEndpoint, _Mapping]]] = ..., models: _Optional[_Iterable[_Union[_generation_pb2.ModelInfo, _Mapping]]] = ..., requests_waiting: _Optional[bool] = ...) -> None: ...

class Subscription(_message.Message):
    __slots__ = ("gateway_id",)
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    gateway_id: str
    def __init__(self, gateway_id: _Optional[str] = ...) -> None: ...

class TokenBatch(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[PlacementOutput]
    def __init__(self, outputs: _Optional[_Iterable[_Union[PlacementOutput, _Mapping]]] = ...) -> None: ...

class ClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "epoch", "pid", "host", "draining", "num_placed", "load", "num_index_blocks", "address")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    NUM_PLACED_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    NUM_INDEX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    pid: int
    host: str
    draining: bool
    num_placed: int
    load: LoadReport
    num_index_blocks: int
    address: str
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., pid: _Optional[int] = ..., host: _Optional[str] = ..., draining: _Optional[bool] = ..., num_placed: _Optional[int] = ..., load: _Optional[_Union[LoadReport, _Mapping]] = ..., num_index_blocks: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("workers", "queue_depth", "num_active_requests", "num_migrations", "num_rejected", "placements_by_worker", "placement_prefix_hit_tokens", "num_gateways", "num_admitted", "num_finished")
    class PlacementsByWorkerEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    NUM_ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_REJECTED_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_BY_WORKER_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_GATEWAYS_FIELD_NUMBER: _ClassVar[int]
    NUM_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    queue_depth: int
    num_active_requests: int
    num_migrations: int
    num_rejected: int
    placements_by_worker: _containers.ScalarMap[str, int]
    placement_prefix_hit_tokens: int
    num_gateways: int
    num_admitted: int
    num_finished: int
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., queue_depth: _Optional[int] = ..., num_active_requests: _Optional[int] = ..., num_migrations: _Optional[int] = ..., num_rejected: _Optional[int] = ..., placements_by_worker: _Optional[_Mapping[str, int]] = ..., placement_prefix_hit_tokens: _Optional[int] = ..., num_gateways: _Optional[int] = ..., num_admitted: _Optional[int] = ..., num_finished: _Optional[int] = ...) -> None: ...
