fn main() {
    eprintln!("engine: not built yet");
    std::process::exit(2);
}
