//! Scoring responses: per-token log-probs of a response given its prompt — the one alignment convention
//! that the teacher stage and the trainer share (docs/method.md §4, §6).
//!
//! **Alignment.** For an item (prompt `p[0..P)`, response `r[0..T)`), the model reads
//! `x = p ++ r` and `logprobs[t] = log π(r[t] | p, r[<t]) = log_softmax(logits[P − 1 + t])[r[t]]`:
//! the hidden state at input position `P − 1 + t` predicts response token `t`. So `logprobs[0]`
//! scores the first response token from the last prompt position, and the last response token's own
//! logits are never used. A prompt must have at least one token.
//!
//! **Packing.** [`PackedBatch`] right-pads the `x` sequences to a common length L (positions 0..L, a
//! plain causal mask: padding only ever follows real tokens, so it cannot be attended to) and the
//! responses to `Tmax`, with a response mask that is 1 on real response tokens.

use tch::{Device, Kind, Tensor};

use super::transformer::{AttnMask, Transformer};
use crate::{Error, Result};

/// Variable-length (prompt, response) pairs packed with right padding.
#[derive(Debug)]
pub struct PackedBatch {
    /// `[B, L]` int64: prompt ++ response, right-padded with the pad id.
    pub input_ids: Tensor,
    /// `[B, Tmax]` int64: response ids, right-padded with 0.
    pub response_ids: Tensor,
    /// `[B, Tmax]` f32: 1 on real response tokens, 0 on padding.
    pub response_mask: Tensor,
    /// `[B, Tmax]` int64: the input position whose hidden state predicts response token t
    /// (`P_b − 1 + t`; 0 on padding).
    pub predict_positions: Tensor,
    /// Prompt length P_b of each item.
    pub prompt_lens: Vec<usize>,
    /// Response length T_b of each item.
    pub response_lens: Vec<usize>,
}

impl PackedBatch {
    /// Packs items on `device`. Token ids must be below `vocab_size`.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for an empty batch, an empty prompt or an id outside the vocabulary.
    pub fn new(items: &[(&[u32], &[u32])], pad_id: u32, vocab_size: usize, device: Device) -> Result<PackedBatch> {
        if items.is_empty() {
            return Err(crate::input_err!("cannot pack an empty batch"));
        }
        let b = items.len();
        let l = items.iter().map(|(p, r)| p.len() + r.len()).max().unwrap_or(0);
        let tmax = items.iter().map(|(_, r)| r.len()).max().unwrap_or(0);
        let mut input = vec![pad_id as i64; b * l];
        let mut resp = vec![0i64; b * tmax];
        let mut mask = vec![0f32; b * tmax];
        let mut pred = vec![0i64; b * tmax];
        for (i, (p, r)) in items.iter().enumerate() {
            if p.is_empty() {
                return Err(crate::input_err!("item {i}: empty prompt (the first response token needs a context)"));
            }
            if let Some(&bad) = p.iter().chain(r.iter()).find(|&&t| t as usize >= vocab_size) {
                return Err(crate::input_err!("item {i}: token id {bad} outside the vocabulary of {vocab_size}"));
            }
            for (j, &t) in p.iter().chain(r.iter()).enumerate() {
                input[i * l + j] = t as i64;
            }
            for (t, &id) in r.iter().enumerate() {
                resp[i * tmax + t] = id as i64;
                mask[i * tmax + t] = 1.0;
                pred[i * tmax + t] = (p.len() - 1 + t) as i64;
            }
        }
        let (b, l, tmax) = (b as i64, l as i64, tmax as i64);
        Ok(PackedBatch {
            input_ids: Tensor::f_from_slice(&input)?.f_view([b, l])?.f_to_device(device)?,
            response_ids: Tensor::f_from_slice(&resp)?.f_view([b, tmax])?.f_to_device(device)?,
            response_mask: Tensor::f_from_slice(&mask)?.f_view([b, tmax])?.f_to_device(device)?,
            predict_positions: Tensor::f_from_slice(&pred)?.f_view([b, tmax])?.f_to_device(device)?,
            prompt_lens: items.iter().map(|(p, _)| p.len()).collect(),
            response_lens: items.iter().map(|(_, r)| r.len()).collect(),
        })
    }

