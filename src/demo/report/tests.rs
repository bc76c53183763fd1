use super::*;
use crate::report::chart::tests::png_size;

fn score(all: f64, md: f64, concise: f64, plain: f64, end: f64, acc: f64) -> Score {
    let per_preference_rate = [
        ("no_markdown", md),
        ("concise", concise),
        ("plain_sentences", plain),
        ("answer_at_end", end),
        ("correct_answer", acc),
    ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    Score { n: 100, fraction_all_satisfied: all, per_preference_rate, accuracy: acc }
}

fn report() -> DemoReport {
    DemoReport {
        title: "Personal-agent demo".into(),
        run_id: "run-1".into(),
        arm: "combined".into(),
        preferences: Preferences::default(),
        checkpoints: vec![
            CheckpointEval { version: 0, interactions: 0, score: score(0.17, 0.30, 0.55, 0.60, 0.40, 0.45), satisfied: vec![], mean_words: None, drift_nats_per_token: None },
            CheckpointEval { version: 1, interactions: 12, score: score(0.33, 0.52, 0.70, 0.71, 0.48, 0.46), satisfied: vec![], mean_words: None, drift_nats_per_token: None },
            CheckpointEval { version: 2, interactions: 24, score: score(0.58, 0.80, 0.85, 0.83, 0.61, 0.47), satisfied: vec![], mean_words: None, drift_nats_per_token: None },
            CheckpointEval { version: 3, interactions: 36, score: score(0.81, 0.95, 0.93, 0.94, 0.86, 0.47), satisfied: vec![], mean_words: Some(61.25), drift_nats_per_token: Some(0.03125) },
        ],
        pipeline_counts: BTreeMap::from([
            ("judge".to_string(), BTreeMap::from([("judgments".to_string(), 140u64), ("votes".to_string(), 420)])),
            ("signals".to_string(), BTreeMap::from([("paired".to_string(), 144u64)])),
        ]),
        advantages: None,
        steps: vec![],
        sessions: None,
        time: None,
        notes: vec!["policy: SmolLM2-135M-Instruct".into()],
    }
}

/// Width and height from a PNG's IHDR chunk.
#[test]
fn report_files_are_written() {
    let dir = tempfile::tempdir().unwrap();
    let files = write_report(dir.path().join("out"), &report()).unwrap();
    assert_eq!(files.markdown, dir.path().join("out/report.md"));
    let png = std::fs::read(&files.plot).unwrap();
    assert!(png.len() > 10_000, "{} bytes", png.len());
    assert_eq!(png_size(&png), (1600, 640));
    assert_eq!(files.plot_has_text, font_loaded());
    let md = std::fs::read_to_string(&files.markdown).unwrap();
    assert!(md.starts_with("# Personal-agent demo\n"), "{md}");
    assert!(md.contains("Personalization score: **0.170 → 0.810** (policy v0 → v3, after 36 student interactions; 100 held-out responses per version)."), "{md}");
    assert!(md.contains(
        "| policy version | interactions seen | held-out responses | personalization score | 95 % CI | no_markdown | concise | plain_sentences | answer_at_end | correct_answer | accuracy | mean words | drift from v0 (nats/token) |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    ), "{md}");
    // Wilson 17/100: [0.1089, 0.2555]; 81/100: [0.7222, 0.8749] (by hand, z = 1.96).
    assert!(md.contains("| 0 | 0 | 100 | 0.170 | 0.109–0.255 | 0.300 | 0.550 | 0.600 | 0.400 | 0.450 | 0.450 | – | – |\n"), "{md}");
    assert!(md.contains("| 3 | 36 | 100 | 0.810 | 0.722–0.875 | 0.950 | 0.930 | 0.940 | 0.860 | 0.470 | 0.470 | 61.2 | 0.0312 |\n"), "{md}");
    assert!(md.contains("95 % Wilson intervals: v0 [0.109, 0.255], v3 [0.722, 0.875]."), "{md}");
    assert!(md.contains("No paired test: per-problem outcomes were not recorded."), "{md}");
    assert!(md.contains("| stage | counter | count |\n|---|---|---:|\n| judge | judgments | 140 |\n| judge | votes | 420 |\n| signals | paired | 144 |\n"), "{md}");
    assert!(md.contains("](personalization.png)"));
    assert!(md.contains("- concise: at most 80 words"));
    assert!(md.contains("- policy: SmolLM2-135M-Instruct"));
    // The machine these tests run on has DejaVu (scripts/setup.sh installs it): the note is absent.
    assert_eq!(md.contains("no plot font was found"), !font_loaded());
}

#[test]
fn markdown_notes_a_missing_font_and_empty_results() {
    let mut r = report();
    let md = render_markdown(&r, "p.png", false);
    assert!(md.contains("Note: no plot font was found (/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"), "{md}");
    r.checkpoints.clear();
    r.pipeline_counts.clear();
    let md = render_markdown(&r, "p.png", true);
    assert!(md.contains("No evaluation results were recorded."));
    assert!(md.contains("No pipeline counts were recorded."));
    assert!(!md.contains("no plot font"));
}

#[test]
fn panels_draw_without_text() {
    // No text at all: plotters' default label font ("sans-serif") is never registered, so any text drawn
    // by accident would fail here with a font error.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plain.png");
    let (score, rates) = plot_series(&report());
    let panel = |series| Panel { title: "t", x_label: "x", y_label: "y", series, y_range: Some((0.0, 1.05)), point_labels: None, x_integer: true, error_bars: None };
    draw_panels(&path, (800, 300), &[panel(&score), panel(&rates)], false).unwrap();
    assert_eq!(png_size(&std::fs::read(&path).unwrap()), (800, 300));
}

#[test]
fn paired_test_and_result_line_from_per_problem_outcomes() {
    let mut r = report();
    r.checkpoints.truncate(2);
    // 12 problems: 3 met before; after, those 3 and 5 more, and one of the first 3 lost → 7 met.
    let before: Vec<bool> = (0..12).map(|i| i < 3).collect();
    let after: Vec<bool> = (0..12).map(|i| (1..8).contains(&i)).collect();
    for (c, sat) in r.checkpoints.iter_mut().zip([before, after]) {
        c.score.n = 12;
        c.score.fraction_all_satisfied = sat.iter().filter(|s| **s).count() as f64 / 12.0;
        c.satisfied = sat;
    }
    let m = r.first_vs_last().unwrap();
    // 5 gained, 1 lost: p = 2·(C(6,0) + C(6,1))/2^6 = 14/64 = 0.21875.
    assert_eq!((m.n, m.gained, m.lost), (12, 5, 1));
    assert!((m.p_value - 0.218_75).abs() < 1e-12, "{m:?}");
    let md = render_markdown(&r, "p.png", true);
    assert!(md.contains("Paired test on the same 12 problems (exact McNemar, v0 vs v1): 5 problems gained, 1 lost, two-sided p = 0.219 — **not significant at 0.05**."), "{md}");
    // Wilson 3/12 = [0.089, 0.532], 7/12 = [0.320, 0.807].
    assert_eq!(
        r.result_line(),
        "personalization score v0 0.250 [95% CI 0.089-0.532] -> v1 0.583 [0.320-0.807] on 12 held-out problems; exact McNemar: 5 gained, 1 lost, p = 0.219: not significant at 0.05"
    );
    r.checkpoints.clear();
    assert_eq!(r.result_line(), "no evaluation results were recorded");
    assert_eq!((p_text(0.21875), p_text(0.001), p_text(2.2e-4)), ("0.219".into(), "0.001".into(), "2.2e-4".into()));
}

#[test]
fn advantage_summary_by_hand() {
    use crate::ablate::fixtures::sample;
    use crate::schema::SampleType;
    // a: reward −1, 2 trained tokens of 3, teacher − student = (−0.5, +1.0) on them (third masked out)
    // b: reward +1, 1 trained token, no hint; c: reward 0, 2 tokens, teacher − student = (−1.0, 0)
    let a = sample(SampleType::CombinedBoth, -1.0, &[-1.0, -2.0, -3.0], Some(&[-1.5, -1.0, 9.0]), &[1, 1, 0]);
    let b = sample(SampleType::CombinedScoreOnly, 1.0, &[-1.0], None, &[1]);
    let c = sample(SampleType::CombinedBoth, 0.0, &[-1.0, -1.0], Some(&[-2.0, -1.0]), &[1, 1]);
    // d: combined-score-only carrying teacher log-probs: its advantage has no teacher term
    let d = sample(SampleType::CombinedScoreOnly, 1.0, &[-1.0], Some(&[-3.0]), &[1]);
    let s = AdvantageSummary::of(&[a, b, c, d], 0.5, 2.0);
    assert_eq!((s.samples, s.positive, s.negative, s.hinted, s.tokens, s.hinted_tokens), (4, 2, 1, 2, 6, 4));
    // |0.5·r| per token: (0.5 + 0.5 + 0.5 + 0 + 0 + 0.5)/6 = 1/3
    assert!((s.mean_abs_rl - 1.0 / 3.0).abs() < 1e-12, "{s:?}");
    // 2·(−0.5, 1.0, −1.0, 0) = (−1, 2, −2, 0): |.| mean 5/4, signed mean −1/4
    assert!((s.mean_abs_opd - 1.25).abs() < 1e-12 && (s.mean_opd + 0.25).abs() < 1e-12, "{s:?}");
    let mut r = report();
    r.advantages = Some(s);
    let md = render_markdown(&r, "p.png", true);
    assert!(md.contains("4 samples (6 trained tokens): reward +1 on 2, −1 on 1, 0 on 1; 2 with an accepted hint (4 tokens)."), "{md}");
    assert!(md.contains("mean |w_rl·r| = 0.333 (w_rl = 0.5); on the hinted tokens mean |w_opd·(teacher − student)| = 1.250, signed mean -0.250 (w_opd = 2)."), "{md}");
}

#[test]
fn per_step_attribution_by_hand() {
    use crate::schema::TrainStep;
    let row = |step: i64, parts: Option<(f64, f64, f64, f64)>| TrainStep {
        samples: 8,
        reward_mean: Some(-0.25),
        advantage_reward_abs_mean: parts.map(|p| p.0),
        advantage_teacher_abs_mean: parts.map(|p| p.1),
        teacher_term_positive_fraction: parts.map(|p| p.2),
        teacher_term_negative_fraction: parts.map(|p| p.3),
        ..TrainStep::new("r", step, "combined")
    };
    // steps out of order; a version-2 row (no parts) is left out
    let steps = StepAttribution::of(&[row(2, Some((0.5, 0.5, 0.25, 0.5))), row(1, Some((0.75, 0.25, 0.1, 0.6))), row(3, None)]);
    assert_eq!(steps.iter().map(|s| s.step).collect::<Vec<_>>(), vec![1, 2]);
    assert_eq!((steps[0].teacher_share(), steps[1].teacher_share()), (0.25, 0.5));
    let mut r = report();
    r.steps = steps;
    let md = render_markdown(&r, "p.png", true);
    assert!(md.contains("| 1 | 8 | -0.25 | 0.750 | 0.250 | 25 % | 10 % / 60 % |"), "{md}");
    assert!(md.contains("| 2 | 8 | -0.25 | 0.500 | 0.500 | 50 % | 25 % / 50 % |"), "{md}");
    // (0.25 + 0.5) / (1.25 + 0.75) = 37.5 % → "38 %"
    assert!(md.contains("Over the 2 steps (each weighted equally), the teacher part is 38 % of the advantage's magnitude, the reward part 62 %."), "{md}");
}

#[test]
fn the_sessions_section_states_the_online_metric() {
    use crate::demo::sessions::{SessionOutcome, SessionsSummary};
    let mut r = report();
    assert!(!render_markdown(&r, "p.png", true).contains("## The student's sessions"));
    let met = [false, true, true, true, false];
    let log: Vec<SessionOutcome> = met
        .iter()
        .enumerate()
        .map(|(i, &m)| SessionOutcome { session: format!("s{i}"), problem_id: i, ended: i + 1, turns: if m { 1 } else { 2 }, first_answer_satisfied: m, satisfied_at_end: true, first_version: 0, failed: false })
        .collect();
    r.sessions = Some(SessionsSummary::of(&log));
    let md = render_markdown(&r, "p.png", true);
    assert!(md.contains("## The student's sessions"), "{md}");
    assert!(md.contains("**preferences met in 3 consecutive sessions after 4 of 5 sessions**"), "{md}");
    // Five sessions in four parts: 1, 1, 1, 2.
    assert!(md.contains("per quarter of the sessions: 0.00 → 1.00 → 1.00 → 0.50; 1.40 answers per session."), "{md}");
}

#[test]
fn the_time_table_gives_each_part_its_share_of_the_wall_time() {
    let t = TimeTable {
        wall_seconds: 200.0,
        rows: vec![
            TimeRow { part: "pipeline phase".into(), seconds: 150.0, detail: "start to stop".into() },
            TimeRow { part: "stage judge".into(), seconds: 12.34, detail: "handler | calls".into() },
        ],
    };
    let md = t.markdown();
    assert!(md.starts_with("## Where the time went\n\nWall time 200 s."), "{md}");
    assert!(md.contains("| part | seconds | share of the wall time | measured as |\n|---|---:|---:|---|\n| pipeline phase | 150.0 | 75.0 % | start to stop |\n| stage judge | 12.3 | 6.2 % | handler \\| calls |\n\n"), "{md}");
    assert_eq!(TimeTable { wall_seconds: 1.0, rows: vec![] }.markdown(), "");
    let mut r = report();
    r.time = Some(t);
    let full = render_markdown(&r, "plot.png", true);
    assert!(full.find("## Where the time went").unwrap() < full.find("## Notes").unwrap(), "before the notes");
}
