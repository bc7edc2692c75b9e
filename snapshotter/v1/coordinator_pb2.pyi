from snapshotter.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CoordinatorInfo(_message.Message):
    __slots__ = ("version", "pid", "store", "agents", "incarnations", "fence", "resources")
    class IncarnationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    INCARNATIONS_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    version: str
    pid: int
    store: str
    agents: _containers.RepeatedScalarFieldContainer[str]
    incarnations: _containers.ScalarMap[str, str]
    fence: Fence
    resources: _common_pb2.Resources
    def __init__(self, version: _Optional[str] = ..., pid: _Optional[int] = ..., store: _Optional[str] = ..., agents: _Optional[_Iterable[str]] = ..., incarnations: _Optional[_Mapping[str, str]] = ..., fence: _Optional[_Union[Fence, _Mapping]] = ..., resources: _Optional[_Union[_common_pb2.Resources, _Mapping]] = ...) -> None: ...

class Fence(_message.Message):
    __slots__ = ("epoch", "id")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    id: str
    def __init__(self, epoch: _Optional[int] = ..., id: _Optional[str] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("name", "address", "live", "heartbeat_age_s", "agent", "error", "links", "drained_links", "draining")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    DRAINED_LINKS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    live: bool
    heartbeat_age_s: float
    agent: _common_pb2.AgentInfo
    error: str
    links: _containers.RepeatedCompositeFieldContainer[_common_pb2.LinkState]
    drained_links: _containers.RepeatedScalarFieldContainer[str]
    draining: bool
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., live: _Optional[bool] = ..., heartbeat_age_s: _Optional[float] = ..., agent: _Optional[_Union[_common_pb2.AgentInfo, _Mapping]] = ..., error: _Optional[str] = ..., links: _Optional[_Iterable[_Union[_common_pb2.LinkState, _Mapping]]] = ..., drained_links: _Optional[_Iterable[str]] = ..., draining: _Optional[bool] = ...) -> None: ...

class NodeList(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...

class RegisterAgentRequest(_message.Message):
    __slots__ = ("name", "address", "host", "heartbeat", "incarnation", "version", "links")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    host: str
    heartbeat: bool
    incarnation: str
    version: str
    links: _containers.RepeatedCompositeFieldContainer[_common_pb2.LinkState]
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., host: _Optional[str] = ..., heartbeat: _Optional[bool] = ..., incarnation: _Optional[str] = ..., version: _Optional[str] = ..., links: _Optional[_Iterable[_Union[_common_pb2.LinkState, _Mapping]]] = ...) -> None: ...

class RegisterAgentReply(_message.Message):
    __slots__ = ("registered", "fence", "beat_s", "relay_key")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    BEAT_S_FIELD_NUMBER: _ClassVar[int]
    RELAY_KEY_FIELD_NUMBER: _ClassVar[int]
    registered: str
    fence: Fence
    beat_s: float
    relay_key: bytes
    def __init__(self, registered: _Optional[str] = ..., fence: _Optional[_Union[Fence, _Mapping]] = ..., beat_s: _Optional[float] = ..., relay_key: _Optional[bytes] = ...) -> None: ...

