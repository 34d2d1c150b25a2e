//! No two sibling modules import each other anywhere in the workspace: within every module,
//! the references between its child modules form no cycle of two. A module's references are
//! every path it names (`use` items and paths in code) that starts with `crate`, `super` or
//! `self`, resolved against where it is written (an inline `mod tests` inside `a.rs` is a child
//! of `a`, so its `use super::*` names `a` itself); a name a parent re-exports from one of its
//! children (`pub use child::Name`) counts as that child. A `mod.rs` re-exporting its children
//! and a test module using its parent are not edges between siblings.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use syn::visit::Visit;

/// A module by its path from the crate root (`["train", "trainer"]`).
type ModPath = Vec<String>;

/// The source roots of the workspace's crates (libraries, binaries, examples).
fn crate_roots(workspace: &Path) -> Vec<PathBuf> {
    let mut roots = Vec::new();
    for dir in ["merak-plan", "merak-burn", "launch", "tests", "benches"] {
        roots.push(workspace.join(dir).join("src"));
    }
    for group in ["models", "examples"] {
        let Ok(entries) = std::fs::read_dir(workspace.join(group)) else {
            continue;
        };
        for e in entries.flatten() {
            roots.push(e.path().join("src"));
        }
    }
    roots.retain(|r| r.is_dir());
    roots
}

/// Every module file under `root` with its module path (`lib.rs`, `main.rs` and `mod.rs`
/// name their folder's module; other files under `src/bin/` are crate roots of their own).
fn module_files(root: &Path) -> Vec<(ModPath, PathBuf)> {
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out
}

fn walk(root: &Path, dir: &Path, out: &mut Vec<(ModPath, PathBuf)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            walk(root, &path, out);
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let rel = path.strip_prefix(root).unwrap_or(&path);
        let mut parts: ModPath = (rel.iter())
            .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
            .collect();
        if parts.first().is_some_and(|p| p == "bin") {
            // A binary's own crate: its modules are its file alone.
            parts = vec![format!("bin:{}", parts[1..].join("/"))];
        } else if matches!(
            parts.last().map(String::as_str),
            Some("mod" | "lib" | "main")
        ) {
            parts.pop();
        }
        out.push((parts, path));
    }
}

/// What one file names: the paths it refers to, resolved to module paths, and the names it
/// re-exports from its children.
#[derive(Default)]
struct FileRefs {
    /// Absolute paths named (the module where each was written, and the path).
    named: Vec<(ModPath, ModPath)>,
    /// `pub use child::..::Name` at the file's top level: `Name` -> `child`.
    reexports: BTreeMap<String, String>,
}

/// Collects the paths of a file, tracking inline modules.
struct Collector {
    /// The module being visited (the file's, then inline modules inside it).
    here: ModPath,
    /// How deep in inline modules the visit is (0: the file's top level).
    depth: usize,
    refs: FileRefs,
}

impl Collector {
    /// `segments` (a path as written) resolved from `self.here`, when it starts with
    /// `crate`, `super` or `self`.
    fn resolve(&self, segments: &[String]) -> Option<ModPath> {
        let mut base = self.here.clone();
        let mut rest = segments;
        match rest.first().map(String::as_str) {
            Some("crate") => {
                base.clear();
                rest = &rest[1..];
            }
            Some("self") => rest = &rest[1..],
            Some("super") => {
                while rest.first().is_some_and(|s| s == "super") {
                    base.pop()?;
                    rest = &rest[1..];
                }
            }
            _ => return None,
        }
        base.extend(rest.iter().cloned());
        Some(base)
    }

    fn name(&mut self, segments: &[String]) {
        if let Some(abs) = self.resolve(segments) {
            self.refs.named.push((self.here.clone(), abs));
        }
    }

    /// Every full path a `use` tree names (a glob names its prefix).
    fn use_paths(tree: &syn::UseTree, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                Self::use_paths(&p.tree, prefix, out);
                prefix.pop();
            }
            syn::UseTree::Name(n) => {
                let mut full = prefix.clone();
                if n.ident != "self" {
                    full.push(n.ident.to_string());
                }
                out.push(full);
            }
            syn::UseTree::Rename(r) => {
                let mut full = prefix.clone();
                full.push(r.ident.to_string());
                out.push(full);
            }
            syn::UseTree::Glob(_) => out.push(prefix.clone()),
            syn::UseTree::Group(g) => {
                for t in &g.items {
                    Self::use_paths(t, prefix, out);
                }
            }
        }
    }
}

