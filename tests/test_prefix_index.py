"""The router's record of what each decode worker holds in its prefix cache (router/prefix_index.py)."""
from dataclasses import dataclass

from splitserve.router.prefix_index import PrefixIndex, chain


@dataclass
class W:
    worker_id: str
    epoch: str = "e1"
    kv_capacity_tokens: int = 10_000


def test_a_prompt_matches_the_whole_blocks_a_worker_computed_leaving_its_last_token():
    idx = PrefixIndex(block_size=4)
    idx.workers([W("d0"), W("d1")])
    first = list(range(10))  # 2 whole blocks and 2 tokens
    idx.record("d0", idx.chain(first))
    assert idx.cached_tokens("d0", idx.prompt_chain(first + [50, 51, 52])) == 8
    assert idx.cached_tokens("d1", idx.prompt_chain(first + [50, 51, 52])) == 0
    # The same 8 tokens as the whole prompt: the last one is left to compute, so 1 block.
    assert idx.cached_tokens("d0", idx.prompt_chain(first[:8])) == 4
    # A prompt that differs in its second block keeps only the first.
    assert idx.cached_tokens("d0", idx.prompt_chain([0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10])) == 4
    # A block of the same tokens after a different first block is a different block.
    assert idx.cached_tokens("d0", idx.prompt_chain([9, 9, 9, 9, 4, 5, 6, 7, 8])) == 0
    # The completion's blocks count too, once recorded after the prompt's.
    idx.record("d0", idx.chain(first + [10, 11, 12, 13, 14, 15]))
    assert idx.cached_tokens("d0", idx.prompt_chain(list(range(20)))) == 16


def test_a_salt_roots_its_own_chain():
    idx = PrefixIndex(block_size=4)
    idx.record("d0", idx.chain(list(range(12)), "alice"))
    assert idx.cached_tokens("d0", idx.prompt_chain(list(range(13)), "alice")) == 12
    assert idx.cached_tokens("d0", idx.prompt_chain(list(range(13)), "bob")) == 0
    assert idx.cached_tokens("d0", idx.prompt_chain(list(range(13)))) == 0
    assert chain(list(range(8)), 4, "a") != chain(list(range(8)), 4, "b")
    # Gone on from a prompt's hashes (as the router records a completion), the chain is the same.
    whole = list(range(30))
    assert idx.chain(whole, "alice", idx.prompt_chain(whole[:13], "alice")) == idx.chain(whole, "alice")
    assert len(idx.chain(whole, "alice")) == 7


def test_a_worker_keeps_at_most_its_kv_caches_blocks_and_drops_the_ends_of_chains_first():
    idx = PrefixIndex(block_size=4)
    idx.workers([W("d0", kv_capacity_tokens=16)])  # 4 blocks
    idx.record("d0", idx.chain(list(range(100, 124))))  # 6 blocks: the last 2 do not fit
    assert len(idx.blocks["d0"]) == 4
    assert idx.cached_tokens("d0", idx.prompt_chain(list(range(100, 125)))) == 16
    idx.record("d0", idx.chain(list(range(8))))  # the newest 2 blocks push out the oldest chain's last 2
    assert idx.cached_tokens("d0", idx.prompt_chain(list(range(9)))) == 8
    assert idx.cached_tokens("d0", idx.prompt_chain(list(range(100, 125)))) == 8


def test_a_restarted_or_departed_worker_starts_empty():
    idx = PrefixIndex(block_size=4)
    idx.workers([W("d0"), W("d1")])
    for w in ("d0", "d1"):
        idx.record(w, idx.chain(list(range(9))))
    hashes = idx.prompt_chain(list(range(9)))
    idx.workers([W("d0", epoch="e2"), W("d1")])  # d0 restarted
    assert (idx.cached_tokens("d0", hashes), idx.cached_tokens("d1", hashes)) == (0, 8)
    idx.workers([W("d0", epoch="e2")])  # d1 left the registry
    assert idx.cached_tokens("d1", hashes) == 0 and "d1" not in idx.blocks
