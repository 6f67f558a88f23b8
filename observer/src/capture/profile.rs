//! Engine profiles: token boundaries in an engine that carries none of our
//! markers (`moe_abi::markers`), from calls of its own decode functions.
//!
//! ## Spec
//! - A profile is data: a name and its entry points. An entry point is a
//!   symbol whose every call is one step (a uprobe at entry, a uretprobe at
//!   return), and the rule that reads the step's token count from the call's
//!   arguments ([`NTokens`]). Where the argument's layout is not known the
//!   count is unknown (`NTokens::Unknown`), never a guess.
//! - A target matches a profile when an ELF file it runs defines at least one
//!   of the profile's symbols. The files looked at, in order: its executable,
//!   the libraries the executable needs, directly or through other libraries
//!   (`DT_NEEDED`, breadth first and searched as the dynamic loader does:
//!   `DT_RPATH`/`DT_RUNPATH` with `$ORIGIN`, `LD_LIBRARY_PATH`, the system
//!   directories), and every file it has mapped (`/proc/PID/maps`, which
//!   also holds a library loaded later with `dlopen`). The first file that
//!   defines any of a profile's symbols is the profile's file; every entry
//!   point defined there is probed.
//! - Calls nest: a thread's call inside another probed call is part of the
//!   outer step (the kernel side keeps a per-thread depth), so entry points
//!   that call one another never count a step twice.
//!
//! ## Adding a profile
//! Add a [`Profile`] to [`PROFILES`]: its name (what `--engine` takes and the
//! header shows) and its entry points. The token-count rule of an entry point
//! is [`NTokens::Unknown`] unless its argument's layout is public and stable,
//! or private but checked against the engine's own header by a test and read
//! by a rule whose checks refuse other layouts (`observer_common::attrib::call_arg`
//! lists the rules the kernel side can apply). Nothing else changes.

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
};

use observer_common::attrib::call_arg;

/// How a step's token count is read from an entry point's arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NTokens {
    /// Not read: the layout is private or not known.
    Unknown,
    /// A signed 32-bit field at byte `field` of a struct over 16 bytes passed
    /// by value as argument `arg` (0-based; the first argument passed this
    /// way). Where it lies is this architecture's calling convention
    /// ([`by_value_i32`]).
    ByValueI32 { arg: u8, field: u32 },
    /// The length of a `std::vector` in the struct an argument points to
    /// (`call_arg::VecLen`: x86-64 and aarch64 alike, the argument is a register).
    PtrVecLen(call_arg::VecLen),
}

impl NTokens {
    /// The uprobe's attach cookie for this rule (`call_arg`'s encoding).
    pub fn cookie(self) -> u64 {
        match self {
            NTokens::ByValueI32 { arg, field } => by_value_i32(arg, field),
            NTokens::PtrVecLen(v) => v.cookie(),
            NTokens::Unknown => call_arg::cookie(call_arg::NONE, 0),
        }
    }
}

/// The rule reading [`NTokens::ByValueI32`] on x86-64 (System V): a struct
/// over 16 bytes passed by value goes in memory, the first such argument just
/// above the return address, at `sp + 8` at entry.
#[cfg(target_arch = "x86_64")]
const fn by_value_i32(_arg: u8, field: u32) -> u64 {
    call_arg::cookie(call_arg::STACK_I32, 8 + field)
}

/// On aarch64 (AAPCS64 B.4): the caller copies a struct over 16 bytes and
/// passes the copy's address as the argument, in register `x<arg>`.
#[cfg(target_arch = "aarch64")]
const fn by_value_i32(arg: u8, field: u32) -> u64 {
    call_arg::PtrI32 { arg, offset: field }.cookie()
}

/// Other architectures: not read (the count is unknown).
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const fn by_value_i32(_arg: u8, _field: u32) -> u64 {
    call_arg::cookie(call_arg::NONE, 0)
}

/// One function whose calls are steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub symbol: &'static str,
    pub n_tokens: NTokens,
}

/// An engine's entry points (module spec).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Profile {
    pub name: &'static str,
    pub entries: &'static [Entry],
}