class RunRequest(_message.Message):
    __slots__ = ("job_id", "script", "script_args", "module", "python", "cwd", "env", "nnodes", "nproc_per_node", "nodes", "policy", "recovery", "tenant", "provider_opt_out", "nproc_kind")
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
    NODES_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_OPT_OUT_FIELD_NUMBER: _ClassVar[int]
    NPROC_KIND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    script: str
    script_args: _containers.RepeatedScalarFieldContainer[str]
    module: bool
    python: str
    cwd: str
    env: _containers.ScalarMap[str, str]
    nnodes: int
    nproc_per_node: int
    nodes: _containers.RepeatedScalarFieldContainer[str]
    policy: _common_pb2.Policy
    recovery: _common_pb2.Recovery
    tenant: str
    provider_opt_out: bool
    nproc_kind: str
    def __init__(self, job_id: _Optional[str] = ..., script: _Optional[str] = ..., script_args: _Optional[_Iterable[str]] = ..., module: _Optional[bool] = ..., python: _Optional[str] = ..., cwd: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., nnodes: _Optional[int] = ..., nproc_per_node: _Optional[int] = ..., nodes: _Optional[_Iterable[str]] = ..., policy: _Optional[_Union[_common_pb2.Policy, _Mapping]] = ..., recovery: _Optional[_Union[_common_pb2.Recovery, _Mapping]] = ..., tenant: _Optional[str] = ..., provider_opt_out: _Optional[bool] = ..., nproc_kind: _Optional[str] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job_id", "state", "nodes", "nnodes", "nproc_per_node", "script", "ranks", "snapshots", "thawed_from", "exit_code", "policy", "recovery", "recoveries", "events", "gave_up", "plane", "tenant")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    NNODES_FIELD_NUMBER: _ClassVar[int]
    NPROC_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    SCRIPT_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    THAWED_FROM_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_FIELD_NUMBER: _ClassVar[int]
    RECOVERIES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    GAVE_UP_FIELD_NUMBER: _ClassVar[int]
    PLANE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: str
    nodes: _containers.RepeatedScalarFieldContainer[str]
    nnodes: int
    nproc_per_node: int
    script: str
    ranks: _containers.RepeatedCompositeFieldContainer[_common_pb2.RankState]
    snapshots: _containers.RepeatedScalarFieldContainer[str]
    thawed_from: str
    exit_code: int
    policy: _common_pb2.Policy
    recovery: _common_pb2.Recovery
    recoveries: int
    events: _containers.RepeatedCompositeFieldContainer[JobEvent]
    gave_up: str
    plane: int
    tenant: str
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[str] = ..., nodes: _Optional[_Iterable[str]] = ..., nnodes: _Optional[int] = ..., nproc_per_node: _Optional[int] = ..., script: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[_common_pb2.RankState, _Mapping]]] = ..., snapshots: _Optional[_Iterable[str]] = ..., thawed_from: _Optional[str] = ..., exit_code: _Optional[int] = ..., policy: _Optional[_Union[_common_pb2.Policy, _Mapping]] = ..., recovery: _Optional[_Union[_common_pb2.Recovery, _Mapping]] = ..., recoveries: _Optional[int] = ..., events: _Optional[_Iterable[_Union[JobEvent, _Mapping]]] = ..., gave_up: _Optional[str] = ..., plane: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("time", "kind", "cause", "snapshot_id", "steps_lost", "took_s", "detect_s", "detail", "nodes", "rank")
    TIME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    STEPS_LOST_FIELD_NUMBER: _ClassVar[int]
    TOOK_S_FIELD_NUMBER: _ClassVar[int]
    DETECT_S_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    time: float
    kind: str
    cause: str
    snapshot_id: str
    steps_lost: int
    took_s: float
    detect_s: float
    detail: str
    nodes: _containers.RepeatedScalarFieldContainer[str]
    rank: int
    def __init__(self, time: _Optional[float] = ..., kind: _Optional[str] = ..., cause: _Optional[str] = ..., snapshot_id: _Optional[str] = ..., steps_lost: _Optional[int] = ..., took_s: _Optional[float] = ..., detect_s: _Optional[float] = ..., detail: _Optional[str] = ..., nodes: _Optional[_Iterable[str]] = ..., rank: _Optional[int] = ...) -> None: ...

class EventList(_message.Message):
    __slots__ = ("job_id", "events")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    events: _containers.RepeatedCompositeFieldContainer[JobEvent]
    def __init__(self, job_id: _Optional[str] = ..., events: _Optional[_Iterable[_Union[JobEvent, _Mapping]]] = ...) -> None: ...

class SetPolicyRequest(_message.Message):
    __slots__ = ("job_id", "policy", "every_given", "clear")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    EVERY_GIVEN_FIELD_NUMBER: _ClassVar[int]
    CLEAR_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    policy: _common_pb2.Policy
    every_given: bool
    clear: bool
    def __init__(self, job_id: _Optional[str] = ..., policy: _Optional[_Union[_common_pb2.Policy, _Mapping]] = ..., every_given: _Optional[bool] = ..., clear: _Optional[bool] = ...) -> None: ...

class AutoInterval(_message.Message):
    __slots__ = ("cost_s", "cost_measured", "node_mtbf_s", "failures", "node_seconds", "nnodes", "job_mtbf_s", "interval_s")
    COST_S_FIELD_NUMBER: _ClassVar[int]
    COST_MEASURED_FIELD_NUMBER: _ClassVar[int]
    NODE_MTBF_S_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    NODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NNODES_FIELD_NUMBER: _ClassVar[int]
    JOB_MTBF_S_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    cost_s: float
    cost_measured: int
    node_mtbf_s: float
    failures: int
    node_seconds: float
    nnodes: int
    job_mtbf_s: float
    interval_s: float
    def __init__(self, cost_s: _Optional[float] = ..., cost_measured: _Optional[int] = ..., node_mtbf_s: _Optional[float] = ..., failures: _Optional[int] = ..., node_seconds: _Optional[float] = ..., nnodes: _Optional[int] = ..., job_mtbf_s: _Optional[float] = ..., interval_s: _Optional[float] = ...) -> None: ...

