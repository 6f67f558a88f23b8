//! Offsets of kernel structure members and values of kernel enums from the kernel's BTF
//! (`/sys/kernel/btf/vmlinux`), for programs that read a kernel structure or compare a
//! tracepoint's enum argument (Rust eBPF has no CO-RE relocations).
//!
//! The format (Linux, `Documentation/bpf/btf.rst`), in the kernel's byte order:
//! - a header: `u16 magic` (0xeB9F), `u8 version`, `u8 flags`, `u32 hdr_len`, then `u32`
//!   `type_off`, `type_len`, `str_off`, `str_len`, the sections' offsets counted from the end
//!   of the header;
//! - the type section: one 12-byte `btf_type` per type (`u32 name_off`; `u32 info`, where bits
//!   0–15 are `vlen`, bits 24–28 the kind and bit 31 `kind_flag`; `u32 size` or `type`), each
//!   followed by data of its kind ([`extra_bytes`]); a struct's is one 12-byte member per `vlen`
//!   (`u32 name_off`, `u32 type`, `u32 offset`: the member's offset in bits, or with the struct's
//!   `kind_flag` set, bits 0–23 the bit offset and bits 24–31 a bitfield's size);
//! - the string section: NUL-terminated names, `name_off` counting from its start.
//!
//! An enum's data is one 8-byte entry per `vlen` (`u32 name_off`, `u32 val`; signed when the
//! enum's `kind_flag` is set).
//!
//! A typedef's `type` (the `u32` after `info`) is the ID of the type it names, types numbered
//! from 1 in the order of the type section; a pointer's the same; a function prototype's data is
//! one 8-byte parameter per `vlen` (`u32 name_off`, `u32 type`).
//!
//! [`member_offset`] gives a named member's byte offset in the first struct of that name that
//! has it; a bitfield member has none. [`enum_value`] gives a named value of the first enum of
//! that name that has it. [`pointer_params`] gives how many parameters the function a typedef of
//! a function pointer points to takes (a raw tracepoint's `btf_trace_<name>`: its context, then
//! the tracepoint's arguments).

/// The kernel's BTF of its own types.
pub const VMLINUX: &str = "/sys/kernel/btf/vmlinux";

const MAGIC: u16 = 0xeb9f;
const KIND_PTR: u32 = 2;
const KIND_STRUCT: u32 = 4;
const KIND_ENUM: u32 = 6;
const KIND_TYPEDEF: u32 = 8;
const KIND_FUNC_PROTO: u32 = 13;

/// Bytes of kind-specific data after a `btf_type` of `kind` with `vlen` entries, `None` for a kind
/// this reader does not know (a newer kernel's: the rest cannot be walked).
fn extra_bytes(kind: u32, vlen: usize) -> Option<usize> {
    Some(match kind {
        2 | 7 | 8 | 9 | 10 | 11 | 12 | 16 | 18 => 0, // PTR FWD TYPEDEF VOLATILE CONST RESTRICT FUNC FLOAT TYPE_TAG
        1 | 14 | 17 => 4,                            // INT VAR DECL_TAG
        3 => 12,                                     // ARRAY
        4 | 5 | 15 | 19 => 12 * vlen,                // STRUCT UNION DATASEC ENUM64
        6 | 13 => 8 * vlen,                          // ENUM FUNC_PROTO
        _ => return None,
    })
}

/// One type of a BTF blob: its name, kind, `vlen`, `kind_flag` and where its kind-specific data
/// starts.
struct Type<'a> {
    name: &'a [u8],
    kind: u32,
    vlen: usize,
    kind_flag: bool,
    data: usize,
}

/// A BTF blob, checked: the type section's bounds and the string section.
struct Blob<'a> {
    btf: &'a [u8],
    types: std::ops::Range<usize>,
    strings: std::ops::Range<usize>,
}

fn truncated() -> String {
    "BTF truncated".to_string()
}

