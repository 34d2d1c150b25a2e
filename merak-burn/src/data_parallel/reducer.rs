//! The bucketed gradient reducer behind [`DataParallel`].

use std::any::Any;
use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};

use super::chunks::{BucketChunks, Holders, RankChunks};
use super::collective::{Collective, Sharding};
use crate::comm::{CommError, Communicator, Group, Pending, ReduceOp, TensorComm};
use crate::tensor_parallel::{GradSink, HookedGrad, ParallelBackend, set_grad_sink};

/// One parameter's place in the gradient buffers (an offset in the concatenation of all
/// parameters, in visit order; each bucket holds a contiguous range of it).
#[derive(Clone, Debug)]
struct Slot {
    id: ParamId,
    offset: usize,
    shape: Vec<usize>,
    len: usize,
    bucket: usize,
    /// Whether a gradient arrived during this step.
    seen: bool,
    /// Gradients the parameter receives per micro-batch: 1, or more when separate backward
    /// passes each deliver one (a tied table under ZeRO-3's unit-by-unit backward).
    uses: usize,
}

struct Bucket {
    start: usize,
    end: usize,
    /// The bucket's slots: `slots.start..slots.end` in [`State::slots`].
    slots: std::ops::Range<usize>,
    /// The bucket's gradients (`end - start` values), moved into its all-reduce while that
    /// runs and back when it completes. A bucket of one parameter starts each step empty and
    /// takes its first gradient's buffer; [`DataParallel::finish`] hands the buffer on to the
    /// gradient tensor: no copy on the way.
    data: Vec<f32>,
    /// Gradients of the bucket that have not arrived yet in the last micro-batch.
    waiting: usize,
    pending: Option<Box<dyn Pending>>,
    launched: bool,
    /// When reduce-scattering every micro-batch: this rank's chunk summed over the
    /// micro-batches whose reduce-scatter is done (empty before the first).
    acc: Vec<f32>,
    /// Whether the bucket holds routed experts' gradients, all-reduced over the expert group.
    expert: bool,
}

impl Bucket {
    /// The bucket's gradients, taken out and padded to `size` equal chunks: what a
    /// reduce-scatter over `size` ranks sends.
    fn take_padded(&mut self, size: usize) -> Vec<f32> {
        let mut data = std::mem::take(&mut self.data);
        data.resize(
            BucketChunks::new(self.start, self.end, size).chunk * size,
            0.0,
        );
        data
    }

    /// The gradients the bucket receives per micro-batch: its parameters' uses.
    fn uses(&self, slots: &[Slot]) -> usize {
        slots[self.slots.clone()].iter().map(|x| x.uses).sum()
    }
}

struct State {
    slots: Vec<Slot>,
    buckets: Vec<Bucket>,
    next_launch: usize,
    reduce_now: bool,
    /// What the reducer does with a bucket ([`Collective`]).
    collective: Collective,
    /// Reduce-scattering every micro-batch: the buckets whose reduce-scatter may still run,
    /// oldest first.
    in_flight: std::collections::VecDeque<usize>,
    comm: Rc<dyn Communicator>,
    /// The ranks a bucket is reduce-scattered over (the data-parallel group, or under hybrid
    /// sharding its shard group).
    shard: Rc<dyn Communicator>,
    /// Under hybrid sharding: the ranks holding the same chunks, over which each chunk is
    /// all-reduced after the reduce-scatter.
    replicate: Option<Rc<dyn Communicator>>,
    /// Under hybrid sharding: the next bucket whose chunk starts its all-reduce over the
    /// copies (in bucket order, so that every rank starts them in the same order).
    next_replicate: usize,
    error: Option<CommError>,
    launched_early: usize,
    /// The ranks holding the same experts, over which the expert buckets are all-reduced, when
    /// they are not the data-parallel group (`None`: no expert bucket, or the experts are held
    /// like the dense parameters).
    experts: Option<Rc<dyn Communicator>>,
    /// Under hybrid sharding: the ranks of the expert group in this rank's shard group, which
    /// the expert buckets held apart are cut over (their chunks then all-reduced over the
    /// copies like the dense ones); `None`: they are cut over the whole expert group.
    expert_shard: Option<Rc<dyn Communicator>>,
    /// On the device: each parameter's gradient summed over the step's micro-batches so far
    /// (a boxed `FloatTensor` of the inner backend), by visit order.
    held: Vec<Option<Box<dyn Any>>>,
}

