//! The byte stream under a remote-tier connection (docs/tier.md "Faults", "Bounds"): a TCP socket,
//! or TLS over one (`rediss://`, rustls driven here record by record), with the exchange's
//! deadline checked before every socket read and write, so that a server that trickles or stalls
//! fails the exchange at its deadline on either kind of connection.
//!
//! TLS is driven by hand rather than through rustls's `Stream`: its `complete_io` loops over
//! socket reads (a handshake, a record) and its `write` swallows the socket's errors, so neither
//! could be bounded by the deadline; here each `read_tls` and `write_tls` is one socket call made
//! after [`Link::arm`].
#![forbid(unsafe_code)]

use std::io::{ErrorKind, IoSliceMut, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The failure of an exchange past its deadline.
pub(super) const DEADLINE: &str = "timed out (the reply took longer than the I/O timeout)";

pub(super) fn io_err(e: &std::io::Error) -> String {
    match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => "timed out".to_owned(),
        _ => e.to_string(),
    }
}

/// TCP, or a TLS session over TCP.
enum Stream {
    Tcp(TcpStream),
    Tls(Box<(rustls::ClientConnection, TcpStream)>),
}

/// A connection's byte stream with its timeouts and the deadline of the exchange under way.
pub(super) struct Link {
    stream: Stream,
    /// No single read or write waits longer.
    io_timeout: Duration,
    /// When the exchange under way must end (set by [`Link::set_deadline`]); every socket read
    /// and write checks it first.
    deadline: Option<Instant>,
    /// The socket's read and write timeouts as last set.
    cur_read: Duration,
    cur_write: Duration,
}

