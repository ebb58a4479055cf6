"""The ``splitserve`` command."""

from __future__ import annotations

import argparse
import logging
import sys

from splitserve.engine.errors import EngineError


def _check_model(args) -> int:
    import time

    from splitserve.engine.config import EngineConfig, ModelSpec
    from splitserve.engine.engine import LLMEngine

    t = time.perf_counter()
    eng = LLMEngine(EngineConfig(model=ModelSpec(path=args.model), kv_cache_bytes=16 << 20))
    s = eng.model.shape
    print(
        f"{eng.model_name}: {s.model_type}, {s.num_layers} layers, hidden {s.hidden_size}, "
        f"{s.num_heads} heads / {s.num_kv_heads} KV heads, vocab {s.vocab_size}, context {eng.max_model_len}, "
        f"fingerprint {eng.fingerprint}, ready in {time.perf_counter() - t:.1f} s"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check-model", help="load a model (converting and caching it) and describe it")
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.set_defaults(func=_check_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except EngineError as e:
        print(f"splitserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
