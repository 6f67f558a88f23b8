//! Snapshot tests of every view on ratatui's `TestBackend`, fed with the
//! synthetic stream of `fixture`, plus checks of the colours that carry
//! meaning (lost events, churn, the engine-compute marker) and of drawing at
//! every small size without a panic.
//!
//! Snapshots live in `tests/snapshots/`; after an intended change, review and
//! accept them with `cargo insta review` (or `INSTA_UPDATE=always`).

mod fixture;

use fixture::Opts;
use observer_common::model::Event;
use ratatui::{
    Terminal,
    backend::TestBackend,
    buffer::Buffer,
    style::{Color, Modifier},
};
use tui::{App, Effect, Scroll, View};

fn app_with(o: &Opts) -> App {
    let mut app = App::new();
    for e in fixture::events(o) {
        app.push(e);
    }
    app.refresh_stats();
    app
}

fn render(app: &mut App, w: u16, h: u16) -> Terminal<TestBackend> {
    app.set_viewport(w, h);
    let mut t = Terminal::new(TestBackend::new(w, h)).unwrap();
    t.draw(|f| tui::draw(app, f)).unwrap();
    t
}

fn show(app: &mut App, view: View, w: u16, h: u16) -> Terminal<TestBackend> {
    app.apply(Effect::SwitchView(view));
    render(app, w, h)
}

fn text(buf: &Buffer) -> String {
    let mut s = String::new();
    for y in 0..buf.area.height {
        for x in 0..buf.area.width {
            s.push_str(buf[(x, y)].symbol());
        }
        s.push('\n');
    }
    s
}

/// Position of the first occurrence of `needle` on screen.
fn find(buf: &Buffer, needle: &str) -> Option<(u16, u16)> {
    for y in 0..buf.area.height {
        let line: Vec<String> = (0..buf.area.width).map(|x| buf[(x, y)].symbol().to_string()).collect();
        let joined: String = line.concat();
        if let Some(byte) = joined.find(needle) {
            // Column = number of cells before the byte offset.
            let mut acc = 0;
            for (x, cell) in line.iter().enumerate() {
                if acc == byte {
                    return Some((x as u16, y));
                }
                acc += cell.len();
            }
        }
    }
    None
}

#[test]
fn tokens_view_while_running() {
    let mut app = app_with(&Opts { end: false, ..Default::default() });
    let t = show(&mut app, View::Tokens, 110, 30);
    insta::assert_snapshot!(t.backend());
}

#[test]
fn tokens_view_scrolled_back_to_the_prompt() {
    let mut app = app_with(&Opts { end: false, ..Default::default() });
    app.apply(Effect::SwitchView(View::Tokens));
    app.set_viewport(110, 30);
    app.apply(Effect::Scroll(Scroll::Top));
    let t = render(&mut app, 110, 30);
    let s = text(t.backend().buffer());
    assert!(s.contains("     0 P   640.00"), "the prompt row is on top when scrolled to the top:\n{s}");
    assert!(s.contains('»'), "the prompt is longer than the scale and is cut with »:\n{s}");
    insta::assert_snapshot!(t.backend());
}

#[test]
fn summary_view_after_the_target_exited() {
    let mut app = app_with(&Opts::default());
    assert_eq!(app.view, View::Summary, "the end switches to the final summary");
    let t = render(&mut app, 110, 30);
    insta::assert_snapshot!(t.backend());
}

#[test]
fn summary_view_shows_the_targets_last_lines_full_width() {
    let mut app = app_with(&Opts::default());
    for l in [
        "engine: small.gguf: dense weights 92.1 MiB (mmap), routed experts 386.0 MiB (mmap), loaded in 0.02 s",
        "prompt: 24 tokens, 37.50 tok/s | generation: 48 tokens, 48 steps, 15.61 tok/s | 2 threads | 49 marked steps",
    ] {
        app.push_output(l.into());
    }
    let t = show(&mut app, View::Summary, 110, 40);
    let s = text(t.backend().buffer());
    assert!(s.contains("| generation: 48 tokens, 48 steps, 15.61 tok/s | 2 threads"), "{s}");
    insta::assert_snapshot!(t.backend());
}

#[test]
fn summary_view_narrow_is_one_column() {
    let mut app = app_with(&Opts::default());
    app.push_output("{\"kind\":\"tokens\",\"n\":48}".into());
    let t = show(&mut app, View::Summary, 72, 44);
    insta::assert_snapshot!(t.backend());
}

