//! One connection of the remote tier to one Redis/Valkey node (docs/design.md "Remote tier
//! client", "The data path").
//!
//! A `redis://` (plain TCP) node gets a [`Conn::Plain`]: kvoff opens the socket (connect timeout,
//! `TCP_NODELAY`, read/write timeouts), authenticates with `AUTH` and selects the URL's database;
//! every command is packed by the `redis` crate ([`redis::Cmd`]) and every reply that is not a bulk
//! string is parsed by the crate ([`redis::parse_redis_value`]) once kvoff's reader has found where
//! it ends. Only a bulk string reply (`$<length>\r\n<bytes>\r\n`, a `GET`'s value) is read by kvoff
//! itself, straight from the socket into the value's own buffer: the crate's synchronous parser
//! reads in 8 KiB steps, zeroes each step, compacts its buffer and copies the value out, six passes
//! over every byte of a load where this takes one (the kernel's copy). A `rediss://` (TLS) or Unix
//! socket node keeps the crate's own [`redis::Connection`] (TLS set up by the crate; its cost is
//! the cipher, not the parser).
//!
//! The framing kvoff writes or reads itself — a `SET`'s header and trailer around its value
//! ([`set_head`]), a bulk string reply's header, the extent of other replies — is checked byte for
//! byte against the crate's own packer and parser by the unit tests below.
#![forbid(unsafe_code)]

