//! The program the context-parallel tests run under `mpirun`: `cp-worker ring` or `cp-worker
//! ulysses`.
//!
//! Every rank builds the same random batch of fused Q/K/V projections of whole sequences
//! (fixed seed) and a random upstream gradient, takes its zigzag shard of both, runs
//! [`ring_attention`] (2 heads) or [`ulysses_attention`] (4 heads, 6 on 3 ranks: the ranks
//! must divide them) over the world's ranks on `Autodiff<Flex>` and backpropagates. It then
//! compares its shard of the context and of the Q/K/V gradient with its shard of the
//! single-rank [`attention`] (same backend) of the whole sequences: relative error
//! `||ring - whole|| / ||whole||` (over the rank's shard) at most `1e-5`, causal and
//! bidirectional, without and with segment ids (documents whose boundaries cross the chunk
//! boundaries). The forward pass on the plain backend must give the same context. A mismatch
//! panics (the panic hook aborts the job, so the test sees a non-zero exit); on success every
//! rank prints `rank R: SCENARIO ok`.

use std::rc::Rc;

use burn::tensor::{Int, Tensor, TensorData, backend::Backend};
use merak_burn::backend::{Cpu, CpuAutodiff};
use merak_burn::comm::{Group, MpiWorld};
use merak_burn::context_parallel::{
    ContextParallelBackend, ZigZag, ring_attention, ulysses_attention,
};
use merak_burn::kernels::{AttentionSpec, attention, attention_in_segments};
use merak_tests::rel_err;

type B = CpuAutodiff;

/// The largest relative error allowed.
const TOL: f64 = 1e-5;
/// Sequences per batch.
const BATCH: usize = 2;
/// Attention heads of the ring.
const RING_HEADS: usize = 2;
/// Features per head.
const HEAD_DIM: usize = 16;

fn main() {
    let scenario = std::env::args().nth(1).unwrap_or_default();
    let mpi = MpiWorld::init().expect("MPI initialises");
    let group = Group::register(Rc::new(mpi.world()));
    match scenario.as_str() {
        "ring" => every_case(group, Variant::Ring),
        "ulysses" => every_case(group, Variant::Ulysses),
        other => panic!("unknown scenario {other:?}"),
    }
    println!("rank {}: {scenario} ok", group.rank());
}

/// The context-parallel attention under test.
#[derive(Clone, Copy, Debug)]
enum Variant {
    /// [`ring_attention`].
    Ring,
    /// [`ulysses_attention`].
    Ulysses,
}

impl Variant {
    /// The heads of the test on `cp` ranks: the all-to-all needs `cp` to divide them.
    fn heads(self, cp: usize) -> usize {
        match self {
            Variant::Ring => RING_HEADS,
            Variant::Ulysses if 4 % cp == 0 => 4,
            Variant::Ulysses => 2 * cp,
        }
    }

    /// The attention of this rank's shard.
    fn run<Bk: ContextParallelBackend>(
        self,
        qkv: Tensor<Bk, 3>,
        spec: AttentionSpec,
        segments: Option<Tensor<Bk, 2, Int>>,
        group: Group,
    ) -> Tensor<Bk, 3> {
        match self {
            Variant::Ring => ring_attention(qkv, spec, segments, group),
            Variant::Ulysses => ulysses_attention(qkv, spec, segments, group),
        }
    }
}

/// Every case: two sequence lengths (chunks shorter and longer than the kernel's blocks),
/// causal or not, without and with segment ids.
fn every_case(group: Group, variant: Variant) {
    for seq in [48, 768] {
        for causal in [true, false] {
            for segments in [false, true] {
                check(group, variant, seq, causal, segments);
            }
        }
    }
}

