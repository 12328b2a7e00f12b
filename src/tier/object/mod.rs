//! The object tier (docs/tier.md "Object tier"): blocks kept as objects in an S3-compatible store
//! (AWS S3, SeaweedFS, MinIO, Ceph RGW…) — capacity priced like disk, outliving every engine,
//! shared by a fleet, bounded in bytes.
//!
//! **Client.** Apache Arrow's `object_store` (SigV4, custom endpoints, multipart, retries with
//! backoff) on a tokio runtime of [`ObjectConfig::io_threads`] threads that the tier owns: the
//! scheduler's calls only update the in-memory index and hand jobs to the runtime, never wait.
//! Every request is bounded as a whole ([`ObjectConfig::io_timeout`], body included: a server
//! that trickles its reply is cut off) and retried [`ObjectConfig::max_retries`] times on server
//! errors, throttling (`503 SlowDown`) and timeouts. A failure (anything but "not found") marks
//! the store down for a backoff that doubles from [`ObjectConfig::backoff_min`] to
//! [`ObjectConfig::backoff_max`]: meanwhile fetches answer "absent", writes are refused and
//! counted, and no request is sent; the first success after it counts a reconnect.
//!
//! **Objects.** `<prefix>/<namespace>/<fingerprint>/<shard>/<key stem>.r<rank>` in the URL's
//! bucket: the 16-hex-digit layout fingerprint keeps layouts apart, `<shard>` (two hex digits of a
//! hash of the key) spreads a namespace over the store's partitions. A value is kvoff's
//! self-describing header ([`COMPACT_HEADER_BYTES`](crate::tier::COMPACT_HEADER_BYTES): magic,
//! version, fingerprint, rank, world size, payload length, xxh3-64 of the payload, owner, key,
//! header checksum) then the payload, written with one PUT (a multipart upload above
//! [`ObjectConfig::multipart_bytes`]): S3 makes an object visible only whole, so nothing is ever
//! seen half-written. Payloads are sent unsigned (`UNSIGNED-PAYLOAD`): the header's checksum
//! covers them, and a read serves a value only when its length is exact and every header field
//! and the checksum match; otherwise the value is rejected
//! ([`SecondaryCounters::rejected`](super::secondary::SecondaryCounters::rejected)), never copied
//! into host memory, and deleted.
//!
//! **Index.** In memory, never asked over the network on the scheduler's thread: the values this
//! instance wrote, those a listing of the namespace found (at start, then every
//! [`ObjectConfig::list_interval`], in the background), the answers of fetches (HEAD requests for
//! keys it did not know, started by lookups) and misses remembered for
//! [`ObjectConfig::negative_ttl`]. A read of a value that vanished is a failed promotion and a
//! miss, never wrong data.
//!
//! **Budget.** [`ObjectConfig::bytes_to_use`] bounds the bytes of this rank's values in the
//! namespace as the index sees them (this instance's writes and every engine's values found by
//! listing): before a write, and after each listing, least-recently-used values (recency: this
//! process's writes and reads, or a listed value's modification time) are deleted until the new
//! one fits. A write deletes its victims before its PUT, so one engine never goes over; engines
//! sharing a namespace each enforce the budget on what they see, so together they exceed it by at
//! most what they write between two listings. [`ObjectConfig::ttl`]: older values are never
//! served and are deleted when found.
//!
//! **Bounds.** Writes beyond [`ObjectConfig::max_queued_writes`] or
//! [`ObjectConfig::max_inflight_bytes`] are dropped and counted; at most
//! [`ObjectConfig::max_requests`] requests run at once; values larger than [`MAX_VALUE_BYTES`]
//! are refused at [`ObjectTier::open`].
//!
//! **Code.** This file: the shared state, `open`, the owner's API; `config` the settings, URL and
//! credentials; `index` the in-memory index and LRU; `io` the jobs on the runtime (PUT, GET, HEAD,
//! DELETE, listing); `secondary` the [`SecondaryTier`] implementation.
#![forbid(unsafe_code)]