impl State {
    /// Adds the gradient of parameter `index` to its place in its bucket (the step's first
    /// gradient of a parameter is copied, so no buffer is cleared between steps).
    fn on_grad(&mut self, index: usize, grad: Vec<f32>) {
        let Some(slot) = self.slots.get_mut(index) else {
            return;
        };
        let bucket = &mut self.buckets[slot.bucket];
        let at = slot.offset - bucket.start;
        if bucket.data.is_empty() && bucket.slots.len() == 1 && grad.len() == slot.len {
            // A one-parameter bucket takes the first gradient's buffer itself.
            bucket.data = grad;
        } else if bucket.data.is_empty() && grad.len() == slot.len {
            // A bucket's buffer exists from its first gradient until its collective (ZeRO-2
            // and 3 then keep only their chunk), not through the whole step.
            bucket.data = vec![0.0; bucket.end - bucket.start];
            bucket.data[at..at + slot.len].copy_from_slice(&grad);
        } else if let Some(dst) = bucket.data.get_mut(at..at + slot.len)
            && grad.len() == dst.len()
        {
            if slot.seen {
                dst.iter_mut().zip(&grad).for_each(|(d, g)| *d += g);
            } else {
                dst.copy_from_slice(&grad);
            }
        }
        slot.seen = true;
        let b = slot.bucket;
        let each = self.collective == Collective::ReduceScatterEach;
        if each && self.buckets[b].expert {
            // An expert may get no token in a micro-batch on some ranks: its bucket adds up
            // whole and is reduce-scattered once, at the end of the step, on every rank.
        } else if each {
            self.buckets[b].waiting = self.buckets[b].waiting.saturating_sub(1);
            if self.buckets[b].waiting == 0 {
                self.scatter_now(b, false);
            }
        } else if self.reduce_now {
            // With other collectives on the same ranks during the backward pass (ZeRO-3's
            // gathers), an expert bucket, complete on some ranks only, must not start early
            // there: it waits for the end of the step, and the buckets after it with it.
            let at_end = self.collective == Collective::ReduceScatterExpertsLast;
            if !(at_end && self.buckets[b].expert) {
                self.buckets[b].waiting = self.buckets[b].waiting.saturating_sub(1);
            }
            self.launch_ready(false);
        }
        self.progress();
    }

    /// Reduce-scattering every micro-batch: starts bucket `b`'s reduce-scatter of what this
    /// micro-batch gave it (after adding the previous one's chunk, if still in flight), and
    /// gets the bucket ready for the next micro-batch. Every rank reaches this at the same
    /// gradient of the same backward pass, so the collectives start in the same order.
    fn scatter_now(&mut self, b: usize, at_end: bool) {
        self.settle(b, true);
        // A bucket in flight holds its whole buffer: with more than a few, the micro-batches'
        // buckets would all be alive at once (MPI progresses them only inside its calls), and
        // the chunks would save nothing. Wait for the oldest first.
        while self.in_flight.len() >= EACH_IN_FLIGHT {
            if let Some(oldest) = self.in_flight.pop_front() {
                self.settle(oldest, true);
            }
        }
        let size = self.shard.size();
        let uses = self.buckets[b].uses(&self.slots);
        let bucket = &mut self.buckets[b];
        let data = bucket.take_padded(size);
        if size == 1 {
            // One rank per copy: the bucket is its chunk.
            add_into(&mut bucket.acc, data);
        } else {
            match self.shard.reduce_scatter_start(data, ReduceOp::Sum) {
                Ok(p) => bucket.pending = Some(p),
                Err(e) => self.error = Some(e),
            }
            self.in_flight.push_back(b);
        }
        bucket.waiting = uses;
        if !at_end {
            self.launched_early += 1;
        }
    }

    /// Reduce-scattering every micro-batch: adds bucket `b`'s finished reduce-scatter (with
    /// `wait`, waiting for it) into its summed chunk.
    fn settle(&mut self, b: usize, wait: bool) {
        let bucket = &mut self.buckets[b];
        let Some(p) = bucket.pending.as_mut() else {
            return;
        };
        match p.test() {
            Ok(false) if !wait => return,
            Err(e) => {
                self.error = Some(e);
                bucket.pending = None;
                return;
            }
            _ => {}
        }
        let Some(p) = bucket.pending.take() else {
            return;
        };
        self.in_flight.retain(|&x| x != b);
        match p.wait() {
            Ok(chunk) => add_into(&mut bucket.acc, chunk),
            Err(e) => self.error = Some(e),
        }
    }

    /// Reduce-scattering every micro-batch, at the end of the step: starts the buckets the
    /// last micro-batch left incomplete, sums every chunk, and under hybrid sharding
    /// all-reduces the sums over the copies; each bucket's buffer then holds its chunk.
    fn complete_each(&mut self) -> Result<(), CommError> {
        for b in 0..self.buckets.len() {
            if self.buckets[b].expert {
                self.scatter_whole(b);
            } else if !self.buckets[b].data.is_empty() {
                self.scatter_now(b, true);
            }
        }
        for b in 0..self.buckets.len() {
            self.settle(b, true);
        }
        let copies = self.replicate.clone();
        for b in 0..self.buckets.len() {
            let (size, whole) = (self.cut_over(b).size(), self.over_every_copy(b));
            let bucket = &mut self.buckets[b];
            let mut chunk = std::mem::take(&mut bucket.acc);
            chunk.resize(BucketChunks::new(bucket.start, bucket.end, size).chunk, 0.0);
            match copies.as_ref().filter(|_| !whole) {
                Some(c) => bucket.pending = Some(c.all_reduce_start(chunk, ReduceOp::Sum)?),
                None => bucket.data = chunk,
            }
        }
        Ok(())
    }

