//! Owned tensors passed to and from the engine threads.

/// Element data of a [`Tensor`].
#[derive(Debug, Clone, PartialEq)]
pub enum TensorData {
    F32(Vec<f32>),
    I64(Vec<i64>),
}

/// A named tensor with its batch on axis 0.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: TensorData,
}

impl Tensor {
    pub fn f32(name: impl Into<String>, shape: Vec<usize>, data: Vec<f32>) -> Tensor {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        Tensor {
            name: name.into(),
            shape,
            data: TensorData::F32(data),
        }
    }

    pub fn i64(name: impl Into<String>, shape: Vec<usize>, data: Vec<i64>) -> Tensor {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        Tensor {
            name: name.into(),
            shape,
            data: TensorData::I64(data),
        }
    }

    /// Number of rows (the size of axis 0).
    pub fn rows(&self) -> usize {
        self.shape.first().copied().unwrap_or(0)
    }

    /// Elements per row.
    fn row_len(&self) -> usize {
        self.shape.iter().skip(1).product()
    }

    /// Joins tensors of one name and element type along the batch axis.
    ///
    /// # Panics
    /// If `parts` is empty.
    pub fn concat(parts: &[&Tensor]) -> Tensor {
        let first = parts[0];
        let data = match &first.data {
            TensorData::F32(_) => TensorData::F32(
                parts
                    .iter()
                    .flat_map(|p| match &p.data {
                        TensorData::F32(v) => v.as_slice(),
                        TensorData::I64(_) => panic!("tensor {}: mixed element types", first.name),
                    })
                    .copied()
                    .collect(),
            ),
            TensorData::I64(_) => TensorData::I64(
                parts
                    .iter()
                    .flat_map(|p| match &p.data {
                        TensorData::I64(v) => v.as_slice(),
                        TensorData::F32(_) => panic!("tensor {}: mixed element types", first.name),
                    })
                    .copied()
                    .collect(),
            ),
        };
        let mut shape = first.shape.clone();
        shape[0] = parts.iter().map(|p| p.rows()).sum();
        Tensor {
            name: first.name.clone(),
            shape,
            data,
        }
    }

    /// A copy of rows `start..end`.
    ///
    /// # Panics
    /// If `end` is beyond the last row or before `start`.
    pub fn slice_rows(&self, start: usize, end: usize) -> Tensor {
        let n = self.row_len();
        let data = match &self.data {
            TensorData::F32(v) => TensorData::F32(v[start * n..end * n].to_vec()),
            TensorData::I64(v) => TensorData::I64(v[start * n..end * n].to_vec()),
        };
        let mut shape = self.shape.clone();
        shape[0] = end - start;
        Tensor {
            name: self.name.clone(),
            shape,
            data,
        }
    }

    /// Every f32 element, or an error naming the tensor for another element type.
    pub fn floats(&self) -> Result<&[f32], super::error::EngineError> {
        self.f32_rows(0, self.rows())
            .ok_or_else(|| super::error::EngineError::Run(format!("`{}` must be float32", self.name)))
    }

    /// The f32 elements of rows `start..end`, or `None` for another element type.
    pub fn f32_rows(&self, start: usize, end: usize) -> Option<&[f32]> {
        let n = self.row_len();
        match &self.data {
            TensorData::F32(v) => v.get(start * n..end * n),
            TensorData::I64(_) => None,
        }
    }

    /// The i64 elements of rows `start..end`, or `None` for another element type.
    pub fn i64_rows(&self, start: usize, end: usize) -> Option<&[i64]> {
        let n = self.row_len();
        match &self.data {
            TensorData::I64(v) => v.get(start * n..end * n),
            TensorData::F32(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn concat_joins_rows_in_order() {
        let a = Tensor::f32("x", vec![1, 2], vec![1.0, 2.0]);
        let b = Tensor::f32("x", vec![2, 2], vec![3.0, 4.0, 5.0, 6.0]);
        let c = Tensor::concat(&[&a, &b]);
        assert_eq!(c.shape, vec![3, 2]);
        assert_eq!(c.f32_rows(1, 3).unwrap(), &[3.0, 4.0, 5.0, 6.0]);
        assert_eq!(c.row_len(), 2);
        let middle = c.slice_rows(1, 2);
        assert_eq!(
            (middle.shape.clone(), middle.f32_rows(0, 1).unwrap()),
            (vec![1, 2], &[3.0, 4.0][..])
        );
        let ids = Tensor::i64("i", vec![3], vec![7, 8, 9]).slice_rows(0, 2);
        assert_eq!(ids, Tensor::i64("i", vec![2], vec![7, 8]));
        let pieces = [c.slice_rows(0, 1), c.slice_rows(1, 3)];
        assert_eq!(Tensor::concat(&[&pieces[0], &pieces[1]]), c);
    }
}
