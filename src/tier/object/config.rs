//! The object tier's settings ([`ObjectConfig`]), its URL (`s3://bucket[/prefix]`) and where its
//! credentials come from (docs/tier.md "Object tier": the standard AWS variables, then a profile
//! of the shared credentials file; never printed).
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::Duration;

use crate::error::{KvoffError, Result};
use crate::tier::Layout;

/// Settings of an [`ObjectTier`](super::ObjectTier). Every default is the one the bindings and
/// tools apply (`kvoff._native.TIER_DEFAULTS`).
#[derive(Clone)]
pub struct ObjectConfig {
    /// `s3://bucket[/prefix]`: the bucket and the key prefix under which every namespace lives.
    pub url: String,
    /// The S3 endpoint (`http://host:port` for SeaweedFS, MinIO and other S3-compatible stores);
    /// `None`: `$AWS_ENDPOINT_URL_S3`, then `$AWS_ENDPOINT_URL`, then AWS's own for the region.
    pub endpoint: Option<String>,
    /// The region; `None`: `$AWS_REGION`, then `$AWS_DEFAULT_REGION`, then `us-east-1`.
    pub region: Option<String>,
    /// What the blocks are (its namespace names the folder of the values, the fingerprint their
    /// layout).
    pub layout: Layout,
    /// Byte budget of this rank's values in the namespace (every engine's, as the tier sees them by
    /// its own writes and its listings): least-recently-used values are deleted to stay within it.
    pub bytes_to_use: u64,
    /// Values older than this are neither served nor kept (deleted when found); `None`: no TTL.
    pub ttl: Option<Duration>,
    /// Bound of a TCP (and TLS) connect.
    pub connect_timeout: Duration,
    /// Bound of one whole request, its body included (a server that trickles its reply is cut off
    /// here), retries not counted.
    pub io_timeout: Duration,
    /// Retries of a request that failed with a server error or a timeout (`503 SlowDown`
    /// included), with backoff, all within [`ObjectConfig::io_timeout`] × (retries + 1).
    pub max_retries: usize,
    /// Threads of the tier's async runtime (they run the requests, copies and checksums).
    pub io_threads: usize,
    /// Most requests in flight at once.
    pub max_requests: usize,
    /// Most writes queued or running; beyond, a write is dropped and counted.
    pub max_queued_writes: usize,
    /// Most value bytes copied out of host memory and not yet sent; beyond, a write is dropped.
    pub max_inflight_bytes: u64,
    /// How long a key found missing is remembered as absent.
    pub negative_ttl: Duration,
    /// How often the namespace is listed again (other engines' values found, deleted ones
    /// forgotten, the budget enforced over every engine's values); `None`: only at start.
    pub list_interval: Option<Duration>,
    /// Values larger than this are written as multipart uploads (parts of this size).
    pub multipart_bytes: u64,
    /// First wait after a failure before the store is tried again (doubles to `backoff_max`).
    pub backoff_min: Duration,
    /// Longest wait after failures.
    pub backoff_max: Duration,
    /// The profile of the shared credentials file used when the AWS variables name no key;
    /// `None`: `$AWS_PROFILE`, then `default`.
    pub profile: Option<String>,
    /// Credentials given directly (the Rust API); `None`: from the environment (see
    /// [`Credentials::from_env`]).
    pub credentials: Option<Credentials>,
    /// Owner string (its hash goes into each value's header); `None`: namespace, rank and host.
    pub owner: Option<String>,
}

impl std::fmt::Debug for ObjectConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectConfig")
            .field("url", &self.url)
            .field("endpoint", &self.endpoint)
            .field("namespace", &self.layout.namespace)
            .field("bytes_to_use", &self.bytes_to_use)
            .finish_non_exhaustive()
    }
}

impl ObjectConfig {
    /// The defaults, for `url` and `layout`, with a budget of `bytes_to_use`.
    #[must_use]
    pub fn new(url: impl Into<String>, bytes_to_use: u64, layout: Layout) -> Self {
        Self {
            url: url.into(),
            endpoint: None,
            region: None,
            layout,
            bytes_to_use,
            ttl: None,
            connect_timeout: Duration::from_secs(1),
            io_timeout: Duration::from_secs(5),
            max_retries: 2,
            io_threads: 2,
            max_requests: 16,
            max_queued_writes: 1024,
            max_inflight_bytes: 512 << 20,
            negative_ttl: Duration::from_secs(2),
            list_interval: Some(Duration::from_secs(30)),
            multipart_bytes: 16 << 20,
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            profile: None,
            credentials: None,
            owner: None,
        }
    }
}

