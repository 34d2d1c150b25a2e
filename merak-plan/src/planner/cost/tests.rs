//! Tests of the cost model: layouts, collectives, per-rank memory and step time.

use super::*;
use crate::data_parallel::{GradientBuffers, ReduceScatter};
use crate::pipeline::balanced_partition;
use crate::planner::UnitTiming;
use crate::planner::calibration::UnitKind;
use crate::planner::memory::sharded;
use crate::planner::model::{RankSplit, RecomputeMode};

fn layout(model: &ModelProxy, dp: usize, tp: usize, pp: usize, m: usize) -> Layout {
    let costs: Vec<f64> = model
        .units
        .iter()
        .map(|u| u.forward_flops + u.backward_flops)
        .collect();
    Layout {
        dp,
        tp,
        pp,
        virtual_stages: 1,
        micro_batch: 1,
        micro_batches: m,
        schedule: ScheduleKind::OneFOneB,
        recompute: vec![RecomputeMode::Full; pp],
        zero: 0,
        reduce_scatter: ReduceScatter::Step,
        shard: 0,
        reshard_after_forward: true,
        gradient_buffers: Default::default(),
        partition: balanced_partition(&costs, pp).unwrap(),
        tp_overlap: 1,
        cp: 1,
        sequence_parallel: false,
        ep: 1,
    }
}

#[test]
fn tp_overlap_hides_communication_behind_compute() {
    let model = ModelProxy::parse("gpt-8.3b").unwrap();
    let hw = HardwareSpec::preset("a100-80g").unwrap().with_devices(8);
    let cm = CostModel::new(&model, &hw);
    let (b, t) = (4, 8);
    let layer = 1;
    let u = &model.units[layer];
    let plain = cm.unit_terms(layer, b, t, 1, RecomputeMode::None, false);
    // k = 1: every all-reduce exposed, as Megatron runs it.
    let bytes = u.tp_allreduce_elements * b as f64 * BYTES_16BIT;
    let (bw, lat) = hw.link(t);
    let ring = |bytes: f64| 2.0 * (t - 1) as f64 / t as f64 * bytes / bw + lat;
    assert!((plain.tp_forward_s - 2.0 * ring(bytes)).abs() < 1e-12);
    let mut previous = plain;
    for k in [2usize, 4] {
        let terms = cm.unit_terms(layer, b, t, k, RecomputeMode::None, false);
        // The same compute; per block of half the forward pass, the last chunk's all-reduce
        // plus what each chunk's compute cannot hide plus the contention of the hidden part.
        assert_eq!(terms.forward_s, plain.forward_s);
        assert_eq!(terms.activation_bytes, plain.activation_bytes);
        let (a, c) = (ring(bytes / k as f64), plain.forward_s / 2.0 / k as f64);
        let block = a + (k - 1) as f64 * ((a - c).max(0.0) + hw.tp_overlap_slowdown * a.min(c));
        assert!((terms.tp_forward_s - 2.0 * block).abs() < 1e-12, "k={k}");
        assert!(terms.tp_forward_s < previous.tp_forward_s, "k={k}");
        assert!(terms.tp_backward_s < previous.tp_backward_s, "k={k}");
        previous = terms;
    }
    // The whole step gets faster, memory does not change.
    let mut l = layout(&model, 1, 8, 1, 4);
    l.micro_batch = b;
    let slow = cm.predict(&l).unwrap();
    l.tp_overlap = 4;
    let fast = cm.predict(&l).unwrap();
    assert!(fast.step_time_s < slow.step_time_s);
    assert!(fast.breakdown["tp_comm_s"] < slow.breakdown["tp_comm_s"]);
    assert_eq!(fast.peak_memory_bytes, slow.peak_memory_bytes);
    // Where latency dominates (a tiny layer), splitting only adds latencies.
    let tiny = ModelProxy::parse("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=512").unwrap();
    let cm = CostModel::new(&tiny, &hw);
    let one = cm.unit_terms(1, 1, 4, 1, RecomputeMode::None, false);
    let four = cm.unit_terms(1, 1, 4, 4, RecomputeMode::None, false);
    assert!(four.tp_forward_s > one.tp_forward_s);
    // A degree of 0, or one that does not divide the tokens, is refused.
    l.tp_overlap = 0;
    assert!(matches!(
        CostModel::new(&model, &hw).predict(&l),
        Err(CostError::Zero {
            field: "tp_overlap"
        })
    ));
    l.tp_overlap = 3;
    let err = CostModel::new(&model, &hw).predict(&l).unwrap_err();
    assert!(err.to_string().contains("4096 tokens"), "{err}");
}

fn split(tp: usize, cp: usize, sequence_parallel: bool) -> RankSplit {
    RankSplit::new(tp, cp, sequence_parallel)
}