mod config;
mod index;
mod io;
mod secondary;

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::{BackoffConfig, ClientOptions, RetryConfig};
use xxhash_rust::xxh3::xxh3_64;

pub use config::{namespace_segment, parse_url, Credentials, ObjectConfig};

use super::format;
use super::secondary::{SecondaryCounters, TierInfo};
use super::{BlockMemory, Completion};
use crate::error::{KvoffError, Result};
use crate::key::ByteKey;
use index::{Entry, Index};

/// The object tier's registration (docs/design.md "Recipe: adding a tier").
pub const INFO: TierInfo = TierInfo {
    kind: "object",
    folder: "object",
    extra_stats: &[
        "evictions",
        "expired",
        "index_entries",
        "known_bytes",
        "listings",
        "up",
    ],
};

/// Largest value (header + payload) the tier writes: 1 GiB.
pub const MAX_VALUE_BYTES: u64 = 1 << 30;

/// Most bytes of an error message kept (`last_error`): a server's error body may be large.
const MAX_ERROR_BYTES: usize = 512;

/// Most entries of the index (values and remembered misses): beyond it, remembered misses are
/// pruned, then new misses are not remembered.
const INDEX_CAP: usize = 4 << 20;

/// Unix time in ns.
fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// Nanoseconds since `t0`.
fn elapsed_ns(t0: Instant) -> u64 {
    u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX)
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
    evictions: AtomicU64,
    expired: AtomicU64,
    listings: AtomicU64,
}

#[derive(Default)]
struct State {
    index: Index,
    completions: Vec<Completion>,
    /// Jobs spawned and not finished (the listing loop not counted).
    running: usize,
    queued_reads: u64,
    queued_writes: u64,
    /// Value bytes of writes queued or running.
    inflight_bytes: u64,
    shutdown: bool,
    /// While set and in the future, the store is down: no request is sent.
    down_until: Option<Instant>,
    /// The next backoff (zero: up).
    backoff: Duration,
    last_error: Option<String>,
}

/// What the jobs share with the owner.
struct Shared {
    store: AmazonS3,
    /// `<prefix>/<namespace>/<fingerprint>`: every object of this layout is under it.
    base: String,
    fingerprint: u64,
    rank: u32,
    world_size: u32,
    owner: u64,
    payload_len: usize,
    /// Header + payload.
    value_len: u64,
    cfg: ObjectConfig,
    memory: Arc<dyn BlockMemory>,
    state: Mutex<State>,
    /// Wakes `flush`: the last running job finished.
    idle: Condvar,
    permits: tokio::sync::Semaphore,
    /// Held by the running listing.
    listing: tokio::sync::Mutex<()>,
    counters: Counters,
    /// The process that started the runtime (a `fork()`ed child has none of its threads).
    pid: u32,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    /// The index id and stem of `key`.
    fn ident(key: &ByteKey) -> (u64, String) {
        let stem = format::key_stem(key.as_bytes());
        (xxh3_64(stem.as_bytes()), stem)
    }

    /// The object name of the value with stem `stem` (index id `id`).
    fn object_name(&self, id: u64, stem: &str) -> String {
        format!("{}/{:02x}/{stem}.r{}", self.base, id >> 56, self.rank)
    }

    /// The `(id, stem)` of a listed object name, `None` when it is not one of this rank's value
    /// names (another rank's, a foreign object).
    fn parse_name(&self, name: &str) -> Option<(u64, String)> {
        let rest = name.strip_prefix(self.base.as_str())?.strip_prefix('/')?;
        let (shard, file) = rest.split_once('/')?;
        let stem = file.strip_suffix(&format!(".r{}", self.rank))?;
        format::parse_key_stem(stem)?;
        let id = xxh3_64(stem.as_bytes());
        (shard == format!("{:02x}", id >> 56)).then(|| (id, stem.to_owned()))
    }

