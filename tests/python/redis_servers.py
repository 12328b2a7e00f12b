"""Real Redis (or Valkey) servers for the remote tier's tests (issue 26, docs/tier.md): started on
loopback at random free ports, no persistence unless asked, stopped at the end also on failure.

Everything here drives the real ``redis-server`` from Debian's package (``scripts/test.sh`` installs
it); nothing stands in for the server. What the tests get:

- :class:`RedisServer`: one server process (standalone or a Cluster node). ``kill()`` (SIGKILL),
  ``restart()`` on the same port (empty, or with its data: ``persistence="aof"`` keeps every write
  across a SIGKILL, ``"rdb"`` what the last ``SAVE`` wrote), ``pause()``/``resume()`` (SIGSTOP /
  SIGCONT: a server that is "there" but answers nothing), ``set_maxmemory(bytes, "allkeys-lru")``,
  ``cli(...)`` (``redis-cli`` against it), ``info()``; optional ``password`` (``requirepass``), ACL
  users and TLS (a throwaway CA and certificate made with ``openssl``: ``rediss://`` URLs).
- :class:`RedisCluster`: ``masters`` masters (and ``replicas`` replicas each) joined with
  ``redis-cli --cluster create``; ``kill_master()`` + ``wait_failover()`` for the "one master
  killed" fault (needs ``replicas >= 1``: a master without a replica takes its slots down with it,
  ``cluster-require-full-coverage no`` keeps the other slots serving); ``proxied=True`` puts a
  :class:`FaultProxy` in front of every node and makes the nodes announce the proxies' ports, so
  that a Cluster client's every connection (also after MOVED/ASK) goes through a proxy that can
  stall or drop.
- :class:`FaultProxy`: a TCP proxy (threads) between client and server that can pass, delay every
  chunk, stall (stop forwarding in both directions; connections stay open, the client's writes
  back up: a network partition as the client sees it) and drop (reset every connection, and
  refuse new ones until ``resume()``).

Cleanup: every process is started in its own process group under ``setpriv --pdeathsig KILL``
(it dies with the test process even when that is SIGKILLed), is stopped by the fixtures' finalizers and,
as a last resort, by an ``atexit`` hook over all processes still running.

The server binary is ``$KVOFF_REDIS_SERVER`` if set, else ``redis-server`` (else ``valkey-server``)
on ``PATH``; the client tools likewise (``redis-cli``/``valkey-cli``, ``redis-benchmark``/
``valkey-benchmark``). Nothing here needs redis-py.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

from typing_extensions import Self

Persistence = Literal["none", "aof", "rdb"]

_LIVE: set[RedisServer] = set()
_LIVE_PROXIES: set[FaultProxy] = set()
_LOCK = threading.Lock()


def _which(*names: str) -> str | None:
    for n in names:
        p = shutil.which(n)
        if p:
            return p
    return None


def server_binary() -> str | None:
    """The server to run: ``$KVOFF_REDIS_SERVER``, else ``redis-server``, else ``valkey-server``."""
    env = os.environ.get("KVOFF_REDIS_SERVER")
    if env:
        return env if os.path.exists(env) else shutil.which(env)
    return _which("redis-server", "valkey-server")


def cli_binary() -> str | None:
    """``redis-cli`` (or ``valkey-cli``) to talk to the servers."""
    env = os.environ.get("KVOFF_REDIS_CLI")
    return env or _which("redis-cli", "valkey-cli")


def benchmark_binary() -> str | None:
    """``redis-benchmark`` (or ``valkey-benchmark``)."""
    env = os.environ.get("KVOFF_REDIS_BENCHMARK")
    return env or _which("redis-benchmark", "valkey-benchmark")


def server_version(binary: str | None = None) -> str:
    """``redis-server --version``'s first line, e.g. ``Redis server v=7.0.15 sha=...``."""
    b = binary or server_binary()
    if b is None:
        return "not installed"
    return subprocess.run(
        [b, "--version"], check=False, capture_output=True, text=True, timeout=10
    ).stdout.strip()


def missing_reason() -> str | None:
    """Why the real-server tests cannot run here, or ``None`` when they can."""
    if server_binary() is None:
        return (
            "redis-server is not installed (scripts/test.sh installs Debian's redis-server and "
            "redis-tools with apt-get; that failed or was not allowed here)"
        )
    if cli_binary() is None:
        return "redis-cli is not installed (Debian package redis-tools; scripts/test.sh installs it)"
    return None


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_PORTS_GIVEN: set[int] = set()


