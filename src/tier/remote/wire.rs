//! The shapes of the remote tier's commands on the wire (docs/design.md "The data path"): reads
//! whose payloads go from the socket straight into host blocks (`BlockRead`, `BlockMget`), an
//! `MGET` into buffers (`Mget`), and writes packed straight from host memory (`BlockWrite`), each
//! a `route::Pack` the router sends.
#![forbid(unsafe_code)]

use super::conn::{BufPool, Conn};
use super::plain::{Head, Next, Plain};
use super::resp::{mset_head, pair_head, set_head, set_tail};
use super::route::{Pack, DIRECT_SEND_BYTES};
use super::shared::Shared;
use super::VALUE_HEADER_BYTES;

use crate::key::ByteKey;
use crate::manager::BlockId;
use crate::tier::format;

/// A `GET` of one value whose payload is read from the socket straight into its (pending) host
/// block, checksummed there while it is still in the CPU's caches (see `Shared::run_reads`);
/// the reply the batch sees is the value's header alone. Over a connection kvoff does not read
/// itself (TLS), or for a reply of another length, the whole value is read as usual.
pub(super) struct BlockRead<'a> {
    pub(super) sh: &'a Shared,
    pub(super) block: BlockId,
    /// The payload went into the block, with this checksum.
    pub(super) split: std::cell::Cell<Option<u64>>,
}

impl Pack for BlockRead<'_> {
    fn pack(&self, key: &str, _c: &mut Conn, packed: &mut Vec<u8>) -> Result<(), String> {
        redis::cmd("GET").arg(key).write_packed_command(packed);
        Ok(())
    }

    fn recv(&self, c: &mut Conn, pool: Option<&BufPool>) -> Result<redis::Value, String> {
        self.split.set(None);
        let (v, split) = read_into_block(self.sh, c.plain(), self.block, pool)?;
        self.split.set(split);
        Ok(v)
    }
}

/// Reads the next reply of `p`: a bulk string of a whole value (`value_len` bytes) has its header
/// returned and its payload read straight into `block`, with the payload's checksum; any other
/// reply is read as usual (no checksum).
fn read_into_block(
    sh: &Shared,
    p: &mut Plain,
    block: BlockId,
    pool: Option<&BufPool>,
) -> Result<(redis::Value, Option<u64>), String> {
    if p.peek()? != Next::Bulk(sh.value_len) {
        return Ok((p.recv(pool)?, None));
    }
    p.take_bulk_header()?;
    let mut head = vec![0u8; VALUE_HEADER_BYTES];
    p.read_body(&mut head)?;
    let mut io = Ok(());
    let mut sum = 0;
    let mut read = false;
    let placed = sh.memory.with_block_mut(block, &mut |dst| {
        if dst.len() != sh.payload_len {
            return false;
        }
        read = true;
        // The checksum follows the bytes in (docs/design.md "The data path"); equal to
        // `format::payload_sum` of the whole payload (xxh3-64, streamed).
        let mut h = crate::tier::format::PayloadSum::new();
        io = p.read_body_summed(dst, Some(&mut h));
        if io.is_ok() {
            sum = h.digest();
        }
        io.is_ok()
    });
    io?;
    if !read {
        // The block could not take the payload: read it past (the stream stays in step).
        let mut scratch = vec![0u8; sh.payload_len];
        p.read_body(&mut scratch)?;
    }
    p.read_crlf()?;
    if !read || placed.is_err() {
        // The block could not take it (out of range): a nil reply, a failed promotion.
        return Ok((redis::Value::Nil, None));
    }
    Ok((redis::Value::BulkString(head), Some(sum)))
}

/// An `MGET` of the values of `blocks`' keys whose payloads are read from the socket each
/// straight into its (pending) host block, as [`BlockRead`] reads one: the reply is the array of
/// the values' headers (or of whole values, over a connection kvoff does not read itself).
pub(super) struct BlockMget<'a> {
    pub(super) sh: &'a Shared,
    pub(super) cmd: redis::Cmd,
    pub(super) blocks: Vec<BlockId>,
    /// Per value: its payload went into its block, with this checksum.
    pub(super) splits: Vec<std::cell::Cell<Option<u64>>>,
}

impl Pack for BlockMget<'_> {
    fn pack(&self, _key: &str, _c: &mut Conn, packed: &mut Vec<u8>) -> Result<(), String> {
        self.cmd.write_packed_command(packed);
        Ok(())
    }

    fn recv(&self, c: &mut Conn, pool: Option<&BufPool>) -> Result<redis::Value, String> {
        for s in &self.splits {
            s.set(None);
        }
        let n = self.blocks.len();
        let p = c.plain();
        match p.array_header(n)? {
            Head::Array(m) if m == n => {
                let mut out = Vec::with_capacity(n);
                for (block, split) in self.blocks.iter().zip(&self.splits) {
                    let (v, sum) = read_into_block(self.sh, p, *block, pool)?;
                    split.set(sum);
                    out.push(v);
                }
                Ok(redis::Value::Array(out))
            }
            Head::Array(m) => {
                // Fewer values than keys: read them past (the caller fails the command).
                let mut out = Vec::with_capacity(m);
                for _ in 0..m {
                    out.push(p.recv(pool)?);
                }
                Ok(redis::Value::Array(out))
            }
            Head::NilArray => Ok(redis::Value::Nil),
            Head::Other => p.recv(pool),
        }
    }
}

/// The answer [`HeaderGet`] gives for a key that holds an empty string: no value's header, a
/// rejected value (docs/tier.md "Values").
pub(super) const EMPTY_VALUE: &str = "an empty string";

