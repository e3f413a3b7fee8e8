from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Medium(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEDIUM_UNSPECIFIED: _ClassVar[Medium]
    MEDIUM_SHM: _ClassVar[Medium]
    MEDIUM_CUDA: _ClassVar[Medium]
    MEDIUM_MEMFD: _ClassVar[Medium]

class HintAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HINT_ACTION_UNSPECIFIED: _ClassVar[HintAction]
    HINT_ACTION_PREFETCH: _ClassVar[HintAction]
    HINT_ACTION_RETAIN: _ClassVar[HintAction]
    HINT_ACTION_RELEASE: _ClassVar[HintAction]
    HINT_ACTION_CANCEL: _ClassVar[HintAction]
    HINT_ACTION_ENVELOPE: _ClassVar[HintAction]

class KeyFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KEY_FORMAT_OPAQUE: _ClassVar[KeyFormat]
    KEY_FORMAT_VLLM: _ClassVar[KeyFormat]

class BlockStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCK_STATUS_UNSPECIFIED: _ClassVar[BlockStatus]
    BLOCK_STATUS_DONE: _ClassVar[BlockStatus]
    BLOCK_STATUS_ALREADY_PRESENT: _ClassVar[BlockStatus]
    BLOCK_STATUS_NOT_FOUND: _ClassVar[BlockStatus]
    BLOCK_STATUS_DATA_LOSS: _ClassVar[BlockStatus]
    BLOCK_STATUS_RESOURCE_EXHAUSTED: _ClassVar[BlockStatus]
    BLOCK_STATUS_FAILED: _ClassVar[BlockStatus]
    BLOCK_STATUS_CANCELLED: _ClassVar[BlockStatus]
    BLOCK_STATUS_DEADLINE_EXCEEDED: _ClassVar[BlockStatus]
    BLOCK_STATUS_NOT_ADMITTED: _ClassVar[BlockStatus]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
    TIER_REMOTE: _ClassVar[Tier]
    TIER_SHARED_FS: _ClassVar[Tier]
    TIER_PEER: _ClassVar[Tier]
    TIER_OBJECT: _ClassVar[Tier]
    TIER_MOONCAKE: _ClassVar[Tier]

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_KIND_STORED: _ClassVar[EventKind]
    EVENT_KIND_REMOVED: _ClassVar[EventKind]
    EVENT_KIND_CLEARED: _ClassVar[EventKind]
    EVENT_KIND_HINTED: _ClassVar[EventKind]

class RemovalReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REMOVAL_REASON_UNSPECIFIED: _ClassVar[RemovalReason]
    REMOVAL_REASON_EVICTED: _ClassVar[RemovalReason]
    REMOVAL_REASON_DELETED: _ClassVar[RemovalReason]
    REMOVAL_REASON_CORRUPTED: _ClassVar[RemovalReason]
    REMOVAL_REASON_EXPIRED: _ClassVar[RemovalReason]
    REMOVAL_REASON_CLEARED: _ClassVar[RemovalReason]
MEDIUM_UNSPECIFIED: Medium
MEDIUM_SHM: Medium
MEDIUM_CUDA: Medium
MEDIUM_MEMFD: Medium
HINT_ACTION_UNSPECIFIED: HintAction
HINT_ACTION_PREFETCH: HintAction
HINT_ACTION_RETAIN: HintAction
HINT_ACTION_RELEASE: HintAction
HINT_ACTION_CANCEL: HintAction
HINT_ACTION_ENVELOPE: HintAction
KEY_FORMAT_OPAQUE: KeyFormat
KEY_FORMAT_VLLM: KeyFormat
BLOCK_STATUS_UNSPECIFIED: BlockStatus
BLOCK_STATUS_DONE: BlockStatus
BLOCK_STATUS_ALREADY_PRESENT: BlockStatus
BLOCK_STATUS_NOT_FOUND: BlockStatus
BLOCK_STATUS_DATA_LOSS: BlockStatus
BLOCK_STATUS_RESOURCE_EXHAUSTED: BlockStatus
BLOCK_STATUS_FAILED: BlockStatus
BLOCK_STATUS_CANCELLED: BlockStatus
BLOCK_STATUS_DEADLINE_EXCEEDED: BlockStatus
BLOCK_STATUS_NOT_ADMITTED: BlockStatus
TIER_UNSPECIFIED: Tier
TIER_HOST: Tier
TIER_DISK: Tier
TIER_REMOTE: Tier
TIER_SHARED_FS: Tier
TIER_PEER: Tier
TIER_OBJECT: Tier
TIER_MOONCAKE: Tier
EVENT_KIND_UNSPECIFIED: EventKind
EVENT_KIND_STORED: EventKind
EVENT_KIND_REMOVED: EventKind
EVENT_KIND_CLEARED: EventKind
EVENT_KIND_HINTED: EventKind
REMOVAL_REASON_UNSPECIFIED: RemovalReason
REMOVAL_REASON_EVICTED: RemovalReason
REMOVAL_REASON_DELETED: RemovalReason
REMOVAL_REASON_CORRUPTED: RemovalReason
REMOVAL_REASON_EXPIRED: RemovalReason
REMOVAL_REASON_CLEARED: RemovalReason

class PoolRef(_message.Message):
    __slots__ = ("pool_id", "epoch", "registration_token")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    epoch: int
    registration_token: bytes
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., registration_token: _Optional[bytes] = ...) -> None: ...