#[test]
fn heatmap_view_with_churn() {
    let mut app = app_with(&Opts::default());
    let t = show(&mut app, View::Heatmap, 100, 20);
    insta::assert_snapshot!(t.backend());
    // Churn colours: the fixture adds and evicts pages every step.
    let buf = t.backend().buffer();
    let fgs: Vec<Color> = (0..buf.area.height)
        .flat_map(|y| (6..buf.area.width).map(move |x| (x, y)))
        .filter(|&(x, y)| "·░▒▓█".contains(buf[(x, y)].symbol()) && y >= 6)
        .map(|(x, y)| buf[(x, y)].fg)
        .collect();
    assert!(fgs.contains(&Color::Green), "added pages are green");
    assert!(fgs.contains(&Color::Red) || fgs.contains(&Color::Yellow), "evicted pages are red (or yellow with added)");
    assert!(fgs.contains(&Color::Gray), "cells without churn stay plain");
}

#[test]
fn heatmap_view_bins_a_grid_wider_than_the_screen() {
    let mut app = app_with(&Opts::default());
    let t = show(&mut app, View::Heatmap, 50, 14);
    let s = text(t.backend().buffer());
    assert!(s.contains("one cell = 2 layers × 1 expert"), "{s}");
    insta::assert_snapshot!(t.backend());
}

/// qwen35moe's grid (40 MoE layers × 256 experts) on a 120 × 50 terminal: every layer keeps a
/// row of its own, labelled with its index, and a cell stands for 3 experts (256 in 114 columns).
#[test]
fn heatmap_view_of_a_40_by_256_grid_keeps_every_layer() {
    let mut app = app_with(&Opts { grid: (40, 256), ..Default::default() });
    let t = show(&mut app, View::Heatmap, 120, 50);
    let s = text(t.backend().buffer());
    assert!(s.contains("one cell = 1 layer × 3 experts"), "{s}");
    let rows: Vec<&str> = s.lines().filter(|l| l.chars().any(|c| "·░▒▓█".contains(c))).collect();
    for layer in 0..40 {
        let label = format!("{layer:>4}  ");
        assert!(rows.iter().any(|r| r.contains(&label)), "layer {layer} has no row:\n{s}");
    }
}

/// A model whose first blocks are dense (DeepSeek's style): rows are labelled with their layer (the
/// grid's block index), not their row number, also when a cell stands for several layers.
#[test]
fn heatmap_view_labels_rows_with_their_layer() {
    let mut app = app_with(&Opts { grid: (40, 16), first_layer: 3, ..Default::default() });
    let rows = |t: &Terminal<TestBackend>| -> Vec<String> {
        text(t.backend().buffer())
            .lines()
            .filter(|l| l.chars().any(|c| "·░▒▓█".contains(c)))
            .map(str::to_owned)
            .collect()
    };
    let tall = rows(&show(&mut app, View::Heatmap, 100, 60));
    let labels: Vec<u32> = tall.iter().filter_map(|r| r.split_whitespace().next()?.parse().ok()).collect();
    assert_eq!(labels, (3..43).collect::<Vec<_>>(), "{tall:#?}");
    // 40 rows on a short screen: one row per 2 or more layers, each labelled with its first.
    let short = rows(&show(&mut app, View::Heatmap, 100, 20));
    let labels: Vec<u32> = short.iter().filter_map(|r| r.split_whitespace().next()?.parse().ok()).collect();
    let step = labels[1] - labels[0];
    assert!(step >= 2 && labels[0] == 3, "{short:#?}");
    assert!(labels.windows(2).all(|w| w[1] - w[0] == step) && *labels.last().unwrap() < 43, "{short:#?}");
}