/// The ring's exchanges as `ring_exposed` states them, recomputed here from the shape:
/// per hop the keys and values of the rank's `s/cp` tokens (`2 b (s/cp) (h/t)` 16-bit
/// values) against `1/cp` of the rank's attention (`4 b s² h / (t cp)` FLOPs).
#[test]
fn a_context_parallel_layout_predicts_the_rings_exchange() {
    let hw = HardwareSpec::preset("h100-80g").unwrap().with_devices(16);
    let b = 2usize;
    for seq in [1024usize, 32768] {
        let spec = format!("gpt:layers=2,hidden=4096,heads=32,seq={seq},vocab=1000");
        let model = ModelProxy::parse(&spec).unwrap();
        let cm = CostModel::new(&model, &hw);
        let (s, h) = (seq as f64, 4096.0);
        // t cp = 2 and 8 on NVLink, 16 across nodes.
        for (t, c) in [(1usize, 2usize), (2, 4), (4, 4)] {
            let (tf, cf) = (t as f64, c as f64);
            let terms = cm.unit_terms(1, b, split(t, c, false), 1, RecomputeMode::Full, false);
            let kv = 2.0 * b as f64 * (s / cf) * (h / tf) * BYTES_16BIT;
            let (bw, lat) = hw.link(t * c);
            let hop = |bytes: f64| bytes / bw + lat;
            let block = 4.0 * b as f64 * s * s * h / (hw.achievable_flops() * tf * cf) / cf;
            let forward = (cf - 1.0) * (hop(kv) - block).max(0.0);
            let backward = (cf - 1.0) * (hop(2.0 * kv) - 2.0 * block).max(0.0) + hop(kv);
            assert!(
                (terms.cp_forward_s - forward).abs() < 1e-15,
                "{seq} {t} {c}"
            );
            assert!(
                (terms.cp_backward_s - backward).abs() < 1e-15,
                "{seq} {t} {c}"
            );
            // Full recomputation runs the ring again.
            assert_eq!(terms.cp_recompute_s, terms.cp_forward_s);
            // 1/cp of the compute of the same TP degree.
            let whole = cm.unit_terms(1, b, t, 1, RecomputeMode::Full, true);
            assert!((terms.forward_s * cf / whole.forward_s - 1.0).abs() < 1e-12);
            assert!((terms.backward_s * cf / whole.backward_s - 1.0).abs() < 1e-12);
            if seq == 1024 && t * c > hw.devices_per_node {
                // Short blocks across nodes: the hops are exposed.
                assert!(terms.cp_forward_s > 1e-4, "{}", terms.cp_forward_s);
            }
            if seq == 32768 && t * c <= hw.devices_per_node {
                // Long blocks on NVLink hide every hop but the gradients' last one.
                assert_eq!(terms.cp_forward_s, 0.0);
                assert_eq!(terms.cp_backward_s, hop(kv));
            }
            // The embedding and the head have no attention: no ring.
            for unit in [0, 3] {
                let other =
                    cm.unit_terms(unit, b, split(t, c, false), 1, RecomputeMode::Full, false);
                assert_eq!((other.cp_forward_s, other.cp_backward_s), (0.0, 0.0));
            }
        }
    }
    // The prediction shows the ring per step: the two blocks' exchanges, m micro-batches.
    let model = ModelProxy::parse("gpt:layers=2,hidden=4096,heads=32,seq=1024,vocab=1000").unwrap();
    let cm = CostModel::new(&model, &hw);
    let mut l = layout(&model, 2, 2, 1, 4);
    l.cp = 4;
    l.micro_batch = b;
    let terms = cm.unit_terms(1, b, l.split(), 1, RecomputeMode::Full, false);
    let ring = 4.0 * 2.0 * (terms.cp_forward_s + terms.cp_backward_s + terms.cp_recompute_s);
    let pred = cm.predict(&l).unwrap();
    assert!((pred.breakdown["cp_comm_s"] / ring - 1.0).abs() < 1e-12);
    assert!(
        !cm.predict(&layout(&model, 2, 2, 1, 4))
            .unwrap()
            .breakdown
            .contains_key("cp_comm_s")
    );
}

/// Each rank of a ring keeps `1/cp` of the activations, and under sequence parallelism
/// the part TP leaves whole is split; parameters and optimizer states are unchanged by cp,
/// ZeRO shards them over `dp x cp`, and the gradients are all-reduced over `dp x cp` ranks.
#[test]
fn context_and_sequence_parallelism_in_the_memory_model() {
    let model =
        ModelProxy::parse("gpt:layers=8,hidden=2048,heads=16,seq=16384,vocab=32000").unwrap();
    let hw = HardwareSpec::preset("h100-80g").unwrap().with_devices(8);
    let cm = CostModel::new(&model, &hw);
    let mut plain = layout(&model, 1, 2, 1, 4);
    plain.recompute = vec![RecomputeMode::None];
    let base = cm.predict(&plain).unwrap();
    let activations = |l: &Layout| cm.predict(l).unwrap().breakdown["activations_bytes"];
    let states = |l: &Layout| cm.predict(l).unwrap().breakdown["model_states_bytes"];
    for cp in [2, 4] {
        let l = Layout {
            cp,
            ..plain.clone()
        };
        assert!((activations(&l) * cp as f64 / activations(&plain) - 1.0).abs() < 1e-12);
        assert_eq!(states(&l), states(&plain));
        // The compute splits over the ring's ranks.
        let pred = cm.predict(&l).unwrap();
        let ratio = base.breakdown["compute_s"] / pred.breakdown["compute_s"];
        assert!((ratio / cp as f64 - 1.0).abs() < 1e-9, "{ratio}");
    }
    // Sequence parallelism: a block keeps 34/t instead of 10 + 24/t of s b h.
    let sp = Layout {
        sequence_parallel: true,
        ..plain.clone()
    };
    let (s, h) = (16384.0, 2048.0);
    let saved = 8.0 * s * h * 10.0 * (1.0 - 1.0 / 2.0);
    let embedding_and_head = s * h * (1.0 + 4.0) * (1.0 - 1.0 / 2.0);
    let want = activations(&plain) - saved - embedding_and_head;
    assert!((activations(&sp) / want - 1.0).abs() < 1e-12);
    assert!(cm.predict(&sp).unwrap().step_time_s < base.step_time_s);
    // ZeRO over the replicas: dp = 1 x cp = 4 holds what dp = 4 holds.
    let zero = |dp, cp| Layout {
        dp,
        cp,
        zero: 1,
        ..plain.clone()
    };
    assert_eq!(states(&zero(1, 4)), states(&zero(4, 1)));
    assert!(states(&zero(1, 4)) < 0.5 * states(&plain));
    // The gradients' all-reduce over the two replicas of dp = 1 x cp = 2 (on the node's
    // links, behind the last backward pass): what dp = 2 pays, with half its tokens.
    let a = cm.predict(&zero(1, 2)).unwrap();
    let b = cm.predict(&zero(2, 1)).unwrap();
    assert_eq!(
        a.breakdown["zero_allgather_s"],
        b.breakdown["zero_allgather_s"]
    );
    // A split the sequence refuses is an error naming it.
    let bad = Layout {
        cp: 3,
        ..plain.clone()
    };
    let err = cm.predict(&bad).unwrap_err();
    assert_eq!(err, CostError::ContextSplit { cp: 3, seq: 16384 });
    let bad = Layout {
        tp: 1,
        sequence_parallel: true,
        ..plain.clone()
    };
    let err = cm.predict(&bad).unwrap_err().to_string();
    assert!(
        err.contains("tp > 1") && err.contains("16384 tokens"),
        "{err}"
    );
}

