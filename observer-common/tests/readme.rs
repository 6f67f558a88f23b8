//! The README's vocabulary tables are the vocabulary's: each section between
//! `<!-- vocab:NAME -->` and `<!-- /vocab:NAME -->` is exactly what
//! `vocab::readme_section(NAME)` renders, so the README cannot drift from the
//! names the observer prints.

use observer_common::vocab::{README_SECTIONS, readme_section};

#[test]
fn the_readme_tables_are_the_vocabulary() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md");
    let readme = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut wrong = Vec::new();
    for name in README_SECTIONS {
        let (open, close) = (format!("<!-- vocab:{name} -->\n"), format!("<!-- /vocab:{name} -->"));
        let want = readme_section(name).unwrap();
        let got = readme.split_once(&open).and_then(|(_, rest)| rest.split_once(&close)).map(|(inside, _)| inside);
        match got {
            Some(g) if g == want => {}
            Some(_) => wrong.push(format!("section {name} differs; it should read:\n{open}{want}{close}\n")),
            None => wrong.push(format!("no section {name} in README.md; add:\n{open}{want}{close}\n")),
        }
        assert_eq!(readme.matches(&open).count(), readme.matches(&close).count(), "{name}: unbalanced markers");
    }
    assert!(wrong.is_empty(), "README.md is not what the vocabulary renders:\n\n{}", wrong.join("\n"));
}
