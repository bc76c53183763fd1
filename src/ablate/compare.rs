//! Arms over seeds: each arm group's final personalization score with its 95 % interval over the
//! replicate seeds, and every pair of groups compared on the same held-out problems.
//!
//! - **Per group** ([`GroupRow`], results table `arm_summary`): the final checkpoint's score of each
//!   replicate; their mean with the Student-t interval over seeds ([`crate::stats::mean_t_95`], none
//!   with one seed); and the pooled Wilson interval of all replicates' held-out responses
//!   ([`crate::stats::wilson_95`]), which counts only problem-level noise.
//! - **Per pair** ([`PairRow`], `arm_comparisons`): the replicates of both groups that share a seed are
//!   paired (same seed = same LoRA initialisation), each on the same held-out problems; per problem p the
//!   difference d_p = mean over the shared seeds of (A's outcome − B's outcome) (1 = the response met
//!   every preference); the paired t-test over problems ([`crate::stats::paired_t`]) gives the mean
//!   difference (= difference of the mean scores), its 95 % interval and the two-sided p-value. The
//!   problems are the independent units, so seeds that agree on a problem do not count as extra
//!   evidence. `a_only` / `b_only` count the (seed, problem) pairs only A / only B satisfied.
//! - **Against the initial weights** ([`versus_initial`], `arm_vs_v0`): each group as A against v0 as
//!   B, the same paired t-test over problems with v0's outcomes standing in on every seed (every
//!   replicate starts from those weights, evaluated once): whether training moved the score at all.
//! - **Multiple comparisons** ([`adjust_holm`]): every p-value the report shows (between arms and
//!   against v0) is Holm-corrected across all of them together (`p_holm`); "significant" means
//!   `p_holm` < [`ALPHA`].
//! - **The paper's ordering** ([`ordering`]): whether combined > OPD > binary holds, at what confidence
//!   (Holm-adjusted).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::results::{ArmRow, CheckpointRow, ResponseRow};
use crate::error::Result;
use crate::stats::{mean_t_95, p_text, paired_t, wilson_95};

/// Significance level of the report's statements (two-sided).
pub const ALPHA: f64 = 0.05;

/// One arm group over its replicate seeds (`arm_summary`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GroupRow {
    /// Group (the arm as the ablation file names it).
    pub group: String,
    /// Method.
    pub method: String,
    /// Replicate seeds, in file order.
    pub seeds: Vec<i64>,
    /// Replicate arm names, same order.
    pub arms: Vec<String>,
    /// Final checkpoint version of each replicate.
    pub final_versions: Vec<i64>,
    /// Final personalization score of each replicate (fraction 0–1).
    pub final_scores: Vec<f64>,
    /// Mean of `final_scores`.
    pub mean: f64,
    /// Sample standard deviation over seeds (0 with one seed).
    pub sd: f64,
    /// Lower end of the 95 % Student-t interval over seeds (none with one seed).
    pub low: Option<f64>,
    /// Upper end of that interval.
    pub high: Option<f64>,
    /// Held-out responses of the final versions, all replicates together.
    pub responses: i64,
    /// Of them, meeting every preference.
    pub satisfied: i64,
    /// Lower end of the pooled 95 % Wilson interval of `satisfied / responses`.
    pub pooled_low: f64,
    /// Upper end of the pooled Wilson interval.
    pub pooled_high: f64,
    /// Mean accuracy of the final versions over seeds.
    pub mean_accuracy: f64,
}

/// Two groups compared on the same problems (`arm_comparisons`); differences are A − B.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PairRow {
    /// Group A.
    pub a: String,
    /// Group B.
    pub b: String,
    /// Seeds both groups ran (the paired replicates).
    pub seeds: Vec<i64>,
    /// Held-out problems both answered in every paired replicate.
    pub problems: i64,
    /// Mean over problems of d_p (module docs): A's score minus B's on these replicates.
    pub mean_diff: f64,
    /// Lower end of the 95 % interval of the mean difference (none with under two problems).
    pub low: Option<f64>,
    /// Upper end of that interval.
    pub high: Option<f64>,
    /// Two-sided p-value of the paired t-test over problems.
    pub p_value: f64,
    /// `p_value` after the Holm correction across every comparison the report shows (the between-arm
    /// pairs and each arm against v0 together, [`adjust_holm`]); equal to `p_value` until adjusted.
    #[serde(default)]
    pub p_holm: f64,
    /// (seed, problem) pairs only A satisfied.
    pub a_only: i64,
    /// (seed, problem) pairs only B satisfied.
    pub b_only: i64,
}

