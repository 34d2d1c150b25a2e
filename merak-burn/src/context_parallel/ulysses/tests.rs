//! The all-to-all attention against the attention of whole sequences, with the ranks as
//! threads of one process whose communicator has only an all-gather (so the exchanges run
//! through the default [`Communicator::all_to_all`]). The kernels run as the backends'
//! default `ulysses_attention` does (the public function is tested across processes by the
//! cp-worker).

use std::rc::Rc;
use std::sync::{Arc, Barrier, Mutex};

use burn::tensor::TensorData;
use burn_autodiff::checkpoint::strategy::NoCheckpointing;

use super::*;
use crate::backend::{Cpu, CpuAutodiff};
use crate::comm::{CommError, Communicator, Pending, ReduceOp};
use crate::kernels::{attention, attention_in_segments};

/// One rank of a world of threads: an all-gather through shared slots and a barrier.
struct Threads {
    rank: usize,
    size: usize,
    barrier: Arc<Barrier>,
    slots: Arc<Mutex<Vec<Vec<f32>>>>,
}

/// The communicators of a world of `size` threads, by rank.
fn world(size: usize) -> Vec<Threads> {
    let barrier = Arc::new(Barrier::new(size));
    let slots = Arc::new(Mutex::new(vec![Vec::new(); size]));
    (0..size)
        .map(|rank| Threads {
            rank,
            size,
            barrier: barrier.clone(),
            slots: slots.clone(),
        })
        .collect()
}

impl Communicator for Threads {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn kind(&self) -> &'static str {
        "threads"
    }
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        self.slots.lock().expect("slots")[self.rank] = send.to_vec();
        self.barrier.wait();
        recv.copy_from_slice(&self.slots.lock().expect("slots").concat());
        self.barrier.wait();
        Ok(())
    }
    fn all_reduce(&self, _: &mut [f32], _: ReduceOp) -> Result<(), CommError> {
        unreachable!("not used")
    }
    fn reduce_scatter(&self, _: &[f32], _: &mut [f32], _: ReduceOp) -> Result<(), CommError> {
        unreachable!("not used")
    }
    fn broadcast(&self, _: &mut [f32], _: usize) -> Result<(), CommError> {
        unreachable!("not used")
    }
    fn broadcast_bytes(&self, _: &mut [u8], _: usize) -> Result<(), CommError> {
        unreachable!("not used")
    }
    fn send(&self, _: &[f32], _: usize, _: u16) -> Result<(), CommError> {
        unreachable!("not used")
    }
    fn recv(&self, _: &mut [f32], _: usize, _: u16) -> Result<(), CommError> {
        unreachable!("not used")
    }
    fn barrier(&self) -> Result<(), CommError> {
        self.barrier.wait();
        Ok(())
    }
    fn all_reduce_start(&self, _: Vec<f32>, _: ReduceOp) -> Result<Box<dyn Pending>, CommError> {
        unreachable!("not used")
    }
}

/// Runs `f` on every rank of a world of `size` threads; their results by rank.
fn on_threads<T: Send>(size: usize, f: impl Fn(Group) -> T + Sync) -> Vec<T> {
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = world(size)
            .into_iter()
            .map(|c| s.spawn(move || f(Group::register(Rc::new(c)))))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank"))
            .collect()
    })
}

/// Deterministic values in `[-1, 1)`.
fn values(n: usize, seed: u64) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let mut x = (i ^ seed.rotate_left(17)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            x ^= x >> 31;
            x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// `||a - b|| / ||b||`.
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let d: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let n: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (d / n.max(1e-60)).sqrt()
}

fn host<Bk: Backend, const D: usize>(t: Tensor<Bk, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec().expect("f32")
}

/// The default all-to-all: block `j` of rank `r`'s send arrives as block `r` of rank `j`.
#[test]
fn the_default_all_to_all_delivers_block_j_to_rank_j() {
    for size in [1, 2, 3] {
        let got = on_threads(size, |g| {
            let send: Vec<f32> = (0..2 * size).map(|i| (g.rank() * 100 + i) as f32).collect();
            let mut recv = vec![0.0; send.len()];
            g.comm().unwrap().all_to_all(&send, &mut recv).unwrap();
            recv
        });
        for (r, recv) in got.iter().enumerate() {
            let want: Vec<f32> = (0..size)
                .flat_map(|s| [0, 1].map(|k| (s * 100 + 2 * r + k) as f32))
                .collect();
            assert_eq!(recv, &want, "rank {r} of {size}");
        }
    }
}

#[test]
fn cp_must_divide_the_heads_per_tp_rank() {
    assert_eq!(ulysses_heads_per_rank(4, 2), Ok(2));
    let e = ulysses_heads_per_rank(6, 4).unwrap_err().to_string();
    assert!(
        e.contains("parallel.cp = 4") && e.contains("6 heads per TP rank"),
        "{e}"
    );
    assert!(ulysses_heads_per_rank(4, 0).is_err());
}

/// A case: `heads` heads of 8 features, 2 sequences of `seq` tokens.
#[derive(Clone, Copy)]
struct Case {
    seq: usize,
    heads: usize,
    causal: bool,
    segments: bool,
}

