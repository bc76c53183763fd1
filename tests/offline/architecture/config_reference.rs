//! `docs/config-reference.md`: every key of a pipeline file with its type, default and meaning,
//! generated from the config structs' doc comments (read from `src/` with syn) and the built-in
//! defaults (`PipelineConfig::embedded_default()` serialised), and checked here. Rewrite it with
//! `NEXTSTATE_WRITE_CONFIG_REFERENCE=1 cargo test --test offline config_reference`.

use std::collections::BTreeMap;
use std::path::Path;

use quote::ToTokens;

/// Every `struct` under `src/`, by name; a name defined twice keeps the one that derives `Deserialize`.
fn structs(src: &Path) -> BTreeMap<String, syn::ItemStruct> {
    let mut out: BTreeMap<String, syn::ItemStruct> = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        // Sorted: the choice between two structs of one name must not depend on the file system's order.
        let mut entries: Vec<std::path::PathBuf> = std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.path()).collect();
        entries.sort();
        for p in entries {
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let file = syn::parse_file(&std::fs::read_to_string(&p).unwrap()).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                collect(&file.items, &mut out);
            }
        }
    }
    out
}

fn collect(items: &[syn::Item], out: &mut BTreeMap<String, syn::ItemStruct>) {
    for item in items {
        match item {
            syn::Item::Struct(s) if derives_deserialize(&s.attrs) || !out.contains_key(&s.ident.to_string()) => {
                out.insert(s.ident.to_string(), s.clone());
            }
            syn::Item::Mod(m) => {
                if let Some((_, items)) = &m.content {
                    collect(items, out);
                }
            }
            _ => {}
        }
    }
}

fn derives_deserialize(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| a.path().is_ident("derive") && a.to_token_stream().to_string().contains("Deserialize"))
}

/// The text of the `#[serde(...)]` attributes.
fn serde_attr(attrs: &[syn::Attribute]) -> String {
    attrs.iter().filter(|a| a.path().is_ident("serde")).map(|a| a.to_token_stream().to_string()).collect::<Vec<_>>().join(" ")
}

/// The `///` lines joined into one paragraph.
fn doc(attrs: &[syn::Attribute]) -> String {
    let lines: Vec<String> = attrs
        .iter()
        .filter_map(|a| match &a.meta {
            syn::Meta::NameValue(nv) if nv.path.is_ident("doc") => match &nv.value {
                syn::Expr::Lit(syn::ExprLit { lit: syn::Lit::Str(s), .. }) => Some(s.value().trim().to_string()),
                _ => None,
            },
            _ => None,
        })
        .collect();
    let text = lines.join(" ").split_whitespace().collect::<Vec<_>>().join(" ");
    // A rustdoc link to an item (`[x](crate::a::B)`) is no link on a page: keep its text.
    regex::Regex::new(r"\[([^\]]+)\]\((?:crate|super|self)::[^)]*\)").unwrap().replace_all(&text, "$1").into_owned()
}

/// `Option<crate::x::Y>` → `Option<Y>`.
fn type_text(ty: &syn::Type) -> String {
    let t = ty.to_token_stream().to_string().replace(' ', "");
    let path = regex::Regex::new(r"(\w+::)+").unwrap();
    path.replace_all(&t, "").replace(',', ", ")
}

/// The struct a field's type names, through `Option<…>` and `Box<…>`.
fn inner_struct<'a>(ty: &syn::Type, all: &'a BTreeMap<String, syn::ItemStruct>) -> Option<&'a syn::ItemStruct> {
    let syn::Type::Path(p) = ty else { return None };
    let last = p.path.segments.last()?;
    let name = last.ident.to_string();
    if name == "Option" || name == "Box" {
        if let syn::PathArguments::AngleBracketed(a) = &last.arguments {
            if let Some(syn::GenericArgument::Type(t)) = a.args.first() {
                return inner_struct(t, all);
            }
        }
        return None;
    }
    all.get(&name).filter(|s| derives_deserialize(&s.attrs) && matches!(s.fields, syn::Fields::Named(_)))
}

/// One row of the reference.
struct Key {
    path: String,
    ty: String,
    default: String,
    meaning: String,
}

