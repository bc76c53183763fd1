//! The attention mask of a forward call and the per-layer key/value cache of incremental decoding.

use tch::{Device, Kind, Tensor};

use crate::model::config::ModelConfig;
use crate::Result;

/// The attention mask of one forward call.
#[derive(Debug, Clone, Copy)]
pub enum AttnMask<'a> {
    /// Plain causal attention over exactly the L new tokens (no cache content, no padding before any
    /// real token: right padding is fine).
    Causal,
    /// Boolean `[B, 1, L, S]`, true where a query may attend to a key; S = cache length after this
    /// call.
    Explicit(&'a Tensor),
}

/// Per-layer key/value cache, preallocated for `capacity` positions: keys and values of layer i are
/// `[B, n_kv, capacity, d]`; positions `[0, len)` are filled.
#[derive(Debug)]
pub struct KvCache {
    pub(super) k: Vec<Tensor>,
    pub(super) v: Vec<Tensor>,
    pub(super) len: usize,
    pub(super) capacity: usize,
}

impl KvCache {
    /// An empty cache for `batch` sequences of up to `capacity` positions.
    ///
    /// # Errors
    /// [`crate::Error::Torch`] when the allocation fails (out of memory).
    pub fn new(config: &ModelConfig, batch: usize, capacity: usize, kind: Kind, device: Device) -> Result<KvCache> {
        let shape = [batch as i64, config.num_key_value_heads as i64, capacity as i64, config.head_dim as i64];
        let mut k = Vec::with_capacity(config.num_hidden_layers);
        let mut v = Vec::with_capacity(config.num_hidden_layers);
        for _ in 0..config.num_hidden_layers {
            k.push(Tensor::f_zeros(shape, (kind, device))?);
            v.push(Tensor::f_zeros(shape, (kind, device))?);
        }
        Ok(KvCache { k, v, len: 0, capacity })
    }
    /// Filled positions.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether no position is filled.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Allocated positions.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// Grows the capacity to at least `needed` positions (filled positions are kept).
    ///
    /// # Errors
    /// [`crate::Error::Torch`] when the allocation fails.
    pub fn reserve(&mut self, needed: usize) -> Result<()> {
        if needed <= self.capacity {
            return Ok(());
        }
        for t in self.k.iter_mut().chain(self.v.iter_mut()) {
            let mut size = t.size();
            size[2] = (needed - self.capacity) as i64;
            let extra = Tensor::f_zeros(&size, (t.kind(), t.device()))?;
            *t = Tensor::f_cat(&[&*t, &extra], 2)?;
        }
        self.capacity = needed;
        Ok(())
    }
    /// Keeps only the batch rows `rows` (int64 `[B']`, on the cache's device), e.g. after some
    /// sequences finished.
    ///
    /// # Errors
    /// [`crate::Error::Torch`] for an out-of-range row.
    pub fn select_rows(&mut self, rows: &Tensor) -> Result<()> {
        for t in self.k.iter_mut().chain(self.v.iter_mut()) {
            *t = t.f_index_select(0, rows)?;
        }
        Ok(())
    }
}