/// With an engine that publishes its expert cache, exactly the cells of the last snapshot's ready
/// experts have the cache's background, and the header line gives that snapshot's slots and the
/// observer's hit rate beside the engine's own, and the observer's mean over the run (all from
/// the stream's records).
#[test]
fn heatmap_view_marks_the_engine_cache_and_its_hit_rates() {
    let o = Opts { engine_cache: true, ..Default::default() };
    let records: Vec<_> = fixture::events(&o)
        .into_iter()
        .filter_map(|e| match e {
            Event::Token(t) => Some(t),
            _ => None,
        })
        .filter(|t| t.residency.as_ref().is_some_and(|r| r.engine_cache.is_some()))
        .collect();
    let last = records.last().expect("records with the engine's cache");
    let cache = last.residency.as_ref().unwrap().engine_cache.clone().unwrap();
    let hits: Vec<f64> = records.iter().filter_map(|t| t.residency.as_ref()?.engine_cache.as_ref()?.hit_pct).collect();
    let run_mean = hits.iter().sum::<f64>() / hits.len() as f64;
    let engine_hit = last.engine.as_ref().unwrap().cache_hit_pct.unwrap();

    let mut app = app_with(&o);
    let t = show(&mut app, View::Heatmap, 120, 30);
    let buf = t.backend().buffer();
    let s = text(buf);
    assert!(!s.contains("one cell ="), "the 8 × 16 grid is drawn cell for cell:\n{s}");
    let line = format!(
        "engine cache at step #{}: {} slots, {} ready, {} loading · hit rate: observer {:.1} % (run {run_mean:.1} %), engine {engine_hit:.1} %",
        last.seq,
        cache.slots,
        cache.ready.len(),
        cache.loading,
        cache.hit_pct.unwrap()
    );
    assert!(s.contains(&line), "{line:?} in\n{s}");
    assert!(s.contains("in the engine's cache"), "the legend names the mark:\n{s}");

    let ticks = find(buf, "layer").expect("the tick line").1;
    let (nl, ne) = o.grid;
    let mut marked = 0;
    for l in 0..nl {
        let label = format!("{l:>4}  ");
        let y = (ticks + 1..buf.area.height)
            .find(|&y| (0..6).map(|x| buf[(x, y)].symbol()).collect::<String>() == label)
            .unwrap_or_else(|| panic!("layer {l} has no row:\n{s}"));
        for e in 0..ne {
            let cell = &buf[(6 + e as u16, y)];
            assert!("·░▒▓█".contains(cell.symbol()), "layer {l} expert {e}: {:?}", cell.symbol());
            let want = cache.ready.contains(&(l * ne + e));
            assert_eq!(cell.bg == tui::view::heatmap::ENGINE_CACHE_BG, want, "layer {l} expert {e}");
            marked += usize::from(want);
        }
    }
    assert_eq!(marked, cache.ready.len());
}

/// `r` switches the heatmap to the explicit reads: every cell's shade is its bytes over the run
/// against the most-read expert's, cyan exactly where it was read within the last 8 steps, and
/// the header gives the last grid's and the run's bytes and calls, all recomputed here from the
/// stream's records; the labels are the vocabulary's.
#[test]
fn heatmap_view_shows_the_explicit_reads_per_expert() {
    use observer_common::vocab::{G_READ_BYTES, G_READ_CALLS, GRID_LAYERS};
    use tui::view::{fmt as f, heatmap};
    let o = Opts { reads: true, ..Default::default() };
    let (nl, ne) = (o.grid.0 as usize, o.grid.1 as usize);
    // From the records: per cell, bytes over the run and the last step with a read of it.
    let (mut run, mut last_read) = (vec![0u64; nl * ne], vec![None::<u64>; nl * ne]);
    let (mut run_calls, mut last) = (0u64, (0u64, 0u64, 0u64));
    for e in fixture::events(&o) {
        let Event::Token(t) = e else { continue };
        let Some(g) = t.residency.as_ref().and_then(|r| r.grid.as_ref()) else { continue };
        let (b, c) = (g.read_bytes.as_ref().unwrap(), g.read_calls.as_ref().unwrap());
        for i in 0..nl * ne {
            run[i] += b[i];
            if b[i] > 0 {
                last_read[i] = Some(t.seq);
            }
        }
        run_calls += c.iter().map(|&c| u64::from(c)).sum::<u64>();
        last = (t.seq, b.iter().sum(), c.iter().map(|&c| u64::from(c)).sum());
    }
    let max = *run.iter().max().unwrap();
    assert!(max > 0 && run.contains(&0), "the fixture reads some experts, not all");

    let mut app = app_with(&o);
    let residency = text(show(&mut app, View::Heatmap, 100, 20).backend().buffer());
    assert!(residency.contains("r: reads") && residency.contains("churn at step"), "{residency}");
    app.apply(Effect::NextHeatLayer);
    let t = render(&mut app, 100, 20);
    let buf = t.backend().buffer();
    let s = text(buf);
    let (rb, rc) = (GRID_LAYERS[G_READ_BYTES].short, GRID_LAYERS[G_READ_CALLS].short);
    let head = format!(
        "explicit reads ({rb}, {rc}) at step #{}: {} in {} calls · run {} in {} calls",
        last.0,
        f::bytes(last.1 as f64),
        f::int(last.2),
        f::bytes(run.iter().sum::<u64>() as f64),
        f::int(run_calls)
    );
    assert!(s.contains(&head), "{head:?} in\n{s}");
    assert!(s.contains(&format!("{rb} over the run vs max")) && s.contains("r: residency"), "{s}");
    assert!(!s.contains("churn at step"), "the reads layer replaces the churn line:\n{s}");
    let ticks = find(buf, "layer").expect("the tick line").1;
    for l in 0..nl {
        let label = format!("{l:>4}  ");
        let y = (ticks + 1..buf.area.height)
            .find(|&y| (0..6).map(|x| buf[(x, y)].symbol()).collect::<String>() == label)
            .unwrap_or_else(|| panic!("layer {l} has no row:\n{s}"));
        for e in 0..ne {
            let i = l * ne + e;
            let cell = &buf[(6 + e as u16, y)];
            let want = heatmap::shade((run[i] as f64 / max as f64) as f32).to_string();
            assert_eq!(cell.symbol(), want, "layer {l} expert {e}: {} of {max} bytes", run[i]);
            let recent = last_read[i].is_some_and(|r| r + tui::state::CHURN_WINDOW > last.0);
            assert_eq!(cell.fg == heatmap::READ_RECENTLY, recent, "layer {l} expert {e}");
        }
    }
    insta::assert_snapshot!(t.backend());
    // Back to residency; and a stream without reads says so in the reads layer.
    app.apply(Effect::NextHeatLayer);
    assert!(text(render(&mut app, 100, 20).backend().buffer()).contains("churn at step"));
    let mut none = app_with(&Opts::default());
    none.apply(Effect::NextHeatLayer);
    let s = text(show(&mut none, View::Heatmap, 100, 20).backend().buffer());
    assert!(s.contains(&format!("explicit reads ({rb}, {rc}): not measured")), "{s}");
    assert!(!s.contains("r: reads"), "no hint for a layer that is not measured:\n{s}");
}

