//! Where an arm's training moved probability mass: each evaluated version's log-probs of two fixed token
//! sets, by token class, position and advantage sign, so the report can say which tokens an arm raised
//! and which it lowered (issue 37: why sampled-token OPD falls below v0 offline while top-K distillation
//! rises).
//!
//! The two sets, scored unchanged at every version of an arm (so a difference between versions is the
//! policy moving, not the tokens changing):
//! - [`HELDOUT`]: v0's greedy answers to the held-out problems (every response token, the stop token
//!   included when an answer ended on one);
//! - [`TRAINED`]: the arm's own training samples (the tokens its loss mask trains), each labelled with
//!   two [`Direction`]s: the sign of its advantage at the start of training (docs/method.md §6 with the
//!   rollout log-probs as the current policy, [`super::eval::token_advantages`]; `+` tokens are the ones
//!   the first step pushes up, `−` the ones it pushes down), and where the sample has teacher log-probs
//!   the sign of `teacher − rollout` (the hint-conditioned teacher's direction on that token, the same
//!   split for every arm that trains on a teacher, whatever its loss: a top-K arm's advantage is 0).
//!
//! Each version stores, per (set, class, band, sign), the token count and the summed log-prob (nats,
//! temperature 1). The change of a group from v0 to version v is `(Σ log π_v − Σ log π_0) / n` over the
//! same n tokens (nats per token), pooled over an arm's replicates by summing both before dividing.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::input_err;
use crate::model::LanguageModel;
use crate::report::cell;

/// The set of v0's greedy answers to the held-out problems.
pub const HELDOUT: &str = "heldout";
/// The set of the arm's training samples' trained tokens.
pub const TRAINED: &str = "trained";

/// What a response token is, from its decoded text: the first matching class in this order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum TokenClass {
    /// A stop token (end of the turn): its mass is the probability of ending the answer there.
    End,
    /// Another special token (one that decodes to nothing once special tokens are skipped).
    Special,
    /// A token with an ASCII digit (the numbers of the working and the final answer).
    Number,
    /// A token with markdown punctuation (`*`, `#`, `` ` ``, `|`).
    Markdown,
    /// A token with a line break.
    Newline,
    /// Every other token (words, spaces, punctuation).
    Word,
}

impl TokenClass {
    /// Every class, in report order.
    pub const ALL: [TokenClass; 6] = [TokenClass::End, TokenClass::Special, TokenClass::Number, TokenClass::Markdown, TokenClass::Newline, TokenClass::Word];

    /// The class of a token whose decoded text is `text` (special tokens kept); `stop` when its id is one
    /// of the model's stop ids, `special` when it is another special token.
    pub fn of(text: &str, stop: bool, special: bool) -> TokenClass {
        if stop {
            TokenClass::End
        } else if special {
            TokenClass::Special
        } else if text.chars().any(|c| c.is_ascii_digit()) {
            TokenClass::Number
        } else if text.contains(['*', '#', '`', '|']) {
            TokenClass::Markdown
        } else if text.contains('\n') {
            TokenClass::Newline
        } else {
            TokenClass::Word
        }
    }

    /// Its name in the table and the report.
    pub fn as_str(self) -> &'static str {
        match self {
            TokenClass::End => "end",
            TokenClass::Special => "special",
            TokenClass::Number => "number",
            TokenClass::Markdown => "markdown",
            TokenClass::Newline => "newline",
            TokenClass::Word => "word",
        }
    }
}

/// Advantages and teacher − rollout differences within this many nats of 0 count as 0 ([`Direction`]):
/// below the float noise between two scoring passes of the same weights, above it a real push.
pub const DEAD_BAND: f32 = 1e-3;

/// The sign of a per-token quantity (nats), with [`DEAD_BAND`] around 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Direction {
    /// Above `DEAD_BAND`.
    Up,
    /// Below `−DEAD_BAND`.
    Down,
    /// Within the band.
    Flat,
    /// Not defined for this token (a held-out answer; a sample without teacher log-probs; an arm trained
    /// at a temperature other than 1).
    None,
}

impl Direction {
    /// The direction of `x` (nats; a non-finite `x` is `None`).
    pub fn of(x: f32) -> Direction {
        if !x.is_finite() {
            Direction::None
        } else if x > DEAD_BAND {
            Direction::Up
        } else if x < -DEAD_BAND {
            Direction::Down
        } else {
            Direction::Flat
        }
    }

    /// `+`, `-`, `0` or `""`.
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Up => "+",
            Direction::Down => "-",
            Direction::Flat => "0",
            Direction::None => "",
        }
    }
}

