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
    /// Training main turns in training order: event time, session, turn index, id ([`stream`]), or the
    /// replicate's seeded session order ([`permute_sessions`]).
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

/// The session-id prefix of replicate `seed`'s own interactions (`r<seed>-`), when each replicate
/// collects its own ([`Replicates::own_data`]).
pub fn replicate_prefix(seed: u64) -> String {
    format!("r{seed}-")
}

/// The interaction streams of an ablation's replicates, one per seed of `[shared] seeds`.
///
/// With one seed the single stream is the data in its logged order ([`stream`]). With two or more,
/// replicate `s` differs from its siblings in what matters to a replicate: its **data** — with
/// `[data.collect]` each replicate collects its own sessions (session ids `r<s>-…`, its own draw of
/// training problems, student and sampling seeds), and its stream holds only those; from a lake every
/// replicate reads the same interactions —, its **order** — its training sessions in a seeded
/// permutation ([`permute_sessions`]; the turns of a session stay in order) — and its **initialisation**
/// (`trainer.seed` = `s`, set by the arm resolution).
#[derive(Debug, Clone)]
pub struct Replicates {
    /// Each seed's stream, in `[shared] seeds` order.
    pub streams: Vec<(u64, Stream)>,
    /// Whether each replicate collected its own interactions.
    pub own_data: bool,
}

impl Replicates {
    /// Builds the streams of `seeds` (see the type docs) from the lake's `rows`, holding out each
    /// stream's last `heldout` sessions.
    pub fn new(rows: &[Interaction], heldout: usize, seeds: &[u64], own_data: bool) -> Replicates {
        if seeds.len() <= 1 {
            let seed = seeds.first().copied().unwrap_or(0);
            return Replicates { streams: vec![(seed, stream(rows, heldout))], own_data: false };
        }
        let streams = seeds
            .iter()
            .map(|&seed| {
                let st = if own_data {
                    let prefix = replicate_prefix(seed);
                    let mine: Vec<Interaction> = rows.iter().filter(|i| i.session_id.starts_with(&prefix)).cloned().collect();
                    stream(&mine, heldout)
                } else {
                    stream(rows, heldout)
                };
                (seed, permute_sessions(st, rows, seed))
            })
            .collect();
        Replicates { streams, own_data }
    }

    /// The stream of replicate `seed` (the first stream when `seed` is not a replicate's).
    pub fn of(&self, seed: u64) -> &Stream {
        self.streams.iter().find(|(s, _)| *s == seed).map(|(_, st)| st).unwrap_or(&self.streams[0].1)
    }

    /// Every replicate's held-out sessions, each once, in replicate order: the sessions whose samples
    /// measure the teacher/student gap of every arm.
    pub fn heldout_all(&self) -> Vec<String> {
        let mut seen = HashSet::new();
        self.streams.iter().flat_map(|(_, st)| st.heldout.iter()).filter(|s| seen.insert(s.as_str())).cloned().collect()
    }
}

/// `st` with its training sessions in a permutation seeded by `seed` (the turns of each session in
/// their order); `rank` follows. `rows` gives each interaction's session.
pub fn permute_sessions(mut st: Stream, rows: &[Interaction], seed: u64) -> Stream {
    use rand::seq::SliceRandom;
    use rand::SeedableRng;
    let session: HashMap<&str, &str> = rows.iter().map(|i| (i.interaction_id.as_str(), i.session_id.as_str())).collect();
    let mut sessions: Vec<&str> = vec![];
    let mut turns: HashMap<&str, Vec<String>> = HashMap::new();
    for id in &st.order {
        let s = session.get(id.as_str()).copied().unwrap_or("");
        let e = turns.entry(s).or_default();
        if e.is_empty() {
            sessions.push(s);
        }
        e.push(id.clone());
    }
    sessions.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
    let order: Vec<String> = sessions.iter().flat_map(|s| turns.remove(s).unwrap_or_default()).collect();
    st.rank = order.iter().enumerate().map(|(k, id)| (id.clone(), k as i64 + 1)).collect();
    st.order = order;
    st
}

/// The samples an arm trains on, in training order: of `samples` (sample id, interaction id) those whose
/// interaction is in the replicate's training stream (`rank`: 1-based positions), ordered by that
/// position then sample id, each id once, at most `limit`.
pub fn first_samples(samples: &[(String, String)], rank: &HashMap<String, i64>, limit: usize) -> Vec<String> {
    let mut kept: Vec<(i64, &str)> = samples.iter().filter_map(|(s, i)| Some((*rank.get(i)?, s.as_str()))).collect();
    kept.sort();
    kept.dedup();
    kept.into_iter().take(limit).map(|(_, s)| s.to_string()).collect()
}

