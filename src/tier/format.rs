//! On-disk format of one tier file: a 4 KiB header, then the payload padded to a multiple of 4 KiB.
//!
//! Header (little-endian): magic `KVOFFTB1`, format version, header length, layout fingerprint,
//! rank, world size, payload length, xxh3-64 of the payload, owner tag, key length and key bytes,
//! and at the end of the used bytes the xxh3-64 of everything before it. A file is served only when
//! the magic, version, fingerprint, rank, key, lengths and both checksums match; anything else is a
//! corrupt file. The 4 KiB alignment of header and payload lets the file be read and written with
//! `O_DIRECT` in one call.
//!
//! A remote-tier value carries the same header, unpadded: [`COMPACT_HEADER_BYTES`] (the fields
//! and room for the longest key), then the payload (docs/tier.md "Remote tier"). The header
//! length field says which of the two a header is, and a reader accepts only the one it expects.
//!
//! **Names.** Every tier names a block key the same way ([`key_stem`]: its bytes in hex, or `h` and
//! its xxh3-128 when longer than [`MAX_HEX_KEY`] bytes), and an instance that names no owner is
//! owned by its namespace, rank and host ([`default_owner`]).
#![forbid(unsafe_code)]

use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

use super::Layout;

/// Longest key named by its hex bytes (longer keys are named by their hash).
pub const MAX_HEX_KEY: usize = 100;

/// The name of block key `k` in a tier's key space: its bytes in lower-case hex, or, when longer
/// than [`MAX_HEX_KEY`] bytes, `h` and the 32 hex digits of its xxh3-128.
#[must_use]
pub fn key_stem(k: &[u8]) -> String {
    if k.len() <= MAX_HEX_KEY {
        hex(k)
    } else {
        format!("h{:032x}", xxh3_128(k))
    }
}

/// What a [`key_stem`] names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Stem {
    /// The key itself (a hex name).
    Key(Vec<u8>),
    /// A hashed name: the key is in the value's header.
    Hashed,
}

/// What `stem` names; `None` for a name [`key_stem`] does not make.
#[must_use]
pub fn parse_key_stem(stem: &str) -> Option<Stem> {
    if let Some(h) = stem.strip_prefix('h') {
        return (h.len() == 32 && h.bytes().all(|b| b.is_ascii_hexdigit())).then_some(Stem::Hashed);
    }
    unhex(stem).map(Stem::Key)
}

/// `bytes` in lower-case hex.
#[must_use]
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// This machine's host name, with every character but ASCII letters, digits and `-` as `_` (empty
/// where it cannot be read).
#[must_use]
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The owner string of an instance whose settings name none: `namespace|rank|host`.
#[must_use]
pub fn default_owner(layout: &Layout, host: &str) -> String {
    format!("{}|{}|{host}", layout.namespace, layout.rank)
}

/// File magic.
pub const MAGIC: [u8; 8] = *b"KVOFFTB1";
/// Format version.
pub const VERSION: u32 = 1;
/// Bytes of the header (and the alignment unit of the file).
pub const HEADER_BYTES: usize = 4096;
/// Longest key stored in a header.
pub const MAX_KEY_BYTES: usize = 1024;

/// Bytes of the unpadded header of a remote-tier value: the fields and the longest key.
pub const COMPACT_HEADER_BYTES: usize = OFF_KEY + MAX_KEY_BYTES + 8;

const OFF_VERSION: usize = 8;
const OFF_HEADER_LEN: usize = 12;
const OFF_FINGERPRINT: usize = 16;
const OFF_RANK: usize = 24;
const OFF_WORLD: usize = 28;
const OFF_PAYLOAD_LEN: usize = 32;
const OFF_PAYLOAD_SUM: usize = 40;
const OFF_OWNER: usize = 48;
const OFF_KEY_LEN: usize = 56;
const OFF_KEY: usize = 64;

/// What a header says (and what a reader expects).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// Layout fingerprint (see [`super::Layout::fingerprint`]).
    pub fingerprint: u64,
    /// Rank whose slot the payload is.
    pub rank: u32,
    /// Number of ranks of the writer.
    pub world_size: u32,
    /// Payload bytes (unpadded).
    pub payload_len: u64,
    /// xxh3-64 of the payload.
    pub payload_sum: u64,
    /// Tag of the tier instance that wrote the file.
    pub owner: u64,
    /// The offload key.
    pub key: Vec<u8>,
}

/// Total file length for a payload of `payload_len` bytes: header plus payload rounded up to 4 KiB.
#[must_use]
pub const fn file_len(payload_len: u64) -> u64 {
    HEADER_BYTES as u64 + payload_len.div_ceil(HEADER_BYTES as u64) * HEADER_BYTES as u64
}

