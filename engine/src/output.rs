//! Output files. Every file a command of the engine or the observer writes
//! (`engine synth -o`, `engine run --metrics-csv/--metrics-json/--logits-out`,
//! an observer trace, `--json`, an export) goes through [`Output`], whose
//! rules are:
//!
//! 1. **Checked before the work.** [`Output::create`] runs before the run or
//!    the computation starts, and fails with the path named when:
//!    - the path exists and `--force` was not given (nothing is overwritten
//!      silently);
//!    - the path is one of the command's inputs (the same file, however
//!      named: same device and inode, symlinks followed), even with `--force`;
//!    - the path exists and is not a regular file or a symlink (a directory,
//!      a FIFO, a device);
//!    - its directory is not writable: the temporary file (rule 2) is created
//!      there at once, so a read-only or missing directory fails now, not
//!      after the run.
//! 2. **Written aside, then renamed.** The bytes go to a temporary file
//!    `NAME.partial-PID` in the same directory, which [`Output::commit`]
//!    flushes to disk (`fsync`) and renames over the path. The path therefore
//!    holds either what it held before or the complete new file, never a part
//!    of one: an output dropped before its commit (a failed write, a full
//!    disk, a run that ends in an error first) removes the temporary file and
//!    leaves the path as it was.
//! 3. **Symlinks are replaced, not followed.** The rename replaces a symlink
//!    at the path (with `--force`); the file it points to is not touched.
//!
//! A program killed by SIGKILL cannot rename or remove: its temporary file
//! stays, under the name above (a trace or a metrics file there is readable,
//! up to the last record written).

use std::{
    fs::File,
    io::{self, Write},
    os::unix::fs::{MetadataExt, OpenOptionsExt},
    path::{Path, PathBuf},
};

/// Why an output cannot be written; each names the path and what to do.
#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    #[error("{path} already exists; give --force to replace it, or choose another name")]
    Exists { path: PathBuf },
    #[error("{path} is also an input of this command ({input}); write the output to another file")]
    IsInput { path: PathBuf, input: PathBuf },
    #[error("{path} exists and is not a regular file ({kind}); choose another name")]
    NotAFile { path: PathBuf, kind: &'static str },
    #[error("cannot write {path}: {what}: {source}")]
    Io { path: PathBuf, what: &'static str, source: io::Error },
}

/// What a command allows for one output.
#[derive(Debug, Clone, Copy, Default)]
pub struct Policy<'a> {
    /// Replace an existing file (`--force`).
    pub force: bool,
    /// The command's input files: never written over.
    pub inputs: &'a [PathBuf],
}

/// The temporary file `NAME.partial-PID` of `path` written by process `pid` (rule 2); `None` for a
/// path without a file name.
pub fn partial_path(path: &Path, pid: u32) -> Option<PathBuf> {
    let mut name = path.file_name()?.to_os_string();
    name.push(format!(".partial-{pid}"));
    Some(path.with_file_name(name))
}

/// The temporary files of `path` (rule 2) that exist now, the most recently modified first: an
/// output still being written (e.g. a trace of a run being recorded), or left by a killed writer.
pub fn partial_paths(path: &Path) -> Vec<PathBuf> {
    let (Some(name), Some(dir)) = (path.file_name().and_then(|n| n.to_str()), path.parent()) else {
        return Vec::new();
    };
    let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
    let prefix = format!("{name}.partial-");
    let mut found: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            e.file_name().to_str().and_then(|n| n.strip_prefix(&prefix)).is_some_and(|pid| pid.parse::<u32>().is_ok())
        })
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, path.with_file_name(e.file_name()))))
        .collect();
    found.sort_by_key(|f| std::cmp::Reverse(f.0));
    found.into_iter().map(|(_, p)| p).collect()
}

/// An output file being written: see the module doc.
#[derive(Debug)]
pub struct Output {
    pending: Pending,
    file: Option<File>,
}

/// The part of an [`Output`] that renames or removes the temporary file, for
/// writers that move the [`File`] elsewhere (the trace writer's thread).
#[derive(Debug)]
pub struct Pending {
    path: PathBuf,
    tmp: PathBuf,
    done: bool,
}