class KVSpec(_message.Message):
    __slots__ = ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_size", "dtype", "kv_parts")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_PARTS_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    kv_parts: int
    def __init__(self, num_layers: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., dtype: _Optional[str] = ..., kv_parts: _Optional[int] = ...) -> None: ...

class Sharding(_message.Message):
    __slots__ = ("model", "tp_rank", "tp_size", "total_kv_heads", "kv_format")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    KV_FORMAT_FIELD_NUMBER: _ClassVar[int]
    model: str
    tp_rank: int
    tp_size: int
    total_kv_heads: int
    kv_format: str
    def __init__(self, model: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., total_kv_heads: _Optional[int] = ..., kv_format: _Optional[str] = ...) -> None: ...

class PoolHandle(_message.Message):
    __slots__ = ("medium", "path", "cuda_ipc_handle", "device", "offset", "device_uuid")
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    medium: Medium
    path: str
    cuda_ipc_handle: bytes
    device: int
    offset: int
    device_uuid: str
    def __init__(self, medium: _Optional[_Union[Medium, str]] = ..., path: _Optional[str] = ..., cuda_ipc_handle: _Optional[bytes] = ..., device: _Optional[int] = ..., offset: _Optional[int] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class PoolInfo(_message.Message):
    __slots__ = ("pool_id", "epoch", "spec", "layout", "layout_name", "strides", "nbytes", "block_bytes", "owned", "handle", "runs_per_block", "cache_group", "sharding", "stored_block_bytes")
    class StridesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_NAME_FIELD_NUMBER: _ClassVar[int]
    STRIDES_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    OWNED_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    RUNS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    CACHE_GROUP_FIELD_NUMBER: _ClassVar[int]
    SHARDING_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    epoch: int
    spec: KVSpec
    layout: str
    layout_name: str
    strides: _containers.ScalarMap[str, int]
    nbytes: int
    block_bytes: int
    owned: bool
    handle: PoolHandle
    runs_per_block: int
    cache_group: str
    sharding: Sharding
    stored_block_bytes: int
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., spec: _Optional[_Union[KVSpec, _Mapping]] = ..., layout: _Optional[str] = ..., layout_name: _Optional[str] = ..., strides: _Optional[_Mapping[str, int]] = ..., nbytes: _Optional[int] = ..., block_bytes: _Optional[int] = ..., owned: _Optional[bool] = ..., handle: _Optional[_Union[PoolHandle, _Mapping]] = ..., runs_per_block: _Optional[int] = ..., cache_group: _Optional[str] = ..., sharding: _Optional[_Union[Sharding, _Mapping]] = ..., stored_block_bytes: _Optional[int] = ...) -> None: ...

class GetPoolInfoRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class GetPoolInfoResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolInfo]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolInfo, _Mapping]]] = ...) -> None: ...

class OffloadRequest(_message.Message):
    __slots__ = ("pool", "namespace", "slots", "keys", "wait", "lease_ms", "client_id", "cuda_event_handle", "pool_deadline_ns", "engine", "hint")
    POOL_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    CUDA_EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    POOL_DEADLINE_NS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    HINT_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    namespace: str
    slots: _containers.RepeatedScalarFieldContainer[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    wait: bool
    lease_ms: int
    client_id: str
    cuda_event_handle: bytes
    pool_deadline_ns: int
    engine: EngineBlocks
    hint: BlockHint
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ..., namespace: _Optional[str] = ..., slots: _Optional[_Iterable[int]] = ..., keys: _Optional[_Iterable[bytes]] = ..., wait: _Optional[bool] = ..., lease_ms: _Optional[int] = ..., client_id: _Optional[str] = ..., cuda_event_handle: _Optional[bytes] = ..., pool_deadline_ns: _Optional[int] = ..., engine: _Optional[_Union[EngineBlocks, _Mapping]] = ..., hint: _Optional[_Union[BlockHint, _Mapping]] = ...) -> None: ...

