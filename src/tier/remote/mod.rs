//! The remote tier (docs/tier.md "Remote tier"): blocks kept as values in Redis ≥ 7 or Valkey,
//! standalone or Cluster, shared by engines on many machines.
//!
//! **Client.** kvoff's own synchronous connections over TCP or rustls TLS (`conn`, `link`; the
//! `redis` crate packs commands and parses short replies: docs/design.md "Remote tier client"); the routing of Cluster commands, the per-node fault state and the
//! timeouts are in [`route`] (docs/tier.md "Faults", "Cluster routing"). Each I/O
//! thread owns one connection per node it talks to; every network call has a timeout
//! ([`RemoteConfig::connect_timeout`], [`RemoteConfig::io_timeout`]). A failed call drops its
//! connection (a timed-out pipeline leaves replies in flight) and marks that node down for a
//! backoff that doubles from [`RemoteConfig::backoff_min`] to [`RemoteConfig::backoff_max`];
//! while it is down, its commands fail at once without touching the network (fetches answer
//! "absent", writes are counted as errors, reads as failed promotions), the batch's other keys go
//! to their nodes, and one thread probes the node when the backoff ends
//! ([`SecondaryCounters::reconnects`](super::secondary::SecondaryCounters::reconnects) counts the recoveries).
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
//! **Values.** The header of a tier file without its padding ([`VALUE_HEADER_BYTES`], 1096
//! bytes: the `format` module's fields — magic, version, header length, layout fingerprint, rank,
//! world size, payload length, xxh3-64 of the payload, owner tag, the key, header checksum — and
//! room for the longest key), then the payload. A value is served only
//! when its length is exact and every header field and the payload checksum match; otherwise it is
//! rejected ([`SecondaryCounters::rejected`](super::secondary::SecondaryCounters::rejected)), never copied into host memory, and deleted (its key
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

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Release};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use xxhash_rust::xxh3::xxh3_64;

use super::format;
use super::secondary::{SecondaryTier, TierInfo};
use super::{BlockMemory, Layout};
use crate::error::{KvoffError, Result};
use crate::key::ByteKey;

mod config;
mod conn;
mod index;
mod link;
pub mod native_ref;
mod plain;
mod resp;
pub mod route;
mod run;
mod sched;
mod secondary;
mod shared;
mod wire;
mod worker;

use conn::BufPool;
use route::{Router, RouterConfig};

use config::parse_url;
pub use config::{
    default_idle_spin, default_io_threads, redact, scrub, RemoteConfig, MAX_ERROR_BYTES,
};
use index::{Entry, Index};
use sched::Sched;
use shared::{lock, Answers, Counters, Queues, Shared};

/// The remote tier's registration (docs/design.md "Recipe: adding a tier").
pub const INFO: TierInfo = TierInfo {
    kind: "remote",
    folder: "remote",
    extra_stats: &[
        "known_present",
        "known_absent",
        "staged_bytes",
        "inflight_bytes",
        "up",
        "writes_summed_ahead",
    ],
};

/// Largest value (header + payload) the remote tier writes: 64 MiB, far below Redis's 512 MB
/// string limit and small enough that one value does not stall a server's event loop for long.
pub const MAX_VALUE_BYTES: u64 = 64 << 20;

/// Entries of the in-memory index before it is pruned (see `RemoteTier::expire`; 16 bytes each,
/// in a table at most half full: the `index` module): small, because a lookup of unknown keys
/// probes it on the scheduler's thread (docs/performance.md "Tier tuning table").
pub const INDEX_CAP: usize = 16_384;