/// The third of a response that token `t` (0-based) of `len` tokens lies in: `first`, `middle` or
/// `last` (`3·t / len` = 0, 1, 2).
pub fn band(t: usize, len: usize) -> &'static str {
    BANDS[band_index(t, len)]
}

/// The band names, first to last.
pub const BANDS: [&str; 3] = ["first", "middle", "last"];

fn band_index(t: usize, len: usize) -> usize {
    (3 * t / len.max(1)).min(2)
}

/// One response to score: its prompt and response ids, which response tokens count, and per response
/// token its two [`Direction`]s (every vector one entry per response token).
#[derive(Debug, Clone, PartialEq)]
pub struct MassItem {
    /// Prompt token ids.
    pub prompt_ids: Vec<u32>,
    /// Response token ids.
    pub response_ids: Vec<u32>,
    /// Whether each response token is counted (the loss mask of a sample; all for an answer).
    pub counted: Vec<bool>,
    /// The sign of each token's advantage at the start of training.
    pub signs: Vec<Direction>,
    /// The sign of each token's `teacher − rollout` log-prob.
    pub teacher: Vec<Direction>,
}

/// One group's tokens at one version (`token_mass`): the tokens of one set with the same class, third
/// and directions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MassRow {
    /// Arm.
    pub arm: String,
    /// Checkpoint version (0 = the initial weights).
    pub version: i64,
    /// [`HELDOUT`] or [`TRAINED`].
    pub set: String,
    /// [`TokenClass::as_str`].
    pub class: String,
    /// [`band`].
    pub band: String,
    /// [`Direction::as_str`] of the token's advantage at the start of training (`""` for the held-out
    /// set).
    pub sign: String,
    /// [`Direction::as_str`] of the token's `teacher − rollout` log-prob (`""` without teacher
    /// log-probs).
    #[serde(default)]
    pub teacher_sign: String,
    /// Tokens in the group.
    pub tokens: i64,
    /// Their summed log-prob under the version, nats (temperature 1).
    pub logprob_sum: f64,
}

/// The rows of one version from the log-probs `logprobs[i][t]` (nats) of `items[i]`'s response tokens,
/// with `class_of(id)` the class of a token id; only counted tokens add. Rows come in (class, band,
/// sign, teacher sign) order.
///
/// # Errors
/// [`crate::Error::InvalidInput`] when `logprobs` has another length than `items`, or an item's
/// log-probs, `counted`, `signs` or `teacher` have another length than its response.
pub fn aggregate(arm: &str, version: i64, set: &str, items: &[MassItem], logprobs: &[Vec<f32>], mut class_of: impl FnMut(u32) -> TokenClass) -> Result<Vec<MassRow>> {
    if logprobs.len() != items.len() {
        return Err(input_err!("token mass of {arm} v{version} ({set}): {} log-prob rows for {} responses", logprobs.len(), items.len()));
    }
    let mut acc: BTreeMap<(TokenClass, usize, Direction, Direction), (i64, f64)> = BTreeMap::new();
    for (k, (item, lp)) in items.iter().zip(logprobs).enumerate() {
        let n = item.response_ids.len();
        let lens = [lp.len(), item.counted.len(), item.signs.len(), item.teacher.len()];
        if lens.iter().any(|l| *l != n) {
            return Err(input_err!("token mass of {arm} v{version} ({set}), response {k}: {n} tokens but log-probs/counted/signs/teacher lengths {lens:?}"));
        }
        for t in 0..n {
            if !item.counted[t] {
                continue;
            }
            let e = acc.entry((class_of(item.response_ids[t]), band_index(t, n), item.signs[t], item.teacher[t])).or_insert((0, 0.0));
            e.0 += 1;
            e.1 += f64::from(lp[t]);
        }
    }
    Ok(acc
        .into_iter()
        .map(|((class, band, sign, teacher), (tokens, sum))| MassRow {
            arm: arm.into(),
            version,
            set: set.into(),
            class: class.as_str().into(),
            band: BANDS[band].into(),
            sign: sign.as_str().into(),
            teacher_sign: teacher.as_str().into(),
            tokens,
            logprob_sum: sum,
        })
        .collect())
}

