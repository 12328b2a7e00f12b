//! The remote tier's scheduler's side (docs/tier.md "Remote tier", the scheduler's path): the
//! partial index and the accounting of queued and running jobs, with the I/O threads' results
//! applied at each call. Runs only on the scheduler's thread.
#![forbid(unsafe_code)]

use std::sync::atomic::Ordering::{Acquire, Relaxed};
use std::time::Instant;

use super::index::{Entry, Index};
use super::shared::{Answer, Done, Job, ReadItem, Shared, Wrote};

use crate::tier::Completion;

/// The scheduler's side of the tier: the partial index and the accounting of queued and running
/// jobs. Only the scheduler's calls lock it (never an I/O thread), so the lock is never contended
/// by the I/O threads.
pub(super) struct Sched {
    pub(super) index: Index,
    /// Size of the index at which the next submission prunes it (see `RemoteTier::expire`).
    pub(super) prune_at: usize,
    /// Writes queued or running.
    pub(super) queued_writes: usize,
    pub(super) inflight_bytes: u64,
    /// Promotions queued or running.
    pub(super) reads_out: u64,
    /// The key (hash) each ticket of `Answers` was last taken for.
    pub(super) owner: Vec<u64>,
    /// The next ticket to take.
    pub(super) next_ticket: usize,
    /// Since when promotion or fetch jobs have been waiting in the queues with no wake-up rung
    /// for them (see [`Shared::queued_jobs`]).
    pub(super) unrung_since: Option<Instant>,
    pub(super) completions: Vec<Completion>,
    pub(super) done: std::sync::mpsc::Receiver<Done>,
}

impl Sched {
    /// Applies the results the I/O threads handed back since the last call.
    pub(super) fn apply(&mut self, sh: &Shared) {
        while let Ok(d) = self.done.try_recv() {
            self.apply_one(sh, d);
        }
    }

    fn end_writes(&mut self, sh: &Shared, n: usize) {
        self.queued_writes = self.queued_writes.saturating_sub(n);
        self.inflight_bytes = self
            .inflight_bytes
            .saturating_sub((n * sh.value_len) as u64);
    }

    pub(super) fn apply_one(&mut self, sh: &Shared, d: Done) {
        let now = self.index.tick(Instant::now());
        let absent = Entry::Absent {
            until: Index::after(now, sh.cfg.negative_ttl),
        };
        let present = Entry::Present {
            until: Index::after(now, sh.cfg.present_ttl),
            staged: false,
        };
        match d {
            Done::Fetch {
                hashes,
                tickets,
                values,
            } => {
                for ((h, t), v) in hashes.into_iter().zip(tickets).zip(values) {
                    // Its reservation ends here, not in the I/O thread (which ends the others'):
                    // until now the value's bytes were counted there.
                    sh.fetch_reserved.fetch_sub(sh.fetch_unit(), Relaxed);
                    // The ticket may be taken again from now on (not before: `take_ticket`).
                    sh.answers.write(t, Answer::Present, now);
                    if self.index.get(h) != Some(Entry::Fetching { ticket: t })
                        || self.owner[t as usize] != h
                    {
                        continue; // forgotten or written meanwhile
                    }
                    if self.index.staged_bytes() + v.len() as u64 <= sh.cfg.max_staged_bytes {
                        self.index
                            .stage(h, Index::after(now, sh.cfg.present_ttl), v);
                    } else {
                        self.index.set(h, present);
                    }
                }
            }
            Done::Read { items, ok } => {
                self.reads_out = self.reads_out.saturating_sub(items.len() as u64);
                for (ReadItem { key, block, .. }, ok) in items.into_iter().zip(ok) {
                    let h = Index::hash(&key);
                    if !ok {
                        self.forget_failed(sh, h, absent);
                    } else if !matches!(
                        self.resolve(sh, h),
                        Some(Entry::Writing | Entry::Fetching { .. })
                    ) {
                        // The server holds it (a read of a key the index did not know learns it).
                        self.index.set(h, present);
                    }
                    self.completions
                        .push(Completion::Promoted { key, block, ok });
                }
            }
            Done::Write { items, wrote } => {
                self.end_writes(sh, items.len());
                for ((key, block), w) in items.into_iter().zip(wrote) {
                    let h = Index::hash(&key);
                    if self.index.get(h) == Some(Entry::Writing) {
                        if w == Wrote::Stored {
                            self.index.set(h, present);
                        } else {
                            // Not on the server because of this write.
                            self.index.remove(h);
                        }
                    }
                    self.completions.push(Completion::Released { key, block });
                }
            }
            Done::Panicked(job) => match job {
                // Answered by its thread (`Shared::worker`).
                Job::Fetch(..) => {}
                Job::Read(items) => {
                    self.reads_out = self.reads_out.saturating_sub(items.len() as u64);
                    for ReadItem { key, block, .. } in items {
                        sh.counters.read_errors.fetch_add(1, Relaxed);
                        self.forget_failed(sh, Index::hash(&key), absent);
                        self.completions.push(Completion::Promoted {
                            key,
                            block,
                            ok: false,
                        });
                    }
                }
                Job::Write(items, _) => {
                    self.end_writes(sh, items.len());
                    sh.counters
                        .write_errors
                        .fetch_add(items.len() as u64, Relaxed);
                    for (key, block) in items {
                        let h = Index::hash(&key);
                        if self.index.get(h) == Some(Entry::Writing) {
                            self.index.remove(h);
                        }
                        self.completions.push(Completion::Released { key, block });
                    }
                }
            },
        }
    }