/// Segment ids: documents of 5 tokens (numbered from the row's index), so that their
/// boundaries cross the zigzag chunks (of 3 to 12 tokens).
fn documents(seq: usize) -> Vec<i64> {
    (0..2 * seq)
        .map(|i| ((i % seq) / 5 + i / seq) as i64)
        .collect()
}

/// The whole sequences' context and Q/K/V gradient on one rank.
fn reference(c: Case, qkv: &[f32], dctx: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let dev = Default::default();
    let w = 3 * c.heads * 8;
    let x = Tensor::<CpuAutodiff, 3>::from_data(TensorData::new(qkv.to_vec(), [2, c.seq, w]), &dev)
        .require_grad();
    let spec = AttentionSpec {
        heads: c.heads,
        causal: c.causal,
    };
    let out = if c.segments {
        let s = TensorData::new(documents(c.seq), [2, c.seq]);
        attention_in_segments(x.clone(), spec, Tensor::from_data(s, &dev))
    } else {
        attention(x.clone(), spec)
    };
    let up = Tensor::from_data(
        TensorData::new(dctx.to_vec(), [2, c.seq, c.heads * 8]),
        &dev,
    );
    let grads = (out.clone() * up).sum().backward();
    (host(out.inner()), host(x.grad(&grads).expect("gradient")))
}

/// The all-to-all attention on `Autodiff<Flex>` with the default kernels (one node).
fn tracked_attention(
    qkv: Tensor<CpuAutodiff, 3>,
    spec: AttentionSpec,
    segments: Option<Tensor<CpuAutodiff, 2, Int>>,
    g: Group,
) -> Tensor<CpuAutodiff, 3> {
    let kernels = (
        forward::<Cpu> as ForwardKernel<Cpu>,
        backward::<Cpu> as BackwardKernel<Cpu>,
    );
    let segments = segments.map(Tensor::into_primitive);
    lift(tracked::<Cpu, NoCheckpointing>(
        prim(qkv),
        spec,
        segments,
        g,
        kernels,
    ))
}

/// The all-to-all attention's forward kernel on the plain backend.
fn plain_attention(
    qkv: Tensor<Cpu, 3>,
    spec: AttentionSpec,
    segments: Option<Tensor<Cpu, 2, Int>>,
    g: Group,
) -> Tensor<Cpu, 3> {
    let segments = segments.map(Tensor::into_primitive);
    lift(forward::<Cpu>(prim(qkv), spec, segments, g).0)
}

/// This rank's context and Q/K/V gradient through the all-to-all attention, and the plain
/// backend's context.
fn sharded(c: Case, g: Group, qkv: &[f32], dctx: &[f32]) -> [Vec<f32>; 3] {
    let zz = ZigZag::new(c.seq, g.size(), g.rank()).expect("2 cp divides seq");
    let (n, w, dev) = (zz.local_len(), 3 * c.heads * 8, Default::default());
    let data = |v: &[f32], width| TensorData::new(zz.shard(v, width).unwrap(), [2, n, width]);
    let segs = c
        .segments
        .then(|| TensorData::new(zz.shard(&documents(c.seq), 1).unwrap(), [2, n]));
    let spec = AttentionSpec {
        heads: c.heads,
        causal: c.causal,
    };
    let x = Tensor::<CpuAutodiff, 3>::from_data(data(qkv, w), &dev).require_grad();
    let s = segs.clone().map(|s| Tensor::from_data(s, &dev));
    let out = tracked_attention(x.clone(), spec, s, g);
    let up = Tensor::from_data(data(dctx, c.heads * 8), &dev);
    let grads = (out.clone() * up).sum().backward();
    let plain = plain_attention(
        Tensor::<Cpu, 3>::from_data(data(qkv, w), &dev),
        spec,
        segs.map(|s| Tensor::from_data(s, &dev)),
        g,
    );
    [
        host(out.inner()),
        host(x.grad(&grads).expect("gradient")),
        host(plain),
    ]
}

/// Every rank's shard of the context and of the Q/K/V gradient equals its shard of the
/// whole sequences' (relative error at most 1e-5), on 1, 2 and 4 ranks.
#[test]
fn ulysses_equals_the_whole_sequence_attention() {
    for cp in [1, 2, 4] {
        for (causal, segments) in [(true, false), (false, false), (true, true)] {
            let c = Case {
                seq: 24,
                heads: 4,
                causal,
                segments,
            };
            let qkv = values(2 * c.seq * 3 * c.heads * 8, 3);
            let dctx = values(2 * c.seq * c.heads * 8, 5);
            let (ctx, dqkv) = reference(c, &qkv, &dctx);
            let got = on_threads(cp, |g| sharded(c, g, &qkv, &dctx));
            for (r, [out, grad, plain]) in got.into_iter().enumerate() {
                let zz = ZigZag::new(c.seq, cp, r).unwrap();
                let tag = format!("cp {cp} rank {r} causal {causal} segments {segments}");
                let e = rel_err(&out, &zz.shard(&ctx, c.heads * 8).unwrap());
                assert!(e <= 1e-5, "{tag}: context error {e:e}");
                let e = rel_err(&grad, &zz.shard(&dqkv, 3 * c.heads * 8).unwrap());
                assert!(e <= 1e-5, "{tag}: gradient error {e:e}");
                assert_eq!(plain, out, "{tag}: plain backend differs");
            }
        }
    }
}