/// [`aggregate`] of `items` scored by `lm` (temperature 1, at most `batch` items per scoring call); a
/// token's class comes from its decoded text, the model's stop ids and whether it decodes to nothing
/// with special tokens skipped.
///
/// # Errors
/// Model and tokenizer errors; those of [`aggregate`].
pub fn mass_rows(lm: &LanguageModel, arm: &str, version: i64, set: &str, items: &[MassItem], batch: usize) -> Result<Vec<MassRow>> {
    let mut logprobs = Vec::with_capacity(items.len());
    for chunk in items.chunks(batch.max(1)) {
        let pairs: Vec<(Vec<u32>, Vec<u32>)> = chunk.iter().map(|i| (i.prompt_ids.clone(), i.response_ids.clone())).collect();
        logprobs.extend(lm.score(&pairs, 0)?.into_iter().map(|s| s.logprobs));
    }
    let stops = lm.eos_token_ids().to_vec();
    let mut classes: HashMap<u32, TokenClass> = HashMap::new();
    for id in items.iter().flat_map(|i| i.response_ids.iter().copied()) {
        if let std::collections::hash_map::Entry::Vacant(e) = classes.entry(id) {
            let (text, plain) = (lm.decode(&[id], false)?, lm.decode(&[id], true)?);
            e.insert(TokenClass::of(&text, stops.contains(&id), plain.is_empty() && !text.is_empty()));
        }
    }
    aggregate(arm, version, set, items, &logprobs, |id| classes.get(&id).copied().unwrap_or(TokenClass::Word))
}

/// Pooled change of a selection of rows from v0 to each replicate's last version: the arm groups'
/// `(Σ log π_last − Σ log π_0, n)` over the rows `keep` selects (n counted at v0).
fn pooled(rows: &[MassRow], replicates: &[(&str, i64)], keep: &dyn Fn(&MassRow) -> bool) -> Option<(f64, i64)> {
    let (mut diff, mut n) = (0.0, 0i64);
    for (arm, last) in replicates {
        let sum = |v: i64| rows.iter().filter(|r| r.arm == *arm && r.version == v && keep(r)).fold((0.0, 0i64), |(s, k), r| (s + r.logprob_sum, k + r.tokens));
        let ((s0, n0), (s1, n1)) = (sum(0), sum(*last));
        if n0 != n1 {
            return None; // not the same tokens (a version without rows)
        }
        diff += s1 - s0;
        n += n0;
    }
    (n > 0).then_some((diff, n))
}

/// A report cell: the pooled change in nats per token and the group's share of `total` tokens.
fn delta_cell(p: Option<(f64, i64)>, total: i64) -> String {
    match p {
        Some((d, n)) if total > 0 => format!("{:+.3} ({:.0} %)", d / n as f64, 100.0 * n as f64 / total as f64),
        Some((d, n)) => format!("{:+.3} ({n})", d / n as f64),
        None => "–".into(),
    }
}