    /// Reduce-scattering every micro-batch, at the end of the step: starts the reduce-scatter
    /// of expert bucket `b`, which added up whole through the step (zeros where this rank saw
    /// no gradient), over the ranks it is cut over.
    fn scatter_whole(&mut self, b: usize) {
        self.zero_unseen(b);
        let comm = self.cut_over(b).clone();
        let bucket = &mut self.buckets[b];
        let data = bucket.take_padded(comm.size());
        if comm.size() == 1 {
            add_into(&mut bucket.acc, data);
            return;
        }
        match comm.reduce_scatter_start(data, ReduceOp::Sum) {
            Ok(p) => bucket.pending = Some(p),
            Err(e) => self.error = Some(e),
        }
        self.in_flight.push_back(b);
    }

    /// Gives bucket `b` its whole buffer, zeros where a parameter got no gradient this step.
    fn zero_unseen(&mut self, b: usize) {
        let b = &mut self.buckets[b];
        b.data.resize(b.end - b.start, 0.0);
        for slot in &self.slots[b.slots.clone()] {
            if !slot.seen {
                let at = slot.offset - b.start;
                if let Some(dst) = b.data.get_mut(at..at + slot.len) {
                    dst.fill(0.0);
                }
            }
        }
    }

    /// Starts the buckets that are complete, in order; with `all`, starts every remaining one.
    /// A bucket's parameters that got no gradient this step count as zeros.
    fn launch_ready(&mut self, all: bool) {
        while self.next_launch < self.buckets.len() {
            let at = self.next_launch;
            if !(all || self.buckets[at].waiting == 0) {
                break;
            }
            let apart = self.experts.is_some() && self.buckets[at].expert;
            let scatter = self.collective.scatters();
            if self.comm.size() > 1 || scatter || apart {
                self.zero_unseen(at);
            }
            let comm = match scatter {
                true => self.cut_over(at),
                false => self.cut_over_whole(at),
            }
            .clone();
            let b = &mut self.buckets[at];
            if comm.size() > 1 {
                let started = if scatter {
                    comm.reduce_scatter_start(b.take_padded(comm.size()), ReduceOp::Sum)
                } else {
                    comm.all_reduce_start(std::mem::take(&mut b.data), ReduceOp::Sum)
                };
                match started {
                    Ok(p) => b.pending = Some(p),
                    Err(e) => self.error = Some(e),
                }
            }
            b.launched = true;
            if !all {
                self.launched_early += 1;
            }
            self.next_launch += 1;
        }
    }

    /// Ends the step's reduction: detaches the gradient hooks, starts the buckets left, and
    /// waits for every bucket's collective (its result back in the bucket's buffer); the
    /// step's statistics, the wait counted as exposed.
    fn complete(&mut self) -> Result<DpStats, CommError> {
        let t0 = Instant::now();
        set_grad_sink(None);
        if self.collective == Collective::ReduceScatterEach {
            self.complete_each()?;
        } else {
            self.launch_ready(true);
            self.start_replicas(true);
        }
        for b in &mut self.buckets {
            if let Some(p) = b.pending.take() {
                b.data = p.wait()?;
            }
        }
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        Ok(DpStats {
            buckets: self.buckets.len(),
            overlapped_buckets: self.launched_early,
            exposed_wait: t0.elapsed(),
        })
    }

    /// Marks an expert parameter seen when any rank of the expert group (the data-parallel
    /// group unless the experts are apart) saw it.
    fn share_expert_seen(&mut self) -> Result<(), CommError> {
        let expert_slots: Vec<usize> = (self.buckets.iter())
            .filter(|b| b.expert)
            .flat_map(|b| b.slots.clone())
            .collect();
        let comm = self.experts.clone().unwrap_or_else(|| self.comm.clone());
        if expert_slots.is_empty() || comm.size() == 1 {
            return Ok(());
        }
        let mut seen: Vec<f32> = (expert_slots.iter())
            .map(|&i| f32::from(u8::from(self.slots[i].seen)))
            .collect();
        comm.all_reduce(&mut seen, ReduceOp::Max)?;
        for (&i, s) in expert_slots.iter().zip(seen) {
            self.slots[i].seen = s > 0.0;
        }
        Ok(())
    }

