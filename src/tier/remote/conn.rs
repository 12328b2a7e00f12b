//! One connection of the remote tier to one Redis/Valkey node (docs/design.md "Remote tier
//! client", "The data path").
//!
//! Every node, `redis://` (TCP) or `rediss://` (TLS, rustls driven by the `link` module), gets
//! kvoff's own connection: kvoff opens the socket (connect timeout, `TCP_NODELAY`, read/write
//! timeouts), makes the TLS handshake, authenticates with `AUTH` and selects the URL's database;
//! every command is packed by the `redis` crate ([`redis::Cmd`]) and every reply that is not a bulk
//! string is parsed by the crate ([`redis::parse_redis_value`]) once kvoff's reader has found where
//! it ends. Only a bulk string reply (`$<length>\r\n<bytes>\r\n`, a `GET`'s value) is read by kvoff
//! itself, straight from the socket (or the decrypted record) into the value's own buffer: the
//! crate's synchronous parser reads in 8 KiB steps, zeroes each step, compacts its buffer and
//! copies the value out, six passes over every byte of a load where this takes one (the kernel's
//! copy). Every read and write checks the exchange's deadline, on TCP and TLS alike.
//!
//! The reader of a plain connection is in the `plain` module; the framing kvoff writes or reads
//! itself (a `SET`'s header and trailer around its value, a bulk string reply's header, the extent
//! of other replies) in `resp`, checked byte for byte against the crate's own packer and parser by
//! its unit tests. The tests below read replies through a loopback "server".
#![forbid(unsafe_code)]

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::plain::{Plain, POOLED_BYTES};

/// Most bytes of a reply that is not a bulk string at the top (a `CLUSTER SLOTS` map, a `SCAN`
/// page): a reply past this is an error (the connection is dropped).
pub(super) const MAX_SMALL_REPLY: usize = 16 << 20;
/// The `max_bulk` of the connections of a tier whose values are `value_len` bytes
/// ([`Conn::open`]): its values, and any other reply up to `MAX_SMALL_REPLY`.
pub(super) fn max_bulk_for(value_len: usize) -> usize {
    value_len.max(MAX_SMALL_REPLY)
}

/// Buffers of values, handed back once a value is in host memory and reused for the next bulk
/// string reply: a load then writes into memory that is already mapped (a fresh buffer of a
/// large value costs a page fault per 4 KiB page inside the kernel's copy).
pub(super) struct BufPool {
    bufs: Mutex<(Vec<Vec<u8>>, usize)>,
    max_bytes: usize,
}

impl BufPool {
    pub(super) fn new(max_bytes: usize) -> Self {
        Self {
            bufs: Mutex::new((Vec::new(), 0)),
            max_bytes,
        }
    }

    /// A buffer of `len` bytes (their contents are to be overwritten).
    pub(super) fn take(&self, len: usize) -> Vec<u8> {
        let got = {
            let mut g = self.bufs.lock().unwrap_or_else(PoisonError::into_inner);
            let v = g.0.pop();
            if let Some(v) = &v {
                g.1 -= v.capacity();
            }
            v
        };
        match got {
            Some(mut v) => {
                if v.len() != len {
                    v.clear();
                    v.resize(len, 0);
                }
                v
            }
            None => vec![0; len],
        }
    }

    /// Hands a buffer back (dropped when the pool holds `max_bytes` already).
    pub(super) fn give(&self, v: Vec<u8>) {
        if v.capacity() < POOLED_BYTES {
            return;
        }
        let mut g = self.bufs.lock().unwrap_or_else(PoisonError::into_inner);
        if g.1 + v.capacity() <= self.max_bytes {
            g.1 += v.capacity();
            g.0.push(v);
        }
    }
}

/// A connection (see the module docs).
pub(super) struct Conn(Box<Plain>);

impl Conn {
    /// Opens a connection to `info` within `connect_timeout` (a `rediss://` node over TLS with
    /// `tls`, which the URL's parse built), with `io_timeout` on every read and write after it.
    /// A bulk string reply longer than `max_bulk` bytes (at the top of a reply, or an array's
    /// element read by [`Conn::recv_array`]) is read past without being kept, and stands as an
    /// empty string: where a value of a known length was asked for, a reply that is not one
    /// (another client's value under the key) costs no allocation of its length, only its read.
    pub(super) fn open(
        info: &redis::ConnectionInfo,
        tls: Option<&std::sync::Arc<rustls::ClientConfig>>,
        connect_timeout: Duration,
        io_timeout: Duration,
        max_bulk: usize,
    ) -> Result<Self, String> {
        let (host, port, tls) = match info.addr() {
            redis::ConnectionAddr::Tcp(host, port) => (host, *port, None),
            redis::ConnectionAddr::TcpTls { host, port, .. } => (
                host,
                *port,
                Some(tls.ok_or("connecting: a rediss:// node without a TLS configuration")?),
            ),
            _ => return Err("connecting: not a TCP node".to_owned()),
        };
        Plain::open(info, host, port, tls, connect_timeout, io_timeout, max_bulk)
            .map(|p| Self(Box::new(p)))
    }

