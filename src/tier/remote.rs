//! The remote tier (docs/tier.md "Remote tier"): blocks kept as values in Redis ≥ 7 or Valkey,
//! standalone or Cluster, shared by engines on many machines.
//!
//! **Client.** The `redis` crate's synchronous client (docs/design.md "Remote tier client"): Cluster
//! slot routing with MOVED/ASK and failover handled by the crate, pipelines, `rediss://` over
//! rustls. Each I/O thread owns one connection (a [`redis::Connection`] or a
//! [`redis::cluster::ClusterConnection`]); every network call has a timeout
//! ([`RemoteConfig::connect_timeout`], [`RemoteConfig::io_timeout`]). A failed call drops the
//! connection (a timed-out pipeline leaves replies in flight) and marks the server down for a
//! backoff that doubles from [`RemoteConfig::backoff_min`] to [`RemoteConfig::backoff_max`];
//! while it is down, jobs fail at once without touching the network (fetches answer "absent",
//! writes are counted as errors, reads as failed promotions), and one thread tries to reconnect
//! when the backoff ends ([`SecondaryCounters::reconnects`] counts the successes).
//!
//! **URLs.** `redis://[user:password@]host:port[/db]` (standalone), `rediss://…` (TLS), and
//! `redis+cluster://host:port[,host:port…]` / `rediss+cluster://…` for a Cluster (seed nodes). A
//! password missing from the URL is taken from the environment variable
//! [`RemoteConfig::password_env`] (default `KVOFF_REMOTE_PASSWORD`). The password never appears in
//! a log line, error, `Debug` output or metric label: [`redact`] is the only form of the URL kvoff
//! prints.
//!
//! **Keys.** `kvoff:{<fingerprint>:<key>}:r<rank>` where `<fingerprint>` is the 16-hex-digit
//! layout fingerprint ([`super::Layout::fingerprint`]: namespace, page sizes, block factor, dtype,
//! world size, payload length) and `<key>` the block key in hex (keys longer than 100 bytes: `h` +
//! xxh3-128). The Cluster hash tag `{fingerprint:key}` leaves the rank out, so the ranks of one
//! block land on one shard (a block is useful only whole, and one shard lost loses whole blocks,
//! not a slot of each), while consecutive blocks of a prefix spread over the shards (their fetches
//! and the load go to every shard).
//!
//! **Values.** Exactly the bytes of a tier file without its padding: the 4 KiB header of
//! [`super::format`] (magic, version, layout fingerprint, rank, world size, payload length, xxh3-64
//! of the payload, owner tag, the key, header checksum), then the payload. A value is served only
//! when its length is exact and every header field and the payload checksum match; otherwise it is
//! rejected ([`SecondaryCounters::rejected`]), never copied into host memory, and deleted (its key
//! is in this layout's key space, so no valid value of another layout can live there). A value is
//! at most [`MAX_VALUE_BYTES`] (far below Redis's 512 MB limit): a layout whose block is larger is
//! refused at [`RemoteTier::open`]. An optional TTL ([`RemoteConfig::ttl`]) is set with each write.
//!
//! **Index.** The tier's index is in memory and partial: keys this instance wrote or fetched are
//! `Present`, recent misses are `Absent` for [`RemoteConfig::negative_ttl`], others are
//! `Unknown` until a fetch ([`SecondaryTier::submit_fetch`]) runs: one pipelined `GET` of a batch
//! of keys (the rest of a prefix) whose found values are checked and kept (at most
//! [`RemoteConfig::max_staged_bytes`]) until the owner reads them into host blocks. Keys known
//! `Present` go stale after [`RemoteConfig::present_ttl`] (another engine, a TTL or `maxmemory`
//! may have removed them); a read of a vanished value is a failed promotion, never wrong data.
//!
//! **Bounds.** Writes queued beyond [`RemoteConfig::max_queued_writes`] or beyond
//! [`RemoteConfig::max_inflight_bytes`] (values copied out of host memory and not yet sent) are
//! dropped and counted; a fetch batch is at most [`RemoteConfig::max_fetch_keys`] keys.
#![forbid(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

use super::format::{self, HEADER_BYTES};
use super::secondary::{Known, SecondaryCounters, SecondaryTier};
use super::{BlockMemory, Completion, Layout};
use crate::error::{KvoffError, Result};
use crate::key::ByteKey;
use crate::manager::BlockId;

/// Largest value (header + payload) the remote tier writes: 64 MiB, far below Redis's 512 MB
/// string limit and small enough that one value does not stall a server's event loop for long.
pub const MAX_VALUE_BYTES: u64 = 64 << 20;

/// Longest key named by its hex bytes (longer keys are named by their hash).
const MAX_HEX_KEY: usize = 100;

/// Entries of the in-memory index before it is pruned (see `RemoteTier::expire`).
const INDEX_CAP: usize = 65_536;