impl<'ast> Visit<'ast> for Collector {
    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        if m.content.is_some() {
            self.here.push(m.ident.to_string());
            self.depth += 1;
            syn::visit::visit_item_mod(self, m);
            self.depth -= 1;
            self.here.pop();
        }
    }

    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        let mut paths = Vec::new();
        Self::use_paths(&u.tree, &mut Vec::new(), &mut paths);
        let public = !matches!(u.vis, syn::Visibility::Inherited);
        for p in &paths {
            self.name(p);
            // `pub use child::..::Name` (or `self::child::..`) re-exports Name from child.
            let local = match p.first().map(String::as_str) {
                Some("self") => &p[1..],
                Some("crate" | "super") => continue,
                _ => &p[..],
            };
            if public && self.depth == 0 && local.len() >= 2 {
                let name = local.last().cloned().unwrap_or_default();
                self.refs.reexports.insert(name, local[0].clone());
            }
        }
    }

    fn visit_path(&mut self, p: &'ast syn::Path) {
        let segments: Vec<String> = p.segments.iter().map(|s| s.ident.to_string()).collect();
        self.name(&segments);
        syn::visit::visit_path(self, p);
    }
}

/// The sibling a reference from module `from` to `to` lands on, when both sit under the
/// same parent: `(parent, from's child, to's child)` with different children.
fn sibling_edge(
    from: &ModPath,
    to: &ModPath,
    modules: &BTreeSet<ModPath>,
    reexports: &BTreeMap<ModPath, BTreeMap<String, String>>,
) -> Option<(ModPath, String, String)> {
    // The common prefix; both must go one level below it.
    let common = from.iter().zip(to).take_while(|(a, b)| a == b).count();
    let parent: ModPath = from[..common].to_vec();
    let from_child = from.get(common)?.clone();
    let next = to.get(common)?;
    let mut candidate = parent.clone();
    candidate.push(next.clone());
    let to_child = if modules.contains(&candidate) {
        next.clone()
    } else {
        // An item of the parent: a child's when the parent re-exports it from one.
        reexports.get(&parent)?.get(next)?.clone()
    };
    (from_child != to_child).then_some((parent, from_child, to_child))
}

#[test]
fn no_two_sibling_modules_import_each_other() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut cycles = Vec::new();
    let mut files_seen = 0;
    for root in crate_roots(&workspace) {
        let files = module_files(&root);
        files_seen += files.len();
        let modules: BTreeSet<ModPath> = files.iter().map(|(m, _)| m.clone()).collect();
        let mut reexports = BTreeMap::new();
        let mut named = Vec::new();
        for (module, path) in &files {
            let text = std::fs::read_to_string(path).expect("a readable source file");
            let file = syn::parse_file(&text)
                .unwrap_or_else(|e| panic!("{}: does not parse: {e}", path.display()));
            let mut c = Collector {
                here: module.clone(),
                depth: 0,
                refs: FileRefs::default(),
            };
            c.visit_file(&file);
            reexports.insert(module.clone(), c.refs.reexports);
            named.extend(c.refs.named);
        }
        // Each edge with one reference that makes it (from where, to what).
        let mut edges: BTreeMap<(ModPath, String, String), String> = BTreeMap::new();
        for (from, to) in &named {
            if let Some(e) = sibling_edge(from, to, &modules, &reexports) {
                let example = format!("{} names {}", from.join("::"), to.join("::"));
                edges.entry(e).or_insert(example);
            }
        }
        for ((parent, a, b), there) in &edges {
            let back = (parent.clone(), b.clone(), a.clone());
            if let (true, Some(back)) = (a < b, edges.get(&back)) {
                let at = match parent.is_empty() {
                    true => "crate".to_string(),
                    false => parent.join("::"),
                };
                let root = root.strip_prefix(&workspace).unwrap_or(&root).display();
                cycles.push(format!("{root}: {at}: {a} <-> {b} ({there}; {back})"));
            }
        }
    }
    assert!(files_seen > 100, "only {files_seen} source files found");
    assert!(
        cycles.is_empty(),
        "sibling modules importing each other:\n{}",
        cycles.join("\n")
    );
}

#[test]
fn the_checker_finds_a_cycle_and_ignores_a_parents_reexports_and_tests() {
    let parse = |module: &[&str], text: &str| {
        let mut c = Collector {
            here: module.iter().map(|s| s.to_string()).collect(),
            depth: 0,
            refs: FileRefs::default(),
        };
        c.visit_file(&syn::parse_file(text).expect("parses"));
        c.refs
    };
    let modules: BTreeSet<ModPath> = [vec![], vec!["a".into()], vec!["b".into()]].into();
    let root = parse(&[], "mod a; mod b; pub use b::Thing;");
    let reexports = BTreeMap::from([(vec![], root.reexports)]);
    let a = parse(
        &["a"],
        "use crate::Thing; #[cfg(test)] mod tests { use super::*; }",
    );
    let b = parse(&["b"], "fn f() { super::a::g(); }");
    let edges: BTreeSet<_> = (a.named.iter().chain(&b.named))
        .filter_map(|(from, to)| sibling_edge(from, to, &modules, &reexports))
        .collect();
    let e = |x: &str, y: &str| (vec![], x.to_string(), y.to_string());
    assert_eq!(edges, BTreeSet::from([e("a", "b"), e("b", "a")]));
    // The root's re-export and a's test module using a are no edges.
    let alone = parse(
        &["a"],
        "#[cfg(test)] mod tests { use super::*; use crate::a::x; }",
    );
    assert!((alone.named.iter()).all(|(f, t)| sibling_edge(f, t, &modules, &reexports).is_none()));
}
