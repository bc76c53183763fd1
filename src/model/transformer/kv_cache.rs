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
    /// Keeps only the batch rows `rows` (int64 `[B']`, on the cache's device) and drops the first
    /// `drop_front` positions of every row (columns no kept row attends to any more, e.g. the left
    /// padding of a finished longer prompt; 0 keeps every column); length and capacity shrink by
    /// `drop_front`. One copy of the kept part.
    ///
    /// # Errors
    /// [`crate::Error::Model`] when `drop_front` exceeds the filled length; [`crate::Error::Torch`] for
    /// an out-of-range row.
    pub fn select_rows_from(&mut self, rows: &Tensor, drop_front: usize) -> Result<()> {
        if drop_front > self.len {
            return Err(crate::Error::Model(format!("cannot drop {drop_front} of {} filled cache positions", self.len)));
        }
        let (start, keep) = (drop_front as i64, (self.capacity - drop_front) as i64);
        for t in self.k.iter_mut().chain(self.v.iter_mut()) {
            *t = t.f_narrow(2, start, keep)?.f_index_select(0, rows)?;
        }
        self.len -= drop_front;
        self.capacity -= drop_front;
        Ok(())
    }

    /// One cache holding the rows of `self` then those of `other`, their filled positions aligned at the
    /// right end (a shorter cache's rows get `L − len` empty positions in front, `L` the longer length),
    /// with room for `room` more positions after `L`. Returns the cache and the column shift of `self`'s
    /// rows and of `other`'s (`L − len` each). The caller's attention mask must mark the shifted-in
    /// positions as padding.
    ///
    /// # Errors
    /// [`crate::Error::Model`] when the caches differ in layers, heads or head size;
    /// [`crate::Error::Torch`] when the allocation fails.
    pub fn concat_right_aligned(&self, other: &KvCache, room: usize) -> Result<(KvCache, usize, usize)> {
        if self.k.len() != other.k.len() {
            return Err(crate::Error::Model(format!("caches of {} and {} layers", self.k.len(), other.k.len())));
        }
        let len = self.len.max(other.len);
        let capacity = len + room;
        let (shift_a, shift_b) = (len - self.len, len - other.len);
        let mut out = KvCache { k: Vec::with_capacity(self.k.len()), v: Vec::with_capacity(self.v.len()), len, capacity };
        for (a, b) in self.k.iter().zip(&other.k).chain(self.v.iter().zip(&other.v)) {
            let (sa, sb) = (a.size(), b.size());
            if sa[1] != sb[1] || sa[3] != sb[3] {
                return Err(crate::Error::Model(format!("caches of shapes {sa:?} and {sb:?}")));
            }
            let t = Tensor::f_zeros([sa[0] + sb[0], sa[1], capacity as i64, sa[3]], (a.kind(), a.device()))?;
            t.f_narrow(0, 0, sa[0])?.f_narrow(2, shift_a as i64, self.len as i64)?.f_copy_(&a.f_narrow(2, 0, self.len as i64)?)?;
            t.f_narrow(0, sa[0], sb[0])?.f_narrow(2, shift_b as i64, other.len as i64)?.f_copy_(&b.f_narrow(2, 0, other.len as i64)?)?;
            out.k.push(t);
        }
        let layers = self.k.len();
        out.v = out.k.split_off(layers);
        Ok((out, shift_a, shift_b))
    }
}
