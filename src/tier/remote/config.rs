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
    /// no wake-up from the scheduler's thread (zero: no napping). Default: `default_idle_nap()`.
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

/// The URL with any password replaced by `***` (the only form kvoff prints), whatever characters
/// the password holds (`,` and `@` too, typed raw): the hosts are what follows the last `@` of
/// the URL, and after each earlier `@` the text up to the next `,` when it reads as `host:port`
/// (another node of a Cluster URL with credentials of its own); everything else before an `@` is
/// credentials. A user name is kept (`user:***@host`, `:***@host` without one) when it holds no
/// `,` or `@`.
#[must_use]
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "<unparsable url>".into();
    };
    let Some(last) = rest.rfind('@') else {
        return url.to_owned();
    };
    let (creds_part, hosts) = (&rest[..last], &rest[last + 1..]);
    let masked = |creds: &str| match creds.split_once(':') {
        Some((user, _)) if !user.contains([',', '@']) => format!("{user}:***"),
        _ => "***".to_owned(),
    };
    let host_like = |h: &str| {
        h.rsplit_once(':').is_some_and(|(name, port)| {
            !name.is_empty()
                && !port.is_empty()
                && port.bytes().all(|b| b.is_ascii_digit())
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-._[]:".contains(&b))
        })
    };
    // `creds_part` is `creds1` or `creds1@host1:p1,creds2@…` up to the last node's credentials.
    let mut out = String::new();
    let mut creds = String::new();
    for (i, seg) in creds_part.split('@').enumerate() {
        if i > 0 {
            if let Some((host, more)) = seg.split_once(',').filter(|(h, _)| host_like(h)) {
                out.push_str(&masked(&creds));
                out.push('@');
                out.push_str(host);
                out.push(',');
                more.clone_into(&mut creds);
                continue;
            }
            creds.push('@');
        }
        creds.push_str(seg);
    }
    out.push_str(&masked(&creds));
    format!("{scheme}://{out}@{hosts}")
}

/// Most bytes of an error text kept for `last_error` (docs/tier.md "Faults").
pub const MAX_ERROR_BYTES: usize = 512;

/// `text` as kvoff keeps or shows it: every secret in `secrets` (the password, as typed and
/// percent-encoded) replaced by `***`, wherever it stands (a server may echo a refused `AUTH`),
/// and at most [`MAX_ERROR_BYTES`] bytes of the result.
#[must_use]
pub fn scrub(text: String, secrets: &[String]) -> String {
    use std::fmt::Write;
    let mut out = text;
    for s in secrets.iter().filter(|s| !s.is_empty()) {
        if out.contains(s.as_str()) {
            out = out.replace(s.as_str(), "***");
        }
    }
    if out.len() > MAX_ERROR_BYTES {
        let mut end = MAX_ERROR_BYTES;
        while !out.is_char_boundary(end) {
            end -= 1;
        }
        let total = out.len();
        out.truncate(end);
        let _ = write!(out, "… ({total} bytes)");
    }
    out
}

/// The secrets of a URL's nodes that [`scrub`] takes out of texts: each password as the
/// connection uses it and percent-encoded.
pub(super) fn secrets_of(nodes: &[redis::ConnectionInfo]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for info in nodes {
        if let Some(pw) = info.redis_settings().password() {
            for s in [pw.to_owned(), pct_encode(pw)] {
                if !s.is_empty() && !out.contains(&s) {
                    out.push(s);
                }
            }
        }
    }
    // Longest first: a password that holds another is replaced whole.
    out.sort_by_key(|s| std::cmp::Reverse(s.len()));
    out
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

/// Most bytes of a file a setting names (a TLS CA file: a few KiB of PEM).
pub const MAX_SETTING_FILE_BYTES: u64 = 1 << 20;

/// Reads a file a setting names as the file tier opens its files (docs/tier.md "Faults"):
/// opened `O_NONBLOCK` (a FIFO never blocks the open), judged by `fstat` on the open descriptor
/// (a regular file only: never a FIFO, a device such as `/dev/zero`, a directory), and at most
/// `cap` bytes (a file that grows past it while read is refused too).
///
/// # Errors
/// What is wrong with it, for the caller's `ConfigError`.
pub fn read_setting_file(path: &std::path::Path, cap: u64) -> std::result::Result<Vec<u8>, String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| e.to_string())?;
    let meta = f.metadata().map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a regular file".to_owned());
    }
    if meta.len() > cap {
        return Err(format!("{} bytes, more than {cap}", meta.len()));
    }
    let mut out = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    f.take(cap + 1)
        .read_to_end(&mut out)
        .map_err(|e| e.to_string())?;
    if out.len() as u64 > cap {
        return Err(format!("more than {cap} bytes"));
    }
    Ok(out)
}

/// Overrides of the remote tier's tuning constants from `KVOFF_REMOTE_TUNE` (`key=value` pairs
/// separated by commas), for the benchmarks to sweep them without rebuilding (as
/// `KVOFF_CUDA_TUNE` does for the CUDA engine; docs/performance.md "Tier tuning table"): keys
/// `large_write_jobs` (write pipelines of values ≥ 256 KiB at once), `large_write_batch` (fewest
/// such values per pipeline) and `read_job_bytes` (most value bytes of one promotion job, at
/// least one value), each 1 to 2^30; `sum_ahead` (values ≥ 256 KiB whose checksums idle I/O
/// threads compute ahead of their writers; 0 = none), 0 to 2^30.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Tune {
    pub(super) large_write_jobs: Option<usize>,
    pub(super) large_write_batch: Option<usize>,
    pub(super) read_job_bytes: Option<usize>,
    pub(super) sum_ahead: Option<usize>,
}

