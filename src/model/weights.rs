//! Reading and writing safetensors checkpoints as tch tensors (single file or sharded with an index).

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use tch::{Device, Kind, Tensor};

use crate::{Error, Result};

fn st_err(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Model(format!("safetensors {}: {e}", path.display()))
}

/// The tch kind of a safetensors dtype (floating types only).
fn kind_of(dtype: safetensors::Dtype) -> Option<Kind> {
    Some(match dtype {
        safetensors::Dtype::F32 => Kind::Float,
        safetensors::Dtype::F16 => Kind::Half,
        safetensors::Dtype::BF16 => Kind::BFloat16,
        safetensors::Dtype::F64 => Kind::Double,
        _ => return None,
    })
}

/// Reads every tensor of one safetensors file onto the CPU, in the file's own dtype.
///
/// # Errors
/// [`Error::Io`] when the file cannot be opened; [`Error::Model`] when it is not valid safetensors or
/// holds a non-float tensor.
pub fn read_safetensors(path: &Path) -> Result<Vec<(String, Tensor)>> {
    let file = std::fs::File::open(path).map_err(|e| Error::io("open", path, e))?;
    // SAFETY: read-only map of a file we do not modify; see memmap2's documentation on truncation.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io("mmap", path, e))?;
    let st = safetensors::SafeTensors::deserialize(&map).map_err(|e| st_err(path, e))?;
    let mut out = Vec::with_capacity(st.len());
    for (name, view) in st.iter() {
        let kind = kind_of(view.dtype()).ok_or_else(|| st_err(path, format!("tensor {name} has unsupported dtype {:?}", view.dtype())))?;
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        let data = view.data();
        let t = Tensor::f_from_data_size(data, &shape, kind)?;
        out.push((name.to_string(), t));
        // The bytes are copied: drop their pages now so loading peaks at about one copy of the
        // weights, not two (mapped file + tensors).
        #[cfg(unix)]
        {
            let offset = data.as_ptr() as usize - map.as_ptr() as usize;
            // SAFETY: a private, read-only file mapping; MADV_DONTNEED only drops clean pages, which
            // fault back in unchanged from the file if touched again, so no Rust reference observes a
            // change.
            let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset, data.len()) };
        }
    }
    Ok(out)
}

/// The safetensors files of a checkpoint directory: `model.safetensors`, else the files named by
/// `model.safetensors.index.json`'s `weight_map`.
///
/// # Errors
/// [`Error::Model`] when the directory has neither; [`Error::Json`] for a malformed index.
pub fn checkpoint_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let s = std::fs::read_to_string(&index).map_err(|e| Error::io("read", &index, e))?;
        let v: serde_json::Value = serde_json::from_str(&s)?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::Model(format!("{}: no weight_map object", index.display())))?;
        let files: BTreeSet<&str> = map.values().filter_map(|f| f.as_str()).collect();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    Err(Error::Model(format!("{}: no model.safetensors or model.safetensors.index.json", dir.display())))
}

/// Reads all weights of a checkpoint directory onto the CPU (see [`checkpoint_files`]).
///
/// # Errors
/// As [`checkpoint_files`] and [`read_safetensors`].
pub fn read_checkpoint(dir: &Path) -> Result<HashMap<String, Tensor>> {
    let mut all = HashMap::new();
    for f in checkpoint_files(dir)? {
        for (name, t) in read_safetensors(&f)? {
            all.insert(name, t);
        }
    }
    Ok(all)
}

/// Frozen weights shared by every model of this process loaded from the same files with the same
/// kind and device (see [`read_checkpoint_shared`]). Models hold an `Arc` of it; the tensors are freed
/// when the last such model is dropped. `Tensor` is `Send` but not `Sync`, hence the mutex.
pub struct SharedWeights {
    tensors: std::sync::Mutex<HashMap<String, Tensor>>,
}

impl std::fmt::Debug for SharedWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedWeights").finish_non_exhaustive()
    }
}

/// The files of a checkpoint (path, length, modification time), its kind and device: two loads share
/// weights only when all of these are equal, so a re-imported model is read afresh.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct SharedKey {
    files: Vec<(PathBuf, u64, Option<std::time::SystemTime>)>,
    kind: Kind,
    device: Device,
}

type SharedMap = HashMap<SharedKey, std::sync::Weak<SharedWeights>>;

fn shared_map() -> &'static std::sync::Mutex<SharedMap> {
    static MAP: std::sync::OnceLock<std::sync::Mutex<SharedMap>> = std::sync::OnceLock::new();
    MAP.get_or_init(Default::default)
}