class PolicyInfo(_message.Message):
    __slots__ = ("job_id", "policy", "describe", "auto", "interval_s", "next_in_s", "steps", "anchor_steps", "failures", "last_error", "state")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    DESCRIBE_FIELD_NUMBER: _ClassVar[int]
    AUTO_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    NEXT_IN_S_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_STEPS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    policy: _common_pb2.Policy
    describe: str
    auto: AutoInterval
    interval_s: float
    next_in_s: float
    steps: int
    anchor_steps: int
    failures: int
    last_error: str
    state: str
    def __init__(self, job_id: _Optional[str] = ..., policy: _Optional[_Union[_common_pb2.Policy, _Mapping]] = ..., describe: _Optional[str] = ..., auto: _Optional[_Union[AutoInterval, _Mapping]] = ..., interval_s: _Optional[float] = ..., next_in_s: _Optional[float] = ..., steps: _Optional[int] = ..., anchor_steps: _Optional[int] = ..., failures: _Optional[int] = ..., last_error: _Optional[str] = ..., state: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("node", "grace_s", "undo")
    NODE_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    UNDO_FIELD_NUMBER: _ClassVar[int]
    node: str
    grace_s: float
    undo: bool
    def __init__(self, node: _Optional[str] = ..., grace_s: _Optional[float] = ..., undo: _Optional[bool] = ...) -> None: ...

class DrainedJob(_message.Message):
    __slots__ = ("job_id", "snapshot_id", "fallback", "detail", "thawed_on", "migrated")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    THAWED_ON_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    snapshot_id: str
    fallback: bool
    detail: str
    thawed_on: _containers.RepeatedScalarFieldContainer[str]
    migrated: bool
    def __init__(self, job_id: _Optional[str] = ..., snapshot_id: _Optional[str] = ..., fallback: _Optional[bool] = ..., detail: _Optional[str] = ..., thawed_on: _Optional[_Iterable[str]] = ..., migrated: _Optional[bool] = ...) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("node", "jobs")
    NODE_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    node: str
    jobs: _containers.RepeatedCompositeFieldContainer[DrainedJob]
    def __init__(self, node: _Optional[str] = ..., jobs: _Optional[_Iterable[_Union[DrainedJob, _Mapping]]] = ...) -> None: ...

class JobList(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobStatus]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ...) -> None: ...