/// llama.cpp (`libllama`): its tools decode through `llama_decode(ctx,
/// llama_batch)` or `llama_process(ctx, type, llama_batch_ext *)` (the server
/// through both), encoder models through `llama_encode`. `llama_batch` is
/// public (`include/llama.h`: `int32_t n_tokens` first) and passed by value.
/// `llama_batch_ext` is private ([`LLAMA_BATCH_EXT_TOKENS`]).
pub const LLAMA_CPP: Profile = Profile {
    name: "llama.cpp",
    entries: &[
        Entry { symbol: "llama_decode", n_tokens: NTokens::ByValueI32 { arg: 1, field: 0 } },
        Entry { symbol: "llama_encode", n_tokens: NTokens::ByValueI32 { arg: 1, field: 0 } },
        Entry { symbol: "llama_process", n_tokens: NTokens::PtrVecLen(LLAMA_BATCH_EXT_TOKENS) },
    ],
};

/// The token count of `llama_process(ctx, type, llama_batch_ext * batch)`:
/// `batch->tokens.size()`. `src/llama-batch.h` (llama-cpp-python 0.3.36's
/// tree) lays the struct out as `size_t n_tokens_max` at 0, then four more
/// words, `n_pos_per_embd`, `n_embd`, and `std::vector<token> tokens` at
/// byte 64, with 96-byte elements (checked by compiling against that header in
/// `observer/tests/llama.rs`). Another release's layout fails the rule's checks
/// (`call_arg` spec) in all but contrived cases and its counts are unknown.
pub const LLAMA_BATCH_EXT_TOKENS: call_arg::VecLen =
    call_arg::VecLen { arg: 2, vec_offset: 64, elem_size: 96, bound_offset: Some(0) };

/// Every profile, tried in this order.
pub const PROFILES: &[Profile] = &[LLAMA_CPP];

/// The profile named `name` (as `--engine` takes it).
pub fn by_name(name: &str) -> Option<&'static Profile> {
    PROFILES.iter().find(|p| p.name.eq_ignore_ascii_case(name))
}

/// A profile found in a target: the file that defines its entry points and
/// the entry points defined there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    pub profile: &'static Profile,
    pub path: PathBuf,
    pub entries: Vec<Entry>,
}

impl Found {
    /// `llama.cpp: llama_decode, llama_process in /path/libllama.so`.
    pub fn describe(&self) -> String {
        let syms: Vec<&str> = self.entries.iter().map(|e| e.symbol).collect();
        format!("{}: {} in {}", self.profile.name, syms.join(", "), self.path.display())
    }
}

