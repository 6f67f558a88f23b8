//! Holds a `testkit::damon` guard until killed (for the test that SIGKILLs a guard): starts a
//! `pageout` kdamond over 1 MiB of physical addresses at 1 GiB, restricted to the memory cgroup
//! given as the one argument (`/proc/PID/cgroup` form; a group with nothing in it evicts nothing),
//! prints `ready`, and sleeps.

use std::{io::Write, time::Duration};

fn main() -> anyhow::Result<()> {
    let memcg_path = std::env::args().nth(1).ok_or_else(|| anyhow::anyhow!("usage: damon_holder MEMCG_PATH"))?;
    let scheme = testkit::damon::PageoutScheme {
        regions: vec![(1 << 30, (1 << 30) + (1 << 20))],
        memcg_path,
        sample: Duration::from_millis(5),
        aggregation: Duration::from_millis(100),
    };
    let _guard = testkit::damon::Damon::pageout(&scheme)?;
    println!("ready");
    std::io::stdout().flush()?;
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}
