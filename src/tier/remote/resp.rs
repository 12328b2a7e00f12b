//! The RESP framing kvoff reads and writes itself on its own connections (docs/design.md "The
//! data path"): where a reply ends ([`extent`], [`bulk_header`]) and the bytes around a value in a
//! `SET` or an `MSET` ([`set_head`], [`set_tail`], [`mset_head`], [`pair_head`]), checked byte for
//! byte against the `redis` crate's own packer and parser by the unit tests below.
#![forbid(unsafe_code)]

use std::io::Write;

/// Most bytes of a bulk string reply: Redis's own limit on a string (`proto-max-bulk-len`,
/// 512 MB). A longer length is a broken or hostile stream: an error, never an allocation.
pub(super) const MAX_BULK_BYTES: usize = 512 << 20;
/// Most nested levels of an array reply.
const MAX_DEPTH: usize = 16;
/// The end of the line at the start of `b` (the index after its CRLF), if it is all there.
pub(super) fn line_end(b: &[u8]) -> Option<usize> {
    b.windows(2).position(|w| w == b"\r\n").map(|i| i + 2)
}

/// The integer of a reply header line (`b` is the line without its type byte and CRLF).
pub(super) fn header_int(b: &[u8]) -> Result<i64, String> {
    std::str::from_utf8(b)
        .ok()
        .and_then(|s| s.parse::<i64>().ok())
        .ok_or_else(|| "a malformed reply header".to_owned())
}

/// A bulk string reply's length (`None`: a nil reply) and its header's size, once the header is in
/// `b`.
pub(super) fn bulk_header(b: &[u8]) -> Result<Option<(Option<usize>, usize)>, String> {
    let Some(end) = line_end(b) else {
        if b.len() > 32 {
            return Err("a malformed bulk string header".to_owned());
        }
        return Ok(None);
    };
    let n = header_int(&b[1..end - 2])?;
    match n {
        -1 => Ok(Some((None, end))),
        n if n >= 0 => {
            let len = usize::try_from(n).map_err(|e| e.to_string())?;
            if len > MAX_BULK_BYTES {
                return Err(format!("a bulk string reply of {len} bytes"));
            }
            Ok(Some((Some(len), end)))
        }
        _ => Err("a malformed bulk string header".to_owned()),
    }
}

/// The size of the RESP2 reply at the start of `b`, if it is all there (`None`: read more).
pub(super) fn extent(b: &[u8], depth: usize) -> Result<Option<usize>, String> {
    if depth > MAX_DEPTH {
        return Err("a reply nested too deep".to_owned());
    }
    let Some(&kind) = b.first() else {
        return Ok(None);
    };
    let Some(end) = line_end(b) else {
        return Ok(None);
    };
    match kind {
        b'+' | b'-' | b':' => Ok(Some(end)),
        b'$' => match bulk_header(b)? {
            Some((None, head)) => Ok(Some(head)),
            Some((Some(len), head)) => {
                let total = head.saturating_add(len).saturating_add(2);
                Ok((b.len() >= total).then_some(total))
            }
            None => Ok(None),
        },
        b'*' => {
            let n = header_int(&b[1..end - 2])?;
            let mut at = end;
            for _ in 0..n.max(0) {
                match extent(&b[at..], depth + 1)? {
                    Some(k) => at += k,
                    None => return Ok(None),
                }
            }
            Ok(Some(at))
        }
        other => Err(format!("an unexpected reply type {:?}", char::from(other))),
    }
}

/// Appends the bytes before a value in the packed command `SET key value [PX ms]` to `out`,
/// exactly as the crate packs them (the value itself can then go to the socket from where it
/// lies); [`set_tail`] appends the bytes after it.
pub(super) fn set_head(key: &str, value_len: usize, px: Option<u64>, out: &mut Vec<u8>) {
    let args = if px.is_some() { 5 } else { 3 };
    let _ = write!(
        out,
        "*{args}\r\n$3\r\nSET\r\n${}\r\n{key}\r\n${value_len}\r\n",
        key.len()
    );
}

/// Appends the bytes before the first key of the packed command `MSET k1 v1 … kn vn` (`pairs`
/// = n) to `out`; each pair then follows as [`pair_head`], the value's bytes and `\r\n`.
pub(super) fn mset_head(pairs: usize, out: &mut Vec<u8>) {
    let _ = write!(out, "*{}\r\n$4\r\nMSET\r\n", 1 + 2 * pairs);
}

/// Appends the bytes of a key and the length line of its value (see [`mset_head`]).
pub(super) fn pair_head(key: &str, value_len: usize, out: &mut Vec<u8>) {
    let _ = write!(out, "${}\r\n{key}\r\n${value_len}\r\n", key.len());
}

