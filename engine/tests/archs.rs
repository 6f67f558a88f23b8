//! Every architecture end to end on its tiny synthetic preset: the file loads as that
//! architecture with the expected layer kinds, a batched prompt gives the same bits as token by
//! token steps (on different thread counts), the session's KV/state memory is what
//! `Config::state_bytes` says, and the blocks that are new per architecture (DeltaNet, gated and
//! windowed attention with sinks, shared experts, biased OAI experts) agree with independent
//! computations.

mod common;

use engine::arch::{Arch, Mixer};
use engine::model::{Model, Session};
use engine::sampling::argmax;
use engine::synth::{SynthConfig, write_model};
use engine::tokenizer::Tokenizer;

use common::{preset_model as model, rows};

const TINY: [(&str, Arch); 4] = [
    ("tiny", Arch::Qwen3Moe),
    ("olmoe-tiny", Arch::OlMoe),
    ("qwen35moe-tiny", Arch::Qwen35Moe),
    ("gpt-oss-tiny", Arch::GptOss),
];

#[test]
fn tiny_presets_load_with_their_layer_kinds() {
    for (preset, arch) in TINY {
        let (_d, m) = model(preset, |_| {});
        let c = &m.cfg;
        assert_eq!(c.arch, arch, "{preset}");
        let want: Vec<Mixer> = (0..c.n_layer)
            .map(|il| match arch {
                Arch::Qwen3Moe | Arch::OlMoe => Mixer::Full,
                Arch::Qwen35Moe if (il + 1) % 4 == 0 => Mixer::Full,
                Arch::Qwen35Moe => Mixer::DeltaNet,
                Arch::GptOss if il % 2 == 0 => Mixer::Window,
                Arch::GptOss => Mixer::Full,
            })
            .collect();
        assert_eq!(c.mixers, want, "{preset}");
        for l in &m.layers {
            let moe = l.moe().unwrap();
            assert_eq!(moe.merged_gate_up, arch == Arch::Qwen35Moe);
            assert_eq!(moe.shared.is_some(), arch == Arch::Qwen35Moe);
            assert_eq!(moe.biases.is_some(), arch == Arch::GptOss);
        }
        if arch == Arch::GptOss {
            assert_eq!(m.layers[0].moe().unwrap().down_exps.w.ty, engine::quant::GgmlType::MXFP4);
            assert!(c.yarn.is_some() && c.n_swa == 16);
        }
        if arch == Arch::Qwen35Moe {
            assert_eq!((c.n_rot, c.head_dim, c.rope_sections), (16, 64, [3, 3, 2, 0]));
        }
    }
}

/// The prompt in one batch (2 threads) and token by token (1 thread) give the same logits, bit
/// for bit, on every architecture; greedy decoding continues; the state memory matches.
#[test]
fn batched_prompt_matches_token_by_token_on_every_arch() {
    for (preset, arch) in TINY {
        // gpt-oss: a window of 16 < the prompt, so the window masks cells within the batch too.
        let (_d, m) = model(preset, |_| {});
        let tok = Tokenizer::from_gguf(&m.gguf).unwrap();
        let ids = tok.encode("The engine maps the file and decodes token by token, layer by layer.").unwrap();
        assert!(ids.len() > 16, "{preset}: prompt of {} tokens", ids.len());
        let mut a = Session::new(&m, 2, 64);
        let la = a.step(&ids).unwrap().to_vec();
        let mut b = Session::new(&m, 1, 64);
        b.ubatch = 1;
        let lb = b.step(&ids).unwrap().to_vec();
        let differ = la.iter().zip(&lb).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
        assert_eq!(differ, 0, "{preset}: batched vs token by token: {differ} logits differ");
        assert!(la.iter().all(|v| v.is_finite()), "{preset}");
        let mut t = argmax(&la);
        for _ in 0..8 {
            t = argmax(a.step(&[t]).unwrap());
            assert!((t as usize) < m.cfg.n_vocab);
        }
        // Different sequences really differ (the layers are not a no-op).
        let mut c = Session::new(&m, 1, 64);
        let lc = c.step(&ids[1..]).unwrap();
        assert!(lc.iter().zip(&la).any(|(x, y)| x != y), "{preset}");
        let _ = arch;
    }
}