    fn progress(&mut self) {
        if self.collective == Collective::ReduceScatterEach {
            let in_flight: Vec<usize> = self.in_flight.iter().copied().collect();
            for b in in_flight {
                self.settle(b, false);
            }
            return;
        }
        for b in &mut self.buckets {
            if let Some(p) = b.pending.as_mut()
                && let Err(e) = p.test()
            {
                self.error = Some(e);
            }
        }
        self.start_replicas(false);
    }

    /// Under hybrid sharding: starts the all-reduce over the copies of each launched bucket's
    /// chunk whose reduce-scatter is done, in bucket order (with `wait`, waiting for them), so
    /// that it overlaps the rest of the backward pass.
    fn start_replicas(&mut self, wait: bool) {
        let Some(copies) = self.replicate.clone() else {
            return;
        };
        while self.next_replicate < self.next_launch {
            if self.over_every_copy(self.next_replicate) {
                self.next_replicate += 1;
                continue;
            }
            let b = &mut self.buckets[self.next_replicate];
            let done = |p: &mut Box<dyn Pending>| matches!(p.test(), Ok(true) | Err(_));
            if !wait && b.pending.as_mut().is_some_and(|p| !done(p)) {
                return;
            }
            let chunk = match b.pending.take() {
                Some(p) => p.wait(),
                // One rank per copy: no reduce-scatter ran, the bucket is the chunk.
                None => Ok(std::mem::take(&mut b.data)),
            };
            match chunk.and_then(|c| copies.all_reduce_start(c, ReduceOp::Sum)) {
                Ok(p) => b.pending = Some(p),
                Err(e) => self.error = Some(e),
            }
            self.next_replicate += 1;
        }
    }

    /// Whether bucket `b` holds routed experts' gradients reduced over the expert group
    /// (which ZeRO's chunks of it are then cut over).
    fn apart(&self, b: usize) -> bool {
        self.buckets[b].expert && self.experts.is_some()
    }

    /// Whether bucket `b`'s chunks are cut over every copy already (an expert bucket held
    /// apart without an expert-shard group): no all-reduce over the copies follows.
    fn over_every_copy(&self, b: usize) -> bool {
        self.apart(b) && self.expert_shard.is_none()
    }

    /// The ranks bucket `b` is cut into chunks over: for an expert bucket held apart, the
    /// expert-shard group (under hybrid sharding) or the expert group; otherwise the shard
    /// group.
    fn cut_over(&self, b: usize) -> &Rc<dyn Communicator> {
        match (&self.expert_shard, &self.experts) {
            (Some(e), Some(_)) | (None, Some(e)) if self.buckets[b].expert => e,
            _ => &self.shard,
        }
    }

    /// Whether this step's gradients stay on the device ([`Collective::AllReduceOnDevice`]).
    fn on_device(&self) -> bool {
        self.collective == Collective::AllReduceOnDevice
    }

    /// On the device: adds gradient `grad` (a boxed `FloatTensor<IB>`) of parameter `index` to
    /// what the parameter holds this step.
    fn hold<IB: Backend>(&mut self, index: usize, grad: Box<dyn Any>) {
        let (Some(slot), Some(held)) = (self.slots.get_mut(index), self.held.get_mut(index)) else {
            return;
        };
        let Ok(grad) = grad.downcast::<FloatTensor<IB>>() else {
            return;
        };
        let before = held
            .take()
            .and_then(|h| h.downcast::<FloatTensor<IB>>().ok());
        let sum = match before {
            Some(before) if slot.seen => IB::float_add(*before, *grad),
            _ => *grad,
        };
        *held = Some(Box::new(sum));
        slot.seen = true;
    }

    /// On the device, after the step's backward passes: sums each bucket over the ranks that
    /// hold its parameters (the expert group for an expert bucket held apart), the bucket's
    /// gradients concatenated on `device` (zeros for a parameter that got none here) and
    /// all-reduced as one tensor (device to device under NCCL), then cut back.
    fn reduce_held<IB: Backend>(&mut self, device: &IB::Device) -> Result<(), CommError> {
        for b in 0..self.buckets.len() {
            let comm = self.cut_over_whole(b).clone();
            if comm.size() == 1 {
                continue;
            }
            let slots = self.buckets[b].slots.clone();
            let parts: Vec<Tensor<IB, 1>> = slots
                .clone()
                .map(|i| self.held_flat::<IB>(i, device))
                .collect();
            let sum = comm.all_reduce_tensor(Tensor::cat(parts, 0), ReduceOp::Sum)?;
            let mut at = 0;
            for i in slots {
                let len = self.slots[i].len;
                let part = sum.clone().slice(at..at + len).into_primitive().tensor();
                self.held[i] = Some(Box::new(part));
                at += len;
            }
        }
        Ok(())
    }

