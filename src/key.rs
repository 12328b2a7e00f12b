//! Offload keys (SPEC §1): `block_hash ‖ group_idx as u32 big-endian`.
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