/// A calibration of the tiny GPT with round numbers: every unit 1 ms forward and 2 ms
/// backward at tp = 1 and micro-batch 1 (growing linearly with the micro-batch), half that
/// at tp = 2.
fn tiny_calibration() -> (ModelProxy, Calibration) {
    use crate::planner::CALIBRATION_FORMAT;
    let model = ModelProxy::parse("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=512").unwrap();
    let mut timings = Vec::new();
    for unit in [UnitKind::Embedding, UnitKind::Layer, UnitKind::Head] {
        for (tp, scale) in [(1, 1.0), (2, 0.5)] {
            for b in [1, 2] {
                timings.push(UnitTiming {
                    unit,
                    tp,
                    micro_batch: b,
                    forward_s: 1e-3 * scale * b as f64,
                    backward_s: 2e-3 * scale * b as f64,
                    tp_overlap: 1,
                });
            }
        }
    }
    let cal = Calibration {
        format: CALIBRATION_FORMAT.into(),
        model: model.shape.unwrap(),
        backend: "test".into(),
        ranks: 2,
        element_bytes: 4.0,
        optimizer_s_per_param: 1e-9,
        micro_batch_s_per_param: 0.0,
        step_overhead_s: 5e-3,
        zero1_s_per_param: 0.0,
        alone_time_fraction: 0.0,
        timings,
    };
    (model, cal)
}

#[test]
fn calibrated_units_replace_flops_and_tp_communication() {
    let (model, cal) = tiny_calibration();
    let hw = HardwareSpec::preset("local-cpu").unwrap();
    let cm = CostModel::new(&model, &hw).with_calibration(&cal);
    let params = model.params() as f64;
    // One rank, 4 micro-batches of 2: 4 units x (2 + 4) ms per micro-batch.
    let mut l = layout(&model, 1, 1, 1, 4);
    l.micro_batch = 2;
    l.recompute = vec![RecomputeMode::None];
    let pred = cm.predict(&l).unwrap();
    let want = 4.0 * 4.0 * 6e-3 + params * 1e-9 + 5e-3;
    assert!(
        (pred.step_time_s - want).abs() < 1e-9,
        "{} vs {want}",
        pred.step_time_s
    );
    // Full recomputation repeats the forward passes of the layers and the embedding (the
    // head's loss is not recomputed).
    l.recompute = vec![RecomputeMode::Full];
    let full = cm.predict(&l).unwrap().step_time_s;
    assert!(full > pred.step_time_s + 4.0 * 2.0 * 2e-3 - 1e-9, "{full}");
    // tp = 2 halves the measured times; no TP all-reduce is added on top.
    let mut l2 = layout(&model, 1, 2, 1, 4);
    l2.micro_batch = 2;
    l2.recompute = vec![RecomputeMode::None];
    let pred2 = cm.predict(&l2).unwrap();
    assert_eq!(pred2.breakdown["tp_comm_s"], 0.0);
    let optimizer = pred2.breakdown["optimizer_s"];
    assert!((pred2.step_time_s - optimizer - 4.0 * 4.0 * 3e-3).abs() < 1e-9);
    // The optimizer works on this rank's parameters: more than half (replicated norms and
    // biases), fewer than all.
    assert!(optimizer > params / 2.0 * 1e-9 + 5e-3 && optimizer < params * 1e-9 + 5e-3);
    // A degree the calibration does not cover falls back to FLOPs over the rate.
    let l4 = layout(&model, 1, 4, 1, 4);
    let uncalibrated = CostModel::new(&model, &hw).predict(&l4).unwrap();
    let fallback = cm.predict(&l4).unwrap();
    assert!(fallback.breakdown["compute_s"] == uncalibrated.breakdown["compute_s"]);
}

#[test]
fn an_overlapped_layout_takes_the_layers_measured_with_its_degree() {
    let (model, mut cal) = tiny_calibration();
    // The layer measured at tp = 2 with 2 chunks: 1 ms slower forward and backward.
    for b in [1, 2] {
        cal.timings.push(UnitTiming {
            unit: UnitKind::Layer,
            tp: 2,
            micro_batch: b,
            forward_s: 0.5e-3 * b as f64 + 1e-3,
            backward_s: 1e-3 * b as f64 + 1e-3,
            tp_overlap: 2,
        });
    }
    let hw = HardwareSpec::preset("local-cpu").unwrap();
    let cm = CostModel::new(&model, &hw).with_calibration(&cal);
    let mut l = layout(&model, 1, 2, 1, 4);
    l.micro_batch = 2;
    l.recompute = vec![RecomputeMode::None];
    let serial = cm.predict(&l).unwrap().step_time_s;
    l.tp_overlap = 2;
    let overlapped = cm.predict(&l).unwrap().step_time_s;
    // 2 layers x 4 micro-batches x 2 ms.
    assert!(
        (overlapped - serial - 16e-3).abs() < 1e-9,
        "{overlapped} vs {serial}"
    );
    // Degree 4 was not measured: the timings without overlap.
    l.tp_overlap = 4;
    assert!((cm.predict(&l).unwrap().step_time_s - serial).abs() < 1e-12);
}

#[test]
fn ranks_sharing_cores_take_the_mean_work_or_the_slowed_critical_path() {
    let (model, cal) = tiny_calibration();
    let mut hw = HardwareSpec::preset("local-cpu").unwrap();
    hw.devices_per_node = 4;
    let mut cores = hw.clone();
    cores.compute_units_per_node = 2;
    let own = CostModel::new(&model, &hw).with_calibration(&cal);
    let shared = CostModel::new(&model, &cores).with_calibration(&cal);
    // Data parallelism: every rank busy all the time, so sharing changes nothing (the
    // measured times already had every rank working).
    let mut dp = layout(&model, 4, 1, 1, 1);
    dp.recompute = vec![RecomputeMode::None];
    let a = own.predict(&dp).unwrap().step_time_s;
    let b = shared.predict(&dp).unwrap().step_time_s;
    assert!((a - b).abs() < 1e-12, "{a} vs {b}");
    // A pipeline with idle ranks: a rank alone runs at units/ranks = 1/2 of its measured
    // time, so the step is shorter than the simulated one, but never shorter than the
    // ranks' mean work, and the estimate stays a lower bound.
    let mut pp = layout(&model, 1, 1, 4, 2);
    pp.recompute = vec![RecomputeMode::None; 4];
    let alone = own.predict(&pp).unwrap().step_time_s;
    let together = shared.predict(&pp).unwrap();
    assert!(together.step_time_s < alone);
    assert!(together.step_time_s >= alone / 2.0 - 1e-12);
    assert!(shared.estimate(&pp).unwrap().time_lower_bound_s <= together.step_time_s);
    assert!(together.breakdown.contains_key("shared_cores_step_s"));
    // A measured alone-time fraction (the calibration's first, then the hardware's)
    // replaces units / ranks: waiting ranks that keep their cores make the step slower.
    let mut measured = cal.clone();
    measured.alone_time_fraction = 0.9;
    let kept = CostModel::new(&model, &cores).with_calibration(&measured);
    let slower = kept.predict(&pp).unwrap().step_time_s;
    assert!(slower > together.step_time_s && slower <= alone, "{slower}");
    let mut spec = cores.clone();
    spec.alone_time_fraction = 0.9;
    let from_spec = CostModel::new(&model, &spec).with_calibration(&cal);
    assert_eq!(from_spec.predict(&pp).unwrap().step_time_s, slower);
}