    /// Parameter `index`'s held gradient flattened, in `f32` (zeros when it has none).
    fn held_flat<IB: Backend>(&mut self, index: usize, device: &IB::Device) -> Tensor<IB, 1> {
        let len = self.slots[index].len;
        match self.take_held::<IB>(index) {
            Some(t) => {
                crate::precision::to_f32(Tensor::<IB, 1>::from_primitive(TensorPrimitive::Float(t)))
                    .reshape([len])
            }
            None => Tensor::zeros([len], device),
        }
    }

    /// Takes parameter `index`'s held gradient, if it has one this step.
    fn take_held<IB: Backend>(&mut self, index: usize) -> Option<FloatTensor<IB>> {
        let held = self.held.get_mut(index)?.take()?;
        let seen = self.slots[index].seen;
        (held.downcast::<FloatTensor<IB>>().ok())
            .filter(|_| seen)
            .map(|t| *t)
    }

    /// On the device, [`complete`](Self::complete)'s counterpart: detaches the gradient hooks
    /// and sums the held gradients over the ranks (zeros created on `device` for parameters
    /// without one); the step's statistics, all of its communication counted as exposed.
    fn complete_held<IB: Backend>(
        &mut self,
        device: Option<&IB::Device>,
    ) -> Result<DpStats, CommError> {
        let t0 = Instant::now();
        set_grad_sink(None);
        self.share_expert_seen()?;
        if let Some(device) = device {
            self.reduce_held::<IB>(device)?;
        }
        Ok(DpStats {
            buckets: self.buckets.len(),
            overlapped_buckets: 0,
            exposed_wait: t0.elapsed(),
        })
    }

    /// The ranks bucket `b` is all-reduced over when reduced whole: the expert group for an
    /// expert bucket held apart, the data-parallel group otherwise.
    fn cut_over_whole(&self, b: usize) -> &Rc<dyn Communicator> {
        match &self.experts {
            Some(e) if self.buckets[b].expert => e,
            _ => &self.comm,
        }
    }

    /// The values of parameter slot `index` in its bucket.
    fn values(&self, index: usize) -> Option<&[f32]> {
        let slot = self.slots.get(index)?;
        let bucket = &self.buckets[slot.bucket];
        let at = slot.offset - bucket.start;
        bucket.data.get(at..at + slot.len)
    }
}

/// Reduce-scattering every micro-batch: at most this many buckets' reduce-scatters in flight
/// (a new one first waits for the oldest), so that few whole buckets are alive at a time.
const EACH_IN_FLIGHT: usize = 2;

/// Adds `values` into `sum` (which takes them when still empty, without the spare capacity
/// of a pooled communication buffer: the sum lives through the step).
fn add_into(sum: &mut Vec<f32>, mut values: Vec<f32>) {
    if sum.is_empty() {
        values.shrink_to_fit();
        *sum = values;
    } else {
        sum.iter_mut().zip(&values).for_each(|(a, v)| *a += v);
    }
}

/// Timing of one step's data-parallel communication.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DpStats {
    /// Buckets of the step.
    pub buckets: usize,
    /// Buckets whose all-reduce started during the backward pass (overlapped).
    pub overlapped_buckets: usize,
    /// Time spent in [`DataParallel::finish`] waiting for all-reduces still in flight: the
    /// communication the backward pass did not hide.
    pub exposed_wait: Duration,
}

/// The data-parallel gradient reducer of one model replica (see the module docs).
pub struct DataParallel {
    state: Rc<RefCell<State>>,
    dp: Group,
    /// The group a reduce-scattering reducer cuts its buckets over (`dp` unless hybrid).
    shard: Group,
}

struct Layout {
    slots: Vec<Slot>,
    total: usize,
}

impl<B: Backend> ModuleVisitor<B> for Layout {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let shape = param.val().dims().to_vec();
        let len = shape.iter().product();
        self.slots.push(Slot {
            id: param.id,
            offset: self.total,
            shape,
            len,
            bucket: 0,
            seen: false,
            uses: 1,
        });
        self.total += len;
    }
}

struct HookMapper {
    next: usize,
}

impl<B: ParallelBackend> ModuleMapper<B> for HookMapper {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let index = self.next;
        self.next += 1;
        let (id, tensor, mapper) = param.consume();
        let hooked = Tensor::from_primitive(TensorPrimitive::Float(B::grad_hook(
            tensor.into_primitive().tensor(),
            index,
        )));
        Param::from_mapped_value(id, hooked, mapper)
    }
}

/// Replaces every parameter by a fresh autodiff leaf holding the same values.
struct FreshLeaves;

impl<B: AutodiffBackend> ModuleMapper<B> for FreshLeaves {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let fresh = if tensor.is_require_grad() {
            Tensor::from_inner(tensor.inner()).require_grad()
        } else {
            tensor
        };
        Param::from_mapped_value(id, fresh, mapper)
    }
}