fn kind_of(ft: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if ft.is_dir() {
        "a directory"
    } else if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_block_device() || ft.is_char_device() {
        "a device"
    } else {
        "a special file"
    }
}

impl Output {
    /// Check `path` against `policy` and create its temporary file (rule 1).
    pub fn create(path: &Path, policy: Policy<'_>) -> Result<Output, OutputError> {
        let io = |what, source| OutputError::Io { path: path.to_path_buf(), what, source };
        // The target of the path (a symlink followed), to compare with the inputs.
        if let Ok(m) = std::fs::metadata(path) {
            for input in policy.inputs {
                if let Ok(im) = std::fs::metadata(input)
                    && (im.dev(), im.ino()) == (m.dev(), m.ino())
                {
                    return Err(OutputError::IsInput { path: path.to_path_buf(), input: input.clone() });
                }
            }
        }
        match std::fs::symlink_metadata(path) {
            Ok(m) if !(m.file_type().is_file() || m.file_type().is_symlink()) => {
                return Err(OutputError::NotAFile { path: path.to_path_buf(), kind: kind_of(m.file_type()) });
            }
            Ok(_) if !policy.force => return Err(OutputError::Exists { path: path.to_path_buf() }),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io("checking it", e)),
        }
        let tmp = partial_path(path, std::process::id())
            .ok_or_else(|| OutputError::NotAFile { path: path.to_path_buf(), kind: "a directory" })?;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&tmp)
            .map_err(|e| io("creating a file in its directory", e))?;
        Ok(Output { pending: Pending { path: path.to_path_buf(), tmp, done: false }, file: Some(file) })
    }

    /// The path this output will have.
    pub fn path(&self) -> &Path {
        &self.pending.path
    }

    /// The temporary file's path, for a writer that opens the file by name itself (the one
    /// [`Output::create`] made, which the commit renames).
    pub fn partial_path(&self) -> &Path {
        &self.pending.tmp
    }

    /// The temporary file, to write to.
    pub fn file(&mut self) -> &mut File {
        self.file.as_mut().expect("the file is there until commit or split")
    }

    /// The file and what renames it, for a writer that runs elsewhere.
    pub fn split(mut self) -> (File, Pending) {
        let file = self.file.take().expect("the file is there until commit or split");
        let pending =
            std::mem::replace(&mut self.pending, Pending { path: PathBuf::new(), tmp: PathBuf::new(), done: true });
        (file, pending)
    }

    /// Flush, sync and rename into place (rule 2).
    pub fn commit(mut self) -> Result<(), OutputError> {
        let file = self.file.take().expect("the file is there until commit or split");
        let pending =
            std::mem::replace(&mut self.pending, Pending { path: PathBuf::new(), tmp: PathBuf::new(), done: true });
        pending.commit(file)
    }

    /// Write `bytes` as the whole file and commit.
    pub fn write_all_and_commit(mut self, bytes: &[u8]) -> Result<(), OutputError> {
        let path = self.pending.path.clone();
        self.file().write_all(bytes).map_err(|source| OutputError::Io { path, what: "writing", source })?;
        self.commit()
    }
}

impl Pending {
    /// The path this output will have.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Sync `file` (the one [`Output::split`] gave) and rename it into place.
    pub fn commit(mut self, mut file: File) -> Result<(), OutputError> {
        let io = |what, source| OutputError::Io { path: self.path.clone(), what, source };
        file.flush().map_err(|e| io("writing", e))?;
        file.sync_all().map_err(|e| io("writing it to disk", e))?;
        drop(file);
        std::fs::rename(&self.tmp, &self.path).map_err(|e| io("renaming the finished file into place", e))?;
        self.done = true;
        Ok(())
    }
}