#[test]
fn single_device_time_is_flops_over_rate() {
    let model = ModelProxy::parse("gpt2").unwrap();
    let mut hw = HardwareSpec::preset("a100-80g").unwrap();
    // Memory-bound work for free: only the matrix products' FLOPs count.
    hw.memory_bandwidth = 1e30;
    let cm = CostModel::new(&model, &hw);
    let pred = cm.predict(&layout(&model, 1, 1, 1, 8)).unwrap();
    let flops = model.flops_per_iteration(8, RecomputeMode::Full);
    let expect = flops / hw.achievable_flops();
    let tail = pred.breakdown["optimizer_s"];
    assert!((pred.step_time_s - tail - expect).abs() < 1e-9 * expect);
}

/// The share of peak one device reaches on a GPT layer stack (no recomputation, 8
/// sequences of 2048).
fn single_device_efficiency(hidden: usize, flash_attention: bool) -> f64 {
    let heads = hidden / 128;
    let spec = format!("gpt:layers=8,hidden={hidden},heads={heads},seq=2048,vocab=51200");
    let model = ModelProxy::parse(&spec).unwrap();
    let mut hw = HardwareSpec::preset("h100-80g").unwrap();
    hw.flash_attention = flash_attention;
    hw.memory_bytes = u64::MAX / 4;
    let cm = CostModel::new(&model, &hw);
    let mut l = layout(&model, 1, 1, 1, 8);
    l.recompute = vec![RecomputeMode::None];
    let pred = cm.predict(&l).unwrap();
    let compute = pred.breakdown["compute_s"];
    model.flops_per_iteration(8, RecomputeMode::None) / compute / hw.peak_flops_fp16
}

#[test]
fn larger_layers_reach_a_higher_share_of_peak() {
    // The memory-bound work grows like s h (and a s² without flash attention), the
    // matrix products like s h²: a small model runs further below the products' rate.
    for flash in [false, true] {
        let e: Vec<f64> = [1024, 2048, 4096, 8192]
            .iter()
            .map(|&h| single_device_efficiency(h, flash))
            .collect();
        assert!(e.windows(2).all(|w| w[0] < w[1]), "{flash}: {e:?}");
        assert!(e[3] < 0.70 && e[0] > 0.2, "{flash}: {e:?}");
    }
    // Flash attention removes the scores' memory traffic.
    assert!(single_device_efficiency(2048, true) > single_device_efficiency(2048, false));
}

#[test]
fn extrapolation_matches_full_simulation() {
    let model = ModelProxy::parse("gpt-1.5b").unwrap();
    let hw = HardwareSpec::preset("a100-80g").unwrap().with_devices(16);
    let cm = CostModel::new(&model, &hw);
    for (kind, v) in [
        (ScheduleKind::OneFOneB, 1),
        (ScheduleKind::GPipe, 1),
        (ScheduleKind::ShiftedCriticalPath, 1),
        (ScheduleKind::TwoBw, 1),
        (ScheduleKind::Interleaved, 2),
    ] {
        let mut l = layout(&model, 1, 2, 4, 40);
        l.schedule = kind;
        if v > 1 {
            let costs: Vec<f64> = model
                .units
                .iter()
                .map(|u| u.forward_flops + u.backward_flops)
                .collect();
            l.virtual_stages = v;
            l.recompute = vec![RecomputeMode::Full; 4 * v];
            l.partition = balanced_partition(&costs, 4 * v).unwrap();
        }
        let derived = cm.derive(&l).unwrap();
        let exact = cm.pipeline_time(&l, &derived, 40).unwrap();
        let pred = cm.predict(&l).unwrap();
        let predicted = pred.breakdown["pipeline_s"];
        assert!(
            (predicted - exact).abs() < 1e-3 * exact,
            "{kind}: {predicted} vs {exact}"
        );
    }
}

/// A schedule that splits the backward is predicted at its simulated time, below 1F1B's: the
/// lower bound that stops an extrapolation from undercutting a drained pipeline must not make
/// its weight-gradient passes wait for the last micro-batch's whole backward.
#[test]
fn a_split_backward_is_predicted_below_one_f_one_b() {
    let model = ModelProxy::parse("gpt-1.5b").unwrap();
    let hw = HardwareSpec::preset("a100-80g").unwrap().with_devices(16);
    let cm = CostModel::new(&model, &hw);
    let pipeline = |kind: ScheduleKind, m: usize| {
        let mut l = layout(&model, 1, 2, 4, m);
        l.schedule = kind;
        l.recompute = vec![RecomputeMode::None; 4];
        let derived = cm.derive(&l).unwrap();
        let exact = cm.pipeline_time(&l, &derived, m).unwrap();
        (cm.predict(&l).unwrap().breakdown["pipeline_s"], exact)
    };
    for m in [8, 40] {
        let (zb, zb_exact) = pipeline(ScheduleKind::ZbH1, m);
        let (one, _) = pipeline(ScheduleKind::OneFOneB, m);
        assert!(
            (zb - zb_exact).abs() < 1e-3 * zb_exact,
            "m {m}: ZB-H1 predicted {zb}, simulated {zb_exact}"
        );
        assert!(zb < 0.99 * one, "m {m}: ZB-H1 {zb} against 1F1B {one}");
    }
}

