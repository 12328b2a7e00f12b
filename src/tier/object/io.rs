//! The object tier's jobs, run on its runtime (docs/tier.md "Object tier"): writes (copy out of
//! host memory, delete the budget's victims, PUT), reads (GET, check, copy into host memory),
//! fetches (HEAD), deletes and the listing of the namespace. Each takes the tier's mutex only
//! for short updates of the index and counters, never across a request.
#![forbid(unsafe_code)]

use std::collections::HashSet;
use std::future::Future;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, PutPayload, WriteMultipart};

use super::{lock, now_ns, Entry, JobGuard, Shared};
use crate::key::ByteKey;
use crate::manager::BlockId;
use crate::tier::format;

/// How a request ended.
pub(super) enum Failed {
    /// The object does not exist.
    NotFound,
    /// Anything else (network, timeout, server error, throttling, auth): the store is marked down.
    Other,
}

impl Shared {
    /// The bound of one request with its retries (the client bounds each attempt; this also
    /// bounds the wait for a permit).
    fn deadline(&self) -> Duration {
        (self.cfg.io_timeout + self.cfg.connect_timeout)
            * u32::try_from(self.cfg.max_retries + 1).unwrap_or(4)
            + Duration::from_millis(500)
    }

    /// Runs one request under a permit and the deadline; records the store up or down. "Not
    /// found" is an answer for GET, HEAD and DELETE; for a PUT it means the bucket is gone (a
    /// failure: [`Self::request_put`]).
    async fn request<T, F>(&self, what: &str, f: F) -> Result<T, Failed>
    where
        F: Future<Output = object_store::Result<T>>,
    {
        let run = async {
            let _permit = self.permits.acquire().await;
            f.await
        };
        match tokio::time::timeout(self.deadline(), run).await {
            Ok(Ok(v)) => {
                self.note_success();
                Ok(v)
            }
            Ok(Err(object_store::Error::NotFound { .. })) => {
                self.note_success();
                Err(Failed::NotFound)
            }
            Ok(Err(e)) => {
                self.note_failure(what, &e);
                Err(Failed::Other)
            }
            Err(_) => {
                let msg = format!("no answer within {:?}", self.deadline());
                self.note_failure(what, &msg);
                Err(Failed::Other)
            }
        }
    }

    /// [`Self::request`] for a write: "not found" (no such bucket) is a failure.
    async fn request_put<T, F>(&self, what: &str, f: F) -> Result<T, Failed>
    where
        F: Future<Output = object_store::Result<T>>,
    {
        let r = self.request(what, f).await;
        if matches!(r, Err(Failed::NotFound)) {
            self.note_failure(what, &"404: the bucket does not exist (NoSuchBucket)");
            return Err(Failed::Other);
        }
        r
    }

    /// Deletes `name` (a victim of the budget, a rejected or expired value). Not found is fine.
    async fn delete(&self, name: &str) -> bool {
        let path = Path::from(name);
        matches!(
            self.request("delete", self.store.delete(&path)).await,
            Ok(()) | Err(Failed::NotFound)
        )
    }
}

