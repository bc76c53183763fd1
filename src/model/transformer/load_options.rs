//! Where and how a model is loaded: [`LoadOptions`] (device, dtype) and what is [`Trainable`].

use tch::{Device, Kind};

use crate::model::peft::LoraConfig;
use crate::{Error, Result};

/// Which parameters require gradients.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum Trainable {
    /// Inference only: nothing requires gradients.
    #[default]
    Frozen,
    /// Full fine-tuning: every weight is a trainable variable.
    Full,
    /// Base weights frozen, LoRA adapters (created at load) trainable.
    Lora(LoraConfig),
}

/// Where and how to load a model.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadOptions {
    /// Device for all weights.
    pub device: Device,
    /// Floating kind of the weights (Float, Half or BFloat16); activations follow it, norms and
    /// softmaxes are computed in f32.
    pub dtype: Kind,
    /// What is trainable.
    pub trainable: Trainable,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { device: Device::Cpu, dtype: Kind::Float, trainable: Trainable::Frozen }
    }
}

impl LoadOptions {
    /// Parses a device name: `cpu`, `cuda`, `cuda:N`, or `auto` (CUDA 0 when available, else CPU).
    ///
    /// # Errors
    /// [`Error::Config`] for anything else, or CUDA requested but not available.
    pub fn parse_device(s: &str) -> Result<Device> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "auto" => Ok(Device::cuda_if_available()),
            "cuda" | "gpu" => {
                if tch::Cuda::is_available() {
                    Ok(Device::Cuda(0))
                } else {
                    Err(Error::Config("device cuda requested but CUDA is not available".into()))
                }
            }
            other => match other.strip_prefix("cuda:").and_then(|n| n.parse::<usize>().ok()) {
                Some(n) if (n as i64) < tch::Cuda::device_count() => Ok(Device::Cuda(n)),
                Some(n) => Err(Error::Config(format!("cuda:{n} requested, {} CUDA devices available", tch::Cuda::device_count()))),
                None => Err(Error::Config(format!("unknown device {other:?} (cpu, cuda, cuda:N, auto)"))),
            },
        }
    }

    /// Parses a dtype name: `f32`/`float32`, `f16`/`float16`, `bf16`/`bfloat16`, or `auto` (f32 on
    /// CPU, bf16 on CUDA).
    ///
    /// # Errors
    /// [`Error::Config`] for anything else.
    pub fn parse_dtype(s: &str, device: Device) -> Result<Kind> {
        Ok(match s {
            "f32" | "float32" | "float" => Kind::Float,
            "f16" | "float16" | "half" => Kind::Half,
            "bf16" | "bfloat16" => Kind::BFloat16,
            "auto" => {
                if device.is_cuda() {
                    Kind::BFloat16
                } else {
                    Kind::Float
                }
            }
            other => return Err(Error::Config(format!("unknown dtype {other:?} (f32, f16, bf16, auto)"))),
        })
    }
}
