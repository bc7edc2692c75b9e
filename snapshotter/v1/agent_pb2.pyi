from snapshotter.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WeightsRequest(_message.Message):
    __slots__ = ("tenant", "channel", "lineage", "version", "token", "names")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    channel: str
    lineage: str
    version: int
    token: str
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tenant: _Optional[str] = ..., channel: _Optional[str] = ..., lineage: _Optional[str] = ..., version: _Optional[int] = ..., token: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ...) -> None: ...

class WeightsIndexReply(_message.Message):
    __slots__ = ("index",)
    INDEX_FIELD_NUMBER: _ClassVar[int]
    index: bytes
    def __init__(self, index: _Optional[bytes] = ...) -> None: ...

class WeightPiece(_message.Message):
    __slots__ = ("name", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    data: bytes
    def __init__(self, name: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class JobPolicy(_message.Message):
    __slots__ = ("job_id", "policy")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    policy: _common_pb2.Policy
    def __init__(self, job_id: _Optional[str] = ..., policy: _Optional[_Union[_common_pb2.Policy, _Mapping]] = ...) -> None: ...

class OpenRdzvRequest(_message.Message):
    __slots__ = ("job_id", "python", "env", "spare")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PYTHON_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    python: str
    env: _containers.ScalarMap[str, str]
    spare: bool
    def __init__(self, job_id: _Optional[str] = ..., python: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., spare: _Optional[bool] = ...) -> None: ...

class LaunchRequest(_message.Message):
    __slots__ = ("spec", "node_rank", "rdzv", "plane", "seal")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    RDZV_FIELD_NUMBER: _ClassVar[int]
    PLANE_FIELD_NUMBER: _ClassVar[int]
    SEAL_FIELD_NUMBER: _ClassVar[int]
    spec: _common_pb2.JobSpec
    node_rank: int
    rdzv: _common_pb2.Endpoint
    plane: int
    seal: _common_pb2.DataKey
    def __init__(self, spec: _Optional[_Union[_common_pb2.JobSpec, _Mapping]] = ..., node_rank: _Optional[int] = ..., rdzv: _Optional[_Union[_common_pb2.Endpoint, _Mapping]] = ..., plane: _Optional[int] = ..., seal: _Optional[_Union[_common_pb2.DataKey, _Mapping]] = ...) -> None: ...

class NodeJob(_message.Message):
    __slots__ = ("job_id", "node_rank", "state", "rdzv", "started", "ended", "ranks", "spec", "gpu_faults", "node")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RDZV_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    GPU_FAULTS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    node_rank: int
    state: str
    rdzv: _common_pb2.Endpoint
    started: float
    ended: float
    ranks: _containers.RepeatedCompositeFieldContainer[_common_pb2.RankState]
    spec: _common_pb2.JobSpec
    gpu_faults: _containers.RepeatedCompositeFieldContainer[_common_pb2.GpuFault]
    node: str
    def __init__(self, job_id: _Optional[str] = ..., node_rank: _Optional[int] = ..., state: _Optional[str] = ..., rdzv: _Optional[_Union[_common_pb2.Endpoint, _Mapping]] = ..., started: _Optional[float] = ..., ended: _Optional[float] = ..., ranks: _Optional[_Iterable[_Union[_common_pb2.RankState, _Mapping]]] = ..., spec: _Optional[_Union[_common_pb2.JobSpec, _Mapping]] = ..., gpu_faults: _Optional[_Iterable[_Union[_common_pb2.GpuFault, _Mapping]]] = ..., node: _Optional[str] = ...) -> None: ...

class NodeJobList(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[NodeJob]
    def __init__(self, jobs: _Optional[_Iterable[_Union[NodeJob, _Mapping]]] = ...) -> None: ...

class FreezeRef(_message.Message):
    __slots__ = ("job_id", "freeze_id", "ranks")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FREEZE_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    freeze_id: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job_id: _Optional[str] = ..., freeze_id: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class PhaseRequest(_message.Message):
    __slots__ = ("job_id", "freeze_id", "timeout_s", "rdzv", "plane", "skip_ranks")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FREEZE_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    RDZV_FIELD_NUMBER: _ClassVar[int]
    PLANE_FIELD_NUMBER: _ClassVar[int]
    SKIP_RANKS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    freeze_id: str
    timeout_s: float
    rdzv: _common_pb2.Endpoint
    plane: int
    skip_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job_id: _Optional[str] = ..., freeze_id: _Optional[str] = ..., timeout_s: _Optional[float] = ..., rdzv: _Optional[_Union[_common_pb2.Endpoint, _Mapping]] = ..., plane: _Optional[int] = ..., skip_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class PrepareRequest(_message.Message):
    __slots__ = ("job_id", "freeze_id", "timeout_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FREEZE_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    freeze_id: str
    timeout_s: float
    def __init__(self, job_id: _Optional[str] = ..., freeze_id: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class GroupCounts(_message.Message):
    __slots__ = ("issued",)
    class IssuedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ISSUED_FIELD_NUMBER: _ClassVar[int]
    issued: _containers.ScalarMap[str, int]
    def __init__(self, issued: _Optional[_Mapping[str, int]] = ...) -> None: ...

class PrepareReply(_message.Message):
    __slots__ = ("counts",)
    class CountsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: GroupCounts
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[GroupCounts, _Mapping]] = ...) -> None: ...
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    counts: _containers.MessageMap[int, GroupCounts]
    def __init__(self, counts: _Optional[_Mapping[int, GroupCounts]] = ...) -> None: ...

class ParkRequest(_message.Message):
    __slots__ = ("job_id", "freeze_id", "targets", "timeout_s")
    class TargetsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FREEZE_ID_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    freeze_id: str
    targets: _containers.ScalarMap[str, int]
    timeout_s: float
    def __init__(self, job_id: _Optional[str] = ..., freeze_id: _Optional[str] = ..., targets: _Optional[_Mapping[str, int]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class ParkPoint(_message.Message):
    __slots__ = ("group", "seq")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    group: str
    seq: int
    def __init__(self, group: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...

class ParkReply(_message.Message):
    __slots__ = ("parked", "missing")
    class ParkedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: ParkPoint
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[ParkPoint, _Mapping]] = ...) -> None: ...
    class MissingEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    PARKED_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    parked: _containers.MessageMap[int, ParkPoint]
    missing: _containers.ScalarMap[int, str]
    def __init__(self, parked: _Optional[_Mapping[int, ParkPoint]] = ..., missing: _Optional[_Mapping[int, str]] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("failed",)
    class FailedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    FAILED_FIELD_NUMBER: _ClassVar[int]
    failed: _containers.ScalarMap[int, str]
    def __init__(self, failed: _Optional[_Mapping[int, str]] = ...) -> None: ...

class KeepFreezeReply(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class DumpReply(_message.Message):
    __slots__ = ("ranks",)
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedCompositeFieldContainer[_common_pb2.RankRecord]
    def __init__(self, ranks: _Optional[_Iterable[_Union[_common_pb2.RankRecord, _Mapping]]] = ...) -> None: ...

class UploadRequest(_message.Message):
    __slots__ = ("job_id", "freeze_id", "snapshot_id", "seal")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FREEZE_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    SEAL_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    freeze_id: str
    snapshot_id: str
    seal: _common_pb2.DataKey
    def __init__(self, job_id: _Optional[str] = ..., freeze_id: _Optional[str] = ..., snapshot_id: _Optional[str] = ..., seal: _Optional[_Union[_common_pb2.DataKey, _Mapping]] = ...) -> None: ...

class Uploaded(_message.Message):
    __slots__ = ("streams", "ranks", "upload", "put_keys")
    class StreamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _common_pb2.StreamInfo
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_common_pb2.StreamInfo, _Mapping]] = ...) -> None: ...
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_FIELD_NUMBER: _ClassVar[int]
    PUT_KEYS_FIELD_NUMBER: _ClassVar[int]
    streams: _containers.MessageMap[str, _common_pb2.StreamInfo]
    ranks: _containers.RepeatedCompositeFieldContainer[_common_pb2.RankRecord]
    upload: _common_pb2.UploadWindow
    put_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, streams: _Optional[_Mapping[str, _common_pb2.StreamInfo]] = ..., ranks: _Optional[_Iterable[_Union[_common_pb2.RankRecord, _Mapping]]] = ..., upload: _Optional[_Union[_common_pb2.UploadWindow, _Mapping]] = ..., put_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class UploadEvent(_message.Message):
    __slots__ = ("progress", "uploaded")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_FIELD_NUMBER: _ClassVar[int]
    progress: _common_pb2.TransferProgress
    uploaded: Uploaded
    def __init__(self, progress: _Optional[_Union[_common_pb2.TransferProgress, _Mapping]] = ..., uploaded: _Optional[_Union[Uploaded, _Mapping]] = ...) -> None: ...

class FinishFreezeRequest(_message.Message):
    __slots__ = ("job_id", "freeze_id", "stop", "committed", "stop_ranks")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FREEZE_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    STOP_RANKS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    freeze_id: str
    stop: bool
    committed: bool
    stop_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job_id: _Optional[str] = ..., freeze_id: _Optional[str] = ..., stop: _Optional[bool] = ..., committed: _Optional[bool] = ..., stop_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("snapshot_id", "streams", "uncommitted", "manifest_sha256", "seal")
    class UncommittedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _common_pb2.StreamInfo
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_common_pb2.StreamInfo, _Mapping]] = ...) -> None: ...
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    UNCOMMITTED_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    SEAL_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    streams: _containers.RepeatedScalarFieldContainer[str]
    uncommitted: _containers.MessageMap[str, _common_pb2.StreamInfo]
    manifest_sha256: str
    seal: _common_pb2.DataKey
    def __init__(self, snapshot_id: _Optional[str] = ..., streams: _Optional[_Iterable[str]] = ..., uncommitted: _Optional[_Mapping[str, _common_pb2.StreamInfo]] = ..., manifest_sha256: _Optional[str] = ..., seal: _Optional[_Union[_common_pb2.DataKey, _Mapping]] = ...) -> None: ...

