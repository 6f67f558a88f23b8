//! Which syscalls are explicit I/O: time blocked in them is `io_wait`, time
//! blocked in any other syscall is `sleep`. Numbers are per architecture.

/// Names counted as explicit I/O.
pub const IO_SYSCALL_NAMES: &[&str] = &[
    "read",
    "pread64",
    "readv",
    "preadv",
    "preadv2",
    "write",
    "pwrite64",
    "writev",
    "pwritev",
    "pwritev2",
    "io_uring_enter",
    "io_getevents",
    "io_pgetevents",
    "fsync",
    "fdatasync",
    "sync_file_range",
    "msync",
    "readahead",
    "sendfile",
    "copy_file_range",
    "splice",
];

/// (name, number) for the running architecture.
#[cfg(target_arch = "x86_64")]
const TABLE: &[(&str, u32)] = &[
    ("read", 0),
    ("write", 1),
    ("pread64", 17),
    ("pwrite64", 18),
    ("readv", 19),
    ("writev", 20),
    ("msync", 26),
    ("sendfile", 40),
    ("fsync", 74),
    ("fdatasync", 75),
    ("readahead", 187),
    ("io_getevents", 208),
    ("splice", 275),
    ("sync_file_range", 277),
    ("preadv", 295),
    ("pwritev", 296),
    ("copy_file_range", 326),
    ("preadv2", 327),
    ("pwritev2", 328),
    ("io_pgetevents", 333),
    ("io_uring_enter", 426),
];

#[cfg(target_arch = "aarch64")]
const TABLE: &[(&str, u32)] = &[
    ("io_getevents", 4),
    ("readv", 65),
    ("writev", 66),
    ("pread64", 67),
    ("pwrite64", 68),
    ("preadv", 69),
    ("pwritev", 70),
    ("sendfile", 71),
    ("splice", 76),
    ("read", 63),
    ("write", 64),
    ("fsync", 82),
    ("fdatasync", 83),
    ("sync_file_range", 84),
    ("msync", 227),
    ("readahead", 213),
    ("io_pgetevents", 292),
    ("copy_file_range", 285),
    ("preadv2", 286),
    ("pwritev2", 287),
    ("io_uring_enter", 426),
];

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const TABLE: &[(&str, u32)] = &[];

/// The 512-bit bitmap the eBPF side tests syscall numbers against.
pub fn io_bitmap() -> [u64; 8] {
    let mut bm = [0u64; 8];
    for (name, nr) in TABLE {
        debug_assert!(IO_SYSCALL_NAMES.contains(name));
        if *nr < 512 {
            bm[(*nr / 64) as usize] |= 1 << (nr % 64);
        }
    }
    bm
}

pub fn is_io(nr: i64) -> bool {
    (0..512).contains(&nr) && io_bitmap()[(nr / 64) as usize] & (1 << (nr % 64)) != 0
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn table_covers_every_name_once() {
        for n in IO_SYSCALL_NAMES {
            assert_eq!(TABLE.iter().filter(|(t, _)| t == n).count(), 1, "{n}");
        }
    }

    /// The C library's number of system call `name` on this architecture (an independent table:
    /// the `libc` crate's `SYS_*` constants), for the tests of every per-architecture table.
    pub(crate) fn libc_nr(name: &str) -> Option<i64> {
        Some(match name {
            "read" => libc::SYS_read,
            "write" => libc::SYS_write,
            "pread64" => libc::SYS_pread64,
            "pwrite64" => libc::SYS_pwrite64,
            "readv" => libc::SYS_readv,
            "writev" => libc::SYS_writev,
            "preadv" => libc::SYS_preadv,
            "pwritev" => libc::SYS_pwritev,
            "preadv2" => libc::SYS_preadv2,
            "pwritev2" => libc::SYS_pwritev2,
            "msync" => libc::SYS_msync,
            "sendfile" => libc::SYS_sendfile,
            "fsync" => libc::SYS_fsync,
            "fdatasync" => libc::SYS_fdatasync,
            "readahead" => libc::SYS_readahead,
            "io_getevents" => libc::SYS_io_getevents,
            "splice" => libc::SYS_splice,
            "sync_file_range" => libc::SYS_sync_file_range,
            "copy_file_range" => libc::SYS_copy_file_range,
            "io_uring_enter" => libc::SYS_io_uring_enter,
            "fadvise64" => libc::SYS_fadvise64,
            "madvise" => libc::SYS_madvise,
            "process_madvise" => libc::SYS_process_madvise,
            "truncate" => libc::SYS_truncate,
            "ftruncate" => libc::SYS_ftruncate,
            "fallocate" => libc::SYS_fallocate,
            "openat" => libc::SYS_openat,
            "openat2" => libc::SYS_openat2,
            "unlinkat" => libc::SYS_unlinkat,
            "renameat" => libc::SYS_renameat,
            "renameat2" => libc::SYS_renameat2,
            "close" => libc::SYS_close,
            "dup3" => libc::SYS_dup3,
            #[cfg(target_arch = "x86_64")]
            "dup2" => libc::SYS_dup2,
            #[cfg(target_arch = "x86_64")]
            "open" => libc::SYS_open,
            #[cfg(target_arch = "x86_64")]
            "creat" => libc::SYS_creat,
            #[cfg(target_arch = "x86_64")]
            "unlink" => libc::SYS_unlink,
            #[cfg(target_arch = "x86_64")]
            "rename" => libc::SYS_rename,
            _ => return None,
        })
    }

    /// The names [`libc_nr`] cannot check: the `libc` crate has no `SYS_io_pgetevents` (its
    /// numbers, x86-64 333 and arm64 292, are the kernel tables').
    pub(crate) const NOT_IN_LIBC: &[&str] = &["io_pgetevents"];

    #[test]
    fn every_number_is_this_architectures() {
        assert!(!TABLE.is_empty(), "no table for this architecture");
        for (name, nr) in TABLE {
            match libc_nr(name) {
                Some(want) => assert_eq!(i64::from(*nr), want, "{name}"),
                None => assert!(NOT_IN_LIBC.contains(name), "{name}: not in libc_nr"),
            }
            assert!(is_io(i64::from(*nr)), "{name}");
        }
        assert!(!is_io(libc::SYS_futex));
        assert!(!is_io(libc::SYS_nanosleep));
    }
}
