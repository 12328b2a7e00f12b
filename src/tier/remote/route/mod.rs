//! Connections, Cluster routing and per-node fault state of the remote tier (docs/tier.md "Remote
//! tier", "Faults"; the client choice in docs/design.md "Remote tier client").
//!
//! **Why not the crate's Cluster connection.** The `redis` crate speaks the protocol and opens the
//! connections (one [`redis::Connection`] per node and I/O thread, TLS and authentication from the
//! URL); the routing of a batch is here, because the crate's synchronous `ClusterConnection`
//! (1.8) fails a whole pipeline when one node of it is down, reads every remaining reply of a
//! node after a timeout (each with the full read timeout: n commands to a stalled node held the
//! batch for n timeouts), and reconnects only through the seed nodes of the URL (one dead seed:
//! no way back, although the Cluster told it every other node).
//!
//! **Nodes.** The URL's seeds, then every master and replica the latest `CLUSTER SLOTS` names
//! (at most `MAX_NODES`; nodes a new map no longer names are retired) stay in `Router`'s
//! list, so a topology refresh can ask any of them. Each
//! node has its own fault state: a failed connect, write or read marks that node failed, with a
//! backoff that doubles from `backoff_min` to `backoff_max`. Commands routed to a failed node fail
//! at once without a network call until a probe (`Router::probe`, run by an I/O thread between
//! jobs, one at a time across all nodes and threads) gets a reply from it after its backoff: jobs
//! never wait for a node that is known to be failing. That reply counts as a reconnect.
//!
//! **Routing.** A standalone server is node 0 for every key. In a Cluster a key goes to the master
//! of its slot (CRC16/XMODEM of the key, or of its `{hash tag}`, modulo 16384 — [`key_slot`]) in
//! the slot map read with `CLUSTER SLOTS`. A batch is split per node; each node's part is one
//! pipeline (written to every node first, then the replies read node by node), so a node that
//! fails or stalls fails only its own commands and costs at most one connect timeout and two I/O
//! timeouts (its pipeline written, its replies read: each a deadline, docs/tier.md "Faults"). In
//! Cluster mode `MOVED` and `ASK` replies to a node the Cluster announced are followed
//! once (`ASKING` before an `ASK`ed command; a standalone server's fail the command) and
//! mark the slot map stale; `TRYAGAIN`, `CLUSTERDOWN`, `MASTERDOWN`, `LOADING` and `READONLY` fail
//! the command (the caller's job ends as a miss or a failed write) and mark it stale too, as does
//! a command routed to a node that is down or to a slot no master serves. A stale map is read
//! again by one thread at a time, at most once per `backoff_min`, from the first node that answers
//! (nodes this thread is connected to first, nodes marked down last and only once their backoff
//! is over).
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::conn::{BufPool, Conn};

mod batch;

/// Slots of a Redis Cluster.
pub const SLOTS: usize = 16_384;

/// The Cluster slot of `key`: CRC16/XMODEM of the key's hash tag (the bytes between its first `{`
/// and the next `}`, when not empty) or of the whole key, modulo 16384 (the Redis Cluster
/// specification, "Keys distribution model").
#[must_use]
pub fn key_slot(key: &[u8]) -> u16 {
    let tagged = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            rest.iter()
                .position(|&b| b == b'}')
                .map(|close| &rest[..close])
        })
        .filter(|tag| !tag.is_empty())
        .unwrap_or(key);
    let mut crc: u16 = 0;
    for &b in tagged {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 == 0 {
                crc << 1
            } else {
                (crc << 1) ^ 0x1021
            };
        }
    }
    crc % 16_384
}

/// No node serves the slot.
const NO_NODE: u32 = u32::MAX;

/// Settings of a [`Router`].
#[derive(Clone, Debug)]
pub(super) struct RouterConfig {
    pub cluster: bool,
    pub connect_timeout: Duration,
    pub io_timeout: Duration,
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    /// Most bytes of a bulk string reply kept ([`Conn::open`]).
    pub max_bulk: usize,
    /// The TLS client configuration of a `rediss://` URL (every node's connections use it).
    pub tls: Option<std::sync::Arc<rustls::ClientConfig>>,
}

