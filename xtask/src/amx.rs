//! The AMX check: no cached llama.cpp build may contain an AMX instruction.
//!
//! Rule: disassemble every ggml library of a build (`objdump -d --no-show-raw-insn` on
//! `libggml*.so` in its `bin/`) and count the instructions whose mnemonic is an AMX one:
//! `ldtilecfg`, `sttilecfg`, `tilerelease`, `tilezero`, `tileloadd`, `tileloaddt1`, `tilestored`,
//! or any `tdp…` (`tdpbssd`, `tdpbf16ps`, `tdpfp16ps`, …; no other x86 mnemonic starts so).
//! The mnemonic is the first word of an instruction line's text after the address, past any
//! prefix words (`{vex}`, `rex.W`, `data16`, `lock`, `notrack`, `bnd`, segment overrides).
//! Any count above zero fails, with the counts per library and per mnemonic.
//!
//! Why: AMX needs a per-thread permission (`arch_prctl(ARCH_REQ_XCOMP_PERM)`) that ggml requests
//! only in some threads, so on VMs that expose AMX an AMX build dies with SIGILL (on
//! `tilezero`) or SIGSEGV; a `GGML_NATIVE` build of this llama.cpp had 190 such instructions.
//! The builds are made with explicit ISA flags and AMX off (`llama.rs`); this proves it on any
//! machine, whether or not its CPU reports AMX.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

const AMX_MNEMONICS: [&str; 7] =
    ["ldtilecfg", "sttilecfg", "tilerelease", "tilezero", "tileloadd", "tileloaddt1", "tilestored"];

const PREFIXES: [&str; 11] = ["data16", "addr32", "lock", "notrack", "bnd", "cs", "ds", "es", "fs", "gs", "ss"];

fn is_amx(mnemonic: &str) -> bool {
    AMX_MNEMONICS.contains(&mnemonic) || mnemonic.starts_with("tdp")
}

/// The mnemonic of one `objdump -d` line, if it is an instruction line (`  addr:\t…`).
fn mnemonic(line: &str) -> Option<&str> {
    let (addr, rest) = line.split_once(':')?;
    let addr = addr.trim();
    if addr.is_empty() || !addr.bytes().all(|b| b.is_ascii_hexdigit()) || !rest.starts_with('\t') {
        return None;
    }
    // With raw bytes shown the text is `\tbytes\tinsn`; without, `\tinsn`.
    let insn = rest.rsplit('\t').next()?;
    insn.split_whitespace().find(|w| !(w.starts_with('{') || w.starts_with("rex") || PREFIXES.contains(w)))
}

/// AMX instruction counts by mnemonic in an `objdump -d` listing.
pub fn count(listing: impl Iterator<Item = String>) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for line in listing {
        if let Some(m) = mnemonic(&line).filter(|m| is_amx(m)) {
            *counts.entry(m.to_owned()).or_insert(0) += 1;
        }
    }
    counts
}

/// The ggml libraries of a build: `libggml*.so` in its `bin/` (symlinks to versioned files are
/// followed by objdump; each library is listed once).
fn ggml_libraries(bin: &Path) -> Result<Vec<PathBuf>> {
    let mut libs: Vec<PathBuf> = std::fs::read_dir(bin)
        .with_context(|| format!("listing {}", bin.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libggml") && n.ends_with(".so"))
        })
        .collect();
    libs.sort();
    if libs.is_empty() {
        bail!("no libggml*.so in {}: the llama.cpp build is incomplete", bin.display());
    }
    Ok(libs)
}

fn scan(lib: &Path) -> Result<(BTreeMap<String, usize>, usize)> {
    let mut child = Command::new("objdump")
        .args(["-d", "--no-show-raw-insn"])
        .arg(lib)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot run objdump (binutils): install it with `apt-get install binutils`")?;
    let out = child.stdout.take().context("objdump: no stdout")?;
    let mut lines = 0usize;
    let counts = count(BufReader::new(out).lines().map_while(Result::ok).inspect(|_| lines += 1));
    let res = child.wait_with_output().context("waiting for objdump")?;
    if !res.status.success() {
        bail!("objdump -d {} failed ({}): {}", lib.display(), res.status, String::from_utf8_lossy(&res.stderr));
    }
    Ok((counts, lines))
}

