from google.protobuf import descriptor_pb2 as _descriptor_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Right(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RIGHT_UNSPECIFIED: _ClassVar[Right]
    VIEW: _ClassVar[Right]
    OPERATE: _ClassVar[Right]
    ADMINISTER: _ClassVar[Right]
    REGISTER: _ClassVar[Right]
    DRIVE: _ClassVar[Right]
    TRANSFER: _ClassVar[Right]
RIGHT_UNSPECIFIED: Right
VIEW: Right
OPERATE: Right
ADMINISTER: Right
REGISTER: Right
DRIVE: Right
TRANSFER: Right
REQUIRED_FIELD_NUMBER: _ClassVar[int]
required: _descriptor.FieldDescriptor

class ErrorDetail(_message.Message):
    __slots__ = ("code", "cause", "next_step", "fields")
    CODE_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    code: str
    cause: str
    next_step: str
    fields: _struct_pb2.Struct
    def __init__(self, code: _Optional[str] = ..., cause: _Optional[str] = ..., next_step: _Optional[str] = ..., fields: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class Resources(_message.Message):
    __slots__ = ("pid", "fds", "threads", "children", "zombies", "rss_bytes")
    PID_FIELD_NUMBER: _ClassVar[int]
    FDS_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    ZOMBIES_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    pid: int
    fds: int
    threads: int
    children: int
    zombies: int
    rss_bytes: int
    def __init__(self, pid: _Optional[int] = ..., fds: _Optional[int] = ..., threads: _Optional[int] = ..., children: _Optional[int] = ..., zombies: _Optional[int] = ..., rss_bytes: _Optional[int] = ...) -> None: ...

class Endpoint(_message.Message):
    __slots__ = ("host", "port")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ...) -> None: ...

class LinkState(_message.Message):
    __slots__ = ("name", "ip", "up")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IP_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    name: str
    ip: str
    up: bool
    def __init__(self, name: _Optional[str] = ..., ip: _Optional[str] = ..., up: _Optional[bool] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("job_id", "script", "script_args", "module", "python", "cwd", "env", "nnodes", "nproc_per_node", "policy", "recovery", "tenant", "provider_opt_out", "sealed")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SCRIPT_FIELD_NUMBER: _ClassVar[int]
    SCRIPT_ARGS_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    PYTHON_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    NNODES_FIELD_NUMBER: _ClassVar[int]
    NPROC_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_OPT_OUT_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    script: str
    script_args: _containers.RepeatedScalarFieldContainer[str]
    module: bool
    python: str
    cwd: str
    env: _containers.ScalarMap[str, str]
    nnodes: int
    nproc_per_node: int
    policy: Policy
    recovery: Recovery
    tenant: str
    provider_opt_out: bool
    sealed: bool
    def __init__(self, job_id: _Optional[str] = ..., script: _Optional[str] = ..., script_args: _Optional[_Iterable[str]] = ..., module: _Optional[bool] = ..., python: _Optional[str] = ..., cwd: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., nnodes: _Optional[int] = ..., nproc_per_node: _Optional[int] = ..., policy: _Optional[_Union[Policy, _Mapping]] = ..., recovery: _Optional[_Union[Recovery, _Mapping]] = ..., tenant: _Optional[str] = ..., provider_opt_out: _Optional[bool] = ..., sealed: _Optional[bool] = ...) -> None: ...

class DataKey(_message.Message):
    __slots__ = ("tenant", "key_id", "key")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    key_id: str
    key: bytes
    def __init__(self, tenant: _Optional[str] = ..., key_id: _Optional[str] = ..., key: _Optional[bytes] = ...) -> None: ...

class Policy(_message.Message):
    __slots__ = ("every_s", "auto", "every_steps", "keep", "keep_hourly_days", "keep_daily_days")
    EVERY_S_FIELD_NUMBER: _ClassVar[int]
    AUTO_FIELD_NUMBER: _ClassVar[int]
    EVERY_STEPS_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    KEEP_HOURLY_DAYS_FIELD_NUMBER: _ClassVar[int]
    KEEP_DAILY_DAYS_FIELD_NUMBER: _ClassVar[int]
    every_s: float
    auto: bool
    every_steps: int
    keep: int
    keep_hourly_days: float
    keep_daily_days: float
    def __init__(self, every_s: _Optional[float] = ..., auto: _Optional[bool] = ..., every_steps: _Optional[int] = ..., keep: _Optional[int] = ..., keep_hourly_days: _Optional[float] = ..., keep_daily_days: _Optional[float] = ...) -> None: ...

class Recovery(_message.Message):
    __slots__ = ("mode", "spares", "max_tries", "window_s", "hang_deadline_s")
    MODE_FIELD_NUMBER: _ClassVar[int]
    SPARES_FIELD_NUMBER: _ClassVar[int]
    MAX_TRIES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    HANG_DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    mode: str
    spares: _containers.RepeatedScalarFieldContainer[str]
    max_tries: int
    window_s: float
    hang_deadline_s: float
    def __init__(self, mode: _Optional[str] = ..., spares: _Optional[_Iterable[str]] = ..., max_tries: _Optional[int] = ..., window_s: _Optional[float] = ..., hang_deadline_s: _Optional[float] = ...) -> None: ...

class RankState(_message.Message):
    __slots__ = ("rank", "local_rank", "pid", "exit_code", "failed_first", "error", "error_time")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIRST_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_TIME_FIELD_NUMBER: _ClassVar[int]
    rank: int
    local_rank: int
    pid: int
    exit_code: int
    failed_first: bool
    error: str
    error_time: float
    def __init__(self, rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., pid: _Optional[int] = ..., exit_code: _Optional[int] = ..., failed_first: _Optional[bool] = ..., error: _Optional[str] = ..., error_time: _Optional[float] = ...) -> None: ...

class GpuInfo(_message.Message):
    __slots__ = ("uuid", "name", "memory")
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    name: str
    memory: int
    def __init__(self, uuid: _Optional[str] = ..., name: _Optional[str] = ..., memory: _Optional[int] = ...) -> None: ...

class GpuRecord(_message.Message):
    __slots__ = ("gpus", "processes", "state_bytes", "lock_s", "checkpoint_s")
    GPUS_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCK_S_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_S_FIELD_NUMBER: _ClassVar[int]
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    processes: int
    state_bytes: int
    lock_s: float
    checkpoint_s: float
    def __init__(self, gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ..., processes: _Optional[int] = ..., state_bytes: _Optional[int] = ..., lock_s: _Optional[float] = ..., checkpoint_s: _Optional[float] = ...) -> None: ...

class RankRecord(_message.Message):
    __slots__ = ("rank", "local_rank", "node_rank", "stream", "inodes", "init_cwd", "image_bytes", "dump_s", "gpu", "dump_start", "dump_end")
    class InodesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    INODES_FIELD_NUMBER: _ClassVar[int]
    INIT_CWD_FIELD_NUMBER: _ClassVar[int]
    IMAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DUMP_S_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    DUMP_START_FIELD_NUMBER: _ClassVar[int]
    DUMP_END_FIELD_NUMBER: _ClassVar[int]
    rank: int
    local_rank: int
    node_rank: int
    stream: str
    inodes: _containers.ScalarMap[str, int]
    init_cwd: str
    image_bytes: int
    dump_s: float
    gpu: GpuRecord
    dump_start: float
    dump_end: float
    def __init__(self, rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., node_rank: _Optional[int] = ..., stream: _Optional[str] = ..., inodes: _Optional[_Mapping[str, int]] = ..., init_cwd: _Optional[str] = ..., image_bytes: _Optional[int] = ..., dump_s: _Optional[float] = ..., gpu: _Optional[_Union[GpuRecord, _Mapping]] = ..., dump_start: _Optional[float] = ..., dump_end: _Optional[float] = ...) -> None: ...

class ChunkInfo(_message.Message):
    __slots__ = ("index", "key", "raw_size", "stored_size", "sha256", "raw_sha256", "xxh3")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    RAW_SIZE_FIELD_NUMBER: _ClassVar[int]
    STORED_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    RAW_SHA256_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    index: int
    key: str
    raw_size: int
    stored_size: int
    sha256: str
    raw_sha256: str
    xxh3: str
    def __init__(self, index: _Optional[int] = ..., key: _Optional[str] = ..., raw_size: _Optional[int] = ..., stored_size: _Optional[int] = ..., sha256: _Optional[str] = ..., raw_sha256: _Optional[str] = ..., xxh3: _Optional[str] = ...) -> None: ...

class StreamInfo(_message.Message):
    __slots__ = ("name", "raw_size", "chunk_size", "chunks", "chunking")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RAW_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHUNKING_FIELD_NUMBER: _ClassVar[int]
    name: str
    raw_size: int
    chunk_size: int
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkInfo]
    chunking: str
    def __init__(self, name: _Optional[str] = ..., raw_size: _Optional[int] = ..., chunk_size: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[ChunkInfo, _Mapping]]] = ..., chunking: _Optional[str] = ...) -> None: ...

