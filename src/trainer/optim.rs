//! AdamW over a [`VarStore`]'s trainable tensors, with state that can be checkpointed.
//!
//! **Why not `tch::nn::AdamW`**: tch's optimizer wraps libtorch's C++ optimizer, whose moments and step
//! count the C API (`ato_*`) cannot read or write, so a resumed run would restart Adam from zero moments
//! and diverge from an uninterrupted one. This is the same algorithm (PyTorch/libtorch `AdamW`,
//! decoupled weight decay, bias correction), written with tensor operations so the state is ordinary
//! named tensors; `tests::matches_libtorch_adamw` checks it step for step against
//! `tch::COptimizer::adamw`. For step t with gradient g (Loshchilov & Hutter, arXiv 1711.05101):
//!
//! ```text
//! θ ← θ·(1 − lr·λ)
//! m ← β1·m + (1 − β1)·g          v ← β2·v + (1 − β2)·g²
//! θ ← θ − (lr / (1 − β1^t)) · m / (√v / √(1 − β2^t) + ε)
//! ```
//!
//! Tensors without a gradient in a step are left untouched (as libtorch does).

use std::path::Path;

use tch::nn::VarStore;
use tch::{Kind, Tensor};

use crate::{Error, Result};

/// AdamW hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate.
    pub lr: f64,
    /// β1.
    pub beta1: f64,
    /// β2.
    pub beta2: f64,
    /// ε.
    pub eps: f64,
    /// Decoupled weight decay λ.
    pub weight_decay: f64,
}

struct ParamState {
    name: String,
    param: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
}

/// AdamW over the trainable tensors of a [`VarStore`] (those with `requires_grad`), ordered by name.
pub struct AdamW {
    cfg: AdamWConfig,
    step: i64,
    params: Vec<ParamState>,
}

impl std::fmt::Debug for AdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdamW").field("cfg", &self.cfg).field("step", &self.step).field("tensors", &self.params.len()).finish()
    }
}