class Fetched(_message.Message):
    __slots__ = ("node", "op", "fetch_s", "local_copy")
    NODE_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    FETCH_S_FIELD_NUMBER: _ClassVar[int]
    LOCAL_COPY_FIELD_NUMBER: _ClassVar[int]
    node: str
    op: str
    fetch_s: float
    local_copy: bool
    def __init__(self, node: _Optional[str] = ..., op: _Optional[str] = ..., fetch_s: _Optional[float] = ..., local_copy: _Optional[bool] = ...) -> None: ...

class FetchEvent(_message.Message):
    __slots__ = ("phase", "progress", "fetched")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    FETCHED_FIELD_NUMBER: _ClassVar[int]
    phase: _common_pb2.PhaseEvent
    progress: _common_pb2.TransferProgress
    fetched: Fetched
    def __init__(self, phase: _Optional[_Union[_common_pb2.PhaseEvent, _Mapping]] = ..., progress: _Optional[_Union[_common_pb2.TransferProgress, _Mapping]] = ..., fetched: _Optional[_Union[Fetched, _Mapping]] = ...) -> None: ...

class FetchRef(_message.Message):
    __slots__ = ("op",)
    OP_FIELD_NUMBER: _ClassVar[int]
    op: str
    def __init__(self, op: _Optional[str] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("op", "spec", "ranks", "node_rank", "timeout_s", "rdzv", "epoch", "put_back_files", "plane", "seal")
    OP_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    RDZV_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PUT_BACK_FILES_FIELD_NUMBER: _ClassVar[int]
    PLANE_FIELD_NUMBER: _ClassVar[int]
    SEAL_FIELD_NUMBER: _ClassVar[int]
    op: str
    spec: _common_pb2.JobSpec
    ranks: _containers.RepeatedCompositeFieldContainer[_common_pb2.RankRecord]
    node_rank: int
    timeout_s: float
    rdzv: _common_pb2.Endpoint
    epoch: str
    put_back_files: bool
    plane: int
    seal: _common_pb2.DataKey
    def __init__(self, op: _Optional[str] = ..., spec: _Optional[_Union[_common_pb2.JobSpec, _Mapping]] = ..., ranks: _Optional[_Iterable[_Union[_common_pb2.RankRecord, _Mapping]]] = ..., node_rank: _Optional[int] = ..., timeout_s: _Optional[float] = ..., rdzv: _Optional[_Union[_common_pb2.Endpoint, _Mapping]] = ..., epoch: _Optional[str] = ..., put_back_files: _Optional[bool] = ..., plane: _Optional[int] = ..., seal: _Optional[_Union[_common_pb2.DataKey, _Mapping]] = ...) -> None: ...

class BridgeRoute(_message.Message):
    __slots__ = ("dst", "via")
    DST_FIELD_NUMBER: _ClassVar[int]
    VIA_FIELD_NUMBER: _ClassVar[int]
    dst: str
    via: str
    def __init__(self, dst: _Optional[str] = ..., via: _Optional[str] = ...) -> None: ...

class BridgeRequest(_message.Message):
    __slots__ = ("plane", "routes", "remove")
    PLANE_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    REMOVE_FIELD_NUMBER: _ClassVar[int]
    plane: int
    routes: _containers.RepeatedCompositeFieldContainer[BridgeRoute]
    remove: bool
    def __init__(self, plane: _Optional[int] = ..., routes: _Optional[_Iterable[_Union[BridgeRoute, _Mapping]]] = ..., remove: _Optional[bool] = ...) -> None: ...

class GpuThaw(_message.Message):
    __slots__ = ("processes", "gpus", "restore_s")
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_S_FIELD_NUMBER: _ClassVar[int]
    processes: int
    gpus: _containers.RepeatedScalarFieldContainer[str]
    restore_s: float
    def __init__(self, processes: _Optional[int] = ..., gpus: _Optional[_Iterable[str]] = ..., restore_s: _Optional[float] = ...) -> None: ...

class RestoreReply(_message.Message):
    __slots__ = ("node", "restore_s", "resume_s", "job", "gpu")
    class GpuEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: GpuThaw
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[GpuThaw, _Mapping]] = ...) -> None: ...
    NODE_FIELD_NUMBER: _ClassVar[int]
    RESTORE_S_FIELD_NUMBER: _ClassVar[int]
    RESUME_S_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    node: str
    restore_s: float
    resume_s: float
    job: NodeJob
    gpu: _containers.MessageMap[int, GpuThaw]
    def __init__(self, node: _Optional[str] = ..., restore_s: _Optional[float] = ..., resume_s: _Optional[float] = ..., job: _Optional[_Union[NodeJob, _Mapping]] = ..., gpu: _Optional[_Mapping[int, GpuThaw]] = ...) -> None: ...