/// Settings of a [`RemoteTier`].
#[derive(Clone)]
pub struct RemoteConfig {
    /// Server URL (see the module docs); may hold a password, never printed.
    pub url: String,
    /// What the blocks are.
    pub layout: Layout,
    /// Time to live of each value written (`None`: none; `maxmemory` policies still apply).
    pub ttl: Option<Duration>,
    /// Timeout of each connection attempt.
    pub connect_timeout: Duration,
    /// Timeout of each read and write on a connection (a pipeline of many values included).
    pub io_timeout: Duration,
    /// Number of I/O threads (one connection each).
    pub io_threads: usize,
    /// Writes queued or running beyond this are dropped (counted).
    pub max_queued_writes: usize,
    /// Bytes of values copied out of host memory and not yet acknowledged by the server.
    pub max_inflight_bytes: u64,
    /// Bytes of fetched values kept until they are read into host blocks.
    pub max_staged_bytes: u64,
    /// Most keys of one fetch.
    pub max_fetch_keys: usize,
    /// Most values of one write pipeline.
    pub max_write_batch: usize,
    /// How long a miss is remembered (a lookup then answers absent without a round trip).
    pub negative_ttl: Duration,
    /// How long a key found or written is believed present before it is fetched again.
    pub present_ttl: Duration,
    /// First wait before reconnecting after a failure.
    pub backoff_min: Duration,
    /// Longest wait between reconnection attempts.
    pub backoff_max: Duration,
    /// Environment variable holding the password when the URL has none.
    pub password_env: String,
    /// Identity of this instance in value headers (default: namespace, rank and host name).
    pub owner: Option<String>,
}

impl std::fmt::Debug for RemoteConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteConfig")
            .field("url", &redact(&self.url))
            .field("layout", &self.layout)
            .field("ttl", &self.ttl)
            .field("connect_timeout", &self.connect_timeout)
            .field("io_timeout", &self.io_timeout)
            .field("io_threads", &self.io_threads)
            .finish_non_exhaustive()
    }
}

impl RemoteConfig {
    /// Defaults: no TTL, 1 s connect and 2 s I/O timeouts, 2 I/O threads, 256 queued writes,
    /// 256 MiB in flight, 256 MiB staged, fetches of up to 64 keys, writes of up to 16 values per
    /// pipeline, misses remembered 2 s, hits 30 s, backoff 100 ms → 5 s, password from
    /// `KVOFF_REMOTE_PASSWORD`.
    #[must_use]
    pub fn new(url: impl Into<String>, layout: Layout) -> Self {
        Self {
            url: url.into(),
            layout,
            ttl: None,
            connect_timeout: Duration::from_secs(1),
            io_timeout: Duration::from_secs(2),
            io_threads: 2,
            max_queued_writes: 256,
            max_inflight_bytes: 256 << 20,
            max_staged_bytes: 256 << 20,
            max_fetch_keys: 64,
            max_write_batch: 16,
            negative_ttl: Duration::from_secs(2),
            present_ttl: Duration::from_secs(30),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            password_env: "KVOFF_REMOTE_PASSWORD".into(),
            owner: None,
        }
    }
}

/// The URL with any password replaced by `***` (the only form kvoff prints).
#[must_use]
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "<unparsable url>".into();
    };
    let parts: Vec<String> = rest
        .split(',')
        .map(|node| match node.rsplit_once('@') {
            Some((auth, host)) => match auth.split_once(':') {
                Some((user, _)) => format!("{user}:***@{host}"),
                None => format!("***@{host}"),
            },
            None => node.to_owned(),
        })
        .collect();
    format!("{scheme}://{}", parts.join(","))
}

