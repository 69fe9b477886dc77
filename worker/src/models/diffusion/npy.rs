//! NumPy `.npy` files of little-endian float32, C order: what `sluice-worker generate` reads
//! (`--latents-in`, `--noise-in`) and writes (`--latents-out`).

use std::path::Path;

/// A float32 array.
#[derive(Debug, Clone, PartialEq)]
pub struct Array {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

const MAGIC: &[u8] = b"\x93NUMPY";

pub fn read(path: &Path) -> Result<Array, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    parse(&bytes).map_err(|e| format!("{}: {e}", path.display()))
}

pub fn parse(bytes: &[u8]) -> Result<Array, String> {
    if !bytes.starts_with(MAGIC) || bytes.len() < 10 {
        return Err("not a .npy file".into());
    }
    let (header_len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12),
        v => return Err(format!("unsupported .npy version {v}")),
    };
    let header = std::str::from_utf8(bytes.get(start..start + header_len).ok_or("truncated header")?).map_err(|e| e.to_string())?;
    if !header.contains("'descr': '<f4'") {
        return Err(format!("expected little-endian float32 ('<f4'), header is {header}"));
    }
    if header.contains("'fortran_order': True") {
        return Err("Fortran-ordered arrays are not supported".into());
    }
    let shape_text = header
        .split("'shape': (")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .ok_or("header has no shape")?;
    let shape: Vec<usize> = shape_text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().map_err(|_| format!("bad shape {shape_text:?}")))
        .collect::<Result<_, _>>()?;
    let body = &bytes[start + header_len..];
    let n: usize = shape.iter().product();
    if body.len() != 4 * n {
        return Err(format!(
            "shape {shape:?} needs {} bytes of data, the file has {}",
            4 * n,
            body.len()
        ));
    }
    let data = body.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    Ok(Array { shape, data })
}

pub fn write(path: &Path, array: &Array) -> Result<(), String> {
    let dims: Vec<String> = array.shape.iter().map(usize::to_string).collect();
    let shape = if dims.len() == 1 {
        format!("{},", dims[0])
    } else {
        dims.join(", ")
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({shape}), }}");
    // Pad so that the data starts on a 64-byte boundary, ending the header with a newline.
    let total = MAGIC.len() + 4 + header.len() + 1;
    header.push_str(&" ".repeat((64 - total % 64) % 64));
    header.push('\n');
    let mut bytes = Vec::with_capacity(10 + header.len() + 4 * array.data.len());
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&[1, 0]);
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    for v in &array.data {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    std::fs::write(path, bytes).map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let dir = std::env::temp_dir().join(format!("sluice-npy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let a = Array {
            shape: vec![2, 1, 3],
            data: vec![0.5, -1.0, 2.0, 3.25, 1e-7, f32::MAX],
        };
        write(&dir.join("a.npy"), &a).unwrap();
        assert_eq!(read(&dir.join("a.npy")).unwrap(), a);
        assert!(parse(b"not numpy").is_err());
        std::fs::remove_dir_all(dir).unwrap();
    }
}
