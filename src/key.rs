//! Offload keys (docs/spec.md §1): `block_hash ‖ group_idx as u32 big-endian`.
//!
//! A key names one CPU block of one KV-cache group. Managers treat keys as opaque; these helpers only
//! build and split them.
#![forbid(unsafe_code)]

use crate::error::{KvoffError, Result};

/// Bytes of the group index suffix.
pub const GROUP_IDX_BYTES: usize = 4;

/// Builds the key of `block_hash` in KV-cache group `group_idx`.
///
/// # Errors
/// Never for a `u32` group index; [`make_offload_key_checked`] takes any integer.
#[must_use]
pub fn make_offload_key(block_hash: &[u8], group_idx: u32) -> Vec<u8> {
    let mut key = Vec::with_capacity(block_hash.len() + GROUP_IDX_BYTES);
    key.extend_from_slice(block_hash);
    key.extend_from_slice(&group_idx.to_be_bytes());
    key
}

/// Like [`make_offload_key`] for a group index of any width.
///
/// # Errors
/// [`KvoffError::InvalidArgument`] if `group_idx` is outside `0..=u32::MAX`.
pub fn make_offload_key_checked(block_hash: &[u8], group_idx: i128) -> Result<Vec<u8>> {
    let g = u32::try_from(group_idx).map_err(|_| {
        KvoffError::arg(format!(
            "group_idx must be in 0..=4294967295, got {group_idx}"
        ))
    })?;
    Ok(make_offload_key(block_hash, g))
}

fn check_len(key: &[u8]) -> Result<()> {
    if key.len() < GROUP_IDX_BYTES {
        return Err(KvoffError::arg(format!(
            "an offload key has at least {GROUP_IDX_BYTES} bytes (the group index), got {}",
            key.len()
        )));
    }
    Ok(())
}

/// The block hash part of `key`.
///
/// # Errors
/// [`KvoffError::InvalidArgument`] if `key` is shorter than 4 bytes.
pub fn get_offload_block_hash(key: &[u8]) -> Result<&[u8]> {
    check_len(key)?;
    Ok(&key[..key.len() - GROUP_IDX_BYTES])
}

/// The KV-cache group index of `key`.
///
/// # Errors
/// [`KvoffError::InvalidArgument`] if `key` is shorter than 4 bytes.
pub fn get_offload_group_idx(key: &[u8]) -> Result<u32> {
    check_len(key)?;
    let n = key.len();
    let mut b = [0u8; GROUP_IDX_BYTES];
    b.copy_from_slice(&key[n - GROUP_IDX_BYTES..]);
    Ok(u32::from_be_bytes(b))
}

#[cfg(test)]
#[allow(clippy::pedantic)] // tests: style lints are for the library
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let k = make_offload_key(b"abc", 0x0102_0304);
        assert_eq!(k, b"abc\x01\x02\x03\x04");
        assert_eq!(get_offload_block_hash(&k).unwrap(), b"abc");
        assert_eq!(get_offload_group_idx(&k).unwrap(), 0x0102_0304);
        assert_eq!(
            get_offload_block_hash(&make_offload_key(b"", 7)).unwrap(),
            b""
        );
    }

    #[test]
    fn errors() {
        assert!(get_offload_group_idx(b"abc").is_err());
        assert!(get_offload_block_hash(b"").is_err());
        assert!(make_offload_key_checked(b"x", -1).is_err());
        assert!(make_offload_key_checked(b"x", 1 << 32).is_err());
        assert_eq!(
            make_offload_key_checked(b"x", (1 << 32) - 1).unwrap(),
            b"x\xff\xff\xff\xff"
        );
    }
}

/// An owned byte-string key that stores up to [`ByteKey::INLINE`] bytes inline (no allocation for
/// typical 32-byte hashes + 4-byte group index) and longer keys on the heap. Hash and equality are
/// those of the byte string.
#[derive(Clone)]
pub enum ByteKey {
    /// Short key stored in place.
    Inline {
        /// Used bytes of `buf`.
        len: u8,
        /// Storage.
        buf: [u8; ByteKey::INLINE],
    },
    /// Long key.
    Heap(Box<[u8]>),
}

impl ByteKey {
    /// Longest key stored inline.
    pub const INLINE: usize = 46;

    /// Copies `bytes` into a key.
    #[must_use]
    #[inline]
    pub fn new(bytes: &[u8]) -> Self {
        if bytes.len() <= Self::INLINE {
            let mut buf = [0u8; Self::INLINE];
            buf[..bytes.len()].copy_from_slice(bytes);
            #[allow(clippy::cast_possible_truncation)] // len ≤ INLINE < 256
            ByteKey::Inline {
                len: bytes.len() as u8,
                buf,
            }
        } else {
            ByteKey::Heap(bytes.into())
        }
    }

    /// The key's bytes.
    #[must_use]
    #[inline]
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            ByteKey::Inline { len, buf } => &buf[..*len as usize],
            ByteKey::Heap(b) => b,
        }
    }
}

impl PartialEq for ByteKey {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}
impl Eq for ByteKey {}

impl std::hash::Hash for ByteKey {
    #[inline]
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_bytes().hash(state);
    }
}

impl std::fmt::Debug for ByteKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ByteKey({:?})", self.as_bytes())
    }
}

impl From<&[u8]> for ByteKey {
    fn from(b: &[u8]) -> Self {
        Self::new(b)
    }
}

#[cfg(test)]
mod byte_key_tests {
    use super::ByteKey;

    #[test]
    fn inline_and_heap() {
        let short = ByteKey::new(&[1; 46]);
        let long = ByteKey::new(&[1; 47]);
        assert!(matches!(short, ByteKey::Inline { .. }));
        assert!(matches!(long, ByteKey::Heap(_)));
        assert_eq!(short.as_bytes(), &[1; 46]);
        assert_eq!(long.as_bytes(), &[1; 47]);
        assert_ne!(ByteKey::new(b"a"), ByteKey::new(b"a\0"));
        assert_eq!(std::mem::size_of::<ByteKey>(), 48);
    }
}