/// Checksum of a payload: XXH3-64 (seed 0), the value every header's `payload_sum` holds.
///
/// Computed by twox-hash, which picks its AVX2 loop at run time where the CPU has it: a portable
/// build of xxhash-rust (the same function) is limited to SSE2, about 1.5x slower on the 2 MiB
/// payloads the tiers check on every load and store (docs/performance.md "Tier tuning table").
/// Equal to xxhash-rust's `xxh3_64` for every input (`payload_sum_is_xxh3_64`).
#[must_use]
pub fn payload_sum(payload: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(payload)
}

/// [`payload_sum`] of a payload fed in pieces (as it arrives from a socket).
pub struct PayloadSum(twox_hash::XxHash3_64);

impl PayloadSum {
    /// A sum of no bytes yet.
    #[must_use]
    pub fn new() -> Self {
        Self(twox_hash::XxHash3_64::with_seed(0))
    }
    /// Feeds the next piece of the payload.
    pub fn update(&mut self, piece: &[u8]) {
        std::hash::Hasher::write(&mut self.0, piece);
    }
    /// [`payload_sum`] of every piece fed so far, in order.
    #[must_use]
    pub fn digest(&self) -> u64 {
        std::hash::Hasher::finish(&self.0)
    }
}

impl Default for PayloadSum {
    fn default() -> Self {
        Self::new()
    }
}

fn put_u32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}
fn put_u64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}
fn get_u32(b: &[u8], off: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[off..off + 4]);
    u32::from_le_bytes(a)
}
fn get_u64(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}

/// Writes `h` into the first [`HEADER_BYTES`] of `out` (the rest of those bytes become zero).
/// Returns `false` (writing nothing) when the key is longer than [`MAX_KEY_BYTES`] or `out` is
/// shorter than a header.
pub fn encode(h: &Header, out: &mut [u8]) -> bool {
    encode_sized(h, out, HEADER_BYTES)
}

/// [`encode`] with a header of `header_len` bytes ([`HEADER_BYTES`] for a file,
/// [`COMPACT_HEADER_BYTES`] for a remote value). Returns `false` (writing nothing) for a
/// `header_len` outside those bounds too.
pub fn encode_sized(h: &Header, out: &mut [u8], header_len: usize) -> bool {
    if h.key.len() > MAX_KEY_BYTES
        || !(COMPACT_HEADER_BYTES..=HEADER_BYTES).contains(&header_len)
        || out.len() < header_len
    {
        return false;
    }
    let b = &mut out[..header_len];
    b.fill(0);
    b[..8].copy_from_slice(&MAGIC);
    put_u32(b, OFF_VERSION, VERSION);
    #[allow(clippy::cast_possible_truncation)] // ≤ 4096
    put_u32(b, OFF_HEADER_LEN, header_len as u32);
    put_u64(b, OFF_FINGERPRINT, h.fingerprint);
    put_u32(b, OFF_RANK, h.rank);
    put_u32(b, OFF_WORLD, h.world_size);
    put_u64(b, OFF_PAYLOAD_LEN, h.payload_len);
    put_u64(b, OFF_PAYLOAD_SUM, h.payload_sum);
    put_u64(b, OFF_OWNER, h.owner);
    #[allow(clippy::cast_possible_truncation)] // ≤ MAX_KEY_BYTES
    put_u32(b, OFF_KEY_LEN, h.key.len() as u32);
    b[OFF_KEY..OFF_KEY + h.key.len()].copy_from_slice(&h.key);
    let end = OFF_KEY + h.key.len();
    let sum = xxh3_64(&b[..end]);
    put_u64(b, end, sum);
    true
}

/// Why a header was rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reject {
    /// Too short, bad magic, version, header length or header checksum.
    Damaged,
    /// A valid header of another layout, rank or key (not ours to serve).
    Mismatch,
}

/// Decodes and checks a header (magic, version, lengths, header checksum).
///
/// # Errors
/// [`Reject::Damaged`] when any check fails.
pub fn decode(b: &[u8]) -> Result<Header, Reject> {
    decode_sized(b, HEADER_BYTES)
}