/// `f` switches the heatmap to the refault cost: every cell's shade is its refault `fault_io` over
/// the run against the costliest expert's, red exactly where it was refaulted within the last 8
/// steps, and the header gives the last grid's and the run's faults and time and the run's evicted
/// pages (on a 120-column terminal: the line is cut to fit narrower ones), all recomputed here
/// from the stream's records; `f` again goes back to residency.
#[test]
fn heatmap_view_shows_the_refault_cost_per_expert() {
    use observer_common::vocab::{G_REFAULT_FAULTS, G_REFAULT_IO, GRID_LAYERS};
    use tui::view::{fmt as f, heatmap};
    let o = Opts { refaults: true, ..Default::default() };
    let (nl, ne) = (o.grid.0 as usize, o.grid.1 as usize);
    let (mut run, mut last_refault) = (vec![0u64; nl * ne], vec![None::<u64>; nl * ne]);
    let (mut run_faults, mut evicted, mut last) = (0u64, 0u64, (0u64, 0u64, 0u64));
    for e in fixture::events(&o) {
        let Event::Token(t) = e else { continue };
        let Some(g) = t.residency.as_ref().and_then(|r| r.grid.as_ref()) else { continue };
        let (fl, io) = (g.refault_faults.as_ref().unwrap(), g.refault_io_ns.as_ref().unwrap());
        for i in 0..nl * ne {
            run[i] += io[i];
            if fl[i] > 0 {
                last_refault[i] = Some(t.seq);
            }
        }
        run_faults += fl.iter().map(|&c| u64::from(c)).sum::<u64>();
        evicted += g.evicted.as_ref().unwrap().iter().map(|&c| u64::from(c)).sum::<u64>();
        last = (t.seq, fl.iter().map(|&c| u64::from(c)).sum(), io.iter().sum());
    }
    let max = *run.iter().max().unwrap();
    assert!(max > 0 && run.contains(&0), "the fixture refaults some experts, not all");

    let mut app = app_with(&o);
    let residency = text(show(&mut app, View::Heatmap, 120, 20).backend().buffer());
    assert!(residency.contains("f: refault cost") && residency.contains("churn at step"), "{residency}");
    app.apply(Effect::ToggleRefaultLayer);
    let t = render(&mut app, 120, 20);
    let buf = t.backend().buffer();
    let s = text(buf);
    let (rf, rio) = (GRID_LAYERS[G_REFAULT_FAULTS].short, GRID_LAYERS[G_REFAULT_IO].short);
    let ms = |ns: u64| format!("{:.3} ms", ns as f64 / 1e6);
    let head = format!(
        "refault cost ({rf}, {rio}) at step #{}: {} faults, {} · run {} faults, {} · run evicted {evicted} pages",
        last.0,
        f::int(last.1),
        ms(last.2),
        f::int(run_faults),
        ms(run.iter().sum())
    );
    assert!(s.contains(&head), "{head:?} in\n{s}");
    assert!(s.contains(&format!("{rio} over the run vs max")) && s.contains("f: residency"), "{s}");
    let ticks = find(buf, "layer").expect("the tick line").1;
    for l in 0..nl {
        let label = format!("{l:>4}  ");
        let y = (ticks + 1..buf.area.height)
            .find(|&y| (0..6).map(|x| buf[(x, y)].symbol()).collect::<String>() == label)
            .unwrap_or_else(|| panic!("layer {l} has no row:\n{s}"));
        for e in 0..ne {
            let i = l * ne + e;
            let cell = &buf[(6 + e as u16, y)];
            let want = heatmap::shade((run[i] as f64 / max as f64) as f32).to_string();
            assert_eq!(cell.symbol(), want, "layer {l} expert {e}: {} of {max} ns", run[i]);
            let recent = last_refault[i].is_some_and(|r| r + tui::state::CHURN_WINDOW > last.0);
            assert_eq!(cell.fg == heatmap::REFAULTED_RECENTLY, recent, "layer {l} expert {e}");
        }
    }
    app.apply(Effect::ToggleRefaultLayer);
    assert!(text(render(&mut app, 120, 20).backend().buffer()).contains("churn at step"));
    // A stream without refault costs says so, and the residency legend has no hint for it.
    let mut none = app_with(&Opts::default());
    assert!(!text(show(&mut none, View::Heatmap, 100, 20).backend().buffer()).contains("f: refault cost"));
    none.apply(Effect::ToggleRefaultLayer);
    let s = text(render(&mut none, 100, 20).backend().buffer());
    assert!(s.contains(&format!("refault cost ({rf}, {rio}): not measured")), "{s}");
}

