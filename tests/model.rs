//! Integration tests of the model runtime against the imported SmolLM2-135M-Instruct
//! (`models/smollm2-135m-instruct`, made by `scripts/setup.sh`; set `NEXTSTATE_TEST_MODEL` to use
//! another directory). Each test is skipped with a message when the model directory is missing.

use std::path::PathBuf;
use std::sync::OnceLock;

use nextstate::model::{FinishReason, LanguageModel, LoadOptions, LoraConfig, LoraTarget, SamplingParams, Trainable};
use nextstate::schema::Message;

fn model_dir() -> Option<PathBuf> {
    let candidates = [
        std::env::var("NEXTSTATE_TEST_MODEL").ok().map(PathBuf::from),
        Some(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/smollm2-135m-instruct")),
        Some(PathBuf::from("/work/main/models/smollm2-135m-instruct")),
    ];
    let found = candidates.into_iter().flatten().find(|d| d.join("model.safetensors").is_file());
    if found.is_none() {
        eprintln!("SKIPPED: model directory models/smollm2-135m-instruct not found (run scripts/setup.sh)");
    }
    found
}

fn threads() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| tch::set_num_threads(1));
}

fn load(trainable: Trainable) -> Option<LanguageModel> {
    threads();
    let dir = model_dir()?;
    Some(LanguageModel::load(&dir, &LoadOptions { trainable, ..Default::default() }).expect("load model"))
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn greedy_plain_text_continuation_says_paris() {
    let Some(lm) = load(Trainable::Frozen) else { return };
    let prompt = lm.encode("The capital of France is").unwrap();
    let out = lm.generate(&[prompt], &SamplingParams::greedy(8)).unwrap();
    assert!(out[0].text.starts_with(" Paris"), "got {:?}", out[0].text);
}

#[test]
fn chatml_answer_about_germany() {
    let Some(lm) = load(Trainable::Frozen) else { return };
    let prompt = lm.chat_prompt_ids(&[Message::text("user", "What is the capital of Germany?")], None, true).unwrap();
    let out = lm.generate(&[prompt], &SamplingParams::greedy(32)).unwrap();
    let g = &out[0];
    assert_eq!(g.text, "The capital of Germany is Berlin.");
    assert_eq!(g.finish_reason, FinishReason::Stop);
    assert_eq!(g.matched_stop.as_deref(), Some("<|im_end|>"));
    assert_eq!(g.token_ids.last().copied(), Some(2));
}