fn pct_encode(s: &str) -> String {
    use std::fmt::Write;
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// The parsed target: node URLs for the `redis` crate, cluster or not.
struct Target {
    cluster: bool,
    nodes: Vec<String>,
}

fn parse_url(url: &str, password_env: &str) -> Result<Target> {
    let bad = |why: &str| {
        KvoffError::Config(format!(
            "remote tier: {why} in remote_url {} (expected redis://host:port, rediss://…, \
             redis+cluster://host:port[,host:port] or rediss+cluster://…)",
            redact(url)
        ))
    };
    let (scheme, rest) = url.split_once("://").ok_or_else(|| bad("no scheme"))?;
    let (cluster, base) = match scheme {
        "redis" => (false, "redis"),
        "rediss" => (false, "rediss"),
        "redis+cluster" => (true, "redis"),
        "rediss+cluster" => (true, "rediss"),
        _ => return Err(bad("unknown scheme")),
    };
    let env_pw = if password_env.is_empty() {
        None
    } else {
        std::env::var(password_env).ok().filter(|p| !p.is_empty())
    };
    let mut nodes = Vec::new();
    for node in rest.split(',') {
        if node.is_empty() {
            return Err(bad("an empty node"));
        }
        if !cluster && !nodes.is_empty() {
            return Err(bad("several nodes without +cluster"));
        }
        let node = match (&env_pw, node.rsplit_once('@')) {
            (Some(pw), None) => format!("{base}://:{}@{node}", pct_encode(pw)),
            (Some(pw), Some((user, host))) if !user.contains(':') => {
                format!("{base}://{user}:{}@{host}", pct_encode(pw))
            }
            _ => format!("{base}://{node}"),
        };
        // Checked here so that a bad URL is a configuration error at open, not a later I/O error.
        redis::IntoConnectionInfo::into_connection_info(node.as_str())
            .map_err(|e| bad(&format!("{:?}", e.kind())))?;
        nodes.push(node);
    }
    Ok(Target { cluster, nodes })
}

enum Conn {
    Single(redis::Connection),
    Cluster(Box<redis::cluster::ClusterConnection>),
}

impl Conn {
    fn connect(
        t: &Target,
        connect_timeout: Duration,
        io_timeout: Duration,
    ) -> redis::RedisResult<Self> {
        if t.cluster {
            let client =
                redis::cluster::ClusterClientBuilder::new(t.nodes.iter().map(String::as_str))
                    .connection_timeout(connect_timeout)
                    .response_timeout(io_timeout)
                    .retries(2)
                    .build()?;
            let c = client.get_connection()?;
            c.set_read_timeout(Some(io_timeout))?;
            c.set_write_timeout(Some(io_timeout))?;
            Ok(Self::Cluster(Box::new(c)))
        } else {
            let client = redis::Client::open(t.nodes[0].as_str())?;
            let c = client.get_connection_with_timeout(connect_timeout)?;
            c.set_read_timeout(Some(io_timeout))?;
            c.set_write_timeout(Some(io_timeout))?;
            Ok(Self::Single(c))
        }
    }

    fn run(&mut self, cmds: Vec<redis::Cmd>) -> redis::RedisResult<Vec<redis::Value>> {
        match self {
            Self::Single(c) => {
                // Not `Pipeline::query`: redis-rs reads every remaining reply after a timeout,
                // each with the full read timeout, so a stalled server held a batch of n commands
                // for n timeouts. Here the first failed read ends the call (the connection is
                // dropped by the caller): a stalled server costs one read timeout per call.
                let mut packed = Vec::new();
                for cmd in &cmds {
                    cmd.write_packed_command(&mut packed);
                }
                c.send_packed_command(&packed)?;
                let mut out = Vec::with_capacity(cmds.len());
                for _ in 0..cmds.len() {
                    out.push(c.recv_response()?);
                }
                Ok(out)
            }
            Self::Cluster(c) => {
                let mut p = redis::cluster::ClusterPipeline::with_capacity(cmds.len());
                for cmd in cmds {
                    p.add_command(cmd);
                }
                p.query(c)
            }
        }
    }
}

#[derive(Clone, Debug)]
enum Entry {
    /// A fetch is asking the server.
    Fetching,
    /// Being written by this instance.
    Writing,
    /// Found or written; `value` holds a fetched, checked value until it is read.
    Present {
        value: Option<Arc<Vec<u8>>>,
        until: Instant,
    },
    /// Not found (remembered until `until`).
    Absent { until: Instant },
}

enum Job {
    Fetch(Vec<ByteKey>),
    Read(ByteKey, BlockId),
    Write(Vec<(ByteKey, BlockId)>),
}

#[derive(Default)]
struct State {
    index: HashMap<ByteKey, Entry, foldhash::fast::RandomState>,
    jobs_reads: VecDeque<Job>,
    jobs_writes: VecDeque<(ByteKey, BlockId)>,
    queued_writes: usize,
    running_reads: u64,
    running_writes: u64,
    inflight_bytes: u64,
    staged_bytes: u64,
    completions: Vec<Completion>,
    shutdown: bool,
    /// The server is considered down until then (no network call before).
    down_until: Option<Instant>,
    backoff: Duration,
    /// A thread is trying to reconnect.
    probing: bool,
    /// Whether a connection failed since the last success (the next success is a reconnect).
    failed: bool,
    last_error: Option<String>,
}

#[derive(Default)]
struct Counters {
    writes: AtomicU64,
    bytes_written: AtomicU64,
    write_ns: AtomicU64,
    write_errors: AtomicU64,
    writes_dropped: AtomicU64,
    promotions: AtomicU64,
    bytes_read: AtomicU64,
    read_ns: AtomicU64,
    read_errors: AtomicU64,
    rejected: AtomicU64,
    fetch_hits: AtomicU64,
    fetch_misses: AtomicU64,
    fetch_errors: AtomicU64,
    reconnects: AtomicU64,
}

struct Shared {
    target: Target,
    url_redacted: String,
    fingerprint: u64,
    fp_hex: String,
    rank: u32,
    world_size: u32,
    owner: u64,
    payload_len: usize,
    value_len: usize,
    cfg: RemoteConfig,
    memory: Arc<dyn BlockMemory>,
    state: Mutex<State>,
    cv: Condvar,
    counters: Counters,
    pid: u32,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn ns(t0: Instant) -> u64 {
    u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// What checking a fetched value found.
enum Checked {
    Ok(Vec<u8>),
    Missing,
    Rejected,
}

impl Shared {
    fn redis_key(&self, key: &ByteKey) -> String {
        let k = key.as_bytes();
        let stem = if k.len() <= MAX_HEX_KEY {
            super::hex(k)
        } else {
            format!("h{:032x}", xxh3_128(k))
        };
        format!("kvoff:{{{}:{stem}}}:r{}", self.fp_hex, self.rank)
    }

    fn expect_header(&self, key: &ByteKey) -> format::Header {
        format::Header {
            fingerprint: self.fingerprint,
            rank: self.rank,
            world_size: self.world_size,
            payload_len: self.payload_len as u64,
            payload_sum: 0,
            owner: self.owner,
            key: key.as_bytes().to_vec(),
        }
    }

    fn check(&self, key: &ByteKey, v: redis::Value) -> Checked {
        let bytes = match v {
            redis::Value::Nil => return Checked::Missing,
            redis::Value::BulkString(b) => b,
            _ => return Checked::Rejected,
        };
        if bytes.len() != self.value_len {
            return Checked::Rejected;
        }
        match format::verify(&bytes, &self.expect_header(key)) {
            Ok(_) => Checked::Ok(bytes),
            Err(_) => Checked::Rejected,
        }
    }

    /// A connection, reusing `conn`; `None` while the server is down (no network call then).
    fn connection<'a>(&self, conn: &'a mut Option<Conn>) -> Option<&'a mut Conn> {
        if conn.is_none() {
            {
                let mut st = lock(&self.state);
                // While the server is down only one thread probes it (after the backoff); the
                // others fail their jobs at once. Before any failure every thread connects.
                if st.down_until.is_some_and(|t| Instant::now() < t) || (st.failed && st.probing) {
                    return None;
                }
                st.probing = true;
            }
            let r = Conn::connect(&self.target, self.cfg.connect_timeout, self.cfg.io_timeout);
            let mut st = lock(&self.state);
            st.probing = false;
            match r {
                // Counted as a reconnect when the first command on it succeeds (`run`).
                Ok(c) => *conn = Some(c),
                Err(e) => {
                    self.mark_down(
                        &mut st,
                        &format!("connecting to {}: {e}", self.url_redacted),
                    );
                    return None;
                }
            }
        }
        conn.as_mut()
    }

    fn mark_down(&self, st: &mut State, msg: &str) {
        st.failed = true;
        let b = st.backoff.max(self.cfg.backoff_min);
        st.down_until = Some(Instant::now() + b);
        st.backoff = (b * 2).min(self.cfg.backoff_max);
        st.last_error = Some(msg.to_owned());
    }

    /// Runs `cmds` on the connection; on failure drops it and marks the server down.
    fn run(&self, conn: &mut Option<Conn>, cmds: Vec<redis::Cmd>) -> Option<Vec<redis::Value>> {
        let c = self.connection(conn)?;
        match c.run(cmds) {
            Ok(v) => {
                let mut st = lock(&self.state);
                if st.failed {
                    // Back after a failure (this connection or another thread's new one).
                    self.counters.reconnects.fetch_add(1, Relaxed);
                    st.failed = false;
                    st.down_until = None;
                    st.backoff = self.cfg.backoff_min;
                }
                Some(v)
            }
            Err(e) => {
                *conn = None;
                let mut st = lock(&self.state);
                // A server error reply (not a network failure) does not mark the server down.
                if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() {
                    self.mark_down(&mut st, &format!("{}: {e}", self.url_redacted));
                } else {
                    st.last_error = Some(format!("{}: {e}", self.url_redacted));
                }
                None
            }
        }
    }

    fn delete(&self, conn: &mut Option<Conn>, key: &ByteKey) {
        let mut c = redis::cmd("DEL");
        c.arg(self.redis_key(key));
        let _ = self.run(conn, vec![c]);
    }

    fn run_fetch(&self, conn: &mut Option<Conn>, keys: &[ByteKey]) {
        let t0 = Instant::now();
        let cmds = keys
            .iter()
            .map(|k| {
                let mut c = redis::cmd("GET");
                c.arg(self.redis_key(k));
                c
            })
            .collect();
        let Some(values) = self.run(conn, cmds).filter(|v| v.len() == keys.len()) else {
            self.counters.fetch_errors.fetch_add(1, Relaxed);
            // Unreachable: remember the keys as absent for a while (no refetch storm).
            let until = Instant::now() + self.cfg.negative_ttl;
            let mut st = lock(&self.state);
            for k in keys {
                if matches!(st.index.get(k), Some(Entry::Fetching)) {
                    st.index.insert(k.clone(), Entry::Absent { until });
                }
            }
            return;
        };
        let mut rejected = Vec::new();
        let mut results = Vec::with_capacity(keys.len());
        for (k, v) in keys.iter().zip(values) {
            let c = self.check(k, v);
            if matches!(c, Checked::Rejected) {
                rejected.push(k.clone());
            }
            results.push(c);
        }
        self.counters.read_ns.fetch_add(ns(t0), Relaxed);
        {
            let now = Instant::now();
            let mut st = lock(&self.state);
            for (k, c) in keys.iter().zip(results) {
                if !matches!(st.index.get(k), Some(Entry::Fetching)) {
                    continue; // written or forgotten meanwhile
                }
                let e = match c {
                    Checked::Ok(v) => {
                        self.counters.fetch_hits.fetch_add(1, Relaxed);
                        let keep = st.staged_bytes + v.len() as u64 <= self.cfg.max_staged_bytes;
                        let value = keep.then(|| {
                            st.staged_bytes += v.len() as u64;
                            Arc::new(v)
                        });
                        Entry::Present {
                            value,
                            until: now + self.cfg.present_ttl,
                        }
                    }
                    Checked::Missing => {
                        self.counters.fetch_misses.fetch_add(1, Relaxed);
                        Entry::Absent {
                            until: now + self.cfg.negative_ttl,
                        }
                    }
                    Checked::Rejected => {
                        self.counters.rejected.fetch_add(1, Relaxed);
                        self.counters.fetch_misses.fetch_add(1, Relaxed);
                        Entry::Absent {
                            until: now + self.cfg.negative_ttl,
                        }
                    }
                };
                st.index.insert(k.clone(), e);
            }
        }
        for k in &rejected {
            self.delete(conn, k);
        }
    }

    fn run_read(&self, conn: &mut Option<Conn>, key: &ByteKey, block: BlockId) {
        let t0 = Instant::now();
        let staged = {
            let mut st = lock(&self.state);
            match st.index.get_mut(key) {
                Some(Entry::Present { value, .. }) => value.take(),
                _ => None,
            }
        };
        let mut rejected = false;
        let value = if let Some(v) = staged {
            lock(&self.state).staged_bytes -= v.len() as u64;
            Some(v)
        } else {
            let mut c = redis::cmd("GET");
            c.arg(self.redis_key(key));
            match self.run(conn, vec![c]).and_then(|mut v| v.pop()) {
                Some(v) => match self.check(key, v) {
                    Checked::Ok(b) => Some(Arc::new(b)),
                    Checked::Missing => None,
                    Checked::Rejected => {
                        rejected = true;
                        None
                    }
                },
                None => None,
            }
        };
        let ok = value.as_ref().is_some_and(|v| {
            self.memory
                .copy_in(block, &v[HEADER_BYTES..HEADER_BYTES + self.payload_len])
                .is_ok()
        });
        if rejected {
            self.counters.rejected.fetch_add(1, Relaxed);
            self.delete(conn, key);
        }
        let mut st = lock(&self.state);
        st.running_reads = st.running_reads.saturating_sub(1);
        if ok {
            self.counters.promotions.fetch_add(1, Relaxed);
            self.counters
                .bytes_read
                .fetch_add(self.payload_len as u64, Relaxed);
            self.counters.read_ns.fetch_add(ns(t0), Relaxed);
        } else {
            self.counters.read_errors.fetch_add(1, Relaxed);
            st.index.insert(
                key.clone(),
                Entry::Absent {
                    until: Instant::now() + self.cfg.negative_ttl,
                },
            );
        }
        st.completions.push(Completion::Promoted {
            key: key.clone(),
            block,
            ok,
        });
    }

    fn run_writes(&self, conn: &mut Option<Conn>, items: &[(ByteKey, BlockId)]) {
        let t0 = Instant::now();
        // Copy every block out first and release it: the host block is free during the network.
        let mut values = Vec::with_capacity(items.len());
        for (k, b) in items {
            let mut v = vec![0u8; self.value_len];
            let copied = self.memory.copy_out(*b, &mut v[HEADER_BYTES..]).is_ok();
            let mut h = self.expect_header(k);
            h.payload_sum = format::payload_sum(&v[HEADER_BYTES..]);
            let encoded = copied && format::encode(&h, &mut v);
            values.push(encoded.then_some(v));
        }
        {
            let mut st = lock(&self.state);
            for (k, b) in items {
                st.completions.push(Completion::Released {
                    key: k.clone(),
                    block: *b,
                });
            }
        }
        let mut cmds = Vec::new();
        let mut sent = Vec::new();
        for ((k, _), v) in items.iter().zip(&values) {
            if let Some(v) = v {
                let mut c = redis::cmd("SET");
                c.arg(self.redis_key(k)).arg(v.as_slice());
                if let Some(ttl) = self.cfg.ttl {
                    c.arg("PX")
                        .arg(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1));
                }
                cmds.push(c);
                sent.push(k.clone());
            }
        }
        let n_failed_local = items.len() - sent.len();
        let ok = if cmds.is_empty() {
            Some(Vec::new())
        } else {
            self.run(conn, cmds)
        };
        drop(values);
        let elapsed = ns(t0);
        let mut st = lock(&self.state);
        st.inflight_bytes = st
            .inflight_bytes
            .saturating_sub((items.len() * self.value_len) as u64);
        st.running_writes = st.running_writes.saturating_sub(items.len() as u64);
        st.queued_writes = st.queued_writes.saturating_sub(items.len());
        self.counters
            .write_errors
            .fetch_add(n_failed_local as u64, Relaxed);
        let now = Instant::now();
        for (i, k) in sent.iter().enumerate() {
            let good = ok
                .as_ref()
                .and_then(|v| v.get(i))
                .is_some_and(|v| matches!(v, redis::Value::Okay | redis::Value::SimpleString(_)));
            if good {
                self.counters.writes.fetch_add(1, Relaxed);
                self.counters
                    .bytes_written
                    .fetch_add(self.payload_len as u64, Relaxed);
                if matches!(st.index.get(k), Some(Entry::Writing)) {
                    st.index.insert(
                        k.clone(),
                        Entry::Present {
                            value: None,
                            until: now + self.cfg.present_ttl,
                        },
                    );
                }
            } else {
                self.counters.write_errors.fetch_add(1, Relaxed);
                if let Some(v) = ok.as_ref().and_then(|v| v.get(i)) {
                    st.last_error = Some(format!("{}: SET answered {v:?}", self.url_redacted));
                }
                if matches!(st.index.get(k), Some(Entry::Writing)) {
                    st.index.remove(k);
                }
            }
        }
        self.counters.write_ns.fetch_add(elapsed, Relaxed);
        drop(st);
        self.cv.notify_all();
    }

    fn worker(self: &Arc<Self>) {
        let mut conn: Option<Conn> = None;
        loop {
            let mut st = lock(&self.state);
            let job = loop {
                if let Some(j) = st.jobs_reads.pop_front() {
                    if matches!(j, Job::Read(..)) {
                        st.running_reads += 1;
                    }
                    break Some(j);
                }
                if !st.jobs_writes.is_empty() {
                    let n = st.jobs_writes.len().min(self.cfg.max_write_batch.max(1));
                    let batch: Vec<_> = st.jobs_writes.drain(..n).collect();
                    st.running_writes += batch.len() as u64;
                    break Some(Job::Write(batch));
                }
                if st.shutdown {
                    break None;
                }
                st = self
                    .cv
                    .wait_timeout(st, Duration::from_millis(500))
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            };
            drop(st);
            match job {
                None => return,
                Some(Job::Fetch(keys)) => self.run_fetch(&mut conn, &keys),
                Some(Job::Read(k, b)) => self.run_read(&mut conn, &k, b),
                Some(Job::Write(items)) => self.run_writes(&mut conn, &items),
            }
        }
    }
}

