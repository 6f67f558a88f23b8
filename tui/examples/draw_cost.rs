//! Rough cost of the TUI's periodic work (not a benchmark with a peer; the
//! decode-speed ratio comes with the engine): one draw of each view and one
//! rate interval, for a run of N tokens.

use std::time::Instant;

use observer_common::model::{Components, Counters, Event, StepKind, TokenRecord};
use ratatui::{Terminal, backend::TestBackend};
use tui::{App, Effect, View, stats};

fn main() {
    let n: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(10_000);
    let mut app = App::new();
    for i in 0..n as u64 {
        let w = 50_000_000 + (i % 7) * 1_000_000;
        app.push(Event::Token(TokenRecord {
            seq: i,
            index: Some(i),
            kind: StepKind::Generate,
            n_tokens: 1,
            start_ns: i * w,
            wall_ns: w,
            components: Components::from_kernel(&[w / 2, w / 10, w / 10, w / 10, 0, 0, 0, w / 10, w / 10, 0, 0]),
            residual_ns: 0,
            counters: Counters::default(),
            engine_compute_ns: Some(w * 7 / 10),
            threads: Vec::new(),
            engine: None,
            residency: None,
            lost_events: 0,
            evicted_by: None,
            refaults: None,
            explicit_reads: None,
        }));
    }
    // Minimum of a few repetitions: the machine is shared.
    let best = (0..5)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(stats::rate_interval(&app.rate_steps, stats::resamples_for(n), stats::SEED));
            t.elapsed()
        })
        .min()
        .unwrap();
    println!("interval over {n} steps, {} resamples: {best:?}", stats::resamples_for(n));
    let mut term = Terminal::new(TestBackend::new(200, 60)).unwrap();
    app.set_viewport(200, 60);
    for v in View::ALL {
        app.apply(Effect::SwitchView(v));
        let best = (0..50)
            .map(|_| {
                let t = Instant::now();
                term.draw(|f| tui::draw(&app, f)).unwrap();
                t.elapsed()
            })
            .min()
            .unwrap();
        println!("{v:?}: {best:?} per draw at 200x60 (fastest of 50)");
    }
}
