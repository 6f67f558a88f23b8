//! A writer for the initramfs format the kernel unpacks: cpio "newc" (SVR4 without checksums).
//!
//! Spec (the kernel's `Documentation/driver-api/early-userspace/buffer-format.rst`), per entry:
//! the magic `070701`, then thirteen fields as 8 ASCII hex digits each — ino, mode, uid, gid,
//! nlink, mtime, filesize, devmajor, devminor, rdevmajor, rdevminor, namesize (with its NUL),
//! check (0) — then the name and a NUL, padded with NULs to a multiple of 4 bytes, then the data,
//! padded the same way. The archive ends with an entry named `TRAILER!!!`. A symbolic link's data
//! is its target. Parents must come before their children (the kernel creates entries in order);
//! [`Archive`] adds every missing parent directory itself. Everything is owned by root, mtime 0,
//! so the same inputs give the same bytes.

use std::collections::BTreeMap;

/// What an entry is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    Dir,
    /// Contents and permission bits (e.g. 0o755).
    File(Vec<u8>, u32),
    /// The link's target.
    Symlink(String),
}

/// An initramfs being assembled: paths (relative, `/`-separated, no leading `/`) to entries.
/// A later [`Archive::add`] of the same path replaces the earlier one.
#[derive(Debug, Default)]
pub struct Archive {
    entries: BTreeMap<String, Entry>,
}

impl Archive {
    pub fn add(&mut self, path: &str, e: Entry) {
        let path = path.trim_start_matches('/').trim_end_matches('/').to_string();
        let mut parent = String::new();
        for part in path.split('/').collect::<Vec<_>>().split_last().map(|(_, p)| p).unwrap_or(&[]) {
            if !parent.is_empty() {
                parent.push('/');
            }
            parent.push_str(part);
            self.entries.entry(parent.clone()).or_insert(Entry::Dir);
        }
        self.entries.insert(path, e);
    }

    /// The total size of the files' contents.
    pub fn data_bytes(&self) -> usize {
        self.entries.values().map(|e| if let Entry::File(d, _) = e { d.len() } else { 0 }).sum()
    }

    /// The archive's bytes. A `BTreeMap` orders `a` before `a/b`, so parents come first.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.data_bytes() + 512 * self.entries.len());
        for (ino, (path, e)) in self.entries.iter().enumerate() {
            let (mode, data): (u32, &[u8]) = match e {
                Entry::Dir => (0o040_755, &[]),
                Entry::File(d, perm) => (0o100_000 | (perm & 0o7777), d),
                Entry::Symlink(t) => (0o120_777, t.as_bytes()),
            };
            let nlink = if matches!(e, Entry::Dir) { 2 } else { 1 };
            header(&mut out, ino as u32 + 1, mode, nlink, data.len(), path);
            out.extend_from_slice(data);
            pad4(&mut out);
        }
        header(&mut out, 0, 0, 1, 0, "TRAILER!!!");
        out
    }
}

fn header(out: &mut Vec<u8>, ino: u32, mode: u32, nlink: u32, size: usize, name: &str) {
    let fields = [ino, mode, 0, 0, nlink, 0, size as u32, 0, 0, 0, 0, name.len() as u32 + 1, 0];
    out.extend_from_slice(b"070701");
    for f in fields {
        out.extend_from_slice(format!("{f:08X}").as_bytes());
    }
    out.extend_from_slice(name.as_bytes());
    out.push(0);
    pad4(out);
}

fn pad4(out: &mut Vec<u8>) {
    while !out.len().is_multiple_of(4) {
        out.push(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads a newc archive back: (name, mode, data) per entry, trailer excluded.
    fn parse(mut b: &[u8]) -> Vec<(String, u32, Vec<u8>)> {
        let mut v = Vec::new();
        let total = b.len();
        loop {
            assert_eq!(&b[..6], b"070701");
            let field =
                |i: usize| u32::from_str_radix(std::str::from_utf8(&b[6 + 8 * i..14 + 8 * i]).unwrap(), 16).unwrap();
            let (mode, size, namesize) = (field(1), field(6) as usize, field(11) as usize);
            let name = std::str::from_utf8(&b[110..110 + namesize - 1]).unwrap().to_string();
            assert_eq!(b[110 + namesize - 1], 0);
            let data_at = (110 + namesize).next_multiple_of(4);
            assert_eq!((total - b.len() + data_at) % 4, 0);
            if name == "TRAILER!!!" {
                return v;
            }
            v.push((name, mode, b[data_at..data_at + size].to_vec()));
            b = &b[(data_at + size).next_multiple_of(4)..];
        }
    }

    #[test]
    fn entries_read_back_with_parents_first() {
        let mut a = Archive::default();
        a.add("/usr/bin/tool", Entry::File(b"abc".to_vec(), 0o755));
        a.add("bin/sh", Entry::Symlink("busybox".into()));
        a.add("init", Entry::File(b"#!/bin/sh\n".to_vec(), 0o700));
        let v = parse(&a.to_bytes());
        let names: Vec<&str> = v.iter().map(|(n, _, _)| n.as_str()).collect();
        assert_eq!(names, ["bin", "bin/sh", "init", "usr", "usr/bin", "usr/bin/tool"]);
        assert_eq!(v[1], ("bin/sh".into(), 0o120_777, b"busybox".to_vec()));
        assert_eq!(v[2], ("init".into(), 0o100_700, b"#!/bin/sh\n".to_vec()));
        assert_eq!(v[3].1, 0o040_755);
        assert_eq!(v[5], ("usr/bin/tool".into(), 0o100_755, b"abc".to_vec()));
        assert_eq!(a.data_bytes(), 13);
    }

    #[test]
    fn same_inputs_same_bytes_and_a_later_add_replaces() {
        let build = |x: &[u8]| {
            let mut a = Archive::default();
            a.add("etc/plan", Entry::File(b"old".to_vec(), 0o644));
            a.add("etc/plan", Entry::File(x.to_vec(), 0o644));
            a.to_bytes()
        };
        assert_eq!(build(b"new"), build(b"new"));
        assert_eq!(parse(&build(b"new"))[1].2, b"new");
    }
}