class BlockHint(_message.Message):
    __slots__ = ("action", "ttl_s")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    action: HintAction
    ttl_s: int
    def __init__(self, action: _Optional[_Union[HintAction, str]] = ..., ttl_s: _Optional[int] = ...) -> None: ...

class HintRequest(_message.Message):
    __slots__ = ("pool", "namespace", "action", "keys", "ttl_s", "request_id", "envelope", "key_format")
    POOL_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    KEY_FORMAT_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    namespace: str
    action: HintAction
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    ttl_s: int
    request_id: str
    envelope: bytes
    key_format: KeyFormat
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ..., namespace: _Optional[str] = ..., action: _Optional[_Union[HintAction, str]] = ..., keys: _Optional[_Iterable[bytes]] = ..., ttl_s: _Optional[int] = ..., request_id: _Optional[str] = ..., envelope: _Optional[bytes] = ..., key_format: _Optional[_Union[KeyFormat, str]] = ...) -> None: ...

class HintResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineBlocks(_message.Message):
    __slots__ = ("key_format", "parent_block_hash", "block_size", "token_ids", "lora_name", "lora_id", "extra_keys")
    KEY_FORMAT_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    key_format: KeyFormat
    parent_block_hash: bytes
    block_size: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    lora_name: str
    lora_id: int
    extra_keys: _containers.RepeatedCompositeFieldContainer[BlockExtraKeys]
    def __init__(self, key_format: _Optional[_Union[KeyFormat, str]] = ..., parent_block_hash: _Optional[bytes] = ..., block_size: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., lora_name: _Optional[str] = ..., lora_id: _Optional[int] = ..., extra_keys: _Optional[_Iterable[_Union[BlockExtraKeys, _Mapping]]] = ...) -> None: ...

class BlockExtraKeys(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[ExtraKey]
    def __init__(self, keys: _Optional[_Iterable[_Union[ExtraKey, _Mapping]]] = ...) -> None: ...

class ExtraKey(_message.Message):
    __slots__ = ("text", "media", "digest")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    text: str
    media: MediaOffset
    digest: bytes
    def __init__(self, text: _Optional[str] = ..., media: _Optional[_Union[MediaOffset, _Mapping]] = ..., digest: _Optional[bytes] = ...) -> None: ...

class MediaOffset(_message.Message):
    __slots__ = ("identifier", "offset")
    IDENTIFIER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    identifier: str
    offset: int
    def __init__(self, identifier: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("pool", "namespace", "keys", "slots", "wait", "lease_ms", "client_id", "pool_deadline_ns", "peer")
    POOL_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_DEADLINE_NS_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    slots: _containers.RepeatedScalarFieldContainer[int]
    wait: bool
    lease_ms: int
    client_id: str
    pool_deadline_ns: int
    peer: str
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ..., namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., slots: _Optional[_Iterable[int]] = ..., wait: _Optional[bool] = ..., lease_ms: _Optional[int] = ..., client_id: _Optional[str] = ..., pool_deadline_ns: _Optional[int] = ..., peer: _Optional[str] = ...) -> None: ...

class TransferResponse(_message.Message):
    __slots__ = ("job_id", "statuses", "bytes", "seconds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    statuses: _containers.RepeatedScalarFieldContainer[BlockStatus]
    bytes: int
    seconds: float
    def __init__(self, job_id: _Optional[int] = ..., statuses: _Optional[_Iterable[_Union[BlockStatus, str]]] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("pools", "namespace", "keys")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolRef]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolRef, _Mapping]]] = ..., namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("hits", "tiers")
    HITS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    hits: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, hits: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("pool", "namespace", "keys")
    POOL_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ..., namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("pool_id", "registration_token")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    registration_token: bytes
    def __init__(self, pool_id: _Optional[str] = ..., registration_token: _Optional[bytes] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "capacity_blocks", "used_blocks", "ready_blocks", "pinned_blocks", "evictions", "slot_bytes", "degraded", "events", "loading", "warming")
    class EventsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    READY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    LOADING_FIELD_NUMBER: _ClassVar[int]
    WARMING_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    capacity_blocks: int
    used_blocks: int
    ready_blocks: int
    pinned_blocks: int
    evictions: int
    slot_bytes: int
    degraded: bool
    events: _containers.ScalarMap[str, int]
    loading: bool
    warming: bool
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., capacity_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., ready_blocks: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., evictions: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., degraded: _Optional[bool] = ..., events: _Optional[_Mapping[str, int]] = ..., loading: _Optional[bool] = ..., warming: _Optional[bool] = ...) -> None: ...