/// Deterministic values in `[-1, 1)` from `seed`, the same on every rank.
fn values(n: usize, seed: u64) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let mut x = (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed;
            x ^= x >> 31;
            x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x ^= x >> 29;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Segment ids of `BATCH` sequences of `seq` tokens: documents of 5, 13, 7, 21, 3 and 11
/// tokens in turn (each row starting elsewhere in the cycle), so their boundaries fall inside
/// and across the zigzag chunks.
fn documents(seq: usize) -> Vec<i64> {
    const LENGTHS: [usize; 6] = [5, 13, 7, 21, 3, 11];
    let mut ids = Vec::with_capacity(BATCH * seq);
    for b in 0..BATCH {
        let (mut id, mut left) = (0i64, LENGTHS[b]);
        for _ in 0..seq {
            if left == 0 {
                id += 1;
                left = LENGTHS[(b + id as usize) % LENGTHS.len()];
            }
            ids.push(id);
            left -= 1;
        }
    }
    ids
}

fn float<Bk: Backend>(v: Vec<f32>, shape: [usize; 3]) -> Tensor<Bk, 3> {
    Tensor::from_data(TensorData::new(v, shape), &Default::default())
}

fn int<Bk: Backend>(v: Vec<i64>, shape: [usize; 2]) -> Tensor<Bk, 2, Int> {
    Tensor::from_data(TensorData::new(v, shape), &Default::default())
}

fn to_vec<Bk: Backend, const D: usize>(t: Tensor<Bk, D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("f32 values")
}

/// The whole sequences' context and Q/K/V gradient, cut to this rank's shard.
fn reference(
    zz: &ZigZag,
    qkv: Vec<f32>,
    dctx: Tensor<B, 3>,
    spec: AttentionSpec,
    segments: Option<Vec<i64>>,
) -> (Vec<f32>, Vec<f32>) {
    let width = 3 * spec.heads * HEAD_DIM;
    let x = float::<B>(qkv, [BATCH, zz.seq(), width]).require_grad();
    let out = match segments {
        Some(s) => attention_in_segments(x.clone(), spec, int(s, [BATCH, zz.seq()])),
        None => attention(x.clone(), spec),
    };
    let grads = (out.clone() * dctx).sum().backward();
    let dx = x.grad(&grads).expect("Q/K/V gradient");
    let shard = |t| to_vec(zz.shard_tensor(t).expect("whole sequences"));
    (shard(out.inner()), shard(dx))
}

/// One case: this rank's shard through the variant against its shard of the whole.
fn check(group: Group, variant: Variant, seq: usize, causal: bool, with_segments: bool) {
    let zz = ZigZag::new(seq, group.size(), group.rank()).expect("2 cp divides seq");
    let heads = variant.heads(group.size());
    let spec = AttentionSpec { heads, causal };
    let (width, n, ctx_width) = (3 * heads * HEAD_DIM, zz.local_len(), heads * HEAD_DIM);
    let qkv = values(BATCH * seq * width, 11 + seq as u64);
    let dctx = values(BATCH * seq * ctx_width, 29 + seq as u64);
    let segments = with_segments.then(|| documents(seq));
    let dctx_full = float::<B>(dctx.clone(), [BATCH, seq, ctx_width]);
    let (want_ctx, want_grad) = reference(&zz, qkv.clone(), dctx_full, spec, segments.clone());

    let local = zz.shard(&qkv, width).expect("whole sequences");
    let local_dctx = zz.shard(&dctx, ctx_width).expect("whole sequences");
    let local_segs = segments.map(|s| zz.shard(&s, 1).expect("whole sequences"));
    let x = float::<B>(local.clone(), [BATCH, n, width]).require_grad();
    let segs = local_segs.clone().map(|s| int::<B>(s, [BATCH, n]));
    let out = variant.run(x.clone(), spec, segs, group);
    let upstream = float::<B>(local_dctx, [BATCH, n, ctx_width]);
    let grads = (out.clone() * upstream).sum().backward();
    let got_grad = to_vec(x.grad(&grads).expect("Q/K/V gradient"));
    let got_ctx = to_vec(out.inner());

    let plain_segs = local_segs.map(|s| int::<Cpu>(s, [BATCH, n]));
    let plain = to_vec(variant.run(
        float::<Cpu>(local, [BATCH, n, width]),
        spec,
        plain_segs,
        group,
    ));

    let tag = format!(
        "{variant:?} rank {} of {}: seq {seq} heads {heads} causal {causal} segments \
         {with_segments}",
        group.rank(),
        group.size()
    );
    let (e_ctx, e_grad) = (rel_err(&got_ctx, &want_ctx), rel_err(&got_grad, &want_grad));
    println!("{tag}: context error {e_ctx:.2e}, Q/K/V gradient error {e_grad:.2e}");
    assert!(e_ctx <= TOL, "{tag}: context error {e_ctx:e} > {TOL:e}");
    assert!(
        e_grad <= TOL,
        "{tag}: Q/K/V gradient error {e_grad:e} > {TOL:e}"
    );
    assert!(
        plain == got_ctx,
        "{tag}: the plain backend's context differs from Autodiff's"
    );
}