    /// After a failed promotion of `key`: remembered as absent, unless it is being written or
    /// fetched again meanwhile (that job's result decides); a value staged again meanwhile is
    /// given up with its bytes.
    fn forget_failed(&mut self, sh: &Shared, h: u64, absent: Entry) {
        if !matches!(
            self.resolve(sh, h),
            Some(Entry::Writing | Entry::Fetching { .. })
        ) {
            self.index.set(h, absent);
        }
    }

    /// Jobs queued or running.
    pub(super) fn outstanding(&self, sh: &Shared) -> bool {
        self.queued_writes > 0 || self.reads_out > 0 || sh.fetches_out.load(Acquire) > 0
    }

    /// `h`'s entry, with the answer of its fetch in place of its ticket once it came (see
    /// [`Answers`]); `None` also for a key whose ticket was taken again (its answer is lost).
    pub(super) fn resolve(&mut self, sh: &Shared, h: u64) -> Option<Entry> {
        let e = self.index.get(h)?;
        match Self::answered(&self.owner, sh, h, e) {
            Some(a) if a == e => Some(e),
            Some(a) => {
                self.index.set(h, a);
                Some(a)
            }
            None => {
                self.index.remove(h);
                None
            }
        }
    }

    /// `e` (`h`'s entry), or for a fetching one its answer if it came, or `None` if it is lost.
    pub(super) fn answered(owner: &[u64], sh: &Shared, h: u64, e: Entry) -> Option<Entry> {
        let Entry::Fetching { ticket } = e else {
            return Some(e);
        };
        if owner.get(ticket as usize) != Some(&h) {
            return None;
        }
        Some(match sh.answers.read(ticket) {
            // A staged value is on its way (`Done::Fetch`, sent right after the cell was written).
            (Answer::Pending | Answer::Staged, _) => e,
            (Answer::Present, at) => Entry::Present {
                until: Index::after(at, sh.cfg.present_ttl),
                staged: false,
            },
            (Answer::Absent, at) => Entry::Absent {
                until: Index::after(at, sh.cfg.negative_ttl),
            },
        })
    }

    /// A ticket for a fetch of `h`, its cell pending; `None` while the next one's fetch is
    /// still running, or its staged value not yet applied (more fetches in flight than there
    /// are tickets for: the caller stops).
    pub(super) fn take_ticket(&mut self, sh: &Shared, h: u64) -> Option<u32> {
        let t = self.next_ticket;
        #[allow(clippy::cast_possible_truncation)]
        let ticket = t as u32; // fewer than 2^32 cells
        if self.owner[t] != 0
            && matches!(sh.answers.read(ticket).0, Answer::Pending | Answer::Staged)
        {
            return None;
        }
        self.owner[t] = h;
        sh.answers.write(ticket, Answer::Pending, 0);
        self.next_ticket = (t + 1) & (self.owner.len() - 1);
        Some(ticket)
    }
}