#[test]
fn heatmap_view_says_not_measured() {
    let mut app = app_with(&Opts { residency: false, ..Default::default() });
    let t = show(&mut app, View::Heatmap, 80, 12);
    let s = text(t.backend().buffer());
    assert!(s.contains("Residency: not measured"), "{s}");
    insta::assert_snapshot!(t.backend());
}

#[test]
fn threads_view() {
    let mut app = app_with(&Opts::default());
    let t = show(&mut app, View::Threads, 130, 12);
    insta::assert_snapshot!(t.backend());
}

#[test]
fn threads_view_narrow_drops_columns() {
    let mut app = app_with(&Opts::default());
    let t = show(&mut app, View::Threads, 60, 12);
    let s = text(t.backend().buffer());
    assert!(s.contains("compute") && !s.contains("ctxsw"), "{s}");
    insta::assert_snapshot!(t.backend());
}

/// The first line of the threads view and its column labels.
fn threads_head(s: &str) -> (String, Vec<String>) {
    let lines: Vec<&str> = s.lines().collect();
    let note = lines.iter().find(|l| l.contains("mean ms per step")).expect("the note").to_string();
    let head = lines.iter().find(|l| l.contains(" tid ")).expect("the column labels");
    (note, head.split_whitespace().skip(3).map(String::from).collect())
}

/// io_wait, io_wait_peer and unattributed are zero on every thread of the fixture: the columns are left out and named as all zero, which makes room for the
/// fault counts at a width where the zero columns pushed them out.
#[test]
fn threads_view_hides_all_zero_columns_narrow_and_wide() {
    let mut app = app_with(&Opts::default());
    for (w, want) in [
        (60, &["compute", "flt_min", "zram_in"][..]),
        (113, &["compute", "flt_min", "zram_in", "flt_io", "reclaim", "syscall", "runq", "sleep", "majF", "majS"][..]),
        (
            170,
            &[
                "compute", "flt_min", "zram_in", "flt_io", "reclaim", "syscall", "runq", "sleep", "majF", "majS",
                "minflt", "swapin", "read", "ctxsw",
            ][..],
        ),
    ] {
        let t = show(&mut app, View::Threads, w, 12);
        let s = text(t.backend().buffer());
        let (note, cols) = threads_head(&s);
        assert_eq!(cols, want, "width {w}:\n{s}");
        if w >= 113 {
            assert!(note.contains("all zero: io_wait io_peer unattr"), "width {w}: {note}");
        }
        if w > 60 {
            // 60 columns: `threads_view_narrow_drops_columns`.
            insta::assert_snapshot!(format!("threads_view_zero_columns_{w}"), t.backend());
        }
    }
}

/// A column that is zero on one thread but not another stays.
#[test]
fn threads_view_keeps_a_column_one_thread_has() {
    let mut app = App::new();
    for e in fixture::events(&Opts::default()) {
        let e = match e {
            Event::Token(mut t) => {
                if let Some(th) = t.threads.get_mut(1) {
                    th.components.set(observer_common::model::Component::IoWait, Some(250_000));
                }
                Event::Token(t)
            }
            e => e,
        };
        app.push(e);
    }
    let t = show(&mut app, View::Threads, 170, 12);
    let s = text(t.backend().buffer());
    let (note, cols) = threads_head(&s);
    assert!(cols.iter().any(|c| c == "io_wait"), "{s}");
    assert!(note.contains("all zero: io_peer unattr") && !note.contains("io_wait"), "{note}");
    assert!(s.contains("    0.25 ") && s.contains("    0.00 "), "one thread's io_wait, the others' zero:\n{s}");
}

