//! Scoring responses: per-token log-probs of a response given its prompt — the one alignment convention
//! that the teacher stage and the trainer share (METHOD.md §4, §6).
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

/// Differentiable per-token log-probs of a packed batch.
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

/// Runs the model over a packed batch and returns per-token response log-probs (see the module docs
/// for the alignment). Differentiable: call it outside `no_grad` for training.
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
}

/// Most tokens (B·L) scored in one forward pass.
pub const SCORE_BATCH_TOKENS: usize = 8192;
/// Most bytes of the `[B, Tmax, V]` f32 log-softmax held at once (1 GiB).
pub const SCORE_BATCH_LOGIT_BYTES: usize = 1 << 30;

/// Scores items without gradients, in chunks bounded by [`SCORE_BATCH_TOKENS`] and
/// [`SCORE_BATCH_LOGIT_BYTES`]; `top_k = 0` skips the top-K lists. Results are in input order.
///
/// # Errors
/// As [`PackedBatch::new`] and [`response_logprobs`]; [`Error::InvalidInput`] when `top_k` exceeds
/// the vocabulary.
pub fn score(model: &Transformer, items: &[(Vec<u32>, Vec<u32>)], top_k: usize, pad_id: u32) -> Result<Vec<ScoredResponse>> {
    let _guard = tch::no_grad_guard();
    let v = model.config.vocab_size;
    if top_k > v {
        return Err(crate::input_err!("top_k {top_k} exceeds the vocabulary of {v}"));
    }
    let mut out = Vec::with_capacity(items.len());
    let mut start = 0;
    while start < items.len() {
        // Grow the chunk while the padded batch stays within both budgets (always at least one item).
        let (mut end, mut l, mut t) = (start, 0usize, 0usize);
        while end < items.len() {
            let (p, r) = &items[end];
            let (nl, nt) = (l.max(p.len() + r.len()), t.max(r.len()));
            let n = end - start + 1;
            if end > start && (n * nl > SCORE_BATCH_TOKENS || n * nt * v * 4 > SCORE_BATCH_LOGIT_BYTES) {
                break;
            }
            (l, t) = (nl, nt);
            end += 1;
        }
        let chunk: Vec<(&[u32], &[u32])> = items[start..end].iter().map(|(p, r)| (p.as_slice(), r.as_slice())).collect();
        let batch = PackedBatch::new(&chunk, pad_id, v, model.device())?;
        let rl = response_logprobs(model, &batch)?;
        let lp = rl.logprobs.f_to_device(Device::Cpu)?;
        let topk = if top_k > 0 && batch.max_response_len() > 0 {
            let (ids, vals) = rl.topk(top_k)?;
            Some((ids.f_to_device(Device::Cpu)?, vals.f_to_device(Device::Cpu)?))
        } else {
            None
        };
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
            out.push(ScoredResponse { logprobs, topk_ids, topk_logprobs });
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