impl PairRow {
    /// Whether A − B differs from 0 at level `alpha`, after the Holm correction (`p_holm`).
    pub fn significant(&self, alpha: f64) -> bool {
        self.p_holm < alpha
    }
}

/// Sets `p_holm` of every row of every family member: the Holm correction ([`crate::stats::holm`])
/// across all of them together, so the family-wise error rate of the report's statements is
/// [`ALPHA`].
pub fn adjust_holm(families: &mut [&mut [PairRow]]) {
    let p: Vec<f64> = families.iter().flat_map(|f| f.iter().map(|r| r.p_value)).collect();
    let adj = crate::stats::holm(&p);
    let mut i = 0;
    for f in families.iter_mut() {
        for r in f.iter_mut() {
            r.p_holm = adj[i];
            i += 1;
        }
    }
}

/// The last evaluated checkpoint of `arm` (highest version).
fn final_checkpoint<'a>(arm: &str, checkpoints: &'a [CheckpointRow]) -> Option<&'a CheckpointRow> {
    checkpoints.iter().filter(|c| c.arm == arm).max_by_key(|c| c.version)
}

/// problem id → satisfied, of `arm` at `version`.
fn outcomes(arm: &str, version: i64, responses: &[ResponseRow]) -> BTreeMap<i64, bool> {
    responses.iter().filter(|r| r.arm == arm && r.version == version).map(|r| (r.problem_id, r.satisfied)).collect()
}

/// seed → (problem id → satisfied) of one group's final checkpoints.
type Outcomes = BTreeMap<i64, BTreeMap<i64, bool>>;

/// A group and its replicates `(seed, arm row)`, in file order.
type Group<'a> = (String, Vec<&'a ArmRow>);

fn groups(arms: &[ArmRow]) -> Vec<Group<'_>> {
    let mut out: Vec<Group<'_>> = vec![];
    for a in arms {
        let g = if a.group.is_empty() { a.arm.clone() } else { a.group.clone() };
        match out.iter_mut().find(|(n, _)| *n == g) {
            Some((_, v)) => v.push(a),
            None => out.push((g, vec![a])),
        }
    }
    out
}

/// Every group's summary and every pair's comparison (see the module docs), groups in file order and
/// pairs (A, B) with A before B. Replicates without an evaluated checkpoint are left out.
///
/// # Errors
/// [`crate::Error::InvalidInput`] only on non-finite scores (not expected).
pub fn summarize(arms: &[ArmRow], checkpoints: &[CheckpointRow], responses: &[ResponseRow]) -> Result<(Vec<GroupRow>, Vec<PairRow>)> {
    let gs = groups(arms);
    // group → seed → (problem → satisfied)
    let mut per: Vec<(String, Outcomes)> = vec![];
    let mut rows = vec![];
    for (name, reps) in &gs {
        let mut row = GroupRow {
            group: name.clone(),
            method: reps[0].method.clone(),
            seeds: vec![],
            arms: vec![],
            final_versions: vec![],
            final_scores: vec![],
            mean: 0.0,
            sd: 0.0,
            low: None,
            high: None,
            responses: 0,
            satisfied: 0,
            pooled_low: 0.0,
            pooled_high: 1.0,
            mean_accuracy: 0.0,
        };
        let mut by_seed = BTreeMap::new();
        let mut accuracy = vec![];
        for a in reps {
            let Some(c) = final_checkpoint(&a.arm, checkpoints) else { continue };
            let o = outcomes(&a.arm, c.version, responses);
            row.seeds.push(a.seed);
            row.arms.push(a.arm.clone());
            row.final_versions.push(c.version);
            row.final_scores.push(c.score);
            row.responses += o.len() as i64;
            row.satisfied += o.values().filter(|s| **s).count() as i64;
            accuracy.push(c.accuracy);
            by_seed.insert(a.seed, o);
        }
        if row.final_scores.is_empty() {
            continue;
        }
        let m = mean_t_95(&row.final_scores)?;
        (row.mean, row.sd, row.low, row.high) = (m.mean, m.sd, m.low, m.high);
        let w = wilson_95(row.satisfied as u64, row.responses as u64)?;
        (row.pooled_low, row.pooled_high) = (w.low, w.high);
        row.mean_accuracy = mean_t_95(&accuracy)?.mean;
        rows.push(row);
        per.push((name.clone(), by_seed));
    }
    let mut pairs = vec![];
    for i in 0..per.len() {
        for j in i + 1..per.len() {
            if let Some(p) = compare(&per[i].0, &per[i].1, &per[j].0, &per[j].1)? {
                pairs.push(p);
            }
        }
    }
    Ok((rows, pairs))
}