/// The first of `profiles` that a file of the target defines (module spec):
/// `exe` (the program it runs or will run) and, when `pid` is running, the
/// files it has mapped.
pub fn detect(profiles: &[&'static Profile], exe: &Path, pid: Option<u32>) -> Option<Found> {
    let mut files = vec![exe.to_path_buf()];
    files.extend(needed_libraries(exe));
    if let Some(pid) = pid {
        files.extend(mapped_files(pid));
    }
    let mut seen = BTreeSet::new();
    for f in files {
        let Ok(canon) = f.canonicalize() else { continue };
        if !seen.insert(canon.clone()) {
            continue;
        }
        let defined = defined_symbols(&canon, profiles);
        if defined.is_empty() {
            continue;
        }
        for &p in profiles {
            let entries: Vec<Entry> = p.entries.iter().filter(|e| defined.contains(e.symbol)).copied().collect();
            if !entries.is_empty() {
                return Some(Found { profile: p, path: canon, entries });
            }
        }
    }
    None
}

/// The first of `profiles` whose entry points `path` defines, if any.
pub fn profile_of_file(path: &Path, profiles: &[&'static Profile]) -> Option<&'static Profile> {
    let defined = defined_symbols(path, profiles);
    profiles.iter().find(|p| p.entries.iter().any(|e| defined.contains(e.symbol))).copied()
}

/// Which of the profiles' symbols `path` defines (its symbol and dynamic
/// symbol tables).
fn defined_symbols(path: &Path, profiles: &[&'static Profile]) -> BTreeSet<&'static str> {
    use object::{Object, ObjectSymbol};
    let mut out = BTreeSet::new();
    let Ok(data) = crate::capture::bpf::map_elf(path) else { return out };
    let Ok(file) = object::File::parse(&*data) else { return out };
    let wanted: Vec<&'static str> = profiles.iter().flat_map(|p| p.entries.iter().map(|e| e.symbol)).collect();
    for s in file.dynamic_symbols().chain(file.symbols()) {
        if !s.is_definition() {
            continue;
        }
        if let Ok(name) = s.name()
            && let Some(w) = wanted.iter().find(|w| **w == name)
        {
            out.insert(*w);
        }
    }
    out
}

/// The regular files a running process has mapped, in map order.
pub fn mapped_files(pid: u32) -> Vec<PathBuf> {
    let Ok(maps) = procfs::process::Process::new(pid as i32).and_then(|p| p.maps()) else { return Vec::new() };
    let mut out: Vec<PathBuf> = Vec::new();
    for m in maps {
        let procfs::process::MMapPath::Path(path) = m.pathname else { continue };
        // A replaced file is named with a " (deleted)" suffix: its path as mapped.
        let path = match path.to_str().and_then(|p| p.strip_suffix(" (deleted)")) {
            Some(p) => PathBuf::from(p),
            None => path,
        };
        if path.is_absolute() && out.last() != Some(&path) {
            out.push(path);
        }
    }
    out
}

/// The dynamic loader's system directories, after `DT_RPATH`/`DT_RUNPATH` and
/// `LD_LIBRARY_PATH`: the multiarch directories of this architecture (Debian,
/// Ubuntu), then the 64-bit ones (Fedora, Arch, and x86-64's legacy layout),
/// then the plain ones (glibc's default on aarch64).
#[cfg(target_arch = "x86_64")]
const SYSTEM_LIB_DIRS: &[&str] =
    &["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib"];
#[cfg(target_arch = "aarch64")]
const SYSTEM_LIB_DIRS: &[&str] =
    &["/lib/aarch64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib"];
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const SYSTEM_LIB_DIRS: &[&str] = &["/lib64", "/usr/lib64", "/lib", "/usr/lib"];

/// At most this many libraries are looked at per executable ([`needed_libraries`]); a program
/// needs a few dozen.
const MAX_NEEDED: usize = 256;

/// The shared libraries `exe` needs (`DT_NEEDED`), directly and through the libraries it needs,
/// breadth first as the dynamic loader loads them, each once, at most [`MAX_NEEDED`]. A name is
/// found as the loader finds it: in the needing object's `DT_RPATH`/`DT_RUNPATH` (with
/// `$ORIGIN` its own directory), then the executable's, `LD_LIBRARY_PATH`, the system
/// directories; names not found are left out. The whole tree matters: `llama-bench` needs
/// `libllama-bench-impl.so`, and only that needs `libllama.so`, where the decode entry points
/// are.
pub fn needed_libraries(exe: &Path) -> Vec<PathBuf> {
    let Some((needed, search)) = dynamic_info(exe) else { return Vec::new() };
    let exe_dirs = search_dirs(exe, &search);
    let mut tail: Vec<PathBuf> = std::env::var("LD_LIBRARY_PATH")
        .map(|v| v.split(':').filter(|d| !d.is_empty()).map(PathBuf::from).collect())
        .unwrap_or_default();
    tail.extend(SYSTEM_LIB_DIRS.iter().map(PathBuf::from));
    let mut out: Vec<PathBuf> = Vec::new();
    let mut queue = std::collections::VecDeque::from([(Vec::new(), needed)]);
    while let Some((own_dirs, needed)) = queue.pop_front() {
        for name in needed {
            let found = if name.contains('/') {
                Some(PathBuf::from(&name))
            } else {
                own_dirs.iter().chain(&exe_dirs).chain(&tail).map(|d| d.join(&name)).find(|p| p.is_file())
            };
            let Some(lib) = found else { continue };
            if out.contains(&lib) || out.len() >= MAX_NEEDED {
                continue;
            }
            if let Some((more, search)) = dynamic_info(&lib) {
                queue.push_back((search_dirs(&lib, &search), more));
            }
            out.push(lib);
        }
    }
    out
}

/// An object's `DT_RPATH`/`DT_RUNPATH` directories, `$ORIGIN` expanded to its own directory.
fn search_dirs(obj: &Path, dirs: &[String]) -> Vec<PathBuf> {
    let origin = obj.parent().map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
    dirs.iter().filter(|d| !d.is_empty()).map(|d| PathBuf::from(d.replace("$ORIGIN", &origin))).collect()
}

/// `DT_NEEDED` names and the `DT_RPATH`/`DT_RUNPATH` directories of an ELF64 file.
fn dynamic_info(path: &Path) -> Option<(Vec<String>, Vec<String>)> {
    use object::{
        elf,
        read::elf::{Dyn, FileHeader},
    };
    let data = crate::capture::bpf::map_elf(path).ok()?;
    let header = elf::FileHeader64::<object::Endianness>::parse(&*data).ok()?;
    let endian = header.endian().ok()?;
    let sections = header.sections(endian, &*data).ok()?;
    let (dyns, link) = sections.dynamic(endian, &*data).ok()??;
    let strings = sections.strings(endian, &*data, link).ok()?;
    let (mut needed, mut search) = (Vec::new(), Vec::new());
    for d in dyns {
        let tag = d.tag(endian);
        let Some(s) = d.string(endian, strings).ok().map(|s| String::from_utf8_lossy(s).into_owned()) else {
            continue;
        };
        match tag {
            elf::DT_NEEDED => needed.push(s),
            elf::DT_RPATH | elf::DT_RUNPATH => search.extend(s.split(':').map(str::to_string)),
            _ => {}
        }
    }
    Some((needed, search))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_are_found_by_name_and_read_only_known_layouts() {
        assert_eq!(by_name("LLAMA.CPP"), Some(&LLAMA_CPP));
        assert_eq!(by_name("ollama"), None);
        let process = LLAMA_CPP.entries.iter().find(|e| e.symbol == "llama_process").unwrap();
        assert_eq!(call_arg::VecLen::from_cookie(process.n_tokens.cookie()), LLAMA_BATCH_EXT_TOKENS);
        let decode = LLAMA_CPP.entries.iter().find(|e| e.symbol == "llama_decode").unwrap();
        #[cfg(target_arch = "x86_64")]
        assert_eq!(call_arg::split(decode.n_tokens.cookie()), (call_arg::STACK_I32, 8));
        #[cfg(target_arch = "aarch64")]
        assert_eq!(call_arg::PtrI32::from_cookie(decode.n_tokens.cookie()), call_arg::PtrI32 { arg: 1, offset: 0 });
    }

    /// `llama_batch` (`include/llama.h`): 56 bytes, `int32_t n_tokens` first.
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct LlamaBatch {
        n_tokens: i32,
        ptrs: [usize; 6],
    }

    /// The integer argument registers and the stack pointer at a function's entry, as a uprobe
    /// sees them (x86-64: rdi, rsi, rdx, rcx, r8, r9; aarch64: x0..x5).
    #[repr(C)]
    struct EntryRegs {
        args: [u64; 6],
        sp: u64,
    }

    struct Shared(std::cell::UnsafeCell<EntryRegs>);
    // SAFETY: written by `llama_decode_like` and read by the body it jumps to, on one thread (one test).
    unsafe impl Sync for Shared {}
    static ENTRY: Shared = Shared(std::cell::UnsafeCell::new(EntryRegs { args: [0; 6], sp: 0 }));

    /// A function of `llama_decode`'s signature, called by the compiler's own C calling convention:
    /// it saves the registers at entry, as a uprobe does, then jumps to [`decode_body`].
    #[unsafe(naked)]
    extern "C" fn llama_decode_like(_ctx: usize, _batch: LlamaBatch) -> i32 {
        #[cfg(target_arch = "x86_64")]
        core::arch::naked_asm!(
            "lea r11, [rip + {e}]",
            "mov [r11], rdi",
            "mov [r11 + 8], rsi",
            "mov [r11 + 16], rdx",
            "mov [r11 + 24], rcx",
            "mov [r11 + 32], r8",
            "mov [r11 + 40], r9",
            "mov [r11 + 48], rsp",
            "jmp {body}",
            e = sym ENTRY,
            body = sym decode_body,
        );
        #[cfg(target_arch = "aarch64")]
        core::arch::naked_asm!(
            "adrp x9, {e}",
            "add x9, x9, :lo12:{e}",
            "stp x0, x1, [x9]",
            "stp x2, x3, [x9, #16]",
            "stp x4, x5, [x9, #32]",
            "mov x10, sp",
            "str x10, [x9, #48]",
            "b {body}",
            e = sym ENTRY,
            body = sym decode_body,
        );
    }

    /// Inside the call (the caller's copy of the batch is alive): the count as the kernel rule of
    /// `llama_decode`'s cookie reads it from the saved entry registers; -1 when the rule reads
    /// nothing, -2 when the callee did not get its argument (no panic across `extern "C"`).
    extern "C" fn decode_body(_ctx: usize, batch: LlamaBatch) -> i32 {
        let Some(decode) = LLAMA_CPP.entries.iter().find(|e| e.symbol == "llama_decode") else { return -1 };
        // SAFETY: written just before the jump here, on this thread.
        let regs = unsafe { &*ENTRY.0.get() };
        let arg = |n: u8| regs.args.get(n as usize).copied();
        let Some(addr) = call_arg::i32_address(decode.n_tokens.cookie(), arg, regs.sp) else { return -1 };
        if batch.n_tokens != N_TOKENS {
            return -2;
        }
        // SAFETY: the rule's address, in the caller's frame while this call runs (what the test checks).
        unsafe { std::ptr::read_volatile(addr as *const i32) }
    }

    const N_TOKENS: i32 = 4242;

    /// The `llama_decode` rule against this architecture's calling convention as the compiler
    /// implements it: a call with a known `n_tokens`, read back through the rule at entry.
    #[test]
    fn the_llama_decode_rule_reads_n_tokens_where_the_calling_convention_puts_it() {
        let batch = LlamaBatch { n_tokens: N_TOKENS, ptrs: [0x11, 0x22, 0x33, 0x44, 0x55, 0x66] };
        assert_eq!(std::mem::size_of::<LlamaBatch>(), 56);
        assert_eq!(std::hint::black_box(llama_decode_like)(0x1234, batch), N_TOKENS);
    }

    /// `prog` needs `liba.so`, which needs `libb.so`, which defines `llama_decode` (the shape of
    /// llama-bench, libllama-bench-impl and libllama), each found through its own `$ORIGIN` run
    /// path: the profile is found before the program runs.
    #[test]
    fn a_profile_in_a_library_that_a_library_needs_is_found() {
        let dir = std::env::temp_dir().join(format!("profile-needed-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cc = |args: &[&str]| {
            let out = std::process::Command::new("cc").current_dir(&dir).args(args).output().expect("cc");
            assert!(out.status.success(), "cc {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        };
        std::fs::write(dir.join("b.c"), "int llama_decode(void) { return 0; }\n").unwrap();
        std::fs::write(dir.join("a.c"), "int llama_decode(void);\nint a(void) { return llama_decode(); }\n").unwrap();
        std::fs::write(dir.join("main.c"), "int a(void);\nint main(void) { return a(); }\n").unwrap();
        cc(&["-shared", "-fPIC", "-o", "libb.so", "b.c"]);
        cc(&["-shared", "-fPIC", "-o", "liba.so", "a.c", "-L.", "-lb", "-Wl,-rpath,$ORIGIN"]);
        cc(&["-o", "prog", "main.c", "-L.", "-la", "-Wl,-rpath,$ORIGIN,-rpath-link,."]);
        let prog = dir.join("prog");
        let needed = needed_libraries(&prog);
        let pos = |name: &str| {
            needed.iter().position(|p| p == &dir.join(name)).unwrap_or_else(|| panic!("{name}: {needed:?}"))
        };
        assert!(pos("liba.so") < pos("libb.so"), "breadth first: {needed:?}");
        let found = detect(&[&LLAMA_CPP], &prog, None).expect("the profile, in libb.so");
        assert_eq!(found.path, dir.join("libb.so").canonicalize().unwrap());
        assert_eq!(found.entries.iter().map(|e| e.symbol).collect::<Vec<_>>(), ["llama_decode"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_program_without_engine_symbols_matches_no_profile() {
        let me = std::env::current_exe().unwrap();
        assert_eq!(detect(&[&LLAMA_CPP], &me, Some(std::process::id())), None);
        // Its libraries are found (libc at least) and mapped files are listed.
        assert!(needed_libraries(&me).iter().any(|p| p.to_string_lossy().contains("libc.so")));
        assert!(mapped_files(std::process::id()).iter().any(|p| p == &me.canonicalize().unwrap()));
    }
}