/// `Config::state_bytes(n_ctx)` is what a session holds once its context is full: f16 K and V of
/// every attention layer (windowed ones: their ring), the f32 DeltaNet states.
#[test]
fn state_bytes_match_the_session_at_full_context() {
    for (preset, _) in TINY {
        let (_d, m) = model(preset, |_| {});
        let n_ctx = 300;
        let mut s = Session::new(&m, 2, n_ctx);
        for chunk in (0..n_ctx as u32).collect::<Vec<_>>().chunks(100) {
            s.step(chunk).unwrap();
        }
        let want = m.cfg.state_bytes(n_ctx);
        assert_eq!(s.held_state_bytes(), want, "{preset}");
        let c = &m.cfg;
        let kv_cell = (2 * c.n_head_kv * c.head_dim * 2) as u64;
        match c.arch {
            Arch::Qwen35Moe => {
                let ssm = c.ssm.unwrap();
                assert_eq!(want.recurrent, 3 * 4 * (ssm.conv_state_len() + ssm.ssm_state_len()) as u64);
                assert_eq!(want.kv, kv_cell * n_ctx as u64);
            }
            // 2 layers: one window (16 + 256 cells padded to 512, more than the context) and one full.
            Arch::GptOss => assert_eq!(want.kv, 2 * kv_cell * n_ctx as u64),
            _ => assert_eq!((want.kv, want.recurrent), (2 * kv_cell * n_ctx as u64, 0)),
        }
    }
    // A window smaller than the context: the ring stops growing at its cells.
    let (_d, m) = model("gpt-oss-tiny", |c| c.context = 8192);
    let n_ctx = 700;
    let mut s = Session::new(&m, 2, n_ctx);
    for chunk in (0..n_ctx as u32).map(|t| t % 500).collect::<Vec<_>>().chunks(256) {
        s.step(chunk).unwrap();
    }
    let c = &m.cfg;
    let kv_cell = (2 * c.n_head_kv * c.head_dim * 2) as u64;
    assert_eq!(engine::arch::window_cells(16, n_ctx), 512);
    assert_eq!(s.held_state_bytes(), c.state_bytes(n_ctx));
    assert_eq!(c.state_bytes(n_ctx).kv, kv_cell * (512 + n_ctx as u64));
}

/// `w·x` for one row with the kernels (ggml's one-token `mul_mat`).
fn matvec(m: &Model, w: &engine::blocks::Weight, x: &[f32]) -> Vec<f32> {
    common::matvec(w.ty, m.bytes(w.range.clone()), w.rows, x)
}

