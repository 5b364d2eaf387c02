"""Prompt block keys: chaining, full blocks only, seeds, the estimate backend, memoisation."""

from array import array

from scheduling_helpers import prompt, request

from router.scheduling.hashing import chain_seed, chained_keys, request_block_keys, tokens_to_bytes
from router.scheduling.types import LLMRequest


def test_keys_are_shared_up_to_the_first_differing_block_then_differ():
    a = prompt(1, 256)
    b = a[:128] + prompt(2, 128)
    ka, kb = request_block_keys(request(a), 64), request_block_keys(request(b), 64)
    assert len(ka) == len(kb) == 4
    assert ka[:2] == kb[:2]
    assert all(x != y for x, y in zip(ka[2:], kb[2:]))


def test_a_later_block_depends_on_every_earlier_block():
    a = prompt(1, 256)
    b = [a[0] + 1] + a[1:]  # only block 0 differs
    ka, kb = request_block_keys(request(a), 64), request_block_keys(request(b), 64)
    assert all(x != y for x, y in zip(ka, kb))


def test_only_full_blocks_are_hashed_and_the_cap_applies():
    assert len(request_block_keys(request(prompt(1, 64 * 3 + 63)), 64)) == 3
    assert len(request_block_keys(request(prompt(1, 63)), 64)) == 0
    assert len(request_block_keys(request(prompt(1, 640)), 64, max_blocks=4)) == 4


def test_model_and_cache_salt_change_the_chain():
    tokens = prompt(1, 128)
    base = request_block_keys(request(tokens, model="m"), 64)
    assert request_block_keys(request(tokens, model="other"), 64) != base
    assert request_block_keys(request(tokens, model="m", cache_salt="s"), 64) != base
    assert chain_seed("m") != chain_seed("m", "")


def test_estimate_backend_hashes_four_bytes_per_token():
    text = ("the same long system prompt. " * 40).encode()  # 1160 bytes -> 290 pseudo-tokens
    req = LLMRequest(request_id="r", model="m", prompt_bytes=text)
    assert req.prompt_tokens == 290
    assert len(request_block_keys(req, 64)) == 4  # 256 bytes per block
    same_start = LLMRequest(request_id="r2", model="m", prompt_bytes=text[:600] + b"different")
    assert request_block_keys(same_start, 64)[:2] == request_block_keys(req, 64)[:2]


def test_keys_are_memoised_on_the_request():
    req = request(prompt(1, 256))
    assert request_block_keys(req, 64) is request_block_keys(req, 64)
    assert list(req.block_key_cache) == [(64, 0)]


def test_token_packing_matches_an_array_of_uint32():
    tokens = [0, 1, 2**32 - 1]
    assert tokens_to_bytes(tokens) == tokens_to_bytes(array("I", tokens)) and len(tokens_to_bytes(tokens)) == 12
    assert chained_keys(tokens_to_bytes(tokens), 4, seed=7) == chained_keys(tokens_to_bytes(tokens), 4, seed=7)
