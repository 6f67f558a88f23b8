//! The metrics endpoint: a small HTTP/1.1 responder on its own thread.
//!
//! ## Spec
//! - `GET /metrics` (or `HEAD`): the exposition. Content negotiation on
//!   `Accept`: OpenMetrics 1.0 (`application/openmetrics-text; version=1.0.0;
//!   charset=utf-8`) when the client prefers `application/openmetrics-text`
//!   (as Prometheus does), else the Prometheus text format 0.0.4
//!   (`text/plain; version=0.0.4; charset=utf-8`; curl, promtool).
//! - `GET /healthz`: `200 ok`, then one `degraded: …` line for each feature
//!   that cannot work with the privileges or kernel given (the rest is served).
//! - `GET /`: a one-line pointer to `/metrics`; other paths: 404; other
//!   methods: 405.
//! - One request per connection (`Connection: close`, a `Content-Length`),
//!   request heads up to 8 KiB (431 beyond), 10 s to send the head and 10 s to
//!   take the answer.
//! - Connections never wait for each other: every connection is accepted at
//!   once and served by its own task, so idle or slow clients cost a scrape
//!   nothing. At most [`MAX_CONNECTIONS`] are kept (fewer if `RLIMIT_NOFILE`
//!   leaves less room); beyond that the oldest connection still sending its
//!   head is closed to make room. Each kept connection costs at most its head
//!   buffer ([`MAX_HEAD`]) and a task, so memory is bounded. The listen queue
//!   is [`BACKLOG`] long, so that a burst of connections is not refused.
//! - Its own thread and current-thread runtime: a burst of scrapes competes
//!   with the run loop only for CPU, never for its event loop.
//! - Addresses: `PORT`, `:PORT` (both on 127.0.0.1) or `HOST:PORT`
//!   (`[::1]:PORT`, `0.0.0.0:PORT` to listen beyond this machine).

use std::{
    collections::VecDeque,
    net::{SocketAddr, TcpListener as StdListener, ToSocketAddrs},
    os::fd::AsRawFd,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::oneshot,
    task::{AbortHandle, JoinSet},
    time::timeout,
};

use super::{Exporter, Format};

/// Connections kept at once (see the spec).
pub const MAX_CONNECTIONS: usize = 2048;
/// Length of the listen queue (the kernel caps it at `net.core.somaxconn`).
pub const BACKLOG: i32 = 4096;
/// Files the process keeps for other uses than the endpoint's connections.
const OTHER_FILES: usize = 256;
pub const MAX_HEAD: usize = 8 << 10;
const READ_TIMEOUT: Duration = Duration::from_secs(10);
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
const DRAIN_TIMEOUT: Duration = Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("--metrics-addr {addr:?}: {why} (use PORT, :PORT or HOST:PORT, e.g. 127.0.0.1:9464)")]
    Addr { addr: String, why: String },
    #[error("cannot listen on {addr} for metrics: {source}{}", bind_hint(source))]
    Bind { addr: String, source: std::io::Error },
    #[error("metrics endpoint: {what}: {source}")]
    Io { what: &'static str, source: std::io::Error },
}

/// What to do about a failed bind, by its cause (none when the error says it all).
fn bind_hint(e: &std::io::Error) -> &'static str {
    match e.kind() {
        std::io::ErrorKind::AddrInUse => {
            ": something else listens on that port (`ss -ltnp` shows what); choose another with --metrics-addr"
        }
        std::io::ErrorKind::AddrNotAvailable => {
            ": that host is not an address of this machine (`ip -br addr` lists them); give one of them, 0.0.0.0 \
             for every interface, or 127.0.0.1"
        }
        std::io::ErrorKind::PermissionDenied => {
            ": ports below 1024 need root or CAP_NET_BIND_SERVICE; choose a port of 1024 or more with --metrics-addr"
        }
        _ => "",
    }
}

/// Resolve `--metrics-addr`: a bare port or `:PORT` binds 127.0.0.1.
pub fn parse_addr(s: &str) -> Result<Vec<SocketAddr>, MetricsError> {
    let err = |why: &str| MetricsError::Addr { addr: s.to_string(), why: why.to_string() };
    let t = s.trim();
    let port_only = t.strip_prefix(':').unwrap_or(t);
    if !port_only.is_empty() && port_only.bytes().all(|b| b.is_ascii_digit()) {
        let port: u16 = port_only.parse().map_err(|_| err("port out of range"))?;
        return Ok(vec![SocketAddr::from(([127, 0, 0, 1], port))]);
    }
    if !t.contains(':') {
        return Err(err("no port"));
    }
    let v: Vec<SocketAddr> = t.to_socket_addrs().map_err(|e| err(&e.to_string()))?.collect();
    if v.is_empty() {
        return Err(err("the host resolves to no address"));
    }
    Ok(v)
}

