//! The remote tier's settings and URLs (docs/tier.md "Remote tier"): [`RemoteConfig`], the
//! password-free form of a URL ([`redact`]) and the parsing of standalone and Cluster URLs.
#![forbid(unsafe_code)]

use std::time::Duration;

use super::Layout;
#[cfg(doc)]
use super::RemoteTier;
use crate::error::{KvoffError, Result};

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
    /// How long an I/O thread that ran out of jobs keeps looking at the queues before it sleeps
    /// (zero: it sleeps at once). A job queued meanwhile is taken with no wake-up, a system call
    /// on the scheduler's thread otherwise. Default: [`default_idle_spin`].
    pub idle_spin: Duration,
    /// After its spin, one I/O thread at a time goes on looking at the queues every `idle_nap`
    /// (sleeping between looks) for up to [`RemoteConfig::idle_nap_for`], so that a lookup after
    /// a scheduler's step mostly finds a thread that will take its fetch within `idle_nap` with
    /// no wake-up from the scheduler's thread (zero: no napping). Default: [`default_idle_nap`].
    pub idle_nap: Duration,
    /// How long after its last job a napping thread keeps looking (see
    /// [`RemoteConfig::idle_nap`]). Default: 50 ms.
    pub idle_nap_for: Duration,
    /// Writes queued or running beyond this are dropped (counted).
    pub max_queued_writes: usize,
    /// Bytes of values copied out of host memory and not yet acknowledged by the server.
    pub max_inflight_bytes: u64,
    /// Bytes of fetched values kept until they are read into host blocks.
    pub max_staged_bytes: u64,
    /// Most keys of one fetch.
    pub max_fetch_keys: usize,
    /// Most values of one write pipeline (which also holds at most 128 KiB of values, or 256 KiB
    /// where the pipeline is one `MSET` — small values on one server without a TTL — but at
    /// least 4 values, or for values of 256 KiB and more 4 on a machine with 8 or more CPUs and
    /// 1 below).
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
    /// PEM file of the certificate authority that signed the servers' certificates, for
    /// `rediss://` (`None`: the system's roots).
    pub tls_ca_file: Option<std::path::PathBuf>,
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
            .field("idle_spin", &self.idle_spin)
            .field("idle_nap", &self.idle_nap)
            .field("idle_nap_for", &self.idle_nap_for)
            .finish_non_exhaustive()
    }
}

/// The default number of I/O threads: 4 (each thread waits on its own round trips: more of them
/// keep the server busy; docs/performance.md "Tier tuning table").
#[must_use]
pub fn default_io_threads() -> usize {
    4
}

/// The default [`RemoteConfig::idle_spin`]: 50 µs on a machine with 8 or more CPUs, none below
/// (where a spinning thread would take a CPU from the server or the engine; docs/performance.md "Tier tuning table").
#[must_use]
pub fn default_idle_spin() -> Duration {
    match std::thread::available_parallelism() {
        Ok(n) if n.get() >= 8 => Duration::from_micros(50),
        _ => Duration::ZERO,
    }
}

/// The default [`RemoteConfig::idle_nap`]: 100 µs on a machine with 8 or more CPUs, none below
/// (where the server and the engine need every CPU; there the scheduler's side rings;
/// docs/performance.md "Tier tuning table").
#[must_use]
pub fn default_idle_nap() -> Duration {
    match std::thread::available_parallelism() {
        Ok(n) if n.get() >= 8 => Duration::from_micros(100),
        _ => Duration::ZERO,
    }
}

impl RemoteConfig {
    /// Defaults: no TTL, 1 s connect and 2 s I/O timeouts, [`default_io_threads`] I/O threads
    /// spinning [`default_idle_spin`] when idle,
    /// 256 queued writes, 256 MiB in flight, 256 MiB staged, fetches of up to 64 keys, writes of
    /// up to 256 values per pipeline (and 128 KiB of values, 256 KiB in an `MSET`, but at least 4), misses remembered
    /// 2 s, hits 30 s, backoff 100 ms → 5 s, password from `KVOFF_REMOTE_PASSWORD`.
    #[must_use]
    pub fn new(url: impl Into<String>, layout: Layout) -> Self {
        Self {
            url: url.into(),
            layout,
            ttl: None,
            connect_timeout: Duration::from_secs(1),
            io_timeout: Duration::from_secs(2),
            io_threads: default_io_threads(),
            idle_spin: default_idle_spin(),
            idle_nap: default_idle_nap(),
            idle_nap_for: Duration::from_millis(50),
            max_queued_writes: 256,
            max_inflight_bytes: 256 << 20,
            max_staged_bytes: 256 << 20,
            max_fetch_keys: 64,
            max_write_batch: 256,
            negative_ttl: Duration::from_secs(2),
            present_ttl: Duration::from_secs(30),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            password_env: "KVOFF_REMOTE_PASSWORD".into(),
            tls_ca_file: None,
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

pub(super) fn pct_encode(s: &str) -> String {
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

/// The parsed target: the URL's nodes for the `redis` crate, cluster or not.
pub(super) struct Target {
    pub(super) cluster: bool,
    pub(super) nodes: Vec<redis::ConnectionInfo>,
}

pub(super) fn parse_url(
    url: &str,
    password_env: &str,
    ca_file: Option<&std::path::Path>,
) -> Result<Target> {
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
        // Parsed here so that a bad URL is a configuration error at open, not a later I/O error.
        let info = redis::IntoConnectionInfo::into_connection_info(node.as_str())
            .map_err(|e| bad(&format!("{:?}", e.kind())))?;
        nodes.push(info);
    }
    if let Some(path) = ca_file {
        if base != "rediss" {
            return Err(KvoffError::Config(format!(
                "remote tier: a TLS CA file ({}) needs a rediss:// URL, got {}",
                path.display(),
                redact(url)
            )));
        }
        let pem = std::fs::read(path).map_err(|e| {
            KvoffError::Config(format!(
                "remote tier: cannot read the TLS CA file {}: {e}",
                path.display()
            ))
        })?;
        // The CA goes into each node's connection info (nodes learned later copy the first's).
        for info in &mut nodes {
            let certs = redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(pem.clone()),
            };
            *info = redis::Client::build_with_tls(info.clone(), certs)
                .map_err(|e| {
                    KvoffError::Config(format!(
                        "remote tier: the TLS CA file {} is not usable: {:?}",
                        path.display(),
                        e.kind()
                    ))
                })?
                .get_connection_info()
                .clone();
        }
    }
    Ok(Target { cluster, nodes })
}
