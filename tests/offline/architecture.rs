//! The module layering of `docs/ARCHITECTURE.md`, checked against the source.
//!
//! An edge runs from one source file to another when the first names the second through a path outside
//! comments and test code (`#[cfg(test)]` items, `tests.rs` files): a `crate::` or `super::` path
//! (`use super::*` too), or, in a file that declares child modules (`mod x;`, `pub mod x;` in a
//! `mod.rs`, or in `foo.rs` with a `foo/` folder), a path that starts with one of those children
//! (`x::f()`, `pub use x::X`, `pub use self::x::{X, Y}`). A path leads to the deepest file it names.
//! Two checks:
//! - no cycle between source files (no file reaches itself through such edges): a child does not use
//!   its parent's items when the parent uses the child, so a `mod.rs` re-exports but the children import
//!   from the sibling file that defines an item, and helpers they share live in a sibling file;
//! - every edge between top-level modules is one the table in `docs/ARCHITECTURE.md` allows, and that
//!   table names every module of `src/lib.rs` and allows no cycle itself.
use crate::common;
mod config_reference;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// A module path: `["stages", "run"]` for `src/stages/run.rs` or `src/stages/run/mod.rs`.
type ModPath = Vec<String>;

fn mod_path(rel: &Path) -> ModPath {
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    let last = parts.pop().expect("file name");
    let stem = last.trim_end_matches(".rs").to_string();
    if !matches!(stem.as_str(), "mod" | "lib" | "main") {
        parts.push(stem);
    }
    parts
}

/// The source without comments and without `#[cfg(test)]` items (a `mod x;` line, or a braced block).
fn code_of(text: &str) -> String {
    let no_comments: Vec<&str> = text.lines().map(|l| l.find("//").map_or(l, |i| &l[..i])).collect();
    let mut out = String::new();
    let mut lines = no_comments.into_iter();
    while let Some(l) = lines.next() {
        if l.trim() != "#[cfg(test)]" {
            out.push_str(l);
            out.push('\n');
            continue;
        }
        // Skip the item the attribute applies to.
        let mut depth = 0i64;
        let mut opened = false;
        for l in lines.by_ref() {
            depth += l.matches('{').count() as i64 - l.matches('}').count() as i64;
            opened |= l.contains('{');
            if (opened && depth <= 0) || (!opened && l.trim_end().ends_with(';')) {
                break;
            }
        }
    }
    out
}

/// Expands `a::{b, c::{d, e}}` into `[a::b, a::c::d, a::c::e]` (segments only; `self`, `*` and
/// `x as y` reduced to their module part).
fn expand(prefix: &[String], s: &str, out: &mut Vec<ModPath>) {
    let s = s.trim();
    if s.is_empty() {
        return;
    }
    if let Some(inner) = s.strip_prefix('{').and_then(|r| r.strip_suffix('}')) {
        let (mut depth, mut start) = (0, 0);
        for (i, ch) in inner.char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    expand(prefix, &inner[start..i], out);
                    start = i + 1;
                }
                _ => {}
            }
        }
        expand(prefix, &inner[start..], out);
        return;
    }
    if let Some((head, rest)) = s.split_once("::{") {
        let mut p = prefix.to_vec();
        p.extend(head.split("::").map(|x| x.trim().to_string()));
        expand(&p, &format!("{{{rest}"), out);
        return;
    }
    let mut p = prefix.to_vec();
    p.extend(s.split("::").map(|x| x.split(" as ").next().unwrap_or(x).trim().to_string()).filter(|x| !x.is_empty() && x != "self" && x != "*"));
    out.push(p);
}

/// A braced use list, `{..}`, with lists nested up to three deep.
const USE_LIST: &str = r"\{(?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*\}";

/// The file-level dependency graph of `src/` (keys and values: module paths of files).
fn graph(src: &Path) -> BTreeMap<ModPath, BTreeSet<ModPath>> {
    let files: Vec<(ModPath, String)> = walkdir::WalkDir::new(src)
        .into_iter()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "rs"))
        .map(|e| (mod_path(e.path().strip_prefix(src).unwrap()), std::fs::read_to_string(e.path()).unwrap()))
        .filter(|(m, _)| !m.is_empty() && !m.iter().any(|s| s == "tests") && m != &["bin".to_string()])
        .collect();
    let known: BTreeSet<ModPath> = files.iter().map(|(m, _)| m.clone()).collect();
    let resolve = |p: &[String]| (1..=p.len()).rev().map(|i| p[..i].to_vec()).find(|c| known.contains(c));
    let mut g: BTreeMap<ModPath, BTreeSet<ModPath>> = BTreeMap::new();
    for (me, text) in &files {
        let code = code_of(text);
        let entry = g.entry(me.clone()).or_default();
        // The children of this file that are files themselves (not inline `mod x { .. }` blocks).
        let children: BTreeSet<String> = child_mods(&code).into_iter().filter(|x| known.contains(&[me.clone(), vec![x.clone()]].concat())).collect();
        for p in named_paths(me, &code, &children) {
            if let Some(t) = resolve(&p) {
                if &t != me {
                    entry.insert(t);
                }
            }
        }
    }
    g
}

