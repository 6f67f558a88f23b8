//! A short, deterministic fuzzing run of every target (crate doc): every seed, then a fixed
//! number of mutated inputs from a fixed seed. A failure names the input and saves it.

const SEED: u64 = 19;

fn smoke(name: &str, mutations: u64) {
    let t = fuzz::target(name).expect("a target");
    let t0 = std::time::Instant::now();
    match fuzz::smoke(t, SEED, mutations) {
        Ok(s) => println!(
            "fuzz {name}: {} seeds and {} mutations (seed {SEED}) passed in {:.1} s",
            s.seeds,
            s.mutations,
            t0.elapsed().as_secs_f64()
        ),
        Err(f) => panic!("{f}"),
    }
}

#[test]
fn gguf() {
    smoke("gguf", 5000);
}

#[test]
fn model() {
    smoke("model", 1000);
}

#[test]
fn trace() {
    smoke("trace", 3000);
}

#[test]
fn bmoe() {
    smoke("bmoe", 20000);
}

#[test]
fn config() {
    smoke("config", 20000);
}

#[test]
fn bench_json() {
    smoke("bench-json", 5000);
}

#[test]
fn http() {
    smoke("http", 50000);
}

#[test]
fn every_target_has_a_test_here_and_a_committed_corpus() {
    let src = include_str!("smoke.rs");
    for t in fuzz::TARGETS {
        assert!(src.contains(&format!("smoke(\"{}\"", t.name)), "no smoke test for fuzz target {}", t.name);
        assert!(!fuzz::corpus(t).is_empty(), "fuzz/corpus/{} is empty", t.name);
    }
}

/// The generated seeds reach deep: each is read without an error, so mutations start from
/// inputs that get through every stage of their target (the committed corpus holds damaged ones).
#[test]
fn the_generated_seeds_are_read_whole() {
    use std::path::Path;
    let seeds = |name: &str| (fuzz::target(name).expect("a target").seeds)();
    for s in seeds("gguf") {
        let g = engine::gguf::Gguf::from_bytes("seed.gguf", s).expect("a GGUF seed parses");
        engine::regions::RegionMap::from_gguf(&g).expect("its region map");
        engine::tokenizer::Tokenizer::from_gguf(&g).expect("its tokenizer");
        engine::model::Model::from_gguf(g).expect("a GGUF seed loads as a model");
    }
    for s in seeds("trace") {
        let mut r = observer::store::trace::Reader::new(&s[..], Path::new("seed.trace")).expect("a trace seed");
        assert!(r.by_ref().count() > 0 && r.issues().is_empty(), "{:?}", r.issues());
    }
    for s in seeds("bmoe") {
        let (events, _) = observer::store::import::bmoe::parse(Path::new("seed.csv"), std::str::from_utf8(&s).unwrap())
            .expect("a bmoe seed parses");
        assert!(events.len() > 10);
    }
    assert_eq!(seeds("config").len(), 2);
    for s in seeds("bench-json") {
        let b = observer::plot::cliff::parse(Path::new("seed.json"), std::str::from_utf8(&s).unwrap())
            .expect("a bench seed parses");
        observer::plot::cliff::CliffPlot::of(&[("seed".into(), b)]).expect("and plots");
    }
    for s in seeds("http") {
        assert!(observer::sinks::prometheus::http::parse_head(std::str::from_utf8(&s).unwrap()).is_some());
    }
}
