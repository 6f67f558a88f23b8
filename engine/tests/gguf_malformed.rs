//! Malformed GGUF inputs give clear errors (never a panic or an out-of-bounds read).

use engine::gguf::{Gguf, GgufError, GgufWriter, TensorSpec, Value, encode_header};
use engine::quant::GgmlType;

fn meta() -> Vec<(String, Value)> {
    vec![
        ("general.architecture".into(), Value::String("qwen3moe".into())),
        ("general.alignment".into(), Value::U32(32)),
        ("test.array".into(), Value::Array(vec![Value::I32(1), Value::I32(-2)])),
    ]
}

fn specs() -> Vec<TensorSpec> {
    vec![
        TensorSpec { name: "a.weight".into(), dims: vec![64, 3], ty: GgmlType::F32 },
        TensorSpec { name: "b.weight".into(), dims: vec![32, 2, 4], ty: GgmlType::Q8_0 },
    ]
}

/// A valid file image written by the crate's own writer.
fn valid_image() -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ok.gguf");
    let mut w = GgufWriter::create(&path, &meta(), specs()).unwrap();
    w.write_tensor(&vec![0u8; 64 * 3 * 4]).unwrap();
    w.write_tensor(&vec![0u8; 8 * 34]).unwrap();
    w.finish().unwrap();
    std::fs::read(&path).unwrap()
}

fn parse(bytes: Vec<u8>) -> Result<Gguf, GgufError> {
    Gguf::from_bytes("test.gguf", bytes)
}

#[test]
fn valid_file_round_trips() {
    let g = parse(valid_image()).expect("valid image parses");
    assert_eq!(g.version, 3);
    assert_eq!(g.architecture().unwrap(), "qwen3moe");
    assert_eq!(g.get("test.array"), Some(&Value::Array(vec![Value::I32(1), Value::I32(-2)])));
    let b = g.tensor("b.weight").unwrap();
    assert_eq!(b.size, 8 * 34);
    assert_eq!(b.offset % 32, 0);
    assert_eq!(b.n_slices(), 4);
    let r1 = b.slice_range(1).unwrap();
    assert_eq!(r1.end - r1.start, 2 * 34);
    assert_eq!(r1.start, b.offset + 2 * 34);
    assert!(b.slice_range(4).is_none());
}

#[test]
fn every_truncation_is_an_error() {
    let img = valid_image();
    let g = parse(img.clone()).unwrap();
    let data_end = g.tensors.iter().map(|t| t.offset + t.size).max().unwrap() as usize;
    // Every prefix shorter than the end of the last tensor must fail cleanly.
    for len in (0..data_end).step_by(7).chain([data_end - 1]) {
        let err = parse(img[..len].to_vec()).expect_err(&format!("prefix of {len} bytes parsed"));
        let msg = err.to_string();
        assert!(msg.contains("test.gguf"), "error does not name the file: {msg}");
    }
}

#[test]
fn truncated_header_names_what_is_missing() {
    let img = valid_image();
    let msg = parse(img[..10].to_vec()).unwrap_err().to_string();
    assert!(msg.contains("truncated") && msg.contains("tensor count"), "{msg}");
}

#[test]
fn bad_magic_and_version() {
    let mut img = valid_image();
    img[0] = b'X';
    assert!(matches!(parse(img).unwrap_err(), GgufError::BadMagic { .. }));
    let mut img = valid_image();
    img[4..8].copy_from_slice(&7u32.to_le_bytes());
    assert!(matches!(parse(img).unwrap_err(), GgufError::BadVersion { version: 7, .. }));
}

#[test]
fn bad_tensor_offset_is_rejected() {
    // Tensor b claims an offset past the end of the file.
    let mut sp = specs();
    sp.truncate(1);
    let mut header = encode_header(&meta(), &sp, 32);
    // The last 8 bytes of the header are the single tensor's offset.
    let n = header.len();
    header[n - 8..].copy_from_slice(&(1u64 << 20).to_le_bytes());
    header.resize(header.len().next_multiple_of(32) + 64 * 3 * 4, 0);
    let msg = parse(header).unwrap_err().to_string();
    assert!(msg.contains("a.weight") && msg.contains("beyond the end"), "{msg}");
}

#[test]
fn misaligned_offset_is_rejected() {
    let mut sp = specs();
    sp.truncate(1);
    let mut header = encode_header(&meta(), &sp, 32);
    let n = header.len();
    header[n - 8..].copy_from_slice(&4u64.to_le_bytes());
    header.resize(header.len().next_multiple_of(32) + 64 * 3 * 4 + 32, 0);
    let msg = parse(header).unwrap_err().to_string();
    assert!(msg.contains("alignment"), "{msg}");
}