#[test]
fn faults_view_from_the_stream() {
    let mut app = app_with(&Opts::default());
    let t = show(&mut app, View::Faults, 100, 60);
    let s = text(t.backend().buffer());
    assert!(s.contains("minflt  n=8544  p50 ≤2.0 µs  p99 ≤16.4 µs · minor faults, entry to completion"), "{s}");
    insta::assert_snapshot!(t.backend());
}

#[test]
fn faults_view_in_procfs_mode_has_no_histograms() {
    let mut app = app_with(&Opts { hists: false, ..Default::default() });
    let t = show(&mut app, View::Faults, 100, 14);
    let s = text(t.backend().buffer());
    assert!(s.contains("Latency histograms: none received yet"), "{s}");
}

#[test]
fn faults_view_with_a_histogram_kind_it_does_not_know() {
    let mut app = app_with(&Opts::default());
    let mut h = app.latency.clone().unwrap();
    h.kinds.insert("io_uring_wait".into(), vec![0, 0, 5]);
    app.push(Event::Histograms(h));
    app.apply(Effect::SwitchView(View::Faults));
    app.apply(Effect::Scroll(Scroll::Bottom));
    let t = render(&mut app, 100, 20);
    let s = text(t.backend().buffer());
    assert!(s.contains("io_uring_wait  n=5  p50 ≤4 ns  p99 ≤4 ns"), "{s}");
}

#[test]
fn tiny_terminal_shows_the_essentials() {
    let mut app = app_with(&Opts { lost: 3, ..Default::default() });
    let t = render(&mut app, 30, 5);
    insta::assert_snapshot!(t.backend());
    let buf = t.backend().buffer();
    let (x, y) = find(buf, "lost 3").expect("lost count shown");
    assert_eq!(buf[(x, y)].fg, Color::Red);
}

#[test]
fn smallest_full_layout() {
    let mut app = app_with(&Opts { end: false, ..Default::default() });
    let t = show(&mut app, View::Tokens, 40, 8);
    insta::assert_snapshot!(t.backend());
}

#[test]
fn lost_and_dropped_events_are_red_in_the_header() {
    let mut app = app_with(&Opts { lost: 7, ..Default::default() });
    let t = render(&mut app, 110, 30);
    let buf = t.backend().buffer();
    let (x, y) = find(buf, "lost 7").expect("lost shown");
    assert_eq!(buf[(x, y)].fg, Color::Red);
    assert!(buf[(x, y)].modifier.contains(Modifier::BOLD));
    let (x, y) = find(buf, "dropped 0").expect("dropped shown");
    assert_ne!(buf[(x, y)].fg, Color::Red, "zero drops are not an alarm");
    app.set_dropped(2);
    let t = render(&mut app, 110, 30);
    let buf = t.backend().buffer();
    let (x, y) = find(buf, "dropped 2").expect("dropped shown");
    assert_eq!(buf[(x, y)].fg, Color::Red);
}

#[test]
fn every_bar_carries_the_engine_compute_marker_after_the_measured_compute() {
    let mut app = app_with(&Opts { end: false, ..Default::default() });
    let t = show(&mut app, View::Tokens, 110, 30);
    let buf = t.backend().buffer();
    let mut rows = 0;
    for y in 3..buf.area.height - 2 {
        let line: Vec<&str> = (0..buf.area.width).map(|x| buf[(x, y)].symbol()).collect();
        let Some(bar0) = line.iter().position(|&c| c == "│") else { continue };
        if !line[..bar0].concat().trim_end().ends_with(|c: char| c.is_ascii_digit()) {
            continue;
        }
        rows += 1;
        let marker = line.iter().position(|&c| c == "┃").unwrap_or_else(|| panic!("no marker on row {y}"));
        // Last compute (green) cell before the marker: the hidden cost lies between.
        let green_end = (bar0 + 1..buf.area.width as usize)
            .take_while(|&x| buf[(x as u16, y)].fg == Color::Green)
            .last()
            .expect("compute segment");
        assert!(marker > green_end, "row {y}: marker at {marker}, compute ends at {green_end}");
    }
    assert!(rows >= 20, "checked {rows} token rows");
}