impl Drop for Pending {
    /// Not committed: the temporary file goes (rule 2).
    fn drop(&mut self) {
        if !self.done {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("engine-output-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn entries(d: &Path) -> Vec<String> {
        let mut v: Vec<String> =
            std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    }

    #[test]
    fn an_output_being_written_is_found_by_its_path() {
        let d = dir("partial");
        let p = d.join("run.trace");
        assert!(partial_paths(&p).is_empty());
        let o = Output::create(&p, Policy::default()).unwrap();
        let tmp = partial_path(&p, std::process::id()).unwrap();
        assert_eq!(partial_paths(&p), [tmp]);
        // Not another file's, nor a name that only starts alike.
        std::fs::write(d.join("run.trace2.partial-1"), "").unwrap();
        std::fs::write(d.join("run.trace.partial-x"), "").unwrap();
        assert_eq!(partial_paths(&p).len(), 1);
        o.write_all_and_commit(b"t").unwrap();
        assert!(partial_paths(&p).is_empty());
    }

    #[test]
    fn an_existing_file_is_kept_without_force_and_replaced_whole_with_it() {
        let d = dir("exists");
        let p = d.join("out.json");
        std::fs::write(&p, "old").unwrap();
        let e = Output::create(&p, Policy::default()).unwrap_err();
        assert!(matches!(e, OutputError::Exists { .. }) && e.to_string().contains("--force"), "{e}");
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "old");
        let o = Output::create(&p, Policy { force: true, inputs: &[] }).unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "old", "nothing changes before the commit");
        o.write_all_and_commit(b"new").unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "new");
        assert_eq!(entries(&d), ["out.json"]);
    }

    #[test]
    fn an_input_is_never_written_over_even_through_a_symlink_or_with_force() {
        let d = dir("input");
        let input = d.join("run.trace");
        std::fs::write(&input, "trace").unwrap();
        let link = d.join("link.trace");
        std::os::unix::fs::symlink(&input, &link).unwrap();
        for p in [&input, &link] {
            let e = Output::create(p, Policy { force: true, inputs: std::slice::from_ref(&input) }).unwrap_err();
            assert!(matches!(e, OutputError::IsInput { .. }), "{e}");
        }
        assert_eq!(std::fs::read_to_string(&input).unwrap(), "trace");
    }

    #[test]
    fn a_symlink_is_replaced_and_its_target_left_alone() {
        let d = dir("symlink");
        let target = d.join("precious");
        std::fs::write(&target, "keep").unwrap();
        let link = d.join("out.json");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(matches!(Output::create(&link, Policy::default()).unwrap_err(), OutputError::Exists { .. }));
        Output::create(&link, Policy { force: true, inputs: &[] }).unwrap().write_all_and_commit(b"new").unwrap();
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep");
        assert!(!std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
        assert_eq!(std::fs::read_to_string(&link).unwrap(), "new");
    }

    #[test]
    fn an_unwritable_directory_fails_at_create_and_a_dropped_output_leaves_nothing() {
        let e = Output::create(Path::new("/proc/observer-out.json"), Policy::default()).unwrap_err();
        assert!(e.to_string().contains("/proc/observer-out.json"), "{e}");
        let e = Output::create(Path::new("/no/such/dir/x.json"), Policy::default()).unwrap_err();
        assert!(e.to_string().contains("/no/such/dir/x.json"), "{e}");
        let d = dir("drop");
        let mut o = Output::create(&d.join("x.json"), Policy::default()).unwrap();
        o.file().write_all(b"{\"half").unwrap();
        drop(o);
        assert!(entries(&d).is_empty(), "{:?}", entries(&d));
    }

    #[test]
    fn a_fifo_or_a_directory_is_not_an_output() {
        let d = dir("special");
        let fifo = d.join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
        for p in [&fifo, &d] {
            let e = Output::create(p, Policy { force: true, inputs: &[] }).unwrap_err();
            assert!(matches!(e, OutputError::NotAFile { .. }), "{e}");
        }
    }

    /// A full disk: /dev/full fails every write with ENOSPC. The old file stays.
    #[test]
    fn a_failed_write_leaves_the_old_file() {
        let d = dir("full");
        let p = d.join("out.json");
        std::fs::write(&p, "old").unwrap();
        let mut o = Output::create(&p, Policy { force: true, inputs: &[] }).unwrap();
        *o.file() = File::options().write(true).open("/dev/full").unwrap();
        let e = o.write_all_and_commit(&[b'x'; 1 << 16]).unwrap_err();
        assert!(e.to_string().contains("No space left"), "{e}");
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "old");
        assert_eq!(entries(&d), ["out.json"]);
    }
}
