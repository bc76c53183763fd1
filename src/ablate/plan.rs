//! What an ablation runs on, decided before anything runs: the ordered interaction stream and its
//! held-out sessions ([`stream`]), the SQL that reads each arm's training and held-out samples, the
//! distinct data pipelines and judge configurations of the arms, and the checkpoint versions of an arm
//! to evaluate.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

use super::config::{AblationConfig, ResolvedArm};
use super::layout::Layout;
use crate::error::Result;
use crate::schema::{content_hash, Interaction, TurnType};

/// SQL string literal.
fn lit(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// The interactions of the ablation lake in replay order, and the held-out sessions.
#[derive(Debug, Clone)]
pub struct Stream {
    /// Training main turns in order (event time, session, turn index, id).
    pub order: Vec<String>,
    /// 1-based position of each training main turn.
    pub rank: HashMap<String, i64>,
    /// Held-out sessions (the last `heldout_sessions` by first event time).
    pub heldout: Vec<String>,
    /// Sessions in the data.
    pub sessions: usize,
    /// Main turns in the data.
    pub main_turns: usize,
}

/// Orders `rows` and splits off the last `heldout` sessions (by first event time, then session id).
pub fn stream(rows: &[Interaction], heldout: usize) -> Stream {
    let mut main: Vec<&Interaction> = rows.iter().filter(|i| i.turn_type == TurnType::Main).collect();
    main.sort_by(|a, b| (a.event_time, &a.session_id, a.turn_index, &a.interaction_id).cmp(&(b.event_time, &b.session_id, b.turn_index, &b.interaction_id)));
    let mut first: Vec<(i64, String)> = vec![];
    let mut seen = HashSet::new();
    for i in &main {
        if seen.insert(i.session_id.clone()) {
            first.push((i.event_time, i.session_id.clone()));
        }
    }
    first.sort();
    let cut = first.len().saturating_sub(heldout);
    let held: Vec<String> = first[cut..].iter().map(|(_, s)| s.clone()).collect();
    let held_set: HashSet<&String> = held.iter().collect();
    let order: Vec<String> = main.iter().filter(|i| !held_set.contains(&i.session_id)).map(|i| i.interaction_id.clone()).collect();
    let rank = order.iter().enumerate().map(|(k, id)| (id.clone(), k as i64 + 1)).collect();
    Stream { order, rank, heldout: held, sessions: first.len(), main_turns: main.len() }
}

/// The query an arm's trainer reads: its data pipeline's samples outside the held-out sessions, in
/// interaction order, at most `limit`.
pub fn train_sql(pipeline: &str, heldout: &[String], limit: usize) -> String {
    let not_in = if heldout.is_empty() { String::new() } else { format!(" AND s.session_id NOT IN ({})", heldout.iter().map(|s| lit(s)).collect::<Vec<_>>().join(", ")) };
    format!(
        "SELECT s.* FROM samples s JOIN interactions i ON s.interaction_id = i.interaction_id \
         WHERE s.pipeline = {}{not_in} ORDER BY i.event_time, i.session_id, i.turn_index, s.sample_id LIMIT {limit}",
        lit(pipeline)
    )
}

/// The held-out samples of a data pipeline, in interaction order.
pub fn heldout_sql(pipeline: &str, heldout: &[String]) -> Option<String> {
    if heldout.is_empty() {
        return None;
    }
    Some(format!(
        "SELECT s.* FROM samples s JOIN interactions i ON s.interaction_id = i.interaction_id \
         WHERE s.pipeline = {} AND s.session_id IN ({}) ORDER BY i.event_time, i.session_id, i.turn_index, s.sample_id",
        lit(pipeline),
        heldout.iter().map(|s| lit(s)).collect::<Vec<_>>().join(", ")
    ))
}

/// Distinct data pipelines in arm order: (pipeline name, the first arm using it).
pub(super) fn data_pipelines(arms: &[ResolvedArm]) -> Vec<&ResolvedArm> {
    let mut seen = HashSet::new();
    arms.iter().filter(|a| seen.insert(a.data_pipeline.clone())).collect()
}

/// Whether `arm` is among `--arms` (by name or group); everything is selected without `--arms`.
pub(super) fn selected(sel: Option<&[String]>, arm: &ResolvedArm) -> bool {
    sel.is_none_or(|sel| sel.contains(&arm.name) || sel.contains(&arm.group))
}

/// `data_pipelines` that a run of the `--arms` selection needs: those of the selected arms, and the
/// first one that builds hints (the held-out gap set every arm is evaluated on comes from it).
pub(super) fn needed_data_pipelines<'a>(arms: &'a [ResolvedArm], sel: Option<&[String]>) -> Vec<&'a ResolvedArm> {
    let gap_source = arms.iter().find(|a| a.pipeline.method.uses_hints()).map(|a| a.data_pipeline.clone());
    data_pipelines(arms)
        .into_iter()
        .filter(|d| Some(&d.data_pipeline) == gap_source.as_ref() || arms.iter().any(|a| a.data_pipeline == d.data_pipeline && selected(sel, a)))
        .collect()
}

