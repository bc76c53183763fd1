//! Reading GGUF files (llama.cpp's model format, versions 2 and 3) and dequantising their tensors.
//!
//! Layout (little-endian), from the GGUF specification in the ggml repository (`docs/gguf.md`):
//!
//! ```text
//! "GGUF" u32 version  u64 tensor_count  u64 metadata_kv_count
//! metadata_kv_count × (string key, u32 value_type, value)
//! tensor_count      × (string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset)
//! padding to `general.alignment` (default 32), then the tensor data; offsets are relative to it
//! ```
//!
//! A string is a u64 length and that many UTF-8 bytes; an array is a u32 element type, a u64 count and
//! the elements. Tensor `dims` are listed fastest-varying first (`ne[0]` is the row length), so a
//! PyTorch/HF weight of shape `[out, in]` has GGUF dims `[in, out]`: the HF shape is the reversed list.
//!
//! Block formats decoded here (ggml `ggml-quants.c`, `dequantize_row_*`): F32, F16, BF16, Q4_0, Q4_1,
//! Q5_0, Q5_1, Q8_0 (32 weights per block) and Q4_K, Q5_K, Q6_K (256 weights per super-block).
//!
//! This module reads the file (header, metadata, tensor-info table, tensor bytes); `quant` holds the
//! element types and their dequantisation.

use std::collections::BTreeMap;
use std::path::Path;

mod quant;

use crate::{Error, Result};
use quant::gguf_err;
pub use quant::{dequantize, GgmlType};

/// Default alignment of the tensor data section when `general.alignment` is absent (bytes).
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// A metadata value of any GGUF value type.
#[derive(Debug, Clone, PartialEq)]
pub enum MetadataValue {
    /// Type 0.
    U8(u8),
    /// Type 1.
    I8(i8),
    /// Type 2.
    U16(u16),
    /// Type 3.
    I16(i16),
    /// Type 4.
    U32(u32),
    /// Type 5.
    I32(i32),
    /// Type 6.
    F32(f32),
    /// Type 7 (one byte, 0 or 1).
    Bool(bool),
    /// Type 8.
    String(String),
    /// Type 9: homogeneous array (nested arrays allowed).
    Array(Vec<MetadataValue>),
    /// Type 10.
    U64(u64),
    /// Type 11.
    I64(i64),
    /// Type 12.
    F64(f64),
}

impl MetadataValue {
    /// The value as an unsigned integer, when it is a non-negative integer of any width (or a bool).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetadataValue::U8(v) => Some(v as u64),
            MetadataValue::U16(v) => Some(v as u64),
            MetadataValue::U32(v) => Some(v as u64),
            MetadataValue::U64(v) => Some(v),
            MetadataValue::I8(v) => u64::try_from(v).ok(),
            MetadataValue::I16(v) => u64::try_from(v).ok(),
            MetadataValue::I32(v) => u64::try_from(v).ok(),
            MetadataValue::I64(v) => u64::try_from(v).ok(),
            MetadataValue::Bool(b) => Some(b as u64),
            _ => None,
        }
    }
    /// The value as a signed integer, when it is an integer that fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetadataValue::I8(v) => Some(v as i64),
            MetadataValue::I16(v) => Some(v as i64),
            MetadataValue::I32(v) => Some(v as i64),
            MetadataValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }
    /// The value as a float, when it is a float or an integer.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetadataValue::F32(v) => Some(v as f64),
            MetadataValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }
    /// The value as a string slice, when it is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetadataValue::String(s) => Some(s),
            _ => None,
        }
    }
    /// The value as a bool, when it is a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetadataValue::Bool(b) => Some(b),
            _ => None,
        }
    }
    /// The elements, when it is an array.
    pub fn as_array(&self) -> Option<&[MetadataValue]> {
        match self {
            MetadataValue::Array(v) => Some(v),
            _ => None,
        }
    }
}
/// One entry of the tensor-info table.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// Tensor name (`blk.0.attn_q.weight`, ...).
    pub name: String,
    /// Dimensions in GGUF order (fastest-varying first).
    pub dims: Vec<u64>,
    /// Element type.
    pub ggml_type: GgmlType,
    /// Byte offset of the data relative to the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
    /// The shape in row-major (PyTorch/HF) order: the GGUF dims reversed.
    pub fn torch_shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// A parsed GGUF file (memory-mapped; tensor data is decoded on request).