/// The report's `## Where the probability mass moved`: per arm group (replicates pooled), the change of
/// mean log-prob from v0 to the last version on v0's held-out answers by token class and by third of the
/// answer, and on the arm's trained tokens by the sign of their starting advantage and the teacher's
/// direction. `arms` are (arm, group) pairs (an empty group is the arm itself); `last` gives each arm's
/// last evaluated version.
/// Nothing is written when no arm has rows at a version above 0.
pub fn render(s: &mut String, arms: &[(&str, &str)], rows: &[MassRow], last: &dyn Fn(&str) -> Option<i64>) {
    let mut groups: Vec<(String, Vec<(&str, i64)>)> = vec![];
    for &(arm, group) in arms {
        let Some(v) = last(arm).filter(|v| *v > 0) else { continue };
        if !rows.iter().any(|r| r.arm == arm && r.version == v) {
            continue;
        }
        let g = if group.is_empty() { arm } else { group };
        match groups.iter_mut().find(|(x, _)| x == g) {
            Some((_, v2)) => v2.push((arm, v)),
            None => groups.push((g.to_string(), vec![(arm, v)])),
        }
    }
    if groups.is_empty() {
        return;
    }
    let _ = writeln!(s, "## Where the probability mass moved\n");
    let _ = writeln!(
        s,
        "Each version scores two fixed token sets (`src/ablate/mass.rs`): v0's greedy answers to the held-out problems, and the arm's own trained tokens. A cell is the change of mean log-prob from v0 to the arm's last checkpoint on the same tokens (nats per token; negative = the arm lowered them; replicates pooled) and, in brackets, the group's share of the set's tokens. `end` is the stop token (the probability of ending the answer there), `number` a token with a digit.\n"
    );
    let heldout = |r: &MassRow| r.set == HELDOUT;
    let _ = write!(s, "On v0's held-out answers:\n\n| arm | all |");
    for c in TokenClass::ALL {
        let _ = write!(s, " {} |", c.as_str());
    }
    let _ = writeln!(s, " first third | middle third | last third |");
    let _ = writeln!(s, "|---|---:|{}---:|---:|---:|", "---:|".repeat(TokenClass::ALL.len()));
    for (g, reps) in &groups {
        let total = pooled(rows, reps, &heldout).map_or(0, |p| p.1);
        let _ = write!(s, "| {} | {} |", cell(g), delta_cell(pooled(rows, reps, &heldout), total));
        for c in TokenClass::ALL {
            let _ = write!(s, " {} |", delta_cell(pooled(rows, reps, &|r: &MassRow| heldout(r) && r.class == c.as_str()), total));
        }
        for b in BANDS {
            let _ = write!(s, " {} |", delta_cell(pooled(rows, reps, &|r: &MassRow| heldout(r) && r.band == b), total));
        }
        s.push('\n');
    }
    let trained = |r: &MassRow| r.set == TRAINED;
    let _ = writeln!(
        s,
        "\nOn the arm's trained tokens: by the sign of their advantage at the start of training (adv `+` = the first step pushes them up, `-` down, `0` = not pushed by the advantage: a reward of 0, a score-only sample, or a top-K loss whose teacher term is outside the advantage), and by the hint-conditioned teacher's direction on them (`t > s`: the teacher's log-prob above the rollout's, `t < s` below; the same split for every arm trained on a teacher; within {DEAD_BAND} nats counts as neither):\n"
    );
    let _ = writeln!(s, "| arm | all | adv + | adv - | adv 0 | t > s | t < s | t < s, numbers | t < s, last third | t < s, end | t > s, end |");
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (g, reps) in &groups {
        let Some((_, total)) = pooled(rows, reps, &trained) else { continue };
        let adv = |sign: &'static str| delta_cell(pooled(rows, reps, &move |r: &MassRow| trained(r) && r.sign == sign), total);
        let tea = |sign: &'static str, extra: fn(&MassRow) -> bool| delta_cell(pooled(rows, reps, &move |r: &MassRow| trained(r) && r.teacher_sign == sign && extra(r)), total);
        let any: fn(&MassRow) -> bool = |_| true;
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            cell(g),
            delta_cell(pooled(rows, reps, &trained), total),
            adv("+"),
            adv("-"),
            adv("0"),
            tea("+", any),
            tea("-", any),
            tea("-", |r| r.class == "number"),
            tea("-", |r| r.band == "last"),
            tea("-", |r| r.class == "end"),
            tea("+", |r| r.class == "end"),
        );
    }
    s.push('\n');
}

#[cfg(test)]
mod tests {
    use super::*;
    use Direction::{Down, Flat, Up};

    fn item(ids: &[u32], counted: &[bool], signs: &[Direction], teacher: &[Direction]) -> MassItem {
        MassItem { prompt_ids: vec![1], response_ids: ids.to_vec(), counted: counted.to_vec(), signs: signs.to_vec(), teacher: teacher.to_vec() }
    }

    #[test]
    fn classes_bands_and_directions_by_hand() {
        assert_eq!(TokenClass::of(" 42", false, false), TokenClass::Number);
        assert_eq!(TokenClass::of("**", false, false), TokenClass::Markdown);
        assert_eq!(TokenClass::of("\n", false, false), TokenClass::Newline);
        assert_eq!(TokenClass::of(" the", false, false), TokenClass::Word);
        assert_eq!(TokenClass::of("<|im_end|>", true, true), TokenClass::End);
        assert_eq!(TokenClass::of("<|im_start|>", false, true), TokenClass::Special);
        // 6 tokens: 0,1 first; 2,3 middle; 4,5 last. 1 token: first.
        assert_eq!((0..6).map(|t| band(t, 6)).collect::<Vec<_>>(), ["first", "first", "middle", "middle", "last", "last"]);
        assert_eq!(band(0, 1), "first");
        let d = [0.5, 2e-3, 1e-3, 0.0, -1e-3, -2e-3, f32::NAN].map(|x| Direction::of(x).as_str());
        assert_eq!(d, ["+", "+", "0", "0", "0", "-", ""]);
    }

