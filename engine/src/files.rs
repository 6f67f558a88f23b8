//! Opening an input file. Rule: an input (a model, a trace, a CSV) is a
//! regular file, checked on the opened descriptor: a FIFO, a directory, a
//! socket or a device is refused with an error saying what it is, instead of
//! hanging in `open` (a FIFO with no writer), failing with a misleading
//! "No such device" (mapping a directory), or reading forever.
//!
//! The file is opened with `O_NONBLOCK`, so that `open` on a FIFO returns at
//! once; the flag is cleared again for a regular file (where it has no effect
//! anyway).

use std::{
    fs::File,
    io,
    os::{fd::AsRawFd, unix::fs::FileTypeExt, unix::fs::OpenOptionsExt},
    path::Path,
};

/// Open `path` for reading if it is a regular file (symlinks followed).
pub fn open_regular(path: &Path) -> io::Result<File> {
    let f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)?;
    let ft = f.metadata()?.file_type();
    if !ft.is_file() {
        let kind = if ft.is_dir() {
            "a directory"
        } else if ft.is_fifo() {
            "a FIFO (named pipe)"
        } else if ft.is_socket() {
            "a socket"
        } else if ft.is_block_device() || ft.is_char_device() {
            "a device"
        } else {
            "not a regular file"
        };
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("it is {kind}; give a regular file")));
    }
    // SAFETY: fcntl on a descriptor we own, with integer arguments.
    unsafe {
        let fl = libc::fcntl(f.as_raw_fd(), libc::F_GETFL);
        if fl >= 0 {
            libc::fcntl(f.as_raw_fd(), libc::F_SETFL, fl & !libc::O_NONBLOCK);
        }
    }
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fifo_or_a_directory_is_refused_at_once_and_a_file_opens() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
        let e = open_regular(&fifo).unwrap_err();
        assert!(e.to_string().contains("FIFO"), "{e}");
        let e = open_regular(dir.path()).unwrap_err();
        assert!(e.to_string().contains("a directory"), "{e}");
        let file = dir.path().join("f");
        std::fs::write(&file, "x").unwrap();
        let mut s = String::new();
        io::Read::read_to_string(&mut open_regular(&file).unwrap(), &mut s).unwrap();
        assert_eq!(s, "x");
    }
}