    /// Number of items B.
    pub fn batch_size(&self) -> usize {
        self.prompt_lens.len()
    }

    /// Longest response Tmax.
    pub fn max_response_len(&self) -> usize {
        self.response_lens.iter().copied().max().unwrap_or(0)
    }
}

/// Differentiable per-token log-probs of a packed batch, with the whole vocabulary's log-softmax
/// (the unchunked path of [`response_logprobs`]).
#[derive(Debug)]
pub struct ResponseLogits {
    /// `[B, Tmax]` f32: `log π(r_t | p, r_<t)`, 0 on padding; carries gradients when the model's
    /// parameters require them.
    pub logprobs: Tensor,
    /// `[B, Tmax]` f32 response mask (1 = real token).
    pub mask: Tensor,
    /// `[B, Tmax, V]` f32: the full log-softmax over the vocabulary at each response position (for
    /// entropy and top-K distillation); rows at padded positions are valid distributions but
    /// meaningless.
    pub log_probs_full: Tensor,
    /// T_b of each item.
    pub response_lens: Vec<usize>,
}

impl ResponseLogits {
    /// Entropy `−Σ_v p_v log p_v` at each response position, `[B, Tmax]` f32, 0 on padding.
    ///
    /// # Errors
    /// [`Error::Torch`] on a tensor failure.
    pub fn entropy(&self) -> Result<Tensor> {
        let h = self.log_probs_full.f_exp()?.f_mul(&self.log_probs_full)?.f_sum_dim_intlist(-1i64, false, Kind::Float)?.f_neg()?;
        Ok(h.f_mul(&self.mask)?)
    }

    /// The K most likely tokens at each response position: ids `[B, Tmax, K]` int64 and log-probs
    /// `[B, Tmax, K]` f32, sorted descending.
    ///
    /// # Errors
    /// [`Error::Torch`] when K exceeds the vocabulary.
    pub fn topk(&self, k: usize) -> Result<(Tensor, Tensor)> {
        let (vals, ids) = self.log_probs_full.f_topk(k as i64, -1, true, true)?;
        Ok((ids, vals))
    }

    /// Log-probs at given token ids per position (e.g. the student's log-probs at the teacher's
    /// top-K ids): `ids` `[B, Tmax, K]` int64 → `[B, Tmax, K]` f32, differentiable.
    ///
    /// # Errors
    /// [`Error::Torch`] on a shape mismatch or an id outside the vocabulary.
    pub fn gather(&self, ids: &Tensor) -> Result<Tensor> {
        Ok(self.log_probs_full.f_gather(2, ids, false)?)
    }
}

/// How [`response_hidden`] keeps what the backward pass needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gradients {
    /// Scoring: no autograd graph at all (runs under `no_grad`); [`HiddenPass::backward`] does nothing.
    None,
    /// Training, every layer's activations kept by autograd: fastest backward, activation memory
    /// grows with layers × tokens.
    Stored,
    /// Training with per-layer activation recomputation (gradient checkpointing): the forward pass
    /// runs without a graph and keeps only each layer's input `[B, L, H]`; the backward pass reruns
    /// one layer at a time with gradients and backpropagates through it, so at most one layer's
    /// activations are alive. Costs one more forward pass; the gradients are the same.
    Recomputed,
}

enum Backward<'a> {
    None,
    /// The graph output whose detached copy is the pass's `hidden`.
    Graph(Tensor),
    Recompute {
        model: &'a Transformer,
        /// Input of layer i at index i, the last layer's output at index n_layers.
        residuals: Vec<Tensor>,
        cos: Tensor,
        sin: Tensor,
        input_ids: Tensor,
        /// `[B, Tmax, H]` int64 gather index of the response positions.
        index: Tensor,
    },
}

/// Hidden states at the response positions of a batch, and the way back to the weights (see
/// [`response_hidden`]). The caller runs the output head on chunks of `hidden` (so no `[B, T, V]`
/// tensor is ever alive), accumulates `∂loss/∂hidden`, and calls [`HiddenPass::backward`] once.
pub struct HiddenPass<'a> {
    /// `[B, Tmax, H]` (model kind): row t of item b is the final-normed hidden state at input position
    /// `predict_positions[b, t]`, which predicts response token t. When training, a leaf tensor that
    /// requires grad (its own graph ends here).
    pub hidden: Tensor,
    back: Backward<'a>,
}