fn walk(s: &syn::ItemStruct, prefix: &str, all: &BTreeMap<String, syn::ItemStruct>, defaults: &toml::Value, out: &mut Vec<Key>) {
    let container = serde_attr(&s.attrs);
    let container_default = regex::Regex::new(r"\bdefault\b").unwrap().is_match(&container);
    let syn::Fields::Named(fields) = &s.fields else { return };
    for f in &fields.named {
        let attr = serde_attr(&f.attrs);
        if attr.contains("skip )") || attr.contains("skip,") || attr.contains("skip_deserializing") {
            continue;
        }
        let ident = f.ident.as_ref().unwrap().to_string();
        let name = regex::Regex::new(r#"rename = "([^"]+)""#).unwrap().captures(&attr).map_or(ident, |c| c[1].to_string());
        if attr.contains("flatten") {
            if let Some(inner) = inner_struct(&f.ty, all) {
                walk(inner, prefix, all, defaults, out);
            }
            continue;
        }
        let path = if prefix.is_empty() { name.clone() } else { format!("{prefix}.{name}") };
        let value = path.split('.').try_fold(defaults, |v, k| v.get(k));
        if let Some(inner) = inner_struct(&f.ty, all) {
            walk(inner, &path, all, defaults, out);
            continue;
        }
        let optional = type_text(&f.ty).starts_with("Option<");
        let has_default = container_default || regex::Regex::new(r"\bdefault\b").unwrap().is_match(&attr);
        let default = match value {
            _ if !has_default && !optional => "required".to_string(),
            Some(v) => format!("`{}`", v.to_string().replace('|', "\\|")),
            None => "unset".to_string(),
        };
        out.push(Key { path, ty: format!("`{}`", type_text(&f.ty)), default, meaning: doc(&f.attrs).replace('|', "\\|") });
    }
}

/// The reference page's text.
fn reference(root: &Path) -> String {
    let all = structs(&root.join("src"));
    let defaults = toml::Value::try_from(nextstate::config::PipelineConfig::embedded_default()).unwrap();
    let mut keys = vec![];
    walk(&all["PipelineConfig"], "", &all, &defaults, &mut keys);
    let mut text = String::from(
        "# Pipeline configuration reference\n\n\
         Generated from the config structs' doc comments and the built-in defaults by\n\
         `tests/offline/architecture/config_reference.rs` (`NEXTSTATE_WRITE_CONFIG_REFERENCE=1 cargo test --test offline\n\
         config_reference` rewrites it; the test fails when it is stale). Every key can be set in a pipeline file\n\
         (`[table]` then `key = value`), and every key inside a table also by an environment variable\n\
         `NEXTSTATE_<TABLE>__<KEY>` (e.g. `NEXTSTATE_TRAINER__LR=1.0e-4`, `NEXTSTATE_TRAINER__LORA__RANK=16`; not the\n\
         entries of `[bus.properties]` / `[bus.secret_env]`), which wins over the file; command-line flags win over\n\
         both ([configuration](configuration.md)). \"unset\":\n\
         no value unless given (the meaning says what happens then); \"required\": the file must give it.\n",
    );
    // One section per table, in the order the tables first appear.
    let mut sections: Vec<(String, Vec<&Key>)> = vec![];
    for k in &keys {
        let t = k.path.rsplit_once('.').map_or("", |(t, _)| t).to_string();
        match sections.iter_mut().find(|(name, _)| *name == t) {
            Some((_, v)) => v.push(k),
            None => sections.push((t, vec![k])),
        }
    }
    for (table, keys) in sections {
        let title = if table.is_empty() { "top level".to_string() } else { format!("`[{table}]`") };
        text.push_str(&format!("\n## {title}\n\n| key | type | default | meaning |\n|---|---|---|---|\n"));
        for k in keys {
            let key = k.path.rsplit_once('.').map_or(k.path.as_str(), |(_, n)| n);
            text.push_str(&format!("| `{key}` | {} | {} | {} |\n", k.ty, k.default, k.meaning));
        }
    }
    text
}

#[test]
fn config_reference_is_generated_from_the_config_structs() {
    let root = crate::common::root();
    let want = reference(&root);
    let path = root.join("docs/config-reference.md");
    if std::env::var_os("NEXTSTATE_WRITE_CONFIG_REFERENCE").is_some() {
        std::fs::write(&path, &want).unwrap();
    }
    let got = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(want.lines().filter(|l| l.starts_with("| `")).count() > 100, "too few keys found:\n{want}");
    assert!(
        got == want,
        "docs/config-reference.md is stale: run NEXTSTATE_WRITE_CONFIG_REFERENCE=1 cargo test --test offline config_reference"
    );
}