class OfferRequest(_message.Message):
    __slots__ = ("job_id", "freeze_id", "ticket")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FREEZE_ID_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    freeze_id: str
    ticket: str
    def __init__(self, job_id: _Optional[str] = ..., freeze_id: _Optional[str] = ..., ticket: _Optional[str] = ...) -> None: ...

class ImagesRequest(_message.Message):
    __slots__ = ("job_id", "freeze_id", "ticket", "stream")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FREEZE_ID_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    freeze_id: str
    ticket: str
    stream: str
    def __init__(self, job_id: _Optional[str] = ..., freeze_id: _Optional[str] = ..., ticket: _Optional[str] = ..., stream: _Optional[str] = ...) -> None: ...

class ImagePiece(_message.Message):
    __slots__ = ("data", "sha256", "size", "last", "path", "dir", "file_size")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DIR_FIELD_NUMBER: _ClassVar[int]
    FILE_SIZE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    sha256: str
    size: int
    last: bool
    path: str
    dir: bool
    file_size: int
    def __init__(self, data: _Optional[bytes] = ..., sha256: _Optional[str] = ..., size: _Optional[int] = ..., last: _Optional[bool] = ..., path: _Optional[str] = ..., dir: _Optional[bool] = ..., file_size: _Optional[int] = ...) -> None: ...