impl Link {
    /// A link over `sock` (connected; `TCP_NODELAY` and timeouts are set here), with TLS when
    /// `tls` holds a client configuration and the server's name: the handshake is made here,
    /// within `deadline`.
    pub(super) fn new(
        sock: TcpStream,
        io_timeout: Duration,
        deadline: Instant,
        tls: Option<(&Arc<rustls::ClientConfig>, &str)>,
    ) -> Result<Self, String> {
        let setup = |s: &TcpStream| -> std::io::Result<()> {
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(io_timeout))?;
            s.set_write_timeout(Some(io_timeout))
        };
        setup(&sock).map_err(|e| format!("connecting: {}", io_err(&e)))?;
        let stream = match tls {
            None => Stream::Tcp(sock),
            Some((cfg, host)) => {
                let name = rustls::pki_types::ServerName::try_from(host.to_owned())
                    .map_err(|e| format!("connecting: TLS: server name {host:?}: {e}"))?;
                let conn = rustls::ClientConnection::new(Arc::clone(cfg), name)
                    .map_err(|e| format!("connecting: TLS: {e}"))?;
                Stream::Tls(Box::new((conn, sock)))
            }
        };
        let mut link = Self {
            stream,
            io_timeout,
            deadline: Some(deadline),
            cur_read: io_timeout,
            cur_write: io_timeout,
        };
        link.handshake()
            .map_err(|e| format!("connecting: TLS handshake: {e}"))?;
        Ok(link)
    }

    fn tcp(&self) -> &TcpStream {
        match &self.stream {
            Stream::Tcp(s) => s,
            Stream::Tls(b) => &b.1,
        }
    }

    /// Sets when the exchange under way must end (`None`: each read and write bounded by the I/O
    /// timeout alone).
    pub(super) fn set_deadline(&mut self, deadline: Option<Instant>) {
        self.deadline = deadline;
    }

    /// Fits the socket's read (or write) timeout to the deadline before a read (or write): the
    /// I/O timeout, or less as the deadline nears. The timeout is set again only when it would
    /// end past the deadline by more than an eighth of the time left, or stop short of the time
    /// left (a new deadline): a fast exchange sets it not at all, a slow one a few times.
    fn arm(&mut self, write: bool) -> Result<(), String> {
        let target = match self.deadline {
            None => self.io_timeout,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(DEADLINE.to_owned());
                }
                left.min(self.io_timeout)
            }
        };
        let cur = if write { self.cur_write } else { self.cur_read };
        if cur < target || cur.saturating_sub(target) > target / 8 {
            let r = if write {
                self.tcp().set_write_timeout(Some(target))
            } else {
                self.tcp().set_read_timeout(Some(target))
            };
            r.map_err(|e| io_err(&e))?;
            if write {
                self.cur_write = target;
            } else {
                self.cur_read = target;
            }
        }
        Ok(())
    }

    /// The TLS handshake (nothing on TCP), one socket call at a time within the deadline.
    fn handshake(&mut self) -> Result<(), String> {
        loop {
            let Stream::Tls(b) = &self.stream else {
                return Ok(());
            };
            if !b.0.is_handshaking() {
                return Ok(());
            }
            if b.0.wants_write() {
                self.flush_tls()?;
            } else if self.read_tls()? == 0 {
                return Err("connection closed by the server".to_owned());
            }
        }
    }

    /// Writes the TLS records rustls holds (nothing on TCP), each socket write armed.
    fn flush_tls(&mut self) -> Result<(), String> {
        loop {
            match &self.stream {
                Stream::Tls(b) if b.0.wants_write() => {}
                _ => return Ok(()),
            }
            self.arm(true)?;
            let Stream::Tls(b) = &mut self.stream else {
                return Ok(());
            };
            let (conn, sock) = &mut **b;
            match conn.write_tls(sock) {
                Ok(0) => return Err("connection closed by the server".to_owned()),
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err(&e)),
            }
        }
    }

    /// One armed socket read into rustls and the records it completes (TLS only): the bytes
    /// read (0 at the end of the stream).
    fn read_tls(&mut self) -> Result<usize, String> {
        self.arm(false)?;
        let Stream::Tls(b) = &mut self.stream else {
            return Ok(0);
        };
        let (conn, sock) = &mut **b;
        let n = loop {
            match conn.read_tls(sock) {
                Ok(n) => break n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err(&e)),
            }
        };
        conn.process_new_packets()
            .map_err(|e| format!("TLS: {e}"))?;
        Ok(n)
    }

    /// Writes some of `bytes` within the deadline; the count taken (never 0 for a non-empty
    /// `bytes`: a closed connection is an error).
    pub(super) fn write(&mut self, bytes: &[u8]) -> Result<usize, String> {
        if let Stream::Tls(b) = &mut self.stream {
            // rustls takes what its buffer limit allows; the records go out before returning.
            let n = b.0.writer().write(bytes).map_err(|e| io_err(&e))?;
            self.flush_tls()?;
            return Ok(n);
        }
        loop {
            self.arm(true)?;
            let Stream::Tcp(s) = &mut self.stream else {
                unreachable!("TLS returned above")
            };
            match s.write(bytes) {
                Ok(0) => return Err("connection closed by the server".to_owned()),
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err(&e)),
            }
        }
    }

    /// Reads into `bufs` in order within the deadline (TCP: one `readv`; TLS: the first non-empty
    /// buffer, from records already decrypted or the next socket read's); the count read, 0 at
    /// the end of the stream.
    pub(super) fn read_vectored(&mut self, bufs: &mut [IoSliceMut<'_>]) -> Result<usize, String> {
        if matches!(self.stream, Stream::Tcp(_)) {
            loop {
                self.arm(false)?;
                let Stream::Tcp(s) = &mut self.stream else {
                    unreachable!("matched above")
                };
                match s.read_vectored(bufs) {
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Err(io_err(&e)),
                }
            }
        }
        let Some(first) = bufs.iter_mut().find(|b| !b.is_empty()) else {
            return Ok(0);
        };
        loop {
            // Records to send first (a key update, an alert): rustls may want to write.
            self.flush_tls()?;
            let Stream::Tls(b) = &mut self.stream else {
                return Ok(0);
            };
            match b.0.reader().read(first) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                // The peer closed without close_notify: the end of the stream, as on TCP.
                Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(0),
                Err(e) => return Err(io_err(&e)),
            }
            if self.read_tls()? == 0 {
                return Ok(0);
            }
        }
    }

    /// Reads into `buf` within the deadline (see [`Link::read_vectored`]).
    pub(super) fn read(&mut self, buf: &mut [u8]) -> Result<usize, String> {
        self.read_vectored(&mut [IoSliceMut::new(buf)])
    }
}
