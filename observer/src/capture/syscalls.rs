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
mod tests {
    use super::*;

    #[test]
    fn table_covers_every_name_once() {
        for n in IO_SYSCALL_NAMES {
            assert_eq!(TABLE.iter().filter(|(t, _)| t == n).count(), 1, "{n}");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn x86_numbers() {
        assert!(is_io(libc::SYS_read));
        assert!(is_io(libc::SYS_pread64));
        assert!(is_io(libc::SYS_io_uring_enter));
        assert!(!is_io(libc::SYS_futex));
        assert!(!is_io(libc::SYS_nanosleep));
        for (name, nr) in TABLE {
            let libc_nr = match *name {
                "read" => libc::SYS_read,
                "write" => libc::SYS_write,
                "pread64" => libc::SYS_pread64,
                "preadv2" => libc::SYS_preadv2,
                "io_uring_enter" => libc::SYS_io_uring_enter,
                "copy_file_range" => libc::SYS_copy_file_range,
                "fdatasync" => libc::SYS_fdatasync,
                _ => continue,
            };
            assert_eq!(*nr as i64, libc_nr, "{name}");
        }
    }
}