struct Node {
    host: String,
    port: u16,
    info: redis::ConnectionInfo,
    /// Commands to this node fail at once until then.
    down_until: Option<Instant>,
    backoff: Duration,
    /// A call failed since the last reply (the next reply is a reconnect).
    failed: bool,
    /// Times the node was marked down: a thread's connection opened before the last of them is
    /// not used again (the server may have restarted since; its first write would meet a reset).
    downs: u64,
    /// Times the node came back (a reply after a failure): a failure of a call that began before
    /// the last of them is older than that reply and does not mark the node down again (a
    /// thread held up past a restart would otherwise report "connection refused" of the server
    /// that is gone, and fail every call for a backoff: docs/tier.md "Faults").
    ups: u64,
    /// No longer announced by the Cluster: out of `by_addr`, its id free for another node.
    retired: bool,
}

/// Most nodes learned from the Cluster kept besides the URL's seeds: a node beyond it is not
/// added (its slots unserved until a map names fewer nodes), and a node no map names any more is
/// dropped at the next map, so a seed that names ever-new nodes never grows the router's memory
/// (docs/tier.md "Cluster routing").
pub(super) const MAX_NODES: usize = 1024;

struct RouterState {
    nodes: Vec<Node>,
    by_addr: HashMap<(String, u16), usize>,
    /// The URL's seeds are the first `seeds` nodes (never retired).
    seeds: usize,
    /// Ids of retired nodes, reused for the next nodes learned.
    free: Vec<usize>,
    /// Node of each slot (Cluster only; empty until the first refresh).
    slots: Vec<u32>,
    /// The nodes the slot map names (sorted, no repeats).
    serving: Vec<usize>,
    /// Bumped at each new slot map (threads then drop connections to nodes that left it).
    epoch: u64,
    stale: bool,
    refreshing: bool,
    /// The node a thread is probing after its backoff (one at a time), and since when.
    probe: Option<(usize, Instant)>,
    last_refresh: Option<Instant>,
}

/// One I/O thread's connections, by node.
#[derive(Default)]
pub(super) struct Conns {
    /// Buffers for large values read (shared by the tier's I/O threads; none: fresh ones).
    pub(super) pool: Option<std::sync::Arc<BufPool>>,
    map: HashMap<usize, Conn>,
    /// The node's `downs` when each connection of `map` was opened.
    opened: HashMap<usize, u64>,
    epoch: u64,
    /// The packed pipeline of one node, reused (no allocation or page faults per batch).
    packed: Vec<u8>,
}

/// Values at least this large go to the socket from where they lie; smaller ones are copied into
/// the packed pipeline (one system call for many).
pub(super) const DIRECT_SEND_BYTES: usize = 64 << 10;

/// A command of a batch, packed into a node's pipeline (`key`: the key that routes it).
pub(super) trait Pack {
    /// Appends the command to `packed`, or writes `packed` and then (part of) the command to `c`.
    fn pack(&self, key: &str, c: &mut Conn, packed: &mut Vec<u8>) -> Result<(), String>;

    /// Reads the command's reply (a large bulk string into a buffer from `pool`).
    fn recv(&self, c: &mut Conn, pool: Option<&BufPool>) -> Result<redis::Value, String> {
        c.recv(pool)
    }
}

impl Pack for redis::Cmd {
    fn pack(&self, _key: &str, _c: &mut Conn, packed: &mut Vec<u8>) -> Result<(), String> {
        self.write_packed_command(packed);
        Ok(())
    }
}

/// Most bytes of the reused pipeline buffer a thread keeps between batches.
pub(super) const KEEP_BUFFER_BYTES: usize = 64 << 20;

impl Conns {
    /// Drops the reused pipeline buffer when it grew past [`KEEP_BUFFER_BYTES`].
    pub(super) fn trim(&mut self) {
        if self.packed.capacity() > KEEP_BUFFER_BYTES {
            self.packed = Vec::new();
        }
    }
}

/// See the module docs.
pub(super) struct Router {
    cfg: RouterConfig,
    /// The URL's form for messages (no password).
    label: String,
    state: Mutex<RouterState>,
    /// Replies from a node after a failure of that node.
    pub reconnects: AtomicU64,
    /// What [`Router::all_down`] answers, published under the lock at each change of the nodes'
    /// state so that the scheduler's thread reads it without the lock the I/O threads take: 0
    /// while some watched node is up, else 1 + nanoseconds from `base` to the earliest end of a
    /// backoff (1 when a down node has no end yet).
    down: AtomicU64,
    /// Whether any node is failed, published with `down`: while none is, [`Router::probe`]
    /// returns without taking the lock (each I/O thread asks before each job).
    any_failed: AtomicBool,
    base: Instant,
}