    /// The header this tier expects of `key`'s value (its payload checksum aside).
    fn expect(&self, key: &ByteKey) -> format::Header {
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

    /// Whether the store is down now (no request should be sent).
    fn down(st: &State, now: Instant) -> bool {
        st.down_until.is_some_and(|t| t > now)
    }

    /// Records a failed request: the store is down for the next backoff.
    fn note_failure(&self, what: &str, e: &dyn std::fmt::Display) {
        let mut msg = format!("object tier: {what}: {e}");
        if msg.len() > MAX_ERROR_BYTES {
            let mut cut = MAX_ERROR_BYTES;
            while !msg.is_char_boundary(cut) {
                cut -= 1;
            }
            msg.truncate(cut);
            msg.push('…');
        }
        let mut st = lock(&self.state);
        let b = if st.backoff.is_zero() {
            self.cfg.backoff_min
        } else {
            st.backoff
        };
        st.down_until = Some(Instant::now() + b);
        st.backoff = (b * 2).min(self.cfg.backoff_max);
        st.last_error = Some(msg);
    }

    /// Records a successful request: a store that was down is up again.
    fn note_success(&self) {
        let mut st = lock(&self.state);
        if !st.backoff.is_zero() {
            st.backoff = Duration::ZERO;
            st.down_until = None;
            self.counters.reconnects.fetch_add(1, Relaxed);
        }
    }

    /// A job started: counted until its [`JobGuard`] drops. `done`: its completion if it ends
    /// without setting another (a failure), and the queue it counts in.
    fn started(self: &Arc<Self>, st: &mut State, done: Option<Completion>, q: Queue) -> JobGuard {
        st.running += 1;
        match q {
            Queue::Reads => st.queued_reads += 1,
            Queue::Writes => st.queued_writes += 1,
            Queue::None => {}
        }
        JobGuard {
            sh: Arc::clone(self),
            done,
            queue: q,
        }
    }
}

/// Counts a running job; on drop (the job ended, panicked, or was cancelled at shutdown) it
/// pushes the job's completion if not pushed yet — a failure unless the job set its own — and
/// wakes `flush`.
struct JobGuard {
    sh: Arc<Shared>,
    done: Option<Completion>,
    queue: Queue,
}

/// Which queue gauge a job counts in.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Queue {
    Reads,
    Writes,
    None,
}

impl JobGuard {
    /// Pushes the completion now (a write's `Released`, once its block is copied out).
    fn complete_now(&mut self) {
        if let Some(c) = self.done.take() {
            lock(&self.sh.state).completions.push(c);
        }
    }

    /// Sets a promotion's outcome (pushed at drop).
    fn set_ok(&mut self, ok: bool) {
        if let Some(Completion::Promoted { ok: o, .. }) = &mut self.done {
            *o = ok;
        }
    }
}

impl Drop for JobGuard {
    fn drop(&mut self) {
        let mut st = lock(&self.sh.state);
        if let Some(c) = self.done.take() {
            st.completions.push(c);
        }
        match self.queue {
            Queue::Reads => st.queued_reads = st.queued_reads.saturating_sub(1),
            Queue::Writes => st.queued_writes = st.queued_writes.saturating_sub(1),
            Queue::None => {}
        }
        st.running = st.running.saturating_sub(1);
        if st.running == 0 {
            self.sh.idle.notify_all();
        }
    }
}

/// The object tier. See the module docs.
pub struct ObjectTier {
    shared: Arc<Shared>,
    rt: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for ObjectTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectTier")
            .field("url", &self.shared.cfg.url)
            .field("base", &self.shared.base)
            .finish_non_exhaustive()
    }
}

/// The object tier's own counters and gauges beyond [`SecondaryCounters`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ObjectStats {
    /// Values deleted to stay within the budget.
    pub evictions: u64,
    /// Values deleted because they were older than the TTL.
    pub expired: u64,
    /// Entries of the index (values and remembered misses).
    pub index_entries: u64,
    /// Bytes of the values the index holds (this rank's, in the namespace).
    pub known_bytes: u64,
    /// Listings of the namespace finished.
    pub listings: u64,
    /// Whether the store is up (not in a backoff after a failure).
    pub up: bool,
}

