//! Per-record overhead of the judge, hint and teacher stages, model time excluded: p50/p99 ms per record
//! over the tau-bench fixture's 2,454 turns (after one warm-up pass), combined method.
//!
//! What is timed per record is what the stage's `StageLogic::handle` does for it, minus Kafka I/O:
//! - `judge`: parse the `signals` envelope (with the carried interaction), build the turn
//!   (`TurnContext::from_rows`), judge it with the rule-based backend (`judge_turn`: prompt render, m
//!   votes, parse, majority), serialise the `judgments` envelope with its carry;
//! - `hint`: parse the `judgments` envelope, build the turn, `hint_turn` with the rule-based backend,
//!   render the teacher context with the policy's chat template (when a hint was accepted), serialise;
//! - `teacher`: parse the `hints` envelope, `samples::decide`, make the prompt/response token ids with the
//!   policy's tokenizer and template (`teacher::tokens::turn_tokens`) and the teacher prompt ids, build
//!   the `teacher_logprobs` row, `samples::assemble`, serialise both outputs. The two forward passes
//!   (rollout recompute, teacher scoring) are not run: their log-probs are −1.0 of the right length.
//!
//! No peer: these are our own pipeline semantics (the reference implementation runs them inside its
//! Python trainer process, interleaved with model calls).
//!
//! Run: `cargo bench --bench stages`. Needs the fixture and `models/smollm2-135m-instruct` (for the
//! tokenizer and chat template). Prints `BENCH {json}` lines.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use serde_json::json;

use nextstate::bus::{Carry, Envelope};
use nextstate::method::Method;
use nextstate::hint::{hint_turn, HintConfig, Hinter};
use nextstate::judge::{judge_turn, Judge, JudgeConfig, TurnContext};
use nextstate::model::{ChatTemplate, LanguageModel, LoadOptions};
use nextstate::samples::{assemble, decide, Decision, SampleConfig, SampleOutcome};
use nextstate::schema::{now_ms, HintRecord, Judgment, Message, Signal, Table, TeacherLogprobs};
use nextstate::teacher::teacher_row_id;
use nextstate::teacher::tokens::turn_tokens;

use common::{emit, fixture_rows, ms, percentile, signals_of};

fn model_dir() -> Option<PathBuf> {
    let d = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/smollm2-135m-instruct");
    d.join("config.json").is_file().then_some(d)
}

fn to_i32(v: &[u32]) -> Vec<i32> {
    v.iter().map(|&x| x as i32).collect()
}

#[derive(Default)]
struct Times {
    judge: Vec<f64>,
    hint: Vec<f64>,
    teacher: Vec<f64>,
    outcomes: HashMap<String, u64>,
}

