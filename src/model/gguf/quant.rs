//! The ggml tensor element types and their dequantisation to f32: the block formats of ggml
//! `ggml-quants.c` (`dequantize_row_*`): F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (32 weights per
//! block) and Q4_K, Q5_K, Q6_K (256 weights per super-block).

use half::{bf16, f16};

use crate::{Error, Result};

/// An error of the GGUF reader: [`Error::Model`] with a `gguf: ` prefix.
pub(super) fn gguf_err(msg: impl Into<String>) -> Error {
    Error::Model(format!("gguf: {}", msg.into()))
}

/// The ggml tensor element types this reader knows (numbering of ggml's `enum ggml_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    /// 0: 4-byte float.
    F32,
    /// 1: IEEE half.
    F16,
    /// 2: 32 weights: f16 d, 16 bytes of 4-bit q; w = d·(q − 8).
    Q4_0,
    /// 3: 32 weights: f16 d, f16 m, 16 bytes of 4-bit q; w = d·q + m.
    Q4_1,
    /// 6: 32 weights: f16 d, u32 high bits, 16 bytes of low nibbles; w = d·(q − 16).
    Q5_0,
    /// 7: 32 weights: f16 d, f16 m, u32 high bits, 16 bytes; w = d·q + m.
    Q5_1,
    /// 8: 32 weights: f16 d, 32 int8 q; w = d·q.
    Q8_0,
    /// 12: 256 weights: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles.
    Q4K,
    /// 13: 256 weights: like Q4_K plus 32 bytes of fifth bits.
    Q5K,
    /// 14: 256 weights: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, f16 d.
    Q6K,
    /// 30: bfloat16.
    BF16,
    /// Any other type id (not decodable here).
    Other(u32),
}

impl GgmlType {
    /// Maps a ggml type id.
    pub fn from_id(id: u32) -> GgmlType {
        match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            30 => GgmlType::BF16,
            other => GgmlType::Other(other),
        }
    }
    /// (weights per block, bytes per block); `None` for types this reader cannot decode.
    pub fn block_layout(self) -> Option<(usize, usize)> {
        Some(match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q5_0 => (32, 22),
            GgmlType::Q5_1 => (32, 24),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q4K => (256, 144),
            GgmlType::Q5K => (256, 176),
            GgmlType::Q6K => (256, 210),
            GgmlType::Other(_) => return None,
        })
    }
}
/// Decodes a whole buffer of blocks of type `ty` to f32.
///
/// # Errors
/// [`Error::Model`] when the type is not supported or `data` is not a whole number of blocks.
pub fn dequantize(ty: GgmlType, data: &[u8]) -> Result<Vec<f32>> {
    let (per_block, block_bytes) = ty.block_layout().ok_or_else(|| gguf_err(format!("unsupported ggml type {ty:?}")))?;
    if !data.len().is_multiple_of(block_bytes) {
        return Err(gguf_err(format!("{} bytes is not a whole number of {ty:?} blocks of {block_bytes} bytes", data.len())));
    }
    let mut out = vec![0f32; data.len() / block_bytes * per_block];
    for (block, y) in data.chunks_exact(block_bytes).zip(out.chunks_exact_mut(per_block)) {
        match ty {
            GgmlType::F32 => y[0] = f32::from_le_bytes([block[0], block[1], block[2], block[3]]),
            GgmlType::F16 => y[0] = f16::from_le_bytes([block[0], block[1]]).to_f32(),
            GgmlType::BF16 => y[0] = bf16::from_le_bytes([block[0], block[1]]).to_f32(),
            GgmlType::Q4_0 => dequant_q4_0(block, y),
            GgmlType::Q4_1 => dequant_q4_1(block, y),
            GgmlType::Q5_0 => dequant_q5_0(block, y),
            GgmlType::Q5_1 => dequant_q5_1(block, y),
            GgmlType::Q8_0 => dequant_q8_0(block, y),
            GgmlType::Q4K => dequant_q4_k(block, y),
            GgmlType::Q5K => dequant_q5_k(block, y),
            GgmlType::Q6K => dequant_q6_k(block, y),
            GgmlType::Other(_) => unreachable!("block_layout returned None above"),
        }
    }
    Ok(out)
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Q4_0 (18 bytes → 32 weights): `d` f16, `qs[16]`; low nibble of qs[j] is weight j, high nibble is
/// weight j+16; w = d·(q − 8).
fn dequant_q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..16 {
        let q = b[2 + j];
        y[j] = ((q & 0x0f) as i32 - 8) as f32 * d;
        y[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

/// Q4_1 (20 bytes → 32 weights): `d` f16, `m` f16, `qs[16]`; w = d·q + m.
fn dequant_q4_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    for j in 0..16 {
        let q = b[4 + j];
        y[j] = (q & 0x0f) as f32 * d + m;
        y[j + 16] = (q >> 4) as f32 * d + m;
    }
}

/// Q5_0 (22 bytes → 32 weights): `d` f16, `qh` u32 (bit j = fifth bit of weight j), `qs[16]`;
/// w = d·(q − 16).
fn dequant_q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for j in 0..16 {
        let xh0 = (((qh >> j) << 4) & 0x10) as u8;
        let xh1 = ((qh >> (j + 12)) & 0x10) as u8;
        let q = b[6 + j];
        y[j] = (((q & 0x0f) | xh0) as i32 - 16) as f32 * d;
        y[j + 16] = (((q >> 4) | xh1) as i32 - 16) as f32 * d;
    }
}

/// Q5_1 (24 bytes → 32 weights): `d` f16, `m` f16, `qh` u32, `qs[16]`; w = d·q + m.
fn dequant_q5_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for j in 0..16 {
        let xh0 = (((qh >> j) << 4) & 0x10) as u8;
        let xh1 = ((qh >> (j + 12)) & 0x10) as u8;
        let q = b[8 + j];
        y[j] = ((q & 0x0f) | xh0) as f32 * d + m;
        y[j + 16] = ((q >> 4) | xh1) as f32 * d + m;
    }
}