impl DataParallel {
    /// Lays out the gradients of `model` (every float parameter, in visit order) in buckets of
    /// about `bucket_elems` values, filled from the last parameter backwards (the order in
    /// which the backward pass finishes them).
    pub fn new<B: Backend, M: Module<B>>(
        model: &M,
        dp: Group,
        bucket_elems: usize,
    ) -> Result<Self, CommError> {
        Self::grouped(model, dp, bucket_elems, &|_| 0)
    }

    /// Like [`new`](Self::new), with no bucket spanning two groups: `group_of` gives each
    /// parameter's group, and a bucket closes wherever the group changes in visit order.
    /// ZeRO-3 groups by unit, so that a unit's gather reads only its own buckets; under ZeRO a
    /// tied copy is a group of its own, so that both pipeline stages cut it into the same
    /// chunks.
    pub fn grouped<B: Backend, M: Module<B>>(
        model: &M,
        dp: Group,
        bucket_elems: usize,
        group_of: &dyn Fn(ParamId) -> usize,
    ) -> Result<Self, CommError> {
        let mut layout = Layout {
            slots: Vec::new(),
            total: 0,
        };
        model.visit(&mut layout);
        let mut buckets: Vec<Bucket> = Vec::new();
        let mut slots = layout.slots;
        // Buckets from the end: contiguous flat ranges, the last parameters first.
        let mut end = layout.total;
        let mut members = 0;
        let mut start = end;
        for i in (0..slots.len()).rev() {
            start = slots[i].offset;
            slots[i].bucket = buckets.len();
            members += 1;
            let boundary = i == 0 || group_of(slots[i - 1].id) != group_of(slots[i].id);
            if boundary || end - start >= bucket_elems.max(1) {
                buckets.push(Bucket {
                    start,
                    end,
                    slots: i..i + members,
                    data: Vec::new(),
                    waiting: members,
                    pending: None,
                    launched: false,
                    acc: Vec::new(),
                    expert: false,
                });
                end = start;
                members = 0;
            }
        }
        debug_assert!(start == 0 || slots.is_empty());
        let held = slots.iter().map(|_| None).collect();
        Ok(Self {
            state: Rc::new(RefCell::new(State {
                slots,
                buckets,
                next_launch: 0,
                reduce_now: false,
                collective: Collective::AllReduce,
                in_flight: std::collections::VecDeque::new(),
                comm: dp.comm()?,
                shard: dp.comm()?,
                replicate: None,
                next_replicate: 0,
                error: None,
                launched_early: 0,
                experts: None,
                expert_shard: None,
                held,
            })),
            dp,
            shard: dp,
        })
    }

    /// This reducer doing `collective` at each bucket, its chunks (when it reads chunks,
    /// [`Collective::reads_chunks`]) cut over the ranks of `sharding` (see [`Sharding`]).
    /// A reducer that reads chunks is read with [`finish_chunks`](Self::finish_chunks), the
    /// others with [`finish`](Self::finish).
    pub fn with_collective(
        mut self,
        collective: Collective,
        sharding: Sharding,
    ) -> Result<Self, CommError> {
        {
            let mut s = self.state.borrow_mut();
            s.collective = collective;
            s.shard = sharding.shard.comm()?;
            // The copies sum the chunks after a reduce-scatter; all-reducing whole buckets
            // sums over every data-parallel rank already.
            s.replicate = match (collective.scatters(), sharding.replicate) {
                (true, Some(r)) => Some(r.comm()?).filter(|c| c.size() > 1),
                _ => None,
            };
            s.expert_shard = sharding.experts.map(|g| g.comm()).transpose()?;
        }
        self.shard = sharding.shard;
        Ok(self)
    }

    /// What this reducer does at each bucket.
    pub fn collective(&self) -> Collective {
        self.state.borrow().collective
    }

    /// This reducer with the routed experts' parameters (`is_expert` picks them; they must not
    /// share a bucket with others: give them their own group in [`grouped`](Self::grouped))
    /// told apart: an expert that got a gradient on any rank of its group gets one on all of
    /// them (zeros where it had no token), as one process would step it. With `apart` (the
    /// ranks holding the same experts, when they are not the data-parallel group: expert or
    /// tensor parallelism), their buckets are all-reduced over that group instead.
    pub fn with_experts(
        self,
        apart: Option<Group>,
        is_expert: &dyn Fn(ParamId) -> bool,
    ) -> Result<Self, CommError> {
        {
            let mut s = self.state.borrow_mut();
            let s = &mut *s;
            for b in &mut s.buckets {
                b.expert = s.slots[b.slots.clone()].iter().any(|x| is_expert(x.id));
            }
            s.experts = apart.map(|g| g.comm()).transpose()?;
        }
        Ok(self)
    }

