//! The mixture-of-experts feed-forward block: router, routed experts (this expert-parallel
//! rank's share), shared experts, auxiliary losses, and the token exchange.

use burn::module::{Module, Param};
use burn::tensor::IndexingUpdateOp;
use burn::tensor::activation::{sigmoid, softmax};
use burn::tensor::{Int, Tensor, TensorData, backend::Backend};

use super::config::{Balance, MoeConfig, RouterScore};
use super::dispatch::{Arrivals, Dispatch, inverse};
use super::expert::{Expert, ExpertInit};
use super::routing::{capacity_keeps, group_loads, loads, min_margin, top_k};
use crate::comm::{Group, ReduceOp};
use crate::expert_ops::{RoutingRecord, exchange, exchange_around, with_aux_loss};
use crate::precision::{like_dtype, to_f32};
use crate::tensor_parallel::{ParallelBackend, param_from_values, sp_param};

/// Where an MoE layer runs: its index, its groups, and which positions its rows hold.
#[derive(Clone, Debug)]
pub struct MoePlace {
    /// The layer's index (0-based block), for messages and metrics.
    pub layer: usize,
    /// The expert-parallel group: its ranks split the experts and exchange tokens.
    pub ep: Group,
    /// Under sequence parallelism, the TP group (its ranks hold parts of the sequences).
    pub sp: Option<Group>,
    /// Under context parallelism, the cp group (its ranks hold parts of the sequences).
    pub cp: Option<Group>,
    /// The positions of each sequence this rank's rows hold (`None`: all, in order).
    pub rows: Option<Vec<usize>>,
    /// The sequence length.
    pub seq: usize,
}

impl MoePlace {
    /// Layer `layer` on one rank holding whole sequences of `seq` tokens.
    pub fn single(layer: usize, seq: usize) -> Self {
        Self {
            layer,
            ep: Group::local(),
            sp: None,
            cp: None,
            rows: None,
            seq,
        }
    }

    /// The process groups whose ranks split each routing group's tokens.
    fn split_groups(&self) -> impl Iterator<Item = Group> {
        self.sp.into_iter().chain(self.cp).filter(|g| g.size() > 1)
    }
}

/// A failure of this rank inside the layer's forward pass (routing past the stated bound, a
/// failed exchange): the job ends as a failed rank ([`crate::comm::fail`]: `merak: rank R
/// failed: ...`, exit status 1), not as a panic.
fn failed(e: impl std::fmt::Display) -> ! {
    crate::comm::fail(format!("mixture of experts: {e}"))
}

/// A broken invariant of the layer (a bug, not an input): a panic.
fn fatal(e: impl std::fmt::Display) -> ! {
    panic!("mixture of experts: {e}")
}

/// The mixture-of-experts block `[batch, seq, hidden] -> [batch, seq, hidden]`.
#[derive(Module, Debug)]
pub struct MoeLayer<B: Backend> {
    /// The router's projection `[hidden, experts]` (computed in f32).
    pub router: Param<Tensor<B, 2>>,
    /// The routed experts by global index: this expert-parallel rank's are `Some`.
    pub experts: Vec<Option<Expert<B>>>,
    /// The shared experts, as one network of their summed width (`None`: none).
    pub shared: Option<Expert<B>>,
    /// The experts' selection biases of auxiliary-loss-free balancing (`[experts]`; `None`
    /// when `bias_update_rate` is 0): moved by [`balance`](Self::balance), never by a
    /// gradient.
    pub bias: Option<Param<Tensor<B, 1>>>,
    #[module(skip)]
    cfg: MoeConfig,
    #[module(skip)]
    place: MoePlace,
}