/// The DeltaNet block on a batch of tokens against the recurrence written out in f64 (the
/// projections with the kernels, everything after them in f64), and state carried across calls.
#[test]
fn delta_net_block_matches_an_f64_recurrence() {
    use engine::blocks::delta_net::{self, DeltaState};
    use engine::blocks::{Ctx, self_attn::Rope};
    let (_d, m) = model("qwen35moe-tiny", |_| {});
    let c = &m.cfg;
    let ssm = c.ssm.unwrap();
    let engine::arch::Attention::DeltaNet(w) = &m.layers[0].attn else { panic!("layer 0 is DeltaNet") };
    let (d, n) = (c.n_embd, 6);
    let x = rows(n, d, 5);
    let pool = engine::pool::Pool::new(2);
    let rope = Rope::default();
    let mut st = DeltaState::new(&ssm);
    let mut sc = delta_net::Scratch::default();
    let mut got = vec![0f32; n * d];
    // Two calls (4 tokens, then 2): the state carries over.
    for (t0, t1) in [(0, 4), (4, 6)] {
        let ctx = Ctx { model: &m, pool: &pool, experts: &m, n: t1 - t0, pos0: t0, rope: &rope };
        delta_net::forward(&ctx, 0, w, &mut st, &x[t0 * d..t1 * d], &mut sc, &mut got[t0 * d..t1 * d]).unwrap();
    }

    let (sd, hk, hv, dc) = (ssm.d_state, ssm.n_k_heads, ssm.n_v_heads, ssm.d_conv);
    let (kd, ch) = (ssm.key_dim(), ssm.conv_channels());
    let sig = |v: f64| 1.0 / (1.0 + (-v).exp());
    let mut conv_hist = vec![vec![0f64; dc - 1]; ch];
    let mut state = vec![vec![vec![0f64; sd]; sd]; hv]; // state[h][i][j] = S[i][j]
    let mut want = Vec::new();
    for t in 0..n {
        let xt = &x[t * d..(t + 1) * d];
        let qkv = matvec(&m, &w.wqkv, xt);
        let z = matvec(&m, &w.wgate, xt);
        let b = matvec(&m, &w.wbeta, xt);
        let a = matvec(&m, &w.walpha, xt);
        let mut y = vec![0f64; ch];
        for cc in 0..ch {
            let taps = &w.conv[cc * dc..(cc + 1) * dc];
            let mut s = f64::from(qkv[cc]) * f64::from(taps[dc - 1]);
            for i in 0..dc - 1 {
                s += conv_hist[cc][i] * f64::from(taps[i]);
            }
            conv_hist[cc].remove(0);
            conv_hist[cc].push(f64::from(qkv[cc]));
            y[cc] = s * sig(s);
        }
        let l2 = |v: &[f64]| {
            let norm = (v.iter().map(|x| x * x).sum::<f64>() + f64::from(c.rms_eps)).sqrt();
            v.iter().map(|x| x / norm).collect::<Vec<f64>>()
        };
        let mut o = vec![0f64; hv * sd];
        for h in 0..hv {
            let kh = h % hk;
            let q = l2(&y[kh * sd..(kh + 1) * sd]);
            let k = l2(&y[kd + kh * sd..kd + (kh + 1) * sd]);
            let v = &y[2 * kd + h * sd..2 * kd + (h + 1) * sd];
            let sp = (f64::from(a[h]) + f64::from(w.dt_bias[h])).exp().ln_1p();
            let decay = (sp * f64::from(w.a[h])).exp();
            let beta = sig(f64::from(b[h]));
            let s = &mut state[h];
            s.iter_mut().flatten().for_each(|e| *e *= decay);
            for j in 0..sd {
                let kv: f64 = (0..sd).map(|i| s[i][j] * k[i]).sum();
                let dj = (v[j] - kv) * beta;
                (0..sd).for_each(|i| s[i][j] += k[i] * dj);
            }
            for j in 0..sd {
                o[h * sd + j] = (0..sd).map(|i| s[i][j] * q[i]).sum::<f64>() / (sd as f64).sqrt();
            }
        }
        let mut fo = vec![0f32; hv * sd];
        for h in 0..hv {
            let oh = &o[h * sd..(h + 1) * sd];
            let rms = (oh.iter().map(|x| x * x).sum::<f64>() / sd as f64 + f64::from(c.rms_eps)).sqrt();
            for j in 0..sd {
                let zj = f64::from(z[h * sd + j]);
                fo[h * sd + j] = (oh[j] / rms * f64::from(w.norm[j]) * zj * sig(zj)) as f32;
            }
        }
        want.extend(matvec(&m, &w.wout, &fo));
    }
    let scale = want.iter().fold(0f32, |a, &v| a.max(v.abs()));
    let err = got.iter().zip(&want).fold(0f32, |a, (&g, &w)| a.max((g - w).abs())) / scale;
    assert!(scale > 0.0 && err < 2e-2, "DeltaNet block vs f64 recurrence: max error {err:.2e} of {scale}");
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// The MoE block of gpt-oss (router bias, softmax over the top-k logits, expert biases,
/// `swiglu_oai`, MXFP4) and of qwen35moe (merged gate_up, shared expert with its sigmoid gate)
/// against a row-at-a-time computation with the kernels, bit for bit.
#[test]
fn moe_variants_match_row_by_row() {
    use engine::blocks::moe::{self, ExpertWeights};
    use engine::blocks::{Ctx, self_attn::Rope, self_attn::sigmoid};
    use engine::vmath;
    for preset in ["gpt-oss-tiny", "qwen35moe-tiny", "olmoe-tiny"] {
        let (_d, m) = model(preset, |_| {});
        let c = &m.cfg;
        let (d, ne, k, n_ff) = (c.n_embd, c.n_expert, c.n_expert_used, c.n_ff_exp);
        let w = m.layers[1].moe().unwrap();
        let n = 5;
        let x = rows(n, d, 17);
        let pool = engine::pool::Pool::new(2);
        let rope = Rope::default();
        let ctx = Ctx { model: &m, pool: &pool, experts: &m, n, pos0: 0, rope: &rope };
        let mut counts = vec![0u64; ne];
        let mut got = vec![0f32; n * d];
        moe::forward(&ctx, 1, w, &mut counts, &x, &mut moe::Scratch::default(), &mut got).unwrap();

        let mut want = Vec::new();
        for xb in x.chunks(d) {
            let mut l = matvec(&m, &w.router, xb);
            l.iter_mut().zip(&w.router_bias).for_each(|(a, b)| *a += b);
            let gated = if c.arch == Arch::GptOss {
                l.clone()
            } else {
                let mut p = l.clone();
                vmath::softmax(&mut p, false);
                p
            };
            let mut ids: Vec<usize> = (0..ne).collect();
            ids.sort_by(|&a, &b| gated[b].total_cmp(&gated[a]).then(a.cmp(&b)));
            let top = &ids[..k];
            let mut wts: Vec<f32> = top.iter().map(|&e| gated[e]).collect();
            if c.arch == Arch::GptOss {
                vmath::softmax(&mut wts, false);
            }
            if c.arch == Arch::Qwen35Moe {
                let s = (wts.iter().map(|&v| f64::from(v)).sum::<f64>() as f32).max(6.103_515_6e-5);
                wts.iter_mut().for_each(|v| *v /= s);
            }
            let mut acc = vec![0f32; d];
            for (j, (&e, &wt)) in top.iter().zip(&wts).enumerate() {
                let v = m.expert_weights(1, w, e);
                let mv = |ty, bytes: &[u8], rows: usize, x: &[f32]| {
                    let mut xq = Vec::new();
                    engine::quant::quantize_activation(ty, x, &mut xq).unwrap();
                    let mut o = vec![0f32; rows];
                    engine::quant::matvec(ty, bytes, 0..rows, x.len(), &xq, &mut o);
                    o
                };
                let mut g = mv(w.gate_exps.w.ty, v.gate, n_ff, xb);
                let mut u = mv(w.up_exps.w.ty, v.up, n_ff, xb);
                let mut h = vec![0f32; n_ff];
                if let Some(b) = &w.biases {
                    g.iter_mut().zip(f32s(m.bytes(b.gate.expert_range(e)))).for_each(|(a, b)| *a += b);
                    u.iter_mut().zip(f32s(m.bytes(b.up.expert_range(e)))).for_each(|(a, b)| *a += b);
                    vmath::swiglu_oai(&g, &u, &mut h);
                } else {
                    vmath::swiglu(&g, &u, &mut h);
                }
                let mut y = mv(w.down_exps.w.ty, v.down, d, &h);
                if let Some(b) = &w.biases {
                    y.iter_mut().zip(f32s(m.bytes(b.down.expert_range(e)))).for_each(|(a, b)| *a += b);
                }
                for (a, v) in acc.iter_mut().zip(y) {
                    *a = if j == 0 { v * wt } else { *a + v * wt };
                }
            }
            if let Some(sh) = &w.shared {
                let g = matvec(&m, &sh.ffn.gate, xb);
                let u = matvec(&m, &sh.ffn.up, xb);
                let mut h = vec![0f32; g.len()];
                vmath::swiglu(&g, &u, &mut h);
                let y = matvec(&m, &sh.ffn.down, &h);
                let gate = sigmoid(matvec(&m, &sh.gate, xb)[0]);
                acc.iter_mut().zip(y).for_each(|(a, v)| *a += v * gate);
            }
            want.extend(acc);
        }
        let differ = got.iter().zip(&want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(differ, 0, "{preset}: {differ} outputs differ from the row-by-row computation");
        assert!(want.iter().any(|&v| v != 0.0));
    }
}

/// The dense/expert split (`--dense`, `Placement`) agrees with the region map on every
/// architecture: routed experts (merged gate_up and expert biases included) are the experts;
/// shared experts, DeltaNet, sinks and routers are dense.
#[test]
fn dense_expert_split_matches_the_region_map() {
    for (preset, arch) in TINY {
        let (_d, m) = model(preset, |_| {});
        let map = engine::regions::RegionMap::from_gguf(&m.gguf).unwrap();
        let (dense, shared, routed) = map.bytes_by_kind();
        let p = &m.placement;
        assert_eq!((p.dense_bytes, p.expert_bytes), (dense + shared, routed), "{preset}");
        assert_eq!(shared > 0, arch == Arch::Qwen35Moe, "{preset}");
        assert_eq!(map.layers.len(), m.cfg.n_layer);
        for (r, row) in map.layers.iter().enumerate() {
            assert_eq!(row.layer as usize, r);
            assert_eq!(row.merged_gate_up, arch == Arch::Qwen35Moe);
            let moe = m.layers[r].moe().unwrap();
            let mut per_expert = moe.gate_exps.slice_bytes() as u64 + moe.down_exps.slice_bytes() as u64;
            if !moe.merged_gate_up {
                per_expert += moe.up_exps.slice_bytes() as u64;
            }
            if let Some(b) = &moe.biases {
                per_expert += (b.gate.slice_bytes() + b.up.slice_bytes() + b.down.slice_bytes()) as u64;
            }
            assert_eq!(row.expert_bytes, per_expert, "{preset} row {r}");
        }
    }
}

/// The released models' per-sequence memory, from their hyperparameters (sparse files of the
/// released shapes: header and tensor table only): Qwen3.6-35B-A3B keeps 10 KV caches of 2 heads
/// x 256 and 30 DeltaNet states of 32 x 128 x 128 f32 plus a 3 x 8192 convolution window;
/// gpt-oss-20b 12 full KV caches and 12 windows of 128 (+ a batch: 512 cells); OLMoE 16 caches.
#[test]
fn released_shapes_state_memory() {
    let dir = tempfile::tempdir().unwrap();
    let n_ctx = 4096;
    for (preset, kv, recurrent) in [
        ("qwen3.6-35b-a3b", 10 * n_ctx * 2 * 2 * 256 * 2, 30 * 4 * (3 * 8192 + 32 * 128 * 128)),
        ("gpt-oss-20b", (12 * n_ctx + 12 * 512) * 2 * 8 * 64 * 2, 0),
        ("olmoe-1b-7b", 16 * n_ctx * 2 * 16 * 128 * 2, 0),
    ] {
        let path = dir.path().join(format!("{preset}.gguf"));
        engine::synth::write_sparse(&SynthConfig::preset(preset).unwrap(), &path).unwrap();
        let c = engine::arch::Config::read(&engine::gguf::Gguf::open(&path).unwrap()).unwrap();
        let b = c.state_bytes(n_ctx);
        assert_eq!((b.kv, b.recurrent), (kv as u64, recurrent as u64), "{preset}");
    }
}

/// `engine run` prints the session's KV and recurrent state at start, in the numbers the
/// synthetic file's shapes give (computed here from the `SynthConfig`, not by the engine):
/// qwen35moe-tiny (layers 0-2 DeltaNet, 3 full attention), gpt-oss-tiny (a window of 16 cells,
/// padded with a batch to 512, beside a full layer).
#[test]
fn run_prints_the_state_memory_at_start() {
    let n_ctx = 700;
    for preset in ["qwen35moe-tiny", "gpt-oss-tiny", "tiny"] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(format!("{preset}.gguf"));
        let c = SynthConfig::preset(preset).unwrap();
        write_model(&c, &path, 2, |_| {}).unwrap();
        let kv_cell = 2 * c.kv_heads * c.head_dim * 2;
        let (full, window, deltanet) = match c.arch {
            Arch::Qwen35Moe => (c.layers / c.full_attn_interval, 0, c.layers - c.layers / c.full_attn_interval),
            Arch::GptOss => (c.layers / 2, c.layers / 2, 0),
            _ => (c.layers, 0, 0),
        };
        let kv = kv_cell * (full * n_ctx + window * 512);
        let conv_channels = c.ssm_state * (2 * c.ssm_k_heads + c.ssm_v_heads);
        let recurrent =
            deltanet * 4 * ((c.ssm_conv.max(1) - 1) * conv_channels + c.ssm_state * c.ssm_state * c.ssm_v_heads);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_engine"))
            .arg("run")
            .arg("-m")
            .arg(&path)
            .args(["-p", "The quick brown fox", "-n", "2", "-t", "1", "--ctx", &n_ctx.to_string()])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{preset}: {stderr}");
        let mib = |b: usize| format!("{:.2} MiB", b as f64 / 1048576.0);
        let want = format!(
            "({} layers: {full} full attention, {window} sliding window, {deltanet} DeltaNet): KV + state for {n_ctx} \
             positions {} (KV cache {}, recurrent state {})",
            c.layers,
            mib(kv + recurrent),
            mib(kv),
            mib(recurrent)
        );
        assert!(stderr.contains(&want), "{preset}: want {want:?} in\n{stderr}");
        if c.arch == Arch::Qwen35Moe {
            assert!(recurrent > 0 && deltanet == 3);
        }
    }
}