impl ObjectTier {
    /// Opens the tier over `memory` (one rank's blocks; its block size is the payload) and starts
    /// its runtime and the first listing of the namespace (in the background: an unreachable
    /// store is counted then, not raised here).
    ///
    /// # Errors
    /// [`KvoffError::Config`] for a bad URL or endpoint, no credentials, a budget of 0, a value
    /// larger than [`MAX_VALUE_BYTES`], 0 or more than 64 I/O threads, 0 requests, or a runtime
    /// that cannot start.
    pub fn open(cfg: ObjectConfig, memory: Arc<dyn BlockMemory>) -> Result<Self> {
        let (bucket, prefix) = parse_url(&cfg.url)?;
        let endpoint = config::endpoint(&cfg)?;
        let region = config::region(&cfg);
        let creds = match &cfg.credentials {
            Some(c) => c.clone(),
            None => Credentials::from_env(cfg.profile.as_deref())?,
        };
        let lay = &cfg.layout;
        if lay.world_size == 0 || lay.rank >= lay.world_size {
            return Err(KvoffError::Config(format!(
                "object tier: rank {} of world size {}",
                lay.rank, lay.world_size
            )));
        }
        if cfg.bytes_to_use == 0 {
            return Err(KvoffError::Config("object_bytes_to_use must be > 0".into()));
        }
        if !(1..=64).contains(&cfg.io_threads) || cfg.max_requests == 0 {
            return Err(KvoffError::Config(format!(
                "object tier: io_threads must be in 1..=64 and max_requests > 0, got {} and {}",
                cfg.io_threads, cfg.max_requests
            )));
        }
        let payload_len = memory.block_bytes();
        let value_len = (format::COMPACT_HEADER_BYTES + payload_len) as u64;
        if value_len > MAX_VALUE_BYTES {
            return Err(KvoffError::Config(format!(
                "object tier: a value of {value_len} bytes is larger than {MAX_VALUE_BYTES}"
            )));
        }
        let fingerprint = lay.fingerprint(payload_len as u64);
        let ns = namespace_segment(&lay.namespace);
        let base = if prefix.is_empty() {
            format!("{ns}/{fingerprint:016x}")
        } else {
            format!("{prefix}/{ns}/{fingerprint:016x}")
        };
        let owner_str = cfg
            .owner
            .clone()
            .unwrap_or_else(|| format::default_owner(lay, &format::host_name()));
        let mut options = ClientOptions::new()
            .with_timeout(cfg.io_timeout)
            .with_connect_timeout(cfg.connect_timeout)
            .with_pool_max_idle_per_host(cfg.max_requests);
        let mut b = AmazonS3Builder::new()
            .with_bucket_name(&bucket)
            .with_region(region)
            .with_access_key_id(&creds.access_key)
            .with_secret_access_key(&creds.secret_key)
            .with_unsigned_payload(true)
            .with_retry(RetryConfig {
                backoff: BackoffConfig {
                    init_backoff: Duration::from_millis(50),
                    max_backoff: Duration::from_secs(1),
                    base: 2.0,
                },
                max_retries: cfg.max_retries,
                retry_timeout: cfg.io_timeout * u32::try_from(cfg.max_retries + 1).unwrap_or(4),
            });
        if let Some(t) = &creds.token {
            b = b.with_token(t);
        }
        if let Some(ep) = &endpoint {
            if ep.starts_with("http://") {
                options = options.with_allow_http(true);
            }
            b = b.with_endpoint(ep).with_virtual_hosted_style_request(false);
        }
        let store = b
            .with_client_options(options)
            .build()
            .map_err(|e| KvoffError::Config(format!("object tier: {e}")))?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(cfg.io_threads)
            .max_blocking_threads(1)
            .thread_name("kvoff-object")
            .enable_all()
            .build()
            .map_err(|e| KvoffError::Config(format!("object tier: runtime: {e}")))?;
        let shared = Arc::new(Shared {
            store,
            base,
            fingerprint,
            rank: lay.rank,
            world_size: lay.world_size,
            owner: xxh3_64(owner_str.as_bytes()),
            payload_len,
            value_len,
            permits: tokio::sync::Semaphore::new(cfg.max_requests),
            listing: tokio::sync::Mutex::new(()),
            cfg,
            memory,
            state: Mutex::new(State::default()),
            idle: Condvar::new(),
            counters: Counters::default(),
            pid: crate::process::id(),
        });
        rt.spawn(io::list_loop(Arc::clone(&shared)));
        Ok(Self {
            shared,
            rt: Some(rt),
        })
    }

