"""kvoff as an SGLang HiCache L3 storage backend (sglang 0.5.23).

SGLang loads it through its ``dynamic`` backend, with no patch::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvoff",
            "module_path": "kvoff.sglang", "class_name": "KvoffHiCacheStorage",
            "interface_v1": 1, "disk_path": "/nvme/kv", "disk_bytes_to_use": 500000000000}'

Each L3 page is one kvoff file (docs/tier.md: checked header and payload, atomic publication,
capacity over this instance's own files, other engines' files picked up by rescans), or with
``remote_url`` instead of ``disk_path`` one value on Redis/Valkey (kvoff's remote tier, same checks),
or with ``object_url`` (``s3://bucket/prefix``) one object in an S3-compatible store (kvoff's object
tier: same checks, a byte budget per rank, credentials from the ``AWS_*`` environment).
The v1 zero-copy path gathers a page from SGLang's host pool (``get_page_buffer_meta``: layer-first,
page-first, MHA and MLA) on kvoff's I/O threads and scatters it back; the v2 path does the same per
hybrid-model pool (KV, Mamba, SWA, ...: ``batch_*_v2`` with ``PoolTransfer``s). See
:class:`KvoffHiCacheStorage`.

``import kvoff`` never needs SGLang; importing this module does.
"""

from __future__ import annotations

from kvoff.sglang.backend import KvoffHiCacheStorage, storage_namespace

__all__ = ["KvoffHiCacheStorage", "storage_namespace"]