/// The module paths (from the crate root) that the code of the file of module `me` names: its
/// `crate::` and `super::` paths (`super::*` included) and its paths into its child modules `children`
/// ([`child_paths`]).
fn named_paths(me: &[String], code: &str, children: &BTreeSet<String>) -> Vec<ModPath> {
    let path_re = regex::Regex::new(&format!(r"\b(crate|super)::(\*|(?:{USE_LIST})|(?:[A-Za-z_][A-Za-z0-9_]*(?:::[A-Za-z_][A-Za-z0-9_]*)*(?:::{USE_LIST})?))")).unwrap();
    let mut paths = vec![];
    for c in path_re.captures_iter(code) {
        let prefix: Vec<String> = if &c[1] == "crate" { vec![] } else { me[..me.len().saturating_sub(1)].to_vec() };
        expand(&prefix, &c[2], &mut paths);
    }
    paths.extend(child_paths(code, children).into_iter().map(|p| [me.to_vec(), p].concat()));
    paths
}

/// The child modules a file declares by `mod x;` (any visibility), not inline `mod x { .. }` blocks.
fn child_mods(code: &str) -> BTreeSet<String> {
    let decl = regex::Regex::new(r"(?m)^\s*(?:pub(?:\s*\([^)]*\))?\s+)?mod\s+([A-Za-z_][A-Za-z0-9_]*)\s*;").unwrap();
    decl.captures_iter(code).map(|c| c[1].to_string()).collect()
}

/// The paths, relative to this file's module, that start with one of its `children`: `x::f`,
/// `x::{A, b::C}`, `x::*`, `self::x::A` or `self::{x::A, y}` (a bare `x::` preceded by `::` is part of
/// a longer path and not one of them).
fn child_paths(code: &str, children: &BTreeSet<String>) -> Vec<ModPath> {
    if children.is_empty() {
        return vec![];
    }
    let rest = format!(r"(\*|{USE_LIST}|[A-Za-z_][A-Za-z0-9_]*(?:::[A-Za-z_][A-Za-z0-9_]*)*(?:::{USE_LIST}|::\*)?)");
    let bare = regex::Regex::new(&format!(r"(?:^|[^A-Za-z0-9_:$])([A-Za-z_][A-Za-z0-9_]*)::{rest}")).unwrap();
    let mut out = vec![];
    for c in bare.captures_iter(code) {
        let mut paths = vec![];
        if &c[1] == "self" {
            expand(&[], &c[2], &mut paths);
        } else if children.contains(&c[1]) {
            expand(&[c[1].to_string()], &c[2], &mut paths);
        }
        out.extend(paths.into_iter().filter(|p| p.first().is_some_and(|x| children.contains(x))));
    }
    out
}