fn lock(m: &Mutex<RouterState>) -> MutexGuard<'_, RouterState> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Router {
    /// A router over the URL's nodes (`seeds`: parsed connection infos, in the URL's order).
    pub(super) fn new(cfg: RouterConfig, label: String, seeds: Vec<redis::ConnectionInfo>) -> Self {
        let mut st = RouterState {
            nodes: Vec::new(),
            by_addr: HashMap::new(),
            seeds: 0,
            free: Vec::new(),
            slots: Vec::new(),
            serving: Vec::new(),
            epoch: 0,
            stale: true,
            refreshing: false,
            probe: None,
            last_refresh: None,
        };
        for info in seeds {
            let (host, port) = match info.addr() {
                redis::ConnectionAddr::Tcp(h, p)
                | redis::ConnectionAddr::TcpTls {
                    host: h, port: p, ..
                } => (h.clone(), *p),
                redis::ConnectionAddr::Unix(p) => (p.display().to_string(), 0),
                _ => (String::new(), 0),
            };
            Self::add_node(&mut st, &cfg, host, port, info);
            st.seeds = st.nodes.len();
        }
        Self {
            cfg,
            label,
            state: Mutex::new(st),
            reconnects: AtomicU64::new(0),
            down: AtomicU64::new(0),
            any_failed: AtomicBool::new(false),
            base: Instant::now(),
        }
    }

    /// Publishes what [`Router::all_down`] answers (see `down`); called under the lock after
    /// every change of a node's state or of the serving set.
    fn publish(&self, st: &RouterState) {
        let mut until: Option<u64> = Some(0);
        for id in Self::watched(st) {
            let n = &st.nodes[id];
            if !n.failed {
                until = None;
                break;
            }
            let t = n.down_until.map_or(0, |t| {
                u64::try_from(t.saturating_duration_since(self.base).as_nanos())
                    .unwrap_or(u64::MAX - 1)
            });
            until = until.map(|u| if u == 0 { t + 1 } else { u.min(t + 1) });
        }
        // No watched node at all (cannot happen: a URL names one) counts as up.
        let v = match until {
            Some(u) if u > 0 => u,
            _ => 0,
        };
        self.down.store(v, Relaxed);
        self.any_failed
            .store(st.nodes.iter().any(|n| n.failed), Relaxed);
    }

    fn add_node(
        st: &mut RouterState,
        cfg: &RouterConfig,
        host: String,
        port: u16,
        info: redis::ConnectionInfo,
    ) -> Option<usize> {
        if let Some(&id) = st.by_addr.get(&(host.clone(), port)) {
            return Some(id);
        }
        let reuse = st.free.pop();
        if reuse.is_none() && st.seeds > 0 && st.nodes.len() >= st.seeds + MAX_NODES {
            return None;
        }
        let node = Node {
            host: host.clone(),
            port,
            info,
            down_until: None,
            backoff: cfg.backoff_min,
            failed: false,
            // A thread's connection to a reused id's former node was opened before this
            // `downs`: it is dropped at its next use (see `Conns::opened`).
            downs: reuse.map_or(0, |id| st.nodes[id].downs + 1),
            ups: reuse.map_or(0, |id| st.nodes[id].ups + 1),
            retired: false,
        };
        let id = if let Some(id) = reuse {
            st.nodes[id] = node;
            id
        } else {
            st.nodes.push(node);
            st.nodes.len() - 1
        };
        st.by_addr.insert((host, port), id);
        Some(id)
    }

    /// Drops the nodes learned from the Cluster that `announced` (the ids a new map named) does
    /// not name: their ids go to the free list (see [`MAX_NODES`]).
    fn retire_unannounced(st: &mut RouterState, announced: &[usize]) {
        for id in st.seeds..st.nodes.len() {
            if st.nodes[id].retired || announced.binary_search(&id).is_ok() {
                continue;
            }
            Self::end_probe(st, id);
            let n = &mut st.nodes[id];
            n.retired = true;
            n.failed = false;
            n.down_until = None;
            n.downs += 1;
            let addr = (std::mem::take(&mut n.host), n.port);
            st.by_addr.remove(&addr);
            st.free.push(id);
        }
    }

    /// The node at `host:port`, added (with the first seed's TLS and credentials) if new and
    /// within [`MAX_NODES`].
    fn node_at(&self, st: &mut RouterState, host: &str, port: u16) -> Option<usize> {
        if let Some(&id) = st.by_addr.get(&(host.to_owned(), port)) {
            return Some(id);
        }
        let base = st.nodes[0].info.clone();
        let addr = match base.addr() {
            redis::ConnectionAddr::TcpTls {
                insecure,
                tls_params,
                ..
            } => redis::ConnectionAddr::TcpTls {
                host: host.to_owned(),
                port,
                insecure: *insecure,
                tls_params: tls_params.clone(),
            },
            _ => redis::ConnectionAddr::Tcp(host.to_owned(), port),
        };
        let id = Self::add_node(st, &self.cfg, host.to_owned(), port, base.set_addr(addr));
        self.publish(st);
        id
    }

    /// Whether every node that serves keys is down now, and if so until when (the earliest end of
    /// their backoffs): callers then fail jobs without queuing them.
    pub(super) fn all_down(&self, now: Instant) -> Option<Instant> {
        // No lock: the answer is published at each change (see `publish`).
        match self.down.load(Relaxed) {
            0 => None,
            v => {
                let t = self.base + Duration::from_nanos(v - 1);
                // At least `backoff_min` (a probe may be due already, its result is not known yet).
                Some(t.max(now + self.cfg.backoff_min))
            }
        }
    }

    /// The nodes whose state matters: those the slot map names (every node while there is none:
    /// standalone, or before the first map).
    fn watched(st: &RouterState) -> Vec<usize> {
        if st.serving.is_empty() {
            (0..st.nodes.len()).collect()
        } else {
            st.serving.clone()
        }
    }

    /// Whether commands may go to node `id`: not while it is failed (until a probe succeeds).
    fn usable(st: &RouterState, id: usize) -> bool {
        !st.nodes[id].failed
    }

    /// How long until a probe is due (zero: now), `None` when no watched node is failed or a
    /// probe is running. The I/O threads wait at most this long for a job.
    pub(super) fn next_probe(&self, now: Instant) -> Option<Duration> {
        let st = lock(&self.state);
        if st
            .probe
            .is_some_and(|(_, t)| now.duration_since(t) < self.probe_limit())
        {
            return None;
        }
        Self::watched(&st)
            .into_iter()
            .filter(|&i| st.nodes[i].failed)
            .map(|i| {
                st.nodes[i]
                    .down_until
                    .map_or(Duration::ZERO, |t| t.saturating_duration_since(now))
            })
            .min()
    }

    /// A probe older than this is taken over (its thread is gone or stuck past its timeouts).
    fn probe_limit(&self) -> Duration {
        (self.cfg.connect_timeout + self.cfg.io_timeout) * 2
    }

    /// Probes one failed node whose backoff is over (a new connection and `PING`), unless another
    /// thread is probing: after a reply the node takes commands again (a reconnect), otherwise its
    /// backoff doubles. Jobs never wait for a probe (they fail the node's commands at once), and
    /// one probe runs at a time across all nodes and threads, so a partition of every node never
    /// ties up every I/O thread.
    pub(super) fn probe(&self, conns: &mut Conns) -> Option<String> {
        // Every change of a node's state publishes this under the lock (`publish`); a failure
        // published just after this load is probed at this thread's next look.
        if !self.any_failed.load(Relaxed) {
            return None;
        }
        let now = Instant::now();
        let (id, info, ups) = {
            let mut st = lock(&self.state);
            if st
                .probe
                .is_some_and(|(_, t)| now.duration_since(t) < self.probe_limit())
            {
                return None;
            }
            let due = Self::watched(&st).into_iter().find(|&i| {
                let n = &st.nodes[i];
                n.failed && n.down_until.is_none_or(|t| t <= now)
            });
            let id = due?;
            st.probe = Some((id, now));
            let n = &st.nodes[id];
            (id, (n.info.clone(), n.downs), n.ups)
        };
        conns.map.remove(&id);
        let r = self.conn(conns, id, Some(info)).and_then(|c| {
            c.request(&redis::cmd("PING"), self.cfg.io_timeout)
                .map_err(|e| format!("PING: {e}"))
        });
        let mut st = lock(&self.state);
        match r {
            Ok(_) => {
                self.mark_up(&mut st, id);
                st.stale = true;
                None
            }
            Err(e) => {
                conns.map.remove(&id);
                if !self.mark_down_since(&mut st, id, ups) {
                    return None; // taken over, and the node answered the other probe
                }
                Some(format!("{} {}: {e}", self.label, Self::node_name(&st, id)))
            }
        }
    }

    /// Node `id`'s [`Node::ups`] now: a call takes it when it begins, for
    /// [`Self::mark_down_since`].
    fn ups(st: &RouterState, id: usize) -> u64 {
        st.nodes[id].ups
    }

    /// Marks node `id` down for a call that failed and began when its `ups` was `ups`, unless
    /// the node came back since and is up: that failure is older than the reply that brought it
    /// back (docs/tier.md "Faults"). Whether it marked.
    fn mark_down_since(&self, st: &mut RouterState, id: usize, ups: u64) -> bool {
        if st.nodes[id].ups != ups && !st.nodes[id].failed {
            return false;
        }
        self.mark_down(st, id);
        true
    }

    fn end_probe(st: &mut RouterState, id: usize) {
        if st.probe.is_some_and(|(p, _)| p == id) {
            st.probe = None;
        }
    }

    fn mark_down(&self, st: &mut RouterState, id: usize) {
        Self::end_probe(st, id);
        let n = &mut st.nodes[id];
        n.failed = true;
        n.downs += 1;
        let b = n.backoff.max(self.cfg.backoff_min);
        n.down_until = Some(Instant::now() + b);
        n.backoff = (b * 2).min(self.cfg.backoff_max);
        st.stale = true;
        self.publish(st);
    }

    fn mark_up(&self, st: &mut RouterState, id: usize) {
        Self::end_probe(st, id);
        let n = &mut st.nodes[id];
        if n.failed {
            self.reconnects.fetch_add(1, Relaxed);
            n.failed = false;
            n.ups += 1;
            n.down_until = None;
            n.backoff = self.cfg.backoff_min;
            self.publish(st);
        }
    }

    fn node_name(st: &RouterState, id: usize) -> String {
        let n = &st.nodes[id];
        format!("{}:{}", n.host, n.port)
    }

    /// A connection to node `id` for this thread (opened if needed; the failure message if not).
    fn conn<'a>(
        &self,
        conns: &'a mut Conns,
        id: usize,
        info: Option<(redis::ConnectionInfo, u64)>,
    ) -> Result<&'a mut Conn, String> {
        match conns.map.entry(id) {
            std::collections::hash_map::Entry::Occupied(e) => Ok(e.into_mut()),
            std::collections::hash_map::Entry::Vacant(e) => {
                let (info, downs) = info.ok_or("no such node")?;
                let c = Conn::open(
                    &info,
                    self.cfg.tls.as_ref(),
                    self.cfg.connect_timeout,
                    self.cfg.io_timeout,
                    self.cfg.max_bulk,
                )?;
                conns.opened.insert(id, downs);
                Ok(e.insert(c))
            }
        }
    }

    /// Reads the slot map again when it is stale (or missing) and no other thread does; the last
    /// failure when no node gave a map (the old map, if any, stays).
    fn refresh(&self, conns: &mut Conns, now_please: bool) -> Option<String> {
        let now = Instant::now();
        let order: Vec<usize> = {
            let mut st = lock(&self.state);
            let have_map = !st.slots.is_empty();
            let due = st.stale
                && (!have_map
                    || now_please
                    || st
                        .last_refresh
                        .is_none_or(|t| now.duration_since(t) >= self.cfg.backoff_min));
            // Without a map every thread may ask (none can route); with one, one thread at a time.
            if !due || (have_map && st.refreshing) {
                return None;
            }
            st.refreshing = true;
            st.last_refresh = Some(now);
            // Nodes not failed (failed ones come back through `probe`), those this thread is
            // connected to first.
            let mut ids: Vec<usize> = (0..st.nodes.len())
                .filter(|&i| Self::usable(&st, i) && !st.nodes[i].retired)
                .collect();
            ids.sort_by_key(|&i| (!conns.map.contains_key(&i), i));
            ids
        };
        let mut error = None;
        for id in order {
            let (info, ups) = {
                let st = lock(&self.state);
                if !Self::usable(&st, id) || st.nodes[id].retired {
                    continue;
                }
                if conns
                    .opened
                    .get(&id)
                    .is_some_and(|&d| d < st.nodes[id].downs)
                {
                    conns.map.remove(&id); // opened before the node's last failure
                }
                (
                    (st.nodes[id].info.clone(), st.nodes[id].downs),
                    Self::ups(&st, id),
                )
            };
            let reply = self.conn(conns, id, Some(info)).and_then(|c| {
                c.request(redis::cmd("CLUSTER").arg("SLOTS"), self.cfg.io_timeout)
                    .map_err(|e| format!("CLUSTER SLOTS: {e}"))
            });
            let mut st = lock(&self.state);
            match reply {
                Ok(v) => {
                    self.mark_up(&mut st, id);
                    let host = st.nodes[id].host.clone();
                    if let Some(map) = self.parse_slots(&mut st, &v, &host) {
                        let mut serving: Vec<usize> = map
                            .iter()
                            .filter(|&&n| n != NO_NODE)
                            .map(|&n| n as usize)
                            .collect();
                        serving.sort_unstable();
                        serving.dedup();
                        st.serving = serving;
                        self.publish(&st);
                        st.slots = map;
                        st.epoch += 1;
                        st.stale = false;
                        st.refreshing = false;
                        return None;
                    }
                    error = Some(format!(
                        "{}: CLUSTER SLOTS answered {v:?}",
                        Self::node_name(&st, id)
                    ));
                }
                Err(e) => {
                    conns.map.remove(&id);
                    self.mark_down_since(&mut st, id, ups);
                    error = Some(format!("{}: {e}", Self::node_name(&st, id)));
                }
            }
        }
        lock(&self.state).refreshing = false;
        error.map(|e| format!("{} {e}", self.label))
    }

    /// The slot map of a `CLUSTER SLOTS` reply (nodes added as learned); `None` if malformed.
    fn parse_slots(&self, st: &mut RouterState, v: &redis::Value, asked: &str) -> Option<Vec<u32>> {
        let redis::Value::Array(ranges) = v else {
            return None;
        };
        let mut map = vec![NO_NODE; SLOTS];
        let mut announced = Vec::new();
        for r in ranges {
            let redis::Value::Array(parts) = r else {
                return None;
            };
            let int = |v: &redis::Value| match v {
                redis::Value::Int(i) => usize::try_from(*i).ok(),
                _ => None,
            };
            let start = int(parts.first()?)?;
            let end = int(parts.get(1)?)?;
            if start > end || end >= SLOTS {
                return None;
            }
            let mut master = None;
            for (j, node) in parts.iter().skip(2).enumerate() {
                let redis::Value::Array(fields) = node else {
                    return None;
                };
                let host = match fields.first()? {
                    redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                    redis::Value::SimpleString(s) => s.clone(),
                    _ => return None,
                };
                let port = u16::try_from(int(fields.get(1)?)?).ok()?;
                // "" : the node asked; "?" : an endpoint the node does not know (skipped).
                let host = if host.is_empty() {
                    asked.to_owned()
                } else {
                    host
                };
                if host == "?" {
                    continue;
                }
                // A node past the cap is left out, as an unknown endpoint is.
                let Some(id) = self.node_at(st, &host, port) else {
                    continue;
                };
                announced.push(id);
                if j == 0 {
                    master = Some(id);
                }
            }
            if let Some(m) = master {
                let m = u32::try_from(m).ok()?;
                map[start..=end].fill(m);
            }
        }
        announced.sort_unstable();
        announced.dedup();
        Self::retire_unannounced(st, &announced);
        Some(map)
    }
}