#[test]
fn memory_terms_follow_the_formulas() {
    let model = ModelProxy::parse("gpt-8.3b").unwrap();
    let hw = HardwareSpec::preset("a100-80g").unwrap().with_devices(64);
    let cm = CostModel::new(&model, &hw);
    let l = layout(&model, 4, 8, 2, 16);
    let pred = cm.predict(&l).unwrap();
    // Rank 0 holds min(p - 0, m) = 2 micro-batches of kept inputs.
    let range = l.partition.range(0);
    let blocks = (range.end - 1) as f64;
    let kept = 2.0 * 1024.0 * 3072.0 * (blocks * 2.0 + 1.0);
    let est = cm.estimate(&l).unwrap();
    assert_eq!(est.peak_memory_bytes, pred.peak_memory_bytes);
    let states: f64 = model.units[range]
        .iter()
        .map(|u| u.params_per_rank(8))
        .sum::<f64>()
        * 16.0;
    let expected = states
        + kept
        + FRAMEWORK_BYTES
        + model.units[1].activation_bytes(1, 8, RecomputeMode::None, false);
    assert!((pred.peak_memory_bytes[0] as f64 - expected).abs() < 2.0);
    let mut z = l.clone();
    z.zero = 1;
    let zp = cm.predict(&z).unwrap();
    assert!(zp.peak_memory_bytes[0] < pred.peak_memory_bytes[0]);
    assert!(est.time_lower_bound_s <= pred.step_time_s);
}

/// A mixture of experts with 16 experts (top-2, width 4096) on the h100-80g preset.
fn moe_model() -> ModelProxy {
    ModelProxy::parse(
        "gpt:layers=4,hidden=1024,heads=16,seq=2048,vocab=1000,experts=16,top_k=2,\
         expert_hidden=4096",
    )
    .unwrap()
}

/// Expert parallelism's all-to-alls as `alltoall` states them: per MoE block and
/// micro-batch a dispatch and a combine forward, the same backward and again under full
/// recomputation, each sending the rank's `top_k b s h / cp` 16-bit values spread over
/// the `ep` ranks of its group; within a node `(ep - 1)/ep` of them at NVLink's bandwidth,
/// across nodes the slower of the node's and the inter-node share.
#[test]
fn an_expert_parallel_layout_predicts_the_all_to_all() {
    let model = moe_model();
    let hw = HardwareSpec::preset("h100-80g").unwrap().with_devices(32);
    let cm = CostModel::new(&model, &hw);
    let (b, s, h, k) = (2usize, 2048.0, 1024.0, 2.0);
    let bytes = k * b as f64 * s * h * 2.0;
    let (intra, inter) = (hw.intra_node_bandwidth, hw.inter_node_bandwidth);
    for (ep, cp, one) in [
        (1usize, 1usize, 0.0),
        (2, 1, bytes / 2.0 / intra + hw.intra_node_latency),
        (
            8,
            2,
            bytes / 2.0 * 7.0 / 8.0 / intra + hw.intra_node_latency,
        ),
        // 8 of the 16 ranks on the node: 7 shares over NVLink, 8 across nodes.
        (16, 1, bytes / 16.0 * 8.0 / inter + hw.inter_node_latency),
    ] {
        let split = RankSplit::new(1, cp, false).with_ep(ep);
        let none = cm.unit_terms(1, b, split, 1, RecomputeMode::None, false);
        assert!((none.ep_forward_s - 2.0 * one).abs() < 1e-15, "ep {ep}");
        assert_eq!(none.ep_backward_s, none.ep_forward_s);
        assert_eq!(none.ep_recompute_s, 0.0);
        let full = cm.unit_terms(1, b, split, 1, RecomputeMode::Full, false);
        assert_eq!(full.ep_recompute_s, full.ep_forward_s);
        // The embedding has no experts.
        let embedding = cm.unit_terms(0, b, split, 1, RecomputeMode::None, false);
        assert_eq!(embedding.ep_forward_s, 0.0);
    }
    // Under sequence parallelism a TP rank sends its 1/tp of the positions; the group's
    // ranks are tp apart (tp = 2, ep = 4: 8 devices, one node).
    let sp = RankSplit::new(2, 1, true).with_ep(4);
    let terms = cm.unit_terms(1, b, sp, 1, RecomputeMode::None, false);
    let one = bytes / 2.0 / 4.0 * 3.0 / intra + hw.intra_node_latency;
    assert!((terms.ep_forward_s - 2.0 * one).abs() < 1e-15);
    // The busiest rank computes EXPERT_IMBALANCE times its share of the routed experts
    // (and streams half the experts' weights).
    let even = cm.unit_terms(1, b, RankSplit::from(1), 1, RecomputeMode::None, false);
    let ep2 = cm.unit_terms(
        1,
        b,
        RankSplit::from(1).with_ep(2),
        1,
        RecomputeMode::None,
        false,
    );
    let routed = model.units[1].expert_flops * b as f64 / hw.achievable_flops();
    let weights = model.units[1].params_expert as f64 * 2.0 / hw.memory_bandwidth;
    let extra = (EXPERT_IMBALANCE - 1.0) * routed - weights / 2.0;
    assert!((ep2.forward_s - even.forward_s - extra).abs() < 1e-12);
    assert!((ep2.backward_s - even.backward_s - 2.0 * extra).abs() < 1e-12);
    // The step's breakdown names the all-to-alls: m micro-batches of the 4 blocks.
    let mut l = layout(&model, 8, 1, 1, 4);
    l.ep = 8;
    l.recompute = vec![RecomputeMode::None];
    let p = cm.predict(&l).unwrap();
    let per_block = cm
        .unit_terms(1, 1, l.split(), 1, RecomputeMode::None, false)
        .ep_forward_s;
    let expected = 4.0 * 4.0 * 2.0 * per_block;
    assert!((p.breakdown["ep_comm_s"] - expected).abs() < 1e-12);
}