/// Most value bytes of one fetch or promotion job (at least one value): larger ones are split into
/// jobs of this size, which the I/O threads work on side by side (docs/performance.md "Tier tuning table").
const FETCH_JOB_BYTES: u64 = 256 << 10;
/// Most keys of one fetch job, merged ones included (headers of large values are 1096 bytes:
/// [`FETCH_JOB_BYTES`] alone would let 239 share a job): the scheduler's thread applies a job's
/// results in one call, a probe of the index per key (docs/performance.md "Tier tuning table").
const MAX_FETCH_JOB_KEYS: usize = 32;
/// Values at least this large are fetched by their header alone (`GETRANGE`) and read into their
/// host block at promotion; smaller ones are fetched whole and staged (see `Shared::header_fetch`).
const HEADER_FETCH_BYTES: usize = 256 << 10;
/// Most header fetches in flight (see `Shared::fetch_unit`).
const MAX_HEADER_FETCHES: u64 = 1024;
/// Most bytes of value buffers kept for reuse (bounded by `max_staged_bytes` too).
const POOL_BYTES: usize = 64 << 20;
/// Fewest and most tickets of fetch answers (`Answers`; 8 bytes each, and 8 more for the key
/// each was taken for): twice the keys the staging room lets fetches have in flight, within
/// these.
const MIN_TICKETS: usize = 1 << 10;
/// How long a promotion or fetch job queued with no wake-up (a thread was looking at the queues)
/// may wait before the scheduler's next call rings for it (`Shared::queued_jobs`).
const LATE_JOB: Duration = Duration::from_millis(1);
const MAX_TICKETS: usize = 1 << 20;

/// Bytes of a value's header: the tier file's header unpadded (`format::COMPACT_HEADER_BYTES`;
/// docs/tier.md "Remote tier"), so that a value of 32 KiB is 97% block rather than 87.5%.
pub const VALUE_HEADER_BYTES: usize = format::COMPACT_HEADER_BYTES;

/// Most value bytes of one write pipeline (besides [`RemoteConfig::max_write_batch`] values), but
/// at least [`MIN_WRITE_BATCH`] values (docs/performance.md "Tier tuning table").
const WRITE_BATCH_BYTES: usize = 128 << 10;
/// Most value bytes of one `MSET` (a write batch of small values on one server without a TTL;
/// `Shared::multi_key`), but at least [`MIN_WRITE_BATCH`] values.
const MSET_BATCH_BYTES: usize = 256 << 10;
/// Most write jobs of values of 256 KiB and more ([`HEADER_FETCH_BYTES`]) running at once on a
/// machine with 8 or more CPUs, whatever the number of I/O threads (two below): few writers of
/// large values keep the server's reads sequential, and each sends one value at a time (see
/// [`LARGE_WRITE_BATCH`]) while an idle I/O thread checksums the next ones
/// (`Shared::sum_ahead`; docs/performance.md "Tier tuning table").
const MAX_LARGE_WRITE_JOBS: usize = 3;

/// Fewest values of one write pipeline (where [`RemoteConfig::max_write_batch`] allows), but see
/// [`large_write_batch`].
const MIN_WRITE_BATCH: usize = 4;

/// Tickets of fetch answers (`Answers`) for a tier of these settings and values.
fn tickets_for(cfg: &RemoteConfig, value_len: usize) -> usize {
    // Keys of fetches in flight are bounded by the staging room (`Shared::fetch_unit`); twice as
    // many tickets leave an answer at least as long again before its ticket is taken again.
    let in_flight = if value_len >= HEADER_FETCH_BYTES {
        MAX_HEADER_FETCHES
    } else {
        cfg.max_staged_bytes / (value_len as u64).max(1)
    };
    usize::try_from(in_flight.saturating_mul(2))
        .unwrap_or(usize::MAX)
        .clamp(MIN_TICKETS, MAX_TICKETS)
        .next_power_of_two()
}

/// Values of 256 KiB and more ([`HEADER_FETCH_BYTES`]) per write pipeline: one, so that each
/// large `SET` starts the server's query buffer (redis-server skips its copy of a large argument
/// only then; docs/performance.md "Tier tuning table").
const LARGE_WRITE_BATCH: usize = 1;

/// Write jobs of large values at once: [`MAX_LARGE_WRITE_JOBS`] on a machine with 8 or more CPUs,
/// two below (where the server shares the engine's few CPUs).
fn large_write_jobs() -> usize {
    match std::thread::available_parallelism() {
        Ok(n) if n.get() >= 8 => MAX_LARGE_WRITE_JOBS,
        _ => 2,
    }
}