/// The query an arm's trainer reads: data pipeline `pipeline`'s samples `ids` (the arm's training
/// samples in order, [`first_samples`]), in that order. The query names at most `steps × batch` ids, so
/// its size does not grow with the lake.
pub fn train_sql(pipeline: &str, ids: &[String]) -> String {
    if ids.is_empty() {
        return "SELECT s.* FROM samples s WHERE false".to_string();
    }
    let list = ids.iter().map(|s| lit(s)).collect::<Vec<_>>().join(", ");
    let rank = ids.iter().enumerate().map(|(k, s)| format!("WHEN {} THEN {}", lit(s), k + 1)).collect::<Vec<_>>().join(" ");
    format!("SELECT s.* FROM samples s WHERE s.pipeline = {} AND s.sample_id IN ({list}) ORDER BY CASE s.sample_id {rank} END LIMIT {}", lit(pipeline), ids.len())
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
    fn replicates_differ_in_data_and_session_order_and_keep_turn_order() {
        // Two replicates that collected their own sessions (r1-…, r2-…), 8 training sessions of 2
        // turns each plus one held-out session per replicate (started last).
        let mut rows = vec![];
        for (k, seed) in [1u64, 2].into_iter().enumerate() {
            for s in 0..9 {
                for turn in 0..2 {
                    let mut i = interaction(&format!("r{seed}-s{s}"), turn);
                    i.event_time = (k as i64 * 1000) + s * 10 + i64::from(turn);
                    rows.push(i);
                }
            }
        }
        let r = Replicates::new(&rows, 1, &[1, 2], true);
        assert_eq!(r.heldout_all(), vec!["r1-s8", "r2-s8"]);
        let (one, two) = (r.of(1), r.of(2));
        assert_eq!((one.heldout.clone(), one.sessions, one.order.len()), (vec!["r1-s8".to_string()], 9, 16));
        assert!(one.order.iter().all(|id| id.starts_with("r1-")) && two.order.iter().all(|id| id.starts_with("r2-")), "own data only");
        for st in [one, two] {
            // every training turn once; each session's turns adjacent and in order; rank follows order
            let mut sorted = st.order.clone();
            sorted.sort();
            sorted.dedup();
            assert_eq!(sorted.len(), 16);
            for pair in st.order.chunks(2) {
                let (a, b) = (pair[0].rsplit_once('-').unwrap(), pair[1].rsplit_once('-').unwrap());
                assert_eq!((a.0, a.1, b.1), (b.0, "0", "1"), "{:?}", st.order);
            }
            assert!(st.order.iter().enumerate().all(|(k, id)| st.rank[id] == k as i64 + 1));
        }
        // the session order is a permutation seeded by the replicate: not the logged order, and the
        // same seed gives the same order
        let sessions = |st: &Stream| st.order.iter().step_by(2).map(|id| id.split('-').nth(1).unwrap().to_string()).collect::<Vec<_>>();
        let logged: Vec<String> = (0..8).map(|s| format!("s{s}")).collect();
        assert_ne!(sessions(one), logged);
        assert_ne!(sessions(one), sessions(two));
        assert_eq!(sessions(Replicates::new(&rows, 1, &[1, 2], true).of(1)), sessions(one));
        // From a lake (no own data): every replicate reads all sessions, in its own order.
        let shared = Replicates::new(&rows, 1, &[1, 2], false);
        assert_eq!(shared.of(1).order.len(), 34);
        assert_eq!(shared.heldout_all(), vec!["r2-s8"]);
        assert_ne!(shared.of(1).order, shared.of(2).order);
        // One seed: the logged order, as `stream`.
        let single = Replicates::new(&rows, 1, &[5], true);
        assert_eq!((single.of(5).order.clone(), single.own_data), (stream(&rows, 1).order, false));
    }

    #[test]
    fn queries_quote_and_exclude() {
        let q = train_sql("p'x", &["s1".into(), "o'k".into()]);
        assert_eq!(q, "SELECT s.* FROM samples s WHERE s.pipeline = 'p''x' AND s.sample_id IN ('s1', 'o''k') ORDER BY CASE s.sample_id WHEN 's1' THEN 1 WHEN 'o''k' THEN 2 END LIMIT 2");
        assert!(train_sql("p", &[]).contains("WHERE false"));
        // the first samples in the stream's order: interaction rank, then sample id; not in the
        // stream (held out, another replicate's) left out; each once; at most `limit`
        let rank: HashMap<String, i64> = [("i2", 1), ("i1", 2)].map(|(k, v)| (k.to_string(), v)).into_iter().collect();
        let rows: Vec<(String, String)> = [("b", "i1"), ("a", "i1"), ("c", "i2"), ("h", "held"), ("c", "i2")].map(|(s, i)| (s.to_string(), i.to_string())).to_vec();
        assert_eq!(first_samples(&rows, &rank, 10), vec!["c", "a", "b"]);
        assert_eq!(first_samples(&rows, &rank, 2), vec!["c", "a"]);
        assert_eq!(heldout_sql("p", &[]), None);
        assert!(heldout_sql("p", &["s".into()]).unwrap().contains("s.session_id IN ('s')"));
    }
}