impl<B: ParallelBackend> MoeLayer<B> {
    /// The layer of `cfg` on `hidden`-wide tokens, named `name` (its parameters' random
    /// streams), holding the experts of rank `place.ep.rank()` of the expert-parallel group.
    /// [`MoeConfig::check_ep`] must have passed for the group's size.
    pub fn new(
        cfg: &MoeConfig,
        hidden: usize,
        name: &str,
        init: ExpertInit<'_>,
        place: MoePlace,
        device: &B::Device,
    ) -> Self {
        let router = init
            .rng
            .normal(&format!("{name}.router"), hidden * cfg.experts, init.std);
        let local = cfg.experts / place.ep.size().max(1);
        let mine = place.ep.rank() * local..(place.ep.rank() + 1) * local;
        let experts = (0..cfg.experts)
            .map(|e| {
                mine.contains(&e).then(|| {
                    let name = format!("{name}.experts.{e}");
                    Expert::new(
                        &name,
                        hidden,
                        cfg.expert_hidden,
                        cfg.activation,
                        init,
                        device,
                    )
                })
            })
            .collect();
        let width = cfg.shared_experts * cfg.expert_hidden;
        let shared = (cfg.shared_experts > 0).then(|| {
            let name = format!("{name}.shared");
            Expert::new(&name, hidden, width, cfg.activation, init, device)
        });
        let bias = (cfg.bias_update_rate > 0.0)
            .then(|| param_from_values(vec![0.0; cfg.experts], [cfg.experts], device));
        Self {
            router: param_from_values(router, [hidden, cfg.experts], device),
            experts,
            shared,
            bias,
            cfg: cfg.clone(),
            place,
        }
    }

    /// The settings.
    pub fn config(&self) -> &MoeConfig {
        &self.cfg
    }

    /// Where the layer runs.
    pub fn place(&self) -> &MoePlace {
        &self.place
    }

    /// The same layer run at `place` (its expert-parallel group must be the one it was built
    /// for: the experts it holds do not change).
    pub fn set_place(&mut self, place: MoePlace) {
        self.place = place;
    }

