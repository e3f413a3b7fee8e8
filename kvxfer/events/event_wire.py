"""KV events to and from the kvxfer.v1 protobuf messages (the daemon and the client read them alike)."""

from __future__ import annotations

from kvxfer.core.errors import InvalidArgument
from kvxfer.core.records import PB_TO_TIER, TIER_TO_PB
from kvxfer.events.event_records import (EngineBlocks, EventKind, ExtraKeys, HintTrace, KeyFormat, Reason, TierEvent,
                                         engine_hash)
from kvxfer.v1 import kvxfer_pb2 as pb

KIND_TO_PB = {EventKind.STORED: pb.EVENT_KIND_STORED, EventKind.REMOVED: pb.EVENT_KIND_REMOVED,
              EventKind.CLEARED: pb.EVENT_KIND_CLEARED, EventKind.HINTED: pb.EVENT_KIND_HINTED}
PB_TO_KIND = {v: k for k, v in KIND_TO_PB.items()}
REASON_TO_PB = {Reason.EVICTED: pb.REMOVAL_REASON_EVICTED, Reason.DELETED: pb.REMOVAL_REASON_DELETED,
                Reason.CORRUPTED: pb.REMOVAL_REASON_CORRUPTED, Reason.EXPIRED: pb.REMOVAL_REASON_EXPIRED,
                Reason.CLEARED: pb.REMOVAL_REASON_CLEARED}
PB_TO_REASON = {v: k for k, v in REASON_TO_PB.items()}
FORMAT_TO_PB = {KeyFormat.OPAQUE: pb.KEY_FORMAT_OPAQUE, KeyFormat.VLLM: pb.KEY_FORMAT_VLLM}
PB_TO_FORMAT = {v: k for k, v in FORMAT_TO_PB.items()}


def engine_from_pb(msg: pb.EngineBlocks) -> EngineBlocks:
    """A request's engine description (checked against its keys by ``TransferBatch.build``)."""
    key_format = PB_TO_FORMAT.get(msg.key_format)
    if key_format is None:
        raise InvalidArgument(f"unknown key_format {msg.key_format}")
    return EngineBlocks(key_format, (), msg.parent_block_hash, msg.block_size, msg.token_ids, msg.lora_name,
                        msg.lora_id, tuple(_extras_from_pb(block) for block in msg.extra_keys))


def engine_to_pb(engine: EngineBlocks) -> pb.EngineBlocks:
    return pb.EngineBlocks(key_format=FORMAT_TO_PB[engine.key_format], parent_block_hash=engine.parent_block_hash,
                           block_size=engine.block_size, token_ids=[int(t) for t in engine.token_ids],
                           lora_name=engine.lora_name, lora_id=engine.lora_id,
                           extra_keys=[_extras_to_pb(block) for block in engine.extra_keys])


def _extras_from_pb(block: pb.BlockExtraKeys) -> ExtraKeys:
    return tuple(_EXTRA_FROM_PB[key.WhichOneof("value") or "text"](key) for key in block.keys)


#: One extra key from the wire, by the field its oneof holds (none set: an empty text, refused by the batch's checks).
_EXTRA_FROM_PB = {"text": lambda key: key.text, "digest": lambda key: key.digest,
                  "media": lambda key: (key.media.identifier, key.media.offset)}


def _extras_to_pb(extras: ExtraKeys) -> pb.BlockExtraKeys:
    out = pb.BlockExtraKeys()
    for value in extras:
        if isinstance(value, str):
            out.keys.add(text=value)
        elif isinstance(value, bytes):
            out.keys.add(digest=value)
        else:
            out.keys.add(media=pb.MediaOffset(identifier=value[0], offset=value[1]))
    return out


def event_to_pb(event: TierEvent) -> pb.KVEvent:
    msg = pb.KVEvent(sequence=event.sequence, timestamp=event.timestamp, kind=KIND_TO_PB[event.kind],
                     tier=TIER_TO_PB[event.tier], cache_group=event.cache_group, namespace=event.namespace,
                     keys=event.keys, reason=REASON_TO_PB[event.reason] if event.reason else 0)
    if event.hint is not None:
        h = event.hint
        msg.hint.CopyFrom(pb.HintTrace(message_id=h.message_id, action_id=h.action_id, action_type=h.action_type,
                                       outcome=h.outcome))
    if event.engine is not None:  # the part of the offload's description these blocks are
        engine = event.engine
        tokens = [t for key in event.keys for t in engine.tokens_of(key)] if len(engine.token_ids) else []
        before = engine.parent_of(event.keys[0]) if event.keys else None
        parent = engine.parent_block_hash if before is None else engine_hash(before, engine.key_format)[0]
        extras = [_extras_to_pb(engine.extras_of(key) or ()) for key in event.keys] if engine.extra_keys else []
        msg.engine.CopyFrom(pb.EngineBlocks(key_format=FORMAT_TO_PB[engine.key_format], parent_block_hash=parent,
                                            block_size=engine.block_size, token_ids=tokens, lora_name=engine.lora_name,
                                            lora_id=engine.lora_id, extra_keys=extras))
    return msg


def event_from_pb(msg: pb.KVEvent) -> TierEvent:
    engine = None
    if msg.HasField("engine"):
        engine = EngineBlocks(PB_TO_FORMAT.get(msg.engine.key_format, KeyFormat.OPAQUE), tuple(msg.keys),
                              msg.engine.parent_block_hash, msg.engine.block_size, tuple(msg.engine.token_ids),
                              msg.engine.lora_name, msg.engine.lora_id,
                              tuple(_extras_from_pb(block) for block in msg.engine.extra_keys))
    hint = HintTrace(msg.hint.message_id, msg.hint.action_id, msg.hint.action_type, msg.hint.outcome) \
        if msg.HasField("hint") else None
    return TierEvent(msg.sequence, msg.timestamp, PB_TO_KIND[msg.kind], PB_TO_TIER[msg.tier], msg.cache_group,
                     msg.namespace, tuple(msg.keys), PB_TO_REASON.get(msg.reason), engine, hint=hint)


__all__ = ["engine_from_pb", "engine_to_pb", "event_from_pb", "event_to_pb"]