/// The judge configurations of the arms that use the judge: (key, first data pipeline, arm names).
pub(super) fn judge_groups(arms: &[ResolvedArm]) -> Result<Vec<(String, ResolvedArm, Vec<String>)>> {
    let mut groups: Vec<(String, ResolvedArm, Vec<String>)> = vec![];
    for a in arms.iter().filter(|a| a.pipeline.method.uses_judge()) {
        let key = content_hash(&[serde_json::to_string(&(&a.pipeline.judge, &a.pipeline.signals))?.as_bytes()]);
        match groups.iter_mut().find(|g| g.0 == key) {
            Some(g) => g.2.push(a.name.clone()),
            None => groups.push((key, a.clone(), vec![a.name.clone()])),
        }
    }
    Ok(groups)
}

/// (version, step, interactions seen, samples seen, checkpoint folder) of one version of an arm.
pub(super) type VersionRow = (i64, i64, i64, i64, Option<PathBuf>);

/// Every version of an arm ([`VersionRow`]), v0 first.
pub(super) fn versions(lay: &Layout, arm: &str, rank: &HashMap<String, i64>) -> Result<Vec<VersionRow>> {
    let scan = crate::trainer::scan(&lay.checkpoints(arm).join(arm))?;
    let mut out = vec![(0, 0, 0, 0, None)];
    let (mut seen, mut samples, mut last) = (0i64, 0i64, 0i64);
    for (path, m) in scan.complete {
        for l in m.lineage.iter().filter(|l| l.trained) {
            samples += 1;
            seen = seen.max(rank.get(&l.interaction_id).copied().unwrap_or(0));
        }
        last = last.max(m.step);
        out.push((m.version, last, seen, samples, Some(path)));
    }
    Ok(out)
}

/// The versions of `arm` that `[eval] versions` asks for ([`versions`], then
/// [`super::config::EvalVersions::select`]).
pub(super) fn evaluated_versions(cfg: &AblationConfig, lay: &Layout, arm: &str, rank: &HashMap<String, i64>) -> Result<Vec<VersionRow>> {
    Ok(cfg.eval.versions.select(&versions(lay, arm, rank)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ablate::fixtures::interaction;

    #[test]
    fn stream_orders_and_holds_out_the_last_sessions() {
        let mut rows = vec![];
        // session b starts first, a second, c last; a has two turns interleaved with b's
        for (sid, turn, t) in [("b", 0, 10), ("a", 0, 20), ("b", 1, 30), ("a", 1, 40), ("c", 0, 50)] {
            let mut i = interaction(sid, turn);
            i.event_time = t;
            rows.push(i);
        }
        let mut side = interaction("a", 2);
        side.turn_type = TurnType::Side;
        rows.push(side);
        let s = stream(&rows, 1);
        assert_eq!(s.heldout, vec!["c"]);
        assert_eq!(s.order, vec!["b-0", "a-0", "b-1", "a-1"]);
        assert_eq!(s.rank["a-1"], 4);
        assert_eq!((s.sessions, s.main_turns), (3, 5));
        let s0 = stream(&rows, 0);
        assert!(s0.heldout.is_empty());
        assert_eq!(s0.order.len(), 5);
        let all = stream(&rows, 9);
        assert_eq!(all.heldout.len(), 3);
        assert!(all.order.is_empty());
    }

    #[test]
    fn queries_quote_and_exclude() {
        let q = train_sql("p'x", &["s1".into(), "o'k".into()], 16);
        assert!(q.contains("s.pipeline = 'p''x'"), "{q}");
        assert!(q.contains("NOT IN ('s1', 'o''k')"), "{q}");
        assert!(q.ends_with("LIMIT 16"));
        assert!(!train_sql("p", &[], 4).contains("NOT IN"));
        assert_eq!(heldout_sql("p", &[]), None);
        assert!(heldout_sql("p", &["s".into()]).unwrap().contains("s.session_id IN ('s')"));
    }
}
