//! Reading the first bytes of a model file without changing its page-cache residency.
//!
//! ## Rule
//! Looking at a model must not warm it. A buffered read or a mapping brings the pages it
//! touches into the page cache, and the kernel's read-ahead adds more around them, some still
//! under I/O when the read returns (and so not dropped by a `POSIX_FADV_DONTNEED` issued then).
//! The observer reads what it needs of a model file (the GGUF metadata and tensor table, the
//! first bytes the run header hashes) with `O_DIRECT`: the device copies into this process's
//! buffer and the page cache is left as it was (pages already there stay, none are added).
//! Buffer addresses, offsets and lengths are multiples of [`ALIGN`], a multiple of the logical
//! block sizes in use. Where the file system refuses `O_DIRECT` (`EINVAL`: tmpfs before Linux
//! 6.6, some FUSE file systems) the functions return `None` and the caller reads through the
//! page cache, then drops what that added (`ModelFile::open`).

use std::{fs::File, io, os::unix::fs::FileExt, path::Path};

use engine::gguf::{Gguf, GgufError};

/// Alignment of direct reads.
pub const ALIGN: usize = 4096;

/// The first bytes read to parse a header; grown by what the parse says it needs.
const FIRST_READ: u64 = 1 << 20;

/// `path` opened for direct reads (`open_regular`: never a FIFO or a device), or `None`.
fn open_direct(path: &Path) -> io::Result<Option<File>> {
    use std::os::fd::AsRawFd;
    let f = engine::files::open_regular(path)?;
    // SAFETY: fcntl on a descriptor we own, with integer arguments.
    let rc = unsafe {
        let fl = libc::fcntl(f.as_raw_fd(), libc::F_GETFL);
        if fl < 0 { fl } else { libc::fcntl(f.as_raw_fd(), libc::F_SETFL, fl | libc::O_DIRECT) }
    };
    match rc {
        0.. => Ok(Some(f)),
        _ => match io::Error::last_os_error() {
            e if e.raw_os_error() == Some(libc::EINVAL) => Ok(None),
            e => Err(e),
        },
    }
}

/// The first `n` bytes of `path` (fewer when the file is shorter), read with `O_DIRECT`;
/// `None` where the file system does not support direct reads.
pub fn read_prefix(path: &Path, n: u64) -> io::Result<Option<Vec<u8>>> {
    let Some(f) = open_direct(path)? else { return Ok(None) };
    let want = (n as usize).next_multiple_of(ALIGN);
    let mut raw = vec![0u8; want + ALIGN];
    let start = raw.as_ptr().align_offset(ALIGN);
    let buf = &mut raw[start..start + want];
    let mut got = 0usize;
    while got < want {
        match f.read_at(&mut buf[got..], got as u64) {
            Ok(0) => break,
            Ok(k) => {
                got += k;
                if !got.is_multiple_of(ALIGN) {
                    break; // only the end of the file ends a direct read off a block boundary
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) && got == 0 => return Ok(None),
            Err(e) => return Err(e),
        }
    }
    Ok(Some(buf[..got.min(n as usize)].to_vec()))
}

/// The GGUF metadata and tensor table of `path` (a file of `file_len` bytes), read with
/// `O_DIRECT` ([`Gguf::from_header`]: no tensor data); `None` where direct reads are refused.
pub fn gguf_header(path: &Path, file_len: u64) -> Result<Option<Gguf>, GgufError> {
    header_from_prefixes(path, file_len, |n| read_prefix(path, n))
}

/// The header parse over prefixes of a file of `file_len` bytes, `read(n)` giving the first
/// `n` bytes (or `None`): from 1 MiB, grown to what the parse says the header needs (at least
/// 4× each time) until it parses or the whole file was read; the result is `Gguf::from_bytes`'
/// on the whole file (the fuzz target `gguf` checks that).
pub fn header_from_prefixes(
    path: &Path,
    file_len: u64,
    mut read: impl FnMut(u64) -> io::Result<Option<Vec<u8>>>,
) -> Result<Option<Gguf>, GgufError> {
    let io = |source| GgufError::Io { path: path.to_owned(), source };
    let mut want = FIRST_READ.min(file_len);
    loop {
        let Some(prefix) = read(want).map_err(io)? else { return Ok(None) };
        let got = prefix.len() as u64;
        match Gguf::from_header(path, prefix, file_len.max(got)) {
            Ok(g) => return Ok(Some(g)),
            Err(GgufError::Truncated { needed, .. }) if got == want && want < file_len => {
                want = got.saturating_add(needed).max(want.saturating_mul(4)).min(file_len);
            }
            Err(e) => return Err(e),
        }
    }
}
