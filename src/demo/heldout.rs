//! Greedy answers of one policy version (the initial weights or a checkpoint) to held-out problems, and
//! their log-probs under another version: what the demo and the ablation both measure a version by.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{Problem, Student};
use crate::config::PipelineConfig;
use crate::error::Result;
use crate::model::{Generation, LanguageModel, LoadOptions, SamplingParams, Trainable};
use crate::schema::Message;

/// Loads the initial weights (`checkpoint` None) or a checkpoint folder on top of them, frozen, with
/// LoRA adapters folded in (evaluation runs at base speed).
///
/// # Errors
/// Model loading errors; [`crate::Error::Config`] for a bad device or dtype.
pub fn load_policy(cfg: &PipelineConfig, checkpoint: Option<&Path>) -> Result<LanguageModel> {
    let device = LoadOptions::parse_device(&cfg.policy.device)?;
    let opts = LoadOptions { device, dtype: LoadOptions::parse_dtype(&cfg.policy.dtype, device)?, trainable: Trainable::Frozen };
    match checkpoint {
        None => LanguageModel::load(&cfg.policy.model, &opts),
        Some(dir) => {
            let mut lm = LanguageModel::load_checkpoint(dir, Some(&cfg.policy.model), &opts)?;
            lm.transformer_mut().merge_lora()?;
            Ok(lm)
        }
    }
}

/// One greedy answer to a held-out problem, with the token ids it was made of.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeldoutAnswer {
    /// The problem.
    pub problem: Problem,
    /// The chat prompt's token ids (the student's first message, generation prompt added).
    pub prompt_ids: Vec<u32>,
    /// The generated token ids (a final stop token included when the answer stopped on one).
    pub response_ids: Vec<u32>,
    /// The log-prob of each generated token under the generating policy (nats; greedy: the plain
    /// log-softmax), same length as `response_ids`.
    pub logprobs: Vec<f32>,
    /// The answer's text (stop token and stop strings removed).
    pub text: String,
}

/// Greedy answers (up to `max_tokens` tokens) to the student's first message about each problem, `batch`
/// problems per generation call, in problem order, with their token ids.
///
/// # Errors
/// Model errors.
pub fn greedy_generations(lm: &LanguageModel, problems: &[Problem], student: &Student, max_tokens: usize, batch: usize) -> Result<Vec<HeldoutAnswer>> {
    let prompts = first_message_prompts(lm, problems, student)?;
    let gens = greedy_ids(lm, &prompts, max_tokens, batch)?;
    Ok(answers_of(problems, prompts, gens))
}

/// The chat prompt's token ids of the student's first message about each problem (generation prompt
/// added), in problem order.
fn first_message_prompts(lm: &LanguageModel, problems: &[Problem], student: &Student) -> Result<Vec<Vec<u32>>> {
    problems.iter().map(|p| lm.chat_prompt_ids(&[Message::text("user", student.first_message(p))], None, true)).collect()
}

/// Pairs each problem with its prompt ids and generation.
fn answers_of(problems: &[Problem], prompts: Vec<Vec<u32>>, gens: Vec<Generation>) -> Vec<HeldoutAnswer> {
    problems.iter().zip(prompts).zip(gens).map(|((p, prompt_ids), g)| HeldoutAnswer { problem: p.clone(), prompt_ids, response_ids: g.token_ids, logprobs: g.logprobs, text: g.text }).collect()
}

/// The file [`greedy_generations_kept`] keeps answers in: the key they were made under, and the answers.
#[derive(Serialize, Deserialize)]
struct KeptAnswers {
    key: String,
    answers: Vec<HeldoutAnswer>,
}