/// The busiest rank's expected load is the model's `imbalance` (percent of the mean): its
/// routed products take `(imbalance - 1)` times their share longer under ep > 1 (twice
/// that backward), none at ep = 1.
#[test]
fn the_expert_imbalance_is_an_input_of_the_model() {
    let spec = "gpt:layers=4,hidden=1024,heads=16,seq=2048,vocab=1000,experts=16,top_k=2,\
                expert_hidden=4096";
    let even = ModelProxy::parse(&format!("{spec},imbalance=100")).unwrap();
    let skewed = ModelProxy::parse(&format!("{spec},imbalance=150")).unwrap();
    assert_eq!(moe_model().shape.unwrap().moe.unwrap().imbalance_pct, 120);
    let hw = HardwareSpec::preset("h100-80g").unwrap().with_devices(16);
    let (a, c) = (CostModel::new(&even, &hw), CostModel::new(&skewed, &hw));
    let routed = even.units[1].expert_flops * 2.0 / hw.achievable_flops();
    for ep in [1usize, 4] {
        let split = RankSplit::from(1).with_ep(ep);
        let x = a.unit_terms(1, 2, split, 1, RecomputeMode::None, false);
        let y = c.unit_terms(1, 2, split, 1, RecomputeMode::None, false);
        let extra = if ep > 1 { 0.5 * routed } else { 0.0 };
        assert!((y.forward_s - x.forward_s - extra).abs() < 1e-12, "ep {ep}");
        assert!((y.backward_s - x.backward_s - 2.0 * extra).abs() < 1e-12);
        // The busiest rank also keeps 1.5 times the routed experts' activations.
        let kept = even.units[1].act_expert * 2.0;
        let more = if ep > 1 { 0.5 * kept } else { 0.0 };
        assert!((y.activation_bytes - x.activation_bytes - more).abs() < 1e-3);
    }
}

/// A routed expert's products over `m` tokens run at `m / (m + F/B)` of the achievable
/// rate: a rank streams its `E/ep` experts' weights once per forward pass (twice
/// backward), so few tokens per expert (small micro-batches, little ep) cost more per FLOP.
#[test]
fn small_expert_products_run_below_the_achievable_rate() {
    let spec = "gpt:layers=4,hidden=1024,heads=16,seq=2048,vocab=1000,experts=16,top_k=2,\
                expert_hidden=4096,imbalance=100";
    let model = ModelProxy::parse(spec).unwrap();
    let hw = HardwareSpec::preset("h100-80g").unwrap().with_devices(16);
    let cm = CostModel::new(&model, &hw);
    let u = &model.units[1];
    let terms = |b: usize, ep: usize| {
        cm.unit_terms(
            1,
            b,
            RankSplit::from(1).with_ep(ep),
            1,
            RecomputeMode::None,
            false,
        )
    };
    let weights = |ep: f64| u.params_expert as f64 * 2.0 / ep / hw.memory_bandwidth;
    let (two, four) = (terms(1, 2), terms(1, 4));
    assert!((two.forward_s - four.forward_s - (weights(2.0) - weights(4.0))).abs() < 1e-12);
    assert!((two.backward_s - four.backward_s - 2.0 * (weights(2.0) - weights(4.0))).abs() < 1e-12);
    // Per sequence a micro-batch of 4 is cheaper than one of 1 (a dense unit: the same).
    assert!(terms(4, 2).forward_s / 4.0 < terms(1, 2).forward_s);
    let dense = |b: usize| {
        cm.unit_terms(0, b, 1, 1, RecomputeMode::None, false)
            .forward_s
    };
    assert!((dense(4) / 4.0 - dense(1)).abs() < 1e-12 * dense(1).max(1e-9));
    // The knee: the tokens per expert at which its products run at half the rate (about
    // 256 on the H100 preset); the expert share of an ep = 2 rank at b = 1, 2 k s / E = 512
    // tokens per expert, runs at 512 / (512 + 256).
    let knee = hw.achievable_flops() / hw.memory_bandwidth;
    assert!((knee - 256.0).abs() < 1.0, "{knee}");
    let products = u.expert_flops / hw.achievable_flops();
    let m = 2.0 * 2.0 * 2048.0 / 16.0;
    let share = products / (products + weights(2.0));
    // (GeLU experts: their biases add h + f values to the 2 h f weights.)
    assert!((share - m / (m + knee)).abs() < 1e-3, "{share}");
}

/// Selective recomputation keeps a MoE block's routed experts without their
/// activation-function outputs (SwiGLU: SiLU and the product, `2 × 2 f` bytes a routed
/// token; GeLU: `2 f`), as the runtime's checkpointing recomputes them.
#[test]
fn selective_recomputation_keeps_less_of_a_moe_block() {
    let hw = HardwareSpec::preset("h100-80g").unwrap().with_devices(8);
    for (spec, per_token) in [
        ("experts=8,top_k=2,expert_hidden=512,swiglu=1", 4.0 * 512.0),
        ("experts=8,top_k=2,expert_hidden=512", 2.0 * 512.0),
    ] {
        let model = ModelProxy::parse(&format!(
            "gpt:layers=2,hidden=128,heads=4,seq=256,vocab=100,{spec},imbalance=125"
        ))
        .unwrap();
        let cm = CostModel::new(&model, &hw);
        for ep in [1usize, 2] {
            let split = RankSplit::from(1).with_ep(ep);
            let none = cm.unit_terms(1, 2, split, 1, RecomputeMode::None, false);
            let sel = cm.unit_terms(1, 2, split, 1, RecomputeMode::Selective, false);
            let load = if ep > 1 { 1.25 } else { 1.0 };
            let saved = load * 2.0 * 2.0 * 256.0 * per_token;
            let got = none.activation_bytes - sel.activation_bytes;
            assert!(
                (got - saved).abs() < 1e-6,
                "{spec} ep {ep}: {got} vs {saved}"
            );
            assert!(sel.recompute_s > 0.0, "{spec}");
        }
    }
}

