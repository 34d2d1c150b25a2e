//! The ring on host buffers against the blockwise attention of whole sequences, with the ranks
//! as threads of one process talking through rendezvous channels (a send waits for its
//! receiver, as NCCL's does: the ring must not deadlock on it).

use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Barrier, Mutex};

use proptest::prelude::*;

use super::*;
use crate::comm::ReduceOp;
use crate::kernels::cpu::blockwise::{self, SelfMask};

/// Every rank's slot for the all-gather.
type Slots = Arc<Mutex<Vec<Vec<f32>>>>;

/// One rank of a world of threads: a rendezvous channel to and from every other rank, and a
/// barrier and slots for the all-gather. Tags are ignored: messages between two ranks arrive
/// in order.
struct Threads {
    rank: usize,
    to: Vec<SyncSender<Vec<f32>>>,
    from: Vec<Receiver<Vec<f32>>>,
    barrier: Arc<Barrier>,
    slots: Slots,
}

/// The communicators of a world of `size` threads, by rank.
fn world(size: usize) -> Vec<Threads> {
    let mut to: Vec<Vec<SyncSender<Vec<f32>>>> = (0..size).map(|_| Vec::new()).collect();
    let mut from: Vec<Vec<Receiver<Vec<f32>>>> = (0..size).map(|_| Vec::new()).collect();
    for src in to.iter_mut() {
        for dst in from.iter_mut() {
            let (tx, rx) = sync_channel(0);
            src.push(tx);
            dst.push(rx);
        }
    }
    let barrier = Arc::new(Barrier::new(size));
    let slots: Slots = Arc::new(Mutex::new(vec![Vec::new(); size]));
    (to.into_iter().zip(from).enumerate())
        .map(|(rank, (to, from))| Threads {
            rank,
            to,
            from,
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
        self.to.len()
    }
    fn kind(&self) -> &'static str {
        "threads"
    }
    fn all_reduce(&self, _: &mut [f32], _: ReduceOp) -> Result<(), CommError> {
        unreachable!("the ring does not all-reduce")
    }
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        self.slots.lock().expect("slots")[self.rank] = send.to_vec();
        self.barrier.wait();
        recv.copy_from_slice(&self.slots.lock().expect("slots").concat());
        self.barrier.wait();
        Ok(())
    }
    fn reduce_scatter(&self, _: &[f32], _: &mut [f32], _: ReduceOp) -> Result<(), CommError> {
        unreachable!("the ring does not reduce-scatter")
    }
    fn broadcast(&self, _: &mut [f32], _: usize) -> Result<(), CommError> {
        unreachable!("the ring does not broadcast")
    }
    fn broadcast_bytes(&self, _: &mut [u8], _: usize) -> Result<(), CommError> {
        unreachable!("the ring does not broadcast")
    }
    fn send(&self, buf: &[f32], dest: usize, _tag: u16) -> Result<(), CommError> {
        self.to[dest].send(buf.to_vec()).expect("receiver alive");
        Ok(())
    }
    fn recv(&self, buf: &mut [f32], src: usize, _tag: u16) -> Result<(), CommError> {
        let got = self.from[src].recv().expect("sender alive");
        assert_eq!(got.len(), buf.len(), "message size");
        buf.copy_from_slice(&got);
        Ok(())
    }
    fn barrier(&self) -> Result<(), CommError> {
        self.barrier.wait();
        Ok(())
    }
    fn all_reduce_start(&self, _: Vec<f32>, _: ReduceOp) -> Result<Box<dyn Pending>, CommError> {
        unreachable!("the ring does not all-reduce")
    }
}