/// The remote tier. See the module docs.
pub struct RemoteTier {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for RemoteTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteTier")
            .field("url", &self.shared.url_redacted)
            .field("cluster", &self.shared.target.cluster)
            .finish_non_exhaustive()
    }
}

impl RemoteTier {
    /// Parses the URL, checks the layout and starts the I/O threads. Does not connect: the first
    /// job does (so an engine starts while the server is down; jobs fail until it is up).
    ///
    /// # Errors
    /// [`KvoffError::Config`] for a bad URL or a value larger than [`MAX_VALUE_BYTES`];
    /// [`KvoffError::InvalidArgument`] for zero I/O threads, a zero block size or a bad rank.
    pub fn open(cfg: RemoteConfig, memory: Arc<dyn BlockMemory>) -> Result<Self> {
        if cfg.io_threads == 0 || cfg.io_threads > 64 {
            return Err(KvoffError::arg(format!(
                "remote io_threads must be in 1..=64, got {}",
                cfg.io_threads
            )));
        }
        let payload_len = memory.block_bytes();
        if payload_len == 0 {
            return Err(KvoffError::arg(
                "the remote tier needs blocks of at least one byte",
            ));
        }
        let value_len = HEADER_BYTES + payload_len;
        if value_len as u64 > MAX_VALUE_BYTES {
            return Err(KvoffError::Config(format!(
                "remote tier: a block of {payload_len} bytes exceeds the value cap of {} bytes \
                 (use a smaller block_size or fewer layers per rank)",
                MAX_VALUE_BYTES - HEADER_BYTES as u64
            )));
        }
        let lay = &cfg.layout;
        if lay.world_size == 0 || lay.rank >= lay.world_size {
            return Err(KvoffError::arg(format!(
                "rank {} out of range for world_size {}",
                lay.rank, lay.world_size
            )));
        }
        if cfg.io_timeout.is_zero() || cfg.connect_timeout.is_zero() {
            return Err(KvoffError::arg("remote timeouts must be positive"));
        }
        let target = parse_url(&cfg.url, &cfg.password_env)?;
        let fingerprint = lay.fingerprint(payload_len as u64);
        let owner_str = cfg
            .owner
            .clone()
            .unwrap_or_else(|| format!("{}|{}|{}", lay.namespace, lay.rank, super::host_name()));
        let shared = Arc::new(Shared {
            target,
            url_redacted: redact(&cfg.url),
            fingerprint,
            fp_hex: format!("{fingerprint:016x}"),
            rank: lay.rank,
            world_size: lay.world_size,
            owner: xxh3_64(owner_str.as_bytes()),
            payload_len,
            value_len,
            state: Mutex::new(State {
                backoff: cfg.backoff_min,
                ..State::default()
            }),
            cfg,
            memory,
            cv: Condvar::new(),
            counters: Counters::default(),
            pid: std::process::id(),
        });
        let mut threads = Vec::new();
        for i in 0..shared.cfg.io_threads {
            let sh = Arc::clone(&shared);
            let t = std::thread::Builder::new()
                .name(format!("kvoff-remote-{i}"))
                .spawn(move || {
                    crate::affinity::place_current_thread();
                    sh.worker();
                })
                .map_err(|e| {
                    KvoffError::Config(format!("remote tier: cannot start a thread: {e}"))
                })?;
            threads.push(t);
        }
        Ok(Self { shared, threads })
    }