class TransferStats(_message.Message):
    __slots__ = ("blocks", "bytes", "seconds")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    bytes: int
    seconds: float
    def __init__(self, blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("pool_id", "epoch", "tiers", "offloaded", "restored", "outcomes", "jobs", "cache_group", "lookup_keys", "lookup_hits", "block_tokens")
    class OutcomesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    OFFLOADED_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FIELD_NUMBER: _ClassVar[int]
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    CACHE_GROUP_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_KEYS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HITS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    epoch: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    offloaded: TransferStats
    restored: TransferStats
    outcomes: _containers.ScalarMap[str, int]
    jobs: JobStats
    cache_group: str
    lookup_keys: int
    lookup_hits: int
    block_tokens: int
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., offloaded: _Optional[_Union[TransferStats, _Mapping]] = ..., restored: _Optional[_Union[TransferStats, _Mapping]] = ..., outcomes: _Optional[_Mapping[str, int]] = ..., jobs: _Optional[_Union[JobStats, _Mapping]] = ..., cache_group: _Optional[str] = ..., lookup_keys: _Optional[int] = ..., lookup_hits: _Optional[int] = ..., block_tokens: _Optional[int] = ...) -> None: ...

class JobStats(_message.Message):
    __slots__ = ("queued", "running", "unclaimed", "completed", "cancelled", "expired")
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    UNCLAIMED_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    queued: int
    running: int
    unclaimed: int
    completed: int
    cancelled: int
    expired: int
    def __init__(self, queued: _Optional[int] = ..., running: _Optional[int] = ..., unclaimed: _Optional[int] = ..., completed: _Optional[int] = ..., cancelled: _Optional[int] = ..., expired: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStats]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolStats, _Mapping]]] = ...) -> None: ...

class RegisterPoolRequest(_message.Message):
    __slots__ = ("pool_id", "spec", "layout", "handle", "host_capacity_mib", "cache_group", "registration_token", "sharding", "share_with_peers", "share_events", "chosen_token")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    HOST_CAPACITY_MIB_FIELD_NUMBER: _ClassVar[int]
    CACHE_GROUP_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SHARDING_FIELD_NUMBER: _ClassVar[int]
    SHARE_WITH_PEERS_FIELD_NUMBER: _ClassVar[int]
    SHARE_EVENTS_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    spec: KVSpec
    layout: str
    handle: PoolHandle
    host_capacity_mib: int
    cache_group: str
    registration_token: bytes
    sharding: Sharding
    share_with_peers: bool
    share_events: bool
    chosen_token: bytes
    def __init__(self, pool_id: _Optional[str] = ..., spec: _Optional[_Union[KVSpec, _Mapping]] = ..., layout: _Optional[str] = ..., handle: _Optional[_Union[PoolHandle, _Mapping]] = ..., host_capacity_mib: _Optional[int] = ..., cache_group: _Optional[str] = ..., registration_token: _Optional[bytes] = ..., sharding: _Optional[_Union[Sharding, _Mapping]] = ..., share_with_peers: _Optional[bool] = ..., share_events: _Optional[bool] = ..., chosen_token: _Optional[bytes] = ...) -> None: ...

class RegisterPoolResponse(_message.Message):
    __slots__ = ("pool", "registration_token")
    POOL_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    pool: PoolInfo
    registration_token: bytes
    def __init__(self, pool: _Optional[_Union[PoolInfo, _Mapping]] = ..., registration_token: _Optional[bytes] = ...) -> None: ...

class UnregisterPoolRequest(_message.Message):
    __slots__ = ("pool", "drain_timeout_ms", "registration_token")
    POOL_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    drain_timeout_ms: int
    registration_token: bytes
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ..., drain_timeout_ms: _Optional[int] = ..., registration_token: _Optional[bytes] = ...) -> None: ...

class UnregisterPoolResponse(_message.Message):
    __slots__ = ("cancelled_jobs",)
    CANCELLED_JOBS_FIELD_NUMBER: _ClassVar[int]
    cancelled_jobs: int
    def __init__(self, cancelled_jobs: _Optional[int] = ...) -> None: ...