/// The format a client's `Accept` header prefers (q-values honoured).
pub fn negotiate(accept: Option<&str>) -> Format {
    let Some(a) = accept else { return Format::Text };
    let (mut om, mut text) = (0.0f64, 0.0f64);
    for part in a.split(',') {
        let mut it = part.split(';');
        let media = it.next().unwrap_or("").trim().to_ascii_lowercase();
        let mut q = 1.0f64;
        for p in it {
            if let Some(v) = p.trim().strip_prefix("q=") {
                q = v.trim().parse().unwrap_or(0.0);
            }
        }
        match media.as_str() {
            "application/openmetrics-text" => om = om.max(q),
            "text/plain" | "text/*" | "*/*" => text = text.max(q),
            _ => {}
        }
    }
    if om > 0.0 && om >= text { Format::OpenMetrics } else { Format::Text }
}

/// A running endpoint; dropping it stops the server thread.
#[derive(Debug)]
pub struct Endpoint {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Endpoint {
    /// Bind `addr` (see [`parse_addr`]) now, so that a bad address or a busy
    /// port fails before anything is observed, and serve `ex` from a thread.
    pub fn start(addr: &str, ex: Arc<Exporter>) -> Result<Endpoint, MetricsError> {
        let addrs = parse_addr(addr)?;
        let listener =
            StdListener::bind(&addrs[..]).map_err(|source| MetricsError::Bind { addr: addr.to_string(), source })?;
        let io = |what| move |source| MetricsError::Io { what, source };
        let local = listener.local_addr().map_err(io("local address"))?;
        listener.set_nonblocking(true).map_err(io("non-blocking listener"))?;
        // std listens with a queue of 128; listening again resizes it.
        // SAFETY: a valid, bound socket of ours.
        if unsafe { libc::listen(listener.as_raw_fd(), BACKLOG) } != 0 {
            return Err(io("listen queue")(std::io::Error::last_os_error()));
        }
        let limit = connection_limit();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(io("runtime"))?;
        let (tx, rx) = oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("metrics-http".into())
            .spawn(move || rt.block_on(serve(listener, ex, rx, limit)))
            .map_err(io("thread"))?;
        Ok(Endpoint { addr: local, stop: Some(tx), thread: Some(thread) })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// How many connections to keep: [`MAX_CONNECTIONS`], after raising the soft
/// `RLIMIT_NOFILE` to the hard one (as Go programs such as node_exporter do),
/// less what the rest of the process needs.
fn connection_limit() -> usize {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain syscalls on a valid struct.
    let files = unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) != 0 {
            return MAX_CONNECTIONS;
        }
        if r.rlim_cur < r.rlim_max {
            let raised = libc::rlimit { rlim_cur: r.rlim_max, rlim_max: r.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                r = raised;
            }
        }
        r.rlim_cur
    };
    let room = usize::try_from(files).unwrap_or(usize::MAX).saturating_sub(OTHER_FILES).max(16);
    if room < MAX_CONNECTIONS {
        log::warn!(
            "metrics endpoint: RLIMIT_NOFILE is {files}: keeping at most {room} connections (raise it to {} for {MAX_CONNECTIONS})",
            MAX_CONNECTIONS + OTHER_FILES
        );
    }
    room.min(MAX_CONNECTIONS)
}

/// A kept connection: its task, and whether it is past its head (answering).
struct Kept {
    task: AbortHandle,
    answering: Arc<AtomicBool>,
}

async fn serve(listener: StdListener, ex: Arc<Exporter>, mut stop: oneshot::Receiver<()>, limit: usize) {
    let listener = match TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            log::error!("metrics endpoint: {e}");
            return;
        }
    };
    let mut tasks = JoinSet::new();
    // Oldest first; finished ones are pruned as they reach the front.
    let mut kept: VecDeque<Kept> = VecDeque::new();
    loop {
        let conn = tokio::select! {
            _ = &mut stop => return,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
            c = listener.accept() => c,
        };
        let stream = match conn {
            Ok((stream, _)) => stream,
            // Per-connection failures (ECONNABORTED, EMFILE): back off briefly.
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        while kept.front().is_some_and(|k| k.task.is_finished()) {
            kept.pop_front();
        }
        if kept.len() > 2 * limit {
            kept.retain(|k| !k.task.is_finished());
        }
        if tasks.len() >= limit && !make_room(&mut kept) {
            // Every kept connection is being answered: this one waits for
            // nothing, it is closed.
            drop(stream);
            continue;
        }
        let answering = Arc::new(AtomicBool::new(false));
        let (ex, flag) = (Arc::clone(&ex), Arc::clone(&answering));
        let task = tasks.spawn(async move { connection(stream, &ex, &flag).await });
        kept.push_back(Kept { task, answering });
    }
}