/// The trainable tensors of `vs` (`requires_grad`), sorted by name. They share storage with the store.
pub fn trainable_named(vs: &VarStore) -> Vec<(String, Tensor)> {
    let mut v: Vec<(String, Tensor)> = vs.variables().into_iter().filter(|(_, t)| t.requires_grad()).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Name of a first-moment tensor in the optimizer state file.
const EXP_AVG: &str = "exp_avg/";
/// Name of a second-moment tensor in the optimizer state file.
const EXP_AVG_SQ: &str = "exp_avg_sq/";

impl AdamW {
    /// An optimizer over `vs`'s trainable tensors, with zero moments and step 0.
    ///
    /// # Errors
    /// [`Error::Config`] when `vs` has no trainable tensor; [`Error::Torch`] on a tensor failure.
    pub fn new(vs: &VarStore, cfg: AdamWConfig) -> Result<AdamW> {
        let named = trainable_named(vs);
        if named.is_empty() {
            return Err(crate::config_err!("the policy has no trainable tensor (all {} are frozen)", vs.len()));
        }
        let _guard = tch::no_grad_guard();
        let params = named
            .into_iter()
            .map(|(name, param)| {
                Ok(ParamState { exp_avg: param.f_zeros_like()?, exp_avg_sq: param.f_zeros_like()?, name, param })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(AdamW { cfg, step: 0, params })
    }

    /// Steps taken so far.
    pub fn steps(&self) -> i64 {
        self.step
    }

    /// The hyper-parameters.
    pub fn config(&self) -> AdamWConfig {
        self.cfg
    }

    /// Names of the optimized tensors, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.params.iter().map(|p| p.name.as_str()).collect()
    }

    /// Sets every trainable tensor's gradient to zero.
    ///
    /// # Errors
    /// [`Error::Torch`] on a tensor failure.
    pub fn zero_grad(&mut self) -> Result<()> {
        for p in &self.params {
            let mut g = p.param.f_grad()?;
            if g.defined() {
                let _ = g.f_detach_()?.f_zero_()?;
            }
        }
        Ok(())
    }

    /// Global L2 norm of all gradients, `√(Σ_p ‖g_p‖²)` (0 when no tensor has a gradient).
    ///
    /// # Errors
    /// [`Error::Torch`] on a tensor failure.
    pub fn grad_norm(&self) -> Result<f64> {
        let _guard = tch::no_grad_guard();
        let mut sq = Vec::new();
        for p in &self.params {
            let g = p.param.f_grad()?;
            if g.defined() {
                sq.push(g.f_to_kind(Kind::Double)?.f_square()?.f_sum(Kind::Double)?.f_to_device(tch::Device::Cpu)?);
            }
        }
        if sq.is_empty() {
            return Ok(0.0);
        }
        Ok(Tensor::f_stack(&sq, 0)?.f_sum(Kind::Double)?.f_double_value(&[])?.sqrt())
    }

    /// Scales all gradients by `max_norm / (norm + 1e−6)` when their global norm exceeds `max_norm`
    /// (PyTorch's `clip_grad_norm_`); returns the norm before clipping. `max_norm = 0` only measures.
    ///
    /// # Errors
    /// [`Error::Torch`] on a tensor failure.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64> {
        let norm = self.grad_norm()?;
        if max_norm > 0.0 && norm.is_finite() {
            let coef = max_norm / (norm + 1e-6);
            if coef < 1.0 {
                let _guard = tch::no_grad_guard();
                for p in &self.params {
                    let mut g = p.param.f_grad()?;
                    if g.defined() {
                        let _ = g.f_mul_scalar_(coef)?;
                    }
                }
            }
        }
        Ok(norm)
    }

    /// One AdamW update of every tensor that has a gradient (module docs).
    ///
    /// # Errors
    /// [`Error::Torch`] on a tensor failure.
    pub fn step(&mut self) -> Result<()> {
        let _guard = tch::no_grad_guard();
        self.step += 1;
        let AdamWConfig { lr, beta1, beta2, eps, weight_decay } = self.cfg;
        let t = self.step as f64;
        let bc1 = 1.0 - beta1.powf(t);
        let bc2 = 1.0 - beta2.powf(t);
        let step_size = lr / bc1;
        for p in &mut self.params {
            let g = p.param.f_grad()?;
            if !g.defined() {
                continue;
            }
            let _ = p.param.f_mul_scalar_(1.0 - lr * weight_decay)?;
            let _ = p.exp_avg.f_mul_scalar_(beta1)?.f_add_(&g.f_mul_scalar(1.0 - beta1)?)?;
            let _ = p.exp_avg_sq.f_mul_scalar_(beta2)?.f_add_(&g.f_square()?.f_mul_scalar(1.0 - beta2)?)?;
            let denom = p.exp_avg_sq.f_sqrt()?.f_div_scalar(bc2.sqrt())?.f_add_scalar(eps)?;
            let _ = p.param.f_sub_(&p.exp_avg.f_div(&denom)?.f_mul_scalar(step_size)?)?;
        }
        Ok(())
    }

    /// Writes the moments to a safetensors file (`exp_avg/<name>`, `exp_avg_sq/<name>`). The step count
    /// and hyper-parameters go in the checkpoint manifest.
    ///
    /// # Errors
    /// [`Error::Torch`] when the file cannot be written.
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut named: Vec<(String, Tensor)> = Vec::with_capacity(2 * self.params.len());
        for p in &self.params {
            named.push((format!("{EXP_AVG}{}", p.name), p.exp_avg.f_to_device(tch::Device::Cpu)?));
            named.push((format!("{EXP_AVG_SQ}{}", p.name), p.exp_avg_sq.f_to_device(tch::Device::Cpu)?));
        }
        Tensor::write_safetensors(&named, path)?;
        Ok(())
    }

    /// Restores the moments from a file written by [`AdamW::save`] and sets the step count.
    ///
    /// # Errors
    /// [`Error::Model`] when the file lacks a tensor, has an extra one or a shape differs;
    /// [`Error::Torch`] when it cannot be read.
    pub fn load(&mut self, path: &Path, step: i64) -> Result<()> {
        let mut tensors: std::collections::HashMap<String, Tensor> = Tensor::read_safetensors(path)?.into_iter().collect();
        let _guard = tch::no_grad_guard();
        for p in &mut self.params {
            for (prefix, dst) in [(EXP_AVG, &mut p.exp_avg), (EXP_AVG_SQ, &mut p.exp_avg_sq)] {
                let key = format!("{prefix}{}", p.name);
                let src = tensors.remove(&key).ok_or_else(|| Error::Model(format!("{}: no optimizer tensor {key}", path.display())))?;
                if src.size() != dst.size() {
                    return Err(Error::Model(format!("{}: {key} has shape {:?}, the parameter {:?}", path.display(), src.size(), dst.size())));
                }
                dst.f_copy_(&src)?;
            }
        }
        if let Some(extra) = tensors.keys().next() {
            return Err(Error::Model(format!("{}: optimizer tensor {extra} matches no trainable tensor", path.display())));
        }
        self.step = step;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use tch::nn::{self, Module};
    use tch::{Device, Kind, Tensor};

    use super::*;

    fn tiny(seed: i64) -> (VarStore, nn::Linear) {
        tch::manual_seed(seed);
        let vs = VarStore::new(Device::Cpu);
        let lin = nn::linear(vs.root() / "lin", 3, 2, Default::default());
        (vs, lin)
    }

    fn loss(lin: &nn::Linear) -> Tensor {
        let x = Tensor::from_slice(&[0.5f32, -1.0, 2.0, 1.5, 0.25, -0.75]).view([2, 3]);
        lin.forward(&x).square().sum(Kind::Float)
    }

    #[test]
    fn matches_libtorch_adamw() {
        let cfg = AdamWConfig { lr: 0.01, beta1: 0.9, beta2: 0.98, eps: 1e-8, weight_decay: 0.1 };
        let (vs_a, lin_a) = tiny(7);
        // Copied rather than re-seeded: other tests draw from libtorch's global generator in parallel.
        let (mut vs_b, lin_b) = tiny(8);
        vs_b.copy(&vs_a).unwrap();
        let mut ours = AdamW::new(&vs_a, cfg).unwrap();
        let mut theirs = tch::COptimizer::adamw(cfg.lr, cfg.beta1, cfg.beta2, cfg.weight_decay, cfg.eps, false).unwrap();
        for (_, t) in trainable_named(&vs_b) {
            theirs.add_parameters(&t, 0).unwrap();
        }

        for _ in 0..10 {
            ours.zero_grad().unwrap();
            loss(&lin_a).backward();
            ours.step().unwrap();
            theirs.zero_grad().unwrap();
            loss(&lin_b).backward();
            theirs.step().unwrap();
        }
        for ((na, a), (nb, b)) in trainable_named(&vs_a).iter().zip(trainable_named(&vs_b).iter()) {
            assert_eq!(na, nb);
            let diff = (a - b).abs().max().double_value(&[]);
            assert!(diff < 1e-6, "{na}: max |ours − libtorch| = {diff}");
        }
        assert_eq!(ours.steps(), 10);
    }

    #[test]
    fn first_step_moves_each_weight_by_lr() {
        // Step 1 with no weight decay: m̂ = g, v̂ = g², update = lr·g/(|g| + ε) ≈ lr·sign(g).
        let (vs, lin) = tiny(1);
        let before: Vec<f32> = Vec::<f32>::try_from(&lin.ws.flatten(0, -1)).unwrap();
        let mut opt = AdamW::new(&vs, AdamWConfig { lr: 0.1, beta1: 0.9, beta2: 0.98, eps: 1e-8, weight_decay: 0.0 }).unwrap();
        loss(&lin).backward();
        let g: Vec<f32> = Vec::<f32>::try_from(&lin.ws.grad().flatten(0, -1)).unwrap();
        opt.step().unwrap();
        let after: Vec<f32> = Vec::<f32>::try_from(&lin.ws.flatten(0, -1)).unwrap();
        for ((b, a), g) in before.iter().zip(&after).zip(&g) {
            assert!((b - a - 0.1 * g.signum()).abs() < 1e-5, "{b} → {a} with gradient {g}");
        }
    }

    #[test]
    fn clip_grad_norm_scales_to_the_limit() {
        let (vs, lin) = tiny(3);
        let mut opt = AdamW::new(&vs, AdamWConfig { lr: 0.1, beta1: 0.9, beta2: 0.98, eps: 1e-8, weight_decay: 0.0 }).unwrap();
        loss(&lin).backward();
        // Norm by hand over weight and bias gradients.
        let hand = (lin.ws.grad().square().sum(Kind::Double).double_value(&[])
            + lin.bs.as_ref().unwrap().grad().square().sum(Kind::Double).double_value(&[]))
        .sqrt();
        let norm = opt.clip_grad_norm(0.5).unwrap();
        assert!((norm - hand).abs() < 1e-6 * hand.max(1.0), "{norm} vs {hand}");
        assert!(hand > 0.5);
        assert!((opt.grad_norm().unwrap() - 0.5).abs() < 1e-5);
        opt.zero_grad().unwrap();
        assert_eq!(opt.grad_norm().unwrap(), 0.0);
    }

    #[test]
    fn state_round_trips_through_a_file() {
        let cfg = AdamWConfig { lr: 0.01, beta1: 0.9, beta2: 0.98, eps: 1e-8, weight_decay: 0.1 };
        let (vs, lin) = tiny(5);
        let mut opt = AdamW::new(&vs, cfg).unwrap();
        for _ in 0..3 {
            opt.zero_grad().unwrap();
            loss(&lin).backward();
            opt.step().unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("optimizer.safetensors");
        opt.save(&path).unwrap();
        let (vs2, _lin2) = tiny(6);
        let mut opt2 = AdamW::new(&vs2, cfg).unwrap();
        opt2.load(&path, opt.steps()).unwrap();
        assert_eq!(opt2.steps(), 3);
        for (a, b) in opt.params.iter().zip(&opt2.params) {
            assert_eq!(a.name, b.name);
            assert!(a.exp_avg.equal(&b.exp_avg) && a.exp_avg_sq.equal(&b.exp_avg_sq));
        }
        // A store with other tensors does not load it.
        let vs3 = VarStore::new(Device::Cpu);
        let _other = nn::linear(vs3.root() / "other", 3, 2, Default::default());
        let mut opt3 = AdamW::new(&vs3, cfg).unwrap();
        assert!(opt3.load(&path, 3).unwrap_err().to_string().contains("no optimizer tensor"));
    }
}