/// Writes `key` from host block `block`: copies the block out (then releases it), deletes the
/// budget's `victims`, PUTs the value.
pub(super) async fn write(
    sh: Arc<Shared>,
    mut guard: JobGuard,
    key: ByteKey,
    block: BlockId,
    id: u64,
    stem: Box<str>,
    victims: Vec<Box<str>>,
) {
    let t0 = Instant::now();
    let hdr = format::COMPACT_HEADER_BYTES;
    let mut buf = vec![0u8; hdr + sh.payload_len];
    let mut sum = 0;
    let copied = sh.memory.with_block(block, &mut |b| {
        if b.len() == buf.len() - hdr {
            sum = format::payload_sum(b);
            buf[hdr..].copy_from_slice(b);
        }
    });
    guard.complete_now(); // the block is free once copied
    let mut h = sh.expect(&key);
    h.payload_sum = sum;
    let ok = copied.is_ok() && format::encode_sized(&h, &mut buf, hdr);
    let mut done = false;
    if ok {
        let mut room = true;
        for v in &victims {
            room &= sh.delete(v).await;
        }
        if room {
            let name = sh.object_name(id, &stem);
            done = put(&sh, &name, buf).await;
        } else {
            sh.counters.write_errors.fetch_add(1, Relaxed);
        }
    } else {
        sh.counters.write_errors.fetch_add(1, Relaxed);
        lock(&sh.state).last_error = Some("object tier: a block could not be copied out".into());
    }
    let mut st = lock(&sh.state);
    st.inflight_bytes = st.inflight_bytes.saturating_sub(sh.value_len);
    if let Some(Entry::Writing { recency, bytes, .. }) = st.index.get(id).cloned() {
        if done {
            let now = now_ns();
            st.index.set(
                id,
                Entry::Present {
                    stem,
                    bytes,
                    recency,
                    born_ns: now,
                    seen_ns: now,
                },
            );
        } else {
            st.index.remove(id);
        }
    }
    drop(st);
    if done {
        sh.counters.writes.fetch_add(1, Relaxed);
        sh.counters
            .bytes_written
            .fetch_add(sh.payload_len as u64, Relaxed);
        sh.counters
            .write_ns
            .fetch_add(super::elapsed_ns(t0), Relaxed);
    }
}

/// PUTs `buf` as `name` (multipart above the threshold); whether it landed.
async fn put(sh: &Shared, name: &str, buf: Vec<u8>) -> bool {
    let path = Path::from(name);
    let r = if (buf.len() as u64) <= sh.cfg.multipart_bytes {
        let payload = PutPayload::from(Bytes::from(buf));
        sh.request_put("put", sh.store.put(&path, payload))
            .await
            .map(|_| ())
    } else {
        let part = usize::try_from(sh.cfg.multipart_bytes).unwrap_or(usize::MAX);
        sh.request_put("multipart put", async {
            let upload = sh.store.put_multipart(&path).await?;
            let mut w = WriteMultipart::new_with_chunk_size(upload, part);
            w.put(Bytes::from(buf));
            w.finish().await
        })
        .await
        .map(|_| ())
    };
    if r.is_err() {
        sh.counters.write_errors.fetch_add(1, Relaxed);
    }
    r.is_ok()
}

/// Reads `key`'s value into host block `block` (a pending store): GET, check, copy.
pub(super) async fn read(sh: Arc<Shared>, mut guard: JobGuard, key: ByteKey, block: BlockId) {
    let t0 = Instant::now();
    let (id, stem) = Shared::ident(&key);
    let name = sh.object_name(id, &stem);
    let path = Path::from(name.as_str());
    let got = sh
        .request("get", async {
            let r = sh.store.get(&path).await?;
            r.bytes().await
        })
        .await;
    let bytes = match got {
        Ok(b) => b,
        Err(f) => {
            sh.counters.read_errors.fetch_add(1, Relaxed);
            let mut st = lock(&sh.state);
            // Vanished (or the store failed): a miss for a while, never a wrong block.
            let until = Instant::now()
                + match f {
                    Failed::NotFound => sh.cfg.negative_ttl,
                    Failed::Other => sh.cfg.backoff_min,
                };
            if !matches!(st.index.get(id), Some(Entry::Writing { .. })) {
                st.index.set(id, Entry::Absent { until });
            }
            return;
        }
    };
    let expect = sh.expect(&key);
    let checked = if bytes.len() as u64 == sh.value_len {
        format::verify_sized(&bytes, &expect, format::COMPACT_HEADER_BYTES).ok()
    } else {
        None
    };
    let Some(payload) = checked else {
        reject(&sh, id, &name).await;
        return;
    };
    if sh.memory.copy_in(block, payload).is_err() {
        sh.counters.read_errors.fetch_add(1, Relaxed);
        return;
    }
    guard.set_ok(true);
    sh.counters.promotions.fetch_add(1, Relaxed);
    sh.counters
        .bytes_read
        .fetch_add(payload.len() as u64, Relaxed);
    sh.counters
        .read_ns
        .fetch_add(super::elapsed_ns(t0), Relaxed);
    let now = now_ns();
    let mut st = lock(&sh.state);
    match st.index.get(id) {
        Some(Entry::Present { .. }) => st.index.touch(id, now),
        Some(Entry::Writing { .. }) => {}
        // Read without knowing it (readahead): now it is known.
        _ => st.index.found(id, stem.into(), sh.value_len, now, now),
    }
}

