//! The hint texts behind each arm: per data pipeline (offline) or arm (online, pooled over its
//! replicates), how many hints were extracted, how many were accepted, how many distinct texts they
//! were, and each text with its count and share. It is the reports' `## Hint texts` section and the
//! offline `hint_texts` results table, so a reader sees whether the teacher was given instructions or
//! the student's complaint copied, and how varied they were (docs/method.md §3: a hint is meant to be a
//! concrete instruction).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::report::cell;
use crate::schema::HintRecord;

/// Texts shown per source in the report's table of most frequent hints (the results table has all).
pub const TOP_TEXTS: usize = 5;

/// The hint rows of one source and its accepted texts, counted.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HintCounts {
    /// Hint rows (every extraction, accepted or not).
    pub hint_rows: u64,
    /// Accepted hints (rows with a chosen hint) by text.
    pub texts: BTreeMap<String, u64>,
}

impl HintCounts {
    /// Counts `rows` whose `pipeline` is `pipeline` (every row with `None`).
    pub fn of(rows: &[HintRecord], pipeline: Option<&str>) -> HintCounts {
        let mut c = HintCounts::default();
        for r in rows.iter().filter(|r| pipeline.is_none_or(|p| r.pipeline == p)) {
            c.add(r.chosen_hint.as_deref());
        }
        c
    }

    /// Counts one hint row: `chosen` is its accepted hint, `None` when none was accepted.
    pub fn add(&mut self, chosen: Option<&str>) {
        self.hint_rows += 1;
        if let Some(h) = chosen {
            *self.texts.entry(h.to_string()).or_default() += 1;
        }
    }

    /// Adds another source's counts (an arm's replicates pooled).
    pub fn merge(&mut self, other: &HintCounts) {
        self.hint_rows += other.hint_rows;
        for (t, n) in &other.texts {
            *self.texts.entry(t.clone()).or_default() += n;
        }
    }

    /// Accepted hints (the sum of the text counts).
    pub fn accepted(&self) -> u64 {
        self.texts.values().sum()
    }
}

/// One source of hints: a data pipeline (offline) or an arm (online), the arms that trained on its
/// hints (comma-separated), and its counts.
#[derive(Debug, Clone, PartialEq)]
pub struct HintSource {
    /// Data pipeline or arm.
    pub source: String,
    /// Arms (or replicates) whose training used these hints.
    pub arms: String,
    /// The counts.
    pub counts: HintCounts,
}

/// One distinct accepted hint text of one source (the `hint_texts` results table).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HintTextRow {
    /// Data pipeline (offline) or arm (online).
    pub source: String,
    /// The arms that trained on these hints, comma-separated.
    pub arms: String,
    /// Rank by count within the source (1 = the most frequent; equal counts by text).
    pub rank: i64,
    /// The hint text.
    pub hint: String,
    /// Accepted hints with this text.
    pub count: i64,
    /// `count` / the source's accepted hints, 0 to 1.
    pub share: f64,
    /// Words in the text (whitespace-separated).
    pub words: i64,
}

/// Words of a hint text (whitespace-separated).
fn words(s: &str) -> usize {
    s.split_whitespace().count()
}

/// A source's texts as rows, most frequent first (equal counts in text order), ranks from 1.
pub fn text_rows(src: &HintSource) -> Vec<HintTextRow> {
    let accepted = src.counts.accepted().max(1) as f64;
    let mut texts: Vec<(&String, &u64)> = src.counts.texts.iter().collect();
    texts.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
    texts
        .into_iter()
        .enumerate()
        .map(|(i, (t, n))| HintTextRow {
            source: src.source.clone(),
            arms: src.arms.clone(),
            rank: i as i64 + 1,
            hint: t.clone(),
            count: *n as i64,
            share: *n as f64 / accepted,
            words: words(t) as i64,
        })
        .collect()
}