impl std::fmt::Debug for HiddenPass<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mode = match &self.back {
            Backward::None => "none",
            Backward::Graph(_) => "stored",
            Backward::Recompute { .. } => "recomputed",
        };
        f.debug_struct("HiddenPass").field("hidden", &self.hidden.size()).field("gradients", &mode).finish()
    }
}

/// Backpropagates `grad` (same shape as `out`) from `out` into every leaf of its graph: the gradient of
/// `Σ out·grad` with respect to `out` is exactly `grad`.
fn backprop(out: &Tensor, grad: &Tensor) -> Result<()> {
    out.f_mul(&grad.f_to_kind(out.kind())?)?.f_sum(Kind::Float)?.f_backward()?;
    Ok(())
}

impl HiddenPass<'static> {
    /// A pass over an existing graph: `at` `[B, T, H]` computed with gradients (any differentiable
    /// trunk). `hidden` becomes a detached leaf copy; [`HiddenPass::backward`] continues from `at`.
    /// Without gradients (`at` does not require grad), `hidden` is `at` and backward does nothing.
    ///
    /// # Errors
    /// [`Error::Torch`] on a tensor failure.
    pub fn from_graph(at: Tensor) -> Result<HiddenPass<'static>> {
        if !at.requires_grad() {
            return Ok(HiddenPass { hidden: at, back: Backward::None });
        }
        let hidden = at.f_detach()?.f_requires_grad_(true)?;
        Ok(HiddenPass { hidden, back: Backward::Graph(at) })
    }
}

impl HiddenPass<'_> {
    /// Backpropagates `grad` = `∂loss/∂hidden` (`[B, Tmax, H]`, any float kind) into the trainable
    /// weights' `.grad` (accumulating, like `Tensor::backward`). With [`Gradients::Recomputed`] this
    /// reruns the layers from the last to the first, one at a time.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when `grad`'s shape differs from `hidden`'s; [`Error::Torch`] on a tensor
    /// failure (e.g. out of memory).
    pub fn backward(self, grad: &Tensor) -> Result<()> {
        if grad.size() != self.hidden.size() {
            return Err(crate::input_err!("gradient of shape {:?} for hidden states of shape {:?}", grad.size(), self.hidden.size()));
        }
        match self.back {
            Backward::None => Ok(()),
            Backward::Graph(at) => backprop(&at, grad),
            Backward::Recompute { model, mut residuals, cos, sin, input_ids, index } => {
                let last = residuals.pop().ok_or_else(|| Error::Internal("recomputation kept no residual stream".into()))?;
                let x = last.f_detach()?.f_requires_grad_(true)?;
                let at = model.final_norm(&x)?.f_gather(1, &index, false)?;
                backprop(&at, grad)?;
                drop(at);
                let mut g = x.f_grad()?;
                for i in (0..residuals.len()).rev() {
                    let input = residuals.pop().ok_or_else(|| Error::Internal("recomputation lost a residual stream".into()))?;
                    let x = input.f_detach()?.f_requires_grad_(true)?;
                    drop(input);
                    let y = model.decoder_layer(i, &x, &cos, &sin, AttnMask::Causal, None, 0)?;
                    backprop(&y, &g)?;
                    drop(y);
                    g = x.f_grad()?;
                }
                if model.embeddings_trainable() {
                    backprop(&model.embed_tokens(&input_ids)?, &g)?;
                }
                Ok(())
            }
        }
    }
}