/// Access key, secret and optional session token. `Debug` shows the access key's first four
/// characters only.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// The access key id.
    pub access_key: String,
    /// The secret access key.
    pub secret_key: String,
    /// A session token (temporary credentials).
    pub token: Option<String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shown: String = self.access_key.chars().take(4).collect();
        write!(f, "Credentials({shown}…, secret ***)")
    }
}

impl Credentials {
    /// Credentials from the environment, as AWS's own tools find them: `$AWS_ACCESS_KEY_ID` and
    /// `$AWS_SECRET_ACCESS_KEY` (and `$AWS_SESSION_TOKEN`), else the profile `profile` (or
    /// `$AWS_PROFILE`, or `default`) of `$AWS_SHARED_CREDENTIALS_FILE` (or `~/.aws/credentials`).
    ///
    /// # Errors
    /// [`KvoffError::Config`] when none are found, or the credentials file is not a regular
    /// readable file of at most 1 MiB (its contents never appear in the message).
    pub fn from_env(profile: Option<&str>) -> Result<Self> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        if let (Some(access_key), Some(secret_key)) =
            (var("AWS_ACCESS_KEY_ID"), var("AWS_SECRET_ACCESS_KEY"))
        {
            return Ok(Self {
                access_key,
                secret_key,
                token: var("AWS_SESSION_TOKEN"),
            });
        }
        let profile = profile
            .map(str::to_owned)
            .or_else(|| var("AWS_PROFILE"))
            .unwrap_or_else(|| "default".into());
        let path = var("AWS_SHARED_CREDENTIALS_FILE")
            .map(PathBuf::from)
            .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".aws/credentials")));
        let none = || {
            KvoffError::Config(format!(
                "object tier: no credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or \
                 profile {profile:?} in the shared credentials file)"
            ))
        };
        let Some(path) = path else {
            return Err(none());
        };
        let text = match read_small(&path) {
            Ok(Some(t)) => t,
            Ok(None) => return Err(none()),
            Err(e) => {
                return Err(KvoffError::Config(format!(
                    "object tier: credentials file {}: {e}",
                    path.display()
                )))
            }
        };
        parse_profile(&text, &profile).ok_or_else(none)
    }
}

/// Most bytes of a credentials file read.
const MAX_CREDENTIALS_FILE: u64 = 1 << 20;

/// The file's text; `None` when it does not exist. Only regular files, opened without blocking
/// (a FIFO named here must not hang the caller) and read up to [`MAX_CREDENTIALS_FILE`].
fn read_small(path: &std::path::Path) -> std::io::Result<Option<String>> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let f = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let meta = f.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    if meta.len() > MAX_CREDENTIALS_FILE {
        return Err(std::io::Error::other("larger than 1 MiB"));
    }
    let mut s = String::new();
    f.take(MAX_CREDENTIALS_FILE).read_to_string(&mut s)?;
    Ok(Some(s))
}

/// The keys of `[profile]` in an INI credentials file.
fn parse_profile(text: &str, profile: &str) -> Option<Credentials> {
    let mut inside = false;
    let (mut access, mut secret, mut token) = (None, None, None);
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') || line.starts_with(';') || line.is_empty() {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            inside = name.trim() == profile;
            continue;
        }
        if !inside {
            continue;
        }
        if let Some((k, v)) = line.split_once('=') {
            let v = v.trim().to_owned();
            match k.trim() {
                "aws_access_key_id" => access = Some(v),
                "aws_secret_access_key" => secret = Some(v),
                "aws_session_token" => token = Some(v),
                _ => {}
            }
        }
    }
    Some(Credentials {
        access_key: access.filter(|s| !s.is_empty())?,
        secret_key: secret.filter(|s| !s.is_empty())?,
        token,
    })
}

/// `s3://bucket[/prefix]` → (bucket, prefix without slashes at either end).
///
/// # Errors
/// [`KvoffError::Config`] naming what is wrong: another scheme, no bucket, a bucket name S3 does
/// not accept, an empty, `.` or `..` segment in the prefix, or characters outside
/// `A-Za-z0-9!-_.*'()/`.
pub fn parse_url(url: &str) -> Result<(String, String)> {
    let bad = |why: &str| KvoffError::Config(format!("object_url {url:?}: {why}"));
    let rest = url
        .strip_prefix("s3://")
        .ok_or_else(|| bad("must start with s3:// (s3://bucket/prefix)"))?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() {
        return Err(bad("no bucket"));
    }
    let bucket_ok = (3..=63).contains(&bucket.len())
        && bucket
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && bucket
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphanumeric())
        && bucket
            .bytes()
            .last()
            .is_some_and(|b| b.is_ascii_alphanumeric());
    if !bucket_ok {
        return Err(bad(
            "bucket names are 3-63 lower-case letters, digits, '-' and '.'",
        ));
    }
    let prefix = prefix.trim_end_matches('/');
    if !prefix.is_empty() {
        for seg in prefix.split('/') {
            if seg.is_empty() || seg == "." || seg == ".." {
                return Err(bad("empty, '.' or '..' segment in the prefix"));
            }
            if !seg.bytes().all(safe_key_char) {
                return Err(bad(
                    "prefix characters must be letters, digits and !-_.*'()",
                ));
            }
        }
    }
    Ok((bucket.to_owned(), prefix.to_owned()))
}