#[test]
fn paused_state_is_shown_and_events_wait() {
    let mut app = app_with(&Opts { end: false, n_gen: 10, ..Default::default() });
    app.apply(Effect::TogglePause);
    for e in fixture::events(&Opts { n_gen: 12, ..Default::default() }).into_iter().skip(14) {
        app.push(e);
    }
    let t = show(&mut app, View::Tokens, 110, 20);
    let s = text(t.backend().buffer());
    assert!(s.contains("PAUSED · RUNNING"), "{s}");
    assert!(s.contains("paused, 5 events queued"), "{s}");
    app.apply(Effect::TogglePause);
    assert!(app.ended());
}

#[test]
fn waiting_screen_before_the_header() {
    let mut app = App::new();
    let t = render(&mut app, 80, 10);
    insta::assert_snapshot!(t.backend());
}

#[test]
fn every_view_draws_at_every_small_size() {
    let apps = [
        App::new(),
        app_with(&Opts { end: false, ..Default::default() }),
        app_with(&Opts { residency: false, lost: 1, ..Default::default() }),
    ];
    for base in apps {
        for view in View::ALL {
            for w in 1..=70u16 {
                for h in 1..=24u16 {
                    let mut app = base.clone();
                    app.apply(Effect::SwitchView(view));
                    app.apply(Effect::Scroll(Scroll::PageDown));
                    let _ = render(&mut app, w, h);
                }
            }
        }
    }
}

#[test]
fn events_round_trip_through_json_into_the_same_screen() {
    // Replay will feed deserialised events: the screen must not depend on
    // anything serde drops.
    let o = Opts::default();
    let mut a = app_with(&o);
    let mut b = App::new();
    for e in fixture::events(&o) {
        let j = serde_json::to_string(&e).unwrap();
        b.push(serde_json::from_str::<Event>(&j).unwrap());
    }
    b.refresh_stats();
    for v in View::ALL {
        let ta = show(&mut a, v, 110, 30);
        let tb = show(&mut b, v, 110, 30);
        assert_eq!(ta.backend().buffer(), tb.backend().buffer(), "{v:?}");
    }
}

/// The summary lists who evicted the model file's pages, most first, over the run (pages, MB,
/// the pages refaulted after those evictions and the `fault_io` of the faults that brought them
/// back) and over the last minute of the steps' clock, then the processes that evicted most (the
/// latest per-process list); without any split the section is absent.
#[test]
fn summary_view_lists_who_evicted() {
    use observer_common::model::{EvictedBy, N_EVICTION_ACTORS, ProcessEvictions, Refaults};
    let mut app = app_with(&Opts::default());
    assert!(!text(render(&mut app, 110, 40).backend().buffer()).contains("Who evicted"));
    let mut app = App::new();
    let mut events = fixture::events(&Opts { end: false, ..Opts::default() });
    let kind = |name: &str| observer_common::vocab::EVICTION_ACTORS.iter().position(|r| r.name == name).unwrap();
    let mut n = 0;
    for e in &mut events {
        match e {
            Event::Token(t) => {
                let mut by = [0u64; N_EVICTION_ACTORS];
                by[kind("fadvise")] = 100;
                by[kind("kswapd")] = 7;
                t.evicted_by = Some(EvictedBy(by));
                let mut r = Refaults::default();
                r.pages.0[kind("fadvise")] = 60;
                r.faults.0[kind("fadvise")] = 3;
                r.fault_io_ns.0[kind("fadvise")] = 1_500_000;
                t.refaults = Some(r);
                // The first steps are over a minute older than the last.
                t.start_ns = if n < 8 { n * 1_000_000 } else { 100_000_000_000 + n * 1_000_000 };
                n += 1;
            }
            Event::Process(p) => {
                let row = |kind: &str, pid, comm: &str, pages| ProcessEvictions {
                    kind: kind.into(),
                    pid,
                    comm: comm.into(),
                    pages,
                };
                p.evicted_by_process = vec![
                    row("fadvise", 4711, "evictor", 100 * n),
                    row("kswapd", 45, "kswapd0", 7 * n),
                    row("fadvise", 0, "other", 3),
                ];
            }
            _ => {}
        }
    }
    for e in events {
        app.push(e);
    }
    app.apply(Effect::SwitchView(View::Summary));
    // One column (narrow), tall enough for every section: a row holds only this pane's numbers.
    let t = render(&mut app, 90, 150);
    let s = text(t.backend().buffer());
    assert!(s.contains("Who evicted (model-file pages)"), "{s}");
    let line = |k: &str| s.lines().find(|l| l.contains(&format!("  {k} "))).unwrap_or_else(|| panic!("{k}: {s}"));
    let words = |l: &str| l.split_whitespace().map(str::to_string).collect::<Vec<_>>();
    let recent = n - 8;
    let mb = |pages: u64| format!("{:.1}", (pages * 4096) as f64 / 1e6);
    let io = format!("{:.2}", 1.5 * n as f64);
    assert_eq!(
        words(line("fadvise")),
        ["fadvise", &(100 * n).to_string(), &mb(100 * n), &(60 * n).to_string(), &io, &(100 * recent).to_string()],
        "{s}"
    );
    assert_eq!(
        words(line("kswapd")),
        ["kswapd", &(7 * n).to_string(), &mb(7 * n), "0", "0.00", &(7 * recent).to_string()]
    );
    assert!(find(t.backend().buffer(), "fadvise").unwrap().1 < find(t.backend().buffer(), "kswapd").unwrap().1);
    // The processes, as the latest list has them.
    let last = app.evictions.processes.clone();
    assert_eq!(last.len(), 3);
    assert_eq!(
        words(line("evictor 4711")),
        ["evictor", "4711", &last[0].pages.to_string(), &mb(last[0].pages), "fadvise"]
    );
    assert_eq!(words(line("other (rest)")), ["other", "(rest)", "3", &mb(3), "fadvise"]);
    // Wide: full width below the two columns.
    let t = render(&mut app, 120, 60);
    insta::assert_snapshot!(t.backend());
}