/// A value that failed its checks: counted, forgotten, deleted (it is in this layout's key space:
/// no valid value of another layout lives there).
async fn reject(sh: &Shared, id: u64, name: &str) {
    {
        let mut st = lock(&sh.state);
        if Shared::rejected_lately(&st, id) {
            return; // a listing (or another read) rejected and deleted it already
        }
        if !matches!(st.index.get(id), Some(Entry::Writing { .. })) {
            let until = Instant::now() + sh.cfg.negative_ttl;
            st.index.set(id, Entry::Absent { until });
        }
    }
    sh.counters.rejected.fetch_add(1, Relaxed);
    sh.delete(name).await;
}

impl Shared {
    /// Whether `id` is remembered absent (rejected, or a miss) right now: a value found bad
    /// again by a racing listing, fetch or read is not counted twice.
    fn rejected_lately(st: &super::State, id: u64) -> bool {
        matches!(st.index.get(id), Some(Entry::Absent { until }) if *until > Instant::now())
    }
}

/// Finds out whether the store holds `key` (HEAD): present with the right length, or absent.
pub(super) async fn fetch(sh: Arc<Shared>, _guard: JobGuard, key: ByteKey) {
    let (id, stem) = Shared::ident(&key);
    let name = sh.object_name(id, &stem);
    let path = Path::from(name.as_str());
    let r = sh.request("head", sh.store.head(&path)).await;
    let now = now_ns();
    let ttl_cut = sh
        .cfg
        .ttl
        .map(|t| now.saturating_sub(u64::try_from(t.as_nanos()).unwrap_or(u64::MAX)));
    let mut bad = false;
    let entry = match r {
        Ok(meta) => {
            let born = meta
                .last_modified
                .timestamp_nanos_opt()
                .map_or(now, |n| u64::try_from(n).unwrap_or(0));
            if meta.size != sh.value_len {
                bad = true;
                None
            } else if ttl_cut.is_some_and(|c| born < c) {
                None
            } else {
                sh.counters.fetch_hits.fetch_add(1, Relaxed);
                Some((stem, born))
            }
        }
        Err(Failed::NotFound) => {
            sh.counters.fetch_misses.fetch_add(1, Relaxed);
            None
        }
        Err(Failed::Other) => {
            sh.counters.fetch_errors.fetch_add(1, Relaxed);
            None
        }
    };
    {
        let mut st = lock(&sh.state);
        if bad {
            // `reject` below remembers it absent and counts it (once).
            if matches!(st.index.get(id), Some(Entry::Fetching)) {
                st.index.remove(id);
            }
        } else if matches!(st.index.get(id), Some(Entry::Fetching)) {
            if let Some((stem, born)) = entry {
                st.index.found(id, stem.into(), sh.value_len, born, now);
            } else {
                let until = st
                    .down_until
                    .unwrap_or_else(Instant::now)
                    .max(Instant::now() + sh.cfg.negative_ttl);
                st.index.set(id, Entry::Absent { until });
            }
        }
    }
    if bad {
        reject(&sh, id, &name).await;
    }
}

/// Deletes values the owner evicted (no write of its own to carry them).
pub(super) async fn delete_all(sh: Arc<Shared>, _guard: JobGuard, names: Vec<Box<str>>) {
    for n in names {
        sh.delete(&n).await;
    }
}

/// Lists the namespace at start, then every `list_interval`, until shutdown.
pub(super) async fn list_loop(sh: Arc<Shared>) {
    loop {
        if lock(&sh.state).shutdown {
            return;
        }
        let down = Shared::down(&lock(&sh.state), Instant::now());
        if !down {
            list(Arc::clone(&sh)).await;
        }
        let wait = match (sh.cfg.list_interval, down) {
            (_, true) => sh.cfg.backoff_min,
            (Some(i), false) => i,
            (None, false) => return,
        };
        tokio::time::sleep(wait).await;
    }
}