/// Memory per rank against ep: a rank holds `E/ep` routed experts (whole under tensor
/// parallelism), their states sharded under ZeRO over the `dp/ep` ranks that hold them
/// and their TP peers; the dense parameters as before.
#[test]
fn a_rank_holds_its_share_of_the_experts() {
    let model = moe_model();
    let hw = HardwareSpec::preset("h100-80g").unwrap().with_devices(16);
    let cm = CostModel::new(&model, &hw);
    let dense: f64 = model.units.iter().map(|u| u.params_per_rank(2)).sum();
    let experts: f64 = model.units.iter().map(|u| u.params_expert as f64).sum();
    assert_eq!(
        experts,
        4.0 * 16.0 * (2.0 * 1024.0 * 4096.0 + 4096.0 + 1024.0)
    );
    for zero in [0u8, 1, 2] {
        let mut previous = f64::INFINITY;
        for ep in [1usize, 2, 4, 8] {
            let mut l = layout(&model, 8, 2, 1, 1);
            (l.ep, l.zero, l.sequence_parallel) = (ep, zero, true);
            let p = cm.predict(&l).unwrap();
            let per = |d: usize| cm.state_bytes(&sharded(zero, d, ReduceScatter::Step)).dense;
            // The experts' states are cut over the dp / ep ranks and their 2 TP peers.
            let states = dense * per(8) + experts / ep as f64 * per(2 * 8 / ep);
            let got = p.breakdown["model_states_bytes"];
            assert!(
                (got - states).abs() < 1e-3 * states.max(1.0),
                "zero {zero} ep {ep}"
            );
            assert!(got < previous, "zero {zero} ep {ep}");
            previous = got;
        }
    }
    // ZeRO-2 reducing every micro-batch: the dense gradients are chunks, the experts' add
    // up whole through the step.
    let mut l = layout(&model, 8, 2, 1, 4);
    (l.ep, l.zero, l.sequence_parallel) = (2, 2, true);
    l.reduce_scatter = ReduceScatter::MicroBatch;
    let per = |d: usize, rs| cm.state_bytes(&sharded(2, d, rs)).dense;
    let states =
        dense * per(8, ReduceScatter::MicroBatch) + experts / 2.0 * per(8, ReduceScatter::Step);
    let got = cm.predict(&l).unwrap().breakdown["model_states_bytes"];
    assert!((got - states).abs() < 1e-3 * states, "{got} {states}");
    assert!(per(8, ReduceScatter::Step) > per(8, ReduceScatter::MicroBatch));
    // Layouts expert parallelism cannot take are refused naming the numbers.
    let mut l = layout(&model, 8, 1, 1, 1);
    l.ep = 3;
    let err = cm.predict(&l).unwrap_err();
    assert_eq!(
        err,
        CostError::ExpertParallel {
            ep: 3,
            replicas: 8,
            experts: 16
        }
    );
    let mut l = layout(&model, 4, 2, 1, 1);
    l.sequence_parallel = false;
    let err = cm.predict(&l).unwrap_err().to_string();
    assert!(
        err.contains("tp = 2 with a mixture of experts needs sequence"),
        "{err}"
    );
    let dense_model = ModelProxy::parse("gpt2").unwrap();
    let mut l = layout(&dense_model, 8, 1, 1, 1);
    l.ep = 2;
    let err = CostModel::new(&dense_model, &hw).predict(&l).unwrap_err();
    assert!(err.to_string().contains("model's 0 experts"), "{err}");
}

/// Megatron-Core's Mixtral 8x7B layout on 64 H100s (TP 1, EP 8, PP 4, VP 8, global batch
/// 256): its data parallelism spans the nodes, so holding 1/8 of the experts cuts the
/// gradients' exposed reduction and ZeRO's all-gather of the experts by more than the
/// all-to-alls and the imbalance cost, and the model states to less than a third.
#[test]
fn megatron_cores_mixtral_layout_is_faster_with_expert_parallelism() {
    let model = ModelProxy::parse("mixtral-8x7b").unwrap();
    let hw = HardwareSpec::preset("h100-80g").unwrap().with_devices(64);
    let cm = CostModel::new(&model, &hw);
    let costs: Vec<f64> = model.units.iter().map(|u| u.forward_flops).collect();
    let at = |ep: usize| {
        let mut l = layout(&model, 16, 1, 4, 16);
        (l.ep, l.zero, l.virtual_stages) = (ep, 1, 8);
        l.schedule = ScheduleKind::Interleaved;
        l.recompute = vec![RecomputeMode::None; 32];
        l.partition = balanced_partition(&costs, 32).unwrap();
        cm.predict(&l).unwrap()
    };
    let (plain, experts) = (at(1), at(8));
    assert!(experts.step_time_s < plain.step_time_s);
    let states = |p: &Prediction| p.breakdown["model_states_bytes"];
    assert!(states(&experts) < states(&plain) / 3.0);
    assert!(experts.breakdown["dp_exposed_s"] < plain.breakdown["dp_exposed_s"]);
    assert!(experts.breakdown["ep_comm_s"] > 0.0);
}

/// `merak-cuda` reproduces the recorded H200 runs of `benches/gpu` (2026-11-28: GPT-2 small
/// and medium, bf16, sequence 1024, micro-batch 16, one rank) within 10%, with device gradient
/// buffers (the default) and, on GPT-2 small, host ones; `spec` on the same GPU predicts the
/// published implementation, several times faster.
#[test]
fn merak_cuda_kernels_reproduce_the_recorded_h200_runs() {
    let ours = crate::planner::Kernels::load("merak-cuda")
        .unwrap()
        .apply(&HardwareSpec::preset("h200-141g").unwrap());
    let spec = HardwareSpec::preset("h200-141g").unwrap();
    // (model, gradient buffers, measured tokens/s)
    let runs = [
        ("gpt2", GradientBuffers::Auto, 32_008.0),
        ("gpt2", GradientBuffers::Host, 20_936.0),
        ("gpt2-medium", GradientBuffers::Auto, 14_252.0),
    ];
    for (name, buffers, measured) in runs {
        let model = ModelProxy::parse(name).unwrap();
        let mut l = layout(&model, 1, 1, 1, 1);
        l.micro_batch = 16;
        l.recompute = vec![RecomputeMode::None];
        l.gradient_buffers = buffers;
        let tokens_s = |hw: &HardwareSpec| {
            16.0 * 1024.0 / CostModel::new(&model, hw).predict(&l).unwrap().step_time_s
        };
        let predicted = tokens_s(&ours);
        let err = predicted / measured - 1.0;
        assert!(
            err.abs() < 0.10,
            "{name} {buffers}: {predicted:.0} against {measured}"
        );
        assert!(tokens_s(&spec) > 3.0 * predicted, "{name}");
    }
}