class FreezeRequest(_message.Message):
    __slots__ = ("job_id", "stop", "quiesce_timeout_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    QUIESCE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    stop: bool
    quiesce_timeout_s: float
    def __init__(self, job_id: _Optional[str] = ..., stop: _Optional[bool] = ..., quiesce_timeout_s: _Optional[float] = ...) -> None: ...

class FreezeStats(_message.Message):
    __slots__ = ("quiesce_s", "dump_s", "upload_s", "stall_s", "image_bytes", "uploads", "total_s", "uploaded_bytes", "spans")
    QUIESCE_S_FIELD_NUMBER: _ClassVar[int]
    DUMP_S_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_S_FIELD_NUMBER: _ClassVar[int]
    STALL_S_FIELD_NUMBER: _ClassVar[int]
    IMAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPLOADS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    quiesce_s: float
    dump_s: float
    upload_s: float
    stall_s: float
    image_bytes: int
    uploads: _containers.RepeatedCompositeFieldContainer[_common_pb2.UploadWindow]
    total_s: float
    uploaded_bytes: int
    spans: _containers.RepeatedCompositeFieldContainer[Span]
    def __init__(self, quiesce_s: _Optional[float] = ..., dump_s: _Optional[float] = ..., upload_s: _Optional[float] = ..., stall_s: _Optional[float] = ..., image_bytes: _Optional[int] = ..., uploads: _Optional[_Iterable[_Union[_common_pb2.UploadWindow, _Mapping]]] = ..., total_s: _Optional[float] = ..., uploaded_bytes: _Optional[int] = ..., spans: _Optional[_Iterable[_Union[Span, _Mapping]]] = ...) -> None: ...

class Span(_message.Message):
    __slots__ = ("node", "rank", "phase", "start", "end")
    NODE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    node: str
    rank: int
    phase: str
    start: float
    end: float
    def __init__(self, node: _Optional[str] = ..., rank: _Optional[int] = ..., phase: _Optional[str] = ..., start: _Optional[float] = ..., end: _Optional[float] = ...) -> None: ...

class FreezeDone(_message.Message):
    __slots__ = ("snapshot_id", "stopped", "stats")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    stopped: bool
    stats: FreezeStats
    def __init__(self, snapshot_id: _Optional[str] = ..., stopped: _Optional[bool] = ..., stats: _Optional[_Union[FreezeStats, _Mapping]] = ...) -> None: ...

class FreezeEvent(_message.Message):
    __slots__ = ("phase", "progress", "done")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    phase: _common_pb2.PhaseEvent
    progress: _common_pb2.TransferProgress
    done: FreezeDone
    def __init__(self, phase: _Optional[_Union[_common_pb2.PhaseEvent, _Mapping]] = ..., progress: _Optional[_Union[_common_pb2.TransferProgress, _Mapping]] = ..., done: _Optional[_Union[FreezeDone, _Mapping]] = ...) -> None: ...

class ThawRequest(_message.Message):
    __slots__ = ("snapshot_id", "job_id", "nodes", "allow_unsigned")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    ALLOW_UNSIGNED_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    job_id: str
    nodes: _containers.RepeatedScalarFieldContainer[str]
    allow_unsigned: bool
    def __init__(self, snapshot_id: _Optional[str] = ..., job_id: _Optional[str] = ..., nodes: _Optional[_Iterable[str]] = ..., allow_unsigned: _Optional[bool] = ...) -> None: ...

class NodeThawStats(_message.Message):
    __slots__ = ("node", "restore_s", "resume_s", "fetch_s", "local_copy")
    NODE_FIELD_NUMBER: _ClassVar[int]
    RESTORE_S_FIELD_NUMBER: _ClassVar[int]
    RESUME_S_FIELD_NUMBER: _ClassVar[int]
    FETCH_S_FIELD_NUMBER: _ClassVar[int]
    LOCAL_COPY_FIELD_NUMBER: _ClassVar[int]
    node: str
    restore_s: float
    resume_s: float
    fetch_s: float
    local_copy: bool
    def __init__(self, node: _Optional[str] = ..., restore_s: _Optional[float] = ..., resume_s: _Optional[float] = ..., fetch_s: _Optional[float] = ..., local_copy: _Optional[bool] = ...) -> None: ...

class ThawStats(_message.Message):
    __slots__ = ("fetch_s", "restore_s", "total_s", "nodes")
    FETCH_S_FIELD_NUMBER: _ClassVar[int]
    RESTORE_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    fetch_s: float
    restore_s: float
    total_s: float
    nodes: _containers.RepeatedCompositeFieldContainer[NodeThawStats]
    def __init__(self, fetch_s: _Optional[float] = ..., restore_s: _Optional[float] = ..., total_s: _Optional[float] = ..., nodes: _Optional[_Iterable[_Union[NodeThawStats, _Mapping]]] = ...) -> None: ...

class ThawDone(_message.Message):
    __slots__ = ("job_id", "stats")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    stats: ThawStats
    def __init__(self, job_id: _Optional[str] = ..., stats: _Optional[_Union[ThawStats, _Mapping]] = ...) -> None: ...

class ThawEvent(_message.Message):
    __slots__ = ("phase", "progress", "done")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    phase: _common_pb2.PhaseEvent
    progress: _common_pb2.TransferProgress
    done: ThawDone
    def __init__(self, phase: _Optional[_Union[_common_pb2.PhaseEvent, _Mapping]] = ..., progress: _Optional[_Union[_common_pb2.TransferProgress, _Mapping]] = ..., done: _Optional[_Union[ThawDone, _Mapping]] = ...) -> None: ...

class ListSnapshotsRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class SnapshotRef(_message.Message):
    __slots__ = ("snapshot_id",)
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    def __init__(self, snapshot_id: _Optional[str] = ...) -> None: ...

class SnapshotSummary(_message.Message):
    __slots__ = ("snapshot_id", "job_id", "created", "ranks", "nodes", "stored_bytes", "raw_bytes", "stats", "tenant")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    job_id: str
    created: float
    ranks: int
    nodes: _containers.RepeatedScalarFieldContainer[str]
    stored_bytes: int
    raw_bytes: int
    stats: FreezeStats
    tenant: str
    def __init__(self, snapshot_id: _Optional[str] = ..., job_id: _Optional[str] = ..., created: _Optional[float] = ..., ranks: _Optional[int] = ..., nodes: _Optional[_Iterable[str]] = ..., stored_bytes: _Optional[int] = ..., raw_bytes: _Optional[int] = ..., stats: _Optional[_Union[FreezeStats, _Mapping]] = ..., tenant: _Optional[str] = ...) -> None: ...

class SnapshotList(_message.Message):
    __slots__ = ("snapshots",)
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    snapshots: _containers.RepeatedCompositeFieldContainer[SnapshotSummary]
    def __init__(self, snapshots: _Optional[_Iterable[_Union[SnapshotSummary, _Mapping]]] = ...) -> None: ...

class SnapshotDetail(_message.Message):
    __slots__ = ("summary", "job", "freeze_id", "targets", "rank_records", "env_omitted")
    class TargetsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    FREEZE_ID_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    RANK_RECORDS_FIELD_NUMBER: _ClassVar[int]
    ENV_OMITTED_FIELD_NUMBER: _ClassVar[int]
    summary: SnapshotSummary
    job: _common_pb2.JobSpec
    freeze_id: str
    targets: _containers.ScalarMap[str, int]
    rank_records: _containers.RepeatedCompositeFieldContainer[_common_pb2.RankRecord]
    env_omitted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, summary: _Optional[_Union[SnapshotSummary, _Mapping]] = ..., job: _Optional[_Union[_common_pb2.JobSpec, _Mapping]] = ..., freeze_id: _Optional[str] = ..., targets: _Optional[_Mapping[str, int]] = ..., rank_records: _Optional[_Iterable[_Union[_common_pb2.RankRecord, _Mapping]]] = ..., env_omitted: _Optional[_Iterable[str]] = ...) -> None: ...