pub struct GgufFile {
    /// Format version (2 or 3).
    pub version: u32,
    /// All metadata key/values, sorted by key.
    pub metadata: BTreeMap<String, MetadataValue>,
    /// The tensor-info table, in file order.
    pub tensors: Vec<TensorInfo>,
    /// Alignment of the data section (bytes).
    pub alignment: u64,
    /// Absolute file offset of the data section.
    pub data_offset: u64,
    bytes: memmap2::Mmap,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .finish()
    }
}

/// Bounds-checked little-endian reader over a byte slice.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or_else(|| {
            gguf_err(format!("truncated: need {n} bytes at offset {}, file has {}", self.pos, self.buf.len()))
        })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self) -> Result<[u8; N]> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.arr::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.arr()?))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.arr()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.arr()?))
    }
    fn len(&mut self) -> Result<usize> {
        let n = self.u64()?;
        // A count can never exceed the bytes left (every element takes at least one byte).
        if n > (self.buf.len() - self.pos) as u64 {
            return Err(gguf_err(format!("count {n} at offset {} exceeds the file size {}", self.pos, self.buf.len())));
        }
        Ok(n as usize)
    }
    fn string(&mut self) -> Result<String> {
        let n = self.len()?;
        let at = self.pos;
        let s = self.take(n)?;
        String::from_utf8(s.to_vec()).map_err(|e| gguf_err(format!("invalid UTF-8 string at offset {at}: {e}")))
    }
    fn value(&mut self, ty: u32, depth: usize) -> Result<MetadataValue> {
        Ok(match ty {
            0 => MetadataValue::U8(self.u8()?),
            1 => MetadataValue::I8(self.u8()? as i8),
            2 => MetadataValue::U16(self.u16()?),
            3 => MetadataValue::I16(self.u16()? as i16),
            4 => MetadataValue::U32(self.u32()?),
            5 => MetadataValue::I32(self.u32()? as i32),
            6 => MetadataValue::F32(f32::from_le_bytes(self.arr()?)),
            7 => MetadataValue::Bool(self.u8()? != 0),
            8 => MetadataValue::String(self.string()?),
            9 => {
                if depth > 8 {
                    return Err(gguf_err(format!("arrays nested deeper than 8 at offset {}", self.pos)));
                }
                let elem = self.u32()?;
                let n = self.len()?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(elem, depth + 1)?);
                }
                MetadataValue::Array(v)
            }
            10 => MetadataValue::U64(self.u64()?),
            11 => MetadataValue::I64(self.u64()? as i64),
            12 => MetadataValue::F64(f64::from_le_bytes(self.arr()?)),
            other => return Err(gguf_err(format!("unknown metadata value type {other} at offset {}", self.pos))),
        })
    }
}