/// Strongly connected groups of more than one file (Tarjan).
fn cycles(g: &BTreeMap<ModPath, BTreeSet<ModPath>>) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a BTreeMap<ModPath, BTreeSet<ModPath>>,
        index: BTreeMap<&'a ModPath, usize>,
        low: BTreeMap<&'a ModPath, usize>,
        stack: Vec<&'a ModPath>,
        on: BTreeSet<&'a ModPath>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a ModPath) {
        let i = t.index.len();
        t.index.insert(v, i);
        t.low.insert(v, i);
        t.stack.push(v);
        t.on.insert(v);
        for w in t.g.get(v).into_iter().flatten() {
            if !t.index.contains_key(w) {
                visit(t, w);
                let lw = t.low[w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if t.on.contains(w) {
                let iw = t.index[w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = vec![];
            loop {
                let w = t.stack.pop().unwrap();
                t.on.remove(w);
                comp.push(w.join("/"));
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                t.out.push(comp);
            }
        }
    }
    let mut t = T { g, index: BTreeMap::new(), low: BTreeMap::new(), stack: vec![], on: BTreeSet::new(), out: vec![] };
    for v in g.keys() {
        if !t.index.contains_key(v) {
            visit(&mut t, v);
        }
    }
    t.out
}

/// The `| `module` | may use |` rows of docs/ARCHITECTURE.md.
fn allowed(doc: &str) -> BTreeMap<String, BTreeSet<String>> {
    let row = regex::Regex::new(r"^\|\s*`([a-z_]+)`\s*\|([^|]*)\|").unwrap();
    let name = regex::Regex::new(r"`([a-z_]+)`").unwrap();
    doc.lines()
        .filter_map(|l| row.captures(l))
        .map(|c| (c[1].to_string(), name.captures_iter(&c[2]).map(|m| m[1].to_string()).collect()))
        .collect()
}

#[test]
fn no_cycle_between_source_files() {
    let g = graph(&common::root().join("src"));
    assert!(g.len() > 100, "only {} source files found", g.len());
    let found = cycles(&g);
    assert!(found.is_empty(), "files that reach themselves through crate::/super:: paths: {found:#?}");
}

#[test]
fn top_level_modules_use_only_what_the_architecture_allows() {
    let root = common::root();
    let table = allowed(&std::fs::read_to_string(root.join("docs/ARCHITECTURE.md")).unwrap());
    let lib = std::fs::read_to_string(root.join("src/lib.rs")).unwrap();
    let modules: BTreeSet<String> = regex::Regex::new(r"(?m)^pub mod ([a-z_]+);").unwrap().captures_iter(&lib).map(|c| c[1].to_string()).collect();
    let listed: BTreeSet<String> = table.keys().cloned().collect();
    assert_eq!(listed, modules, "docs/ARCHITECTURE.md's table and src/lib.rs's modules differ");
    // The table itself is layered: no module may use, directly or not, a module that may use it.
    let layered: BTreeMap<ModPath, BTreeSet<ModPath>> = table.iter().map(|(m, uses)| (vec![m.clone()], uses.iter().map(|u| vec![u.clone()]).collect())).collect();
    let loops = cycles(&layered);
    assert!(loops.is_empty(), "docs/ARCHITECTURE.md's table allows cycles: {loops:#?}");
    let mut wrong = vec![];
    for (from, to) in graph(&root.join("src")) {
        let a = &from[0];
        for t in to {
            let b = &t[0];
            if b != a && !table.get(a).is_some_and(|s| s.contains(b)) {
                wrong.push(format!("{} -> {}", from.join("/"), t.join("/")));
            }
        }
    }
    assert!(wrong.is_empty(), "edges docs/ARCHITECTURE.md does not allow: {wrong:#?}");
}

#[test]
fn the_parser_reads_nested_use_lists_and_skips_test_code() {
    let mut out = vec![];
    expand(&[], "{a::{b, c::d as e}, f}", &mut out);
    assert_eq!(out, vec![vec!["a", "b"], vec!["a", "c", "d"], vec!["f"]]);
    let code = code_of("use crate::a; // crate::b\n#[cfg(test)]\nmod tests {\n    use crate::c;\n}\n#[cfg(test)]\nmod more;\nuse crate::d;\n");
    assert!(code.contains("crate::a") && code.contains("crate::d"), "{code}");
    assert!(!code.contains("crate::b") && !code.contains("crate::c") && !code.contains("more"), "{code}");
}

#[test]
fn the_parser_reads_paths_into_child_modules() {
    let code = code_of(concat!(
        "pub mod sink;\npub(crate) mod claude_code;\nmod codex;\nmod inline { }\n",
        "pub use self::sink::{Sink, Flush};\npub use codex::*;\n",
        "use self::{claude_code::{read, Format}, other::X};\n",
        "fn f() { claude_code::read(x); crate::sink::y(); a::sink::z(); let sink = 1; }\n",
        "#[cfg(test)]\nmod tests {\n    use codex::Hidden;\n}\n",
    ));
    let children = child_mods(&code);
    assert_eq!(children, ["claude_code", "codex", "sink"].map(String::from).into());
    let found: BTreeSet<String> = child_paths(&code, &children).iter().map(|p| p.join("::")).collect();
    let want = ["sink::Sink", "sink::Flush", "codex", "claude_code::read", "claude_code::Format"];
    assert_eq!(found, want.map(String::from).into());
    assert!(child_paths(&code, &BTreeSet::new()).is_empty());
    // From the crate root: `super::` (a glob too) from `ingest/codex.rs`, child paths from `ingest/mod.rs`.
    let named = |me: &[&str], code: &str, children: &BTreeSet<String>| -> Vec<String> {
        let me: ModPath = me.iter().map(|s| s.to_string()).collect();
        named_paths(&me, code, children).iter().map(|p| p.join("::")).collect()
    };
    assert_eq!(named(&["ingest", "codex"], "use super::*;\nuse crate::{a::B, c};\n", &BTreeSet::new()), ["ingest", "a::B", "c"]);
    assert_eq!(named(&["ingest"], "pub use sink::Sink;\nsink::Sink::new();\n", &children), ["ingest::sink::Sink", "ingest::sink::Sink::new"]);
}
