//! End-to-end on a `tiny` synthetic model: synth → load → tokenize → decode.

use engine::model::{Model, Session};
use engine::sampling::argmax;
use engine::synth::{QuantMix, SynthConfig, write_model};
use engine::tokenizer::Tokenizer;

fn tiny(quant: QuantMix) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(format!("tiny-{}.gguf", quant.name()));
    let mut c = SynthConfig::preset("tiny").unwrap();
    c.quant = quant;
    write_model(&c, &path, 2, |_| {}).unwrap();
    (dir, path)
}

#[test]
fn synth_is_deterministic_and_loads() {
    let (_d1, a) = tiny(QuantMix::Q8_0);
    let (_d2, b) = tiny(QuantMix::Q8_0);
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap(), "same seed, same bytes");
    let m = Model::load(&a).unwrap();
    assert_eq!(m.cfg.n_layer, 2);
    assert_eq!(m.cfg.n_vocab, 512);
    assert_eq!(m.cfg.arch, engine::arch::Arch::Qwen3Moe);
    assert_eq!(m.layers[0].moe().unwrap().down_exps.w.ty, engine::quant::GgmlType::Q8_0);
}

#[test]
fn batched_prompt_matches_token_by_token() {
    for q in [QuantMix::Q8_0, QuantMix::Q4KM] {
        let (_d, path) = tiny(q);
        let m = Model::load(&path).unwrap();
        let tok = Tokenizer::from_gguf(&m.gguf).unwrap();
        let ids = tok.encode("The engine maps the file and decodes token by token.").unwrap();
        let mut a = Session::new(&m, 2, 64);
        let la = a.step(&ids).unwrap().to_vec();
        let mut b = Session::new(&m, 1, 64);
        b.ubatch = 1;
        let lb = b.step(&ids).unwrap().to_vec();
        // Bit-identical: the batched kernels do per token exactly what the one-token ones do,
        // attention rows are independent, and below 256 positions the thread count does not
        // enter the numerics (see `engine::attention`).
        let differ = la.iter().zip(&lb).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
        assert_eq!(differ, 0, "{}: batched (2 threads) vs token by token (1 thread): {differ} logits differ", q.name());
        assert!(la.iter().all(|v| v.is_finite()));
        // Greedy continuation runs and stays in the vocabulary.
        let mut t = argmax(&la);
        for _ in 0..8 {
            t = argmax(a.step(&[t]).unwrap());
            assert!((t as usize) < m.cfg.n_vocab);
        }
        assert_eq!(a.pos(), ids.len() + 8);
    }
}

#[test]
fn router_skew_makes_expert_popularity_uneven() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("skew.gguf");
    let mut c = SynthConfig::preset("tiny").unwrap();
    c.experts = 16;
    c.experts_used = 2;
    c.router_skew = 1.5;
    write_model(&c, &path, 2, |_| {}).unwrap();
    let m = Model::load(&path).unwrap();
    let mut s = Session::new(&m, 1, 512);
    let mut t = 1u32;
    for _ in 0..200 {
        t = argmax(s.step(&[t]).unwrap());
    }
    let counts = &s.expert_counts[0];
    let mut sorted = counts.clone();
    sorted.sort_unstable_by(|a, b| b.cmp(a));
    let total: u64 = sorted.iter().sum();
    let top4: u64 = sorted[..4].iter().sum();
    assert_eq!(total, 400);
    // Uniform routing would give the top quarter of experts ~25 % of the selections.
    assert!(top4 * 100 / total > 50, "top-4 experts got {top4}/{total}: {counts:?}");
}

#[test]
fn bad_inputs_are_errors() {
    let (_d, path) = tiny(QuantMix::Q8_0);
    let m = Model::load(&path).unwrap();
    let mut s = Session::new(&m, 1, 4);
    assert!(s.step(&[100_000]).is_err(), "token id beyond the vocabulary");
    assert!(s.step(&[1, 2, 3, 4, 5]).is_err(), "context overflow");
    // A GGUF that is not qwen3moe.
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("other.gguf");
    let meta = vec![("general.architecture".to_owned(), engine::gguf::Value::String("llama".into()))];
    engine::gguf::GgufWriter::create(&p, &meta, vec![]).unwrap().finish().unwrap();
    let msg = Model::load(&p).unwrap_err().to_string();
    assert!(
        msg.contains("other.gguf") && msg.contains("\"llama\" is not supported") && msg.contains("qwen3moe"),
        "the error names the file, the architecture and the supported list: {msg}"
    );
}

#[test]
fn tokenizer_round_trips_text() {
    let (_d, path) = tiny(QuantMix::Q8_0);
    let g = engine::gguf::Gguf::open(&path).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    for text in ["Hello world", "naïve café 東京 🚀\n\n  spaces", "It's 2026; they're here."] {
        let ids = tok.encode(text).unwrap();
        assert_eq!(tok.decode(&ids), text);
    }
    // Merges are used: " the" is a single token, not four bytes.
    assert_eq!(tok.encode(" the").unwrap().len(), 1, "{:?}", tok.encode(" the").unwrap());
    // Control tokens are recognised in text.
    let ids = tok.encode("<|im_start|>user").unwrap();
    assert_eq!(tok.token_type(ids[0]), Some(engine::tokenizer::TOKEN_CONTROL));
    assert!(tok.is_eog(tok.eos.unwrap()));
}