/// Name of the initial weights as group B of [`versus_initial`]'s rows.
pub const INITIAL: &str = "v0";

/// Every group against the initial weights on the same held-out problems (module docs): one
/// [`PairRow`] per group with an evaluated checkpoint after v0, `a` = the group, `b` = [`INITIAL`], in
/// file order. v0's outcomes are those of the version-0 responses (the first arm that has them; the
/// ablation evaluates the initial weights once for all arms). Empty without version-0 responses.
///
/// # Errors
/// [`crate::Error::InvalidInput`] only on non-finite values (not expected).
pub fn versus_initial(arms: &[ArmRow], checkpoints: &[CheckpointRow], responses: &[ResponseRow]) -> Result<Vec<PairRow>> {
    let Some(base) = arms.iter().map(|a| outcomes(&a.arm, 0, responses)).find(|o| !o.is_empty()) else {
        return Ok(vec![]);
    };
    versus_reference(INITIAL, &base, arms, checkpoints, responses)
}

/// Every group against each baseline without training ([`super::baselines`]), as [`versus_initial`]
/// does against v0: `b` = the baseline's name, its outcomes (`baseline_responses`, rows whose `arm` is
/// the baseline's name) standing in on every seed. Groups in file order within each baseline, baselines
/// in the order given.
///
/// # Errors
/// [`crate::Error::InvalidInput`] only on non-finite values (not expected).
pub fn versus_baselines(arms: &[ArmRow], checkpoints: &[CheckpointRow], responses: &[ResponseRow], baseline_responses: &[ResponseRow], names: &[String]) -> Result<Vec<PairRow>> {
    let mut out = vec![];
    for name in names {
        let base = outcomes(name, 0, baseline_responses);
        if !base.is_empty() {
            out.extend(versus_reference(name, &base, arms, checkpoints, responses)?);
        }
    }
    Ok(out)
}

fn versus_reference(b: &str, base: &BTreeMap<i64, bool>, arms: &[ArmRow], checkpoints: &[CheckpointRow], responses: &[ResponseRow]) -> Result<Vec<PairRow>> {
    let mut out = vec![];
    for (name, reps) in groups(arms) {
        let (mut ra, mut rb) = (Outcomes::new(), Outcomes::new());
        for a in reps {
            let Some(c) = final_checkpoint(&a.arm, checkpoints).filter(|c| c.version > 0) else { continue };
            ra.insert(a.seed, outcomes(&a.arm, c.version, responses));
            rb.insert(a.seed, base.clone());
        }
        if let Some(p) = compare(&name, &ra, b, &rb)? {
            out.push(p);
        }
    }
    Ok(out)
}

fn compare(a: &str, ra: &Outcomes, b: &str, rb: &Outcomes) -> Result<Option<PairRow>> {
    let seeds: Vec<i64> = ra.keys().filter(|s| rb.contains_key(s)).copied().collect();
    if seeds.is_empty() {
        return Ok(None);
    }
    // problems every paired replicate of both answered
    let mut problems: Option<BTreeSet<i64>> = None;
    for s in &seeds {
        let here: BTreeSet<i64> = ra[s].keys().filter(|p| rb[s].contains_key(p)).copied().collect();
        problems = Some(match problems {
            None => here,
            Some(p) => p.intersection(&here).copied().collect(),
        });
    }
    let problems = problems.unwrap_or_default();
    if problems.is_empty() {
        return Ok(None);
    }
    let (mut a_only, mut b_only) = (0i64, 0i64);
    let mut diffs = vec![];
    for p in &problems {
        let mut d = 0.0;
        for s in &seeds {
            let (x, y) = (ra[s][p], rb[s][p]);
            a_only += i64::from(x && !y);
            b_only += i64::from(y && !x);
            d += f64::from(u8::from(x)) - f64::from(u8::from(y));
        }
        diffs.push(d / seeds.len() as f64);
    }
    let t = paired_t(&diffs)?;
    Ok(Some(PairRow {
        a: a.into(),
        b: b.into(),
        seeds,
        problems: problems.len() as i64,
        mean_diff: t.diff.mean,
        low: t.diff.low,
        high: t.diff.high,
        p_value: t.p_value,
        p_holm: t.p_value,
        a_only,
        b_only,
    }))
}