fn main() {
    let Some(rows) = fixture_rows() else {
        eprintln!("SKIPPED: tau-bench fixture not found");
        return;
    };
    let Some(dir) = model_dir() else {
        eprintln!("SKIPPED: no model directory (run scripts/setup.sh)");
        return;
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let lm = LanguageModel::load(&dir, &LoadOptions::default()).expect("load model");
    let template = ChatTemplate::from_dir(&dir).expect("template").expect("the model has a chat template");
    let judge = Judge::new(JudgeConfig::default()).expect("judge");
    let hinter = Hinter::new(HintConfig::default()).expect("hinter");
    let scfg = SampleConfig::default();
    let pipeline = "bench";
    let teacher_model = "policy-v0";
    let by_id: HashMap<String, Signal> = signals_of(&rows).into_iter().map(|s| (s.interaction_id.clone(), s)).collect();
    // The judge stage's input records: signals envelopes carrying their interaction.
    let inputs: Vec<Vec<u8>> = rows
        .iter()
        .filter_map(|i| {
            let s = by_id.get(&i.interaction_id)?;
            let carry = Carry { interaction: Some(i.clone()), ..Default::default() };
            Some(serde_json::to_vec(&Envelope { row: s.clone(), carry: Some(carry) }).expect("json"))
        })
        .collect();

    let pass = |t: &mut Times| {
        for input in &inputs {
            // judge
            let t0 = Instant::now();
            let env: Envelope<Signal> = serde_json::from_slice(input).expect("signal envelope");
            if env.row.excluded_reason.is_some() {
                *t.outcomes.entry("judge: skipped (excluded)".into()).or_default() += 1;
                continue;
            }
            let carry = env.carry.unwrap_or_default();
            let Some(interaction) = carry.interaction else { continue };
            let Ok(turn) = TurnContext::from_rows(&interaction, &env.row) else {
                *t.outcomes.entry("judge: dead letter".into()).or_default() += 1;
                continue;
            };
            let j = rt.block_on(judge_turn(&judge, pipeline, &turn));
            let out = Carry { interaction: Some(interaction), signal: Some(env.row), judgment: Some(j.clone()), hint: None };
            let judged = serde_json::to_vec(&Envelope { row: j, carry: Some(out) }).expect("json");
            t.judge.push(ms(t0.elapsed()));

            // hint
            let t0 = Instant::now();
            let env: Envelope<Judgment> = serde_json::from_slice(&judged).expect("judgment envelope");
            let mut carry = env.carry.unwrap_or_default();
            let (Some(i), Some(s)) = (carry.interaction.as_ref(), carry.signal.as_ref()) else { continue };
            let turn = TurnContext::from_rows(i, s).expect("turn");
            let mut h = rt.block_on(hint_turn(&hinter, pipeline, &turn));
            if let Some(tm) = &h.teacher_messages {
                let msgs: Vec<Message> = serde_json::from_str(tm).expect("teacher messages");
                h.teacher_prompt_text = Some(template.render(&msgs, None, true, None).expect("render"));
            }
            *t.outcomes.entry(format!("hint: {}", if h.chosen_hint.is_some() { "accepted" } else { "none" })).or_default() += 1;
            carry.hint = Some(h.clone());
            let hinted = serde_json::to_vec(&Envelope { row: h, carry: Some(carry) }).expect("json");
            t.hint.push(ms(t0.elapsed()));

            // teacher (model time excluded)
            let t0 = Instant::now();
            let env: Envelope<HintRecord> = serde_json::from_slice(&hinted).expect("hint envelope");
            let carry = env.carry.unwrap_or_default();
            let Some(interaction) = carry.interaction else { continue };
            let uses_teacher = match decide(Method::Combined, &scfg, &interaction, carry.judgment.as_ref(), carry.hint.as_ref()) {
                Decision::NoSample(r) => {
                    *t.outcomes.entry(format!("teacher: no sample ({})", r.as_str())).or_default() += 1;
                    t.teacher.push(ms(t0.elapsed()));
                    continue;
                }
                Decision::Emit { uses_teacher, .. } => uses_teacher,
            };
            let Ok((p, r)) = turn_tokens(&lm, &interaction) else {
                *t.outcomes.entry("teacher: dead letter (tokenization)".into()).or_default() += 1;
                continue;
            };
            let tools: Option<serde_json::Value> = interaction.tools.as_ref().and_then(|t| serde_json::from_str(t).ok());
            let teacher_prompt = uses_teacher.then(|| {
                let msgs: Vec<Message> = serde_json::from_str(env.row.teacher_messages.as_deref().unwrap_or("[]")).expect("teacher messages");
                lm.chat_prompt_ids(&msgs, tools.as_ref(), true).expect("teacher prompt")
            });
            let rollout = vec![-1.0f32; r.len()];
            let teacher_row = teacher_prompt.as_ref().map(|tp| TeacherLogprobs {
                schema_version: TeacherLogprobs::SCHEMA_VERSION,
                teacher_id: teacher_row_id(&interaction.interaction_id, teacher_model, tp, 0, None),
                pipeline: pipeline.into(),
                interaction_id: interaction.interaction_id.clone(),
                session_id: interaction.session_id.clone(),
                tenant: interaction.tenant.clone(),
                turn_index: interaction.turn_index,
                teacher_model: teacher_model.into(),
                teacher_version: 0,
                teacher_prompt_token_ids: to_i32(tp),
                response_token_ids: to_i32(&r),
                teacher_logprobs: vec![-1.0; r.len()],
                topk_ids: None,
                topk_logprobs: None,
                student_topk_ids: None,
                logprobs_at_student_topk: None,
                event_time: interaction.event_time,
                processed_time: now_ms(),
            });
            let outcome = assemble(Method::Combined, &scfg, &interaction, carry.judgment.as_ref(), carry.hint.as_ref(), teacher_row.as_ref(), &to_i32(&p), &to_i32(&r), &rollout, pipeline);
            match outcome {
                Ok(SampleOutcome::Sample(s)) => {
                    if let Some(tr) = &teacher_row {
                        std::hint::black_box(serde_json::to_vec(&Envelope { row: tr.clone(), carry: None }).expect("json"));
                    }
                    std::hint::black_box(serde_json::to_vec(&Envelope { row: s.clone(), carry: None }).expect("json"));
                    *t.outcomes.entry(format!("teacher: sample {}", s.sample_type.as_str())).or_default() += 1;
                }
                Ok(SampleOutcome::NoSample { reason }) => *t.outcomes.entry(format!("teacher: no sample ({})", reason.as_str())).or_default() += 1,
                Err(e) => *t.outcomes.entry(format!("teacher: dead letter ({e})")).or_default() += 1,
            }
            t.teacher.push(ms(t0.elapsed()));
        }
    };
    let mut warm = Times::default();
    pass(&mut warm);
    let mut t = Times::default();
    pass(&mut t);
    for (stage, v) in [("judge", &mut t.judge), ("hint", &mut t.hint), ("teacher", &mut t.teacher)] {
        v.sort_by(f64::total_cmp);
        let total: f64 = v.iter().sum();
        emit(json!({"bench": "stages", "case": stage, "records": v.len(), "p50_ms": percentile(v, 50.0), "p99_ms": percentile(v, 99.0),
            "max_ms": v.last().copied().unwrap_or(f64::NAN), "records_s": v.len() as f64 / (total / 1e3)}));
    }
    emit(json!({"bench": "stages", "case": "outcomes", "outcomes": t.outcomes}));
}
