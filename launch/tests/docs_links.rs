//! The book's links hold: every relative link and image of every page under `docs/src`
//! resolves to a file in `docs/src`, every `#anchor` to a heading of the page it points into
//! (with mdBook's ids: the heading's text lowercased, whitespace to `-`, other punctuation
//! dropped, repeats numbered `-1`, `-2`, ...), and `SUMMARY.md` lists every page, each once,
//! and only pages that exist. No network: web links are not followed.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

/// `docs/src`.
fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/src")
}

/// Every file under `dir`, relative to it.
fn files(dir: &Path) -> Vec<PathBuf> {
    fn walk(base: &Path, dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(base, &p, out);
            } else if let Ok(rel) = p.strip_prefix(base) {
                out.push(rel.to_path_buf());
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// `text` without fenced code blocks (their lines become empty, so line numbers stay).
fn without_code_blocks(text: &str) -> String {
    let mut out = String::new();
    let mut fence: Option<String> = None;
    for line in text.lines() {
        let t = line.trim_start();
        let marker: String = t.chars().take_while(|&c| c == '`' || c == '~').collect();
        match &fence {
            Some(f) if marker.len() >= f.len() && marker.starts_with(&f[..1]) => fence = None,
            Some(_) => {}
            None if marker.len() >= 3 => fence = Some(marker),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// `line` without its inline code spans.
fn without_code_spans(line: &str) -> String {
    let mut out = String::new();
    let mut rest = line;
    while let Some(start) = rest.find('`') {
        out.push_str(&rest[..start]);
        let ticks = rest[start..].chars().take_while(|&c| c == '`').count();
        let fence = "`".repeat(ticks);
        let after = &rest[start + ticks..];
        match after.find(&fence) {
            Some(end) => rest = &after[end + ticks..],
            None => {
                out.push_str(&rest[start..]);
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

/// The targets of the page's links and images, with their line numbers: `[text](target)`,
/// `![alt](target)`, `[name]: target` definitions, and `src="..."`/`href="..."` of raw HTML.
fn link_targets(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in without_code_blocks(text).lines().enumerate() {
        let line = without_code_spans(line);
        let mut rest = line.as_str();
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let end = after.find(')').unwrap_or(after.len());
            let target = after[..end].split_whitespace().next().unwrap_or("");
            out.push((n + 1, target.trim_matches(['<', '>']).to_string()));
            rest = &after[end..];
        }
        let t = line.trim_start();
        if t.starts_with('[')
            && let Some(i) = t.find("]: ")
        {
            let target = t[i + 3..].split_whitespace().next().unwrap_or("");
            out.push((n + 1, target.to_string()));
        }
        for attr in ["src=\"", "href=\""] {
            for (i, _) in line.match_indices(attr) {
                let after = &line[i + attr.len()..];
                let end = after.find('"').unwrap_or(after.len());
                out.push((n + 1, after[..end].to_string()));
            }
        }
    }
    out
}

/// The text of a heading as mdBook renders it: links and images keep their text, code spans
/// their content; backticks, `*` emphasis markers and HTML tags go. (The book's headings use
/// no `_` emphasis.)
fn heading_text(raw: &str) -> String {
    let mut text = String::new();
    let mut rest = raw;
    while let Some(open) = rest.find('[') {
        let Some(close) = rest[open..].find("](").map(|i| open + i) else {
            break;
        };
        let Some(end) = rest[close + 2..].find(')').map(|i| close + 2 + i) else {
            break;
        };
        let start = if rest[..open].ends_with('!') {
            open - 1
        } else {
            open
        };
        text.push_str(&rest[..start]);
        text.push_str(&rest[open + 1..close]);
        rest = &rest[end + 1..];
    }
    text.push_str(rest);
    let mut out = String::new();
    let (mut in_tag, mut in_code) = (false, false);
    for c in text.chars() {
        match c {
            '`' => in_code = !in_code,
            _ if in_code => out.push(c),
            '<' => in_tag = true,
            '>' if in_tag => in_tag = false,
            '*' => {}
            _ if in_tag => {}
            other => out.push(other),
        }
    }
    out
}

/// mdBook's id for a heading's text.
fn heading_id(text: &str) -> String {
    text.trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| {
            if c.is_alphanumeric() || c == '_' || c == '-' {
                Some(c)
            } else if c.is_whitespace() {
                Some('-')
            } else {
                None
            }
        })
        .collect()
}

/// The ids of a page's headings (`#` lines outside code blocks), numbered as mdBook numbers
/// repeats; an explicit `{#id}` is taken as written.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut ids = BTreeSet::new();
    for line in without_code_blocks(text).lines() {
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let raw = line[hashes..].trim().trim_end_matches('#').trim();
        let id = match raw.rfind("{#") {
            Some(i) if raw.ends_with('}') => raw[i + 2..raw.len() - 1].to_string(),
            _ => heading_id(&heading_text(raw)),
        };
        let mut unique = id.clone();
        let mut n = 0;
        while ids.contains(&unique) {
            n += 1;
            unique = format!("{id}-{n}");
        }
        ids.insert(unique);
    }
    ids
}

/// `base/rel` with `.` and `..` resolved, or `None` when it leaves `base`'s root.
fn resolve(dir: &Path, rel: &str) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in dir.join(rel).components() {
        match c {
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    Some(out)
}

/// Whether a target leaves the book (a web address, mail).
fn external(target: &str) -> bool {
    target.contains("://") || target.starts_with("mailto:")
}

#[test]
fn every_link_and_image_of_the_book_resolves() {
    let src = src();
    let all: BTreeSet<PathBuf> = files(&src).into_iter().collect();
    let pages: Vec<&PathBuf> = all
        .iter()
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    assert!(
        pages.len() > 10,
        "only {} pages under {}",
        pages.len(),
        src.display()
    );
    let texts: BTreeMap<&PathBuf, String> = pages
        .iter()
        .map(|p| (*p, std::fs::read_to_string(src.join(p)).expect("a page")))
        .collect();
    let ids: BTreeMap<&PathBuf, BTreeSet<String>> =
        texts.iter().map(|(p, t)| (*p, anchors(t))).collect();
    let mut broken = Vec::new();
    let mut checked = 0;
    for (page, text) in &texts {
        let dir = page.parent().unwrap_or(Path::new(""));
        for (line, target) in link_targets(text) {
            if target.is_empty() || external(&target) {
                continue;
            }
            checked += 1;
            let (file, anchor) = match target.split_once('#') {
                Some((f, a)) => (f, Some(a)),
                None => (target.as_str(), None),
            };
            let at = format!("{}:{line}: {target}", page.display());
            let resolved = if file.is_empty() {
                Some((*page).clone())
            } else {
                resolve(dir, file)
            };
            let Some(resolved) = resolved else {
                broken.push(format!("{at}: leaves docs/src"));
                continue;
            };
            if !all.contains(&resolved) {
                broken.push(format!("{at}: no file docs/src/{}", resolved.display()));
                continue;
            }
            if let Some(anchor) = anchor {
                match ids.get(&resolved) {
                    Some(known) if known.contains(anchor) => {}
                    Some(_) => broken.push(format!(
                        "{at}: no heading with id `{anchor}` in {}",
                        resolved.display()
                    )),
                    None => broken.push(format!("{at}: an anchor into a file that is not a page")),
                }
            }
        }
    }
    assert!(checked > 50, "only {checked} links checked");
    assert!(
        broken.is_empty(),
        "broken links in the book:\n{}",
        broken.join("\n")
    );
}

#[test]
fn summary_lists_every_page_once_and_only_pages_that_exist() {
    let src = src();
    let summary = std::fs::read_to_string(src.join("SUMMARY.md")).expect("docs/src/SUMMARY.md");
    let mut listed = Vec::new();
    for (line, target) in link_targets(&summary) {
        if external(&target) {
            continue;
        }
        let file = target.split('#').next().unwrap_or("");
        assert!(
            !file.is_empty(),
            "SUMMARY.md:{line}: an entry without a page"
        );
        listed.push(PathBuf::from(file));
    }
    let mut problems = Vec::new();
    let mut seen = BTreeSet::new();
    for page in &listed {
        if !seen.insert(page.clone()) {
            problems.push(format!("listed twice: {}", page.display()));
        }
        if !src.join(page).is_file() {
            problems.push(format!("listed but missing: docs/src/{}", page.display()));
        }
    }
    for page in files(&src) {
        if page.extension().is_some_and(|x| x == "md")
            && page != Path::new("SUMMARY.md")
            && !seen.contains(&page)
        {
            problems.push(format!("not in SUMMARY.md: docs/src/{}", page.display()));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn heading_ids_follow_mdbook() {
    assert_eq!(
        heading_id(&heading_text("Set-up on a fresh Debian/Ubuntu machine")),
        "set-up-on-a-fresh-debianubuntu-machine"
    );
    assert_eq!(
        heading_id(&heading_text("`bench-allreduce` output")),
        "bench-allreduce-output"
    );
    assert_eq!(
        heading_id(&heading_text(
            "Sub-pipelined tensor parallelism (`bench-tp-layer --overlap`)"
        )),
        "sub-pipelined-tensor-parallelism-bench-tp-layer---overlap"
    );
    assert_eq!(
        heading_id(&heading_text("`Autodiff<Flex>` and <em>this</em>")),
        "autodiffflex-and-this"
    );
    assert_eq!(
        heading_id(&heading_text("A [link](x.md#y) *here*")),
        "a-link-here"
    );
    assert_eq!(
        heading_id(&heading_text("Section 1 with ZB-V (2026-11-23, later)")),
        "section-1-with-zb-v-2026-11-23-later"
    );
    let ids = anchors("# A\n\n## A\n\n```\n# not a heading\n```\n## A\n### Custom {#mine}\n");
    let expected: BTreeSet<String> = ["a", "a-1", "a-2", "mine"].map(String::from).into();
    assert_eq!(ids, expected);
}