class WaitJobsRequest(_message.Message):
    __slots__ = ("pool", "client_id", "job_ids", "timeout_ms", "wait_all")
    POOL_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_IDS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    WAIT_ALL_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    client_id: str
    job_ids: _containers.RepeatedScalarFieldContainer[int]
    timeout_ms: int
    wait_all: bool
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ..., client_id: _Optional[str] = ..., job_ids: _Optional[_Iterable[int]] = ..., timeout_ms: _Optional[int] = ..., wait_all: _Optional[bool] = ...) -> None: ...

class JobResult(_message.Message):
    __slots__ = ("job_id", "statuses", "bytes", "seconds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    statuses: _containers.RepeatedScalarFieldContainer[BlockStatus]
    bytes: int
    seconds: float
    def __init__(self, job_id: _Optional[int] = ..., statuses: _Optional[_Iterable[_Union[BlockStatus, str]]] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("sequence", "timestamp", "kind", "tier", "cache_group", "namespace", "keys", "reason", "engine", "hint")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CACHE_GROUP_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    HINT_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    timestamp: float
    kind: EventKind
    tier: Tier
    cache_group: str
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    reason: RemovalReason
    engine: EngineBlocks
    hint: HintTrace
    def __init__(self, sequence: _Optional[int] = ..., timestamp: _Optional[float] = ..., kind: _Optional[_Union[EventKind, str]] = ..., tier: _Optional[_Union[Tier, str]] = ..., cache_group: _Optional[str] = ..., namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., reason: _Optional[_Union[RemovalReason, str]] = ..., engine: _Optional[_Union[EngineBlocks, _Mapping]] = ..., hint: _Optional[_Union[HintTrace, _Mapping]] = ...) -> None: ...

class HintTrace(_message.Message):
    __slots__ = ("message_id", "action_id", "action_type", "outcome")
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_TYPE_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    message_id: str
    action_id: str
    action_type: str
    outcome: str
    def __init__(self, message_id: _Optional[str] = ..., action_id: _Optional[str] = ..., action_type: _Optional[str] = ..., outcome: _Optional[str] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("from_sequence", "namespaces", "stream_id", "pools")
    FROM_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    from_sequence: int
    namespaces: _containers.RepeatedScalarFieldContainer[str]
    stream_id: str
    pools: _containers.RepeatedCompositeFieldContainer[PoolRef]
    def __init__(self, from_sequence: _Optional[int] = ..., namespaces: _Optional[_Iterable[str]] = ..., stream_id: _Optional[str] = ..., pools: _Optional[_Iterable[_Union[PoolRef, _Mapping]]] = ...) -> None: ...

class WatchEventsResponse(_message.Message):
    __slots__ = ("stream_id", "events", "resync", "next_sequence")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    resync: bool
    next_sequence: int
    def __init__(self, stream_id: _Optional[str] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ..., resync: _Optional[bool] = ..., next_sequence: _Optional[int] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("namespaces", "pools")
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedScalarFieldContainer[str]
    pools: _containers.RepeatedCompositeFieldContainer[PoolRef]
    def __init__(self, namespaces: _Optional[_Iterable[str]] = ..., pools: _Optional[_Iterable[_Union[PoolRef, _Mapping]]] = ...) -> None: ...

class SnapshotResponse(_message.Message):
    __slots__ = ("stream_id", "sequence", "tier", "cache_group", "namespace", "keys")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CACHE_GROUP_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    sequence: int
    tier: Tier
    cache_group: str
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, stream_id: _Optional[str] = ..., sequence: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ..., cache_group: _Optional[str] = ..., namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class WaitJobsResponse(_message.Message):
    __slots__ = ("finished", "unknown_job_ids")
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_JOB_IDS_FIELD_NUMBER: _ClassVar[int]
    finished: _containers.RepeatedCompositeFieldContainer[JobResult]
    unknown_job_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, finished: _Optional[_Iterable[_Union[JobResult, _Mapping]]] = ..., unknown_job_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PeerConnectRequest(_message.Message):
    __slots__ = ("peer", "agent_metadata")
    PEER_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    peer: str
    agent_metadata: bytes
    def __init__(self, peer: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ...) -> None: ...

class PeerConnectResponse(_message.Message):
    __slots__ = ("peer", "agent_metadata")
    PEER_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    peer: str
    agent_metadata: bytes
    def __init__(self, peer: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ...) -> None: ...

class PeerLookupRequest(_message.Message):
    __slots__ = ("peer", "namespace", "block_format", "keys", "cache_group")
    PEER_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FORMAT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CACHE_GROUP_FIELD_NUMBER: _ClassVar[int]
    peer: str
    namespace: str
    block_format: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    cache_group: str
    def __init__(self, peer: _Optional[str] = ..., namespace: _Optional[str] = ..., block_format: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., cache_group: _Optional[str] = ...) -> None: ...

class PeerLookupResponse(_message.Message):
    __slots__ = ("present",)
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, present: _Optional[_Iterable[bool]] = ...) -> None: ...

class PeerLeaseRequest(_message.Message):
    __slots__ = ("peer", "namespace", "block_format", "keys", "lease_ms", "cache_group")
    PEER_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FORMAT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    CACHE_GROUP_FIELD_NUMBER: _ClassVar[int]
    peer: str
    namespace: str
    block_format: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    lease_ms: int
    cache_group: str
    def __init__(self, peer: _Optional[str] = ..., namespace: _Optional[str] = ..., block_format: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., lease_ms: _Optional[int] = ..., cache_group: _Optional[str] = ...) -> None: ...

class LeasedBlock(_message.Message):
    __slots__ = ("position", "address", "checksum")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    position: int
    address: int
    checksum: int
    def __init__(self, position: _Optional[int] = ..., address: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class PeerLeaseResponse(_message.Message):
    __slots__ = ("lease_id", "blocks", "block_bytes", "lease_ms", "memory_metadata")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_METADATA_FIELD_NUMBER: _ClassVar[int]
    lease_id: bytes
    blocks: _containers.RepeatedCompositeFieldContainer[LeasedBlock]
    block_bytes: int
    lease_ms: int
    memory_metadata: bytes
    def __init__(self, lease_id: _Optional[bytes] = ..., blocks: _Optional[_Iterable[_Union[LeasedBlock, _Mapping]]] = ..., block_bytes: _Optional[int] = ..., lease_ms: _Optional[int] = ..., memory_metadata: _Optional[bytes] = ...) -> None: ...

class PeerReleaseRequest(_message.Message):
    __slots__ = ("peer", "lease_id", "corrupt_positions")
    PEER_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    peer: str
    lease_id: bytes
    corrupt_positions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, peer: _Optional[str] = ..., lease_id: _Optional[bytes] = ..., corrupt_positions: _Optional[_Iterable[int]] = ...) -> None: ...

class PeerReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("pool", "namespace", "keys", "peer")
    POOL_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    pool: PoolRef
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    peer: str
    def __init__(self, pool: _Optional[_Union[PoolRef, _Mapping]] = ..., namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., peer: _Optional[str] = ...) -> None: ...

class PeerReserveRequest(_message.Message):
    __slots__ = ("peer", "namespace", "block_format", "keys", "lease_ms", "cache_group")
    PEER_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FORMAT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    CACHE_GROUP_FIELD_NUMBER: _ClassVar[int]
    peer: str
    namespace: str
    block_format: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    lease_ms: int
    cache_group: str
    def __init__(self, peer: _Optional[str] = ..., namespace: _Optional[str] = ..., block_format: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., lease_ms: _Optional[int] = ..., cache_group: _Optional[str] = ...) -> None: ...

class PeerReserveResponse(_message.Message):
    __slots__ = ("reservation_id", "blocks", "present_positions", "block_bytes", "lease_ms", "memory_metadata")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PRESENT_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_METADATA_FIELD_NUMBER: _ClassVar[int]
    reservation_id: bytes
    blocks: _containers.RepeatedCompositeFieldContainer[LeasedBlock]
    present_positions: _containers.RepeatedScalarFieldContainer[int]
    block_bytes: int
    lease_ms: int
    memory_metadata: bytes
    def __init__(self, reservation_id: _Optional[bytes] = ..., blocks: _Optional[_Iterable[_Union[LeasedBlock, _Mapping]]] = ..., present_positions: _Optional[_Iterable[int]] = ..., block_bytes: _Optional[int] = ..., lease_ms: _Optional[int] = ..., memory_metadata: _Optional[bytes] = ...) -> None: ...

class PeerCommitRequest(_message.Message):
    __slots__ = ("peer", "reservation_id", "checksums")
    PEER_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    peer: str
    reservation_id: bytes
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, peer: _Optional[str] = ..., reservation_id: _Optional[bytes] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class PeerCommitResponse(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, stored: _Optional[_Iterable[bool]] = ...) -> None: ...