/// [`greedy_generations`] of the initial weights, kept in the JSON file `kept` for callers that evaluate
/// the same initial weights on the same prompts many times (the online ablation's replicates,
/// [`crate::ablate::online`]). The file's answers are reused when its key matches: the
/// [`crate::schema::content_hash`] of the policy's `model`, `dtype` and `device` (`cfg.policy`),
/// `max_tokens`, `batch` and every prompt's token ids in order. Otherwise (no file, another key, a file
/// that does not parse, logged) the answers are generated and the file is written atomically. Greedy
/// decoding of the same prompts in the same batches gives the same answers, so a reuse returns what a
/// new generation would (on the same machine and thread count). `lm` must be the initial weights of
/// `cfg.policy`: only the caller can know that, so only it may pass a kept file.
///
/// # Errors
/// Model errors; [`crate::Error::Io`] when the file cannot be written; JSON errors when the answers
/// cannot be serialised.
pub fn greedy_generations_kept(cfg: &PipelineConfig, lm: &LanguageModel, problems: &[Problem], student: &Student, max_tokens: usize, batch: usize, kept: &Path) -> Result<Vec<HeldoutAnswer>> {
    let prompts = first_message_prompts(lm, problems, student)?;
    let head = serde_json::json!({"model": cfg.policy.model, "dtype": cfg.policy.dtype, "device": cfg.policy.device, "max_tokens": max_tokens, "batch": batch});
    let ids: Vec<u8> = prompts.iter().flat_map(|p| (p.len() as u64).to_le_bytes().into_iter().chain(p.iter().flat_map(|t| t.to_le_bytes()))).collect();
    let key = crate::schema::content_hash(&[head.to_string().as_bytes(), &ids]);
    if kept.is_file() {
        match std::fs::read(kept).map_err(|e| e.to_string()).and_then(|b| serde_json::from_slice::<KeptAnswers>(&b).map_err(|e| e.to_string())) {
            Ok(k) if k.key == key && k.answers.len() == problems.len() => return Ok(k.answers),
            Ok(_) => tracing::info!(path = %kept.display(), "kept held-out answers were made under another key; generating them again"),
            Err(e) => tracing::warn!(path = %kept.display(), error = %e, "kept held-out answers unreadable; generating them again"),
        }
    }
    let gens = greedy_ids(lm, &prompts, max_tokens, batch)?;
    let answers = answers_of(problems, prompts, gens);
    if let Some(parent) = kept.parent() {
        std::fs::create_dir_all(parent).map_err(|e| crate::Error::io("create", parent, e))?;
    }
    crate::lake::write_atomic(kept, serde_json::to_string(&KeptAnswers { key, answers: answers.clone() })?.as_bytes())?;
    Ok(answers)
}

/// Greedy generations for the chat conversations `chats` (each rendered with the chat template and the
/// assistant turn opened), `batch` conversations per generation call, at most `max_tokens` tokens each,
/// in order, each with its prompt's token ids: the one generation loop of every greedy evaluation (the
/// held-out answers, the ablation's teacher and its baselines).
///
/// # Errors
/// Model errors (chat template, generation).
pub fn greedy_chat(lm: &LanguageModel, chats: &[Vec<Message>], max_tokens: usize, batch: usize) -> Result<Vec<(Vec<u32>, Generation)>> {
    let prompts = chats.iter().map(|m| lm.chat_prompt_ids(m, None, true)).collect::<Result<Vec<_>>>()?;
    let gens = greedy_ids(lm, &prompts, max_tokens, batch)?;
    Ok(prompts.into_iter().zip(gens).collect())
}

/// Greedy generations for token-id `prompts`, `batch` per generation call, at most `max_tokens` tokens
/// each, in order.
///
/// # Errors
/// Model errors.
pub fn greedy_ids(lm: &LanguageModel, prompts: &[Vec<u32>], max_tokens: usize, batch: usize) -> Result<Vec<Generation>> {
    let mut out = vec![];
    for chunk in prompts.chunks(batch.max(1)) {
        out.extend(lm.generate(chunk, &SamplingParams::greedy(max_tokens))?);
    }
    Ok(out)
}

/// Greedy answers as `(problem, text)` pairs ([`greedy_generations`] without the token ids).
///
/// # Errors
/// Model errors.
pub fn greedy_answers(lm: &LanguageModel, problems: &[Problem], student: &Student, max_tokens: usize, batch: usize) -> Result<Vec<(Problem, String)>> {
    Ok(greedy_generations(lm, problems, student, max_tokens, batch)?.into_iter().map(|a| (a.problem, a.text)).collect())
}

/// The summed log-prob (nats) of every response token of `answers` under `lm`, given its prompt, and the
/// number of tokens summed; answers are scored `batch` at a time and empty responses add nothing. The
/// held-out drift of a version `v` from `v0` is `(sum_v0 − sum_v) / tokens` on `v0`'s answers.
///
/// # Errors
/// Model errors.
pub fn response_logprob_sum(lm: &LanguageModel, answers: &[HeldoutAnswer], batch: usize) -> Result<(f64, usize)> {
    let (mut sum, mut n) = (0.0, 0usize);
    let with: Vec<&HeldoutAnswer> = answers.iter().filter(|a| !a.response_ids.is_empty()).collect();
    for chunk in with.chunks(batch.max(1)) {
        let items: Vec<(Vec<u32>, Vec<u32>)> = chunk.iter().map(|a| (a.prompt_ids.clone(), a.response_ids.clone())).collect();
        for scored in lm.score(&items, 0)? {
            sum += scored.logprobs.iter().map(|x| f64::from(*x)).sum::<f64>();
            n += scored.logprobs.len();
        }
    }
    Ok((sum, n))
}