/// S3's "safe characters" of an object key (no encoding needed anywhere).
fn safe_key_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!-_.*'()".contains(&b)
}

/// The namespace as one key segment: itself when made of safe characters (and not `.`/`..`),
/// otherwise those characters kept, others `_`, and a hash of the whole so that two namespaces
/// never share a folder. Empty: `default`.
#[must_use]
pub fn namespace_segment(ns: &str) -> String {
    if ns.is_empty() {
        return "default".into();
    }
    if ns.bytes().all(safe_key_char) && ns != "." && ns != ".." && ns.len() <= 128 {
        return ns.to_owned();
    }
    let kept: String = ns
        .chars()
        .take(64)
        .map(|c| {
            if c.is_ascii() && safe_key_char(c as u8) {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{kept}-{:016x}", xxhash_rust::xxh3::xxh3_64(ns.as_bytes()))
}

/// The endpoint the tier talks to (`cfg.endpoint`, else the AWS variables) and whether it is
/// plain HTTP.
///
/// # Errors
/// [`KvoffError::Config`] for an endpoint that is not `http://` or `https://`.
pub fn endpoint(cfg: &ObjectConfig) -> Result<Option<String>> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let ep = cfg
        .endpoint
        .clone()
        .or_else(|| var("AWS_ENDPOINT_URL_S3"))
        .or_else(|| var("AWS_ENDPOINT_URL"));
    if let Some(e) = &ep {
        let rest = e
            .strip_prefix("http://")
            .or_else(|| e.strip_prefix("https://"));
        if rest.is_none_or(|r| r.is_empty() || r.contains('@')) {
            return Err(KvoffError::Config(format!(
                "object_endpoint {e:?}: must be http://host[:port] or https://host[:port]"
            )));
        }
    }
    Ok(ep.map(|e| e.trim_end_matches('/').to_owned()))
}

/// The region: `cfg.region`, `$AWS_REGION`, `$AWS_DEFAULT_REGION`, `us-east-1`.
#[must_use]
pub fn region(cfg: &ObjectConfig) -> String {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    cfg.region
        .clone()
        .or_else(|| var("AWS_REGION"))
        .or_else(|| var("AWS_DEFAULT_REGION"))
        .unwrap_or_else(|| "us-east-1".into())
}

#[cfg(test)]
#[allow(clippy::pedantic)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(
            parse_url("s3://kv-cache/a/b/").unwrap(),
            ("kv-cache".into(), "a/b".into())
        );
        assert_eq!(parse_url("s3://kvb").unwrap(), ("kvb".into(), "".into()));
        for bad in [
            "s3:///p",
            "http://b/p",
            "s3://B/p",
            "s3://ab",
            "s3://b-/x",
            "s3://bkt/a//b",
            "s3://bkt/../x",
            "s3://bkt/a b",
            "s3://bkt/a%2f",
        ] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn namespaces() {
        assert_eq!(namespace_segment(""), "default");
        assert_eq!(namespace_segment("llama-3_8b.v1"), "llama-3_8b.v1");
        let a = namespace_segment("org/model");
        let b = namespace_segment("org_model");
        assert_ne!(a, b);
        assert!(a.starts_with("org_model-"));
        assert!(namespace_segment("..").starts_with("..-"));
    }

    #[test]
    fn profiles() {
        let text = "[default]\naws_access_key_id = A\naws_secret_access_key=S\n\n[other]\n\
                    aws_access_key_id=B\naws_secret_access_key=T\naws_session_token=X\n";
        let d = parse_profile(text, "default").unwrap();
        assert_eq!((d.access_key.as_str(), d.secret_key.as_str()), ("A", "S"));
        assert_eq!(d.token, None);
        let o = parse_profile(text, "other").unwrap();
        assert_eq!(o.token.as_deref(), Some("X"));
        assert!(parse_profile(text, "none").is_none());
        assert!(!format!("{o:?}").contains('T'));
    }
}