    /// Whether this is a `fork()`ed copy (no runtime threads here: submissions are refused,
    /// `flush` returns at once, `shutdown` forgets the runtime).
    #[must_use]
    pub fn forked(&self) -> bool {
        crate::process::id() != self.shared.pid
    }

    /// The object name of `key`'s value (for tests and tools), without the bucket.
    #[must_use]
    pub fn object_name(&self, key: &ByteKey) -> String {
        let (id, stem) = Shared::ident(key);
        self.shared.object_name(id, &stem)
    }

    /// `<prefix>/<namespace>/<fingerprint>`: the folder of this layout's values.
    #[must_use]
    pub fn base(&self) -> &str {
        &self.shared.base
    }

    /// Bytes of one value (header + payload).
    #[must_use]
    pub fn value_len(&self) -> u64 {
        self.shared.value_len
    }

    /// Lists the namespace now and waits for it (tests and tools; never on a scheduler's thread).
    pub fn rescan(&self) {
        if let (Some(rt), false) = (&self.rt, self.forked()) {
            rt.block_on(io::list(Arc::clone(&self.shared)));
        }
    }

    /// Blocks until the running jobs have finished (tests, tools, shutdown — never a scheduler
    /// step). Completions stay for `poll`.
    pub fn flush(&self) {
        if self.rt.is_none() || self.forked() {
            return;
        }
        let mut st = lock(&self.shared.state);
        while st.running > 0 {
            st = self
                .shared
                .idle
                .wait(st)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// The common counters.
    #[must_use]
    pub fn counters(&self) -> SecondaryCounters {
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
            queued_reads: st.queued_reads,
            queued_writes: st.queued_writes,
            last_error: st.last_error.clone(),
        }
    }

    /// The tier's own counters and gauges.
    #[must_use]
    pub fn stats(&self) -> ObjectStats {
        let c = &self.shared.counters;
        let st = lock(&self.shared.state);
        ObjectStats {
            evictions: c.evictions.load(Relaxed),
            expired: c.expired.load(Relaxed),
            index_entries: st.index.len() as u64,
            known_bytes: st.index.bytes(),
            listings: c.listings.load(Relaxed),
            up: !Shared::down(&st, Instant::now()),
        }
    }

    /// Finishes the running jobs (each bounded by its timeouts), stops the runtime. Idempotent.
    pub fn shutdown(&mut self) {
        if self.forked() {
            // The runtime's threads exist only in the parent: never join them here, nor take a
            // lock a parent thread may have held at fork() (docs/spec.md §9).
            if let Some(rt) = self.rt.take() {
                std::mem::forget(rt);
            }
            return;
        }
        let Some(rt) = self.rt.take() else {
            return;
        };
        let bound = (self.shared.cfg.io_timeout + self.shared.cfg.connect_timeout)
            * u32::try_from(self.shared.cfg.max_retries + 1).unwrap_or(4)
            + Duration::from_secs(1);
        {
            let mut st = lock(&self.shared.state);
            st.shutdown = true;
            let t0 = Instant::now();
            while st.running > 0 && t0.elapsed() < bound {
                st = self
                    .shared
                    .idle
                    .wait_timeout(st, Duration::from_millis(50))
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
        }
        // Cancels what is left (the listing loop, a job past its bound): their guards push
        // failed completions.
        rt.shutdown_timeout(Duration::from_secs(1));
    }
}

impl Drop for ObjectTier {
    fn drop(&mut self) {
        self.shutdown();
    }
}
