//! ELF facts the guest image needs: a binary's interpreter and needed libraries (to copy a
//! foreign-architecture program with its libraries), and the two BPF objects the guest loads to
//! find out whether its kernel attaches kprobe and fentry programs.
//!
//! The probe objects, as libbpf reads them: a relocatable ELF for `EM_BPF`, one program in a
//! section named `kprobe/vfs_read` or `fentry/vfs_read` (the section name is the program type
//! and the attach point; `vfs_read` is global, traceable and runs on every `read`), a global
//! function symbol naming the program, and a `license` section with `GPL`. The program is
//! `r0 = 0; exit`: it only has to run, and the kernel counts its runs itself when
//! `kernel.bpf_stats_enabled` is 1 (`run_cnt` in `bpftool prog show`).

use anyhow::{Context, Result};
use object::{
    Architecture, BinaryFormat, Endianness, SectionKind, SymbolFlags, SymbolKind, SymbolScope,
    read::elf::{ElfFile64, ProgramHeader},
    write::{self, Symbol, SymbolSection},
};

/// `DT_NEEDED` entries and the `PT_INTERP` path of a 64-bit ELF file.
pub fn needs(data: &[u8]) -> Result<(Vec<String>, Option<String>)> {
    let f = ElfFile64::<Endianness>::parse(data).context("not a 64-bit ELF file")?;
    let (endian, sections) = (f.endian(), f.elf_section_table());
    let table = sections.dynamic_table(endian, data)?;
    let mut libs = Vec::new();
    for d in table.iter() {
        if d.tag == object::elf::DT_NEEDED {
            libs.push(String::from_utf8_lossy(table.string(d)?).into_owned());
        }
    }
    let mut interp = None;
    for ph in f.elf_program_headers() {
        if let Some(i) = ph.interpreter(endian, data)? {
            interp = Some(String::from_utf8_lossy(i).into_owned());
        }
    }
    Ok((libs, interp))
}

/// `r0 = 0` (BPF_ALU64 | BPF_MOV | BPF_K), then `exit` (BPF_JMP | BPF_EXIT).
const RETURN_ZERO: [u8; 16] = [0xb7, 0, 0, 0, 0, 0, 0, 0, 0x95, 0, 0, 0, 0, 0, 0, 0];

/// The function every probe program attaches to.
pub const PROBE_TARGET: &str = "vfs_read";

/// A BPF object with one program `vmtest_<kind>` in section `<kind>/vfs_read`.
pub fn probe_object(kind: &str) -> Result<Vec<u8>> {
    let mut obj = write::Object::new(BinaryFormat::Elf, Architecture::Bpf, Endianness::Little);
    let prog = obj.add_section(Vec::new(), format!("{kind}/{PROBE_TARGET}").into_bytes(), SectionKind::Text);
    obj.append_section_data(prog, &RETURN_ZERO, 8);
    obj.add_symbol(Symbol {
        name: format!("vmtest_{kind}").into_bytes(),
        value: 0,
        size: RETURN_ZERO.len() as u64,
        kind: SymbolKind::Text,
        scope: SymbolScope::Dynamic,
        weak: false,
        section: SymbolSection::Section(prog),
        flags: SymbolFlags::None,
    });
    let license = obj.add_section(Vec::new(), b"license".to_vec(), SectionKind::Data);
    obj.append_section_data(license, b"GPL\0", 1);
    obj.write().context("writing a BPF object")
}

#[cfg(test)]
mod tests {
    use object::{Object, ObjectSection, ObjectSymbol};

    use super::*;

    #[test]
    fn probe_objects_are_what_libbpf_reads() {
        for kind in ["kprobe", "fentry"] {
            let bytes = probe_object(kind).unwrap();
            let f = object::File::parse(&*bytes).unwrap();
            assert_eq!(f.architecture(), Architecture::Bpf);
            assert_eq!(f.kind(), object::ObjectKind::Relocatable);
            let prog = f.section_by_name(&format!("{kind}/vfs_read")).unwrap();
            assert_eq!(prog.data().unwrap(), RETURN_ZERO);
            assert_eq!(f.section_by_name("license").unwrap().data().unwrap(), b"GPL\0");
            let sym = f.symbols().find(|s| s.name() == Ok(&format!("vmtest_{kind}"))).unwrap();
            assert!(sym.is_global() && sym.kind() == SymbolKind::Text && sym.section_index() == Some(prog.index()));
        }
    }

    #[test]
    fn a_host_program_needs_libc_and_the_loader() {
        let data = std::fs::read("/bin/sh").unwrap();
        let (libs, interp) = needs(&data).unwrap();
        assert!(libs.iter().any(|l| l == "libc.so.6"), "{libs:?}");
        assert!(interp.unwrap().contains("ld-linux"));
    }
}