/// How long the index gauges of [`SecondaryTier::extra_stats`] are reused (they count the whole
/// index, which a scheduler step that reads the stats should not pay for each time).
const GAUGES_TTL: Duration = Duration::from_secs(1);

/// The remote tier. See the module docs.
pub struct RemoteTier {
    shared: Arc<Shared>,
    /// The index and the jobs' accounting (see `Sched`): locked by the scheduler's calls only.
    sched: Mutex<Sched>,
    /// Dropped at shutdown (wakes every I/O thread; see `Queues::stop`).
    stop: Option<crossbeam_channel::Sender<()>>,
    threads: Vec<JoinHandle<()>>,
    /// Last index gauges (present, absent) and when they were counted.
    gauges: Mutex<Option<(Instant, (u64, u64))>>,
}

impl std::fmt::Debug for RemoteTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteTier")
            .field("url", &self.shared.url_redacted)
            .field("cluster", &self.shared.cluster)
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
        let value_len = VALUE_HEADER_BYTES + payload_len;
        if value_len as u64 > MAX_VALUE_BYTES {
            return Err(KvoffError::Config(format!(
                "remote tier: a block of {payload_len} bytes exceeds the value cap of {} bytes \
                 (use a smaller block_size or fewer layers per rank)",
                MAX_VALUE_BYTES - VALUE_HEADER_BYTES as u64
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
        let target = parse_url(&cfg.url, &cfg.password_env, cfg.tls_ca_file.as_deref())?;
        let tune = config::Tune::from_env()?;
        let fingerprint = lay.fingerprint(payload_len as u64);
        let owner_str = cfg
            .owner
            .clone()
            .unwrap_or_else(|| format::default_owner(lay, &format::host_name()));
        let secrets = config::secrets_of(&target.nodes);
        let router = Router::new(
            RouterConfig {
                cluster: target.cluster,
                connect_timeout: cfg.connect_timeout,
                io_timeout: cfg.io_timeout,
                backoff_min: cfg.backoff_min,
                backoff_max: cfg.backoff_max,
                max_bulk: conn::max_bulk_for(value_len),
                tls: target.tls,
            },
            redact(&cfg.url),
            target.nodes,
        );
        let max_staged = usize::try_from(cfg.max_staged_bytes).unwrap_or(usize::MAX);
        let epoch = Instant::now();
        let tickets = tickets_for(&cfg, value_len);
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = crossbeam_channel::bounded(0);
        let shared = Arc::new(Shared {
            cluster: target.cluster,
            router,
            url_redacted: redact(&cfg.url),
            secrets,
            fingerprint,
            fp_hex: format!("{fingerprint:016x}"),
            rank: lay.rank,
            world_size: lay.world_size,
            owner: xxh3_64(owner_str.as_bytes()),
            payload_len,
            value_len,
            queues: Queues {
                reads: crossbeam_channel::unbounded(),
                fetches: crossbeam_channel::unbounded(),
                writes: crossbeam_channel::unbounded(),
                summed: crossbeam_channel::unbounded(),
                bell: crossbeam_channel::unbounded(),
                stop: stop_rx,
            },
            done: done_tx,
            shutdown: AtomicBool::new(false),
            writes_running: std::sync::atomic::AtomicUsize::new(0),
            large_write_batch: tune.large_write_batch.unwrap_or(LARGE_WRITE_BATCH),
            large_write_jobs: tune.large_write_jobs.unwrap_or_else(large_write_jobs),
            // Each writer's next value checksummed ahead.
            sum_ahead: tune.sum_ahead.unwrap_or_else(|| {
                tune.large_write_jobs.unwrap_or_else(large_write_jobs)
                    * tune.large_write_batch.unwrap_or(LARGE_WRITE_BATCH)
                    * 2
            }),
            summing: std::sync::atomic::AtomicUsize::new(0),
            read_job_bytes: tune
                .read_job_bytes
                .unwrap_or(usize::try_from(FETCH_JOB_BYTES).unwrap_or(usize::MAX)),
            spinning: std::sync::atomic::AtomicUsize::new(0),
            napping: AtomicBool::new(false),
            answers: Answers::new(tickets),
            queued_jobs: std::sync::atomic::AtomicUsize::new(0),
            epoch,
            fetches_out: AtomicU64::new(0),
            fetch_reserved: AtomicU64::new(0),
            last_error: Mutex::new(None),
            cfg,
            memory,
            counters: Counters::default(),
            pid: crate::process::id(),
            pool: Arc::new(BufPool::new(POOL_BYTES.min(max_staged))),
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
                });
            match t {
                Ok(t) => threads.push(t),
                Err(e) => {
                    // The threads already started stop (shutdown set before their wake-up).
                    shared.shutdown.store(true, Release);
                    drop(stop_tx);
                    for t in threads {
                        let _ = t.join();
                    }
                    return Err(e);
                }
            }
        }
        Ok(Self {
            shared,
            sched: Mutex::new(Sched {
                // Sized for the cap: no growth (a rehash of every entry) under a lookup.
                index: Index::with_capacity(INDEX_CAP, epoch),
                prune_at: INDEX_CAP,
                queued_writes: 0,
                inflight_bytes: 0,
                reads_out: 0,
                owner: vec![0; tickets],
                next_ticket: 0,
                unrung_since: None,
                completions: Vec::new(),
                done: done_rx,
            }),
            stop: Some(stop_tx),
            threads,
            gauges: Mutex::new(None),
        })
    }

    /// The URL with the password hidden.
    #[must_use]
    pub fn url(&self) -> &str {
        &self.shared.url_redacted
    }

    /// Whether the URL names a Cluster.
    #[must_use]
    pub fn is_cluster(&self) -> bool {
        self.shared.cluster
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
        self.sched().index.remove(Index::hash(key));
    }

    fn forked(&self) -> bool {
        crate::process::id() != self.shared.pid
    }

    /// The scheduler's side, with the I/O threads' results applied (not in a `fork()`ed child:
    /// the parent's threads may have been inside a send at the fork).
    fn sched(&self) -> MutexGuard<'_, Sched> {
        let mut st = lock(&self.sched);
        if !self.forked() {
            st.apply(&self.shared);
        }
        st
    }

    /// Bounds the index (called from submissions): at [`INDEX_CAP`] entries, expired ones go; if
    /// more than half the cap remain, every remembered answer without a staged value goes too
    /// (those keys become `Unknown`: a later lookup fetches them again). The survivors move to a
    /// fresh table sized for the next pruning, so no insertion until then grows or rehashes it.
    /// The next pruning waits until the index has grown by half the cap again,
    /// so a pruning's cost is always amortised over the insertions since the last one, also when
    /// fetches, writes and staged values under way (which their own limits bound, not the cap)
    /// keep the index above the cap.
    fn expire(sh: &Shared, st: &mut Sched, now: Instant) {
        if st.index.len() < st.prune_at {
            return;
        }
        let now = st.index.tick(now);
        // First the answers that came replace their tickets (a lost one is dropped below).
        let Sched { index, owner, .. } = st;
        index.map_fetching(|h, ticket| {
            Sched::answered(owner, sh, h, Entry::Fetching { ticket })
                .unwrap_or(Entry::Absent { until: 0 })
        });
        let unexpired = |e: Entry| match e {
            Entry::Absent { until } | Entry::Present { until, .. } => until > now,
            Entry::Fetching { .. } | Entry::Writing => true,
        };
        let answers_too = st.index.entries().filter(|e| unexpired(*e)).count() > INDEX_CAP / 2;
        let keep = |_: u64, e: Entry| {
            (unexpired(e)
                && (!answers_too
                    || matches!(
                        e,
                        Entry::Fetching { .. }
                            | Entry::Writing
                            | Entry::Present { staged: true, .. }
                    )))
            .then_some(e)
        };
        st.prune_at = st
            .index
            .rebuild(keep, |survivors| INDEX_CAP.max(survivors + INDEX_CAP / 2));
    }
}

impl Drop for RemoteTier {
    fn drop(&mut self) {
        SecondaryTier::shutdown(self);
    }
}