    /// The URL with the password hidden.
    #[must_use]
    pub fn url(&self) -> &str {
        &self.shared.url_redacted
    }

    /// Whether the URL names a Cluster.
    #[must_use]
    pub fn is_cluster(&self) -> bool {
        self.shared.target.cluster
    }

    /// The server key of `key` (for tests and tools).
    #[must_use]
    pub fn redis_key(&self, key: &ByteKey) -> String {
        self.shared.redis_key(key)
    }

    /// Bytes of one value (header + payload).
    #[must_use]
    pub fn value_len(&self) -> usize {
        self.shared.value_len
    }

    /// Forgets what the index knows about `key` (the next lookup asks the server).
    pub fn forget(&self, key: &ByteKey) {
        let mut st = lock(&self.shared.state);
        if let Some(Entry::Present { value: Some(v), .. }) = st.index.remove(key) {
            st.staged_bytes -= v.len() as u64;
        }
    }

    fn forked(&self) -> bool {
        std::process::id() != self.shared.pid
    }

    /// Bounds the index (called from submissions): at [`INDEX_CAP`] entries, expired ones go; if
    /// more than half remain, every remembered answer without a staged value goes too (those keys
    /// become `Unknown`: a later lookup fetches them again). So the index stays below the cap and
    /// the scan's cost is amortised over the insertions that filled it.
    fn expire(st: &mut State, now: Instant) {
        if st.index.len() < INDEX_CAP {
            return;
        }
        let mut freed = 0u64;
        st.index.retain(|_, e| match e {
            Entry::Absent { until } => *until > now,
            Entry::Present { until, value } => {
                let keep = *until > now;
                if !keep {
                    freed += value.as_ref().map_or(0, |v| v.len() as u64);
                }
                keep
            }
            _ => true,
        });
        if st.index.len() > INDEX_CAP / 2 {
            st.index.retain(|_, e| {
                matches!(
                    e,
                    Entry::Fetching | Entry::Writing | Entry::Present { value: Some(_), .. }
                )
            });
        }
        st.staged_bytes -= freed;
    }
}