#[cfg(test)]
#[allow(clippy::pedantic, clippy::unwrap_used)] // tests: style lints are for the library
mod tests {
    use super::*;

    /// A `CLUSTER SLOTS` reply: slot ranges of 16 slots, each with a master and a replica on
    /// ports from `first` on.
    fn slots_reply(first: u16, ranges: u16) -> redis::Value {
        use redis::Value::{Array, BulkString, Int};
        let node = |p: u16| Array(vec![BulkString(b"10.0.0.1".to_vec()), Int(i64::from(p))]);
        Array(
            (0..ranges)
                .map(|r| {
                    Array(vec![
                        Int(i64::from(r) * 16),
                        Int(i64::from(r) * 16 + 15),
                        node(first + 2 * r),
                        node(first + 2 * r + 1),
                    ])
                })
                .collect(),
        )
    }

    fn standalone() -> Router {
        let cfg = RouterConfig {
            cluster: false,
            connect_timeout: Duration::from_secs(1),
            io_timeout: Duration::from_secs(1),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(1),
            max_bulk: 1 << 20,
            tls: None,
        };
        let seed =
            redis::IntoConnectionInfo::into_connection_info("redis://127.0.0.1:7000").unwrap();
        Router::new(cfg, "redis://127.0.0.1:7000".into(), vec![seed])
    }