impl<'a> Blob<'a> {
    fn new(btf: &'a [u8]) -> Result<Self, String> {
        let b = Blob { btf, types: 0..0, strings: 0..0 };
        if b.u16_at(0) != Some(MAGIC) {
            return Err("not BTF of this machine's byte order (bad magic)".into());
        }
        let hdr_len = b.u32_at(4).ok_or_else(truncated)? as usize;
        let [type_off, type_len, str_off, str_len] =
            [8, 12, 16, 20].map(|o| b.u32_at(o).map(|v| v as usize).ok_or_else(truncated));
        let (type_start, str_start) = (hdr_len + type_off?, hdr_len + str_off?);
        let (type_end, str_end) = (type_start + type_len?, str_start + str_len?);
        if type_end > btf.len() || str_end > btf.len() {
            return Err(truncated());
        }
        Ok(Blob { btf, types: type_start..type_end, strings: str_start..str_end })
    }

    fn u16_at(&self, o: usize) -> Option<u16> {
        self.btf.get(o..o + 2).map(|b| u16::from_ne_bytes([b[0], b[1]]))
    }

    fn u32_at(&self, o: usize) -> Option<u32> {
        self.btf.get(o..o + 4).map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// The name at `off` in the string section.
    fn name(&self, off: u32) -> &'a [u8] {
        let s = self.btf.get(self.strings.start + off as usize..self.strings.end).unwrap_or_default();
        &s[..s.iter().position(|b| *b == 0).unwrap_or(s.len())]
    }

