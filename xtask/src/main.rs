mod bench_engine;
mod llama;
mod parity;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        ["parity", ..] => parity::main(&args[1..]),
        ["bench", "engine", ..] => bench_engine::main(&args[2..]),
        _ => anyhow::bail!("usage: cargo xtask parity [--threads N] | cargo xtask bench engine [options]"),
    }
}