/// [`decode`] of a header that must be `header_len` bytes long (see [`encode_sized`]).
///
/// # Errors
/// [`Reject::Damaged`] when any check fails, a header of another length included.
pub fn decode_sized(b: &[u8], header_len: usize) -> Result<Header, Reject> {
    if !(COMPACT_HEADER_BYTES..=HEADER_BYTES).contains(&header_len)
        || b.len() < header_len
        || b[..8] != MAGIC
    {
        return Err(Reject::Damaged);
    }
    if get_u32(b, OFF_VERSION) != VERSION || get_u32(b, OFF_HEADER_LEN) as usize != header_len {
        return Err(Reject::Damaged);
    }
    let key_len = get_u32(b, OFF_KEY_LEN) as usize;
    if key_len > MAX_KEY_BYTES {
        return Err(Reject::Damaged);
    }
    let end = OFF_KEY + key_len;
    if get_u64(b, end) != xxh3_64(&b[..end]) {
        return Err(Reject::Damaged);
    }
    Ok(Header {
        fingerprint: get_u64(b, OFF_FINGERPRINT),
        rank: get_u32(b, OFF_RANK),
        world_size: get_u32(b, OFF_WORLD),
        payload_len: get_u64(b, OFF_PAYLOAD_LEN),
        payload_sum: get_u64(b, OFF_PAYLOAD_SUM),
        owner: get_u64(b, OFF_OWNER),
        key: b[OFF_KEY..end].to_vec(),
    })
}

/// Checks a header against what the reader expects (fingerprint, rank, world size, payload length,
/// key); the payload checksum is the caller's to compare with the returned `payload_sum`.
///
/// # Errors
/// [`Reject::Damaged`] for a bad header; [`Reject::Mismatch`] for another layout, rank, key or length.
pub fn verify_header(b: &[u8], expect: &Header) -> Result<Header, Reject> {
    verify_header_sized(b, expect, HEADER_BYTES)
}

/// [`verify_header`] of a header that must be `header_len` bytes long.
///
/// # Errors
/// As [`verify_header`].
pub fn verify_header_sized(b: &[u8], expect: &Header, header_len: usize) -> Result<Header, Reject> {
    let h = decode_sized(b, header_len)?;
    if h.fingerprint != expect.fingerprint
        || h.rank != expect.rank
        || h.world_size != expect.world_size
        || h.payload_len != expect.payload_len
        || h.key != expect.key
    {
        return Err(Reject::Mismatch);
    }
    Ok(h)
}

/// Checks a whole file image (`buf` = the bytes read, `expect` = what the reader wants, with
/// `payload_sum` ignored) and returns the payload slice.
///
/// # Errors
/// [`Reject::Damaged`] for a bad header, a short file or a payload checksum mismatch;
/// [`Reject::Mismatch`] for a valid header of another layout, rank, key or payload length.
pub fn verify<'a>(buf: &'a [u8], expect: &Header) -> Result<&'a [u8], Reject> {
    verify_sized(buf, expect, HEADER_BYTES)
}

/// [`verify`] of an image whose header is `header_len` bytes long (its payload follows at once).
///
/// # Errors
/// As [`verify`].
pub fn verify_sized<'a>(
    buf: &'a [u8],
    expect: &Header,
    header_len: usize,
) -> Result<&'a [u8], Reject> {
    let h = verify_header_sized(buf, expect, header_len)?;
    let len = usize::try_from(h.payload_len).map_err(|_| Reject::Damaged)?;
    let payload = buf
        .get(header_len..header_len + len)
        .ok_or(Reject::Damaged)?;
    if payload_sum(payload) != h.payload_sum {
        return Err(Reject::Damaged);
    }
    Ok(payload)
}

#[cfg(test)]
#[allow(clippy::pedantic)] // tests: style lints are for the library
mod tests {
    use super::*;

    /// Values stored by any build stay readable: the run-time-dispatched sum is xxhash-rust's
    /// XXH3-64, one-shot and streamed in uneven pieces, at the lengths where XXH3 changes path
    /// (0, 1–3, 4–8, 9–16, 17–128, 129–240, stripes, blocks of 1 KiB, the tail).
    #[test]
    fn payload_sum_is_xxh3_64() {
        let n = (2 << 20) + 77;
        let v: Vec<u8> = (0..n)
            .map(|i| u8::try_from((i * 131 + 7 + (i >> 11)) % 251).unwrap_or(0))
            .collect();
        for len in [
            0usize,
            1,
            3,
            4,
            8,
            9,
            16,
            17,
            64,
            128,
            129,
            200,
            240,
            241,
            1024,
            1025,
            1096,
            4096,
            32_768,
            65_543,
            1 << 20,
            n,
        ] {
            let want = xxh3_64(&v[..len]);
            assert_eq!(payload_sum(&v[..len]), want, "len {len}");
            for first in [1usize, 7, 64, 1000] {
                let mut h = PayloadSum::new();
                let (mut i, mut step) = (0, first);
                while i < len {
                    let e = (i + step).min(len);
                    h.update(&v[i..e]);
                    i = e;
                    step = step * 3 + 5;
                }
                assert_eq!(
                    h.digest(),
                    want,
                    "len {len}, streamed from pieces of {first}"
                );
            }
        }
    }

