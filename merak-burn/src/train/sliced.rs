//! ZeRO on slices (`parallel.zero = 1` and `2`; ZeRO-3 keeps the new values as its shards): the
//! gradient buckets are all-reduced (1) or reduce-scattered (2), each data-parallel
//! rank steps only its pieces of the parameters ([`RankSlices`]) with the optimizer state of
//! those pieces, and the new values are all-gathered into every rank's model. The pieces'
//! state is gathered into whole tensors only when a checkpoint is written, so checkpoints stay
//! layout-free and resume under any stage and layout.

use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};

use super::pieces::{Sliced, flat, values_of};
use crate::checkpoint::TensorSlice;
use crate::data_parallel::all_gather_each;
use crate::pipeline::ScheduleKind;
use crate::pipeline::{TrainBackend, TrainModel};
use crate::train::grad_norm::norm_of;
use crate::train::{GradStats, TrainError, Trainer};

impl<B, M> Trainer<'_, B, M>
where
    B: TrainBackend,
    M: TrainModel<B>,
{
    /// ZeRO-2's update from this rank's reduce-scattered gradient `chunks` at `lr`: the global
    /// gradient norm over every rank's pieces, clipping, each piece stepped by its group's
    /// optimizer, and the new values all-gathered into the model. Returns the norm before
    /// clipping.
    pub(crate) fn update_sliced(
        &mut self,
        lr: f64,
        chunks: Vec<Vec<f32>>,
    ) -> Result<f64, TrainError> {
        let mut sliced = self.sliced.take().ok_or(TrainError::Sliced(
            "the sliced optimizer state is missing".into(),
        ))?;
        let result = self.update_pieces(&mut sliced, lr, chunks);
        self.sliced = Some(sliced);
        result
    }

    fn update_pieces(
        &mut self,
        s: &mut Sliced<B::InnerBackend>,
        lr: f64,
        mut chunks: Vec<Vec<f32>>,
    ) -> Result<f64, TrainError> {
        let norm = self.pieces_norm(s, &chunks)?;
        let max = self.settings.grad_clip;
        if max > 0.0 && norm > max && norm.is_finite() {
            // As `clip_grads` scales whole gradients.
            let scale = (max / (norm + 1e-6)) as f32;
            chunks.iter_mut().flatten().for_each(|g| *g *= scale);
        }
        if self.executor.plan().schedule.kind == ScheduleKind::TwoBw {
            self.stale = Some(self.model.clone());
        }
        let read;
        let values: &[Vec<f32>] = match &self.shards {
            // ZeRO-3: this rank's own values are its chunks.
            Some(shards) => shards.own(),
            None => {
                read = read_params(&self.model)?;
                &read
            }
        };
        let zero3 = self.shards.is_some();
        let seen = self.reducer.seen();
        let mut mine: Vec<Vec<f32>> = (s.slices.buckets.iter())
            .map(|c| vec![0.0; c.chunk])
            .collect();
        for (k, p) in s.slices.pieces.iter().enumerate() {
            let current = if zero3 {
                &values[p.bucket][p.chunk_offset..p.chunk_offset + p.len]
            } else {
                &values[p.param][p.param_start..p.param_start + p.len]
            };
            let dst = &mut mine[p.bucket][p.chunk_offset..p.chunk_offset + p.len];
            let param = &s.params[p.param];
            let group = seen[p.param]
                .then(|| self.optim.group_of(param.id))
                .flatten();
            let Some((optim, lr_scale)) = group else {
                // No gradient this step: the parameter keeps its values (as Burn's optimizer
                // leaves a parameter without a gradient alone).
                dst.copy_from_slice(current);
                continue;
            };
            let grad = &chunks[p.bucket][p.chunk_offset..p.chunk_offset + p.len];
            let device = &self.device;
            let step = optim.step_piece(
                &param.name,
                lr * lr_scale,
                flat::<B::InnerBackend>(current, device),
                flat::<B::InnerBackend>(grad, device),
                s.states[k].take(),
            )?;
            s.states[k] = step.state;
            dst.copy_from_slice(&values_of(step.values)?);
        }
        if let Some(shards) = self.shards.as_mut() {
            shards.set_own(mine);
            return Ok(norm);
        }
        let flat = self.gather_buckets(s, mine)?;
        let mut write = WriteParams {
            ranges: &s.ranges,
            flat: &flat,
            next: 0,
        };
        self.model = self.model.clone().map(&mut write);
        Ok(norm)
    }

    /// The flat values of every bucket from every rank's chunk of it (`mine`: this rank's).
    fn gather_buckets(
        &self,
        s: &Sliced<B::InnerBackend>,
        mine: Vec<Vec<f32>>,
    ) -> Result<Vec<f32>, TrainError> {
        // The dense buckets' chunks over the shard group, the experts' held apart over the
        // expert group.
        let (mut dense, mut experts) = (Vec::new(), Vec::new());
        for (chunk, &apart) in mine.into_iter().zip(&s.slices.apart) {
            match apart {
                true => experts.push(chunk),
                false => dense.push(chunk),
            }
        }
        let mut dense = all_gather_each(&*self.shard.comm()?, dense)?.into_iter();
        let mut experts = match experts.is_empty() {
            true => Vec::new(),
            false => all_gather_each(&*self.grid.experts.comm()?, experts)?,
        }
        .into_iter();
        let total = s.ranges.iter().map(|&(o, l)| o + l).max().unwrap_or(0);
        let mut flat = vec![0.0; total];
        for (c, &apart) in s.slices.buckets.iter().zip(&s.slices.apart) {
            let all = match apart {
                true => experts.next(),
                false => dense.next(),
            }
            .ok_or_else(|| TrainError::Sliced("a bucket's gathered values are missing".into()))?;
            flat[c.start..c.start + c.len].copy_from_slice(&all[..c.len]);
        }
        Ok(flat)
    }

    /// The global gradient norm from this rank's pieces: squares summed over the
    /// data-parallel ranks (the routed experts' held apart over the expert group), then over
    /// tensor-parallel shards, expert-parallel ranks and stages as
    /// [`global_grad_norm`](crate::train::global_grad_norm) does.
    fn pieces_norm(
        &self,
        s: &Sliced<B::InnerBackend>,
        chunks: &[Vec<f32>],
    ) -> Result<f64, TrainError> {
        let mut stats = GradStats::default();
        for p in &s.slices.pieces {
            let id = s.params[p.param].id;
            if self.not_counted.contains(&id) {
                continue;
            }
            let g = &chunks[p.bucket][p.chunk_offset..p.chunk_offset + p.len];
            let sq = crate::kernels::cpu::math::sum_of_squares(g);
            if s.slices.apart[p.bucket] {
                stats.expert_sq += sq;
            } else if self.sharded.contains(&id) {
                stats.sharded_sq += sq;
            } else {
                stats.replicated_sq += sq;
            }
        }
        // Summed in f64, so that the norm (and the clipping) is the one of the whole
        // gradients up to the order of the additions.
        let both = sum_f64(self.shard, &[stats.sharded_sq, stats.replicated_sq])?;
        let experts = match s.slices.apart.contains(&true) {
            true => sum_f64(self.grid.experts, &[stats.expert_sq])?[0],
            false => 0.0,
        };
        let stats = GradStats {
            sharded_sq: both[0],
            replicated_sq: both[1],
            expert_sq: experts,
        };
        let groups = crate::train::NormGroups {
            tp: self.grid.tp,
            pp: self.grid.pp,
            ep: self.grid.ep,
        };
        Ok(norm_of(stats, groups)?)
    }

    /// This data-parallel rank's slices of the optimizer state (and, under ZeRO-3, of the
    /// parameters) for a checkpoint: each piece's moments where it has stepped (a second
    /// moment of zeros for an optimizer that keeps one tensor).
    pub(crate) fn slices_to_write(&self) -> Result<Vec<TensorSlice>, TrainError> {
        let Some(s) = self.sliced.as_ref() else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for (p, state) in s.slices.pieces.iter().zip(&s.states) {
            let name = &s.params[p.param].name;
            let slice = |kind, values, time| TensorSlice {
                kind,
                name: name.clone(),
                start: p.param_start,
                values,
                time,
            };
            if let Some(shards) = &self.shards {
                let own = &shards.own()[p.bucket][p.chunk_offset..p.chunk_offset + p.len];
                out.push(slice("param", own.to_vec(), 0));
            }
            let Some(st) = state else { continue };
            let m2 = match &st.m2 {
                Some(x) => values_of(x.clone())?,
                None => vec![0.0; p.len],
            };
            out.push(slice("m1", values_of(st.m1.clone())?, st.time));
            out.push(slice("m2", m2, st.time));
        }
        Ok(out)
    }
}