impl Tune {
    /// The environment's overrides (none where `KVOFF_REMOTE_TUNE` is unset).
    ///
    /// # Errors
    /// [`KvoffError::InvalidArgument`] for an unknown key or a value out of range.
    pub(super) fn from_env() -> Result<Self> {
        std::env::var("KVOFF_REMOTE_TUNE").map_or(Ok(Self::default()), |s| Self::parse(&s))
    }

    pub(super) fn parse(spec: &str) -> Result<Self> {
        let mut t = Self::default();
        for kv in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let bad = || {
                KvoffError::arg(format!(
                    "KVOFF_REMOTE_TUNE: {kv:?} is not key=N (N in 1..=2^30)"
                ))
            };
            let (k, v) = kv.split_once('=').ok_or_else(bad)?;
            let n = v
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|n| (usize::from(k.trim() != "sum_ahead")..=1 << 30).contains(n))
                .ok_or_else(bad)?;
            match k.trim() {
                "large_write_jobs" => t.large_write_jobs = Some(n),
                "large_write_batch" => t.large_write_batch = Some(n),
                "read_job_bytes" => t.read_job_bytes = Some(n),
                "sum_ahead" => t.sum_ahead = Some(n),
                _ => {
                    return Err(KvoffError::arg(format!(
                        "KVOFF_REMOTE_TUNE: unknown key {k:?} (large_write_jobs, large_write_batch, read_job_bytes, sum_ahead)"
                    )))
                }
            }
        }
        Ok(t)
    }
}

/// The parsed target: the URL's nodes for the `redis` crate, cluster or not, and for a
/// `rediss://` URL the TLS client configuration every connection uses.
pub(super) struct Target {
    pub(super) cluster: bool,
    pub(super) nodes: Vec<redis::ConnectionInfo>,
    pub(super) tls: Option<std::sync::Arc<rustls::ClientConfig>>,
}

/// The TLS client configuration of a `rediss://` URL: the certificates of the CA file (`pem`,
/// from `path`) as the only roots, else the system's (`rustls-native-certs`, as the `redis`
/// crate's own TLS does); rustls's safe defaults with `ring`, no client certificate.
fn tls_config(
    ca: Option<(&std::path::Path, &[u8])>,
) -> Result<std::sync::Arc<rustls::ClientConfig>> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    let mut roots = rustls::RootCertStore::empty();
    if let Some((path, pem)) = ca {
        let unusable = |why: String| {
            KvoffError::Config(format!(
                "remote tier: the TLS CA file {} is not usable: {why}",
                path.display()
            ))
        };
        for cert in CertificateDer::pem_slice_iter(pem) {
            let cert = cert.map_err(|e| unusable(e.to_string()))?;
            roots.add(cert).map_err(|e| unusable(e.to_string()))?;
        }
        if roots.is_empty() {
            return Err(unusable("it holds no PEM certificate".to_owned()));
        }
    } else {
        // Certificates the system store holds that rustls cannot use are left out (as the
        // crate does); with none at all every handshake fails, counted and kept in the stats.
        for cert in rustls_native_certs::load_native_certs().certs {
            let _ = roots.add(cert);
        }
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| KvoffError::Config(format!("remote tier: TLS: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(std::sync::Arc::new(cfg))
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
    }
    if nodes.iter().any(|n| {
        matches!(
            n.addr(),
            redis::ConnectionAddr::TcpTls { insecure: true, .. }
        )
    }) {
        return Err(bad(
            "#insecure (TLS without checking the server's certificate is not offered; \
             name its CA with remote_tls_ca_file)",
        ));
    }
    let tls = if base == "rediss" {
        let pem = match ca_file {
            Some(path) => Some(
                read_setting_file(path, MAX_SETTING_FILE_BYTES).map_err(|e| {
                    KvoffError::Config(format!(
                        "remote tier: cannot read the TLS CA file {}: {e}",
                        path.display()
                    ))
                })?,
            ),
            None => None,
        };
        Some(tls_config(ca_file.zip(pem.as_deref()))?)
    } else {
        None
    };
    Ok(Target {
        cluster,
        nodes,
        tls,
    })
}

#[cfg(test)]
#[allow(clippy::pedantic)] // tests: style lints are for the library
mod tests {
    use super::Tune;

    /// `KVOFF_REMOTE_TUNE`'s keys parse; unknown keys, bad numbers and zero are refused.
    #[test]
    fn tune_overrides_parse_and_refuse_nonsense() {
        let t = Tune::parse(
            "large_write_jobs=4, large_write_batch=1,read_job_bytes=4194304,sum_ahead=0",
        )
        .unwrap();
        assert_eq!(
            t,
            Tune {
                large_write_jobs: Some(4),
                large_write_batch: Some(1),
                read_job_bytes: Some(4 << 20),
                sum_ahead: Some(0),
            }
        );
        assert_eq!(Tune::parse("").unwrap(), Tune::default());
        for bad in [
            "jobs=2",
            "large_write_jobs",
            "large_write_jobs=0",
            "large_write_jobs=-1",
            "read_job_bytes=2147483648",
            "sum_ahead=-1",
            "sum_ahead=1073741825",
        ] {
            assert!(Tune::parse(bad).is_err(), "{bad}");
        }
    }
}