    #[test]
    fn aggregate_sums_counted_tokens_by_group() {
        // ids: 7 = a number, 9 = the stop token, everything else a word
        let class = |id: u32| match id {
            7 => TokenClass::Number,
            9 => TokenClass::End,
            _ => TokenClass::Word,
        };
        let items = vec![
            item(&[5, 7, 9], &[true, true, true], &[Up, Down, Down], &[Up, Down, Flat]),
            item(&[5, 5, 7], &[false, true, true], &[Up, Up, Down], &[Up, Up, Down]),
        ];
        let lp = vec![vec![-1.0, -2.0, -0.5], vec![-9.0, -0.25, -3.0]];
        let rows = aggregate("a", 2, TRAINED, &items, &lp, class).unwrap();
        let got: Vec<(&str, &str, &str, &str, i64, f64)> = rows.iter().map(|r| (r.class.as_str(), r.band.as_str(), r.sign.as_str(), r.teacher_sign.as_str(), r.tokens, r.logprob_sum)).collect();
        assert_eq!(
            got,
            vec![
                ("end", "last", "-", "0", 1, -0.5),
                ("number", "middle", "-", "-", 1, -2.0),
                ("number", "last", "-", "-", 1, -3.0),
                ("word", "first", "+", "+", 1, -1.0),
                ("word", "middle", "+", "+", 1, -0.25),
            ]
        );
        assert!(rows.iter().all(|r| r.arm == "a" && r.version == 2 && r.set == TRAINED));
        // a length that does not match is an error, not a silent skip
        let short = vec![vec![-1.0, -2.0, -0.5], vec![-1.0]];
        assert!(aggregate("a", 2, TRAINED, &items, &short, class).unwrap_err().to_string().contains("response 1"));
        assert!(aggregate("a", 2, TRAINED, &items, &lp[..1], class).is_err());
    }

    #[allow(clippy::too_many_arguments)]
    fn row(arm: &str, version: i64, set: &str, class: &str, band: &str, sign: &str, teacher: &str, tokens: i64, sum: f64) -> MassRow {
        MassRow { arm: arm.into(), version, set: set.into(), class: class.into(), band: band.into(), sign: sign.into(), teacher_sign: teacher.into(), tokens, logprob_sum: sum }
    }

    #[test]
    fn render_pools_replicates_by_hand() {
        let arms = [("opd.seed=1", "opd"), ("opd.seed=2", "opd")];
        let rows = vec![
            // replicate 1: 4 held-out tokens (3 numbers in the last third, 1 end), v0 → v2
            row("opd.seed=1", 0, HELDOUT, "number", "last", "", "", 3, -3.0),
            row("opd.seed=1", 0, HELDOUT, "end", "last", "", "", 1, -1.0),
            row("opd.seed=1", 2, HELDOUT, "number", "last", "", "", 3, -6.0),
            row("opd.seed=1", 2, HELDOUT, "end", "last", "", "", 1, -1.5),
            row("opd.seed=1", 0, TRAINED, "word", "first", "-", "-", 2, -2.0),
            row("opd.seed=1", 2, TRAINED, "word", "first", "-", "-", 2, -4.0),
            row("opd.seed=1", 0, TRAINED, "end", "last", "+", "+", 2, -2.0),
            row("opd.seed=1", 2, TRAINED, "end", "last", "+", "+", 2, -1.0),
            // replicate 2: 1 number, raised by 1 nat
            row("opd.seed=2", 0, HELDOUT, "number", "first", "", "", 1, -2.0),
            row("opd.seed=2", 2, HELDOUT, "number", "first", "", "", 1, -1.0),
        ];
        let mut s = String::new();
        render(&mut s, &arms, &rows, &|_| Some(2));
        // all: (−7.5 + 4 − 1 + 2)/5 = −0.5; numbers (−6 + 3 − 1 + 2)/4 = −0.5 over 4 of 5 tokens; end −0.5
        // (20 %); first third +1 (20 %); last third (−7.5 + 4)/4 = −0.875 (80 %)
        assert!(s.contains("| opd | -0.500 (100 %) | -0.500 (20 %) | – | -0.500 (80 %) | – | – | – | +1.000 (20 %) | – | -0.875 (80 %) |"), "{s}");
        // trained (replicate 1 only): 4 tokens, all (−5 + 4)/4 = −0.25; the two − tokens lost 1 nat each,
        // the two + end tokens gained 0.5
        assert!(s.contains("| opd | -0.250 (100 %) | +0.500 (50 %) | -1.000 (50 %) | – | +0.500 (50 %) | -1.000 (50 %) | – | – | – | +0.500 (50 %) |"), "{s}");
        // nothing after v0: no section
        let mut t = String::new();
        render(&mut t, &arms, &rows, &|_| Some(0));
        assert!(t.is_empty());
    }
}