/// A fetch of a value's header alone (values of 256 KiB and more): `GETRANGE key 0 1095`, then
/// `EXISTS key`, in the same pipeline. `GETRANGE` answers an empty string for a missing key and
/// for a key holding one (another client wrote "" over a value); `EXISTS` tells them apart, so an
/// empty value is a rejected value (counted, deleted) like any other value shorter than its
/// header, rather than a miss. The reply is `GETRANGE`'s, or `SimpleString(EMPTY_VALUE)`.
pub(super) struct HeaderGet;

impl Pack for HeaderGet {
    fn pack(&self, key: &str, _c: &mut Conn, packed: &mut Vec<u8>) -> Result<(), String> {
        redis::cmd("GETRANGE")
            .arg(key)
            .arg(0)
            .arg(VALUE_HEADER_BYTES - 1)
            .write_packed_command(packed);
        redis::cmd("EXISTS").arg(key).write_packed_command(packed);
        Ok(())
    }

    fn recv(&self, c: &mut Conn, pool: Option<&BufPool>) -> Result<redis::Value, String> {
        let v = c.recv(pool)?;
        let exists = c.recv(None)?;
        Ok(match (v, exists) {
            (redis::Value::BulkString(b), redis::Value::Int(1)) if b.is_empty() => {
                redis::Value::SimpleString(EMPTY_VALUE.to_owned())
            }
            // An error of `EXISTS` (an `ASK`ed `GETRANGE`: the `ASKING` covered only it) leaves
            // `GETRANGE`'s answer as it is.
            (v, _) => v,
        })
    }
}

/// An `MGET` of `.1` keys, whose values are read from the socket each into a buffer of its own
/// ([`Conn::recv_array`]).
pub(super) struct Mget(pub(super) redis::Cmd, pub(super) usize);

impl Pack for Mget {
    fn pack(&self, _key: &str, _c: &mut Conn, packed: &mut Vec<u8>) -> Result<(), String> {
        self.0.write_packed_command(packed);
        Ok(())
    }

    fn recv(&self, c: &mut Conn, pool: Option<&BufPool>) -> Result<redis::Value, String> {
        c.recv_array(pool, self.1)
    }
}

/// A write of block values, packed straight from host memory (see `Shared::run_writes`): a
/// `SET` (with `PX` for a TTL) of one value, or an `MSET` of several (each below
/// `DIRECT_SEND_BYTES`: packed whole before it is sent).
pub(super) struct BlockWrite<'a> {
    pub(super) sh: &'a Shared,
    pub(super) parts: Vec<WritePart<'a>>,
    pub(super) px: Option<u64>,
}

/// One value of a [`BlockWrite`].
pub(super) struct WritePart<'a> {
    pub(super) key: &'a ByteKey,
    pub(super) rkey: String,
    pub(super) block: BlockId,
    /// The payload's checksum where an idle thread computed it ahead (`Shared::sum_ahead`).
    pub(super) sum: Option<u64>,
    /// The value could not be built (the block unreadable, the header not encodable): it is left
    /// out of its command (a `PING` goes in place of a command left with none), and the write
    /// counts as failed.
    pub(super) failed: std::cell::Cell<bool>,
}

impl BlockWrite<'_> {
    /// Reads `part`'s block and hands its header and payload to `f`; false (and `f` not called)
    /// when the value cannot be built.
    fn build(&self, part: &WritePart<'_>, f: &mut dyn FnMut(&[u8], &[u8])) -> bool {
        let mut h = self.sh.expect_header(part.key);
        let mut header = [0u8; VALUE_HEADER_BYTES];
        let mut built = false;
        let read = self.sh.memory.with_block(part.block, &mut |payload| {
            h.payload_sum = part.sum.unwrap_or_else(|| format::payload_sum(payload));
            if format::encode_sized(&h, &mut header, VALUE_HEADER_BYTES) {
                built = true;
                f(&header, payload);
            }
        });
        read.is_ok() && built
    }

    /// Packs the `MSET` of the parts that can be built (each value whole into `packed`); a part
    /// that cannot is marked failed and the command packed again without it.
    fn pack_mset(&self, packed: &mut Vec<u8>) {
        let start = packed.len();
        'again: loop {
            packed.truncate(start);
            let live = self.parts.iter().filter(|p| !p.failed.get()).count();
            if live == 0 {
                redis::cmd("PING").write_packed_command(packed);
                return;
            }
            mset_head(live, packed);
            for part in self.parts.iter().filter(|p| !p.failed.get()) {
                let built = self.build(part, &mut |header, payload| {
                    pair_head(&part.rkey, header.len() + payload.len(), packed);
                    packed.extend_from_slice(header);
                    packed.extend_from_slice(payload);
                    packed.extend_from_slice(b"\r\n");
                });
                if !built {
                    part.failed.set(true);
                    continue 'again;
                }
            }
            return;
        }
    }
}

impl Pack for BlockWrite<'_> {
    fn pack(&self, key: &str, c: &mut Conn, packed: &mut Vec<u8>) -> Result<(), String> {
        if self.parts.len() > 1 {
            self.pack_mset(packed);
            return Ok(());
        }
        let part = &self.parts[0];
        let mut sent = Ok(());
        let built = self.build(part, &mut |header, payload| {
            set_head(key, header.len() + payload.len(), self.px, packed);
            packed.extend_from_slice(header);
            if payload.len() >= DIRECT_SEND_BYTES {
                sent = c.send(packed).and_then(|()| {
                    packed.clear();
                    c.send(payload)
                });
            } else {
                packed.extend_from_slice(payload);
            }
            set_tail(self.px, packed);
        });
        if !built {
            // Keeps the pipeline's replies in step with its commands.
            part.failed.set(true);
            redis::cmd("PING").write_packed_command(packed);
        }
        sent
    }
}
