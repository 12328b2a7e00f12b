//! kvoff's own reader of a connection to a Redis/Valkey node, over TCP or TLS (docs/design.md "The
//! data path"): the connection's set-up (`AUTH`, `SELECT`), and replies read with at most 64 bytes
//! past a value's body, so that a bulk string's body goes from the socket (or, over TLS, from the
//! decrypted record) straight into its own buffer or host block. The byte stream and its deadline
//! are the `link` module's; [`super::conn::Conn`] is the connection the rest of the tier uses.
#![forbid(unsafe_code)]

use std::io::IoSliceMut;
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::conn::{BufPool, MAX_SMALL_REPLY};
use super::link::io_err;
use super::link::Link;
use super::resp::{bulk_header, extent, header_int, line_end};

/// The read buffer's size: replies of this size or less arrive in one `read` when the server has
/// sent them.
const READ_CHUNK: usize = 256 << 10;
/// Most bytes a read takes into the read buffer where the next bytes may start a bulk string
/// (a reply's first bytes, an array's header, the CRLF after a value), and behind a value's body
/// (the next value's header): a value's body is then read from the socket straight into its own
/// buffer or host block, not into the read buffer and copied out of it (docs/design.md "The data
/// path"). 64 bytes hold a CRLF, an array header and a bulk string header.
const HEAD_READ: usize = 64;

/// Most bytes of a status, error or integer reply line (docs/tier.md "Faults").
const MAX_LINE: usize = 64 << 10;

/// Bulk string replies at least this large get their buffer from a [`BufPool`].
pub(super) const POOLED_BYTES: usize = 16 << 10;

/// A connection with its read buffer (`buf[start..end]` is read and not yet parsed).
pub(super) struct Plain {
    /// The byte stream, with the deadline of the exchange under way (docs/tier.md "Faults": bytes
    /// may come slowly, a reply may not), set by [`Plain::set_deadline`].
    link: Link,
    pub(super) buf: Vec<u8>,
    pub(super) start: usize,
    pub(super) end: usize,
    /// Most bytes of a top-level bulk string reply kept (see [`Conn::open`]).
    pub(super) max_bulk: usize,
    /// Reads made, and the bytes they put into the read buffer (tests: how a reply was read).
    #[cfg(test)]
    pub(super) stats: (usize, usize),
}

impl Plain {
    /// Connects to `host:port` within `connect_timeout` (TLS with `tls`: the handshake within
    /// `io_timeout` after), then authenticates and selects the database `info` names.
    pub(super) fn open(
        info: &redis::ConnectionInfo,
        host: &str,
        port: u16,
        tls: Option<&Arc<rustls::ClientConfig>>,
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
        let link = Link::new(
            sock,
            io_timeout,
            Instant::now() + io_timeout,
            tls.map(|c| (c, host)),
        )?;
        let mut p = Self {
            link,
            buf: vec![0; READ_CHUNK],
            start: 0,
            end: 0,
            max_bulk,
            #[cfg(test)]
            stats: (0, 0),
        };
        p.set_deadline(Some(Instant::now() + io_timeout));
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

    /// Sets when the exchange under way must end (`None`: each read and write bounded by the I/O
    /// timeout alone).
    pub(super) fn set_deadline(&mut self, deadline: Option<Instant>) {
        self.link.set_deadline(deadline);
    }

    /// Writes all of `bytes`, within the deadline.
    pub(super) fn send(&mut self, mut bytes: &[u8]) -> Result<(), String> {
        while !bytes.is_empty() {
            let n = self.link.write(bytes)?;
            bytes = &bytes[n..];
        }
        Ok(())
    }

    /// Sends a setup command and fails unless the server answers `OK` (the message never holds the
    /// command's arguments: `AUTH`'s is a password).
    fn expect_ok(&mut self, cmd: &redis::Cmd, name: &str) -> Result<(), String> {
        self.send(&cmd.get_packed_command())
            .map_err(|e| format!("connecting: {name}: {e}"))?;
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
        match self.link.read(&mut self.buf[self.end..stop])? {
            0 => Err("connection closed by the server".to_owned()),
            n => {
                #[cfg(test)]
                {
                    self.stats.0 += 1;
                    self.stats.1 += n;
                }
                self.end += n;
                Ok(())
            }
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
            if avail.len() > MAX_LINE && avail.first().is_some_and(|b| b"+-:".contains(b)) {
                // A status, error or integer line this long is no server's reply: the stream
                // is broken (or hostile), and no error text of its length is kept.
                return Err(format!("a reply line over {MAX_LINE} bytes"));
            }
            // Nothing read yet, or a bulk string's header: it may be a value's.
            let head = avail.first().is_none_or(|&b| b == b'$');
            self.fill_at(head)?;
        }
    }

    /// See [`Conn::recv_array`]. Only the top level is read this way: an array inside an
    /// element is parsed whole (bounded by `MAX_SMALL_REPLY` and `MAX_DEPTH`).
    pub(super) fn recv_array(
        &mut self,
        pool: Option<&BufPool>,
        max: usize,
    ) -> Result<redis::Value, String> {
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
        self.read_body_summed(dst, None)
    }

    /// [`Plain::read_body`], feeding each piece of `dst` to `sum` as it arrives (while it is in
    /// the CPU's caches: a value's checksum then costs no second pass over its block, and the
    /// connection is ready for its next command as soon as the last byte is in).
    pub(super) fn read_body_summed(
        &mut self,
        dst: &mut [u8],
        mut sum: Option<&mut crate::tier::format::PayloadSum>,
    ) -> Result<(), String> {
        let have = (self.end - self.start).min(dst.len());
        dst[..have].copy_from_slice(&self.buf[self.start..self.start + have]);
        if let Some(h) = sum.as_deref_mut() {
            h.update(&dst[..have]);
        }
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
            match self.link.read_vectored(&mut iov)? {
                0 => return Err("connection closed by the server".to_owned()),
                n => {
                    let body = n.min(dst.len() - got);
                    #[cfg(test)]
                    {
                        self.stats.0 += 1;
                        self.stats.1 += n - body;
                    }
                    if let Some(h) = sum.as_deref_mut() {
                        h.update(&dst[got..got + body]);
                    }
                    got += body;
                    (self.start, self.end) = (0, n - body);
                }
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
