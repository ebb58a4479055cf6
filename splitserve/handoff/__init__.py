"""The KV handoff: a prefilled request's KV cache moved from a prefill worker to a decode worker.

The two sides, and who owns what:

  producer (prefill worker, ``prefill_worker/handoff.py``: HandoffSender)
    1. sends the first token ahead (FirstTokens stream, or FirstToken), so the client sees it now;
    2. writes the request's KV into a region of its own arena (``arena.Arena``, a shared-memory
       segment it creates and removes), or into a buffer of bytes for another host, in the
       layout of ``layout.py``;
    3. calls the decode worker's PutKV with a handle (``KVHandle``: arena, offset, length,
       tokens, layout version, dtype, model fingerprint, host, lease), or PutKVStream with the
       bytes in chunks;
    4. frees the region when PutKV answers, whatever the answer: the region is the producer's
       from allocation to free, and the consumer never keeps a reference to it.

  consumer (decode worker, ``decode_worker/handoff.py``: HandoffReceiver)
    1. checks every field of the handle against its own model and the arena's size before it
       reads a byte (a bad handle is INVALID_ARGUMENT, never a read of someone else's memory);
    2. maps the producer's arena read-only (``arena.ArenaReader``, which unmaps a segment that
       was removed or replaced) and copies the KV into its paged pool (``layout.load``);
    3. answers PutKV once the copy is done, and adds the sequence to its running batch.

Transports: ``shm`` (same host, same IPC namespace: the handle names a region) and ``grpc``
(the bytes travel in PutKVStream chunks). ``kv_transport`` chooses; ``auto`` takes shm where
the producer's host id is the consumer's.

Backpressure runs through the handoff: a decode pool without room makes PutKV wait, which keeps
the producer's region, which fills its arena, which stops it pulling jobs.
"""
