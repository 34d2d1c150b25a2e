//! ZeRO-3's parameter shards ([`Shards`]): each data-parallel rank stores only its chunk of
//! every gradient bucket's *values*, and a unit's parameters are all-gathered just before the
//! unit runs, then dropped. Buckets never span two units (the reducer is
//! [`grouped`](super::DataParallel::grouped) by unit), so a unit's gather reads its own buckets
//! only, plus those of a tied table it reads.
//!
//! Gathers are started ahead along the step's order of units (the forward passes' units in
//! order, the backward passes' in reverse, as the pipeline schedule runs them): with a
//! prefetch of `k`, the next `k` units' all-gathers are in flight while a unit computes. Every
//! rank of the data-parallel group runs the same order, so the collectives match.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use super::chunks::RankChunks;
use crate::comm::{CommError, Communicator, Pending};

/// The values of one parameter, by its index in visit order.
pub type ParamValues = (usize, Vec<f32>);

/// The all-gathers of one unit's buckets in flight, by bucket.
type Gathers = Vec<(usize, Box<dyn Pending>)>;

/// A rank's shards of the parameters under ZeRO-3 (see the module docs).
pub struct Shards {
    comm: Rc<dyn Communicator>,
    /// The ranks holding the same routed experts, over which the buckets of experts held apart
    /// ([`RankChunks::apart`]) are cut (`None`: every bucket over `comm`).
    experts: Option<Rc<dyn Communicator>>,
    rank_chunks: RankChunks,
    /// Each parameter's `(offset, len)` in the flat concatenation, in visit order.
    ranges: Vec<(usize, usize)>,
    /// Each parameter's shape, in visit order.
    shapes: Vec<Vec<usize>>,
    /// Each parameter's bucket.
    bucket_of: Vec<usize>,
    /// This rank's chunk of each bucket's values (`chunk` values, zeros past the bucket's end).
    own: Vec<Vec<f32>>,
    /// The parameters (visit order) each unit reads.
    units: HashMap<usize, Vec<usize>>,
    /// Units gathered ahead of the one running.
    prefetch: usize,
    queue: RefCell<Queue>,
}

/// The step's order of gathers and those already started.
#[derive(Default)]
struct Queue {
    order: Vec<usize>,
    /// The next position of `order` to be used.
    next: usize,
    /// Gathers started for positions `next..next + started.len()`.
    started: VecDeque<Gathers>,
}

impl Shards {
    /// The shards of rank `rank_chunks.rank` for parameters at `ranges` of shapes `shapes`, `own`
    /// its chunk of every bucket's values ([`RankChunks::zero_chunks`] filled by
    /// [`RankChunks::write_param`]), each unit reading the parameters `units` lists;
    /// `prefetch` units gathered ahead.
    pub fn new(
        comm: Rc<dyn Communicator>,
        rank_chunks: RankChunks,
        ranges: Vec<(usize, usize)>,
        shapes: Vec<Vec<usize>>,
        own: Vec<Vec<f32>>,
        units: HashMap<usize, Vec<usize>>,
        prefetch: usize,
    ) -> Self {
        let bucket_of = (ranges.iter())
            .map(|&(offset, _)| {
                (rank_chunks.buckets.iter())
                    .position(|c| (c.start..c.start + c.len.max(1)).contains(&offset))
                    .unwrap_or(0)
            })
            .collect();
        Self {
            comm,
            experts: None,
            rank_chunks,
            ranges,
            shapes,
            bucket_of,
            own,
            units,
            prefetch,
            queue: RefCell::new(Queue::default()),
        }
    }

    /// These shards with the buckets of routed experts held apart ([`RankChunks::apart`])
    /// gathered over `experts`, the ranks holding the same experts, over which they are cut.
    pub fn with_experts(mut self, experts: Rc<dyn Communicator>) -> Self {
        self.experts = Some(experts);
        self
    }

    /// The ranks bucket `b` is cut over and gathered from.
    fn comm_of(&self, b: usize) -> &dyn Communicator {
        match &self.experts {
            Some(e) if self.rank_chunks.apart.get(b).copied().unwrap_or(false) => &**e,
            _ => &*self.comm,
        }
    }

    /// How this rank's chunks are cut.
    pub fn rank_chunks(&self) -> &RankChunks {
        &self.rank_chunks
    }

    /// This rank's chunk of every bucket's values.
    pub fn own(&self) -> &[Vec<f32>] {
        &self.own
    }

    /// Replaces this rank's chunks (after an optimizer step or a resume).
    pub fn set_own(&mut self, own: Vec<Vec<f32>>) {
        self.own = own;
    }

    /// Values this rank stores (its chunks, padding included).
    pub fn stored_elements(&self) -> usize {
        self.own.iter().map(Vec::len).sum()
    }

    /// Starts a step whose units are gathered in `order`.
    pub fn begin(&self, order: Vec<usize>) -> Result<(), CommError> {
        let mut q = self.queue.borrow_mut();
        // Gathers a failed step left in flight are completed, so the next ones match.
        for started in std::mem::take(&mut q.started) {
            for (_, p) in started {
                p.wait()?;
            }
        }
        *q = Queue {
            order,
            ..Queue::default()
        };
        Ok(())
    }