    /// A call that began before the node came back and fails after (a thread held up past a
    /// server's restart, or a probe taken over) does not mark it down again; a call that began
    /// after does, and so does a second failure while it is down (docs/tier.md "Faults").
    #[test]
    fn a_failure_older_than_the_recovery_does_not_mark_the_node_down() {
        let r = standalone();
        let mut st = lock(&r.state);
        let before = Router::ups(&st, 0);
        // Another thread's call fails (the server is gone), then a probe gets a reply.
        assert!(r.mark_down_since(&mut st, 0, before));
        assert!(st.nodes[0].failed);
        r.mark_up(&mut st, 0);
        assert!(!st.nodes[0].failed);
        let downs = st.nodes[0].downs;
        // The held-up call reports its failure now: ignored, the node stays up.
        assert!(!r.mark_down_since(&mut st, 0, before));
        assert!(!st.nodes[0].failed && st.nodes[0].down_until.is_none());
        assert_eq!(st.nodes[0].downs, downs);
        assert!(r.all_down(Instant::now()).is_none());
        // A call that began after the recovery and fails marks it down.
        let after = Router::ups(&st, 0);
        assert!(r.mark_down_since(&mut st, 0, after));
        assert!(st.nodes[0].failed);
        // While it is down, an older call's failure still counts (the backoff grows).
        assert!(r.mark_down_since(&mut st, 0, before));
        assert_eq!(st.nodes[0].downs, downs + 2);
    }

