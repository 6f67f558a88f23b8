//! Dense-weight placement in the library: same numbers from every policy, dense ranges served
//! from the anonymous copy, residency measured by mincore.

mod common;

use engine::model::{Model, Session};
use engine::placement::DensePolicy;
use engine::synth::{QuantMix, SynthConfig, write_model};

fn tiny(dir: &std::path::Path) -> std::path::PathBuf {
    let p = dir.join("tiny.gguf");
    let mut c = SynthConfig::preset("tiny").unwrap();
    c.quant = QuantMix::Q4KM;
    write_model(&c, &p, 2, |_| {}).unwrap();
    p
}

#[test]
fn every_policy_computes_the_same_logits() {
    let d = tempfile::tempdir().unwrap();
    let p = tiny(d.path());
    let mut reference: Option<Vec<f32>> = None;
    for policy in [DensePolicy::Mmap, DensePolicy::Anon, DensePolicy::Locked] {
        let m = Model::load_with(&p, policy).unwrap();
        assert_eq!(m.placement.dense, policy);
        let total: u64 = m.gguf.tensors.iter().map(|t| t.size).sum();
        assert_eq!(m.placement.dense_bytes + m.placement.expert_bytes, total);
        let mut s = Session::new(&m, 2, 64);
        let mut logits = s.step(&[1, 2, 3, 4]).unwrap().to_vec();
        logits.extend_from_slice(s.step(&[5]).unwrap());
        match &reference {
            None => reference = Some(logits),
            Some(r) => assert!(r == &logits, "{policy:?} computes different logits than mmap"),
        }
    }
}

#[test]
fn dense_ranges_come_from_the_copy_and_experts_from_the_mapping() {
    let d = tempfile::tempdir().unwrap();
    let p = tiny(d.path());
    let m = Model::load_with(&p, DensePolicy::Anon).unwrap();
    let file = m.gguf.bytes().as_ptr_range();
    let inside = |b: &[u8]| file.contains(&b.as_ptr());
    let (a, e) = (m.layers[0].self_attn().unwrap(), m.layers[0].moe().unwrap());
    for w in [&a.wq, &a.wk, &a.wv, &a.wo, &e.router, &m.tok_embd, &m.output] {
        let b = m.bytes(w.range.clone());
        assert!(!inside(b), "{} is read from the file mapping under anon", w.name);
        assert_eq!(b, &m.gguf.bytes()[w.range.clone()], "{}: copy differs from the file", w.name);
        // A sub-range (an embedding row) is served from the copy too.
        let sub = w.range.start + 32..w.range.start + 64;
        assert!(!inside(m.bytes(sub.clone())));
        assert_eq!(m.bytes(sub.clone()), &m.gguf.bytes()[sub]);
    }
    assert!(inside(m.bytes(e.gate_exps.expert_range(1))), "experts stay on the mapping");
    assert!(m.placement.copy_bytes() >= m.placement.dense_bytes as usize);

    let mm = Model::load_with(&p, DensePolicy::Mmap).unwrap();
    assert!(mm.gguf.bytes().as_ptr_range().contains(&mm.bytes(mm.output.range.clone()).as_ptr()));
    assert_eq!(mm.placement.copy_bytes(), 0);
}

#[test]
fn mmap_residency_follows_the_page_cache() {
    let d = tempfile::tempdir().unwrap();
    // Big dense tensors (a 16k vocabulary), so that the small reads at load (header, norms) and
    // their read-around cover little of them.
    let p = d.path().join("vocab.gguf");
    let mut c = SynthConfig::preset("tiny").unwrap();
    c.vocab = 16384;
    c.hidden = 512;
    write_model(&c, &p, 2, |_| {}).unwrap();
    let m = Model::load_with(&p, DensePolicy::Mmap).unwrap();
    // Drops every page of the file that this process has not mapped (loading touched only the
    // header and the norm vectors).
    common::uncache(&p);
    let mut scratch = Vec::new();
    let before = m.placement.dense_resident_frac(&m.gguf, &mut scratch).unwrap();
    // Independent count: mincore over the whole file, done here.
    let whole = {
        let page = 4096usize;
        let len = m.gguf.bytes().len();
        let mut v = vec![0u8; len.div_ceil(page)];
        // SAFETY: the mapping is page-aligned and `len` bytes long.
        let rc = unsafe { libc::mincore(m.gguf.bytes().as_ptr() as *mut libc::c_void, len, v.as_mut_ptr()) };
        assert_eq!(rc, 0);
        v.iter().filter(|&&b| b & 1 != 0).count() as f64 / v.len() as f64
    };
    let mut s = Session::new(&m, 1, 16);
    s.step(&[1, 2, 3]).unwrap();
    let after = m.placement.dense_resident_frac(&m.gguf, &mut scratch).unwrap();
    assert!(
        before < 0.5,
        "dense resident {before} right after dropping the file from the page cache (whole file {whole})"
    );
    assert!(after > 0.5 && after > before, "dense resident {before} → {after} after a forward pass");

    let a = Model::load_with(&p, DensePolicy::Anon).unwrap();
    assert_eq!(a.placement.dense_resident_frac(&a.gguf, &mut scratch), Some(1.0));
}