/// The report's `## Hint texts` section: a summary row per source (hint rows, accepted, distinct
/// texts, the most frequent text's share, mean words of the accepted hints), then the `top` most
/// frequent texts of each. Says so when there are no sources.
pub fn render(s: &mut String, sources: &[HintSource], top: usize) {
    let _ = writeln!(s, "## Hint texts\n");
    if sources.is_empty() {
        let _ = writeln!(s, "No arm extracted hints.\n");
        return;
    }
    let _ = writeln!(
        s,
        "The hints the teacher was conditioned on: per source, the hint rows (every extraction), the accepted ones (a chosen hint), how many distinct texts those were, the most frequent text's share of them and their mean length in words.\n"
    );
    let _ = writeln!(s, "| source | arms | hint rows | accepted | distinct texts | most frequent's share | mean words |");
    let _ = writeln!(s, "|---|---|---:|---:|---:|---:|---:|");
    for src in sources {
        let accepted = src.counts.accepted();
        let (share, mean_words) = if accepted == 0 {
            ("–".to_string(), "–".to_string())
        } else {
            let most = src.counts.texts.values().max().copied().unwrap_or(0);
            let w: u64 = src.counts.texts.iter().map(|(t, n)| words(t) as u64 * n).sum();
            (format!("{:.3}", most as f64 / accepted as f64), format!("{:.1}", w as f64 / accepted as f64))
        };
        let _ = writeln!(s, "| {} | {} | {} | {accepted} | {} | {share} | {mean_words} |", cell(&src.source), cell(&src.arms), src.counts.hint_rows, src.counts.texts.len());
    }
    s.push('\n');
    let rows: Vec<HintTextRow> = sources.iter().flat_map(|src| text_rows(src).into_iter().take(top)).collect();
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(s, "The most frequent accepted hints (at most {top} per source):\n");
    let _ = writeln!(s, "| source | rank | count | share | words | hint |");
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---|");
    for r in &rows {
        let _ = writeln!(s, "| {} | {} | {} | {:.3} | {} | {} |", cell(&r.source), r.rank, r.count, r.share, r.words, cell(&r.hint));
    }
    s.push('\n');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(name: &str, chosen: &[Option<&str>]) -> HintSource {
        let mut counts = HintCounts::default();
        for c in chosen {
            counts.add(*c);
        }
        HintSource { source: name.into(), arms: format!("{name}-arm"), counts }
    }

    #[test]
    fn texts_are_ranked_by_count_then_text_with_shares_and_words() {
        let a = source("p", &[Some("End with the number."), None, Some("Keep it short."), Some("End with the number."), Some("A b|c")]);
        assert_eq!((a.counts.hint_rows, a.counts.accepted()), (5, 4));
        let rows = text_rows(&a);
        let got: Vec<(i64, &str, i64, f64, i64)> = rows.iter().map(|r| (r.rank, r.hint.as_str(), r.count, r.share, r.words)).collect();
        assert_eq!(got, vec![(1, "End with the number.", 2, 0.5, 4), (2, "A b|c", 1, 0.25, 2), (3, "Keep it short.", 1, 0.25, 3)]);
    }

    #[test]
    fn replicates_pool_and_the_section_reads_by_hand() {
        let mut a = source("combined", &[Some("Keep it short."), Some("Keep it short.")]);
        a.counts.merge(&source("x", &[Some("No markdown."), None]).counts);
        let none = source("opd", &[None, None]);
        let mut s = String::new();
        render(&mut s, &[a, none], 1);
        // combined: 4 rows, 3 accepted, 2 texts, most frequent 2/3, mean words (3+3+2)/3 = 2.7.
        assert!(s.contains("| combined | combined-arm | 4 | 3 | 2 | 0.667 | 2.7 |\n"), "{s}");
        assert!(s.contains("| opd | opd-arm | 2 | 0 | 0 | – | – |\n"), "{s}");
        assert!(s.contains("(at most 1 per source):\n\n| source | rank | count | share | words | hint |\n|---|---:|---:|---:|---:|---|\n| combined | 1 | 2 | 0.667 | 3 | Keep it short. |\n\n"), "{s}");
        let mut e = String::new();
        render(&mut e, &[], TOP_TEXTS);
        assert_eq!(e, "## Hint texts\n\nNo arm extracted hints.\n\n");
    }
}
