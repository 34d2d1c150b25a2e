//! The communication terms of the cost model: ring all-reduces, tensor parallelism's exposed
//! all-reduces, context parallelism's ring, expert parallelism's all-to-alls and expert
//! gradients, pipeline messages, and the data-parallel work after the pipeline drains.

use super::{CostModel, Layout, RankMemory};
use crate::data_parallel::ReduceScatter;
use crate::planner::hardware::Runtime;
use crate::planner::model::{BYTES_16BIT, RankSplit, UnitProfile};

/// Gradient tensors per unit the host buffers copy one by one: a transformer layer's weights
/// and biases (two LayerNorms, the attention's two projections and the MLP's two, each a weight
/// and a bias).
pub(crate) const GRADIENT_TENSORS_PER_UNIT: f64 = 12.0;

/// A pipeline rank's data-parallel work after its pipeline drains
/// ([`CostModel::data_parallel_tail`]).
pub(super) struct DataParallelTail {
    /// Seconds of gradient reduction the backward pass does not hide.
    pub(super) exposed: f64,
    /// Seconds of the all-gather of the updated values.
    pub(super) allgather: f64,
    /// Parameters the rank's optimizer steps.
    pub(super) local_params: f64,
}

impl<'a> CostModel<'a> {
    /// Seconds of one ring all-reduce of `bytes` over `n` ranks spanning `span` ranks.
    pub(super) fn allreduce(&self, bytes: f64, n: usize, span: usize) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let (bw, lat) = self.hardware.link(span);
        2.0 * (n - 1) as f64 / n as f64 * bytes / bw + lat
    }

    /// Exposed seconds of `n` tensor-parallel all-reduces of `bytes` each over `t` ranks, each
    /// after a block of `compute_s / n` seconds of compute it depends on, with the micro-batch's
    /// tokens split into `k` chunks (sub-pipelined tensor parallelism): per block, chunk `i`'s
    /// all-reduce `a` (of `bytes / k`) runs while chunk `i + 1` computes (`c = compute_s / (n k)`),
    /// so a block exposes `a + (k - 1) * (max(0, a - c) + slowdown * min(a, c))`: the last
    /// chunk's all-reduce, what the compute cannot hide, and the compute lost to the contention
    /// of overlapped communication
    /// ([`HardwareSpec::tp_overlap_slowdown`](crate::planner::HardwareSpec::tp_overlap_slowdown)).
    /// `k = 1` gives `n * a` (nothing hidden); a larger `k` hides more but pays the latency `k`
    /// times.
    pub(crate) fn tp_exposed(&self, n: u32, bytes: f64, t: usize, compute_s: f64, k: usize) -> f64 {
        if n == 0 || t <= 1 {
            return 0.0;
        }
        let k = k.max(1);
        let a = self.allreduce(bytes / k as f64, t, t);
        if k == 1 {
            return n as f64 * a;
        }
        let c = compute_s / n as f64 / k as f64;
        let hidden_slowdown = self.hardware.tp_overlap_slowdown * a.min(c);
        n as f64 * (a + (k - 1) as f64 * ((a - c).max(0.0) + hidden_slowdown))
    }

    /// Exposed seconds of context parallelism's ring for one micro-batch of `b` sequences of
    /// `u` on a rank of `split`: (forward, backward). Each rank holds the keys and values of its
    /// `s/cp` tokens, `kv = kv_elements b / (cp t)` elements; a hop sends them to the next rank
    /// of the group (ranks `t` apart, on the node's links when `t cp` fit in a node) while the
    /// rank computes its queries against the block it holds, `1/cp` of its attention. Forward:
    /// `cp - 1` hops of `kv`, each exposing what that block's compute does not hide; backward:
    /// `cp - 1` hops of the keys and values with their gradients (`2 kv`) behind the block's
    /// backward (twice the forward's compute), and the last hop of the gradients home, exposed
    /// (the projections' backward waits for it).
    pub(super) fn ring_exposed(&self, u: &UnitProfile, b: usize, split: RankSplit) -> (f64, f64) {
        let c = split.cp.max(1);
        if c == 1 || u.kv_elements <= 0.0 {
            return (0.0, 0.0);
        }
        let (t, cf) = (split.tp.max(1), c as f64);
        let kv = u.kv_elements * b as f64 / (cf * t as f64) * self.element_bytes();
        let (bw, lat) = self.hardware.link(t * c);
        let hop = |bytes: f64| bytes / bw + lat;
        let rank_attention =
            u.attention_flops * b as f64 / (self.hardware.achievable_flops() * t as f64 * cf);
        let block = rank_attention / cf;
        let hops = (c - 1) as f64;
        let forward = hops * (hop(kv) - block).max(0.0);
        let backward = hops * (hop(2.0 * kv) - 2.0 * block).max(0.0) + hop(kv);
        (forward, backward)
    }

    /// Seconds of one all-to-all in which each of `n` ranks, `stride` devices apart, sends
    /// `bytes` spread evenly over the group (`bytes / n` to each member, its own share
    /// staying): the members on its node (`devices_per_node / stride` of them, all when the
    /// group fits in a node) get theirs over the node's links, the others over the inter-node
    /// links, both at once, so the slower of the two sets the time, plus the latency of the
    /// link the group spans. A group within a node moves `(n - 1)/n` of the bytes at the
    /// node's bandwidth.
    fn alltoall(&self, bytes: f64, n: usize, stride: usize) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let hw = self.hardware;
        let stride = stride.max(1);
        let on_node = (hw.devices_per_node / stride).clamp(1, n);
        let (intra_bw, _) = hw.link(1);
        let (inter_bw, _) = hw.link(usize::MAX);
        let (_, latency) = hw.link(stride.saturating_mul(n));
        let share = bytes / n as f64;
        let intra = share * (on_node - 1) as f64 / intra_bw;
        let inter = share * (n - on_node) as f64 / inter_bw;
        intra.max(inter) + latency
    }

    /// Seconds of expert parallelism's all-to-alls for one micro-batch of `b` sequences of `u`
    /// on a rank of `split`, per pass (forward; backward the same): a dispatch and a combine,
    /// each of the rank's `a2a_elements b / cp` values (`1/tp` of them under sequence
    /// parallelism: a TP rank routes its own positions) over the `ep` ranks of its group,
    /// `tp` devices apart (consecutive ranks of the `dp x cp` that hold the same parameters).
    pub(super) fn alltoall_exposed(&self, u: &UnitProfile, b: usize, split: RankSplit) -> f64 {
        if split.ep <= 1 || u.a2a_elements <= 0.0 {
            return 0.0;
        }
        let tokens = b as f64 / (split.cp.max(1) as f64 * split.replicated_divisor());
        let bytes = u.a2a_elements * tokens * self.element_bytes();
        2.0 * self.alltoall(bytes, split.ep, split.tp)
    }

    /// Seconds one rank of `split` spends per forward pass of a micro-batch streaming its routed
    /// experts' weights (`params_expert / ep` 16-bit values) from memory (the backward pass
    /// twice: it reads them for the input gradients and writes their gradients). A routed
    /// expert's matrix product over `m` tokens (`2 M h f m` FLOPs for `M` matrices of `h f`)
    /// then runs at `m / (m + m*)` of the achievable rate, with `m* = F / B` (achievable FLOP/s
    /// over memory bandwidth, 256 tokens on an H100 preset): a small share of tokens per expert
    /// (many experts, small micro-batches, little expert parallelism) makes the experts'
    /// products memory-bound, where a dense layer's products see `b s` tokens.
    pub(super) fn expert_weights_s(&self, u: &UnitProfile, split: RankSplit) -> f64 {
        if u.params_expert == 0 {
            return 0.0;
        }
        let weights = u.params_expert as f64 / split.ep.max(1) as f64 * BYTES_16BIT;
        weights / self.hardware.memory_bandwidth
    }

    /// A ring all-reduce of `bytes` of routed experts' values over `n` ranks spanning `span`
    /// devices; nothing (not even the latency) when the rank holds no experts.
    pub(super) fn expert_allreduce(&self, bytes: f64, n: usize, span: usize) -> f64 {
        if bytes > 0.0 {
            self.allreduce(bytes, n, span)
        } else {
            0.0
        }
    }

    /// Seconds of the routed experts' gradient reduction and of the all-gather of their
    /// updated values (ZeRO stages 1 and 2) on a rank of `layout` holding `bytes` of their
    /// gradients, with `holders` ranks holding the same experts (`dp cp / ep` and their `tp`
    /// peers, which route other positions to the same experts): a ring all-reduce over them,
    /// spanning the `dp x cp x tp` devices of the data-parallel group (its reduce-scatter half
    /// under ZeRO, whose chunks are cut over the same ranks; the all-gather half after the
    /// update). Overlapped with the backward pass like the dense gradients'.
    fn expert_exchange(&self, bytes: f64, layout: &Layout, holders: usize) -> (f64, f64) {
        let span = layout.replicas() * layout.tp;
        let reduce = self.expert_allreduce(bytes, holders, span);
        match layout.zero {
            0 => (reduce, 0.0),
            1 | 2 => (reduce / 2.0, reduce / 2.0),
            _ => (reduce / 2.0, 0.0),
        }
    }

    /// The exposed seconds of a whole all-reduce of `grad_bytes` over `d` ranks lasting `full`
    /// after a last backward pass of `last_backward`, given the host buffers' `copies`
    /// ([`host_buffer_s`](Self::host_buffer_s)).
    fn allreduce_exposed(
        &self,
        full: f64,
        grad_bytes: f64,
        (d, last_backward): (usize, f64),
        copies: Option<f64>,
    ) -> f64 {
        let runtime = self.hardware.runtime;
        match copies {
            // The published runtime's device buckets overlap the backward pass.
            None if runtime == Runtime::Published => (full - last_backward).max(0.0),
            // merak's device buffers: every bucket all-reduced after the backward pass,
            // through host memory without NCCL.
            None if d > 1 && !runtime.nccl() => {
                full + 2.0 * grad_bytes / self.hardware.host_copy_bandwidth()
            }
            None => full,
            Some(copies) => (full - last_backward).max(0.0) + copies,
        }
    }

    /// Seconds a rank of `layout` holding `bytes` of gradients over `units` units spends
    /// copying them into host buffers and back when its runtime is merak's and keeps them
    /// there (`gradient_buffers`; `None`: it keeps them on the device, or the runtime is the
    /// published one, whose device buckets cost nothing beyond the all-reduce). Each
    /// micro-batch's gradients go down and the sums come back up at the host link's bandwidth,
    /// and the device waits [`gradient_copy_stall_s`](crate::planner::HardwareSpec::gradient_copy_stall_s)
    /// per gradient copied ([`GRADIENT_TENSORS_PER_UNIT`] a unit).
    fn host_buffer_s(&self, layout: &Layout, bytes: f64, units: usize) -> Option<f64> {
        let hw = self.hardware;
        let on_device =
            (layout.gradient_buffers).on_device(layout.zero, layout.replicas(), hw.runtime.nccl());
        if hw.runtime == Runtime::Published || on_device {
            return None;
        }
        let m = layout.micro_batches.max(1) as f64;
        let transfers = (m + 1.0) * bytes / hw.host_copy_bandwidth();
        let stalls = m * units as f64 * GRADIENT_TENSORS_PER_UNIT * hw.gradient_copy_stall_s;
        Some(transfers + stalls)
    }

    /// Seconds of one pipeline message (an activation or its gradient) between two stages.
    pub(super) fn pp_message_time(&self, layout: &Layout) -> f64 {
        let (pp_bw, pp_lat) = self.hardware.link(2 * layout.replicas() * layout.tp);
        self.model
            .pp_message_bytes_per_rank(layout.micro_batch, layout.split())
            / BYTES_16BIT
            * self.element_bytes()
            / pp_bw
            + pp_lat
    }

    /// A pipeline rank's data-parallel work after its last backward pass (which lasted
    /// `last_backward` and hides what it can): the exposed gradient reduction, the all-gather
    /// of ZeRO's updated values, and the parameters its optimizer steps.
    pub(super) fn data_parallel_tail(
        &self,
        layout: &Layout,
        memory: &RankMemory,
        (last_backward, units): (f64, usize),
    ) -> DataParallelTail {
        let (t, d) = (layout.tp, layout.replicas());
        let s = Self::shard_ranks(layout);
        let expert_shard = layout.state_sharding().expert_shard;
        let rank_params = memory.params;
        let grad_bytes = rank_params * self.element_bytes();
        let experts = memory.expert_params;
        let (expert_reduce, expert_gather) =
            self.expert_exchange(experts * self.element_bytes(), layout, expert_shard);
        let copies = self.host_buffer_s(
            layout,
            (rank_params + experts) * self.element_bytes(),
            units,
        );
        if layout.zero == 0 {
            let full = self.allreduce(grad_bytes, d, d * t) + expert_reduce;
            return DataParallelTail {
                exposed: self.allreduce_exposed(full, grad_bytes, (d, last_backward), copies),
                allgather: 0.0,
                local_params: rank_params + experts,
            };
        }
        // Reduce-scattered every micro-batch: m collectives, each hidden behind its
        // micro-batch's backward pass as far as it goes.
        let scatters = if layout.zero >= 2 && layout.reduce_scatter == ReduceScatter::MicroBatch {
            layout.micro_batches.max(1) as f64
        } else {
            1.0
        };
        // Reduce-scatter (half a ring all-reduce) overlaps the backward pass; the all-gather
        // of the updated 16-bit parameters does not.
        let half = self.allreduce(grad_bytes, s, s * t) / 2.0;
        // Under hybrid sharding each chunk is all-reduced over the copies (the experts' chunks
        // too, where their holders are cut within each copy).
        let replicate = self.allreduce(grad_bytes / s as f64, d / s, d * t)
            + self.expert_allreduce(
                experts * self.element_bytes() / expert_shard as f64,
                (layout.expert_replicas() * t / expert_shard).max(1),
                d * t,
            );
        let exchange = match self.calibration {
            // Measured at dp = the calibration's ranks; scaled by the ring's (d-1)/d.
            Some(c) if c.ranks > 1 => {
                let at = |n: usize| (n - 1) as f64 / n as f64;
                c.zero1_s_per_param * rank_params * at(s) / at(c.ranks)
            }
            _ => half,
        };
        DataParallelTail {
            // The copies' all-reduce starts as each chunk is reduced, during the backward
            // pass; m reduce-scatters expose m times what one does.
            exposed: (half + replicate + expert_reduce - last_backward).max(0.0)
                + (scatters - 1.0) * (half - last_backward).max(0.0)
                + copies.unwrap_or(0.0),
            // ZeRO-3 keeps its slices: no all-gather after the update, but without resharding
            // one of the whole parameters before the step's first forward pass.
            allgather: if s > 1 && (layout.zero < 3 || !layout.reshard_after_forward) {
                exchange + expert_gather
            } else {
                expert_gather
            },
            local_params: rank_params / s as f64 + experts / expert_shard as f64,
        }
    }
}
