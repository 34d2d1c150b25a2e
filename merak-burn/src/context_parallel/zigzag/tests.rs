//! The zigzag shards: which tokens each rank holds, that the shards partition the sequence,
//! and that cutting and putting back together round-trip on host buffers and tensors.

use burn::tensor::{Int, Tensor, TensorData};
use proptest::prelude::*;

use super::*;
use crate::backend::{Cpu, CpuDevice};

#[test]
fn two_ranks_hold_the_outer_and_the_inner_chunks() {
    let zz = ZigZag::new(8, 2, 0).expect("2 * 2 divides 8");
    assert_eq!(zz.positions(), vec![0, 1, 6, 7]);
    assert_eq!(zz.of_rank(1).expect("rank 1").positions(), vec![2, 3, 4, 5]);
    assert_eq!((zz.chunk_len(), zz.local_len()), (2, 4));
}

#[test]
fn bad_configurations_are_refused_and_named() {
    assert_eq!(ZigZag::new(8, 0, 0), Err(ZigZagError::NoRanks));
    assert_eq!(
        ZigZag::new(10, 2, 0),
        Err(ZigZagError::Indivisible { seq: 10, cp: 2 })
    );
    assert_eq!(
        ZigZag::new(2, 2, 0),
        Err(ZigZagError::Indivisible { seq: 2, cp: 2 })
    );
    assert_eq!(
        ZigZag::new(8, 2, 2),
        Err(ZigZagError::Rank { rank: 2, cp: 2 })
    );
    assert_eq!(
        ZigZag::new(8, usize::MAX, 0),
        Err(ZigZagError::Indivisible {
            seq: 8,
            cp: usize::MAX
        })
    );
    let message = ZigZagError::Indivisible { seq: 10, cp: 2 }.to_string();
    for name in ["parallel.cp", "model.seq_len", "10", "2 * 2"] {
        assert!(message.contains(name), "{message:?} names {name}");
    }
}

#[test]
fn buffers_of_partial_sequences_are_refused() {
    let zz = ZigZag::new(8, 2, 1).expect("valid");
    let err = zz.shard(&[0u8; 12], 1);
    assert_eq!(
        err,
        Err(ZigZagError::Size {
            len: 12,
            tokens: 8,
            width: 1
        })
    );
    let shards = [vec![0u8; 4], vec![0u8; 6]];
    assert!(matches!(
        ZigZag::unshard(8, &shards, 1),
        Err(ZigZagError::Mismatch { .. })
    ));
}

#[test]
fn tensors_round_trip_along_the_sequence() {
    let device = CpuDevice::default();
    let (batch, seq, width, cp) = (2, 12, 3, 3);
    let values: Vec<f32> = (0..batch * seq * width).map(|i| i as f32).collect();
    let full = Tensor::<Cpu, 3>::from_data(
        TensorData::new(values.clone(), [batch, seq, width]),
        &device,
    );
    let shards: Vec<Tensor<Cpu, 3>> = (0..cp)
        .map(|r| {
            let zz = ZigZag::new(seq, cp, r).expect("valid");
            let t = zz.shard_tensor(full.clone()).expect("whole sequences");
            let host = zz.shard(&values, width).expect("whole sequences");
            assert_eq!(t.to_data().to_vec::<f32>().expect("f32"), host, "rank {r}");
            t
        })
        .collect();
    let back = ZigZag::unshard_tensor(shards).expect("same shards");
    assert_eq!(back.into_data().to_vec::<f32>().expect("f32"), values);
    let ids =
        Tensor::<Cpu, 2, Int>::from_data(TensorData::new(vec![0i64; 2 * 11], [2, 11]), &device);
    let zz = ZigZag::new(seq, cp, 0).expect("valid");
    assert!(matches!(
        zz.shard_tensor(ids),
        Err(ZigZagError::Size { .. })
    ));
}

proptest! {
    /// Over the ranks, the positions cover every token of the sequence exactly once, each
    /// rank's two chunks are contiguous, equal and mirrored, and cutting a buffer into every
    /// rank's shard and putting them back together gives the buffer.
    #[test]
    fn shards_partition_the_sequence_and_round_trip(
        cp in 1usize..=6,
        chunk in 1usize..=9,
        batch in 1usize..=3,
        width in 1usize..=3,
    ) {
        let seq = 2 * cp * chunk;
        let mut seen = vec![0usize; seq];
        let full: Vec<u32> = (0..(batch * seq * width) as u32).collect();
        let mut shards = Vec::new();
        for rank in 0..cp {
            let zz = ZigZag::new(seq, cp, rank).expect("2 cp divides seq");
            let [a, b] = zz.chunks();
            prop_assert_eq!(a.len(), chunk);
            prop_assert_eq!(b.len(), chunk);
            prop_assert_eq!(a.start + b.end, seq);
            for p in zz.positions() {
                seen[p] += 1;
            }
            let shard = zz.shard(&full, width).expect("whole sequences");
            prop_assert_eq!(shard.len(), batch * zz.local_len() * width);
            for (i, &p) in zz.positions().iter().enumerate() {
                let at = (i * width, p * width);
                prop_assert_eq!(shard[at.0], full[at.1]);
            }
            shards.push(shard);
        }
        prop_assert!(seen.iter().all(|&n| n == 1));
        prop_assert_eq!(ZigZag::unshard(seq, &shards, width).expect("same shards"), full);
    }
}