impl GgufFile {
    /// Opens and parses a GGUF file (header, metadata, tensor infos); the data stays mapped.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be opened or mapped; [`Error::Model`] when it is not GGUF
    /// v2/v3, is big-endian, is truncated, or a tensor's data lies outside the file.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let file = std::fs::File::open(path).map_err(|e| Error::io("open", path, e))?;
        // SAFETY: the file is opened read-only and we never write through the map; a concurrent
        // truncation by another process is the documented risk of memmap2 and not expected for a model.
        let bytes = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io("mmap", path, e))?;
        Self::parse(bytes)
    }

    fn parse(bytes: memmap2::Mmap) -> Result<GgufFile> {
        let mut r = Reader { buf: &bytes[..], pos: 0 };
        if r.take(4)? != b"GGUF" {
            return Err(gguf_err("not a GGUF file (magic is not \"GGUF\")"));
        }
        let version = r.u32()?;
        if version.swap_bytes() == 2 || version.swap_bytes() == 3 {
            return Err(gguf_err(format!("big-endian GGUF (version {}) is not supported", version.swap_bytes())));
        }
        if !(2..=3).contains(&version) {
            return Err(gguf_err(format!("unsupported GGUF version {version} (2 and 3 are supported)")));
        }
        let n_tensors = r.len()?;
        let n_kv = r.len()?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = r.string()?;
            let ty = r.u32()?;
            let v = r.value(ty, 0)?;
            metadata.insert(key, v);
        }
        let mut tensors = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = r.string()?;
            let n_dims = r.u32()? as usize;
            if n_dims > 8 {
                return Err(gguf_err(format!("tensor {name}: {n_dims} dimensions (at most 8)")));
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(r.u64()?);
            }
            let ggml_type = GgmlType::from_id(r.u32()?);
            let offset = r.u64()?;
            tensors.push(TensorInfo { name, dims, ggml_type, offset });
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => v.as_u64().filter(|&a| a > 0 && a.is_power_of_two()).ok_or_else(|| gguf_err(format!("invalid general.alignment {v:?}")))?,
        };
        let pos = r.pos as u64;
        let data_offset = pos.div_ceil(alignment) * alignment;
        let file = GgufFile { version, metadata, tensors, alignment, data_offset, bytes };
        for t in &file.tensors {
            file.tensor_bytes(t)?;
        }
        Ok(file)
    }

    /// A metadata value by key.
    pub fn get(&self, key: &str) -> Option<&MetadataValue> {
        self.metadata.get(key)
    }

    /// A required string metadata value.
    ///
    /// # Errors
    /// [`Error::Model`] when absent or not a string.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.get(key).and_then(|v| v.as_str()).ok_or_else(|| gguf_err(format!("missing string metadata {key}")))
    }

    /// A required unsigned integer metadata value.
    ///
    /// # Errors
    /// [`Error::Model`] when absent or not a non-negative integer.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.get(key).and_then(|v| v.as_u64()).ok_or_else(|| gguf_err(format!("missing integer metadata {key}")))
    }

    /// A required float metadata value.
    ///
    /// # Errors
    /// [`Error::Model`] when absent or not a number.
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        self.get(key).and_then(|v| v.as_f64()).ok_or_else(|| gguf_err(format!("missing float metadata {key}")))
    }

    /// The tensor info with this name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw bytes of a tensor's data.
    ///
    /// # Errors
    /// [`Error::Model`] when its type cannot be decoded, its element count is not a whole number of
    /// blocks, or its data lies outside the file.
    pub fn tensor_bytes(&self, t: &TensorInfo) -> Result<&[u8]> {
        let (per_block, block_bytes) =
            t.ggml_type.block_layout().ok_or_else(|| gguf_err(format!("tensor {}: unsupported ggml type {:?}", t.name, t.ggml_type)))?;
        let n = t.n_elements();
        if !n.is_multiple_of(per_block as u64) {
            return Err(gguf_err(format!("tensor {}: {n} elements is not a multiple of the block size {per_block}", t.name)));
        }
        let len = n / per_block as u64 * block_bytes as u64;
        let start = self.data_offset.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(len));
        match (start, end) {
            (Some(s), Some(e)) if e <= self.bytes.len() as u64 => Ok(&self.bytes[s as usize..e as usize]),
            _ => Err(gguf_err(format!(
                "tensor {}: data [{} + {}, {len} bytes] lies outside the file ({} bytes)",
                t.name,
                self.data_offset,
                t.offset,
                self.bytes.len()
            ))),
        }
    }

    /// Decodes a tensor to f32 in row-major order of [`TensorInfo::torch_shape`].
    ///
    /// # Errors
    /// As [`GgufFile::tensor_bytes`].
    pub fn tensor_f32(&self, t: &TensorInfo) -> Result<Vec<f32>> {
        dequantize(t.ggml_type, self.tensor_bytes(t)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    /// Builds a tiny GGUF v3 file in memory: every metadata value type, one Q8_0 and one F32 tensor.
    pub(crate) fn tiny_gguf() -> Vec<u8> {
        fn s(out: &mut Vec<u8>, x: &str) {
            out.extend_from_slice(&(x.len() as u64).to_le_bytes());
            out.extend_from_slice(x.as_bytes());
        }
        let mut f = Vec::new();
        f.extend_from_slice(b"GGUF");
        f.extend_from_slice(&3u32.to_le_bytes());
        f.extend_from_slice(&2u64.to_le_bytes()); // tensors
        f.extend_from_slice(&6u64.to_le_bytes()); // kv
        s(&mut f, "general.architecture");
        f.extend_from_slice(&8u32.to_le_bytes());
        s(&mut f, "llama");
        s(&mut f, "a.u8");
        f.extend_from_slice(&0u32.to_le_bytes());
        f.push(7);
        s(&mut f, "a.i32");
        f.extend_from_slice(&5u32.to_le_bytes());
        f.extend_from_slice(&(-3i32).to_le_bytes());
        s(&mut f, "a.f32");
        f.extend_from_slice(&6u32.to_le_bytes());
        f.extend_from_slice(&1.5f32.to_le_bytes());
        s(&mut f, "a.bool");
        f.extend_from_slice(&7u32.to_le_bytes());
        f.push(1);
        s(&mut f, "a.arr");
        f.extend_from_slice(&9u32.to_le_bytes());
        f.extend_from_slice(&8u32.to_le_bytes());
        f.extend_from_slice(&2u64.to_le_bytes());
        s(&mut f, "x");
        s(&mut f, "yz");
        // tensor infos
        s(&mut f, "q");
        f.extend_from_slice(&2u32.to_le_bytes());
        f.extend_from_slice(&32u64.to_le_bytes());
        f.extend_from_slice(&1u64.to_le_bytes());
        f.extend_from_slice(&8u32.to_le_bytes());
        f.extend_from_slice(&0u64.to_le_bytes());
        s(&mut f, "n");
        f.extend_from_slice(&1u32.to_le_bytes());
        f.extend_from_slice(&2u64.to_le_bytes());
        f.extend_from_slice(&0u32.to_le_bytes());
        f.extend_from_slice(&64u64.to_le_bytes());
        while f.len() % 32 != 0 {
            f.push(0);
        }
        let mut q = vec![0u8; 34];
        q[..2].copy_from_slice(&f16::from_f32(2.0).to_le_bytes());
        q[2] = 3;
        f.extend_from_slice(&q);
        f.resize(f.len() + 30, 0); // pad to offset 64
        f.extend_from_slice(&0.5f32.to_le_bytes());
        f.extend_from_slice(&(-1.0f32).to_le_bytes());
        f
    }

    #[test]
    fn parses_header_metadata_and_tensors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.gguf");
        std::fs::write(&p, tiny_gguf()).unwrap();
        let g = GgufFile::open(&p).unwrap();
        assert_eq!(g.version, 3);
        assert_eq!(g.get_str("general.architecture").unwrap(), "llama");
        assert_eq!(g.get("a.u8"), Some(&MetadataValue::U8(7)));
        assert_eq!(g.get("a.i32").and_then(|v| v.as_i64()), Some(-3));
        assert_eq!(g.get_f64("a.f32").unwrap(), 1.5);
        assert_eq!(g.get("a.bool").and_then(|v| v.as_bool()), Some(true));
        let arr = g.get("a.arr").and_then(|v| v.as_array()).unwrap();
        assert_eq!(arr.iter().filter_map(|v| v.as_str()).collect::<Vec<_>>(), vec!["x", "yz"]);
        assert_eq!(g.data_offset % 32, 0);
        let q = g.tensor("q").unwrap().clone();
        assert_eq!(q.torch_shape(), vec![1, 32]);
        let y = g.tensor_f32(&q).unwrap();
        assert_eq!((y[0], y[1]), (6.0, 0.0));
        let n = g.tensor("n").unwrap().clone();
        assert_eq!(g.tensor_f32(&n).unwrap(), vec![0.5, -1.0]);
    }

    #[test]
    fn rejects_bad_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.gguf");
        let good = tiny_gguf();
        std::fs::write(&p, &good[..good.len() - 3]).unwrap();
        let e = GgufFile::open(&p).unwrap_err().to_string();
        assert!(e.contains("tensor n"), "{e}");
        let mut bad = good.clone();
        bad[4] = 1;
        std::fs::write(&p, &bad).unwrap();
        assert!(GgufFile::open(&p).unwrap_err().to_string().contains("version 1"));
        std::fs::write(&p, b"GGML").unwrap();
        assert!(GgufFile::open(&p).is_err());
    }
}