/// Q8_0 (34 bytes → 32 weights): `d` f16, `qs[32]` int8; w = d·q.
fn dequant_q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        y[j] = (b[2 + j] as i8) as f32 * d;
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K super-block (ggml
/// `get_scale_min_k4`).
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Q4_K (144 bytes → 256 weights): `d` f16, `dmin` f16, `scales[12]`, `qs[128]`. Eight sub-blocks of
/// 32; each pair of sub-blocks shares 32 bytes of qs (low nibbles, then high nibbles);
/// w = d·sc·q − dmin·m.
fn dequant_q4_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..144];
    for (pair, chunk) in (0..4).zip(qs.chunks_exact(32)) {
        let (sc1, m1) = scale_min_k4(2 * pair, scales);
        let (sc2, m2) = scale_min_k4(2 * pair + 1, scales);
        let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, min2) = (d * sc2 as f32, dmin * m2 as f32);
        let out = &mut y[pair * 64..pair * 64 + 64];
        for l in 0..32 {
            out[l] = d1 * (chunk[l] & 0x0f) as f32 - min1;
            out[l + 32] = d2 * (chunk[l] >> 4) as f32 - min2;
        }
    }
}

/// Q5_K (176 bytes → 256 weights): `d`, `dmin` f16, `scales[12]`, `qh[32]`, `qs[128]`; as Q4_K with a
/// fifth bit from qh (bit 2·pair for the low half, 2·pair+1 for the high half).
fn dequant_q5_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for (pair, chunk) in (0..4).zip(qs.chunks_exact(32)) {
        let (sc1, m1) = scale_min_k4(2 * pair, scales);
        let (sc2, m2) = scale_min_k4(2 * pair + 1, scales);
        let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, min2) = (d * sc2 as f32, dmin * m2 as f32);
        let (u1, u2) = (1u8 << (2 * pair), 2u8 << (2 * pair));
        let out = &mut y[pair * 64..pair * 64 + 64];
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            out[l] = d1 * ((chunk[l] & 0x0f) + h1) as f32 - min1;
            out[l + 32] = d2 * ((chunk[l] >> 4) + h2) as f32 - min2;
        }
    }
}