impl SecondaryTier for RemoteTier {
    fn kind(&self) -> &'static str {
        "remote"
    }

    fn index(&self, key: &ByteKey) -> Known {
        let st = lock(&self.shared.state);
        match st.index.get(key) {
            // A fetch in flight answers later; a key being written is not readable yet.
            None | Some(Entry::Writing | Entry::Fetching) => Known::Unknown,
            Some(Entry::Present { until, value }) => {
                if value.is_some() || *until > Instant::now() {
                    Known::Present
                } else {
                    Known::Unknown
                }
            }
            Some(Entry::Absent { until }) => {
                if *until > Instant::now() {
                    Known::Absent
                } else {
                    Known::Unknown
                }
            }
        }
    }

    fn submit_fetch(&self, keys: &[ByteKey]) -> usize {
        if self.forked() || keys.is_empty() {
            return 0;
        }
        let sh = &self.shared;
        let now = Instant::now();
        let mut st = lock(&sh.state);
        if st.shutdown {
            return 0;
        }
        Self::expire(&mut st, now);
        // While the server is down, remember the keys as misses: no job, no network.
        let down = st.down_until.is_some_and(|t| now < t);
        let down_until = st.down_until.unwrap_or(now);
        let mut batch = Vec::new();
        for k in keys.iter().take(sh.cfg.max_fetch_keys.max(1)) {
            let unknown = match st.index.get(k) {
                None => true,
                Some(Entry::Absent { until }) => *until <= now,
                Some(Entry::Present { until, value }) => value.is_none() && *until <= now,
                Some(Entry::Fetching | Entry::Writing) => false,
            };
            if !unknown {
                continue;
            }
            if down {
                sh.counters.fetch_errors.fetch_add(1, Relaxed);
                st.index
                    .insert(k.clone(), Entry::Absent { until: down_until });
                continue;
            }
            st.index.insert(k.clone(), Entry::Fetching);
            batch.push(k.clone());
        }
        let n = batch.len();
        if n > 0 {
            st.jobs_reads.push_back(Job::Fetch(batch));
            drop(st);
            sh.cv.notify_one();
        }
        n
    }

    fn has_or_writing(&self, key: &ByteKey) -> bool {
        self.index(key) == Known::Present
            || matches!(
                lock(&self.shared.state).index.get(key),
                Some(Entry::Writing)
            )
    }

    fn submit_writes(&self, items: &[(ByteKey, BlockId)]) -> Vec<bool> {
        let sh = &self.shared;
        if self.forked() {
            return vec![false; items.len()];
        }
        let now = Instant::now();
        let mut st = lock(&sh.state);
        Self::expire(&mut st, now);
        let down = st.down_until.is_some_and(|t| now < t);
        let out = items
            .iter()
            .map(|(k, b)| {
                if st.shutdown {
                    return false;
                }
                if matches!(st.index.get(k), Some(Entry::Writing)) {
                    return false;
                }
                if down {
                    // Counted as an error: the server is unreachable (its backoff runs).
                    sh.counters.write_errors.fetch_add(1, Relaxed);
                    return false;
                }
                if st.queued_writes >= sh.cfg.max_queued_writes
                    || st.inflight_bytes + sh.value_len as u64 > sh.cfg.max_inflight_bytes
                {
                    sh.counters.writes_dropped.fetch_add(1, Relaxed);
                    return false;
                }
                st.queued_writes += 1;
                st.inflight_bytes += sh.value_len as u64;
                if let Some(Entry::Present { value: Some(v), .. }) =
                    st.index.insert(k.clone(), Entry::Writing)
                {
                    st.staged_bytes -= v.len() as u64;
                }
                st.jobs_writes.push_back((k.clone(), *b));
                true
            })
            .collect();
        drop(st);
        sh.cv.notify_one();
        out
    }

    fn submit_reads(&self, items: &[(ByteKey, BlockId)]) -> Vec<bool> {
        let sh = &self.shared;
        if self.forked() {
            return vec![false; items.len()];
        }
        let mut st = lock(&sh.state);
        let out = items
            .iter()
            .map(|(k, b)| {
                if st.shutdown || !matches!(st.index.get(k), Some(Entry::Present { .. })) {
                    return false;
                }
                st.jobs_reads.push_back(Job::Read(k.clone(), *b));
                true
            })
            .collect();
        drop(st);
        sh.cv.notify_all();
        out
    }

    fn poll(&self) -> Vec<Completion> {
        std::mem::take(&mut lock(&self.shared.state).completions)
    }

    fn busy(&self) -> bool {
        let st = lock(&self.shared.state);
        !(st.jobs_reads.is_empty()
            && st.jobs_writes.is_empty()
            && st.running_reads == 0
            && st.running_writes == 0
            && st.completions.is_empty()
            && !st.index.values().any(|e| matches!(e, Entry::Fetching)))
    }

    fn flush(&self) {
        if self.threads.is_empty() || self.forked() {
            return;
        }
        loop {
            {
                let st = lock(&self.shared.state);
                let idle = st.jobs_reads.is_empty()
                    && st.jobs_writes.is_empty()
                    && st.running_reads == 0
                    && st.running_writes == 0
                    && !st.index.values().any(|e| matches!(e, Entry::Fetching));
                if idle || st.shutdown {
                    return;
                }
            }
            self.shared.cv.notify_all();
            std::thread::sleep(Duration::from_micros(500));
        }
    }

    fn shutdown(&mut self) {
        if self.forked() {
            for t in self.threads.drain(..) {
                std::mem::forget(t);
            }
            lock(&self.shared.state).shutdown = true;
            return;
        }
        self.flush();
        lock(&self.shared.state).shutdown = true;
        self.shared.cv.notify_all();
        for t in self.threads.drain(..) {
            if t.join().is_err() {
                lock(&self.shared.state).last_error = Some("a remote I/O thread panicked".into());
            }
        }
    }

    fn counters(&self) -> SecondaryCounters {
        let c = &self.shared.counters;
        let st = lock(&self.shared.state);
        #[allow(clippy::cast_precision_loss)]
        let secs = |ns: &AtomicU64| ns.load(Relaxed) as f64 * 1e-9;
        SecondaryCounters {
            writes: c.writes.load(Relaxed),
            bytes_written: c.bytes_written.load(Relaxed),
            write_seconds: secs(&c.write_ns),
            write_errors: c.write_errors.load(Relaxed),
            writes_dropped: c.writes_dropped.load(Relaxed),
            promotions: c.promotions.load(Relaxed),
            bytes_read: c.bytes_read.load(Relaxed),
            read_seconds: secs(&c.read_ns),
            read_errors: c.read_errors.load(Relaxed),
            rejected: c.rejected.load(Relaxed),
            fetch_hits: c.fetch_hits.load(Relaxed),
            fetch_misses: c.fetch_misses.load(Relaxed),
            fetch_errors: c.fetch_errors.load(Relaxed),
            reconnects: c.reconnects.load(Relaxed),
            queued_reads: st.jobs_reads.len() as u64 + st.running_reads,
            queued_writes: st.queued_writes as u64,
            last_error: st.last_error.clone(),
        }
    }

    fn extra_stats(&self) -> Vec<(&'static str, u64)> {
        let (present, absent, staged) = self.index_gauges();
        let st = lock(&self.shared.state);
        let down = st.down_until.is_some_and(|t| Instant::now() < t);
        vec![
            ("known_present", present),
            ("known_absent", absent),
            ("staged_bytes", staged),
            ("inflight_bytes", st.inflight_bytes),
            ("up", u64::from(!down)),
        ]
    }
}

impl RemoteTier {
    /// Gauges of the index (for metrics): keys known present, remembered misses, staged bytes.
    fn index_gauges(&self) -> (u64, u64, u64) {
        let st = lock(&self.shared.state);
        let now = Instant::now();
        let mut present = 0;
        let mut absent = 0;
        for e in st.index.values() {
            match e {
                Entry::Present { until, value } if value.is_some() || *until > now => present += 1,
                Entry::Absent { until } if *until > now => absent += 1,
                _ => {}
            }
        }
        (present, absent, st.staged_bytes)
    }
}

impl Drop for RemoteTier {
    fn drop(&mut self) {
        SecondaryTier::shutdown(self);
    }
}
