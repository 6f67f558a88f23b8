//! What the daemon ships with: the systemd unit's sandboxing as
//! `systemd-analyze security --offline=true` scores it (PID 1 here is not
//! systemd; the offline mode reads the unit file alone), and a LICENSE file
//! that matches the manifests.

use std::{path::PathBuf, process::Command};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

#[test]
fn the_systemd_unit_is_sandboxed() {
    let unit = repo().join("packaging/moe-observer.service");
    let out = Command::new("systemd-analyze")
        .args(["security", "--offline=true", "--no-pager"])
        .arg(&unit)
        .output()
        .expect("systemd-analyze is not installed (Debian package `systemd`)");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.contains("Overall exposure level"))
        .unwrap_or_else(|| panic!("no score from systemd-analyze:\n{text}\n{}", String::from_utf8_lossy(&out.stderr)));
    println!("{}", line.trim());
    let score: f64 = line
        .split(':')
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("unreadable score line {line:?}"));
    // systemd rates 0–10; below 3 is "OK" (exposure is limited).
    assert!(score < 3.0, "the unit's exposure is {score}:\n{text}");
    let body = std::fs::read_to_string(&unit).unwrap();
    for must in ["NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=", "CapabilityBoundingSet=", "User="] {
        assert!(body.contains(must), "the unit lacks {must}");
    }
    // Each capability the unit grants is named with its reason in its header.
    let caps = body.lines().find_map(|l| l.strip_prefix("CapabilityBoundingSet=")).unwrap();
    for cap in caps.split_whitespace() {
        assert!(body.lines().any(|l| l.starts_with(&format!("#   {cap} "))), "{cap} is granted without a reason");
    }
}

#[test]
fn the_license_file_matches_the_manifests() {
    let manifest = std::fs::read_to_string(repo().join("Cargo.toml")).unwrap();
    assert!(manifest.contains("license = \"Apache-2.0\""), "the workspace license changed: update LICENSE");
    let license = std::fs::read_to_string(repo().join("LICENSE")).expect("a LICENSE file at the top");
    assert!(license.contains("Apache License") && license.contains("Version 2.0, January 2004"));
}

/// The DaemonSet grants exactly the unit's capabilities, drops the rest, runs
/// unprivileged, and serves where its PodMonitor scrapes.
#[test]
fn the_daemonset_grants_the_units_capabilities() {
    let unit = std::fs::read_to_string(repo().join("packaging/moe-observer.service")).unwrap();
    let mut want: Vec<&str> = unit
        .lines()
        .find_map(|l| l.strip_prefix("CapabilityBoundingSet="))
        .unwrap()
        .split_whitespace()
        .map(|c| c.trim_start_matches("CAP_"))
        .collect();
    let ds = std::fs::read_to_string(repo().join("packaging/k8s/daemonset.yaml")).unwrap();
    let add = ds.lines().find_map(|l| l.trim().strip_prefix("add: [")).expect("capabilities.add");
    let mut have: Vec<&str> = add.trim_end_matches(']').split(',').map(str::trim).collect();
    want.sort_unstable();
    have.sort_unstable();
    assert_eq!(have, want, "the DaemonSet and the unit disagree");
    for must in
        ["drop: [ALL]", "privileged: false", "allowPrivilegeEscalation: false", "hostPID: true", "path: /healthz"]
    {
        assert!(ds.contains(must), "the DaemonSet lacks {must}");
    }
    let pm = std::fs::read_to_string(repo().join("packaging/k8s/podmonitor.yaml")).unwrap();
    assert!(pm.contains("port: metrics") && ds.contains("name: metrics"), "the PodMonitor scrapes the named port");
}

/// The subcommands `observer [SUB] --help` lists (`testkit::help::subcommands`).
fn subcommands(path: &[&str]) -> Vec<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_observer")).args(path).arg("--help").output().unwrap();
    testkit::help::subcommands(&String::from_utf8(out.stdout).unwrap())
}

/// `observer assets DIR` (what `cargo xtask man` and the package run) writes
/// a man page for the program and for every subcommand its help lists,
/// nested ones included, and the bash, zsh and fish completions.
#[test]
fn every_subcommand_has_a_man_page_and_the_shells_have_completions() {
    let dir = std::env::temp_dir().join(format!("observer-assets-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(env!("CARGO_BIN_EXE_observer")).arg("assets").arg(&dir).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let top = subcommands(&[]);
    assert!(top.len() >= 10 && top.iter().any(|s| s == "serve"), "{top:?}");
    assert!(!top.iter().any(|s| s == "assets"), "the assets command is hidden");
    let mut pages = vec!["observer".to_string()];
    for sub in &top {
        pages.push(format!("observer-{sub}"));
        for nested in subcommands(&[sub]) {
            pages.push(format!("observer-{sub}-{nested}"));
        }
    }
    assert!(pages.len() > top.len() + 1, "nested subcommands (plot's) have pages too: {pages:?}");
    for p in &pages {
        let f = dir.join("man").join(format!("{p}.1"));
        let text = std::fs::read_to_string(&f).unwrap_or_else(|e| panic!("no man page {}: {e}", f.display()));
        assert!(text.starts_with(".ie") || text.starts_with(".TH") || text.contains("\n.TH "), "{p}.1 is not roff");
        assert!(text.contains(".SH NAME") && text.contains(".SH SYNOPSIS"), "{p}.1 lacks its sections");
    }
    let serve = std::fs::read_to_string(dir.join("man/observer-serve.1")).unwrap();
    assert!(serve.contains("discover") && serve.contains("web.listen\\-address"), "serve's flags are in its page");
    for c in ["observer.bash", "_observer", "observer.fish"] {
        let text = std::fs::read_to_string(dir.join("completions").join(c)).unwrap();
        assert!(text.contains("serve"), "{c} completes the subcommands");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// CAP_SYS_ADMIN is needed for uprobes on this kernel (6.18): the unit grants
/// it and says why, and so does the DaemonSet.
#[test]
fn the_unit_says_why_it_needs_cap_sys_admin() {
    let unit = std::fs::read_to_string(repo().join("packaging/moe-observer.service")).unwrap();
    assert!(unit.lines().any(|l| l.starts_with("#   CAP_SYS_ADMIN ") && l.contains("uprobe")), "{unit}");
    let ds = std::fs::read_to_string(repo().join("packaging/k8s/daemonset.yaml")).unwrap();
    assert!(ds.contains("SYS_ADMIN"), "the DaemonSet grants SYS_ADMIN");
}