/// Runs the trunk over a packed batch and returns the hidden states that predict each response token
/// (see the module docs for the alignment), `[B, Tmax, H]`, with the backward path `grad` asks for.
/// The output head is not applied: see [`position_chunks`] and [`Transformer::logits`].
///
/// # Errors
/// [`Error::Torch`] on a tensor failure (e.g. out of memory).
pub fn response_hidden<'a>(model: &'a Transformer, batch: &PackedBatch, grad: Gradients) -> Result<HiddenPass<'a>> {
    let size = batch.input_ids.size();
    let (b, l) = (size[0], size[1]);
    let tmax = batch.response_ids.size()[1];
    let device = model.device();
    let pos = Tensor::f_arange(l, (Kind::Int64, device))?.f_unsqueeze(0)?.f_expand([b, l], false)?;
    let h = model.config.hidden_size as i64;
    let index = batch.predict_positions.f_unsqueeze(-1)?.f_expand([b, tmax, h], false)?;
    match grad {
        Gradients::None => {
            let _guard = tch::no_grad_guard();
            let hidden = model.forward_hidden(&batch.input_ids, &pos, AttnMask::Causal, None)?.f_gather(1, &index, false)?;
            Ok(HiddenPass { hidden, back: Backward::None })
        }
        Gradients::Stored => HiddenPass::from_graph(model.forward_hidden(&batch.input_ids, &pos, AttnMask::Causal, None)?.f_gather(1, &index, false)?),
        Gradients::Recomputed => {
            let _guard = tch::no_grad_guard();
            let (cos, sin) = model.rope_tables(&pos)?;
            let mut residuals = Vec::with_capacity(model.num_layers() + 1);
            let mut x = model.embed_tokens(&batch.input_ids)?;
            for i in 0..model.num_layers() {
                let y = model.decoder_layer(i, &x, &cos, &sin, AttnMask::Causal, None, 0)?;
                residuals.push(x);
                x = y;
            }
            let hidden = model.final_norm(&x)?.f_gather(1, &index, false)?.f_requires_grad_(true)?;
            residuals.push(x);
            Ok(HiddenPass { hidden, back: Backward::Recompute { model, residuals, cos, sin, input_ids: batch.input_ids.shallow_clone(), index } })
        }
    }
}

/// Default rows (batch items × positions) of one output-head chunk: the largest `[rows, V]` tensor
/// alive while scoring or training (256 × 49,152 f32 = 48 MiB for SmolLM2).
pub const LOGIT_CHUNK_TOKENS: usize = 256;

/// Splits response positions `0..tmax` of a batch of `batch` items into consecutive chunks
/// `(start, len)` of at most `chunk_tokens` rows (`batch · len`), at least one position each.
pub fn position_chunks(batch: i64, tmax: i64, chunk_tokens: usize) -> Vec<(i64, i64)> {
    let step = ((chunk_tokens as i64) / batch.max(1)).max(1);
    (0..tmax).step_by(step as usize).map(|s| (s, step.min(tmax - s))).collect()
}

/// Runs the model over a packed batch and returns per-token response log-probs with the **whole**
/// `[B, Tmax, V]` log-softmax (see the module docs for the alignment). Differentiable: call it outside
/// `no_grad` for gradients. Its memory grows with B·Tmax·V; the trainer and [`score`] use
/// [`response_hidden`] with chunks of positions instead, and this is their unchunked reference.
///
/// # Errors
/// [`Error::Torch`] on a tensor failure (e.g. out of memory).
pub fn response_logprobs(model: &Transformer, batch: &PackedBatch) -> Result<ResponseLogits> {
    let size = batch.input_ids.size();
    let (b, l) = (size[0], size[1]);
    let tmax = batch.response_ids.size()[1];
    let device = model.device();
    let pos = Tensor::f_arange(l, (Kind::Int64, device))?.f_unsqueeze(0)?.f_expand([b, l], false)?;
    let hidden = model.forward_hidden(&batch.input_ids, &pos, AttnMask::Causal, None)?;
    let h = hidden.size()[2];
    // Only response positions go through the output head ([B, Tmax, H] → [B, Tmax, V]).
    let idx = batch.predict_positions.f_unsqueeze(-1)?.f_expand([b, tmax, h], false)?;
    let at = hidden.f_gather(1, &idx, false)?;
    let log_probs_full = model.logits(&at)?.f_log_softmax(-1, Kind::Float)?;
    let lp = log_probs_full.f_gather(2, &batch.response_ids.f_unsqueeze(-1)?, false)?.f_squeeze_dim(-1)?;
    Ok(ResponseLogits { logprobs: lp.f_mul(&batch.response_mask)?, mask: batch.response_mask.shallow_clone(), log_probs_full, response_lens: batch.response_lens.clone() })
}