class TransferProgress(_message.Message):
    __slots__ = ("node", "stream", "raw_bytes", "stored_bytes", "rate", "uploaded_bytes", "total_bytes")
    NODE_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RATE_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    node: str
    stream: str
    raw_bytes: int
    stored_bytes: int
    rate: float
    uploaded_bytes: int
    total_bytes: int
    def __init__(self, node: _Optional[str] = ..., stream: _Optional[str] = ..., raw_bytes: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., rate: _Optional[float] = ..., uploaded_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class LogChunk(_message.Message):
    __slots__ = ("rank", "offset", "data")
    RANK_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    rank: int
    offset: int
    data: bytes
    def __init__(self, rank: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class LogsRequest(_message.Message):
    __slots__ = ("job_id", "rank", "offset", "follow")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    offset: int
    follow: bool
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., offset: _Optional[int] = ..., follow: _Optional[bool] = ...) -> None: ...

class JobRef(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ProgressRequest(_message.Message):
    __slots__ = ("job_id", "peers")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    peers: bool
    def __init__(self, job_id: _Optional[str] = ..., peers: _Optional[bool] = ...) -> None: ...

class WaitRequest(_message.Message):
    __slots__ = ("job_id", "timeout_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    timeout_s: float
    def __init__(self, job_id: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class AgentInfo(_message.Message):
    __slots__ = ("node", "version", "pid", "host", "incarnation", "resources", "running_jobs", "gpu_faults", "cpus", "gpus")
    NODE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_JOBS_FIELD_NUMBER: _ClassVar[int]
    GPU_FAULTS_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    node: str
    version: str
    pid: int
    host: str
    incarnation: str
    resources: Resources
    running_jobs: _containers.RepeatedScalarFieldContainer[str]
    gpu_faults: _containers.RepeatedCompositeFieldContainer[GpuFault]
    cpus: int
    gpus: int
    def __init__(self, node: _Optional[str] = ..., version: _Optional[str] = ..., pid: _Optional[int] = ..., host: _Optional[str] = ..., incarnation: _Optional[str] = ..., resources: _Optional[_Union[Resources, _Mapping]] = ..., running_jobs: _Optional[_Iterable[str]] = ..., gpu_faults: _Optional[_Iterable[_Union[GpuFault, _Mapping]]] = ..., cpus: _Optional[int] = ..., gpus: _Optional[int] = ...) -> None: ...

class GpuFault(_message.Message):
    __slots__ = ("uuid", "kind", "code", "time", "fatal", "detail")
    UUID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    FATAL_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    kind: str
    code: int
    time: float
    fatal: bool
    detail: str
    def __init__(self, uuid: _Optional[str] = ..., kind: _Optional[str] = ..., code: _Optional[int] = ..., time: _Optional[float] = ..., fatal: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class PhaseEvent(_message.Message):
    __slots__ = ("phase", "snapshot_id", "targets", "stall_s", "bytes", "node")
    class TargetsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PHASE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    STALL_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    phase: str
    snapshot_id: str
    targets: _containers.ScalarMap[str, int]
    stall_s: float
    bytes: int
    node: str
    def __init__(self, phase: _Optional[str] = ..., snapshot_id: _Optional[str] = ..., targets: _Optional[_Mapping[str, int]] = ..., stall_s: _Optional[float] = ..., bytes: _Optional[int] = ..., node: _Optional[str] = ...) -> None: ...

class UploadWindow(_message.Message):
    __slots__ = ("node", "start", "end", "uploaded_bytes", "deduped_chunks", "uploaded_chunks")
    NODE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEDUPED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    node: str
    start: float
    end: float
    uploaded_bytes: int
    deduped_chunks: int
    uploaded_chunks: int
    def __init__(self, node: _Optional[str] = ..., start: _Optional[float] = ..., end: _Optional[float] = ..., uploaded_bytes: _Optional[int] = ..., deduped_chunks: _Optional[int] = ..., uploaded_chunks: _Optional[int] = ...) -> None: ...

class RankProgress(_message.Message):
    __slots__ = ("rank", "answered", "steps", "counts", "proc_state", "exit_code", "in_flight_s", "step_s", "steps_window", "timings")
    class CountsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RANK_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    PROC_STATE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_S_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    STEPS_WINDOW_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    answered: bool
    steps: int
    counts: _containers.ScalarMap[str, int]
    proc_state: str
    exit_code: int
    in_flight_s: float
    step_s: float
    steps_window: int
    timings: _containers.RepeatedCompositeFieldContainer[CollectiveTiming]
    def __init__(self, rank: _Optional[int] = ..., answered: _Optional[bool] = ..., steps: _Optional[int] = ..., counts: _Optional[_Mapping[str, int]] = ..., proc_state: _Optional[str] = ..., exit_code: _Optional[int] = ..., in_flight_s: _Optional[float] = ..., step_s: _Optional[float] = ..., steps_window: _Optional[int] = ..., timings: _Optional[_Iterable[_Union[CollectiveTiming, _Mapping]]] = ...) -> None: ...

class CollectiveTiming(_message.Message):
    __slots__ = ("group", "done", "window", "mean_s", "p50_s", "seqs", "latencies_s")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    MEAN_S_FIELD_NUMBER: _ClassVar[int]
    P50_S_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    LATENCIES_S_FIELD_NUMBER: _ClassVar[int]
    group: str
    done: int
    window: int
    mean_s: float
    p50_s: float
    seqs: _containers.RepeatedScalarFieldContainer[int]
    latencies_s: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, group: _Optional[str] = ..., done: _Optional[int] = ..., window: _Optional[int] = ..., mean_s: _Optional[float] = ..., p50_s: _Optional[float] = ..., seqs: _Optional[_Iterable[int]] = ..., latencies_s: _Optional[_Iterable[float]] = ...) -> None: ...

class PeerStats(_message.Message):
    __slots__ = ("address", "connections", "rtt_ms", "bytes_sent", "bytes_retrans", "delivery_bps")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RETRANS_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_BPS_FIELD_NUMBER: _ClassVar[int]
    address: str
    connections: int
    rtt_ms: float
    bytes_sent: int
    bytes_retrans: int
    delivery_bps: float
    def __init__(self, address: _Optional[str] = ..., connections: _Optional[int] = ..., rtt_ms: _Optional[float] = ..., bytes_sent: _Optional[int] = ..., bytes_retrans: _Optional[int] = ..., delivery_bps: _Optional[float] = ...) -> None: ...

class JobProgress(_message.Message):
    __slots__ = ("job_id", "busy", "ranks", "sampled", "node", "peers")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    busy: bool
    ranks: _containers.RepeatedCompositeFieldContainer[RankProgress]
    sampled: float
    node: str
    peers: _containers.RepeatedCompositeFieldContainer[PeerStats]
    def __init__(self, job_id: _Optional[str] = ..., busy: _Optional[bool] = ..., ranks: _Optional[_Iterable[_Union[RankProgress, _Mapping]]] = ..., sampled: _Optional[float] = ..., node: _Optional[str] = ..., peers: _Optional[_Iterable[_Union[PeerStats, _Mapping]]] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AuditCheck(_message.Message):
    __slots__ = ("name", "status", "value", "unit", "detail", "higher_is_better")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    HIGHER_IS_BETTER_FIELD_NUMBER: _ClassVar[int]
    name: str
    status: str
    value: float
    unit: str
    detail: str
    higher_is_better: bool
    def __init__(self, name: _Optional[str] = ..., status: _Optional[str] = ..., value: _Optional[float] = ..., unit: _Optional[str] = ..., detail: _Optional[str] = ..., higher_is_better: _Optional[bool] = ...) -> None: ...
