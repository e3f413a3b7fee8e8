"""What a store says of its blocks (``manager.describe``): tokens and parent only where they are the
blocks' own; otherwise the keys alone, so that no event claims tokens another block holds."""

from types import SimpleNamespace

from vllm.v1.kv_offload.base import ReqContext, make_offload_key

from kvxfer.integrations.vllm.manager import describe

SIZE = 4


def request(blocks: int = 5):
    hashes = [bytes([i]) * 32 for i in range(1, blocks + 1)]
    return SimpleNamespace(block_hashes=hashes, all_token_ids=list(range(100, 100 + SIZE * blocks + 2)))


def keys_at(req, context, positions):
    keys = []
    for i in positions:
        key = make_offload_key(req.block_hashes[i], 0)
        context.set_offload_key_position(key, (i + 1) * SIZE)
        keys.append(key)
    return keys


def test_consecutive_blocks_carry_their_tokens_and_parent():
    req, context = request(), ReqContext("r")
    first = describe(keys_at(req, context, [0, 1]), req, context, SIZE, "ns")
    assert (first.token_ids, first.parent, first.block_size) == (list(range(100, 108)), b"", SIZE)
    later = describe(keys_at(req, context, [2, 3, 4]), req, context, SIZE, "ns")
    assert later.token_ids == list(range(108, 120)) and later.parent == req.block_hashes[1]


def test_anything_else_carries_the_keys_alone():
    req, context = request(), ReqContext("r")
    gap = keys_at(req, context, [1, 3])
    unknown = [make_offload_key(b"\x09" * 32, 0)]  # no position recorded
    wrong = keys_at(req, context, [2])
    context.set_offload_key_position(wrong[0], 2 * SIZE)  # a position whose block has another hash
    for keys, req_ in ((gap, req), (unknown, req), (wrong, req), (keys_at(req, context, [0]), None)):
        spec = describe(keys, req_, context, SIZE, "ns")
        assert (spec.keys, spec.token_ids, spec.parent, spec.block_size) == (keys, (), b"", 0)


def test_a_salted_request_says_its_salt_on_its_first_block_as_vllm_publishes_it():
    req, context = request(), ReqContext("r")
    req.cache_salt, req.lora_request, req.mm_features, req.prompt_embeds = "alice", None, None, None
    first = describe(keys_at(req, context, [0, 1]), req, context, SIZE, "ns")
    assert first.extra_keys == (("alice",), ()) and (first.lora_name, first.lora_id) == ("", 0)
    later = describe(keys_at(req, context, [2, 3]), req, context, SIZE, "ns")
    assert later.extra_keys == ((), ())
    req.cache_salt = None
    assert describe(keys_at(req, context, [0]), req, context, SIZE, "ns").extra_keys == ()  # nothing entered the hash


def test_extra_keys_the_daemon_would_refuse_cost_the_tokens_not_the_store():
    req, context = request(), ReqContext("r")
    req.cache_salt, req.lora_request, req.mm_features, req.prompt_embeds = "s" * 2000, None, None, None
    spec = describe(keys_at(req, context, [0, 1]), req, context, SIZE, "ns")
    assert (spec.token_ids, spec.extra_keys, spec.parent, spec.block_size) == ((), (), b"", 0) and len(spec.keys) == 2