/// Close the oldest connection still sending its head; false if none is.
fn make_room(kept: &mut VecDeque<Kept>) -> bool {
    let Some(i) = kept.iter().position(|k| !k.task.is_finished() && !k.answering.load(Ordering::Relaxed)) else {
        return false;
    };
    if let Some(k) = kept.remove(i) {
        k.task.abort();
    }
    true
}

/// What a request asked for.
#[derive(Debug, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub accept: Option<String>,
}

/// Parse a request head (up to and excluding the blank line).
pub fn parse_head(head: &str) -> Option<Request> {
    let mut lines = head.split("\r\n");
    let mut first = lines.next()?.split(' ');
    let (method, target, version) = (first.next()?, first.next()?, first.next()?);
    if first.next().is_some() || !version.starts_with("HTTP/1.") || method.is_empty() {
        return None;
    }
    let path = target.split(['?', '#']).next().unwrap_or("").to_string();
    let mut accept: Option<String> = None;
    for l in lines {
        let (k, v) = l.split_once(':')?;
        if k.trim().eq_ignore_ascii_case("accept") {
            // Repeated headers combine with commas (RFC 9110 §5.3).
            let v = v.trim();
            accept = Some(match accept {
                Some(a) => format!("{a},{v}"),
                None => v.to_string(),
            });
        }
    }
    Some(Request { method: method.to_string(), path, accept })
}

/// The full response to a request (head and, unless `HEAD`, body).
pub fn respond(req: Option<&Request>, ex: &Exporter) -> Vec<u8> {
    let Some(req) = req else {
        return response(400, "Bad Request", "text/plain; charset=utf-8", "bad request\n", "", false);
    };
    let head_only = req.method == "HEAD";
    if req.method != "GET" && !head_only {
        return response(
            405,
            "Method Not Allowed",
            "text/plain; charset=utf-8",
            "use GET\n",
            "Allow: GET, HEAD\r\n",
            false,
        );
    }
    match req.path.as_str() {
        "/metrics" => {
            let format = negotiate(req.accept.as_deref());
            match ex.render(format) {
                Ok(body) => response(200, "OK", format.content_type(), &body, "", head_only),
                Err(_) => response(
                    500,
                    "Internal Server Error",
                    "text/plain; charset=utf-8",
                    "encoding failed\n",
                    "",
                    head_only,
                ),
            }
        }
        "/healthz" => response(200, "OK", "text/plain; charset=utf-8", &ex.health(), "", head_only),
        "/" => response(200, "OK", "text/plain; charset=utf-8", "moe-observer: metrics at /metrics\n", "", head_only),
        _ => response(404, "Not Found", "text/plain; charset=utf-8", "not found: try /metrics\n", "", head_only),
    }
}

fn response(code: u16, reason: &str, ctype: &str, body: &str, extra: &str, head_only: bool) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n{extra}\r\n",
        body.len()
    )
    .into_bytes();
    if !head_only {
        out.extend_from_slice(body.as_bytes());
    }
    out
}

enum Head {
    Complete(String),
    TooLarge,
    Closed,
}

async fn read_head(s: &mut TcpStream) -> std::io::Result<Head> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            return Ok(Head::Closed);
        }
        let scan_from = buf.len().saturating_sub(3);
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf[scan_from..].windows(4).position(|w| w == b"\r\n\r\n") {
            buf.truncate(scan_from + end);
            return Ok(Head::Complete(String::from_utf8_lossy(&buf).into_owned()));
        }
        if buf.len() > MAX_HEAD {
            return Ok(Head::TooLarge);
        }
    }
}

async fn connection(mut s: TcpStream, ex: &Exporter, answering: &AtomicBool) {
    let head = timeout(READ_TIMEOUT, read_head(&mut s)).await;
    answering.store(true, Ordering::Relaxed);
    let resp = match head {
        Ok(Ok(Head::Complete(h))) => respond(parse_head(&h).as_ref(), ex),
        Ok(Ok(Head::TooLarge)) => response(
            431,
            "Request Header Fields Too Large",
            "text/plain; charset=utf-8",
            "request head too large\n",
            "",
            false,
        ),
        // Closed, failed or too slow: nothing to answer.
        _ => return,
    };
    if let Ok(Ok(())) = timeout(WRITE_TIMEOUT, s.write_all(&resp)).await {
        let _ = s.shutdown().await;
        // Take what the client still sends (an oversized head, a body) until
        // it closes: closing with unread input would reset the connection and
        // could destroy the answer before the client reads it.
        let _ = timeout(DRAIN_TIMEOUT, async {
            let mut sink = [0u8; 4096];
            let mut left = 64usize << 10;
            while left > 0 {
                match s.read(&mut sink).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => left = left.saturating_sub(n),
                }
            }
        })
        .await;
    }
}