/// The first group of each method that sets nothing but the method (and the replicate seed): the
/// paper's plain binary, OPD and combined arms.
fn plain_group(arms: &[ArmRow], method: &str) -> Option<String> {
    arms.iter()
        .find(|a| {
            a.method == method
                && serde_json::from_str::<BTreeMap<String, String>>(&a.overrides).is_ok_and(|o| o.keys().all(|k| k == "method" || k == "trainer.seed"))
        })
        .map(|a| if a.group.is_empty() { a.arm.clone() } else { a.group.clone() })
}

fn pair<'a>(pairs: &'a [PairRow], x: &str, y: &str) -> Option<(f64, f64, &'a PairRow)> {
    pairs.iter().find_map(|p| {
        if p.a == x && p.b == y {
            Some((p.mean_diff, p.p_holm, p))
        } else if p.a == y && p.b == x {
            Some((-p.mean_diff, p.p_holm, p))
        } else {
            None
        }
    })
}

/// One sentence on the paper's claim combined > OPD > binary from the paired comparisons of the plain
/// arms: "holds" only when both differences are positive at [`ALPHA`]; otherwise what was measured.
/// `None` when the ablation lacks one of the three plain arms.
pub fn ordering(arms: &[ArmRow], pairs: &[PairRow]) -> Option<String> {
    let (b, o, c) = (plain_group(arms, "binary")?, plain_group(arms, "opd")?, plain_group(arms, "combined")?);
    let (d1, p1, r1) = pair(pairs, &c, &o)?;
    let (d2, p2, r2) = pair(pairs, &o, &b)?;
    let n = r1.seeds.len().min(r2.seeds.len());
    let part = |x: &str, y: &str, d: f64, p: f64| format!("{x} − {y} = {d:+.3} (Holm-adjusted p = {})", p_text(p));
    let detail = format!("{}; {}", part(&c, &o, d1, p1), part(&o, &b, d2, p2));
    Some(if d1 > 0.0 && d2 > 0.0 && p1 < ALPHA && p2 < ALPHA {
        format!("**combined > OPD > binary holds here** at the 95 % level (paired t-tests over problems, {n} seed(s)): {detail}.")
    } else if d1 > 0.0 && d2 > 0.0 {
        format!("combined > OPD > binary holds in the point estimates only, **not at the 95 % level** ({n} seed(s)): {detail}.")
    } else {
        format!("**combined > OPD > binary does not hold here** ({n} seed(s)): {detail}.")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arm(name: &str, group: &str, method: &str, seed: i64) -> ArmRow {
        ArmRow {
            arm: name.into(),
            group: group.into(),
            method: method.into(),
            overrides: format!("{{\"method\": \"\\\"{method}\\\"\", \"trainer.seed\": \"{seed}\"}}"),
            data_pipeline: String::new(),
            data_hash: String::new(),
            config_hash: String::new(),
            trainer_hash: String::new(),
            seed,
            initial_weights: String::new(),
            batch_size: 2,
            lr: 1e-3,
            lora: true,
            w_rl: 1.0,
            w_opd: 1.0,
            opd_loss: "ppo".into(),
            top_k: 0,
            hint_strategy: "longest".into(),
            judge_m: 1,
            hint_m: 1,
            steps: 1,
            train_sql: String::new(),
            sample_ids: vec![],
            interaction_ids: vec![],
            sample_types: vec![],
        }
    }

    fn ck(arm: &str, version: i64, score: f64) -> CheckpointRow {
        CheckpointRow::score_only(arm, version, version, 0, score, 0.5, 4)
    }

    fn resp(arm: &str, version: i64, outcomes: &[bool]) -> Vec<ResponseRow> {
        outcomes
            .iter()
            .enumerate()
            .map(|(p, s)| ResponseRow { arm: arm.into(), version, problem_id: p as i64, satisfied: *s, correct: false, violations: vec![], response_text: String::new() })
            .collect()
    }

    /// Two groups × two seeds on 4 problems, by hand.
    #[test]
    fn groups_and_pairs_by_hand() {
        let arms = vec![arm("c.seed=1", "c", "combined", 1), arm("c.seed=2", "c", "combined", 2), arm("b.seed=1", "b", "binary", 1), arm("b.seed=2", "b", "binary", 2)];
        // c: seed 1 → TTTF (0.75), seed 2 → TTFF (0.5); b: seed 1 → TFFF (0.25), seed 2 → TFFT (0.5).
        let mut checkpoints = vec![ck("c.seed=1", 0, 0.25), ck("c.seed=1", 2, 0.75), ck("c.seed=2", 2, 0.5), ck("b.seed=1", 2, 0.25), ck("b.seed=2", 2, 0.5)];
        checkpoints.push(ck("b.seed=2", 1, 0.9)); // not the final version
        let mut responses = vec![];
        responses.extend(resp("c.seed=1", 0, &[false, false, false, true])); // v0: ignored
        responses.extend(resp("c.seed=1", 2, &[true, true, true, false]));
        responses.extend(resp("c.seed=2", 2, &[true, true, false, false]));
        responses.extend(resp("b.seed=1", 2, &[true, false, false, false]));
        responses.extend(resp("b.seed=2", 2, &[true, false, false, true]));
        let (groups, pairs) = summarize(&arms, &checkpoints, &responses).unwrap();
        assert_eq!(groups.len(), 2);
        let c = &groups[0];
        assert_eq!((c.group.as_str(), c.seeds.clone(), c.final_versions.clone(), c.final_scores.clone()), ("c", vec![1, 2], vec![2, 2], vec![0.75, 0.5]));
        // mean 0.625, s = 0.176777, s/√2 = 0.125, t_{0.975,1} = 12.7062 → 0.625 ± 1.588275
        assert!((c.mean - 0.625).abs() < 1e-12 && (c.sd - 0.176_777).abs() < 1e-6, "{c:?}");
        assert!((c.low.unwrap() - (0.625 - 1.588_275)).abs() < 1e-4, "{c:?}");
        assert_eq!((c.responses, c.satisfied), (8, 5));
        assert!((c.pooled_low - crate::stats::wilson_95(5, 8).unwrap().low).abs() < 1e-12);
        // d_p = mean over seeds of c − b: p0 (1−1, 1−1)/2 = 0; p1 (1−0, 1−0)/2 = 1; p2 (1−0, 0−0)/2 = ½;
        // p3 (0−0, 0−1)/2 = −½ → mean 0.25, s = √((0.0625 + 0.5625 + 0.0625 + 0.5625)/3) = 0.645497.
        assert_eq!(pairs.len(), 1);
        let p = &pairs[0];
        assert_eq!((p.a.as_str(), p.b.as_str(), p.seeds.clone(), p.problems, p.a_only, p.b_only), ("c", "b", vec![1, 2], 4, 3, 1));
        assert!((p.mean_diff - 0.25).abs() < 1e-12, "{p:?}");
        assert!((p.mean_diff - (c.mean - groups[1].mean)).abs() < 1e-12, "the mean difference is the difference of the means");
        let t = crate::stats::paired_t(&[0.0, 1.0, 0.5, -0.5]).unwrap();
        assert_eq!(p.p_value, t.p_value);
        assert!(!p.significant(ALPHA));

        // Against v0 (c.seed=1's version-0 responses FFFT, the only ones): c's d_p = p0 (1, 1)/2 = 1,
        // p1 1, p2 (1 + 0)/2 = ½, p3 (0−1, 0−1)/2 = −1 → mean 0.375; only c: 3 + 2, only v0: 1 + 1.
        let v0 = versus_initial(&arms, &checkpoints, &responses).unwrap();
        assert_eq!(v0.iter().map(|p| (p.a.as_str(), p.b.as_str())).collect::<Vec<_>>(), vec![("c", "v0"), ("b", "v0")]);
        let c0 = &v0[0];
        assert_eq!((c0.seeds.clone(), c0.problems, c0.a_only, c0.b_only), (vec![1, 2], 4, 5, 2));
        assert!((c0.mean_diff - 0.375).abs() < 1e-12, "{c0:?}");
        assert_eq!(c0.p_value, crate::stats::paired_t(&[1.0, 1.0, 0.5, -1.0]).unwrap().p_value);
        // b: seed 1 TFFF, seed 2 TFFT vs FFFT → d = [1, 0, 0, −½] → mean 0.125.
        assert!((v0[1].mean_diff - 0.125).abs() < 1e-12, "{:?}", v0[1]);
        assert!(versus_initial(&arms, &checkpoints, &responses[4..]).unwrap().is_empty(), "no v0 responses, no comparison");

        // Against a baseline without training, memory = TTFF: c's d = [0, 0, ½, 0] → mean 0.125; b's
        // d = [0, −1, 0, ½] → mean −0.125. A baseline without responses gives no rows.
        let memory = resp("memory", 0, &[true, true, false, false]);
        let names = vec!["memory".to_string(), "prompted".to_string()];
        let vb = versus_baselines(&arms, &checkpoints, &responses, &memory, &names).unwrap();
        assert_eq!(vb.iter().map(|p| (p.a.as_str(), p.b.as_str())).collect::<Vec<_>>(), vec![("c", "memory"), ("b", "memory")]);
        assert!((vb[0].mean_diff - 0.125).abs() < 1e-12 && (vb[1].mean_diff + 0.125).abs() < 1e-12, "{vb:?}");
        assert_eq!(vb[1].p_value, crate::stats::paired_t(&[0.0, -1.0, 0.0, 0.5]).unwrap().p_value);
    }

    #[test]
    fn one_seed_has_no_interval_and_unpaired_seeds_are_not_compared() {
        let arms = vec![arm("x", "x", "binary", 1), arm("y", "y", "opd", 2)];
        let checkpoints = vec![ck("x", 1, 0.5), ck("y", 1, 0.25)];
        let mut responses = resp("x", 1, &[true, false]);
        responses.extend(resp("y", 1, &[false, false]));
        let (groups, pairs) = summarize(&arms, &checkpoints, &responses).unwrap();
        assert_eq!((groups[0].low, groups[0].high, groups[0].sd), (None, None, 0.0));
        assert!(pairs.is_empty(), "seed 1 vs seed 2: nothing to pair");
    }

    #[test]
    fn ordering_says_what_was_measured() {
        let arms = vec![arm("binary", "binary", "binary", 1), arm("opd", "opd", "opd", 1), arm("combined", "combined", "combined", 1)];
        let row = |a: &str, b: &str, d: f64, p: f64| PairRow { a: a.into(), b: b.into(), seeds: vec![1], problems: 48, mean_diff: d, low: None, high: None, p_value: p, p_holm: p, a_only: 0, b_only: 0 };
        let holds = vec![row("binary", "opd", -0.2, 0.01), row("opd", "combined", -0.1, 0.02), row("binary", "combined", -0.3, 0.001)];
        let s = ordering(&arms, &holds).unwrap();
        assert!(s.contains("holds here") && s.contains("combined − opd = +0.100 (Holm-adjusted p = 0.020)") && s.contains("opd − binary = +0.200 (Holm-adjusted p = 0.010)"), "{s}");
        let weak = vec![row("binary", "opd", -0.2, 0.01), row("opd", "combined", -0.1, 0.2)];
        assert!(ordering(&arms, &weak).unwrap().contains("not at the 95 % level"));
        let not = vec![row("binary", "opd", 0.2, 0.01), row("opd", "combined", -0.1, 0.02)];
        assert!(ordering(&arms, &not).unwrap().contains("does not hold here"));
        assert_eq!(ordering(&arms[..2], &holds), None, "no combined arm");
        // The statement reads the Holm-adjusted p-values: raw 0.01 and 0.02 adjusted to 0.06 do not hold.
        let mut pairs = holds.clone();
        let mut v0 = vec![row("combined", "v0", 0.1, 0.03)];
        for p in &mut pairs {
            p.p_holm = 1.0;
        }
        adjust_holm(&mut [&mut pairs, &mut v0]);
        // Sorted 0.001·4, 0.01·3, 0.02·2, 0.03·1 → 0.004, 0.03, 0.04, max(0.04, 0.03) = 0.04.
        let got: Vec<f64> = pairs.iter().chain(&v0).map(|p| p.p_holm).collect();
        for (g, w) in got.iter().zip([0.03, 0.04, 0.004, 0.04]) {
            assert!((g - w).abs() < 1e-12, "{got:?}");
        }
        assert!(ordering(&arms, &pairs).unwrap().contains("holds here"));
        let three = vec![row("binary", "opd", -0.2, 0.02), row("opd", "combined", -0.1, 0.02), row("binary", "combined", -0.3, 0.03)];
        let mut three = three;
        adjust_holm(&mut [&mut three]);
        assert!(ordering(&arms, &three).unwrap().contains("not at the 95 % level"), "0.02·3 = 0.06 > 0.05");
    }
}
