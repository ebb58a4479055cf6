"""A decode worker of the release before KV without its first tokens: it reads layout version 1 only.

Imported first (as a sitecustomize) by one role's processes: see common.with_module."""

import splitserve.handoff.layout as kv_layout

kv_layout.LAYOUT_VERSIONS = (kv_layout.LAYOUT_VERSION,)