class DeleteReply(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: str
    def __init__(self, deleted: _Optional[str] = ...) -> None: ...

class GcRequest(_message.Message):
    __slots__ = ("min_age_s", "delete")
    MIN_AGE_S_FIELD_NUMBER: _ClassVar[int]
    DELETE_FIELD_NUMBER: _ClassVar[int]
    min_age_s: float
    delete: bool
    def __init__(self, min_age_s: _Optional[float] = ..., delete: _Optional[bool] = ...) -> None: ...

class GcOrphan(_message.Message):
    __slots__ = ("snapshot_id", "objects", "bytes", "newest_age_s", "action", "reason", "failed_keys")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NEWEST_AGE_S_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FAILED_KEYS_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    objects: int
    bytes: int
    newest_age_s: float
    action: str
    reason: str
    failed_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, snapshot_id: _Optional[str] = ..., objects: _Optional[int] = ..., bytes: _Optional[int] = ..., newest_age_s: _Optional[float] = ..., action: _Optional[str] = ..., reason: _Optional[str] = ..., failed_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class GcSummary(_message.Message):
    __slots__ = ("orphans", "objects", "bytes", "kept", "collected", "collected_bytes", "failed", "failed_keys")
    ORPHANS_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    COLLECTED_FIELD_NUMBER: _ClassVar[int]
    COLLECTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    FAILED_KEYS_FIELD_NUMBER: _ClassVar[int]
    orphans: int
    objects: int
    bytes: int
    kept: int
    collected: int
    collected_bytes: int
    failed: int
    failed_keys: int
    def __init__(self, orphans: _Optional[int] = ..., objects: _Optional[int] = ..., bytes: _Optional[int] = ..., kept: _Optional[int] = ..., collected: _Optional[int] = ..., collected_bytes: _Optional[int] = ..., failed: _Optional[int] = ..., failed_keys: _Optional[int] = ...) -> None: ...

class GcReport(_message.Message):
    __slots__ = ("store", "now", "min_age_s", "delete", "orphans", "summary", "chunks", "checkpoints")
    STORE_FIELD_NUMBER: _ClassVar[int]
    NOW_FIELD_NUMBER: _ClassVar[int]
    MIN_AGE_S_FIELD_NUMBER: _ClassVar[int]
    DELETE_FIELD_NUMBER: _ClassVar[int]
    ORPHANS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    store: str
    now: float
    min_age_s: float
    delete: bool
    orphans: _containers.RepeatedCompositeFieldContainer[GcOrphan]
    summary: GcSummary
    chunks: GcChunks
    checkpoints: GcReport
    def __init__(self, store: _Optional[str] = ..., now: _Optional[float] = ..., min_age_s: _Optional[float] = ..., delete: _Optional[bool] = ..., orphans: _Optional[_Iterable[_Union[GcOrphan, _Mapping]]] = ..., summary: _Optional[_Union[GcSummary, _Mapping]] = ..., chunks: _Optional[_Union[GcChunks, _Mapping]] = ..., checkpoints: _Optional[_Union[GcReport, _Mapping]] = ...) -> None: ...

class GcChunks(_message.Message):
    __slots__ = ("stored", "stored_bytes", "unreferenced", "unreferenced_bytes", "collected", "collected_bytes", "kept", "failed", "reason")
    STORED_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNREFERENCED_FIELD_NUMBER: _ClassVar[int]
    UNREFERENCED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COLLECTED_FIELD_NUMBER: _ClassVar[int]
    COLLECTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    stored: int
    stored_bytes: int
    unreferenced: int
    unreferenced_bytes: int
    collected: int
    collected_bytes: int
    kept: int
    failed: int
    reason: str
    def __init__(self, stored: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., unreferenced: _Optional[int] = ..., unreferenced_bytes: _Optional[int] = ..., collected: _Optional[int] = ..., collected_bytes: _Optional[int] = ..., kept: _Optional[int] = ..., failed: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ("force",)
    FORCE_FIELD_NUMBER: _ClassVar[int]
    force: bool
    def __init__(self, force: _Optional[bool] = ...) -> None: ...

class ShutdownReply(_message.Message):
    __slots__ = ("stopping", "cancelled")
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    stopping: bool
    cancelled: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, stopping: _Optional[bool] = ..., cancelled: _Optional[_Iterable[str]] = ...) -> None: ...

class LinkRequest(_message.Message):
    __slots__ = ("node", "iface", "restore")
    NODE_FIELD_NUMBER: _ClassVar[int]
    IFACE_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    node: str
    iface: str
    restore: bool
    def __init__(self, node: _Optional[str] = ..., iface: _Optional[str] = ..., restore: _Optional[bool] = ...) -> None: ...

class Rerouted(_message.Message):
    __slots__ = ("job_id", "from_plane", "to_plane", "stall_s", "error")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_PLANE_FIELD_NUMBER: _ClassVar[int]
    TO_PLANE_FIELD_NUMBER: _ClassVar[int]
    STALL_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    from_plane: int
    to_plane: int
    stall_s: float
    error: str
    def __init__(self, job_id: _Optional[str] = ..., from_plane: _Optional[int] = ..., to_plane: _Optional[int] = ..., stall_s: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class LinkReply(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Rerouted]
    def __init__(self, jobs: _Optional[_Iterable[_Union[Rerouted, _Mapping]]] = ...) -> None: ...

class MigrateRequest(_message.Message):
    __slots__ = ("job_id", "node", "rank", "to", "via_store", "quiesce_timeout_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    VIA_STORE_FIELD_NUMBER: _ClassVar[int]
    QUIESCE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    node: str
    rank: int
    to: str
    via_store: bool
    quiesce_timeout_s: float
    def __init__(self, job_id: _Optional[str] = ..., node: _Optional[str] = ..., rank: _Optional[int] = ..., to: _Optional[str] = ..., via_store: _Optional[bool] = ..., quiesce_timeout_s: _Optional[float] = ...) -> None: ...

class MigrateStats(_message.Message):
    __slots__ = ("downtime_s", "quiesce_s", "dump_s", "transfer_s", "restore_s", "resume_s", "image_bytes", "ranks")
    DOWNTIME_S_FIELD_NUMBER: _ClassVar[int]
    QUIESCE_S_FIELD_NUMBER: _ClassVar[int]
    DUMP_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    RESTORE_S_FIELD_NUMBER: _ClassVar[int]
    RESUME_S_FIELD_NUMBER: _ClassVar[int]
    IMAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    downtime_s: float
    quiesce_s: float
    dump_s: float
    transfer_s: float
    restore_s: float
    resume_s: float
    image_bytes: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, downtime_s: _Optional[float] = ..., quiesce_s: _Optional[float] = ..., dump_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., restore_s: _Optional[float] = ..., resume_s: _Optional[float] = ..., image_bytes: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class MigrateDone(_message.Message):
    __slots__ = ("job_id", "node", "to", "stats", "nodes")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    node: str
    to: str
    stats: MigrateStats
    nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., node: _Optional[str] = ..., to: _Optional[str] = ..., stats: _Optional[_Union[MigrateStats, _Mapping]] = ..., nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class MigrateEvent(_message.Message):
    __slots__ = ("phase", "progress", "done")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    phase: _common_pb2.PhaseEvent
    progress: _common_pb2.TransferProgress
    done: MigrateDone
    def __init__(self, phase: _Optional[_Union[_common_pb2.PhaseEvent, _Mapping]] = ..., progress: _Optional[_Union[_common_pb2.TransferProgress, _Mapping]] = ..., done: _Optional[_Union[MigrateDone, _Mapping]] = ...) -> None: ...

class TenantRef(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class TenantInfo(_message.Message):
    __slots__ = ("tenant", "max_stored_bytes", "max_concurrent_freezes", "stored_bytes", "snapshots", "jobs", "active_jobs", "freezing", "webhook_url", "data_key_id", "webhook_secret")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MAX_STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_FREEZES_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_JOBS_FIELD_NUMBER: _ClassVar[int]
    FREEZING_FIELD_NUMBER: _ClassVar[int]
    WEBHOOK_URL_FIELD_NUMBER: _ClassVar[int]
    DATA_KEY_ID_FIELD_NUMBER: _ClassVar[int]
    WEBHOOK_SECRET_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    max_stored_bytes: int
    max_concurrent_freezes: int
    stored_bytes: int
    snapshots: int
    jobs: int
    active_jobs: int
    freezing: int
    webhook_url: str
    data_key_id: str
    webhook_secret: str
    def __init__(self, tenant: _Optional[str] = ..., max_stored_bytes: _Optional[int] = ..., max_concurrent_freezes: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., snapshots: _Optional[int] = ..., jobs: _Optional[int] = ..., active_jobs: _Optional[int] = ..., freezing: _Optional[int] = ..., webhook_url: _Optional[str] = ..., data_key_id: _Optional[str] = ..., webhook_secret: _Optional[str] = ...) -> None: ...

class TenantList(_message.Message):
    __slots__ = ("tenants",)
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantInfo]
    def __init__(self, tenants: _Optional[_Iterable[_Union[TenantInfo, _Mapping]]] = ...) -> None: ...

class SetTenantRequest(_message.Message):
    __slots__ = ("tenant", "max_stored_bytes", "max_concurrent_freezes", "webhook_url")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MAX_STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_FREEZES_FIELD_NUMBER: _ClassVar[int]
    WEBHOOK_URL_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    max_stored_bytes: int
    max_concurrent_freezes: int
    webhook_url: str
    def __init__(self, tenant: _Optional[str] = ..., max_stored_bytes: _Optional[int] = ..., max_concurrent_freezes: _Optional[int] = ..., webhook_url: _Optional[str] = ...) -> None: ...

class AnnounceWeightsRequest(_message.Message):
    __slots__ = ("node", "job_id", "channel", "lineage", "version", "token", "published", "failed", "bytes", "tensors")
    NODE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    node: str
    job_id: str
    channel: str
    lineage: str
    version: int
    token: str
    published: bool
    failed: bool
    bytes: int
    tensors: int
    def __init__(self, node: _Optional[str] = ..., job_id: _Optional[str] = ..., channel: _Optional[str] = ..., lineage: _Optional[str] = ..., version: _Optional[int] = ..., token: _Optional[str] = ..., published: _Optional[bool] = ..., failed: _Optional[bool] = ..., bytes: _Optional[int] = ..., tensors: _Optional[int] = ...) -> None: ...

class WatchWeightsRequest(_message.Message):
    __slots__ = ("node", "job_id", "channel", "lineage", "version", "timeout_s")
    NODE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    node: str
    job_id: str
    channel: str
    lineage: str
    version: int
    timeout_s: float
    def __init__(self, node: _Optional[str] = ..., job_id: _Optional[str] = ..., channel: _Optional[str] = ..., lineage: _Optional[str] = ..., version: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class WeightsSource(_message.Message):
    __slots__ = ("node", "address")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node: str
    address: str
    def __init__(self, node: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class WeightsPlan(_message.Message):
    __slots__ = ("channel", "lineage", "version", "token", "sources", "bytes", "tenant")
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    channel: str
    lineage: str
    version: int
    token: str
    sources: _containers.RepeatedCompositeFieldContainer[WeightsSource]
    bytes: int
    tenant: str
    def __init__(self, channel: _Optional[str] = ..., lineage: _Optional[str] = ..., version: _Optional[int] = ..., token: _Optional[str] = ..., sources: _Optional[_Iterable[_Union[WeightsSource, _Mapping]]] = ..., bytes: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class WeightsChannel(_message.Message):
    __slots__ = ("tenant", "channel", "lineage", "version", "publisher", "bytes", "holders", "failed")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PUBLISHER_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    channel: str
    lineage: str
    version: int
    publisher: str
    bytes: int
    holders: _containers.RepeatedScalarFieldContainer[str]
    failed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tenant: _Optional[str] = ..., channel: _Optional[str] = ..., lineage: _Optional[str] = ..., version: _Optional[int] = ..., publisher: _Optional[str] = ..., bytes: _Optional[int] = ..., holders: _Optional[_Iterable[str]] = ..., failed: _Optional[_Iterable[str]] = ...) -> None: ...

class WeightsChannelList(_message.Message):
    __slots__ = ("channels",)
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    channels: _containers.RepeatedCompositeFieldContainer[WeightsChannel]
    def __init__(self, channels: _Optional[_Iterable[_Union[WeightsChannel, _Mapping]]] = ...) -> None: ...

class AuditRequest(_message.Message):
    __slots__ = ("nodes", "link_bytes", "storage_bytes")
    NODES_FIELD_NUMBER: _ClassVar[int]
    LINK_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedScalarFieldContainer[str]
    link_bytes: int
    storage_bytes: int
    def __init__(self, nodes: _Optional[_Iterable[str]] = ..., link_bytes: _Optional[int] = ..., storage_bytes: _Optional[int] = ...) -> None: ...

class NodeAudit(_message.Message):
    __slots__ = ("node", "status", "checks", "why")
    NODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    WHY_FIELD_NUMBER: _ClassVar[int]
    node: str
    status: str
    checks: _containers.RepeatedCompositeFieldContainer[_common_pb2.AuditCheck]
    why: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node: _Optional[str] = ..., status: _Optional[str] = ..., checks: _Optional[_Iterable[_Union[_common_pb2.AuditCheck, _Mapping]]] = ..., why: _Optional[_Iterable[str]] = ...) -> None: ...

class LinkAudit(_message.Message):
    __slots__ = ("a", "b", "plane", "rtt_ms", "mbps", "retrans", "status", "why")
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    PLANE_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    MBPS_FIELD_NUMBER: _ClassVar[int]
    RETRANS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    WHY_FIELD_NUMBER: _ClassVar[int]
    a: str
    b: str
    plane: int
    rtt_ms: float
    mbps: float
    retrans: float
    status: str
    why: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, a: _Optional[str] = ..., b: _Optional[str] = ..., plane: _Optional[int] = ..., rtt_ms: _Optional[float] = ..., mbps: _Optional[float] = ..., retrans: _Optional[float] = ..., status: _Optional[str] = ..., why: _Optional[_Iterable[str]] = ...) -> None: ...

class InterfaceAudit(_message.Message):
    __slots__ = ("node", "plane", "rtt_ms", "mbps", "retrans", "status", "why")
    NODE_FIELD_NUMBER: _ClassVar[int]
    PLANE_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    MBPS_FIELD_NUMBER: _ClassVar[int]
    RETRANS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    WHY_FIELD_NUMBER: _ClassVar[int]
    node: str
    plane: int
    rtt_ms: float
    mbps: float
    retrans: float
    status: str
    why: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node: _Optional[str] = ..., plane: _Optional[int] = ..., rtt_ms: _Optional[float] = ..., mbps: _Optional[float] = ..., retrans: _Optional[float] = ..., status: _Optional[str] = ..., why: _Optional[_Iterable[str]] = ...) -> None: ...

class AuditReport(_message.Message):
    __slots__ = ("nodes", "links", "rounds", "seconds", "passed", "interfaces")
    NODES_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    INTERFACES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeAudit]
    links: _containers.RepeatedCompositeFieldContainer[LinkAudit]
    rounds: int
    seconds: float
    passed: bool
    interfaces: _containers.RepeatedCompositeFieldContainer[InterfaceAudit]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeAudit, _Mapping]]] = ..., links: _Optional[_Iterable[_Union[LinkAudit, _Mapping]]] = ..., rounds: _Optional[int] = ..., seconds: _Optional[float] = ..., passed: _Optional[bool] = ..., interfaces: _Optional[_Iterable[_Union[InterfaceAudit, _Mapping]]] = ...) -> None: ...

