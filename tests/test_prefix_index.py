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


def test_the_chain_is_the_same_in_every_process():
    """Routers share their records (prefix_share.py): a prompt's hashes may not depend on the
    process's hash salt (PYTHONHASHSEED), as a str's hash does."""
    import os
    import subprocess
    import sys

    code = (
        "from splitserve.router.prefix_index import chain; "
        "print(chain(list(range(40)), 16, 'tenant-a'), chain(list(range(40)), 16))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2", "random")
    }
    assert outs == {f"{chain(list(range(40)), 16, 'tenant-a')} {chain(list(range(40)), 16)}\n"}


def test_routers_share_what_they_record_through_redis(redis_socket):
    """Two routers' records over a real Redis: what one records reaches the other's, for the runs
    of workers it knows; its own entries are not applied again; the stream has a TTL."""
    import asyncio

    import redis.asyncio as aioredis

    from splitserve.router.prefix_share import STREAM_TTL_S, SharedRecord

    key = "{t}:prefix-records"

    async def main():
        clients = [aioredis.Redis(unix_socket_path=redis_socket) for _ in range(2)]
        idx = [PrefixIndex(block_size=4), PrefixIndex(block_size=4)]
        for i in idx:
            i.workers([W("d0"), W("d1", epoch="e2")])
        a, b = (SharedRecord(c, key, f"router-{n}", i) for c, n, i in zip(clients, "ab", idx))
        tasks = [asyncio.create_task(x.run()) for x in (a, b)]
        try:
            await asyncio.wait_for(asyncio.gather(a.reading.wait(), b.reading.wait()), 10)
            prompt = list(range(10))
            applied = []
            a.apply, b.apply = _counting(a.apply, applied, "a"), _counting(b.apply, applied, "b")
            idx[0].record("d0", idx[0].chain(prompt))
            a.publish("d0", "e1", idx[0].chain(prompt))
            a.publish("d1", "e1", idx[0].chain([7] * 8))  # a run of d1 that b does not know (it has e2)
            b.publish("d1", "e2", idx[1].chain([5] * 12, "s"))
            for _ in range(200):
                if len(applied) == 6:  # each reads all three entries
                    break
                await asyncio.sleep(0.02)
            # its own two and b's, applied; a's for d0, and its own and a's for a run it does not know
            assert sorted(applied) == [("a", False), ("a", False), ("a", True), ("b", False), ("b", False), ("b", True)]
            assert idx[1].cached_tokens("d0", idx[1].prompt_chain(prompt + [1])) == 8
            assert idx[1].cached_tokens("d1", idx[1].prompt_chain([7] * 9)) == 0
            assert idx[0].cached_tokens("d1", idx[0].prompt_chain([5] * 13, "s")) == 12
            assert 0 < await clients[0].ttl(key) <= STREAM_TTL_S
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for c in clients:
                await c.aclose()
        assert not a.running and not b.running
        a.publish("d0", "e1", [1, 2])  # not running: nothing is kept
        assert a.pending == []

    asyncio.run(main())


def _counting(apply, into: list, who: str):
    def wrapped(fields):
        done = apply(fields)
        into.append((who, done))
        return done

    return wrapped


def test_a_shared_record_goes_to_the_index_that_knows_its_workers_run():
    """A router keeps two records, the decode workers' and the prefill workers' (prefill affinity);
    another router's entry is applied to the one that knows its worker's run (prefill workers'
    runs are "": their ids differ per process), and dropped where neither does."""
    from splitserve.router.prefix_share import SharedRecord, pack

    decode, prefill = PrefixIndex(block_size=4), PrefixIndex(block_size=4)
    decode.workers([W("d0", epoch="e1")])
    prefill.workers([W("p0", epoch=""), W("p1", epoch="")])
    shared = SharedRecord(None, "{t}:prefix-records", "router-b", [decode, prefill])
    chain = prefill.chain(list(range(12)))

    def entry(worker, epoch):
        return {b"r": b"router-a", b"w": worker.encode(), b"e": epoch.encode(), b"h": pack(chain)}

    assert shared.apply(entry("p0", ""))
    assert prefill.cached_tokens("p0", prefill.prompt_chain(list(range(13)))) == 12 and "p0" not in decode.blocks
    assert shared.apply(entry("d0", "e1"))
    assert decode.cached_tokens("d0", decode.prompt_chain(list(range(13)))) == 12 and "d0" not in prefill.blocks
    assert not shared.apply(entry("p2", ""))  # a prefill worker this router has not read from the registry
    # Entries no router wrote (another release's, a hand's): fields not UTF-8 name no worker here
    # (not: UnicodeDecodeError, which ended the router's reading of every entry after it); hashes
    # of a length that is not whole are read as far as they are whole.
    for odd in ({b"r": b"router-a", b"w": b"\xfe\xff", b"e": b""}, {b"r": b"router-a", b"w": b"d0", b"e": b"\xc3"}, {}):
        assert not shared.apply({b"h": pack(chain), **odd}), odd
    assert shared.apply({**entry("p0", ""), b"r": b"\xff"})  # (its writer's id matters only if it is this router's)
    assert shared.apply({**entry("p1", ""), b"h": pack(chain)[:-3]})
    assert prefill.cached_tokens("p1", prefill.prompt_chain(list(range(13)))) == 8
    assert not shared.apply(entry("d0", ""))  # (a decode worker's run is never "")
    assert "p2" not in prefill.blocks and "p2" not in decode.blocks
