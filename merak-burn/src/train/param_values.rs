//! A model's parameter values read to the host one parameter at a time (ZeRO's chunks and
//! shards are cut from them).

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;

use super::TrainError;

/// Reads the parameters to the host one at a time, handing each (its visit-order index and
/// values) to `take` before the next is read.
pub(crate) fn for_each_param<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    take: &mut dyn FnMut(usize, Vec<f32>),
) -> Result<(), TrainError> {
    struct Read<'a> {
        take: &'a mut dyn FnMut(usize, Vec<f32>),
        next: usize,
        error: Option<TrainError>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Read<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let values = crate::host_read::floats(param.val().inner()).unwrap_or_else(|e| {
                (self.error).get_or_insert(TrainError::ZeroValues(e.0));
                Vec::new()
            });
            (self.take)(self.next, values);
            self.next += 1;
        }
    }
    let mut read = Read {
        take,
        next: 0,
        error: None,
    };
    model.visit(&mut read);
    read.error.map_or(Ok(()), Err)
}