    /// Which elements of the flat gradients this rank's chunks hold ([`RankChunks`]; with
    /// one rank, everything).
    pub fn rank_chunks(&self) -> RankChunks {
        let s = self.state.borrow();
        let buckets: Vec<(usize, usize)> = s.buckets.iter().map(|b| (b.start, b.end)).collect();
        let apart: Vec<bool> = (0..s.buckets.len()).map(|b| s.apart(b)).collect();
        let holders = |c: &Rc<dyn Communicator>| Holders {
            ranks: c.size(),
            rank: c.rank(),
        };
        let dense = holders(&s.shard);
        let experts =
            (s.experts.as_ref()).map_or(dense, |e| holders(s.expert_shard.as_ref().unwrap_or(e)));
        RankChunks::with_experts(&self.param_ranges(), &buckets, dense, (experts, &apart))
    }

    /// Each parameter's `(offset, len)` in the flat concatenation of the gradients, in visit
    /// order.
    pub fn param_ranges(&self) -> Vec<(usize, usize)> {
        (self.state.borrow().slots.iter())
            .map(|x| (x.offset, x.len))
            .collect()
    }

    /// Whether each parameter (in visit order) received a gradient this step on this rank.
    pub fn seen(&self) -> Vec<bool> {
        self.state.borrow().slots.iter().map(|x| x.seen).collect()
    }

    /// The bucket holding parameter `id` (by visit order), if it is this model's.
    pub fn bucket_of(&self, id: ParamId) -> Option<usize> {
        let s = self.state.borrow();
        s.slots.iter().find(|x| x.id == id).map(|x| x.bucket)
    }

    /// Gradient values this rank's buckets hold during a step: every parameter's when the
    /// micro-batches add up in whole buckets; when reduce-scattering
    /// [every micro-batch](Collective::ReduceScatterEach), this rank's chunks (each bucket then lives
    /// only from its first gradient to its reduce-scatter, within one backward pass).
    pub fn gradient_elements(&self) -> usize {
        let s = self.state.borrow();
        let size = s.shard.size();
        (s.buckets.iter())
            .map(
                |b| match s.collective == Collective::ReduceScatterEach && !b.expert {
                    true => BucketChunks::new(b.start, b.end, size).chunk,
                    false => b.end - b.start,
                },
            )
            .sum()
    }

    /// The DP group.
    pub fn group(&self) -> Group {
        self.dp
    }

    /// Clears the accumulated gradients for a new optimizer step.
    pub fn begin_step(&self) {
        let mut s = self.state.borrow_mut();
        let s = &mut *s;
        s.slots.iter_mut().for_each(|x| x.seen = false);
        s.held.iter_mut().for_each(|h| *h = None);
        for b in &mut s.buckets {
            b.waiting = b.uses(&s.slots);
            b.pending = None;
            b.launched = false;
            b.acc = Vec::new();
            // A one-parameter bucket takes its first gradient as its buffer. Under ZeRO-2 and 3
            // every bucket gets a buffer at its first gradient (what it held is a chunk now),
            // so buffers live from then to their reduce-scatter; all-reducing buckets keep
            // theirs from step to step.
            if s.collective.scatters() || b.slots.len() == 1 {
                b.data = Vec::new();
            }
        }
        s.next_launch = 0;
        s.in_flight.clear();
        s.next_replicate = 0;
        s.launched_early = 0;
        s.error = None;
        s.reduce_now = false;
    }

    /// Says that parameter `id` receives `uses` gradients per micro-batch, from as many
    /// separate backward passes (a tied table used by two units that ZeRO-3 runs backward one
    /// at a time): its bucket starts only after the last of them.
    pub fn set_uses(&self, id: ParamId, uses: usize) {
        let mut s = self.state.borrow_mut();
        if let Some(slot) = s.slots.iter_mut().find(|x| x.id == id) {
            slot.uses = uses.max(1);
        }
    }

    /// Marks whether the next backward pass is the step's last micro-batch, whose completed
    /// buckets start their all-reduce during the backward pass.
    pub fn set_last_micro_batch(&self, last: bool) {
        self.state.borrow_mut().reduce_now = last;
    }

    /// `model` with every parameter wrapped in this reducer's gradient hook, for one forward
    /// pass; activates the reducer on this thread. Gradients are read from the reducer with
    /// [`DataParallel::finish`], not from the returned module.
    ///
    /// Each call gives the parameters fresh autodiff leaves (same values, no copy), so the
    /// graphs of several micro-batches in flight at once (a pipeline) share no node: Burn
    /// 0.21's graph cleanup after one backward pass can otherwise break another pending graph
    /// through a shared parameter leaf.
    pub fn hooked<B: AutodiffBackend + ParallelBackend, M: AutodiffModule<B>>(
        &self,
        model: M,
    ) -> M {
        let state = self.state.clone();
        let on_device = state.borrow().on_device();
        let deliver = move |hook, grad| match grad {
            HookedGrad::Host(values) => state.borrow_mut().on_grad(hook, values),
            HookedGrad::Device(t) => state.borrow_mut().hold::<B::InnerBackend>(hook, t),
        };
        set_grad_sink(Some(GradSink {
            on_device,
            deliver: Rc::new(deliver),
        }));
        model.map(&mut FreshLeaves).map(&mut HookMapper { next: 0 })
    }