def free_port(bus: bool = False) -> int:
    """A free loopback port (and with ``bus``, one whose Cluster bus port, ``port + 10000``, is free
    too). Ports are drawn at random from 10000-22000, bus ports 20000-32000 (below Linux's
    ephemeral range, 32768-60999 by default, so that a client's outgoing port cannot take a
    server's between the draw and the bind), never twice per process."""
    rng = random.Random()
    for _ in range(1000):
        p = rng.randrange(10000, 22000)
        if p in _PORTS_GIVEN or (p + 10000) in _PORTS_GIVEN:
            continue
        if _port_free(p) and (not bus or _port_free(p + 10000)):
            _PORTS_GIVEN.update((p, p + 10000) if bus else (p,))
            return p
    raise RuntimeError("no free loopback port found")


def _die_with_parent() -> list[str]:
    """A command prefix that makes the server die with the test process, even when that is
    SIGKILLed: util-linux ``setpriv --pdeathsig KILL`` (Linux ``PR_SET_PDEATHSIG``; kept across
    its exec of the server). Empty where setpriv is missing (finalizers and atexit remain).
    The signal is sent when the *thread* that started the server ends: start servers from the
    main thread (the fixtures do)."""
    sp = shutil.which("setpriv")
    return [sp, "--pdeathsig", "KILL"] if sp else []