/// `values` summed over the ranks of `group` in f64: each value travels as two f32 (its nearest
/// f32 and the remainder), and every rank adds them up in rank order, so all get the same bits.
fn sum_f64(group: crate::comm::Group, values: &[f64]) -> Result<Vec<f64>, TrainError> {
    if group.size() == 1 {
        return Ok(values.to_vec());
    }
    let split: Vec<f32> = (values.iter())
        .flat_map(|&v| {
            let hi = v as f32;
            [hi, (v - f64::from(hi)) as f32]
        })
        .collect();
    let mut all = vec![0.0f32; split.len() * group.size()];
    group.comm()?.all_gather(&split, &mut all)?;
    let mut out = vec![0.0f64; values.len()];
    for rank in all.chunks(split.len()) {
        for (o, pair) in out.iter_mut().zip(rank.chunks(2)) {
            *o += f64::from(pair[0]) + f64::from(pair[1]);
        }
    }
    Ok(out)
}

/// Every parameter's values (visit order), read to the host.
pub(crate) fn read_params<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
) -> Result<Vec<Vec<f32>>, TrainError> {
    let mut all = Vec::new();
    for_each_param(model, &mut |_, v| all.push(v))?;
    Ok(all)
}

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
            let data = param.val().inner().into_data().convert::<f32>();
            let values = data.into_vec::<f32>().unwrap_or_else(|e| {
                (self.error).get_or_insert(TrainError::Sliced(format!("{e:?}")));
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

/// Sets every float parameter (visit order) to its range of `flat`, keeping its id.
struct WriteParams<'a> {
    ranges: &'a [(usize, usize)],
    flat: &'a [f32],
    next: usize,
}

impl<B: AutodiffBackend> ModuleMapper<B> for WriteParams<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let Some(&(offset, len)) = self.ranges.get(self.next) else {
            return param;
        };
        self.next += 1;
        let (id, tensor, mapper) = param.consume();
        let require_grad = tensor.is_require_grad();
        let (shape, device) = (tensor.shape(), tensor.device());
        let data = TensorData::new(self.flat[offset..offset + len].to_vec(), shape);
        let mut out = Tensor::<B, D>::from_data(data, &device);
        if require_grad {
            out = out.require_grad();
        }
        Param::from_mapped_value(id, out, mapper)
    }
}