#[test]
fn the_header_names_what_marks_the_tokens_and_the_model() {
    let mut h = fixture::header();
    h.tokens = "engine profile llama.cpp: llama_decode, llama_process in /opt/llama/libllama.so".into();
    let mut app = App::new();
    app.push(Event::Header(h));
    let t = show(&mut app, View::Tokens, 200, 20);
    let s = text(t.backend().buffer());
    let first = s.lines().next().unwrap_or("");
    assert!(first.contains("tokens: engine profile llama.cpp: llama_decode, llama_process"), "{s}");
    assert!(s.contains("model small.gguf"), "{s}");
}

/// A wrapper (`sh -c llama-simple …`) starts with no markers; when its child's engine profile
/// is found after exec, a `marks` event restates what marks the tokens and the probes, and
/// the header says so from then on.
#[test]
fn the_header_follows_marks_found_after_exec() {
    let mut h = fixture::header();
    h.tokens = "none (whole-run totals only; use --window or --token-symbol)".into();
    let mut app = App::new();
    app.push(Event::Header(h.clone()));
    let t = show(&mut app, View::Summary, 200, 20);
    assert!(text(t.backend().buffer()).lines().next().unwrap().contains("tokens: none"));
    let mut probes = h.probes.clone();
    probes.push("uprobe:/opt/llama/libllama.so:llama_process".into());
    app.push(Event::Marks(observer_common::model::TokenMarks {
        mono_ns: h.started_mono_ns + 5_000_000,
        pid: 4250,
        tokens: "engine profile llama.cpp: llama_decode, llama_process in /opt/llama/libllama.so".into(),
        probes,
        degraded: Vec::new(),
    }));
    let t = render(&mut app, 200, 20);
    let s = text(t.backend().buffer());
    let mut lines = s.lines();
    let first = lines.next().unwrap();
    assert!(first.contains("tokens: engine profile llama.cpp: llama_decode, llama_process"), "{s}");
    assert!(lines.next().unwrap().contains(&format!("probes {}", h.probes.len() + 1)), "{s}");
}

/// Token markers that are never called: the session restates them with a `degraded` entry
/// (`Event::Marks`), which the header's second line shows first, in the alarm style.
#[test]
fn the_header_warns_of_markers_never_called() {
    let h = fixture::header();
    let mut app = App::new();
    app.push(Event::Header(h.clone()));
    let t = show(&mut app, View::Summary, 200, 20);
    assert!(!text(t.backend().buffer()).contains('⚠'), "nothing degraded yet");
    let warning = "tokens: no call of `llama_decode` in 5 s: no token records";
    app.push(Event::Marks(observer_common::model::TokenMarks {
        mono_ns: h.started_mono_ns + 5_000_000_000,
        pid: 4250,
        tokens: "calls of llama_decode in /opt/llama/libllama.so".into(),
        probes: h.probes.clone(),
        degraded: vec![warning.into()],
    }));
    let t = render(&mut app, 200, 20);
    let buf = t.backend().buffer();
    let second = text(buf).lines().nth(1).unwrap().to_string();
    assert!(second.contains(&format!("⚠ {warning}")), "{second}");
    assert!(second.contains("kernel "), "the run's facts follow: {second}");
    let (x, y) = find(buf, "no call of").unwrap();
    assert_eq!(buf[(x, y)].fg, Color::Red, "the warning is in the alarm style");
}