/// Deterministic values in `[-1, 1)`.
fn values(n: usize, seed: u64) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let mut x = (i ^ seed.rotate_left(17)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            x ^= x >> 31;
            x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x ^= x >> 29;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Segment ids of `batch` sequences of `seq` tokens: `kind` 0 none, 1 documents of random
/// lengths (they cross the chunk boundaries), 2 ids in any order (a token's segment need not
/// be contiguous), some far outside `f32`'s exact integers.
fn segments(kind: u8, batch: usize, seq: usize, seed: u64) -> Option<Vec<i64>> {
    let r = values(batch * seq, seed ^ 0x5E6);
    match kind {
        0 => None,
        1 => {
            let mut id = 0i64;
            let ids = r.iter().map(|&x| {
                id += i64::from(x > 0.6);
                id
            });
            Some(ids.collect())
        }
        _ => Some(
            r.iter()
                .map(|&x| ((x * 2.0) as i64) * (1 << 40) + 7)
                .collect(),
        ),
    }
}

/// A whole batch and what the single-rank blockwise attention makes of it.
struct Case {
    shape: Shape,
    causal: bool,
    qkv: Vec<f32>,
    dctx: Vec<f32>,
    segments: Option<Vec<i64>>,
    ctx: Vec<f32>,
    dqkv: Vec<f32>,
}

impl Case {
    fn new(shape: Shape, causal: bool, kind: u8, seed: u64) -> Self {
        let qkv = values(shape.qkv_len(), seed);
        let dctx = values(shape.ctx_len(), seed ^ 0xD0);
        let segments = segments(kind, shape.batch, shape.seq, seed);
        let mask = SelfMask {
            causal,
            positions: Positions::From(0),
            segments: segments.as_deref(),
        };
        let mut ctx = vec![0.0; shape.ctx_len()];
        let mut lse = vec![0.0; shape.lse_len()];
        blockwise::forward(&qkv, shape, mask, &mut ctx, &mut lse);
        let mut dqkv = vec![0.0; shape.qkv_len()];
        blockwise::backward(&qkv, &ctx, &lse, &dctx, shape, mask, &mut dqkv);
        Self {
            shape,
            causal,
            qkv,
            dctx,
            segments,
            ctx,
            dqkv,
        }
    }

    /// Rank `comm.rank()`'s context and Q/K/V gradient from the ring, with the references'
    /// shards of both.
    fn run(&self, comm: &dyn Communicator) -> [(Vec<f32>, Vec<f32>); 2] {
        let s = self.shape;
        let cp = comm.size();
        let zz = ZigZag::new(s.seq, cp, comm.rank()).expect("2 cp divides seq");
        let (w, cut) = (s.heads * s.head_dim, |buf: &[f32], width| {
            zz.shard(buf, width).expect("whole sequences")
        });
        let local = Shape {
            seq: zz.local_len(),
            ..s
        };
        let segs = (self.segments.as_ref()).map(|x| zz.shard(x, 1).expect("whole sequences"));
        let ring = Ring::new(comm, local, self.causal, segs.as_deref()).expect("ring");
        let qkv = cut(&self.qkv, 3 * w);
        let (ctx, lse) = ring.forward(&qkv).expect("forward");
        let dctx = cut(&self.dctx, w);
        let dqkv = ring.backward(&qkv, &ctx, &lse, &dctx).expect("backward");
        [(ctx, cut(&self.ctx, w)), (dqkv, cut(&self.dqkv, 3 * w))]
    }
}

/// `||got - want|| / ||want||`.
fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "lengths");
    let sq = |it: &mut dyn Iterator<Item = f64>| it.map(|x| x * x).sum::<f64>().sqrt();
    let diff = sq(&mut got
        .iter()
        .zip(want)
        .map(|(a, b)| f64::from(*a) - f64::from(*b)));
    diff / sq(&mut want.iter().map(|&b| f64::from(b))).max(1e-30)
}

/// Runs `case` on a ring of `cp` threads; every rank's results against the reference.
fn check_ring(case: &Case, cp: usize, tol: f64) {
    let results: Vec<[(Vec<f32>, Vec<f32>); 2]> = std::thread::scope(|scope| {
        let handles: Vec<_> = world(cp)
            .into_iter()
            .map(|comm| scope.spawn(move || case.run(&comm)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank"))
            .collect()
    });
    for (rank, [(ctx, want_ctx), (dqkv, want_dqkv)]) in results.iter().enumerate() {
        assert!(
            ctx.iter().chain(dqkv).all(|x| x.is_finite()),
            "rank {rank}: finite"
        );
        let (e_ctx, e_grad) = (rel_err(ctx, want_ctx), rel_err(dqkv, want_dqkv));
        assert!(
            e_ctx <= tol && e_grad <= tol,
            "rank {rank} of {cp}: context error {e_ctx:e}, gradient error {e_grad:e}"
        );
    }
}

#[test]
fn a_ring_of_one_is_the_blockwise_attention_bit_for_bit() {
    for (causal, kind) in [(true, 0), (false, 0), (true, 1), (false, 2)] {
        let shape = Shape {
            batch: 2,
            seq: 150,
            heads: 2,
            head_dim: 8,
        };
        check_ring(&Case::new(shape, causal, kind, 3), 1, 0.0);
    }
}

#[test]
fn rings_of_two_three_and_four_match_the_whole_on_long_chunks() {
    // Chunks of 160 tokens: more than one block of the kernel per chunk.
    for cp in 2..=4 {
        for (causal, kind) in [(true, 0), (false, 1), (true, 2)] {
            let shape = Shape {
                batch: 1,
                seq: 2 * cp * 160,
                heads: 2,
                head_dim: 16,
            };
            check_ring(&Case::new(shape, causal, kind, cp as u64), cp, 1e-5);
        }
    }
}

#[test]
fn segment_ids_travel_exactly() {
    for id in [0, 1, -1, i64::MIN, i64::MAX, 1 << 40, -(1 << 53) + 3] {
        assert_eq!(decode(&encode(id)), id);
    }
}

#[test]
fn a_shard_of_an_odd_length_is_refused() {
    let comm = crate::comm::LocalCommunicator;
    let shape = Shape {
        batch: 1,
        seq: 3,
        heads: 1,
        head_dim: 4,
    };
    assert!(matches!(
        Ring::new(&comm, shape, true, None),
        Err(RingError::Layout { .. })
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Any ring of 1 to 4 ranks, causal or not, with or without segment ids: every rank's
    /// context and Q/K/V gradient equal its shard of the whole sequence's.
    #[test]
    fn the_ring_matches_the_whole_sequence(
        cp in 1usize..=4,
        chunk in 1usize..=12,
        batch in 1usize..=2,
        heads in 1usize..=3,
        head_dim in 1usize..=8,
        causal in any::<bool>(),
        kind in 0u8..3,
        seed in any::<u64>(),
    ) {
        let shape = Shape { batch, seq: 2 * cp * chunk, heads, head_dim };
        check_ring(&Case::new(shape, causal, kind, seed), cp, 1e-5);
    }
}