/// Scores of one response.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoredResponse {
    /// `logprobs[t] = log π(response_t | prompt, response_<t)` (nats); length T.
    pub logprobs: Vec<f32>,
    /// Top-K ids per position, `[T][K]` (when asked).
    pub topk_ids: Option<Vec<Vec<u32>>>,
    /// Top-K log-probs per position, `[T][K]`, descending (when asked).
    pub topk_logprobs: Option<Vec<Vec<f32>>>,
    /// Log-probs (nats) at the ids asked for per position ([`score_at`]), `[T][J]`; `None` when not asked.
    pub at_logprobs: Option<Vec<Vec<f32>>>,
    /// Rank of each response token in its position's whole-vocabulary distribution ([`score_ranked`]),
    /// length T: 1 + the number of *other* ids with a log-prob ≥ the token's (1 = the most likely;
    /// vLLM's `rank` of prompt log-probs counts the same way). `None` when not asked.
    pub ranks: Option<Vec<u32>>,
}

/// `logits / temperature` (unchanged, no copy, at 1): the logits of the distribution that is trained and
/// scored at `trainer.temperature` / `teacher.temperature` (docs/method.md §6). Shared by the scorer and the
/// trainer so both take one tempering.
///
/// # Errors
/// [`Error::Torch`] on a tensor failure.
pub fn tempered(logits: &Tensor, temperature: f64) -> Result<Tensor> {
    if temperature == 1.0 {
        Ok(logits.shallow_clone())
    } else {
        Ok(logits.f_div_scalar(temperature)?)
    }
}

/// Most tokens (B·L) scored in one forward pass.
pub const SCORE_BATCH_TOKENS: usize = 8192;

/// Scores items without gradients, in forward passes of at most [`SCORE_BATCH_TOKENS`] padded tokens,
/// with the output head applied to chunks of [`LOGIT_CHUNK_TOKENS`] positions (no `[B, T, V]` tensor
/// is built); `top_k = 0` skips the top-K lists. Results are in input order.
///
/// # Errors
/// As [`PackedBatch::new`] and [`response_hidden`]; [`Error::InvalidInput`] when `top_k` exceeds
/// the vocabulary; [`Error::NonFinite`] for a non-finite log-prob.
pub fn score(model: &Transformer, items: &[(Vec<u32>, Vec<u32>)], top_k: usize, pad_id: u32) -> Result<Vec<ScoredResponse>> {
    score_at(model, items, top_k, &[], pad_id)
}

/// [`score`], and also the log-probs at given token ids: with `at` non-empty (one entry per item,
/// `at[i]` = `[T_i][J]` ids, the same J for every position of every item), each result's
/// `at_logprobs[t][j] = log π(at[i][t][j] | prompt, response_<t)` (nats). Multi-candidate hints
/// (docs/method.md §3b) use it to score a teacher at the student's top-K ids.
///
/// # Errors
/// As [`score`]; [`Error::InvalidInput`] when `at` has another length than `items`, a row of `at`
/// has another length than its response, the widths differ, or an id is outside the vocabulary.
pub fn score_at(model: &Transformer, items: &[(Vec<u32>, Vec<u32>)], top_k: usize, at: &[Vec<Vec<u32>>], pad_id: u32) -> Result<Vec<ScoredResponse>> {
    score_pass(model, items, top_k, at, pad_id, false, 1.0)
}

/// [`score_at`] of the distribution at `temperature`: every log-prob (of the response tokens, the
/// top-K lists and the ids asked for) is taken from the log-softmax of `logits / temperature` — the
/// distribution the trainer trains with `trainer.temperature` (docs/method.md §6). 1 is [`score_at`].
///
/// # Errors
/// As [`score_at`]; [`Error::InvalidInput`] for a temperature that is not a positive number.
pub fn score_at_temperature(model: &Transformer, items: &[(Vec<u32>, Vec<u32>)], top_k: usize, at: &[Vec<Vec<u32>>], pad_id: u32, temperature: f64) -> Result<Vec<ScoredResponse>> {
    if !(temperature.is_finite() && temperature > 0.0) {
        return Err(crate::input_err!("scoring temperature {temperature} must be a positive number"));
    }
    score_pass(model, items, top_k, at, pad_id, false, temperature)
}