class ReceiveRequest(_message.Message):
    __slots__ = ("job_id", "freeze_id", "ticket", "source", "source_name", "streams", "bytes")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FREEZE_ID_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_NAME_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    freeze_id: str
    ticket: str
    source: str
    source_name: str
    streams: _containers.RepeatedScalarFieldContainer[str]
    bytes: int
    def __init__(self, job_id: _Optional[str] = ..., freeze_id: _Optional[str] = ..., ticket: _Optional[str] = ..., source: _Optional[str] = ..., source_name: _Optional[str] = ..., streams: _Optional[_Iterable[str]] = ..., bytes: _Optional[int] = ...) -> None: ...

class AuditNodeRequest(_message.Message):
    __slots__ = ("storage_bytes",)
    STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    storage_bytes: int
    def __init__(self, storage_bytes: _Optional[int] = ...) -> None: ...

class AuditNodeReply(_message.Message):
    __slots__ = ("checks",)
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    checks: _containers.RepeatedCompositeFieldContainer[_common_pb2.AuditCheck]
    def __init__(self, checks: _Optional[_Iterable[_Union[_common_pb2.AuditCheck, _Mapping]]] = ...) -> None: ...

class OpenProbeRequest(_message.Message):
    __slots__ = ("plane", "token", "peer")
    PLANE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    plane: int
    token: str
    peer: str
    def __init__(self, plane: _Optional[int] = ..., token: _Optional[str] = ..., peer: _Optional[str] = ...) -> None: ...