def make_tls_files(directory: Path) -> dict[str, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1/localhost (``openssl``): files
    ``ca.crt``, ``server.crt``, ``server.key`` in ``directory``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ossl = shutil.which("openssl")
    if ossl is None:
        raise RuntimeError("openssl is needed to make TLS certificates")

    def run(*args: str) -> None:
        subprocess.run([ossl, *args], cwd=d, check=True, capture_output=True, timeout=60)

    run(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=kvoff-test-ca",
        "-keyout", "ca.key", "-out", "ca.crt",
    )  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    )
    run(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", "2", "-extfile", "san.ext", "-out", "server.crt",
    )  # fmt: skip
    return {"ca": d / "ca.crt", "cert": d / "server.crt", "key": d / "server.key"}


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1 (see the module docs).

    Args:
        port: the client port (default: a free one; kept across ``restart()``).
        persistence: ``"none"`` (``save ""``, ``appendonly no``: the default), ``"aof"``
            (``appendfsync always``: every acknowledged write survives SIGKILL) or ``"rdb"`` (what
            an explicit ``SAVE`` or ``SHUTDOWN SAVE`` wrote).
        password: ``requirepass`` (the ``default`` user's password).
        acl_users: ``{user: password}`` users with every permission (``+@all ~* &*``).
        tls: serve TLS only (``rediss://``), with a throwaway CA (``self.tls_files["ca"]``).
        cluster: a Cluster node (``cluster-enabled yes``; the bus port is ``port + 10000``).
        announce_port: a Cluster node's ``cluster-announce-port`` (a proxy in front of it).
        node_timeout_ms: ``cluster-node-timeout`` (failure detection; failover after about twice it).
        maxmemory, maxmemory_policy: memory cap at start (also ``set_maxmemory``).
        extra_args: more ``--name value`` options.
        binary: the server executable (default :func:`server_binary`).
        workdir: where data, config and log live (default: a new temporary directory).
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        persistence: Persistence = "none",
        password: str | None = None,
        acl_users: dict[str, str] | None = None,
        tls: bool = False,
        cluster: bool = False,
        announce_port: int | None = None,
        node_timeout_ms: int = 2000,
        maxmemory: int | None = None,
        maxmemory_policy: str = "allkeys-lru",
        extra_args: Sequence[str] = (),
        binary: str | None = None,
        workdir: Path | None = None,
        name: str = "redis",
    ) -> None:
        b = binary or server_binary()
        if b is None:
            raise RuntimeError(missing_reason() or "no redis-server")
        self.binary = b
        self.cluster = cluster
        self.port = port if port is not None else free_port(bus=cluster)
        # A port drawn here may be taken by another process before the server binds it: start()
        # then draws another, until the server has run once (restarts keep the port).
        self._may_move = port is None and announce_port is None
        self.starts = 0
        self.persistence = persistence
        self.password = password
        self.acl_users = dict(acl_users or {})
        self.tls = tls
        self.announce_port = announce_port
        self.node_timeout_ms = node_timeout_ms
        self.maxmemory = maxmemory
        self.maxmemory_policy = maxmemory_policy
        self.extra_args = list(extra_args)
        self.name = name
        self._own_dir = workdir is None
        self.dir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix=f"kvoff-{name}-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.dir / "server.log"
        self.tls_files: dict[str, Path] = make_tls_files(self.dir / "tls") if tls else {}
        self.proc: subprocess.Popen[bytes] | None = None

    # -- addresses -----------------------------------------------------------------------------

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def client_port(self) -> int:
        """The port clients use: the announced (proxy) port of a proxied Cluster node, else ``port``."""
        return self.announce_port or self.port

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:port`` (``rediss://`` with TLS) of the server itself."""
        auth = f":{self.password}@" if self.password else ""
        return f"{'rediss' if self.tls else 'redis'}://{auth}127.0.0.1:{self.port}"

    # -- life cycle ----------------------------------------------------------------------------

    def _args(self) -> list[str]:
        a = [self.binary, "--bind", "127.0.0.1", "--protected-mode", "no", "--daemonize", "no"]
        a += ["--dir", str(self.dir), "--logfile", str(self.log_path), "--loglevel", "notice"]
        a += ["--databases", "1"] if not self.cluster else []
        if self.tls:
            t = self.tls_files
            a += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(t["cert"])]
            a += ["--tls-key-file", str(t["key"]), "--tls-ca-cert-file", str(t["ca"])]
            a += ["--tls-auth-clients", "no"]
            if self.cluster:
                a += ["--tls-cluster", "yes", "--tls-replication", "yes"]
        else:
            a += ["--port", str(self.port)]
        if self.persistence == "aof":
            a += ["--save", "", "--appendonly", "yes", "--appendfsync", "always"]
        elif self.persistence == "rdb":
            a += ["--save", "", "--appendonly", "no", "--dbfilename", "dump.rdb"]
        else:
            a += ["--save", "", "--appendonly", "no"]
        if self.password:
            a += ["--requirepass", self.password]
            if self.cluster:
                a += ["--masterauth", self.password]
        for user, pw in self.acl_users.items():
            a += ["--user", user, "on", f">{pw}", "~*", "&*", "+@all"]
        if self.cluster:
            a += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.dir / "nodes.conf")]
            a += ["--cluster-node-timeout", str(self.node_timeout_ms)]
            a += ["--cluster-require-full-coverage", "no", "--cluster-announce-ip", "127.0.0.1"]
            a += ["--cluster-replica-validity-factor", "0"]  # any replica may take over
            if self.announce_port is not None:
                a += ["--cluster-announce-port", str(self.announce_port)]
                a += ["--cluster-announce-bus-port", str(self.port + 10000)]
        if self.maxmemory is not None:
            a += ["--maxmemory", str(self.maxmemory), "--maxmemory-policy", self.maxmemory_policy]
        return a + self.extra_args

    def start(self, timeout_s: float = 20.0) -> Self:
        """Start the process and wait until it answers PING (also while loading its data)."""
        if self.running():
            return self
        self.proc = subprocess.Popen(
            [*_die_with_parent(), *self._args()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        with _LOCK:
            _LIVE.add(self)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if self._may_move and self.starts == 0 and "Address already in use" in self.log_tail():
                    self.port = free_port(bus=self.cluster)
                    self.log_path.unlink(missing_ok=True)
                    return self.start(timeout_s)
                raise RuntimeError(
                    f"{self.name} on port {self.port} exited with {self.proc.returncode}; log:\n{self.log_tail()}"
                )
            if self.ping():
                self.starts += 1
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(
            f"{self.name} on port {self.port} did not answer within {timeout_s}s:\n{self.log_tail()}"
        )

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (default SIGKILL: no shutdown, no save) and, for fatal signals, reap it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)

    def pause(self) -> None:
        """SIGSTOP: the server keeps its port and connections but answers nothing (a hung server,
        or one "stopped for minutes") until :meth:`resume`."""
        self.kill(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        self.kill(signal.SIGCONT)

    def stop(self) -> None:
        """Stop the server (SIGCONT in case it is paused, then SIGKILL: no data is written)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGCONT)
            self.kill(signal.SIGKILL)
        with _LOCK:
            _LIVE.discard(self)

    def restart(self, *, keep_data: bool = True, timeout_s: float = 30.0) -> Self:
        """Start again on the same port (after :meth:`kill` or :meth:`stop`; kills a running one
        first). ``keep_data=False`` removes the AOF/RDB files first (restarted empty); with
        ``persistence="none"`` the server always comes back empty. A Cluster node keeps its
        ``nodes.conf`` (its identity and slots) either way."""
        self.stop()
        if not keep_data:
            for p in ("appendonlydir", "dump.rdb"):
                q = self.dir / p
                if q.is_dir():
                    shutil.rmtree(q)
                elif q.exists():
                    q.unlink()
        # The port may linger in TIME_WAIT from the client side only; the server sets SO_REUSEADDR.
        return self.start(timeout_s)

    def close(self) -> None:
        """Stop and remove the working directory (if this object made it)."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    # -- commands ------------------------------------------------------------------------------

    def cli_args(self) -> list[str]:
        """``redis-cli`` options that reach this server (host, port, auth, TLS)."""
        c = cli_binary()
        if c is None:
            raise RuntimeError(missing_reason() or "no redis-cli")
        a = [c, "-h", "127.0.0.1", "-p", str(self.port)]
        if self.password:
            a += ["-a", self.password, "--no-auth-warning"]
        if self.tls:
            a += ["--tls", "--cacert", str(self.tls_files["ca"])]
        return a

    def cli(self, *args: str, timeout_s: float = 10.0, check: bool = True, stdin: bytes | None = None) -> str:
        """Run ``redis-cli ARGS`` against the server; its output without the trailing newline. A
        reply that is an error (``(error) ...`` / ``ERR ...``) raises with ``check``."""
        r = subprocess.run(
            [*self.cli_args(), *args], input=stdin, capture_output=True, timeout=timeout_s, check=False
        )
        out = r.stdout.decode(errors="replace").rstrip("\n")
        if check and (r.returncode != 0 or out.startswith(("ERR", "(error)", "WRONGPASS", "NOAUTH"))):
            raise RuntimeError(f"redis-cli {' '.join(args)} on port {self.port}: {out} {r.stderr.decode()}")
        return out

    def ping(self) -> bool:
        """Whether the server answers PING within a second (``LOADING`` counts as not yet)."""
        if not self.running():
            return False
        try:
            return self.cli("PING", timeout_s=2.0, check=False) == "PONG"
        except subprocess.TimeoutExpired:
            return False

    def info(self, section: str = "") -> dict[str, str]:
        """``INFO [section]`` as a dict (``key: value`` lines)."""
        out = self.cli(*(["INFO", section] if section else ["INFO"]))
        d = {}
        for ln in out.splitlines():
            if ":" in ln and not ln.startswith("#"):
                k, v = ln.split(":", 1)
                d[k] = v.strip()
        return d

    def config_get(self, name: str) -> str:
        """``CONFIG GET name``'s value (``""`` when empty)."""
        lines = self.cli("CONFIG", "GET", name).split("\n")
        return lines[1] if len(lines) > 1 else ""

    def set_maxmemory(self, nbytes: int, policy: str = "allkeys-lru") -> None:
        """``CONFIG SET maxmemory`` / ``maxmemory-policy`` (``allkeys-lru``: the server evicts
        any key, ours included, when full)."""
        self.cli("CONFIG", "SET", "maxmemory", str(nbytes))
        self.cli("CONFIG", "SET", "maxmemory-policy", policy)
        self.maxmemory, self.maxmemory_policy = nbytes, policy

    def save(self) -> None:
        """``SAVE`` (for ``persistence="rdb"``: what a restart with data will load)."""
        self.cli("SAVE")

    def dbsize(self) -> int:
        return int(self.cli("DBSIZE"))


def _parse_cluster_nodes(text: str) -> list[dict[str, str]]:
    rows = []
    for ln in text.splitlines():
        f = ln.split()
        if len(f) < 8:
            continue
        addr = f[1].split("@")[0]
        rows.append(
            {
                "id": f[0],
                "addr": addr,
                "port": addr.rsplit(":", 1)[1],
                "flags": f[2],
                "master_id": f[3],
                "link": f[7],
                "slots": " ".join(f[8:]),
            }
        )
    return rows


class RedisCluster:
    """A Redis Cluster on loopback: ``masters`` masters with ``replicas`` replicas each (see the
    module docs). ``url`` is a seed node's URL (the client discovers the rest); ``urls`` all of
    them. With ``proxied=True`` every node is announced at a :class:`FaultProxy` (``proxies[i]``
    fronts ``nodes[i]``; ``url``/``urls`` name the proxies)."""

    def __init__(
        self,
        masters: int = 3,
        replicas: int = 0,
        *,
        node_timeout_ms: int = 2000,
        proxied: bool = False,
        password: str | None = None,
        tls: bool = False,
        persistence: Persistence = "none",
        binary: str | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        if masters < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        self.masters_n, self.replicas_n = masters, replicas
        self.node_timeout_ms = node_timeout_ms
        self.password, self.tls = password, tls
        self.proxies: list[FaultProxy] = []
        self.nodes: list[RedisServer] = []
        n = masters * (1 + replicas)
        for i in range(n):
            port = free_port(bus=True)
            announce = None
            if proxied:
                proxy = FaultProxy(port)
                self.proxies.append(proxy)
                announce = proxy.port
            self.nodes.append(
                RedisServer(
                    port=port,
                    cluster=True,
                    announce_port=announce,
                    node_timeout_ms=node_timeout_ms,
                    password=password,
                    tls=tls,
                    persistence=persistence,
                    binary=binary,
                    extra_args=extra_args,
                    name=f"cluster-node{i}",
                )
            )
        self._killed_ids: dict[RedisServer, str] = {}
        self._replicas_of: dict[str, list[RedisServer]] = {}
        if tls:  # one CA for all nodes: the client trusts one file
            ca = self.nodes[0].tls_files
            for nd in self.nodes[1:]:
                nd.tls_files = ca

    @property
    def url(self) -> str:
        return self.urls[0]

    @property
    def urls(self) -> list[str]:
        auth = f":{self.password}@" if self.password else ""
        scheme = "rediss" if self.tls else "redis"
        return [f"{scheme}://{auth}127.0.0.1:{nd.client_port}" for nd in self.nodes]

    @property
    def cluster_url(self) -> str:
        """Every node as a seed: ``redis+cluster://[:password@]127.0.0.1:p1,127.0.0.1:p2,...``
        (``rediss+cluster://`` with TLS), the multi-seed form of kvoff's ``remote_url``."""
        auth = f":{self.password}@" if self.password else ""
        seeds = ",".join(f"127.0.0.1:{nd.client_port}" for nd in self.nodes)
        return f"{'rediss' if self.tls else 'redis'}+cluster://{auth}{seeds}"

    @property
    def ca_file(self) -> Path | None:
        return self.nodes[0].tls_files.get("ca") if self.tls else None

    def start(self, timeout_s: float = 60.0) -> Self:
        """Start the nodes, join them (``redis-cli --cluster create ... --cluster-yes``) and wait
        until every node says ``cluster_state:ok`` with all 16384 slots assigned."""
        for nd in self.nodes:
            nd.start()
        addrs = [f"127.0.0.1:{nd.port}" for nd in self.nodes]
        a = self.nodes[0].cli_args()
        # redis-cli's -h/-p are ignored by --cluster create; the addresses are its arguments.
        r = subprocess.run(
            [*a, "--cluster", "create", *addrs, "--cluster-replicas", str(self.replicas_n), "--cluster-yes"],
            capture_output=True,
            timeout=timeout_s,
            check=False,
        )
        out = r.stdout.decode(errors="replace") + r.stderr.decode(errors="replace")
        if r.returncode != 0 or "[OK] All 16384 slots covered" not in out:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed (rc {r.returncode}):\n{out[-4000:]}")
        self.wait_ok(timeout_s)
        return self

    def cluster_info(self, node: RedisServer) -> dict[str, str]:
        d = {}
        for ln in node.cli("CLUSTER", "INFO").splitlines():
            if ":" in ln:
                k, v = ln.split(":", 1)
                d[k] = v.strip()
        return d

    def node_table(self, via: RedisServer | None = None) -> list[dict[str, str]]:
        """``CLUSTER NODES`` as seen by ``via`` (default: the first running node)."""
        nd = via or next(n for n in self.nodes if n.running())
        return _parse_cluster_nodes(nd.cli("CLUSTER", "NODES"))

    def masters(self) -> list[RedisServer]:
        """The running nodes that are masters now (after a failover, a former replica)."""
        out = []
        for nd in self.nodes:
            if not nd.running():
                continue
            role = nd.info("replication").get("role")
            if role == "master":
                out.append(nd)
        return out

    def wait_ok(self, timeout_s: float = 60.0) -> None:
        """Wait until every running node reports ``cluster_state:ok`` and 16384 slots ok, and,
        with replicas, every running replica has its master link up."""
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            try:
                ok = True
                for nd in self.nodes:
                    if not nd.running():
                        continue
                    ci = self.cluster_info(nd)
                    if ci.get("cluster_state") != "ok" or ci.get("cluster_slots_ok") != "16384":
                        ok, last = False, f"node {nd.port}: {ci}"
                        break
                    rep = nd.info("replication")
                    if rep.get("role") == "slave" and rep.get("master_link_status") != "up":
                        ok, last = False, f"replica {nd.port}: link {rep.get('master_link_status')}"
                        break
                if ok:
                    return
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                last = str(e)
            time.sleep(0.1)
        raise RuntimeError(f"cluster not ok after {timeout_s}s: {last}")

    def master_for_key(self, key: str) -> RedisServer:
        """The node that serves ``key``'s slot now."""
        slot = int(next(n for n in self.nodes if n.running()).cli("CLUSTER", "KEYSLOT", key))
        for row in self.node_table():
            if "master" not in row["flags"] or "fail" in row["flags"]:
                continue
            for rng in row["slots"].split():
                if rng.startswith("["):
                    continue
                lo, _, hi = rng.partition("-")
                if int(lo) <= slot <= int(hi or lo):
                    port = int(row["port"])
                    return next(n for n in self.nodes if port in (n.port, n.client_port))
        raise RuntimeError(f"no master serves slot {slot}")

    def wait_replicated(self, timeout_s: float = 30.0) -> None:
        """Wait until every running master's replicas have acknowledged all of its writes
        (``INFO replication``: each replica's ``offset`` equals ``master_repl_offset``). Unlike
        ``WAIT``, which counts only its own connection's writes, this covers every client's."""
        deadline = time.monotonic() + timeout_s
        while True:
            behind = []
            for m in self.masters():
                rep = m.info("replication")
                target = int(rep.get("master_repl_offset", "0"))
                n = int(rep.get("connected_slaves", "0"))
                offs = [
                    int(dict(kv.split("=", 1) for kv in rep[f"slave{i}"].split(","))["offset"])
                    for i in range(n)
                    if f"slave{i}" in rep
                ]
                if n < self.replicas_n or any(o < target for o in offs):
                    behind.append((m.port, target, offs))
            if not behind:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"replicas behind after {timeout_s}s: {behind}")
            time.sleep(0.05)

    def node_id(self, node: RedisServer) -> str:
        """The node's Cluster id (``CLUSTER MYID``)."""
        return node.cli("CLUSTER", "MYID")

    def kill_master(self, index: int = 0) -> RedisServer:
        """SIGKILL the ``index``-th master that is running now; returns it (:meth:`wait_failover`
        waits for its replica to take over; ``restart()`` brings it back as a replica)."""
        m = self.masters()[index]
        kid = self.node_id(m)
        self._killed_ids[m] = kid
        by_id = {self.node_id(n): n for n in self.nodes if n.running()}
        self._replicas_of[kid] = [by_id[r["id"]] for r in self.node_table() if r["master_id"] == kid]
        m.kill()
        return m

    def wait_failover(self, killed: RedisServer, timeout_s: float = 30.0) -> RedisServer:
        """After :meth:`kill_master`: wait until the others flag ``killed`` as failed, one of its
        replicas is master and the cluster is ok again (all slots served); returns the new master."""
        kid = self._killed_ids[killed]
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            try:
                rows = self.node_table()
                dead = next((r for r in rows if r["id"] == kid), None)
                if dead is not None and "fail" in dead["flags"].split(","):
                    self.wait_ok(max(1.0, deadline - time.monotonic()))
                    for nd in self.nodes:
                        if nd is killed or not nd.running():
                            continue
                        row = next(r for r in self.node_table() if r["id"] == self.node_id(nd))
                        if "master" in row["flags"] and row["slots"] and nd in self._replicas_of.get(kid, []):
                            return nd
                    last = "killed master's slots not taken over by one of its replicas"
                else:
                    last = f"not yet flagged failed: {dead}"
            except (RuntimeError, subprocess.TimeoutExpired, StopIteration) as e:
                last = str(e)
            time.sleep(0.2)
        raise RuntimeError(f"no failover for the master on port {killed.port} within {timeout_s}s: {last}")

    def stop(self) -> None:
        for nd in self.nodes:
            nd.stop()
        for p in self.proxies:
            p.close()

    def close(self) -> None:
        for nd in self.nodes:
            nd.close()
        for p in self.proxies:
            p.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- fault-injecting TCP proxy ---------------------------------------------------------------


class FaultProxy:
    """A TCP proxy on 127.0.0.1 (a free port, ``self.port``) in front of ``target_port``.

    Modes (any thread may switch them while traffic flows):

    - pass-through (the default, and after :meth:`resume`);
    - ``delay(seconds)``: every chunk waits that long before it is forwarded (a slow network);
    - :meth:`stall`: nothing is forwarded either way and nothing more is read (the sender's
      socket buffers fill and its writes block); connections stay open; new connections are
      accepted (the kernel completes the handshake) and stall too. What a client sees of a
      network partition or a dead peer whose host is gone.
    - :meth:`drop`: every open connection is reset (RST) and, until :meth:`resume`, every new one
      is reset on arrival (a server that is down but whose host answers).

    ``connections``, ``bytes_up`` (client → server) and ``bytes_down`` count what went through.
    """

    def __init__(self, target_port: int, target_host: str = "127.0.0.1", listen_port: int = 0) -> None:
        self.target = (target_host, target_port)
        self._ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._ls.bind(("127.0.0.1", listen_port or free_port()))
        self._ls.listen(128)
        self._ls.settimeout(0.2)
        self.port: int = self._ls.getsockname()[1]
        self._cv = threading.Condition()
        self._stalled = False
        self._refusing = False
        self._delay = 0.0
        self._closed = False
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        # Pumps still running per (client, server) pair: the last one to end closes both sockets.
        self._pumps: dict[tuple[socket.socket, socket.socket], int] = {}
        self.connections = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self._threads: list[threading.Thread] = []
        t = threading.Thread(target=self._accept_loop, name=f"fault-proxy-{self.port}", daemon=True)
        t.start()
        self._threads.append(t)
        with _LOCK:
            _LIVE_PROXIES.add(self)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    # -- modes ---------------------------------------------------------------------------------

    def stall(self) -> None:
        with self._cv:
            self._stalled = True
            self._cv.notify_all()

    def delay(self, seconds: float) -> None:
        with self._cv:
            self._delay = max(0.0, seconds)
            self._cv.notify_all()

    def drop(self) -> None:
        """Reset every connection now and refuse (reset) new ones until :meth:`resume`."""
        with self._cv:
            self._refusing = True
            pairs, self._pairs = self._pairs, []
            self._cv.notify_all()
        for a, b in pairs:
            _reset(a)
            _reset(b)

    def resume(self) -> None:
        """Back to pass-through: no stall, no delay, new connections accepted."""
        with self._cv:
            self._stalled = False
            self._refusing = False
            self._delay = 0.0
            self._cv.notify_all()

    def open_connections(self) -> int:
        with self._cv:
            return len(self._pairs)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            pairs, self._pairs = self._pairs, []
            self._cv.notify_all()
        for a, b in pairs:
            _reset(a)
            _reset(b)
        with contextlib.suppress(OSError):
            self._ls.close()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=2)
        with _LOCK:
            _LIVE_PROXIES.discard(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                c, _ = self._ls.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._cv:
                refusing = self._refusing
            if refusing:
                _reset(c)
                continue
            try:
                s = socket.create_connection(self.target, timeout=5)
            except OSError:
                _reset(c)
                continue
            for x in (c, s):
                x.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                x.settimeout(0.2)
            with self._cv:
                self._pairs.append((c, s))
                self._pumps[(c, s)] = 2
                self.connections += 1
            for src, dst, up in ((c, s, True), (s, c, False)):
                t = threading.Thread(target=self._pump, args=(src, dst, up), daemon=True)
                t.start()
            self._threads = [t for t in self._threads if t.is_alive()]

    def _wait_flowing(self) -> float | None:
        """Block while stalled; the delay to apply, or ``None`` when closed."""
        with self._cv:
            while self._stalled and not self._closed:
                self._cv.wait(0.2)
            return None if self._closed else self._delay

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        try:
            while True:
                if self._wait_flowing() is None:
                    return
                try:
                    data = src.recv(1 << 16)
                except TimeoutError:
                    continue
                if not data:
                    with contextlib.suppress(OSError):
                        dst.shutdown(socket.SHUT_WR)
                    return
                if not self._forward(dst, data, up):
                    return
        except OSError:
            _reset(src)
            _reset(dst)
        finally:
            self._pump_done(src, dst, up)

    def _forward(self, dst: socket.socket, data: bytes, up: bool) -> bool:
        """Send ``data`` to ``dst`` after the set delay (waiting while stalled) and count its bytes;
        ``False`` when the proxy closed meanwhile."""
        d = self._wait_flowing()
        if d is None:
            return False
        if d:
            time.sleep(d)
        view = memoryview(data)
        while view:
            if self._wait_flowing() is None:
                return False
            try:
                n = dst.send(view)
            except TimeoutError:
                continue
            view = view[n:]
        with self._cv:
            if up:
                self.bytes_up += len(data)
            else:
                self.bytes_down += len(data)
        return True

    def _pump_done(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        """One direction of a pair ended: forget the pair; the last of its two pumps closes both
        sockets."""
        pair = (src, dst) if up else (dst, src)
        with self._cv:
            self._pairs = [p for p in self._pairs if src not in p]
            left = self._pumps.get(pair, 1) - 1
            if left:
                self._pumps[pair] = left
            else:
                self._pumps.pop(pair, None)
        if not left:
            for x in pair:
                with contextlib.suppress(OSError):
                    x.close()


def _reset(s: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), ignoring errors."""
    with contextlib.suppress(OSError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    with contextlib.suppress(OSError):
        s.close()


def stop_all() -> None:
    """Stop every server and proxy this process started and that is still running."""
    with _LOCK:
        servers, proxies = list(_LIVE), list(_LIVE_PROXIES)
    for s in servers:
        with contextlib.suppress(Exception):
            s.stop()
    for p in proxies:
        with contextlib.suppress(Exception):
            p.close()


atexit.register(stop_all)


@contextlib.contextmanager
def standalone(**kw: object) -> Iterator[RedisServer]:
    """``with standalone() as srv:`` a started :class:`RedisServer`, closed at the end."""
    srv = RedisServer(**kw)  # type: ignore[arg-type]
    try:
        yield srv.start()
    finally:
        srv.close()


@contextlib.contextmanager
def cluster(masters: int = 3, replicas: int = 0, **kw: object) -> Iterator[RedisCluster]:
    """``with cluster() as c:`` a started :class:`RedisCluster`, closed at the end."""
    c = RedisCluster(masters, replicas, **kw)  # type: ignore[arg-type]
    try:
        yield c.start()
    finally:
        c.close()


def open_fds(pid: int | None = None) -> int:
    """Open file descriptors of a process (default: this one), for "no fd growth" checks."""
    return len(os.listdir(f"/proc/{pid or os.getpid()}/fd"))


def thread_count(pid: int | None = None) -> int:
    """Threads of a process (default: this one; native threads included), for "no thread growth"
    checks."""
    return len(os.listdir(f"/proc/{pid or os.getpid()}/task"))


def rss_bytes(pid: int | None = None) -> int:
    """Resident memory of a process (default: this one), for "no memory growth" checks."""
    with open(f"/proc/{pid or os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def client_connections(srv: RedisServer) -> int:
    """Clients connected to ``srv`` now (``INFO clients``), for connection-leak checks; the
    ``redis-cli`` asking counts itself, so this is one less than the server's figure."""
    return int(srv.info("clients")["connected_clients"]) - 1