/// `gradient_buffers` costs what merak's reducer does on merak's runtimes: device buffers
/// all-reduce after the backward pass (through host memory without NCCL), host buffers overlap
/// the all-reduce and pay each micro-batch's copies down, one copy up and a stall per gradient;
/// the published runtime (the GPU presets) ignores them.
#[test]
fn gradient_buffers_cost_what_merak_reducer_does() {
    use crate::planner::Runtime;
    let model = ModelProxy::parse("gpt2").unwrap();
    let mut hw = HardwareSpec::preset("h100-80g").unwrap().with_devices(2);
    let m = 4;
    let mut l = layout(&model, 2, 1, 1, m);
    let exposed = |hw: &HardwareSpec, l: &Layout, buffers| {
        let mut l = l.clone();
        l.gradient_buffers = buffers;
        let p = CostModel::new(&model, hw).predict(&l).unwrap();
        p.breakdown["dp_exposed_s"]
    };
    let (auto, host, device) = (
        GradientBuffers::Auto,
        GradientBuffers::Host,
        GradientBuffers::Device,
    );
    let published = exposed(&hw, &l, auto);
    assert_eq!(exposed(&hw, &l, host), published);
    assert_eq!(exposed(&hw, &l, device), published);
    // merak on NCCL: auto is device without ZeRO, and exposes the whole all-reduce.
    hw.runtime = Runtime::MerakNccl;
    let whole = exposed(&hw, &l, device);
    assert_eq!(exposed(&hw, &l, auto), whole);
    assert!(whole > published, "{whole} against {published}");
    // Links and host copies free, a second a gradient: host buffers cost m stalls a tensor.
    (hw.intra_node_bandwidth, hw.intra_node_latency) = (1e30, 0.0);
    (hw.host_bandwidth, hw.gradient_copy_stall_s) = (1e30, 1.0);
    let units = model.units.len() as f64;
    let stalls = m as f64 * units * super::collectives::GRADIENT_TENSORS_PER_UNIT;
    assert!((exposed(&hw, &l, host) - stalls).abs() < 1e-9);
    assert!(exposed(&hw, &l, device) < 1e-12);
    // Copies at the host link: m down and one up; without NCCL device buffers go down and up
    // once for the all-reduce through host memory.
    (hw.host_bandwidth, hw.gradient_copy_stall_s) = (1e9, 0.0);
    let host_m = exposed(&hw, &l, host);
    l.micro_batches = 1;
    let host_1 = exposed(&hw, &l, host);
    assert!((host_m / host_1 - (m + 1) as f64 / 2.0).abs() < 1e-9);
    hw.runtime = Runtime::MerakMpi;
    assert!((exposed(&hw, &l, device) - host_1).abs() < 1e-9 * host_1);
    // Under ZeRO the reducer keeps its slices on the host whatever is asked.
    l.zero = 1;
    assert_eq!(exposed(&hw, &l, device), exposed(&hw, &l, host));
}

/// Muon's terms: nothing under an element-wise optimizer; at ZeRO 0 with tp = 2 every rank
/// gathers half of every block matrix's fp32 update (GPT-2 small: about 170 MB) and computes
/// every orthogonalization; under ZeRO over 4 ranks a quarter of both, plus the pieces taken to
/// their owners and back; the step's optimizer time grows by the terms' seconds.
#[test]
fn muon_adds_its_orthogonalizations_and_their_traffic_to_the_step() {
    let model = ModelProxy::parse("gpt2").unwrap();
    let hw = HardwareSpec::preset("h100-80g").unwrap().with_devices(8);
    let units: Vec<usize> = (0..model.units.len()).collect();
    let plain = CostModel::new(&model, &hw);
    let muon = CostModel::new(&model, &hw).with_optimizer(OptimizerCost::Muon { ns_steps: 5 });
    let tp2 = layout(&model, 1, 2, 1, 4);
    assert_eq!(plain.muon_terms(&tp2, &units), MuonTerms::default());
    let whole = muon.muon_terms(&tp2, &units);
    let blocks: f64 = (model.units.iter())
        .filter(|u| u.recomputable)
        .map(|u| u.params_split as f64)
        .sum();
    assert!((whole.tp_gather_bytes - 0.5 * 4.0 * blocks).abs() < 1.0);
    assert!(
        (whole.tp_gather_bytes / 1.7e8 - 1.0).abs() < 0.02,
        "{whole:?}"
    );
    let h = 768.0;
    assert!((whole.flops - 5.0 * 14.0 / 3.0 * h * blocks).abs() / whole.flops < 1e-12);
    assert_eq!(whole.exchange_bytes, 0.0);
    let zero = Layout {
        dp: 4,
        zero: 1,
        ..tp2.clone()
    };
    let shared = muon.muon_terms(&zero, &units);
    assert!((shared.flops - whole.flops / 4.0).abs() / whole.flops < 1e-12);
    assert!((shared.tp_gather_bytes - whole.tp_gather_bytes / 4.0).abs() < 1.0);
    let exchange = 2.0 * 3.0 / 16.0 * 4.0 * blocks / 2.0;
    assert!((shared.exchange_bytes - exchange).abs() < 1.0, "{shared:?}");
    for l in [&tp2, &zero] {
        let (a, b) = (plain.predict(l).unwrap(), muon.predict(l).unwrap());
        let added = muon.muon_terms(l, &units).seconds;
        assert!(added > 0.0);
        assert!((b.step_time_s - a.step_time_s - added).abs() < 1e-9 + 1e-6 * added);
    }
    // Two multi-token-prediction depths on the head add two blocks' matrices.
    let shape = model.shape.expect("a transformer shape").with_mtp(2);
    let mtp = ModelProxy::from_shape(shape);
    let muon_mtp = CostModel::new(&mtp, &hw).with_optimizer(OptimizerCost::Muon { ns_steps: 5 });
    let with = muon_mtp.muon_terms(&tp2, &units);
    let block = model.units[1].params_split as f64;
    let extra = 2.0 * block / blocks;
    assert!(
        (with.flops / whole.flops - 1.0 - extra).abs() < 1e-9,
        "{with:?}"
    );
    // Muon keeps one fp32 state tensor per matrix element where AdamW keeps two: at tp 2
    // without ZeRO a rank holds half of each block matrix, 4 bytes fewer per element held
    // (the mixed-precision format's 8 optimizer bytes per parameter, halved); under ZeRO-1
    // over 4 ranks a quarter of that.
    let states =
        |cm: &CostModel, l: &Layout| cm.predict(l).unwrap().breakdown["model_states_bytes"];
    let saved = states(&plain, &tp2) - states(&muon, &tp2);
    assert!((saved / (0.5 * blocks * 4.0) - 1.0).abs() < 1e-6, "{saved}");
    let saved_zero = states(&plain, &zero) - states(&muon, &zero);
    assert!(
        (saved_zero / (saved / 4.0) - 1.0).abs() < 1e-6,
        "{saved_zero}"
    );
}