class ProbeEndpoint(_message.Message):
    __slots__ = ("address", "port")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    address: str
    port: int
    def __init__(self, address: _Optional[str] = ..., port: _Optional[int] = ...) -> None: ...

class ProbeLinkRequest(_message.Message):
    __slots__ = ("peer", "address", "port", "token", "bytes", "plane")
    PEER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PLANE_FIELD_NUMBER: _ClassVar[int]
    peer: str
    address: str
    port: int
    token: str
    bytes: int
    plane: int
    def __init__(self, peer: _Optional[str] = ..., address: _Optional[str] = ..., port: _Optional[int] = ..., token: _Optional[str] = ..., bytes: _Optional[int] = ..., plane: _Optional[int] = ...) -> None: ...

class LinkMeasurement(_message.Message):
    __slots__ = ("rtt_ms", "mbps", "retrans", "error")
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    MBPS_FIELD_NUMBER: _ClassVar[int]
    RETRANS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    rtt_ms: float
    mbps: float
    retrans: float
    error: str
    def __init__(self, rtt_ms: _Optional[float] = ..., mbps: _Optional[float] = ..., retrans: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class ControlRequest(_message.Message):
    __slots__ = ("id", "method", "request", "timeout_s")
    ID_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    id: int
    method: str
    request: bytes
    timeout_s: float
    def __init__(self, id: _Optional[int] = ..., method: _Optional[str] = ..., request: _Optional[bytes] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class RelayOrder(_message.Message):
    __slots__ = ("method", "request", "timeout_s", "fence", "targets", "expires", "nonce")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    method: str
    request: bytes
    timeout_s: float
    fence: str
    targets: _containers.RepeatedScalarFieldContainer[str]
    expires: float
    nonce: bytes
    def __init__(self, method: _Optional[str] = ..., request: _Optional[bytes] = ..., timeout_s: _Optional[float] = ..., fence: _Optional[str] = ..., targets: _Optional[_Iterable[str]] = ..., expires: _Optional[float] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class RelayTarget(_message.Message):
    __slots__ = ("name", "address")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class RelayRequest(_message.Message):
    __slots__ = ("order", "signature", "targets")
    ORDER_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    order: bytes
    signature: bytes
    targets: _containers.RepeatedCompositeFieldContainer[RelayTarget]
    def __init__(self, order: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., targets: _Optional[_Iterable[_Union[RelayTarget, _Mapping]]] = ...) -> None: ...

class RelayedCall(_message.Message):
    __slots__ = ("order", "signature")
    ORDER_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    order: bytes
    signature: bytes
    def __init__(self, order: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class RelayResult(_message.Message):
    __slots__ = ("name", "reply", "error", "delivered")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_FIELD_NUMBER: _ClassVar[int]
    name: str
    reply: bytes
    error: _common_pb2.ErrorDetail
    delivered: bool
    def __init__(self, name: _Optional[str] = ..., reply: _Optional[bytes] = ..., error: _Optional[_Union[_common_pb2.ErrorDetail, _Mapping]] = ..., delivered: _Optional[bool] = ...) -> None: ...

class RelayReply(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[RelayResult]
    def __init__(self, results: _Optional[_Iterable[_Union[RelayResult, _Mapping]]] = ...) -> None: ...

class ControlReply(_message.Message):
    __slots__ = ("id", "reply", "error")
    ID_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    id: int
    reply: bytes
    error: _common_pb2.ErrorDetail
    def __init__(self, id: _Optional[int] = ..., reply: _Optional[bytes] = ..., error: _Optional[_Union[_common_pb2.ErrorDetail, _Mapping]] = ...) -> None: ...