    /// `[batch, seq, hidden] -> [batch, seq, hidden]`: every token through its top-k experts
    /// (weighted by its gates) and the shared experts; the auxiliary losses ride on the output
    /// into the backward pass ([`with_aux_loss`]).
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, n, h] = x.dims();
        let (t, k, e) = (b * n, self.cfg.top_k, self.cfg.experts);
        let xf = x.reshape([t, h]);
        let logits = to_f32(xf.clone()).matmul(sp_param(self.router.val(), self.place.sp));
        let scores = match self.cfg.score {
            RouterScore::Softmax => softmax(logits.clone(), 1),
            RouterScore::Sigmoid => sigmoid(logits.clone()),
        };
        // The choice sees the balancing biases; the gates do not.
        let mut host = host_values(scores.clone());
        if let Some(bias) = &self.bias {
            let bias = host_values(bias.val());
            host.chunks_exact_mut(e)
                .for_each(|row| row.iter_mut().zip(&bias).for_each(|(s, b)| *s += b));
        }
        let choice = top_k(&host, None, e, k);
        let local_loads = loads(&choice, e);
        let groups = self.groups(b);
        let per_group = group_loads(&choice, e, k, t / groups);
        let per_group = self.routing_sum(per_group.iter().map(|&v| v as f32).collect());
        let group_tokens = t / groups * self.routing_size();
        let kept = self.kept(&choice, [b, n], groups, group_tokens);
        let dropped = kept.iter().filter(|&&k| !k).count();
        let device = xf.device();
        let choice_t = ints(choice.iter().map(|&c| c as i64).collect(), [t, k], &device);
        let mut gates = scores.clone().gather(1, choice_t);
        if self.cfg.renormalize {
            gates = gates.clone() / gates.sum_dim(1);
        }
        let (routed, shared) = self.routed(xf, gates, &choice, &kept);
        let y = match shared {
            Some(s) => routed + s,
            None => routed,
        };
        let y = y.reshape([b, n, h]);
        let aux = self.aux_loss(&logits, scores, &per_group, group_tokens);
        let record = RoutingRecord {
            layer: self.place.layer,
            aux_loss: f64::from(host_values(aux.clone())[0]),
            loads: local_loads,
            dropped,
            margin: min_margin(&host, e, k),
        };
        with_aux_loss(y, aux, record)
    }

    /// Auxiliary-loss-free balancing after a step: each expert's selection bias moves by the
    /// rate towards balance, given the step's `loads` (assignments per expert of this layer,
    /// over the whole grid). No effect without biases.
    pub fn balance(&mut self, loads: &[u64]) {
        let Some(bias) = &self.bias else {
            return;
        };
        let rate = self.cfg.bias_update_rate as f32;
        let mean = loads.iter().sum::<u64>() as f32 / loads.len().max(1) as f32;
        let toward_mean = |load: u64| match (load as f32).partial_cmp(&mean) {
            Some(std::cmp::Ordering::Less) => rate,
            Some(std::cmp::Ordering::Greater) => -rate,
            _ => 0.0,
        };
        let moved: Vec<f32> = (host_values(bias.val()).iter().zip(loads))
            .map(|(b, &l)| b + toward_mean(l))
            .collect();
        let device = bias.val().device();
        let n = moved.len();
        self.bias = Some(Param::initialized(
            bias.id,
            Tensor::from_data(TensorData::new(moved, [n]), &device),
        ));
    }

    /// Sums `values` over the ranks that split the routing group's tokens.
    fn routing_sum(&self, mut values: Vec<f32>) -> Vec<f32> {
        for g in self.place.split_groups() {
            let comm = g.comm().unwrap_or_else(|e| failed(e));
            comm.all_reduce(&mut values, ReduceOp::Sum)
                .unwrap_or_else(|e| failed(e));
        }
        values
    }

    /// Ranks that split a routing group's tokens.
    fn routing_size(&self) -> usize {
        self.place.split_groups().map(|g| g.size()).product()
    }

    /// The routing groups of a micro-batch of `batch` sequences ([`MoeConfig::balance`]): one
    /// per sequence, or the whole micro-batch.
    fn groups(&self, batch: usize) -> usize {
        match self.cfg.balance {
            Balance::Sequence => batch.max(1),
            Balance::MicroBatch => 1,
        }
    }

    /// Which assignments are computed: all of them (dropless), or those the capacity keeps in
    /// global token order within each of the `groups` routing groups of the micro-batch
    /// (`[batch, n]` tokens here) of `group_tokens` tokens each.
    fn kept(
        &self,
        choice: &[usize],
        [batch, n]: [usize; 2],
        groups: usize,
        group_tokens: usize,
    ) -> Vec<bool> {
        let k = self.cfg.top_k;
        let Some(_) = self.cfg.capacity_factor else {
            return vec![true; choice.len()];
        };
        let limit = self.cfg.expert_limit(group_tokens);
        // A group's global token indices share their quotient by `span`.
        let span = self.place.seq * (batch / groups).max(1);
        // Each token with its global index, gathered over the routing group.
        let mut mine = Vec::with_capacity(batch * n * (1 + k));
        for (tok, chosen) in choice.chunks_exact(k).enumerate() {
            let (s, r) = (tok / n, tok % n);
            let pos = self.place.rows.as_ref().map_or(r, |rows| rows[r]);
            mine.push(s * self.place.seq + pos);
            mine.extend_from_slice(chosen);
        }
        let mut group: Vec<f32> = mine.iter().map(|&v| v as f32).collect();
        for g in self.place.split_groups() {
            let comm = g.comm().unwrap_or_else(|e| failed(e));
            let mut all = vec![0.0; group.len() * g.size()];
            comm.all_gather(&group, &mut all)
                .unwrap_or_else(|e| failed(e));
            group = all;
        }
        let group: Vec<usize> = group.iter().map(|&v| v as usize).collect();
        let keeps = capacity_keeps(&group, k, limit, span);
        mine.chunks_exact(1 + k)
            .flat_map(|t| keeps.get(&t[0]).cloned().unwrap_or_else(|| vec![false; k]))
            .collect()
    }

    /// The routed experts' weighted outputs `[tokens, hidden]`: the kept assignments' rows sent
    /// to their experts' ranks, computed there expert by expert, sent back and summed per
    /// token with their gates; and the shared experts' outputs, computed while the rows travel
    /// ([`MoeConfig::shared_overlap`]) or before.
    fn routed(
        &self,
        xf: Tensor<B, 2>,
        gates: Tensor<B, 2>,
        choice: &[usize],
        kept: &[bool],
    ) -> (Tensor<B, 2>, Option<Tensor<B, 2>>) {
        let [t, h] = xf.dims();
        let device = xf.device();
        let ep = self.place.ep;
        let d = Dispatch::new(choice, kept, self.cfg.top_k, self.cfg.experts);
        let local = self.cfg.experts / ep.size();
        let arrivals = self.arrivals(&d, local);
        self.check_load(&arrivals, t);
        let counts = arrivals.counts(d.send_counts(ep.size()));
        let rows = d.tokens.len();
        let tokens = ints(d.tokens.clone(), [rows], &device);
        let shared = || (self.shared.as_ref()).map(|s| s.forward(xf.clone(), self.place.sp));
        let rows_out = xf.clone().select(0, tokens.clone());
        let (sent, shared) = match self.cfg.shared_overlap {
            true => exchange_around(rows_out, &counts, ep, shared),
            false => {
                let shared = shared();
                (exchange(rows_out, &counts, ep), shared)
            }
        };
        let order = arrivals.expert_order();
        let inv = inverse(&order);
        let grouped = sent
            .clone()
            .select(0, ints(order.clone(), [order.len()], &device));
        let first = ep.rank() * local;
        let mut outs = Vec::new();
        let mut at = 0;
        for (i, &m) in arrivals.per_expert().iter().enumerate() {
            if m == 0 {
                continue;
            }
            let expert = self.experts[first + i]
                .as_ref()
                .unwrap_or_else(|| fatal("an expert of this rank is not built"));
            outs.push(expert.forward(grouped.clone().narrow(0, at, m), None));
            at += m;
        }
        // With no row to compute, the exchanges still run (and their backward passes): the
        // empty rows keep the graph connected.
        let computed = match outs.is_empty() {
            true => grouped * 0.0,
            false => Tensor::cat(outs, 0),
        };
        let back = computed.select(0, ints(inv.clone(), [inv.len()], &device));
        let returned = exchange(back, &counts.reversed(), ep);
        let slots = ints(d.slots, [rows], &device);
        let g = like_dtype(
            gates.reshape([t * self.cfg.top_k]).select(0, slots),
            returned.dtype(),
        );
        let weighted = returned * g.reshape([rows, 1]);
        let zeros = Tensor::<B, 2>::zeros([t, h], &device).cast(weighted.dtype());
        let routed = zeros.select_assign(0, tokens, weighted, IndexingUpdateOp::Add);
        (routed, shared)
    }

    /// Under dropless expert parallelism, stops when this rank receives more rows than the
    /// stated bound the memory check counts: `max_load` times the mean, which is
    /// the `tokens × top_k` rows every rank sends (at ep = 1 a rank computes its own rows, however
    /// they are routed).
    fn check_load(&self, arrivals: &Arrivals, tokens: usize) {
        if self.place.ep.size() == 1 || self.cfg.capacity_factor.is_some() {
            return;
        }
        let received = arrivals.per_expert();
        let mean = tokens * self.cfg.top_k;
        if let Err(e) = within_bound(self.place.layer, &received, mean, self.cfg.max_load) {
            failed(e);
        }
    }

    /// The rows each local expert receives from each rank (the counts are exchanged first).
    fn arrivals(&self, d: &Dispatch, local: usize) -> Arrivals {
        let ep = self.place.ep;
        if ep.size() == 1 {
            return Arrivals {
                matrix: d.per_expert.clone(),
                local,
            };
        }
        let send: Vec<f32> = d.per_expert.iter().map(|&v| v as f32).collect();
        let mut recv = vec![0.0; send.len()];
        let comm = ep.comm().unwrap_or_else(|e| failed(e));
        let t0 = std::time::Instant::now();
        comm.all_to_all(&send, &mut recv)
            .unwrap_or_else(|e| failed(e));
        crate::expert_ops::exchange::count_seconds(t0.elapsed().as_secs_f64());
        Arrivals {
            matrix: recv.iter().map(|&v| v as usize).collect(),
            local,
        }
    }

    /// This rank's part of the layer's auxiliary losses (`[1]`, f32), the mean over the
    /// micro-batch's routing groups of each group's Switch loss `w E Σ_i f_i P_i` (`f_i` the
    /// group's share of assignments to expert `i`, `P_i` its mean score) and z-loss
    /// `w mean(logsumexp(logits)²)`. `group_loads` holds every group's loads summed over the
    /// ranks that split it (`[groups][E]`), each group of `group_tokens` tokens; this rank's
    /// tokens are its groups' in order. The ranks' parts add up to the groups' losses.
    fn aux_loss(
        &self,
        logits: &Tensor<B, 2>,
        scores: Tensor<B, 2>,
        group_loads: &[f32],
        group_tokens: usize,
    ) -> Tensor<B, 1> {
        let device = logits.device();
        let [t, e] = scores.dims();
        let k = self.cfg.top_k;
        let groups = group_loads.len() / e.max(1);
        // Every group weighs 1 / groups, each of its tokens 1 / group_tokens.
        let per_token = (group_tokens * groups) as f32;
        let mut aux = Tensor::<B, 1>::zeros([1], &device);
        if self.cfg.aux_loss > 0.0 {
            let f: Vec<f32> = (group_loads.iter())
                .map(|&l| l / (group_tokens * k) as f32)
                .collect();
            let f = Tensor::<B, 2>::from_data(TensorData::new(f, [groups, e]), &device);
            let p = scores.reshape([groups, t / groups.max(1), e]).sum_dim(1);
            let fp = (p.reshape([groups, e]) * f).sum().reshape([1]) / per_token;
            aux = aux + fp * (self.cfg.aux_loss as f32 * e as f32);
        }
        if self.cfg.z_loss > 0.0 {
            let max = logits.clone().max_dim(1).detach();
            let lse = (logits.clone() - max.clone()).exp().sum_dim(1).log() + max;
            let z = lse.powi_scalar(2).sum().reshape([1]) / per_token;
            aux = aux + z * self.cfg.z_loss as f32;
        }
        aux
    }
}