    /// The values of every parameter unit `unit` reads, gathered from every rank's chunks.
    /// Next in the step's order, it takes the gather started ahead (or starts it) and starts
    /// the following ones; out of order, it gathers at once.
    pub fn gathered(&self, unit: usize) -> Result<Vec<ParamValues>, CommError> {
        let mut q = self.queue.borrow_mut();
        let pending = if q.order.get(q.next) == Some(&unit) {
            if q.started.is_empty() {
                let p = self.start(unit)?;
                q.started.push_back(p);
            }
            let current = q.started.pop_front().unwrap_or_default();
            q.next += 1;
            while q.started.len() < self.prefetch && q.next + q.started.len() < q.order.len() {
                let ahead = q.order[q.next + q.started.len()];
                let p = self.start(ahead)?;
                q.started.push_back(p);
            }
            current
        } else {
            self.start(unit)?
        };
        drop(q);
        let mut full: HashMap<usize, Vec<f32>> = HashMap::new();
        for (b, p) in pending {
            full.insert(b, p.wait()?);
        }
        let params = self.units.get(&unit).map(Vec::as_slice).unwrap_or(&[]);
        Ok((params.iter())
            .filter_map(|&p| Some((p, self.param_values(p, full.get(&self.bucket_of[p])?))))
            .collect())
    }

    /// Every parameter's values, gathered from every rank's chunks (every rank must call it):
    /// the whole model (the trained model, a parameter-group rule's view, a resume).
    pub fn gathered_all(&self) -> Result<Vec<ParamValues>, CommError> {
        let pending = (self.own.iter().enumerate())
            .map(|(b, c)| self.comm_of(b).all_gather_start(c.clone()))
            .collect::<Result<Vec<_>, _>>()?;
        let full = (pending.into_iter())
            .map(|p| p.wait())
            .collect::<Result<Vec<_>, _>>()?;
        Ok((0..self.ranges.len())
            .map(|p| (p, self.param_values(p, &full[self.bucket_of[p]])))
            .collect())
    }

    /// Starts the all-gathers of the buckets unit `unit` reads.
    fn start(&self, unit: usize) -> Result<Gathers, CommError> {
        let mut buckets: Vec<usize> = (self.units.get(&unit).into_iter().flatten())
            .map(|&p| self.bucket_of[p])
            .collect();
        buckets.sort_unstable();
        buckets.dedup();
        (buckets.into_iter())
            .map(|b| Ok((b, self.comm_of(b).all_gather_start(self.own[b].clone())?)))
            .collect()
    }

    /// Parameter `p`'s values in its bucket's gathered chunks `all` (rank after rank).
    fn param_values(&self, p: usize, all: &[f32]) -> Vec<f32> {
        let (offset, len) = self.ranges[p];
        let at = offset - self.rank_chunks.buckets[self.bucket_of[p]].start;
        all.get(at..at + len)
            .map(<[f32]>::to_vec)
            .unwrap_or_default()
    }

    /// `model` with the parameters of `values` (by visit index) set to them and every other
    /// parameter emptied ([`emptied`]).
    pub fn fill<B: Backend, M: Module<B>>(&self, model: M, values: Vec<ParamValues>) -> M {
        model.map(&mut Fill {
            values: values.into_iter().collect(),
            shapes: &self.shapes,
            next: 0,
        })
    }
}

/// Every rank's `chunks` (one per bucket, all started at once), each as the concatenation of
/// the ranks' chunks in rank order: the buckets' whole values, padding at the end.
pub fn all_gather_each(
    comm: &dyn Communicator,
    chunks: Vec<Vec<f32>>,
) -> Result<Vec<Vec<f32>>, CommError> {
    let pending = (chunks.into_iter())
        .map(|c| comm.all_gather_start(c))
        .collect::<Result<Vec<_>, _>>()?;
    pending.into_iter().map(|p| p.wait()).collect()
}

/// `model` with every float parameter replaced by an empty tensor (same id, rank and
/// `require_grad`): what a ZeRO-3 rank keeps between gathers.
pub fn emptied<B: Backend, M: Module<B>>(model: M) -> M {
    model.map(&mut Fill {
        values: HashMap::new(),
        shapes: &[],
        next: 0,
    })
}

/// Sets parameter `i` (visit order) to `values[i]` of shape `shapes[i]`, and every parameter
/// without values to an empty tensor.
struct Fill<'a> {
    values: HashMap<usize, Vec<f32>>,
    shapes: &'a [Vec<usize>],
    next: usize,
}

impl<B: Backend> ModuleMapper<B> for Fill<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let index = self.next;
        self.next += 1;
        let (id, tensor, mapper) = param.consume();
        let (require_grad, device) = (tensor.is_require_grad(), tensor.device());
        let data = match (self.values.remove(&index), self.shapes.get(index)) {
            (Some(v), Some(shape)) => TensorData::new(v, shape.clone()),
            _ => TensorData::new(Vec::<f32>::new(), [0; D]),
        };
        let mut out = Tensor::<B, D>::from_data(data, &device);
        if require_grad {
            out = out.require_grad();
        }
        Param::from_mapped_value(id, out, mapper)
    }
}