/// Reads a checkpoint directory's weights as [`read_checkpoint`] does, converted to `kind` on
/// `device`, **shared** with every other model of this process that read the same files with the same
/// kind and device and is still alive: the returned tensors alias the shared storage (no copy), and the
/// `Arc` keeps it alive. For frozen weights only — a caller must never write into these tensors (the
/// LoRA trainer trains adapters beside them; [`super::Transformer::merge_lora`] replaces a weight
/// rather than writing into it). Loads of the same files are serialised, so concurrent loaders read
/// the files once.
///
/// # Errors
/// As [`read_checkpoint`]; [`Error::Io`] when a file's metadata cannot be read; [`Error::Torch`] on a
/// kind or device conversion failure.
pub fn read_checkpoint_shared(dir: &Path, kind: Kind, device: Device) -> Result<(HashMap<String, Tensor>, std::sync::Arc<SharedWeights>)> {
    let mut files = Vec::new();
    for f in checkpoint_files(dir)? {
        let meta = std::fs::metadata(&f).map_err(|e| Error::io("stat", &f, e))?;
        let path = std::fs::canonicalize(&f).unwrap_or(f);
        files.push((path, meta.len(), meta.modified().ok()));
    }
    let key = SharedKey { files, kind, device };
    let mut map = shared_map().lock().unwrap_or_else(|p| p.into_inner());
    map.retain(|_, w| w.strong_count() > 0);
    let shared = match map.get(&key).and_then(std::sync::Weak::upgrade) {
        Some(s) => s,
        None => {
            let _guard = tch::no_grad_guard();
            let mut tensors = HashMap::new();
            for (name, t) in read_checkpoint(dir)? {
                tensors.insert(name, t.f_to_kind(kind)?.f_to_device(device)?);
            }
            let s = std::sync::Arc::new(SharedWeights { tensors: std::sync::Mutex::new(tensors) });
            map.insert(key, std::sync::Arc::downgrade(&s));
            s
        }
    };
    drop(map);
    let aliases = shared.tensors.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
    Ok((aliases, shared))
}

/// A CPU copy of a tensor, ready to be written.
struct HostTensor {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl safetensors::View for &HostTensor {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

fn host_tensor(name: &str, t: &Tensor) -> Result<HostTensor> {
    let dtype = match t.kind() {
        Kind::Float => safetensors::Dtype::F32,
        Kind::Half => safetensors::Dtype::F16,
        Kind::BFloat16 => safetensors::Dtype::BF16,
        Kind::Double => safetensors::Dtype::F64,
        k => return Err(Error::Model(format!("cannot save tensor {name} of kind {k:?}"))),
    };
    let cpu = t.f_detach()?.f_to_device(Device::Cpu)?.f_contiguous()?;
    let numel = cpu.numel();
    let mut bytes = vec![0u8; numel * cpu.kind().elt_size_in_bytes()];
    cpu.f_copy_data_u8(&mut bytes, numel)?;
    Ok(HostTensor { dtype, shape: cpu.size().iter().map(|&d| d as usize).collect(), bytes })
}

/// Writes named tensors to a safetensors file atomically (temp file in the same folder, then
/// rename), with `{"format": "pt"}` metadata as HF writes it.
///
/// # Errors
/// [`Error::Model`] for a non-float tensor or a writer failure; [`Error::Io`] for the rename.
pub fn write_safetensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    let host: Vec<(String, HostTensor)> = tensors.iter().map(|(n, t)| Ok((n.clone(), host_tensor(n, t)?))).collect::<Result<_>>()?;
    let tmp = path.with_extension(format!("safetensors.tmp-{}", std::process::id()));
    let mut info = HashMap::new();
    info.insert("format".to_string(), "pt".to_string());
    safetensors::serialize_to_file(host.iter().map(|(n, h)| (n.as_str(), h)), Some(info), &tmp).map_err(|e| st_err(&tmp, e))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644)).map_err(|e| Error::io("chmod", &tmp, e))?;
    }
    std::fs::rename(&tmp, path).map_err(|e| Error::io("rename", &tmp, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_and_reads_single_and_sharded_checkpoints() {
        let dir = tempfile::tempdir().unwrap();
        let a = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]).view([2, 2]);
        let b = Tensor::from_slice(&[0.5f32, -0.5]).to_kind(Kind::BFloat16);
        // Sharded: two files and an index naming them.
        write_safetensors(&dir.path().join("model-00001-of-00002.safetensors"), &[("x.weight".into(), a.shallow_clone())]).unwrap();
        write_safetensors(&dir.path().join("model-00002-of-00002.safetensors"), &[("y.bias".into(), b.shallow_clone())]).unwrap();
        let index = serde_json::json!({"metadata": {}, "weight_map": {"x.weight": "model-00001-of-00002.safetensors", "y.bias": "model-00002-of-00002.safetensors"}});
        std::fs::write(dir.path().join("model.safetensors.index.json"), index.to_string()).unwrap();
        let w = read_checkpoint(dir.path()).unwrap();
        assert_eq!(w.len(), 2);
        assert_eq!(Vec::<Vec<f32>>::try_from(&w["x.weight"]).unwrap(), vec![vec![1.0, 2.0], vec![3.0, 4.0]]);
        assert_eq!(w["y.bias"].kind(), Kind::BFloat16);
        assert_eq!(Vec::<f32>::try_from(&w["y.bias"].to_kind(Kind::Float)).unwrap(), vec![0.5, -0.5]);
        // A single model.safetensors takes precedence over an index.
        write_safetensors(&dir.path().join("model.safetensors"), &[("z".into(), a)]).unwrap();
        assert_eq!(checkpoint_files(dir.path()).unwrap(), vec![dir.path().join("model.safetensors")]);
        assert!(checkpoint_files(&dir.path().join("missing")).is_err());
    }
}