class TopRequest(_message.Message):
    __slots__ = ("job_id", "hang_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    HANG_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    hang_s: float
    def __init__(self, job_id: _Optional[str] = ..., hang_s: _Optional[float] = ...) -> None: ...

class TopRank(_message.Message):
    __slots__ = ("rank", "node", "answered", "proc_state", "steps", "step_s", "wait_s", "busy_s", "in_flight_s", "last_share")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_FIELD_NUMBER: _ClassVar[int]
    PROC_STATE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_S_FIELD_NUMBER: _ClassVar[int]
    LAST_SHARE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node: str
    answered: bool
    proc_state: str
    steps: int
    step_s: float
    wait_s: float
    busy_s: float
    in_flight_s: float
    last_share: float
    def __init__(self, rank: _Optional[int] = ..., node: _Optional[str] = ..., answered: _Optional[bool] = ..., proc_state: _Optional[str] = ..., steps: _Optional[int] = ..., step_s: _Optional[float] = ..., wait_s: _Optional[float] = ..., busy_s: _Optional[float] = ..., in_flight_s: _Optional[float] = ..., last_share: _Optional[float] = ...) -> None: ...

class TopLink(_message.Message):
    __slots__ = ("a", "b", "rtt_ms", "bytes_sent", "bytes_retrans")
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RETRANS_FIELD_NUMBER: _ClassVar[int]
    a: str
    b: str
    rtt_ms: float
    bytes_sent: int
    bytes_retrans: int
    def __init__(self, a: _Optional[str] = ..., b: _Optional[str] = ..., rtt_ms: _Optional[float] = ..., bytes_sent: _Optional[int] = ..., bytes_retrans: _Optional[int] = ...) -> None: ...

class TopReport(_message.Message):
    __slots__ = ("job_id", "sampled", "ranks", "slowest_rank", "slowest_node", "slowest_link", "waits_on", "stalled_s", "findings", "links", "busy", "aligned")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SLOWEST_RANK_FIELD_NUMBER: _ClassVar[int]
    SLOWEST_NODE_FIELD_NUMBER: _ClassVar[int]
    SLOWEST_LINK_FIELD_NUMBER: _ClassVar[int]
    WAITS_ON_FIELD_NUMBER: _ClassVar[int]
    STALLED_S_FIELD_NUMBER: _ClassVar[int]
    FINDINGS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    ALIGNED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    sampled: float
    ranks: _containers.RepeatedCompositeFieldContainer[TopRank]
    slowest_rank: int
    slowest_node: str
    slowest_link: str
    waits_on: int
    stalled_s: float
    findings: _containers.RepeatedScalarFieldContainer[str]
    links: _containers.RepeatedCompositeFieldContainer[TopLink]
    busy: bool
    aligned: int
    def __init__(self, job_id: _Optional[str] = ..., sampled: _Optional[float] = ..., ranks: _Optional[_Iterable[_Union[TopRank, _Mapping]]] = ..., slowest_rank: _Optional[int] = ..., slowest_node: _Optional[str] = ..., slowest_link: _Optional[str] = ..., waits_on: _Optional[int] = ..., stalled_s: _Optional[float] = ..., findings: _Optional[_Iterable[str]] = ..., links: _Optional[_Iterable[_Union[TopLink, _Mapping]]] = ..., busy: _Optional[bool] = ..., aligned: _Optional[int] = ...) -> None: ...