    /// Waits for the all-reduces and returns the gradients summed over the micro-batches and
    /// the DP ranks, for the parameters that received one, as Burn's `GradientsParams` for
    /// `model` (the unhooked module). Weight each micro-batch's loss by its share of the global
    /// batch (for example `1 / (dp * micro_batches)`, or its share of the target tokens) so that
    /// the sum is the gradient of the global mean loss. A reducer that
    /// [reads chunks](Collective::reads_chunks) is read with
    /// [`finish_chunks`](Self::finish_chunks) instead.
    pub fn finish<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        model: &M,
    ) -> Result<(GradientsParams, DpStats), CommError> {
        let mut s = self.state.borrow_mut();
        let stats = if s.on_device() {
            s.complete_held::<B::InnerBackend>(model.devices().first())?
        } else {
            let stats = s.complete()?;
            s.share_expert_seen()?;
            stats
        };
        let mut builder = GradBuilder::<B> {
            state: &mut s,
            next: 0,
            grads: GradientsParams::new(),
            _b: std::marker::PhantomData,
        };
        model.visit(&mut builder);
        Ok((builder.grads, stats))
    }

    /// Waits for the reduce-scatters (or all-reduces, under [`Collective::AllReduceChunked`])
    /// and returns this rank's chunk of every bucket (summed over the micro-batches and the DP
    /// ranks; `chunk` values each, zeros past the bucket's end), in bucket order. Under
    /// hybrid sharding each chunk is also all-reduced over the copies, started as soon as its
    /// reduce-scatter is done.
    pub fn finish_chunks(&self) -> Result<(Vec<Vec<f32>>, DpStats), CommError> {
        let mut s = self.state.borrow_mut();
        let stats = s.complete()?;
        s.share_expert_seen()?;
        let scatter = s.collective.scatters();
        let holders: Vec<(usize, usize)> = (0..s.buckets.len())
            .map(|b| {
                let c = s.cut_over(b);
                (c.size(), c.rank())
            })
            .collect();
        let chunks: Vec<Vec<f32>> = (s.buckets.iter_mut().zip(holders))
            .map(|(b, (size, rank))| {
                let c = BucketChunks::new(b.start, b.end, size);
                let mut data = std::mem::take(&mut b.data);
                if !scatter {
                    // All-reduced whole (ZeRO-1): this rank's chunk of it.
                    data.resize(c.len, 0.0);
                    let mine = c.range_of(rank);
                    data = data[mine.start - c.start..mine.end - c.start].to_vec();
                }
                // One rank: its chunk is the whole bucket.
                data.resize(c.chunk, 0.0);
                data
            })
            .collect();
        Ok((chunks, stats))
    }
}

/// Registers the step's gradient of each parameter that got one (in host buckets, or held on
/// the device) with its id, in its shape.
struct GradBuilder<'a, B: AutodiffBackend> {
    state: &'a mut State,
    next: usize,
    grads: GradientsParams,
    _b: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for GradBuilder<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let index = self.next;
        self.next += 1;
        if self.state.on_device() {
            self.register_held(index, param);
            return;
        }
        let Some(slot) = self.state.slots.get(index) else {
            return;
        };
        if !slot.seen {
            return;
        }
        let bucket = slot.bucket;
        let values = if self.state.buckets[bucket].slots.len() == 1 {
            // The bucket is this gradient: hand over its buffer.
            std::mem::take(&mut self.state.buckets[bucket].data)
        } else {
            let Some(values) = self.state.values(index) else {
                return;
            };
            values.to_vec()
        };
        if values.len() != slot.len {
            return;
        }
        let shape = slot.shape.clone();
        let device = param.val().device();
        let g = Tensor::<B::InnerBackend, D>::from_data(TensorData::new(values, shape), &device);
        self.grads.register(param.id, g);
    }
}

impl<B: AutodiffBackend> GradBuilder<'_, B> {
    /// Registers parameter `index`'s gradient held on the device, in `param`'s shape, `f32`.
    fn register_held<const D: usize>(&mut self, index: usize, param: &Param<Tensor<B, D>>) {
        let Some(held) = self.state.take_held::<B::InnerBackend>(index) else {
            return;
        };
        let g = Tensor::<B::InnerBackend, D>::from_primitive(TensorPrimitive::Float(held));
        if g.shape().num_elements() != self.state.slots[index].len {
            return;
        }
        let g = crate::precision::to_f32(g.reshape(param.val().dims()));
        self.grads.register(param.id, g);
    }
}