use std::io::{ErrorKind, IoSliceMut, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Most bytes of a reply that is not a bulk string at the top (a `CLUSTER SLOTS` map, a `SCAN`
/// page): a reply past this is an error (the connection is dropped).
const MAX_SMALL_REPLY: usize = 16 << 20;
/// Most bytes of a bulk string reply: Redis's own limit on a string (`proto-max-bulk-len`,
/// 512 MB). A longer length is a broken or hostile stream: an error, never an allocation.
const MAX_BULK_BYTES: usize = 512 << 20;
/// The `max_bulk` of the connections of a tier whose values are `value_len` bytes
/// ([`Conn::open`]): its values, and any other reply up to `MAX_SMALL_REPLY`.
pub(super) fn max_bulk_for(value_len: usize) -> usize {
    value_len.max(MAX_SMALL_REPLY)
}

/// Most nested levels of an array reply.
const MAX_DEPTH: usize = 16;
/// The read buffer's size: replies of this size or less arrive in one `read` when the server has
/// sent them.
const READ_CHUNK: usize = 256 << 10;
/// Most bytes a read takes into the read buffer where the next bytes may start a bulk string
/// (a reply's first bytes, an array's header, the CRLF after a value), and behind a value's body
/// (the next value's header): a value's body is then read from the socket straight into its own
/// buffer or host block, not into the read buffer and copied out of it (docs/design.md "The data
/// path"). 64 bytes hold a CRLF, an array header and a bulk string header.
const HEAD_READ: usize = 64;

/// Bulk string replies at least this large get their buffer from a [`BufPool`].
const POOLED_BYTES: usize = 16 << 10;

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
    fn take(&self, len: usize) -> Vec<u8> {
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

/// A connection: kvoff's own over plain TCP, or the crate's (TLS, Unix sockets).
pub(super) enum Conn {
    Plain(Box<Plain>),
    Crate(Box<redis::Connection>),
}

/// A plain TCP connection with its read buffer (`buf[start..end]` is read and not yet parsed).
pub(super) struct Plain {
    sock: TcpStream,
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// Most bytes of a top-level bulk string reply kept (see [`Conn::open`]).
    max_bulk: usize,
    /// Reads made, and the bytes they put into the read buffer (tests: how a reply was read).
    #[cfg(test)]
    stats: (usize, usize),
}

fn io_err(e: &std::io::Error) -> String {
    match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => "timed out".to_owned(),
        _ => e.to_string(),
    }
}

impl Conn {
    /// Opens a connection to `info` within `connect_timeout`, with `io_timeout` on every read and
    /// write after it. On kvoff's own connections (`redis://`), a bulk string reply longer than
    /// `max_bulk` bytes (at the top of a reply, or an array's element read by
    /// [`Conn::recv_array`]) is read past without being kept, and stands as an empty string:
    /// where a value of a known length was asked for, a reply that is not one (another client's
    /// value under the key) costs no allocation of its length, only its read.
    pub(super) fn open(
        info: redis::ConnectionInfo,
        connect_timeout: Duration,
        io_timeout: Duration,
        max_bulk: usize,
    ) -> Result<Self, String> {
        if let redis::ConnectionAddr::Tcp(host, port) = info.addr() {
            return Plain::open(&info, host, *port, connect_timeout, io_timeout, max_bulk)
                .map(|p| Self::Plain(Box::new(p)));
        }
        let c = redis::Client::open(info)
            .and_then(|cl| cl.get_connection_with_timeout(connect_timeout))
            .and_then(|c| {
                c.set_read_timeout(Some(io_timeout))?;
                c.set_write_timeout(Some(io_timeout))?;
                Ok(c)
            })
            .map_err(|e| format!("connecting: {e}"))?;
        Ok(Self::Crate(Box::new(c)))
    }

    /// Writes `bytes` (packed commands, or part of one) to the socket.
    pub(super) fn send(&mut self, bytes: &[u8]) -> Result<(), String> {
        match self {
            Self::Plain(p) => p.sock.write_all(bytes).map_err(|e| io_err(&e)),
            Self::Crate(c) => c.send_packed_command(bytes).map_err(|e| e.to_string()),
        }
    }

    /// Reads one reply (a server error reply is a value, not a failure); a large bulk string
    /// reply goes into a buffer from `pool`.
    pub(super) fn recv(&mut self, pool: Option<&BufPool>) -> Result<redis::Value, String> {
        match self {
            Self::Plain(p) => p.recv(pool),
            Self::Crate(c) => c.recv_response().map_err(|e| e.to_string()),
        }
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
        match self {
            Self::Plain(p) => p.recv_array(pool, max),
            Self::Crate(c) => c.recv_response().map_err(|e| e.to_string()),
        }
    }

    /// One command and its reply.
    pub(super) fn request(&mut self, cmd: &redis::Cmd) -> Result<redis::Value, String> {
        self.send(&cmd.get_packed_command())?;
        self.recv(None)
    }
}

impl Plain {
    fn open(
        info: &redis::ConnectionInfo,
        host: &str,
        port: u16,
        connect_timeout: Duration,
        io_timeout: Duration,
        max_bulk: usize,
    ) -> Result<Self, String> {
        let t0 = Instant::now();
        let addrs = (host, port)
            .to_socket_addrs()
            .map_err(|e| format!("connecting: resolving {host}: {e}"))?;
        let mut last = format!("connecting: {host} resolves to no address");
        let mut sock = None;
        for a in addrs {
            let left = connect_timeout.saturating_sub(t0.elapsed());
            if left.is_zero() {
                "connecting: timed out".clone_into(&mut last);
                break;
            }
            match TcpStream::connect_timeout(&a, left) {
                Ok(s) => {
                    sock = Some(s);
                    break;
                }
                Err(e) => last = format!("connecting: {}", io_err(&e)),
            }
        }
        let sock = sock.ok_or(last)?;
        let setup = |s: &TcpStream| -> std::io::Result<()> {
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(io_timeout))?;
            s.set_write_timeout(Some(io_timeout))
        };
        setup(&sock).map_err(|e| format!("connecting: {}", io_err(&e)))?;
        let mut p = Self {
            sock,
            buf: vec![0; READ_CHUNK],
            start: 0,
            end: 0,
            max_bulk,
            #[cfg(test)]
            stats: (0, 0),
        };
        let settings = info.redis_settings();
        if let Some(pw) = settings.password() {
            let mut auth = redis::cmd("AUTH");
            if let Some(user) = settings.username() {
                auth.arg(user);
            }
            auth.arg(pw);
            p.expect_ok(&auth, "AUTH")?;
        }
        if settings.db() != 0 {
            p.expect_ok(redis::cmd("SELECT").arg(settings.db()), "SELECT")?;
        }
        Ok(p)
    }

    /// Sends a setup command and fails unless the server answers `OK` (the message never holds the
    /// command's arguments: `AUTH`'s is a password).
    fn expect_ok(&mut self, cmd: &redis::Cmd, name: &str) -> Result<(), String> {
        self.sock
            .write_all(&cmd.get_packed_command())
            .map_err(|e| format!("connecting: {name}: {}", io_err(&e)))?;
        match self.recv(None) {
            Ok(redis::Value::Okay) => Ok(()),
            Ok(redis::Value::ServerError(e)) => Err(format!(
                "connecting: {name}: {} {}",
                e.code(),
                e.details().unwrap_or("")
            )),
            Ok(v) => Err(format!("connecting: {name} answered {v:?}")),
            Err(e) => Err(format!("connecting: {name}: {e}")),
        }
    }

    /// Reads more bytes into the buffer (moving what is unparsed to its front, growing it up to
    /// `MAX_SMALL_REPLY` when one reply needs more), at most [`HEAD_READ`] bytes where a bulk
    /// string's header may come next (`head`).
    fn fill_at(&mut self, head: bool) -> Result<(), String> {
        if self.end == self.buf.len() {
            if self.start > 0 {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            } else if self.buf.len() < MAX_SMALL_REPLY {
                let n = (self.buf.len() * 2).min(MAX_SMALL_REPLY);
                self.buf.resize(n, 0);
            } else {
                return Err(format!("a reply over {MAX_SMALL_REPLY} bytes"));
            }
        }
        let stop = if head {
            (self.end + HEAD_READ).min(self.buf.len())
        } else {
            self.buf.len()
        };
        match self.sock.read(&mut self.buf[self.end..stop]) {
            Ok(0) => Err("connection closed by the server".to_owned()),
            Ok(n) => {
                #[cfg(test)]
                {
                    self.stats.0 += 1;
                    self.stats.1 += n;
                }
                self.end += n;
                Ok(())
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => Ok(()),
            Err(e) => Err(io_err(&e)),
        }
    }

    /// Reads one reply (see [`Conn::recv`]).
    pub(super) fn recv(&mut self, pool: Option<&BufPool>) -> Result<redis::Value, String> {
        loop {
            let avail = &self.buf[self.start..self.end];
            if avail.first() == Some(&b'$') {
                if let Some((len, head)) = bulk_header(avail)? {
                    return self.recv_bulk(len, head, pool);
                }
            } else if let Some(n) = extent(avail, 0)? {
                let v = redis::parse_redis_value(&avail[..n]).map_err(|e| e.to_string())?;
                self.start += n;
                if self.start == self.end {
                    (self.start, self.end) = (0, 0);
                }
                return Ok(v);
            }
            // Nothing read yet, or a bulk string's header: it may be a value's.
            let head = avail.first().is_none_or(|&b| b == b'$');
            self.fill_at(head)?;
        }
    }

    /// See [`Conn::recv_array`]. Only the top level is read this way: an array inside an
    /// element is parsed whole (bounded by `MAX_SMALL_REPLY` and `MAX_DEPTH`).
    fn recv_array(&mut self, pool: Option<&BufPool>, max: usize) -> Result<redis::Value, String> {
        match self.array_header(max)? {
            Head::Array(n) => {
                let mut out = Vec::with_capacity(n);
                for _ in 0..n {
                    out.push(self.recv(pool)?);
                }
                Ok(redis::Value::Array(out))
            }
            Head::NilArray => Ok(redis::Value::Nil),
            Head::Other => self.recv(pool),
        }
    }

    /// Consumes the header of the next reply if it is an array (its length; more than `max`
    /// elements is an error, see [`Conn::recv_array`]); another reply is left unread.
    pub(super) fn array_header(&mut self, max: usize) -> Result<Head, String> {
        loop {
            let avail = &self.buf[self.start..self.end];
            match avail.first() {
                Some(&b'*') => {
                    if let Some(end) = line_end(avail) {
                        let n = header_int(&avail[1..end - 2])?;
                        self.start += end;
                        if self.start == self.end {
                            (self.start, self.end) = (0, 0);
                        }
                        let Ok(n) = usize::try_from(n) else {
                            return Ok(Head::NilArray); // `*-1`
                        };
                        if n > max {
                            return Err(format!(
                                "an array reply of {n} elements where at most {max} were asked"
                            ));
                        }
                        return Ok(Head::Array(n));
                    }
                    if avail.len() > 32 {
                        return Err("an array reply with a header line over 32 bytes".to_owned());
                    }
                }
                Some(_) => return Ok(Head::Other),
                None => {}
            }
            self.fill_at(true)?;
        }
    }

    /// A bulk string reply whose header (`head` bytes) is in the buffer: its `len` bytes go into a
    /// buffer of their own (from `pool` when large), read from the socket directly once the read
    /// buffer is used up.
    fn recv_bulk(
        &mut self,
        len: Option<usize>,
        head: usize,
        pool: Option<&BufPool>,
    ) -> Result<redis::Value, String> {
        self.start += head;
        let Some(len) = len else {
            return Ok(redis::Value::Nil);
        };
        if len > self.max_bulk {
            self.skip_body(len)?;
            self.read_crlf()?;
            return Ok(redis::Value::BulkString(Vec::new()));
        }
        let mut out = match pool {
            Some(p) if len >= POOLED_BYTES => p.take(len),
            _ => vec![0u8; len],
        };
        self.read_body(&mut out)?;
        self.read_crlf()?;
        Ok(redis::Value::BulkString(out))
    }

    /// What the next reply is, once its header is read (nothing is consumed).
    pub(super) fn peek(&mut self) -> Result<Next, String> {
        loop {
            let avail = &self.buf[self.start..self.end];
            match avail.first() {
                None => {}
                Some(&b'$') => match bulk_header(avail)? {
                    Some((Some(len), _)) => return Ok(Next::Bulk(len)),
                    Some((None, _)) => return Ok(Next::Other),
                    None => {}
                },
                Some(_) => return Ok(Next::Other),
            }
            self.fill_at(true)?;
        }
    }

    /// Consumes the header of the bulk string reply [`Plain::peek`] found.
    pub(super) fn take_bulk_header(&mut self) -> Result<(), String> {
        let avail = &self.buf[self.start..self.end];
        let (_, head) = bulk_header(avail)?.ok_or("no bulk string header")?;
        self.start += head;
        Ok(())
    }

    /// Reads the next `dst.len()` bytes of the stream into `dst`: what the read buffer holds, the
    /// rest from the socket straight into `dst`, each read taking up to [`HEAD_READ`] bytes past
    /// `dst`'s end into the read buffer (the CRLF and the next value's header: no read of its
    /// own for them, and no more of the next value than its header).
    pub(super) fn read_body(&mut self, dst: &mut [u8]) -> Result<(), String> {
        let have = (self.end - self.start).min(dst.len());
        dst[..have].copy_from_slice(&self.buf[self.start..self.start + have]);
        self.start += have;
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        }
        let mut got = have;
        while got < dst.len() {
            // The read buffer is empty here: `have` took all of it, and a read only puts bytes
            // into it once `dst` is full.
            let tail = HEAD_READ.min(self.buf.len());
            let mut iov = [
                IoSliceMut::new(&mut dst[got..]),
                IoSliceMut::new(&mut self.buf[..tail]),
            ];
            match self.sock.read_vectored(&mut iov) {
                Ok(0) => return Err("connection closed by the server".to_owned()),
                Ok(n) => {
                    let body = n.min(dst.len() - got);
                    #[cfg(test)]
                    {
                        self.stats.0 += 1;
                        self.stats.1 += n - body;
                    }
                    got += body;
                    (self.start, self.end) = (0, n - body);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err(&e)),
            }
        }
        Ok(())
    }

    /// Reads past the next `n` bytes of the stream, through the read buffer.
    fn skip_body(&mut self, mut n: usize) -> Result<(), String> {
        loop {
            let have = (self.end - self.start).min(n);
            self.start += have;
            n -= have;
            if self.start == self.end {
                (self.start, self.end) = (0, 0);
            }
            if n == 0 {
                return Ok(());
            }
            self.fill_at(false)?;
        }
    }

    /// Consumes the CRLF that ends a bulk string.
    pub(super) fn read_crlf(&mut self) -> Result<(), String> {
        while self.end - self.start < 2 {
            self.fill_at(true)?;
        }
        if &self.buf[self.start..self.start + 2] != b"\r\n" {
            return Err("a bulk string reply without its CRLF".to_owned());
        }
        self.start += 2;
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        }
        Ok(())
    }
}