/// One listing of this layout's folder: values found are indexed, values no longer there are
/// forgotten, values of a wrong length are rejected and deleted, values past the TTL deleted,
/// and the budget is enforced over everything the index holds.
pub(super) async fn list(sh: Arc<Shared>) {
    // One listing at a time (the loop's and a caller's `rescan`): each sees what the one before
    // deleted, and nothing is counted twice.
    let _one = sh.listing.lock().await;
    let start = now_ns();
    let start_at = Instant::now();
    let prefix = Path::from(sh.base.as_str());
    let mut stream = sh.store.list(Some(&prefix));
    let mut found = Vec::new();
    loop {
        let item = match tokio::time::timeout(sh.deadline(), stream.next()).await {
            Ok(Some(Ok(m))) => m,
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                sh.note_failure("list", &e);
                return;
            }
            Err(_) => {
                sh.note_failure("list", &"no answer");
                return;
            }
        };
        if let Some((id, stem)) = sh.parse_name(item.location.as_ref()) {
            let born = item
                .last_modified
                .timestamp_nanos_opt()
                .map_or(start, |n| u64::try_from(n).unwrap_or(0));
            found.push((id, stem, item.size, born));
        }
    }
    drop(stream);
    sh.note_success();
    sh.counters.listings.fetch_add(1, Relaxed);
    let ttl_cut = sh
        .cfg
        .ttl
        .map(|t| start.saturating_sub(u64::try_from(t.as_nanos()).unwrap_or(u64::MAX)));
    let mut seen =
        HashSet::with_capacity_and_hasher(found.len(), foldhash::fast::RandomState::default());
    let mut doomed: Vec<Box<str>> = Vec::new();
    let mut rejected = 0;
    let mut expired = 0;
    let mut evicted = 0;
    {
        let mut st = lock(&sh.state);
        for (id, stem, size, born) in found {
            seen.insert(id);
            let name = sh.object_name(id, &stem);
            if size != sh.value_len {
                if !Shared::rejected_lately(&st, id) {
                    rejected += 1;
                    let until = Instant::now() + sh.cfg.negative_ttl;
                    st.index.set(id, Entry::Absent { until });
                    doomed.push(name.into());
                }
                continue;
            }
            if ttl_cut.is_some_and(|c| born < c) {
                expired += 1;
                st.index.remove(id);
                doomed.push(name.into());
                continue;
            }
            match st.index.get(id) {
                Some(Entry::Present { .. }) => {
                    if let Some(Entry::Present { seen_ns, .. }) = st.index.get_mut(id) {
                        *seen_ns = start;
                    }
                }
                Some(Entry::Writing { .. }) => {}
                // Remembered absent (rejected, or a miss): that holds until its deadline, and
                // whatever was learnt after this listing began is newer than what it found (a
                // listing served before a rejected value's DELETE still names the value). An
                // entry is set `negative_ttl` or more before its deadline (docs/tier.md "Object
                // tier", index).
                Some(Entry::Absent { until })
                    if *until > Instant::now()
                        || until
                            .checked_sub(sh.cfg.negative_ttl)
                            .is_some_and(|set| set >= start_at) => {}
                _ => st.index.set(
                    id,
                    Entry::Present {
                        stem: stem.into(),
                        bytes: size,
                        recency: born,
                        born_ns: born,
                        seen_ns: start,
                    },
                ),
            }
        }
        for id in st.index.unseen_since(start, &seen) {
            st.index.remove(id);
        }
        if let Some(c) = ttl_cut {
            for (id, stem) in st.index.born_before(c) {
                st.index.remove(id);
                expired += 1;
                doomed.push(sh.object_name(id, &stem).into());
            }
        }
        while st.index.bytes() > sh.cfg.bytes_to_use {
            let Some((id, stem, _)) = st.index.evict_lru() else {
                break;
            };
            evicted += 1;
            doomed.push(sh.object_name(id, &stem).into());
        }
        st.index.prune_absent(Instant::now());
    }
    sh.counters.rejected.fetch_add(rejected, Relaxed);
    sh.counters.expired.fetch_add(expired, Relaxed);
    sh.counters.evictions.fetch_add(evicted, Relaxed);
    for n in doomed {
        sh.delete(&n).await;
    }
}