/// Scans every ggml library of each named build directory (`(name, bin dir)`); fails with the
/// counts if any AMX instruction is found.
pub fn check(builds: &[(String, PathBuf)]) -> Result<()> {
    let mut found = Vec::new();
    for (name, bin) in builds {
        for lib in ggml_libraries(bin)? {
            let (counts, lines) = scan(&lib)?;
            let total: usize = counts.values().sum();
            println!("amx check: {name}: {}: {total} AMX instructions in {lines} lines of disassembly", lib.display());
            if total > 0 {
                let each: Vec<String> = counts.iter().map(|(m, n)| format!("{m} {n}")).collect();
                found.push(format!("{}: {total} ({})", lib.display(), each.join(", ")));
            }
        }
    }
    if !found.is_empty() {
        bail!(
            "AMX instructions in the cached llama.cpp builds (they fault on VMs that expose AMX; the builds must \
             have AMX off):\n  {}\ndelete the build directories above and run again",
            found.join("\n  ")
        );
    }
    println!("amx check: no AMX instruction in {} build(s)", builds.len());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LISTING: &str = "
libggml-cpu.so:     file format elf64-x86-64


Disassembly of section .text:

0000000000012340 <_ZN3amx4tileEv>:
   12340:\tc4 e2 78 49 00       \tldtilecfg (%rax)
   12345:\tc4 e2 7b 49 c0       \ttilezero %tmm0
   1234a:\tc4 a2 7b 4b 0c 08    \ttileloadd (%rax,%r9,1),%tmm1
   12350:\tc4 e2 73 5e c1       \ttdpbssd %tmm1,%tmm1,%tmm0
   12355:\tc4 e2 72 5c c1       \ttdpbf16ps %tmm1,%tmm1,%tmm0
   1235a:\tc4 e2 7a 4b 04 08    \ttilestored %tmm0,(%rax,%r9,1)
   12360:\tc4 e2 78 49 c0       \ttilerelease
   12365:\t48 8d 05 00 00 00 00 \tlea    0x0(%rip),%rax        # 1236c <tilezero_in_a_symbol>
   1236c:\tf0 48 0f b1 11       \tlock cmpxchg %rdx,(%rcx)
   12371:\t62 f1 7c 48 28 c1    \t{evex} vmovaps %zmm1,%zmm0
   12377:\tc3                   \tret
0000000000012380 <tdp_helper>:
   12380:\t3e ff e0             \tnotrack jmp *%rax
";

    #[test]
    fn counts_amx_instructions_only() {
        let counts = count(LISTING.lines().map(str::to_owned));
        let want: BTreeMap<String, usize> = [
            ("ldtilecfg", 1),
            ("tdpbf16ps", 1),
            ("tdpbssd", 1),
            ("tileloadd", 1),
            ("tilerelease", 1),
            ("tilestored", 1),
            ("tilezero", 1),
        ]
        .into_iter()
        .map(|(m, n)| (m.to_owned(), n))
        .collect();
        assert_eq!(counts, want);
    }

    #[test]
    fn without_raw_bytes_and_past_prefixes() {
        let lines =
            ["   4a0:\ttilezero %tmm3", "   4a5:\t{vex} tdpbusd %tmm2,%tmm1,%tmm0", "   4aa:\tlock addl $0x1,(%rax)"];
        let counts = count(lines.into_iter().map(str::to_owned));
        assert_eq!(counts.values().sum::<usize>(), 2);
        assert_eq!(mnemonic("   4aa:\tlock addl $0x1,(%rax)"), Some("addl"));
        assert_eq!(mnemonic("0000000000012380 <tdp_helper>:"), None);
    }

    /// The scanner on real `objdump` output: a library with AMX instructions (inline assembly,
    /// assembled by binutils' `as`) fails the check with their count; one without passes.
    #[test]
    fn a_real_library_with_amx_fails_the_check() {
        let dir = std::env::temp_dir().join(format!("amx-check-test-{}", std::process::id()));
        let bin = dir.join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let c = dir.join("amx.c");
        std::fs::write(
            &c,
            r#"void amx(void *cfg, void *p, long stride) {
    __asm__ volatile("ldtilecfg (%0)" :: "r"(cfg) : "memory");
    __asm__ volatile("tilezero %%tmm0" ::: "memory");
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm1" :: "r"(p), "r"(stride) : "memory");
    __asm__ volatile("tdpbssd %%tmm1, %%tmm2, %%tmm0" ::: "memory");
    __asm__ volatile("tilestored %%tmm0, (%0,%1,1)" :: "r"(p), "r"(stride) : "memory");
    __asm__ volatile("tilerelease" ::: "memory");
}
int tilezero_is_only_a_name(int x) { return x + 1; }
"#,
        )
        .unwrap();
        let lib = |name: &str, src: &Path| {
            let out = Command::new("cc").args(["-shared", "-fPIC", "-O2", "-o"]).arg(bin.join(name)).arg(src).output();
            assert!(out.as_ref().is_ok_and(|o| o.status.success()), "cc failed: {out:?}");
        };
        lib("libggml-amx.so", &c);
        let (counts, lines) = scan(&bin.join("libggml-amx.so")).unwrap();
        assert!(lines > 10);
        let want: BTreeMap<String, usize> =
            ["ldtilecfg", "tdpbssd", "tileloadd", "tilerelease", "tilestored", "tilezero"]
                .map(|m| (m.to_owned(), 1))
                .into();
        assert_eq!(counts, want);
        let err = check(&[("amx".to_owned(), bin.clone())]).unwrap_err().to_string();
        assert!(err.contains("libggml-amx.so: 6 (ldtilecfg 1, tdpbssd 1"), "{err}");
        std::fs::remove_file(bin.join("libggml-amx.so")).unwrap();
        let clean = dir.join("clean.c");
        std::fs::write(&clean, "int tilezero(int x) { return x * 3; }\n").unwrap();
        lib("libggml-clean.so", &clean);
        check(&[("clean".to_owned(), bin.clone())]).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_clean_listing_counts_nothing() {
        let clean = LISTING.lines().filter(|l| !l.contains("tile") && !l.contains("tdpb")).map(str::to_owned);
        assert!(count(clean).is_empty());
    }
}