/// See [`set_head`].
pub(super) fn set_tail(px: Option<u64>, out: &mut Vec<u8>) {
    out.extend_from_slice(b"\r\n");
    if let Some(ms) = px {
        let ms = ms.to_string();
        let _ = write!(out, "$2\r\nPX\r\n${}\r\n{ms}\r\n", ms.len());
    }
}

#[cfg(test)]
#[allow(clippy::pedantic)] // tests: style lints are for the library
pub(super) mod tests {
    use super::*;

    #[test]
    fn set_frame_is_the_crates_packing() {
        for (key, len, px) in [
            ("k", 0, None),
            ("kvoff:{ab:cd}:r0", 5, Some(1)),
            ("x", 70_000, Some(86_400_000)),
        ] {
            let value: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let mut c = redis::cmd("SET");
            c.arg(key).arg(&value[..]);
            if let Some(ms) = px {
                c.arg("PX").arg(ms);
            }
            let mut ours = Vec::new();
            set_head(key, len, px, &mut ours);
            ours.extend_from_slice(&value);
            set_tail(px, &mut ours);
            assert_eq!(ours, c.get_packed_command());
        }
    }

    #[test]
    fn mset_frame_is_the_crates_packing() {
        for pairs in [
            vec![("k", 0)],
            vec![("kvoff:{ab:cd}:r0", 5), ("kvoff:{ab:ce}:r0", 33_864)],
            vec![("a", 1), ("b", 2), ("c", 70_000)],
        ] {
            let mut c = redis::cmd("MSET");
            let mut ours = Vec::new();
            mset_head(pairs.len(), &mut ours);
            for (i, &(key, len)) in pairs.iter().enumerate() {
                let value: Vec<u8> = (0..len).map(|j| ((i + j) % 251) as u8).collect();
                c.arg(key).arg(&value[..]);
                pair_head(key, len, &mut ours);
                ours.extend_from_slice(&value);
                ours.extend_from_slice(b"\r\n");
            }
            assert_eq!(ours, c.get_packed_command());
        }
    }

    /// A loopback "server" that sends `data` (in pieces of 997 bytes, 50 µs apart, when
    /// `trickle`) and then waits for the client to hang up; a [`Conn`] to it.
    pub(in crate::tier::remote) fn replies() -> Vec<Vec<u8>> {
        let mut huge = b"$1100000\r\n".to_vec();
        huge.extend((0..1_100_000).map(|i| (i % 253) as u8));
        huge.extend_from_slice(b"\r\n");
        let mut nested_big = b"*2\r\n:7\r\n$600000\r\n".to_vec();
        nested_big.extend((0..600_000).map(|i| (i % 247) as u8));
        nested_big.extend_from_slice(b"\r\n");
        let mut big = b"$70000\r\n".to_vec();
        big.extend((0..70_000).map(|i| (i % 251) as u8));
        big.extend_from_slice(b"\r\n");
        let mut mget = b"*4\r\n".to_vec();
        mget.extend_from_slice(&big);
        mget.extend_from_slice(b"$-1\r\n$5\r\nhello\r\n");
        mget.extend_from_slice(&big);
        vec![
            mget,
            b"+OK\r\n".to_vec(),
            b"+PONG\r\n".to_vec(),
            b"-MOVED 3999 127.0.0.1:6381\r\n".to_vec(),
            b"-ERR wrong\r\n".to_vec(),
            b":42\r\n".to_vec(),
            b"$-1\r\n".to_vec(),
            b"$0\r\n\r\n".to_vec(),
            b"$5\r\nhe\r\no\r\n".to_vec(),
            big,
            b"*2\r\n$1\r\n0\r\n*2\r\n$3\r\nabc\r\n$-1\r\n".to_vec(),
            huge,
            nested_big,
            b"*-1\r\n".to_vec(),
            b"*0\r\n".to_vec(),
            b"*1\r\n*3\r\n:0\r\n:5460\r\n*3\r\n$9\r\n127.0.0.1\r\n:7000\r\n$2\r\nid\r\n".to_vec(),
        ]
    }

    #[test]
    fn extent_finds_every_reply_and_waits_for_partial_ones() {
        for r in replies() {
            assert_eq!(extent(&r, 0).unwrap(), Some(r.len()), "{r:?}");
            for cut in [1, r.len() / 2, r.len() - 1] {
                assert_eq!(extent(&r[..cut], 0).unwrap(), None, "{cut} of {r:?}");
            }
            let mut two = r.clone();
            two.extend_from_slice(b":1\r\n");
            assert_eq!(extent(&two, 0).unwrap(), Some(r.len()));
        }
        assert!(extent(b"%1\r\n", 0).is_err());
        // An absurd length is an error, never an allocation.
        assert!(bulk_header(b"$99999999999999\r\n").is_err());
        assert!(extent(b"*1\r\n$99999999999999\r\n", 0).is_err());
        assert!(extent(b"*x\r\n", 0).is_err());
    }
}
