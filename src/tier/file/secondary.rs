//! The file tier's [`SecondaryTier`] implementation: what the tiered manager
//! (`chain::ChainManager`) calls, mapped onto [`FileTier`]'s own API.

use std::any::Any;

use super::{FileTier, INFO};
use crate::key::ByteKey;
use crate::manager::BlockId;
use crate::tier::secondary::{Known, SecondaryCounters, SecondaryTier};
use crate::tier::Completion;

impl SecondaryTier for FileTier {
    fn kind(&self) -> &'static str {
        INFO.kind
    }

    fn index(&self, key: &ByteKey) -> Known {
        if self.contains(key) {
            Known::Present
        } else {
            Known::Absent
        }
    }

    fn has_or_writing(&self, key: &ByteKey) -> bool {
        FileTier::has_or_writing(self, key)
    }

    fn submit_writes(&self, items: &[(ByteKey, BlockId)]) -> Vec<bool> {
        items
            .iter()
            .map(|(k, b)| self.submit_write(k, *b))
            .collect()
    }

    fn submit_reads(&self, items: &[(ByteKey, BlockId)]) -> Vec<bool> {
        items.iter().map(|(k, b)| self.submit_read(k, *b)).collect()
    }

    fn poll(&self) -> Vec<Completion> {
        FileTier::poll(self)
    }

    fn busy(&self) -> bool {
        FileTier::busy(self)
    }

    fn flush(&self) {
        FileTier::flush(self);
    }

    fn shutdown(&mut self) {
        FileTier::shutdown(self);
    }

    fn forked(&self) -> bool {
        FileTier::forked(self)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn counters(&self) -> SecondaryCounters {
        let s = self.stats();
        SecondaryCounters {
            writes: s.files_written,
            bytes_written: s.bytes_written,
            write_seconds: s.write_seconds,
            write_errors: s.write_errors,
            writes_dropped: s.writes_dropped,
            promotions: s.promotions,
            bytes_read: s.bytes_read,
            read_seconds: s.read_seconds,
            read_errors: s.read_errors,
            rejected: s.corrupt_files,
            fetch_hits: 0,
            fetch_misses: 0,
            fetch_errors: 0,
            reconnects: 0,
            queued_reads: s.queued_reads,
            queued_writes: s.queued_writes,
            last_error: s.last_error,
        }
    }

    fn extra_stats(&self) -> Vec<(&'static str, u64)> {
        let s = self.stats();
        // In the order of `INFO.extra_stats` (its length checked at compile time).
        let values: [u64; INFO.extra_stats.len()] = [
            s.rejected_files,
            s.evicted_files,
            s.indexed_files,
            s.own_files,
            s.own_bytes,
            u64::from(s.direct_io),
        ];
        INFO.extra_stats.iter().copied().zip(values).collect()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::tier::{Layout, TierConfig, VecMemory};

    /// The file tier through the trait object: write, index, read back, counters.
    #[test]
    fn file_tier_through_the_trait() {
        let dir = std::env::temp_dir().join(format!("kvoff-secondary-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mem = Arc::new(VecMemory::new(4, 4096));
        let layout = Layout {
            namespace: "t".into(),
            world_size: 1,
            ..Layout::default()
        };
        let tier =
            FileTier::open(TierConfig::new(&dir, 1 << 20, layout), mem.clone()).expect("open");
        let mut tier: Box<dyn SecondaryTier> = Box::new(tier);
        assert_eq!(tier.kind(), "disk");
        let k = ByteKey::new(b"k1");
        assert_eq!(tier.index(&k), Known::Absent);
        assert_eq!(tier.submit_fetch(std::slice::from_ref(&k)), 0);
        mem.set_block(0, &[9; 4096]).expect("set");
        assert_eq!(tier.submit_writes(&[(k.clone(), 0)]), vec![true]);
        assert!(tier.has_or_writing(&k));
        tier.flush();
        assert!(tier.poll().contains(&Completion::Released {
            key: k.clone(),
            block: 0
        }));
        assert_eq!(tier.index(&k), Known::Present);
        assert_eq!(tier.submit_reads(&[(k.clone(), 1)]), vec![true]);
        tier.flush();
        assert_eq!(
            tier.poll(),
            vec![Completion::Promoted {
                key: k,
                block: 1,
                ok: true
            }]
        );
        assert_eq!(mem.block(1).expect("block"), vec![9; 4096]);
        let c = tier.counters();
        assert_eq!((c.writes, c.promotions, c.bytes_read), (1, 1, 4096));
        tier.shutdown();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