#[test]
fn absurd_sizes_are_rejected() {
    // Absurd tensor count.
    let mut img = valid_image();
    img[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    let msg = parse(img).unwrap_err().to_string();
    assert!(msg.contains("absurd"), "{msg}");

    // Absurd string length in the first key.
    let mut img = valid_image();
    img[24..32].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    assert!(parse(img).is_err());

    // Absurd dimensions: 2^40 × 2^40 elements.
    let sp = vec![TensorSpec { name: "huge".into(), dims: vec![1 << 40, 1 << 40], ty: GgmlType::F32 }];
    let mut header = encode_header(&meta(), &sp, 32);
    header.resize(header.len().next_multiple_of(32) + 64, 0);
    let msg = parse(header).unwrap_err().to_string();
    assert!(msg.contains("huge") && msg.contains("absurd"), "{msg}");

    // Array count larger than the file.
    let m = vec![("k".to_owned(), Value::Array(vec![Value::U8(1); 3]))];
    let mut img = encode_header(&m, &[], 32);
    // key: 8 + 1 bytes, type 4, elem type 4, then the count.
    let at = 24 + 8 + 1 + 4 + 4;
    img[at..at + 8].copy_from_slice(&(1u64 << 23).to_le_bytes());
    let msg = parse(img).unwrap_err().to_string();
    assert!(msg.contains("truncated"), "{msg}");
}

#[test]
fn unknown_types_and_bad_shapes() {
    let sp = vec![TensorSpec { name: "odd".into(), dims: vec![33, 2], ty: GgmlType::Q8_0 }];
    let mut header = encode_header(&meta(), &sp, 32);
    header.resize(header.len().next_multiple_of(32) + 256, 0);
    let msg = parse(header).unwrap_err().to_string();
    assert!(msg.contains("odd") && msg.contains("block size"), "{msg}");

    let sp = vec![TensorSpec { name: "t".into(), dims: vec![32], ty: GgmlType::F32 }];
    let mut header = encode_header(&meta(), &sp, 32);
    let n = header.len();
    // ggml type id sits just before the 8-byte offset.
    header[n - 12..n - 8].copy_from_slice(&9999u32.to_le_bytes());
    header.resize(header.len().next_multiple_of(32) + 128, 0);
    let msg = parse(header).unwrap_err().to_string();
    assert!(msg.contains("unknown ggml type 9999"), "{msg}");

    // Unknown metadata value type.
    let mut img = encode_header(&[("k".to_owned(), Value::U8(1))], &[], 32);
    let at = 24 + 8 + 1;
    img[at..at + 4].copy_from_slice(&77u32.to_le_bytes());
    let msg = parse(img).unwrap_err().to_string();
    assert!(msg.contains("unknown value type 77"), "{msg}");
}

#[test]
fn missing_file_names_the_path() {
    let msg = Gguf::open("/nonexistent/dir/model.gguf").unwrap_err().to_string();
    assert!(msg.contains("/nonexistent/dir/model.gguf"), "{msg}");
}

#[test]
fn random_corruption_never_panics() {
    let img = valid_image();
    let mut rng = engine::synth::SplitMix::new(99);
    for _ in 0..2000 {
        let mut m = img.clone();
        for _ in 0..4 {
            let i = (rng.next_u64() % m.len() as u64) as usize;
            m[i] = rng.next_u64() as u8;
        }
        let cut = (rng.next_u64() % (m.len() as u64 + 1)) as usize;
        m.truncate(cut);
        let _ = parse(m); // Ok or Err, never a panic.
    }
}

/// `from_header` parses the first bytes of a file as `from_bytes` parses the whole image; a
/// prefix that ends inside the header says how far the header reaches at least, and growing
/// the prefix by that rule ends at the same table.
#[test]
fn a_header_prefix_parses_like_the_whole_file() {
    let img = valid_image();
    let whole = parse(img.clone()).unwrap();
    let len = img.len() as u64;
    let header_end = whole.data_offset as usize;
    let h = Gguf::from_header("test.gguf", img[..header_end].to_vec(), len).expect("the header alone parses");
    let table = |g: &Gguf| g.tensors.iter().map(|t| (t.name.clone(), t.offset, t.size)).collect::<Vec<_>>();
    assert_eq!((&h.metadata, table(&h), h.data_offset), (&whole.metadata, table(&whole), whole.data_offset));
    let mut prefix = 1usize;
    let grown = loop {
        match Gguf::from_header("test.gguf", img[..prefix].to_vec(), len) {
            Ok(g) => break g,
            Err(GgufError::Truncated { needed, len: l, .. }) => {
                assert_eq!(l, len, "a truncation names the file's length, not the prefix's");
                let next = prefix + needed as usize;
                assert!(next > prefix && next <= header_end, "prefix {prefix}: the header reaches {next}");
                prefix = next;
            }
            Err(e) => panic!("prefix {prefix}: {e}"),
        }
    };
    assert_eq!(table(&grown), table(&h));
    // Tensor ranges are checked against the file's length, not the prefix's.
    let short = Gguf::from_header("test.gguf", img[..header_end].to_vec(), header_end as u64 + 8);
    assert!(matches!(short, Err(GgufError::BadTensor { .. }) | Err(GgufError::Truncated { .. })), "{short:?}");
}