    #[test]
    fn key_stems_round_trip() {
        assert_eq!(key_stem(b"\x01\xab"), "01ab");
        assert_eq!(parse_key_stem("01ab"), Some(Stem::Key(vec![1, 0xab])));
        let long = vec![7u8; MAX_HEX_KEY + 1];
        let s = key_stem(&long);
        assert_eq!((s.len(), s.as_bytes()[0]), (33, b'h'));
        assert_eq!(parse_key_stem(&s), Some(Stem::Hashed));
        assert_eq!(key_stem(&long[..MAX_HEX_KEY]).len(), 2 * MAX_HEX_KEY);
        assert_eq!(parse_key_stem("0g"), None);
        assert_eq!(parse_key_stem("hxyz"), None);
    }

    fn hdr() -> Header {
        Header {
            fingerprint: 7,
            rank: 1,
            world_size: 2,
            payload_len: 5,
            payload_sum: payload_sum(b"hello"),
            owner: 9,
            key: b"key\0\0\0\0".to_vec(),
        }
    }

    #[test]
    fn roundtrip_and_every_flipped_header_byte_is_caught() {
        let h = hdr();
        let mut buf = vec![0u8; crate::usize_from(file_len(5))];
        assert!(encode(&h, &mut buf));
        buf[HEADER_BYTES..HEADER_BYTES + 5].copy_from_slice(b"hello");
        assert_eq!(decode(&buf).unwrap(), h);
        assert_eq!(verify(&buf, &h).unwrap(), b"hello");
        let used = OFF_KEY + h.key.len() + 8;
        for i in 0..used {
            let mut b = buf.clone();
            b[i] ^= 0x10;
            assert!(verify(&b, &h).is_err(), "flipped header byte {i} accepted");
        }
        for i in HEADER_BYTES..HEADER_BYTES + 5 {
            let mut b = buf.clone();
            b[i] ^= 1;
            assert_eq!(verify(&b, &h), Err(Reject::Damaged));
        }
        let mut other = h.clone();
        other.rank = 0;
        assert_eq!(verify(&buf, &other), Err(Reject::Mismatch));
        assert_eq!(verify(&buf[..100], &h), Err(Reject::Damaged));
    }

    #[test]
    fn compact_header_roundtrips_and_is_not_a_file_header() {
        let h = hdr();
        let mut buf = vec![0u8; COMPACT_HEADER_BYTES + 5];
        assert!(encode_sized(&h, &mut buf, COMPACT_HEADER_BYTES));
        buf[COMPACT_HEADER_BYTES..].copy_from_slice(b"hello");
        assert_eq!(
            verify_sized(&buf, &h, COMPACT_HEADER_BYTES).unwrap(),
            b"hello"
        );
        // Each length is only accepted where it is expected.
        assert_eq!(decode(&buf), Err(Reject::Damaged));
        let mut file = vec![0u8; crate::usize_from(file_len(5))];
        assert!(encode(&h, &mut file));
        assert_eq!(
            decode_sized(&file, COMPACT_HEADER_BYTES),
            Err(Reject::Damaged)
        );
        // The longest key fits; lengths outside the bounds are refused.
        let mut long = h.clone();
        long.key = vec![7; MAX_KEY_BYTES];
        assert!(encode_sized(&long, &mut buf, COMPACT_HEADER_BYTES));
        assert_eq!(decode_sized(&buf, COMPACT_HEADER_BYTES).unwrap(), long);
        assert!(!encode_sized(&h, &mut buf, COMPACT_HEADER_BYTES - 8));
        assert!(!encode_sized(&h, &mut file, HEADER_BYTES + 8));
        assert_eq!(
            decode_sized(&buf, COMPACT_HEADER_BYTES - 8),
            Err(Reject::Damaged)
        );
        for i in 0..OFF_KEY + h.key.len() + 8 {
            let mut b = buf.clone();
            assert!(encode_sized(&h, &mut b, COMPACT_HEADER_BYTES));
            b[i] ^= 0x10;
            assert!(
                verify_header_sized(&b, &h, COMPACT_HEADER_BYTES).is_err(),
                "flipped byte {i} accepted"
            );
        }
    }

    #[test]
    fn lengths() {
        assert_eq!(file_len(0), 4096);
        assert_eq!(file_len(1), 8192);
        assert_eq!(file_len(2 << 20), 4096 + (2 << 20));
        let mut h = hdr();
        h.key = vec![0; MAX_KEY_BYTES + 1];
        assert!(!encode(&h, &mut [0u8; HEADER_BYTES]));
    }
}