    /// kvoff's reader of the connection (the reads straight into host blocks: `wire`).
    pub(super) fn plain(&mut self) -> &mut Plain {
        &mut self.0
    }

    /// Writes `bytes` (packed commands, or part of one) to the socket.
    pub(super) fn send(&mut self, bytes: &[u8]) -> Result<(), String> {
        self.0.send(bytes)
    }

    /// Sets when the exchange under way (a node's pipeline written, or its replies read; one
    /// command and its reply) must end: every read and write checks it, so a server that sends a
    /// reply byte by byte fails it at the deadline (docs/tier.md "Faults").
    pub(super) fn set_deadline(&mut self, deadline: Instant) {
        self.0.set_deadline(Some(deadline));
    }

    /// Reads one reply (a server error reply is a value, not a failure); a large bulk string
    /// reply goes into a buffer from `pool`.
    pub(super) fn recv(&mut self, pool: Option<&BufPool>) -> Result<redis::Value, String> {
        self.0.recv(pool)
    }

    /// Reads one reply like [`Conn::recv`], where an array reply's bulk strings (an `MGET`'s
    /// values) are each read as [`Conn::recv`] reads a bulk string reply: from the socket
    /// straight into a buffer of their own. An array of more than `max` elements is an error (the
    /// connection is then dropped): a broken or hostile stream, never an allocation.
    pub(super) fn recv_array(
        &mut self,
        pool: Option<&BufPool>,
        max: usize,
    ) -> Result<redis::Value, String> {
        self.0.recv_array(pool, max)
    }

    /// One command and its reply, within `io_timeout` in all.
    pub(super) fn request(
        &mut self,
        cmd: &redis::Cmd,
        io_timeout: Duration,
    ) -> Result<redis::Value, String> {
        self.set_deadline(Instant::now() + io_timeout);
        self.send(&cmd.get_packed_command())?;
        self.recv(None)
    }
}

#[cfg(test)]
#[allow(clippy::pedantic)] // tests: style lints are for the library
mod tests {
    use std::io::{Read, Write};

    use super::*;
    use crate::tier::remote::resp::tests::replies;
    use crate::tier::remote::resp::MAX_BULK_BYTES;

    fn serve(data: Vec<u8>, trickle: bool) -> (Conn, std::thread::JoinHandle<()>) {
        serve_max(data, trickle, MAX_BULK_BYTES)
    }