/// What [`Plain::array_header`] found.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Head {
    /// An array of this many elements (its header consumed).
    Array(usize),
    /// A nil array (`*-1`, consumed).
    NilArray,
    /// Another reply (nothing consumed).
    Other,
}

/// The next reply, as [`Plain::peek`] sees it.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Next {
    /// A bulk string of this many bytes.
    Bulk(usize),
    /// Anything else (nil, an error, a status, an integer, an array).
    Other,
}

/// The end of the line at the start of `b` (the index after its CRLF), if it is all there.
fn line_end(b: &[u8]) -> Option<usize> {
    b.windows(2).position(|w| w == b"\r\n").map(|i| i + 2)
}

/// The integer of a reply header line (`b` is the line without its type byte and CRLF).
fn header_int(b: &[u8]) -> Result<i64, String> {
    std::str::from_utf8(b)
        .ok()
        .and_then(|s| s.parse::<i64>().ok())
        .ok_or_else(|| "a malformed reply header".to_owned())
}

/// A bulk string reply's length (`None`: a nil reply) and its header's size, once the header is in
/// `b`.
fn bulk_header(b: &[u8]) -> Result<Option<(Option<usize>, usize)>, String> {
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
fn extent(b: &[u8], depth: usize) -> Result<Option<usize>, String> {
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
mod tests {
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
            info,
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
        let stats = |c: &Conn| match c {
            Conn::Plain(p) => p.stats,
            Conn::Crate(_) => unreachable!("a redis:// connection is kvoff's own"),
        };
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

    /// An array reply longer than asked is an error, not a value.
    #[test]
    fn array_reply_longer_than_asked_is_an_error() {
        let (mut c, server) = serve(b"*1000000000\r\n$1\r\na\r\n".to_vec(), false);
        let e = c.recv_array(None, 8).unwrap_err();
        assert!(e.contains("1000000000 elements"), "{e}");
        drop(c);
        server.join().unwrap();
    }

    fn replies() -> Vec<Vec<u8>> {
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