/// [`score`], and also each response token's rank in the whole vocabulary
/// ([`ScoredResponse::ranks`]); the policy server's prompt log-probs (`/v1/completions`) report it.
///
/// # Errors
/// As [`score`].
pub fn score_ranked(model: &Transformer, items: &[(Vec<u32>, Vec<u32>)], top_k: usize, pad_id: u32) -> Result<Vec<ScoredResponse>> {
    score_pass(model, items, top_k, &[], pad_id, true, 1.0)
}

fn score_pass(model: &Transformer, items: &[(Vec<u32>, Vec<u32>)], top_k: usize, at: &[Vec<Vec<u32>>], pad_id: u32, ranked: bool, temperature: f64) -> Result<Vec<ScoredResponse>> {
    let _guard = tch::no_grad_guard();
    let v = model.config.vocab_size;
    if top_k > v {
        return Err(crate::input_err!("top_k {top_k} exceeds the vocabulary of {v}"));
    }
    if !at.is_empty() && at.len() != items.len() {
        return Err(crate::input_err!("{} id lists for {} items", at.len(), items.len()));
    }
    // J from the first position of any item (an item with an empty response has no rows).
    let width = at.iter().find_map(|rows| rows.first()).map_or(0, Vec::len);
    for (i, (rows, (_, r))) in at.iter().zip(items).enumerate() {
        if rows.len() != r.len() {
            return Err(crate::input_err!("item {i}: {} id rows for {} response tokens", rows.len(), r.len()));
        }
        if let Some(bad) = rows.iter().find(|row| row.len() != width) {
            return Err(crate::input_err!("item {i}: a row of {} ids, expected {width}", bad.len()));
        }
        if let Some(&id) = rows.iter().flatten().find(|&&id| id as usize >= v) {
            return Err(crate::input_err!("item {i}: id {id} outside the vocabulary of {v}"));
        }
    }
    let mut out = Vec::with_capacity(items.len());
    let mut start = 0;
    while start < items.len() {
        // Grow the chunk while the padded batch stays within the budget (always at least one item).
        let (mut end, mut l) = (start, 0usize);
        while end < items.len() {
            let (p, r) = &items[end];
            let nl = l.max(p.len() + r.len());
            if end > start && (end - start + 1) * nl > SCORE_BATCH_TOKENS {
                break;
            }
            l = nl;
            end += 1;
        }
        let chunk: Vec<(&[u32], &[u32])> = items[start..end].iter().map(|(p, r)| (p.as_slice(), r.as_slice())).collect();
        let batch = PackedBatch::new(&chunk, pad_id, v, model.device())?;
        let pass = response_hidden(model, &batch, Gradients::None)?;
        let (b, tmax) = (batch.batch_size() as i64, batch.max_response_len() as i64);
        // [B, Tmax, J] ids to gather (0 on padding), when asked.
        let at_ids = if width > 0 {
            let mut flat = vec![0i64; (b * tmax) as usize * width];
            for (i, rows) in at[start..end].iter().enumerate() {
                for (t, row) in rows.iter().enumerate() {
                    for (j, &id) in row.iter().enumerate() {
                        flat[(i * tmax as usize + t) * width + j] = i64::from(id);
                    }
                }
            }
            Some(Tensor::f_from_slice(&flat)?.f_view([b, tmax, width as i64])?.f_to_device(model.device())?)
        } else {
            None
        };
        let (mut lps, mut ids, mut vals, mut ats, mut rks) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (t0, n) in position_chunks(b, tmax, LOGIT_CHUNK_TOKENS) {
            let lsm = tempered(&model.logits(&pass.hidden.f_narrow(1, t0, n)?)?, temperature)?.f_log_softmax(-1, Kind::Float)?;
            let lp = lsm.f_gather(2, &batch.response_ids.f_narrow(1, t0, n)?.f_unsqueeze(-1)?, false)?;
            if ranked {
                rks.push(lsm.f_ge_tensor(&lp)?.f_sum_dim_intlist(-1i64, false, Kind::Int64)?);
            }
            lps.push(lp.f_squeeze_dim(-1)?);
            if top_k > 0 {
                let (tv, ti) = lsm.f_topk(top_k as i64, -1, true, true)?;
                ids.push(ti);
                vals.push(tv);
            }
            if let Some(a) = &at_ids {
                ats.push(lsm.f_gather(2, &a.f_narrow(1, t0, n)?, false)?);
            }
        }
        let at_all = if ats.is_empty() { None } else { Some(Tensor::f_cat(&ats, 1)?.f_to_device(Device::Cpu)?) };
        let rank_all = if rks.is_empty() { None } else { Some(Tensor::f_cat(&rks, 1)?.f_to_device(Device::Cpu)?) };
        let lp = if lps.is_empty() { Tensor::f_zeros([b, 0], (Kind::Float, Device::Cpu))? } else { Tensor::f_cat(&lps, 1)?.f_mul(&batch.response_mask)?.f_to_device(Device::Cpu)? };
        let topk = if top_k > 0 && !ids.is_empty() { Some((Tensor::f_cat(&ids, 1)?.f_to_device(Device::Cpu)?, Tensor::f_cat(&vals, 1)?.f_to_device(Device::Cpu)?)) } else { None };
        for (i, &tl) in batch.response_lens.iter().enumerate() {
            let row: Vec<f32> = Vec::<f32>::try_from(&lp.f_get(i as i64)?)?;
            let logprobs = row[..tl].to_vec();
            let (topk_ids, topk_logprobs) = match &topk {
                Some((ids, vals)) => {
                    let ids: Vec<Vec<i64>> = Vec::<Vec<i64>>::try_from(&ids.f_get(i as i64)?)?;
                    let vals: Vec<Vec<f32>> = Vec::<Vec<f32>>::try_from(&vals.f_get(i as i64)?)?;
                    (
                        Some(ids[..tl].iter().map(|r| r.iter().map(|&x| x as u32).collect()).collect()),
                        Some(vals[..tl].to_vec()),
                    )
                }
                None if top_k > 0 => (Some(vec![]), Some(vec![])),
                None => (None, None),
            };
            if let Some(pos) = logprobs.iter().position(|x| !x.is_finite()) {
                return Err(Error::NonFinite { what: "scored log-prob", position: pos });
            }
            let at_logprobs = match &at_all {
                Some(a) => {
                    let rows: Vec<Vec<f32>> = Vec::<Vec<f32>>::try_from(&a.f_get(i as i64)?)?;
                    Some(rows[..tl].to_vec())
                }
                None if width > 0 => Some(vec![vec![]; tl]),
                None => None,
            };
            let ranks = match &rank_all {
                Some(r) => Some(Vec::<i64>::try_from(&r.f_get(i as i64)?)?[..tl].iter().map(|&x| x.clamp(1, i64::from(u32::MAX)) as u32).collect()),
                None if ranked => Some(vec![]),
                None => None,
            };
            out.push(ScoredResponse { logprobs, topk_ids, topk_logprobs, at_logprobs, ranks });
        }
        start = end;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packs_with_right_padding_and_alignment() {
        let p1: &[u32] = &[5, 6, 7];
        let r1: &[u32] = &[8];
        let p2: &[u32] = &[9];
        let r2: &[u32] = &[10, 11, 12];
        let b = PackedBatch::new(&[(p1, r1), (p2, r2)], 0, 100, Device::Cpu).unwrap();
        assert_eq!(b.input_ids.size(), vec![2, 4]);
        assert_eq!(Vec::<Vec<i64>>::try_from(&b.input_ids).unwrap(), vec![vec![5, 6, 7, 8], vec![9, 10, 11, 12]]);
        assert_eq!(Vec::<Vec<i64>>::try_from(&b.response_ids).unwrap(), vec![vec![8, 0, 0], vec![10, 11, 12]]);
        assert_eq!(Vec::<Vec<f32>>::try_from(&b.response_mask).unwrap(), vec![vec![1.0, 0.0, 0.0], vec![1.0, 1.0, 1.0]]);
        // Response token t of item 0 is predicted at position P−1+t = 2; item 1 at 0, 1, 2.
        assert_eq!(Vec::<Vec<i64>>::try_from(&b.predict_positions).unwrap(), vec![vec![2, 0, 0], vec![0, 1, 2]]);
        assert!(PackedBatch::new(&[(&[][..], r1)], 0, 100, Device::Cpu).is_err());
        assert!(PackedBatch::new(&[(p1, &[100][..])], 0, 100, Device::Cpu).is_err());
    }
}