    /// [`serve`] with bulk strings of at most `max_bulk` bytes kept.
    fn serve_max(
        data: Vec<u8>,
        trickle: bool,
        max_bulk: usize,
    ) -> (Conn, std::thread::JoinHandle<()>) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            if trickle {
                s.set_nodelay(true).unwrap();
                for chunk in data.chunks(997) {
                    s.write_all(chunk).unwrap();
                    std::thread::sleep(Duration::from_micros(50));
                }
            } else {
                s.write_all(&data).unwrap();
            }
            let mut sink = [0u8; 1];
            let _ = s.read(&mut sink);
        });
        let info = redis::IntoConnectionInfo::into_connection_info(
            format!("redis://127.0.0.1:{port}").as_str(),
        )
        .unwrap();
        let c = Conn::open(
            &info,
            None,
            Duration::from_secs(5),
            Duration::from_secs(5),
            max_bulk,
        )
        .unwrap();
        (c, server)
    }

    /// A bulk string longer than the connection keeps is read past (whole, in pieces too) and
    /// stands as an empty string; the replies after it are read in step, within an array too.
    #[test]
    fn bulk_strings_over_the_cap_are_read_past() {
        for trickle in [false, true] {
            let mut data = b"$700000\r\n".to_vec();
            data.extend((0..700_000).map(|i| (i % 241) as u8));
            data.extend_from_slice(b"\r\n$3\r\nabc\r\n*2\r\n$5000\r\n");
            data.extend(std::iter::repeat_n(b'x', 5000));
            data.extend_from_slice(b"\r\n$2\r\nok\r\n+PONG\r\n");
            let (mut c, server) = serve_max(data, trickle, 4096);
            let bulk = |v: &[u8]| redis::Value::BulkString(v.to_vec());
            assert_eq!(c.recv(None).unwrap(), bulk(b""));
            assert_eq!(c.recv(None).unwrap(), bulk(b"abc"));
            assert_eq!(
                c.recv_array(None, 2).unwrap(),
                redis::Value::Array(vec![bulk(b""), bulk(b"ok")])
            );
            assert_eq!(
                c.recv(None).unwrap(),
                redis::Value::SimpleString("PONG".into())
            );
            drop(c);
            server.join().unwrap();
        }
    }

    /// How values are read: a value's body goes from the socket into its own buffer (only headers
    /// and CRLFs pass through the read buffer), and a value over the cap is read past in reads of
    /// the whole read buffer, not of a header's size.
    #[test]
    fn bodies_bypass_the_read_buffer_and_skips_take_big_reads() {
        let mut data = Vec::new();
        for i in 0..4u8 {
            data.extend_from_slice(b"$1000000\r\n");
            data.extend(std::iter::repeat_n(i, 1_000_000));
            data.extend_from_slice(b"\r\n");
        }
        data.extend_from_slice(b"$16777216\r\n");
        data.extend(std::iter::repeat_n(9u8, 16 << 20));
        data.extend_from_slice(b"\r\n+PONG\r\n");
        let (mut c, server) = serve_max(data, false, 1 << 20);
        let stats = |c: &Conn| c.0.stats;
        for i in 0..4u8 {
            assert_eq!(
                c.recv(None).unwrap(),
                redis::Value::BulkString(vec![i; 1_000_000])
            );
        }
        let (reads, buffered) = stats(&c);
        assert!(
            buffered < 4096,
            "{buffered} bytes of 4 values of 1 MB went through the read buffer"
        );
        assert_eq!(c.recv(None).unwrap(), redis::Value::BulkString(Vec::new()));
        assert_eq!(
            c.recv(None).unwrap(),
            redis::Value::SimpleString("PONG".into())
        );
        let skip_reads = stats(&c).0 - reads;
        assert!(skip_reads < 2048, "{skip_reads} reads to read past 16 MiB");
        drop(c);
        server.join().unwrap();
    }

    /// A body read with its checksum streamed (`read_body_summed`: the checksum a promotion
    /// checks) sums to the one-shot xxh3-64 of the same bytes, whether they came in one piece,
    /// in small pieces, or partly through the read buffer.
    #[test]
    fn streamed_checksum_equals_the_one_shot_sum() {
        let body: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        for trickle in [false, true] {
            let mut data = format!("${}\r\n", body.len()).into_bytes();
            data.extend_from_slice(&body);
            data.extend_from_slice(b"\r\n");
            let (mut c, server) = serve(data, trickle);
            let p = c.plain();
            assert_eq!(
                p.peek().unwrap(),
                super::super::plain::Next::Bulk(body.len())
            );
            p.take_bulk_header().unwrap();
            let mut dst = vec![0u8; body.len()];
            let mut h = crate::tier::format::PayloadSum::new();
            p.read_body_summed(&mut dst, Some(&mut h)).unwrap();
            p.read_crlf().unwrap();
            assert_eq!(dst, body);
            assert_eq!(
                h.digest(),
                xxhash_rust::xxh3::xxh3_64(&body),
                "trickle {trickle}"
            );
            drop(c);
            server.join().unwrap();
        }
    }

    /// An array reply longer than asked is an error, not a value.
    #[test]
    fn array_reply_longer_than_asked_is_an_error() {
        let (mut c, server) = serve(b"*1000000000\r\n$1\r\na\r\n".to_vec(), false);
        let e = c.recv_array(None, 8).unwrap_err();
        assert!(e.contains("1000000000 elements"), "{e}");
        drop(c);
        server.join().unwrap();
    }

    /// Replies served by a loopback "server" thread in small pieces and all at once: the
    /// reader's values, read by `recv` and by `recv_array`, equal the crate's parse of the same
    /// bytes.
    #[test]
    fn plain_reader_agrees_with_the_crate() {
        let mut all = Vec::new();
        let mut expect = Vec::new();
        for r in replies() {
            expect.push(redis::parse_redis_value(&r).unwrap());
            all.extend_from_slice(&r);
        }
        for (trickle, array) in [(false, false), (true, false), (false, true), (true, true)] {
            let (mut c, server) = serve(all.clone(), trickle);
            let pool = BufPool::new(4 << 20);
            pool.give(vec![7; 1 << 20]);
            for e in &expect {
                let got = if array {
                    c.recv_array(Some(&pool), 4)
                } else {
                    c.recv(Some(&pool))
                };
                assert_eq!(&got.unwrap(), e);
            }
            drop(c);
            server.join().unwrap();
        }
    }
}