/// Q6_K (210 bytes → 256 weights): `ql[128]`, `qh[64]`, `scales[16]` int8, `d` f16. Two halves of
/// 128 weights; w = d·scale·(q − 32) with q = 4 low bits from ql and 2 high bits from qh.
fn dequant_q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    for half in 0..2 {
        let ql = &b[half * 64..half * 64 + 64];
        let qh = &b[128 + half * 32..128 + half * 32 + 32];
        let sc = &b[192 + half * 8..192 + half * 8 + 8];
        let out = &mut y[half * 128..half * 128 + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            out[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            out[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            out[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            out[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    #[test]
    fn q4_0_block() {
        // d = 0.5; qs[0] = 0x9F → weight 0 = (15−8)·0.5 = 3.5, weight 16 = (9−8)·0.5 = 0.5;
        // qs[1] = 0x08 → weight 1 = 0, weight 17 = (0−8)·0.5 = −4; all other nibbles 0 → −4.
        let mut b = vec![0u8; 18];
        b[..2].copy_from_slice(&h(0.5));
        b[2] = 0x9f;
        b[3] = 0x08;
        let y = dequantize(GgmlType::Q4_0, &b).unwrap();
        assert_eq!(y.len(), 32);
        assert_eq!((y[0], y[16], y[1], y[17], y[2], y[31]), (3.5, 0.5, 0.0, -4.0, -4.0, -4.0));
    }

    #[test]
    fn q4_1_block() {
        // d = 0.25, m = −1; qs[3] = 0xA5 → weight 3 = 5·0.25 − 1 = 0.25, weight 19 = 10·0.25 − 1 = 1.5.
        let mut b = vec![0u8; 20];
        b[..2].copy_from_slice(&h(0.25));
        b[2..4].copy_from_slice(&h(-1.0));
        b[4 + 3] = 0xa5;
        let y = dequantize(GgmlType::Q4_1, &b).unwrap();
        assert_eq!((y[3], y[19], y[0], y[31]), (0.25, 1.5, -1.0, -1.0));
    }

    #[test]
    fn q5_0_block() {
        // d = 2; qh bit 0 set (weight 0 gets +16), bit 17 set (weight 17 gets +16);
        // qs[0] = 0x31 → weight 0 = (1|16) − 16 = 1 → 2.0, weight 16 = 3 − 16 = −13 → −26;
        // qs[1] = 0x02 → weight 1 = 2 − 16 → −28, weight 17 = (0|16) − 16 = 0 → 0.
        let mut b = vec![0u8; 22];
        b[..2].copy_from_slice(&h(2.0));
        b[2..6].copy_from_slice(&((1u32 << 0) | (1u32 << 17)).to_le_bytes());
        b[6] = 0x31;
        b[7] = 0x02;
        let y = dequantize(GgmlType::Q5_0, &b).unwrap();
        assert_eq!((y[0], y[16], y[1], y[17], y[31]), (2.0, -26.0, -28.0, 0.0, -32.0));
    }

    #[test]
    fn q5_1_block() {
        // d = 1, m = 0.5; qh bit 31 → weight 31 high bit; qs[15] = 0xF0 → weight 31 = (15|16) = 31
        // → 31.5, weight 15 = 0 → 0.5.
        let mut b = vec![0u8; 24];
        b[..2].copy_from_slice(&h(1.0));
        b[2..4].copy_from_slice(&h(0.5));
        b[4..8].copy_from_slice(&(1u32 << 31).to_le_bytes());
        b[8 + 15] = 0xf0;
        let y = dequantize(GgmlType::Q5_1, &b).unwrap();
        assert_eq!((y[31], y[15], y[0]), (31.5, 0.5, 0.5));
    }

    #[test]
    fn q8_0_block() {
        // d = 0.125; q = [−128, 127, −1, 0, ...] → [−16, 15.875, −0.125, 0].
        let mut b = vec![0u8; 34];
        b[..2].copy_from_slice(&h(0.125));
        b[2] = (-128i8) as u8;
        b[3] = 127;
        b[4] = (-1i8) as u8;
        let y = dequantize(GgmlType::Q8_0, &b).unwrap();
        assert_eq!(&y[..4], &[-16.0, 15.875, -0.125, 0.0]);
    }

    #[test]
    fn q4_k_block() {
        // d = 1, dmin = 0.5. Sub-block 0: scale 3, min 2 (scales[0] = 3, scales[4] = 2).
        // Sub-block 5 (j ≥ 4): scale = (scales[9] & 0xF) | ((scales[1] >> 6) << 4),
        //   min = (scales[9] >> 4) | ((scales[5] >> 6) << 4). Set scales[9] = 0x21, scales[1] = 0x40
        //   (its low 6 bits, scale of sub-block 1, are 0), scales[5] = 0xC0 → scale = 1 | 16 = 17,
        //   min = 2 | 48 = 50.
        // qs[0] = 0x07 → weight 0 (sub-block 0, low nibble 7) = 1·3·7 − 0.5·2 = 20;
        //   weight 32 (sub-block 1: scale 0, min = scales[5] & 63 = 0) = 0.
        // Sub-block 5 is the high nibbles of qs[64..96]: qs[64] = 0x40 → weight 160 = 17·4 − 0.5·50 = 43.
        let mut b = vec![0u8; 144];
        b[..2].copy_from_slice(&h(1.0));
        b[2..4].copy_from_slice(&h(0.5));
        let s = 4;
        b[s] = 3;
        b[s + 4] = 2;
        b[s + 9] = 0x21;
        b[s + 1] = 0x40;
        b[s + 5] = 0xc0;
        b[16] = 0x07;
        b[16 + 64] = 0x40;
        let y = dequantize(GgmlType::Q4K, &b).unwrap();
        assert_eq!(y.len(), 256);
        assert_eq!(y[0], 20.0);
        assert_eq!(y[1], -1.0); // 3·0 − 1
        assert_eq!(y[32], 0.0);
        assert_eq!(y[160], 43.0);
        assert_eq!(y[161], -25.0); // 17·0 − 25
    }

    #[test]
    fn q5_k_block() {
        // d = 1, dmin = 1; sub-block 0 scale 2, min 1; sub-block 1 scale 1, min 0.
        // qh[0] = 0b11: fifth bit for weight 0 (u1 = 1) and weight 32 (u2 = 2).
        // qs[0] = 0x31 → weight 0 = 2·(1+16) − 1 = 33; weight 32 = 1·(3+16) − 0 = 19.
        let mut b = vec![0u8; 176];
        b[..2].copy_from_slice(&h(1.0));
        b[2..4].copy_from_slice(&h(1.0));
        b[4] = 2;
        b[5] = 1;
        b[4 + 4] = 1;
        b[16] = 0b11;
        b[48] = 0x31;
        let y = dequantize(GgmlType::Q5K, &b).unwrap();
        assert_eq!((y[0], y[32], y[1], y[33]), (33.0, 19.0, -1.0, 0.0));
    }

    #[test]
    fn q6_k_block() {
        // d = 0.5 (at byte 208); scales[0] = 2, scales[2] = −1, scales[4] = 3, scales[6] = 1 (int8).
        // ql[0] = 0x5A (low 10, high 5), ql[32] = 0x0F; qh[0] = 0b11_10_01_00
        //  q1 = (10 | 0<<4) − 32 = −22 → 0.5·2·(−22) = −22    (weight 0)
        //  q2 = (15 | 1<<4) − 32 = −1  → 0.5·(−1)·(−1) = 0.5  (weight 32)
        //  q3 = (5 | 2<<4) − 32 = 5    → 0.5·3·5 = 7.5        (weight 64)
        //  q4 = (0 | 3<<4) − 32 = 16   → 0.5·1·16 = 8         (weight 96)
        let mut b = vec![0u8; 210];
        b[0] = 0x5a;
        b[32] = 0x0f;
        b[128] = 0b1110_0100;
        b[192] = 2;
        b[194] = (-1i8) as u8;
        b[196] = 3;
        b[198] = 1;
        b[208..210].copy_from_slice(&h(0.5));
        let y = dequantize(GgmlType::Q6K, &b).unwrap();
        assert_eq!((y[0], y[32], y[64], y[96]), (-22.0, 0.5, 7.5, 8.0));
        // second half uses scales[8..16], all 0 → 0
        assert_eq!(y[128], 0.0);
    }

    #[test]
    fn float_types() {
        let mut b = Vec::new();
        b.extend_from_slice(&h(-2.5));
        b.extend_from_slice(&h(65504.0));
        assert_eq!(dequantize(GgmlType::F16, &b).unwrap(), vec![-2.5, 65504.0]);
        let b = bf16::from_f32(3.0).to_le_bytes();
        assert_eq!(dequantize(GgmlType::BF16, &b).unwrap(), vec![3.0]);
        let b = 1.25f32.to_le_bytes();
        assert_eq!(dequantize(GgmlType::F32, &b).unwrap(), vec![1.25]);
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 33]).is_err());
        assert!(dequantize(GgmlType::Other(99), &[0u8; 4]).is_err());
    }

}