/// Whether the rows an expert-parallel rank `received` for its experts in layer `layer` stay
/// within the stated bound: `bound` (`model.moe.max_load`) times `mean`, the rows every rank
/// sends; otherwise the message that stops the run.
pub fn within_bound(
    layer: usize,
    received: &[usize],
    mean: usize,
    bound: usize,
) -> Result<(), String> {
    let total: usize = received.iter().sum();
    let limit = bound.saturating_mul(mean);
    if total <= limit {
        return Ok(());
    }
    let needed = total.div_ceil(mean.max(1));
    Err(format!(
        "layer {layer}: this expert-parallel rank received {total} token rows for its experts \
         ({received:?}) in a micro-batch, more than the stated bound model.moe.max_load = \
         {bound} x the mean of {mean} that the memory check counts; raise it to {needed} or \
         more (a resume may: --set model.moe.max_load={needed}; the memory check counts the \
         raised bound), set model.moe.capacity_factor to drop what exceeds an expert's \
         capacity, or lower parallel.ep"
    ))
}

/// A tensor's values on the host, as f32.
fn host_values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    crate::host_read::floats(t)
        .unwrap_or_else(|e| fatal(format!("cannot read the router's scores: {e}")))
}

/// An integer tensor of `values`.
fn ints<B: Backend, const D: usize>(
    values: Vec<i64>,
    shape: [usize; D],
    device: &B::Device,
) -> Tensor<B, D, Int> {
    Tensor::from_data(TensorData::new(values, shape), device)
}