    /// A seed that names ever-new nodes at each map: the router keeps at most its seeds and
    /// [`MAX_NODES`] nodes, the nodes of the latest map, and no address of the older ones
    /// (docs/tier.md "Cluster routing").
    #[test]
    fn the_node_map_stays_bounded_under_ever_new_nodes() {
        let cfg = RouterConfig {
            cluster: true,
            connect_timeout: Duration::from_secs(1),
            io_timeout: Duration::from_secs(1),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(1),
            max_bulk: 1 << 20,
            tls: None,
        };
        let seed =
            redis::IntoConnectionInfo::into_connection_info("redis://127.0.0.1:7000").unwrap();
        let r = Router::new(cfg, "redis+cluster://127.0.0.1:7000".into(), vec![seed]);
        for round in 0..40u16 {
            // 300 new nodes per map (150 ranges of a master and a replica).
            let v = slots_reply(10_000 + round * 300, 150);
            let mut st = lock(&r.state);
            let map = r.parse_slots(&mut st, &v, "127.0.0.1").unwrap();
            assert_eq!(
                map[0] as usize,
                st.by_addr[&("10.0.0.1".to_owned(), 10_000 + round * 300)]
            );
            assert!(st.nodes.len() <= 1 + MAX_NODES, "{} nodes", st.nodes.len());
            assert_eq!(st.by_addr.len(), 1 + 300, "round {round}");
        }
        // A map naming more than the cap keeps the cap: the nodes past it are left out.
        let v = slots_reply(40_000, 1000);
        let mut st = lock(&r.state);
        let map = r.parse_slots(&mut st, &v, "127.0.0.1").unwrap();
        assert!(st.nodes.len() <= 1 + MAX_NODES);
        // (The previous map's 300 nodes still held their places while this one was read.)
        assert_eq!(st.by_addr.len(), 1 + MAX_NODES - 300);
        assert!(map.contains(&NO_NODE) && map[0] != NO_NODE);
    }
}
