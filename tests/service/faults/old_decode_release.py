"""A decode worker of the release before KV without its first tokens: it reads layout version 1 only.

Imported first (as a sitecustomize) by one role's processes: see common.with_module."""

import splitserve.engine.kv_transfer as kv_transfer

kv_transfer.LAYOUT_VERSIONS = (kv_transfer.LAYOUT_VERSION,)