    /// Each type in order, with its ID, until `f` returns something, and that.
    fn walk<T>(&self, mut f: impl FnMut(u32, &Type<'a>) -> Result<Option<T>, String>) -> Result<Option<T>, String> {
        let (mut at, mut id) = (self.types.start, 1);
        while at + 12 <= self.types.end {
            let (name_off, info) = (self.u32_at(at).ok_or_else(truncated)?, self.u32_at(at + 4).ok_or_else(truncated)?);
            let (vlen, k, kind_flag) = ((info & 0xffff) as usize, (info >> 24) & 0x1f, info >> 31 == 1);
            let extra = extra_bytes(k, vlen).ok_or_else(|| format!("BTF kind {k} unknown to this reader"))?;
            let t = Type { name: self.name(name_off), kind: k, vlen, kind_flag, data: at + 12 };
            if let Some(v) = f(id, &t)? {
                return Ok(Some(v));
            }
            (at, id) = (at + 12 + extra, id + 1);
        }
        Ok(None)
    }

    /// The first type of `kind` named `name` for which `f` returns something, and that.
    fn find<T>(
        &self,
        kind: u32,
        name: &str,
        mut f: impl FnMut(&Type<'a>) -> Result<Option<T>, String>,
    ) -> Result<Option<T>, String> {
        self.walk(|_, t| if t.kind == kind && t.name == name.as_bytes() { f(t) } else { Ok(None) })
    }

    /// The kind, `vlen` and `type` of the type with ID `id`.
    fn by_id(&self, id: u32) -> Result<(u32, usize, u32), String> {
        self.walk(|i, t| {
            if i != id {
                return Ok(None);
            }
            Ok(Some((t.kind, t.vlen, self.u32_at(t.data - 4).ok_or_else(truncated)?)))
        })?
        .ok_or_else(|| format!("BTF type {id} is out of range"))
    }
}

/// The byte offset of member `member` of `struct strukt` in the BTF blob `btf`.
pub fn member_offset(btf: &[u8], strukt: &str, member: &str) -> Result<u32, String> {
    let b = Blob::new(btf)?;
    let mut found_struct = false;
    let off = b.find(KIND_STRUCT, strukt, |t| {
        found_struct = true;
        for m in (0..t.vlen).map(|i| t.data + 12 * i) {
            if b.name(b.u32_at(m).ok_or_else(truncated)?) != member.as_bytes() {
                continue;
            }
            let off = b.u32_at(m + 8).ok_or_else(truncated)?;
            let (bits, bitfield) = if t.kind_flag { (off & 0xff_ffff, off >> 24 != 0) } else { (off, false) };
            if bitfield || !bits.is_multiple_of(8) {
                return Err(format!("struct {strukt}.{member} is a bitfield"));
            }
            return Ok(Some(bits / 8));
        }
        Ok(None)
    })?;
    off.ok_or_else(|| {
        if found_struct {
            format!("struct {strukt} has no member {member} in this kernel's BTF")
        } else {
            format!("no struct {strukt} in this kernel's BTF")
        }
    })
}

/// The value of `name` in `enum en` (a 32-bit `BTF_KIND_ENUM`) in the BTF blob `btf`.
pub fn enum_value(btf: &[u8], en: &str, name: &str) -> Result<i64, String> {
    let b = Blob::new(btf)?;
    let mut found_enum = false;
    let v = b.find(KIND_ENUM, en, |t| {
        found_enum = true;
        for e in (0..t.vlen).map(|i| t.data + 8 * i) {
            if b.name(b.u32_at(e).ok_or_else(truncated)?) == name.as_bytes() {
                let v = b.u32_at(e + 4).ok_or_else(truncated)?;
                // `kind_flag` set: the enum is signed.
                return Ok(Some(if t.kind_flag { v as i32 as i64 } else { v as i64 }));
            }
        }
        Ok(None)
    })?;
    v.ok_or_else(|| {
        if found_enum {
            format!("enum {en} has no value {name} in this kernel's BTF")
        } else {
            format!("no enum {en} in this kernel's BTF")
        }
    })
}

/// How many parameters the function that typedef `name` points to takes (module doc).
pub fn pointer_params(btf: &[u8], name: &str) -> Result<usize, String> {
    let b = Blob::new(btf)?;
    let target = b.find(KIND_TYPEDEF, name, |t| b.u32_at(t.data - 4).ok_or_else(truncated).map(Some))?;
    let target = target.ok_or_else(|| format!("no typedef {name} in this kernel's BTF"))?;
    let not_fn = || format!("typedef {name} is not a function pointer in this kernel's BTF");
    let (kind, _, pointee) = b.by_id(target)?;
    if kind != KIND_PTR {
        return Err(not_fn());
    }
    match b.by_id(pointee)? {
        (KIND_FUNC_PROTO, vlen, _) => Ok(vlen),
        _ => Err(not_fn()),
    }
}

fn kernel_btf() -> Result<Vec<u8>, String> {
    std::fs::read(VMLINUX).map_err(|e| format!("{VMLINUX}: {e} (the kernel needs CONFIG_DEBUG_INFO_BTF)"))
}

/// [`enum_value`] in this kernel's BTF ([`VMLINUX`]).
pub fn kernel_enum_value(en: &str, name: &str) -> Result<i64, String> {
    enum_value(&kernel_btf()?, en, name)
}

/// [`member_offset`] in this kernel's BTF ([`VMLINUX`]).
pub fn kernel_member_offset(strukt: &str, member: &str) -> Result<u32, String> {
    member_offset(&kernel_btf()?, strukt, member)
}

/// How many arguments raw tracepoint `tracepoint` passes on this kernel ([`pointer_params`] of
/// its `btf_trace_<tracepoint>`, less the context).
pub fn kernel_raw_tracepoint_args(tracepoint: &str) -> Result<usize, String> {
    Ok(pointer_params(&kernel_btf()?, &format!("btf_trace_{tracepoint}"))?.saturating_sub(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A BTF blob of `types` (already encoded) and `strings`.
    fn blob(types: &[u32], strings: &[u8]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend(MAGIC.to_ne_bytes());
        b.extend([1u8, 0]);
        let type_len = types.len() as u32 * 4;
        for v in [24u32, 0, type_len, type_len, strings.len() as u32] {
            b.extend(v.to_ne_bytes());
        }
        for t in types {
            b.extend(t.to_ne_bytes());
        }
        b.extend(strings);
        b
    }

    #[test]
    fn finds_a_member_after_other_kinds_and_refuses_bitfields() {
        // Strings: 0 "", 1 "int", 5 "s", 7 "a", 9 "b", 11 "c".
        let strings = b"\0int\0s\0a\0b\0c\0";
        #[rustfmt::skip]
        let types = [
            1, 1 << 24, 4, 0x20, // INT "int", 4 bytes, 32 bits
            0, 6 << 24 | 1, 4, 7, 0, // ENUM with one value (8 bytes of data)
            5, 4 << 24 | 2, 8, 7, 1, 0, 9, 1, 32, // struct s { int a; int b; }
            5, 1 << 31 | 4 << 24 | 1, 4, 11, 1, 3 << 24 | 16, // struct s (kind_flag) { int c: 3 at bit 16 }
        ];
        let b = blob(&types, strings);
        assert_eq!(member_offset(&b, "s", "a"), Ok(0));
        assert_eq!(member_offset(&b, "s", "b"), Ok(4));
        assert_eq!(member_offset(&b, "s", "c"), Err("struct s.c is a bitfield".into()));
        assert_eq!(member_offset(&b, "s", "d"), Err("struct s has no member d in this kernel's BTF".into()));
        assert_eq!(member_offset(&b, "t", "a"), Err("no struct t in this kernel's BTF".into()));
        assert!(member_offset(&b[..30], "s", "a").is_err());
        assert!(member_offset(b"not btf at all", "s", "a").is_err());
        // The enum: no name, so not found by name; the values of a named one below.
        assert_eq!(enum_value(&b, "e", "x"), Err("no enum e in this kernel's BTF".into()));
    }

    #[test]
    fn finds_an_enum_value_signed_or_not() {
        // Strings: 0 "", 1 "e", 3 "A", 5 "B", 7 "f".
        let strings = b"\0e\0A\0B\0f\0";
        #[rustfmt::skip]
        let types = [
            1, 6 << 24 | 2, 4, 3, 23, 5, 24, // enum e { A = 23, B = 24 }
            7, 1 << 31 | 6 << 24 | 1, 4, 3, (-2i32) as u32, // signed enum f { A = -2 }
        ];
        let b = blob(&types, strings);
        assert_eq!(enum_value(&b, "e", "A"), Ok(23));
        assert_eq!(enum_value(&b, "e", "B"), Ok(24));
        assert_eq!(enum_value(&b, "f", "A"), Ok(-2));
        assert_eq!(enum_value(&b, "e", "C"), Err("enum e has no value C in this kernel's BTF".into()));
    }

    #[test]
    fn counts_the_parameters_of_a_function_pointer_typedef() {
        // Strings: 0 "", 1 "int", 5 "fp", 8 "ip".
        let strings = b"\0int\0fp\0ip\0";
        #[rustfmt::skip]
        let types = [
            1, 1 << 24, 4, 0x20, // [1] INT "int"
            0, 13 << 24 | 3, 0, 0, 1, 0, 1, 0, 1, // [2] FUNC_PROTO void (int, int, int)
            0, 2 << 24, 2, // [3] PTR to [2]
            5, 8 << 24, 3, // [4] TYPEDEF "fp" = [3]
            8, 8 << 24, 1, // [5] TYPEDEF "ip" = [1]
            0, 2 << 24, 1, // [6] PTR to [1]
            8, 8 << 24, 6, // [7] TYPEDEF "ip" = [6] (the first "ip" is what is found)
        ];
        let b = blob(&types, strings);
        assert_eq!(pointer_params(&b, "fp"), Ok(3));
        assert_eq!(pointer_params(&b, "ip"), Err("typedef ip is not a function pointer in this kernel's BTF".into()));
        assert_eq!(pointer_params(&b, "gp"), Err("no typedef gp in this kernel's BTF".into()));
        // A typedef naming a type that is not there.
        let b = blob(&[5, 8 << 24, 9], strings);
        assert_eq!(pointer_params(&b, "fp"), Err("BTF type 9 is out of range".into()));
    }

    /// This kernel's `sched_switch` raw tracepoint (what `switch_raw` reads) against bpftool's
    /// dump of the same BTF: its `btf_trace_sched_switch` points to a prototype of as many
    /// parameters as `kernel_raw_tracepoint_args` says, plus the context.
    #[test]
    fn sched_switch_arguments_match_bpftool() {
        let n = kernel_raw_tracepoint_args("sched_switch").expect("this kernel has BTF");
        let out = std::process::Command::new("bpftool")
            .args(["btf", "dump", "file", VMLINUX, "format", "raw"])
            .output()
            .expect("bpftool (cargo xtask setup installs it)");
        let text = String::from_utf8_lossy(&out.stdout);
        let id_of = |l: &str| l.strip_prefix('[')?.split(']').next()?.parse::<u32>().ok();
        let type_of = |l: &str| l.split("type_id=").nth(1)?.split_whitespace().next()?.parse::<u32>().ok();
        let line = |id: u32| text.lines().find(|l| id_of(l) == Some(id)).unwrap_or_default();
        let typedef = text.lines().find(|l| l.contains("TYPEDEF 'btf_trace_sched_switch'")).expect("bpftool's typedef");
        let ptr = line(type_of(typedef).expect("typedef's type_id"));
        let proto = line(type_of(ptr).expect("pointer's type_id"));
        assert!(proto.contains("FUNC_PROTO"), "{proto}");
        let vlen = proto.split("vlen=").nth(1).and_then(|v| v.split_whitespace().next()?.parse::<usize>().ok());
        assert_eq!(vlen, Some(n + 1), "bpftool: {proto}");
    }

    /// This kernel's `vm_event_item` values of `PGFAULT` and `PGMAJFAULT` (what the memcg fault
    /// close compares) against bpftool's dump of the same BTF.
    #[test]
    fn vm_event_items_match_bpftool() {
        let out = std::process::Command::new("bpftool")
            .args(["btf", "dump", "file", VMLINUX, "format", "raw"])
            .output()
            .expect("bpftool (cargo xtask setup installs it)");
        let text = String::from_utf8_lossy(&out.stdout);
        for name in ["PGFAULT", "PGMAJFAULT"] {
            let v = kernel_enum_value("vm_event_item", name).expect("this kernel has BTF with enum vm_event_item");
            let mut in_enum = false;
            let mut dumped = None;
            for l in text.lines() {
                if l.starts_with('[') {
                    in_enum = l.contains("ENUM 'vm_event_item'");
                } else if in_enum && l.trim_start().starts_with(&format!("'{name}' ")) {
                    dumped = l.split("val=").nth(1).and_then(|v| v.trim().parse::<i64>().ok());
                    break;
                }
            }
            assert_eq!(Some(v), dumped, "bpftool's value of {name}");
        }
    }

    /// This kernel's `block_device.bd_dev` against bpftool's dump of the same BTF.
    #[test]
    fn block_device_bd_dev_matches_bpftool() {
        let off = kernel_member_offset("block_device", "bd_dev").expect("this kernel has BTF");
        let out = std::process::Command::new("bpftool")
            .args(["btf", "dump", "file", VMLINUX, "format", "raw"])
            .output()
            .expect("bpftool (cargo xtask setup installs it)");
        let text = String::from_utf8_lossy(&out.stdout);
        let mut in_struct = false;
        let mut bits = None;
        for l in text.lines() {
            if l.starts_with('[') {
                in_struct = l.contains("STRUCT 'block_device'");
            } else if in_struct && l.trim_start().starts_with("'bd_dev'") {
                bits = l.split("bits_offset=").nth(1).and_then(|v| v.split_whitespace().next()?.parse::<u32>().ok());
                break;
            }
        }
        assert_eq!(Some(off * 8), bits, "bpftool's bits_offset of block_device.bd_dev");
    }
}
