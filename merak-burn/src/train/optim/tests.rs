//! Each optimizer's update against its formula, computed here in f64; the state's round trip
//! through the checkpoint's places; the settings checks.

use std::collections::HashMap;

use burn::module::{Module, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use super::groups::GroupOptim;
use super::*;
use crate::backend::CpuAutodiff;
use crate::checkpoint::Moments;
use crate::checkpoint::state;

type AB = CpuAutodiff;

#[derive(Module, Debug)]
struct Net<B: Backend> {
    w: Param<Tensor<B, 2>>,
}

const START: [f64; 6] = [0.5, -0.3, 0.8, -1.2, 0.05, 0.4];
/// The gradient of each of the three steps (a loss `sum(w * g)` has gradient `g`).
const GRADS: [[f64; 6]; 3] = [
    [0.1, -0.2, 0.3, 0.05, -0.4, 0.25],
    [-0.3, 0.1, 0.2, -0.15, 0.35, 0.05],
    [0.2, 0.4, -0.1, 0.3, -0.05, -0.2],
];
const LRS: [f64; 3] = [0.1, 0.05, 0.2];

fn net() -> Net<AB> {
    let v: Vec<f32> = START.iter().map(|x| *x as f32).collect();
    Net {
        w: Param::from_tensor(Tensor::from_data(
            TensorData::new(v, [2, 3]),
            &Default::default(),
        )),
    }
}

fn grads(net: &Net<AB>, step: usize) -> GradientsParams {
    let g: Vec<f32> = GRADS[step].iter().map(|x| *x as f32).collect();
    let g = Tensor::<AB, 2>::from_data(TensorData::new(g, [2, 3]), &Default::default());
    let loss = net.w.val().mul(g).sum();
    GradientsParams::from_grads(loss.backward(), net)
}

fn values(net: &Net<AB>) -> Vec<f64> {
    let v = net.w.val().into_data().into_vec::<f32>().unwrap();
    v.into_iter().map(f64::from).collect()
}

/// How a whole matrix is stepped under `settings`: by Muon under Muon (`Some`), else by the
/// run's optimizer.
fn matrix(settings: &TrainSettings) -> Option<super::muon::MatrixSplit> {
    (settings.optimizer.kind == OptimizerKind::Muon)
        .then_some(super::muon::MatrixSplit { dim: None })
}

/// One rank's group.
fn local() -> crate::comm::Group {
    crate::comm::Group::local()
}

/// Three steps of the optimizer of `settings` (weight decay `wd`) on [`START`].
fn run(settings: &TrainSettings, wd: f64) -> Vec<f64> {
    let mut optim = GroupOptim::<Net<AB>, AB>::new(settings, wd, matrix(settings), local());
    let mut n = net();
    for (step, lr) in LRS.iter().enumerate() {
        let g = grads(&n, step);
        n = optim.step(*lr, n, g);
    }
    values(&n)
}

/// Per element, `got` equals `want` within 1e-5 relative (f32 against f64).
fn assert_close(what: &str, got: &[f64], want: &[f64]) {
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        let tol = 1e-5 * b.abs().max(1e-2);
        assert!((a - b).abs() <= tol, "{what}[{i}]: {a} vs formula {b}");
    }
}

/// Applies `update(p, g, lr, t)` (t 1-based) element by element over the three steps.
fn reference(mut update: impl FnMut(usize, f64, f64, f64, usize) -> f64) -> Vec<f64> {
    let mut p = START.to_vec();
    for (s, lr) in LRS.iter().enumerate() {
        for (i, x) in p.iter_mut().enumerate() {
            *x = update(i, *x, GRADS[s][i], *lr, s + 1);
        }
    }
    p
}

fn settings(o: OptimizerSettings) -> TrainSettings {
    TrainSettings::default()
        .with_beta1(0.8)
        .with_beta2(0.9)
        .with_eps(1e-3)
        .with_optimizer(o)
}

#[test]
fn sgd_with_momentum_dampening_and_nesterov_follows_torch() {
    let wd = 0.1;
    for (mu, damp, nesterov) in [(0.9, 0.0, true), (0.8, 0.3, false), (0.0, 0.0, false)] {
        let s = settings(OptimizerSettings::sgd(mu, damp, nesterov));
        let mut v = [0.0; 6];
        let want = reference(|i, p, g, lr, t| {
            let g = g + wd * p;
            v[i] = if t == 1 {
                g
            } else {
                mu * v[i] + (1.0 - damp) * g
            };
            let d = if nesterov { g + mu * v[i] } else { v[i] };
            let d = if mu > 0.0 { d } else { g };
            p - lr * d
        });
        assert_close(&format!("sgd {mu} {damp} {nesterov}"), &run(&s, wd), &want);
    }
}

/// Muon on a `[2, 3]` matrix, as its formula says in f64: the Nesterov momentum (`v = g` at
/// the first step, then `mu v + g`; the update `g + mu v`), normalised by its Frobenius norm,
/// `steps` quintic Newton-Schulz iterations `X <- aX + (bA + cA^2)X`, `A = X X^T` (the
/// matrix is wide, so no transpose), scaled by `0.2 sqrt(3)` (the scale matching AdamW's
/// RMS) and the decoupled decay `1 - lr wd`.
fn muon_reference(mu: f64, steps: usize, wd: f64) -> Vec<f64> {
    let (a, b, c) = (3.4445, -4.775, 2.0315);
    let mm = |x: &[f64], y: &[f64], n: usize, k: usize, m: usize| -> Vec<f64> {
        (0..n * m)
            .map(|ij| (0..k).map(|l| x[ij / m * k + l] * y[l * m + ij % m]).sum())
            .collect()
    };
    let transpose = |x: &[f64]| -> Vec<f64> { (0..6).map(|ij| x[(ij % 2) * 3 + ij / 2]).collect() };
    let mut p = START.to_vec();
    let mut v = [0.0; 6];
    for (s, lr) in LRS.iter().enumerate() {
        let g = GRADS[s];
        for i in 0..6 {
            v[i] = if s == 0 { g[i] } else { mu * v[i] + g[i] };
        }
        let u: Vec<f64> = (0..6).map(|i| g[i] + mu * v[i]).collect();
        let norm = u.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-7);
        let mut x: Vec<f64> = u.iter().map(|e| e / norm).collect();
        for _ in 0..steps {
            let am = mm(&x, &transpose(&x), 2, 3, 2);
            let a2 = mm(&am, &am, 2, 2, 2);
            let bm: Vec<f64> = (0..4).map(|i| b * am[i] + c * a2[i]).collect();
            let bx = mm(&bm, &x, 2, 2, 3);
            x = (0..6).map(|i| a * x[i] + bx[i]).collect();
        }
        let scale = 0.2 * 3f64.sqrt();
        for i in 0..6 {
            p[i] = p[i] * (1.0 - lr * wd) - lr * scale * x[i];
        }
    }
    p
}

#[test]
fn muon_follows_its_formula() {
    let o = OptimizerSettings::default().with_kind(OptimizerKind::Muon);
    let wd = 0.1;
    assert_close(
        "muon",
        &run(&settings(o.clone()), wd),
        &muon_reference(0.95, 5, wd),
    );
    // Its settings reach it: other momentum and iterations, no decay.
    let o = OptimizerSettings {
        muon_momentum: 0.5,
        ns_steps: 2,
        ..o
    };
    assert_close(
        "muon",
        &run(&settings(o), 0.0),
        &muon_reference(0.5, 2, 0.0),
    );
}

/// Adam and AdamW: bias-corrected moments; Adam adds the decay to the gradient, AdamW
/// shrinks the parameter.
fn adam_reference(decoupled: bool, wd: f64) -> Vec<f64> {
    let (b1, b2, eps) = (0.8_f64, 0.9_f64, 1e-3);
    let (mut m, mut v) = ([0.0; 6], [0.0; 6]);
    reference(|i, p, g, lr, t| {
        let (p, g) = if decoupled {
            (p * (1.0 - lr * wd), g)
        } else {
            (p, g + wd * p)
        };
        m[i] = b1 * m[i] + (1.0 - b1) * g;
        v[i] = b2 * v[i] + (1.0 - b2) * g * g;
        let mh = m[i] / (1.0 - b1.powi(t as i32));
        let vh = v[i] / (1.0 - b2.powi(t as i32));
        p - lr * mh / (vh.sqrt() + eps)
    })
}

#[test]
fn adam_with_l2_and_adamw_follow_torch() {
    let wd = 0.2;
    let adam = settings(OptimizerSettings::default().with_kind(OptimizerKind::Adam));
    assert_close("adam", &run(&adam, wd), &adam_reference(false, wd));
    let adamw = settings(OptimizerSettings::default());
    assert_close("adamw", &run(&adamw, wd), &adam_reference(true, wd));
}

#[test]
fn adagrad_with_lr_decay_follows_torch() {
    let (wd, decay, eps) = (0.05, 0.5, 1e-3);
    let o = OptimizerSettings {
        kind: OptimizerKind::AdaGrad,
        lr_decay: decay,
        ..Default::default()
    };
    let mut sum = [0.0; 6];
    let want = reference(|i, p, g, lr, t| {
        let g = g + wd * p;
        sum[i] += g * g;
        let clr = lr / (1.0 + (t as f64 - 1.0) * decay);
        p - clr * g / (sum[i].sqrt() + eps)
    });
    assert_close("adagrad", &run(&settings(o), wd), &want);
}

#[test]
fn rmsprop_with_momentum_or_centered_follows_torch() {
    let (wd, alpha, eps) = (0.1, 0.7, 1e-3);
    for (mu, centered) in [(0.6, false), (0.0, true), (0.0, false)] {
        let o = OptimizerSettings {
            kind: OptimizerKind::RmsProp,
            alpha,
            momentum: mu,
            centered,
            ..Default::default()
        };
        let (mut sq, mut ga, mut buf) = ([0.0; 6], [0.0; 6], [0.0; 6]);
        let want = reference(|i, p, g, lr, _| {
            let g = g + wd * p;
            sq[i] = alpha * sq[i] + (1.0 - alpha) * g * g;
            let var = if centered {
                ga[i] = alpha * ga[i] + (1.0 - alpha) * g;
                sq[i] - ga[i] * ga[i]
            } else {
                sq[i]
            };
            let step = g / (var.sqrt() + eps);
            if mu > 0.0 {
                buf[i] = mu * buf[i] + step;
                p - lr * buf[i]
            } else {
                p - lr * step
            }
        });
        let what = format!("rmsprop momentum {mu} centered {centered}");
        assert_close(&what, &run(&settings(o), wd), &want);
    }
}

/// Two steps, the state through the checkpoint's places into a fresh optimizer, a third step:
/// the same parameters as three steps of one optimizer, for every kind and state layout.
#[test]
fn every_kinds_state_survives_the_checkpoint_format() {
    let kinds = [
        OptimizerSettings::default(),
        OptimizerSettings::default().with_kind(OptimizerKind::Adam),
        OptimizerSettings::sgd(0.9, 0.0, true),
        OptimizerSettings {
            kind: OptimizerKind::AdaGrad,
            lr_decay: 0.3,
            ..Default::default()
        },
        OptimizerSettings {
            kind: OptimizerKind::RmsProp,
            momentum: 0.5,
            ..Default::default()
        },
        OptimizerSettings {
            kind: OptimizerKind::RmsProp,
            centered: true,
            ..Default::default()
        },
        OptimizerSettings::default().with_kind(OptimizerKind::Muon),
    ];
    for o in kinds {
        let s = settings(o.clone());
        let muon = o.kind == OptimizerKind::Muon;
        let mut first = GroupOptim::<Net<AB>, AB>::new(&s, 0.1, matrix(&s), local());
        let mut n = net();
        for (step, lr) in LRS.iter().enumerate().take(2) {
            let g = grads(&n, step);
            n = first.step(*lr, n, g);
        }
        let moments: HashMap<String, Moments> = first.moments(&n).unwrap().into_iter().collect();
        assert_eq!(moments.len(), 1, "{o:?}");
        let m = &moments["w"];
        assert_eq!((m.m1.len(), m.m2.len()), (6, 6), "{o:?}");
        if o.state_slots()[1] == "-" || muon {
            assert!(
                m.m2.iter().all(|x| *x == 0.0),
                "{o:?}: the unused place is zeros"
            );
        }
        let mut second = GroupOptim::<Net<AB>, AB>::new(&s, 0.1, matrix(&s), local());
        second.load(&n, &moments, &|_, _| true);
        let g = grads(&n, 2);
        let a = values(&first.step(LRS[2], n.clone(), g));
        let g = grads(&n, 2);
        let b = values(&second.step(LRS[2], n.clone(), g));
        assert_eq!(a, b, "{o:?}");
    }
}

#[derive(Module, Debug)]
struct Three<B: Backend> {
    a: Param<Tensor<B, 2>>,
    b: Param<Tensor<B, 1>>,
    c: Param<Tensor<B, 2>>,
}

/// The optimizers of `model`'s parameters (one process, the default settings) grouped by
/// `rule`, with the tied `copies`.
fn grouped<M: burn::module::AutodiffModule<AB>>(
    model: &M,
    copies: Vec<(String, String)>,
    rule: &dyn Fn(&ParamInfo<'_>) -> ParamGroup,
) -> Result<Optimizers<M, AB>, crate::train::TrainError> {
    let s = TrainSettings::default();
    Optimizers::new(
        &state::param_shapes(model),
        &s,
        (1, copies),
        &MuonMatrices::default(),
        rule,
    )
}

#[test]
fn groups_follow_the_rule_by_name_and_full_shape() {
    let dev = Default::default();
    let model = Three::<AB> {
        a: Param::from_tensor(Tensor::ones([2, 3], &dev)),
        b: Param::from_tensor(Tensor::ones([3], &dev)),
        c: Param::from_tensor(Tensor::ones([2, 3], &dev)),
    };
    let all = || {
        let loss = model.a.val().sum() + model.b.val().sum() + model.c.val().sum();
        GradientsParams::from_grads(loss.backward(), &model)
    };
    let sizes = |o: &Optimizers<Three<AB>, AB>| {
        let g = o.split(&model, all());
        g.iter().map(GradientsParams::len).collect::<Vec<_>>()
    };
    let copies = || vec![("c".to_string(), "a".to_string())];
    // Default: the matrices decay, the vector does not.
    let default = grouped(&model, copies(), &|p| p.default).unwrap();
    assert_eq!(sizes(&default), vec![2, 1]);
    // By name (the copy `c` is seen as its original `a`) and full shape.
    let seen = std::cell::RefCell::new(Vec::new());
    let rule = |p: &ParamInfo<'_>| {
        let lr_scale = if p.name == "a" { 0.5 } else { 1.0 };
        ParamGroup {
            lr_scale,
            ..p.default
        }
    };
    let by_name = grouped(&model, copies(), &|p| {
        seen.borrow_mut()
            .push((p.name.to_string(), p.shape.to_vec()));
        rule(p)
    })
    .unwrap();
    assert_eq!(sizes(&by_name), vec![2, 1]);
    assert_eq!(
        seen.into_inner(),
        vec![
            ("a".to_string(), vec![2, 3]),
            ("b".to_string(), vec![3]),
            ("a".to_string(), vec![2, 3]),
        ]
    );
    let own = |p: &ParamInfo<'_>| ParamGroup {
        weight_decay: if p.name == "b" { 0.3 } else { 0.0 },
        lr_scale: 1.0,
    };
    let split = grouped(&model, vec![], &own).unwrap();
    assert_eq!(sizes(&split), vec![2, 1]);
    // A negative decay is refused, naming the parameter.
    let bad = |p: &ParamInfo<'_>| ParamGroup {
        weight_decay: -1.0,
        ..p.default
    };
    match grouped(&model, vec![], &bad) {
        Err(crate::train::TrainError::ParamGroup { name, reason }) => {
            assert_eq!(name, "a");
            assert!(reason.contains("weight_decay = -1"), "{reason}");
        }
        other => panic!("{:?}", other.err()),
    }
}

#[derive(Module, Debug)]
struct Sharded<B: Backend> {
    split: crate::tensor_parallel::Split<B>,
    w: Param<Tensor<B, 2>>,
}

/// A rank's column shard is grouped by the full shape: the same group on every layout.
#[test]
fn a_shard_is_grouped_by_its_full_shape() {
    use crate::tensor_parallel::{ShardKind, Split};
    let group = crate::comm::Group::local();
    let model = Sharded::<AB> {
        split: Split::new(group, [("w", ShardKind::Columns { segments: 1 })]),
        w: Param::from_tensor(Tensor::ones([2, 3], &Default::default())),
    };
    let seen = std::cell::RefCell::new(Vec::new());
    let rule = |p: &ParamInfo<'_>| {
        seen.borrow_mut()
            .push((p.name.to_string(), p.shape.to_vec()));
        p.default
    };
    let s = TrainSettings::default();
    Optimizers::<Sharded<AB>, AB>::new(
        &state::param_shapes(&model),
        &s,
        (2, vec![]),
        &MuonMatrices::default(),
        &rule,
    )
    .unwrap();
    assert_eq!(seen.into_inner(), vec![("w".to_string(), vec![2, 6])]);
}

#[test]
fn out_of_range_settings_are_refused_naming_the_key() {
    let base = TrainSettings::default().with_steps(20);
    assert_eq!(check_settings(&base), Ok(()));
    let sgd = |m, d, n| base.clone().with_optimizer(OptimizerSettings::sgd(m, d, n));
    let rms = |o: OptimizerSettings| {
        base.clone().with_optimizer(OptimizerSettings {
            kind: OptimizerKind::RmsProp,
            ..o
        })
    };
    let wsd = |warmup, decay| {
        base.clone()
            .with_warmup_steps(warmup)
            .with_optimizer(OptimizerSettings::default().with_schedule(LrScheduleKind::Wsd, decay))
    };
    let cases: Vec<(TrainSettings, &str, &str)> = vec![
        (base.clone().with_lr(-1e-3), "lr", "-0.001"),
        (base.clone().with_lr(f64::NAN), "lr", "NaN"),
        (base.clone().with_lr(1e30), "lr", "1e30"),
        (base.clone().with_eps(1e-31), "eps", "1e-31"),
        (base.clone().with_grad_clip(1e7), "grad_clip", "10000000"),
        (base.clone().with_weight_decay(2.0), "weight_decay", "2"),
        (base.clone().with_min_lr(1.0), "min_lr", "1"),
        (base.clone().with_beta1(1.0), "beta1", "1"),
        (base.clone().with_beta2(-0.1), "beta2", "-0.1"),
        (base.clone().with_eps(0.0), "eps", "0"),
        (base.clone().with_weight_decay(-0.1), "weight_decay", "-0.1"),
        (base.clone().with_grad_clip(-1.0), "grad_clip", "-1"),
        (sgd(1.0, 0.0, false), "optimizer.momentum", "1"),
        (sgd(-0.5, 0.0, false), "optimizer.momentum", "-0.5"),
        (sgd(0.9, 1.5, false), "optimizer.dampening", "1.5"),
        (sgd(0.0, 0.0, true), "optimizer.nesterov", "true"),
        (sgd(0.9, 0.1, true), "optimizer.nesterov", "true"),
        (
            rms(OptimizerSettings {
                alpha: 1.0,
                ..Default::default()
            }),
            "optimizer.alpha",
            "1",
        ),
        (
            rms(OptimizerSettings {
                centered: true,
                momentum: 0.9,
                ..Default::default()
            }),
            "optimizer.centered",
            "true",
        ),
        (
            base.clone().with_optimizer(OptimizerSettings {
                kind: OptimizerKind::AdaGrad,
                lr_decay: -1.0,
                ..Default::default()
            }),
            "optimizer.lr_decay",
            "-1",
        ),
        // A kind-specific value for a kind that does not use it.
        (
            base.clone().with_optimizer(OptimizerSettings {
                momentum: 0.9,
                ..Default::default()
            }),
            "optimizer.momentum",
            "0.9",
        ),
        (wsd(2, 0), "optimizer.decay_steps", "0"),
        (wsd(10, 11), "optimizer.decay_steps", "11"),
        (
            base.clone().with_optimizer(
                OptimizerSettings::default().with_schedule(LrScheduleKind::Linear, 3),
            ),
            "optimizer.decay_steps",
            "3",
        ),
        (
            base.clone().with_warmup_steps(21).with_optimizer(
                OptimizerSettings::default().with_schedule(LrScheduleKind::Constant, 0),
            ),
            "warmup_steps",
            "21",
        ),
    ];
    for (s, key, value) in cases {
        let e = check_settings(&s).expect_err(key);
        assert_eq!((e.key.as_str(), e.value.as_str()), (key, value), "{e}");
        let shown = e.to_string();
        assert!(shown.contains(key) && shown.contains(value), "{shown}");
    }
    // Cosine warm-up longer than the run is the short-run case it has always allowed.
    assert_eq!(check_settings(&base.clone().with_warmup_steps(30)), Ok(()));
    assert_eq!(check_settings(&wsd(10, 10)), Ok(()));
}

#[test]
fn kinds_are_named_and_the_ones_not_offered_say_why() {
    for k in OptimizerKind::ALL {
        let json = serde_json::to_string(&k).unwrap();
        assert_eq!(json, format!("\"{}\"", k.name()));
        assert_eq!(serde_json::from_str::<OptimizerKind>(&json).unwrap(), k);
    }
    for (name, why) in [
        ("lbfgs", "closure"),
        ("adan", "four state tensors"),
        ("lion", "Known: adamw, adam, sgd, adagrad, rmsprop, muon"),
    ] {
        let e = serde_json::from_str::<OptimizerKind>(&format!("\"{name}\"")).unwrap_err();
        assert!(e.to_string().contains(why), "{e}");
    }
    let s: OptimizerSettings = serde_json::from_str(r#"{"kind": "sgd", "momentum": 0.5}"#).unwrap();
    assert_eq!(s, OptimizerSettings::sgd(0.5, 0.0, false));
}

/// The checkpoint reader's state checks ([`crate::checkpoint`]) place every state each
/// optimizer keeps.
#[test]
fn the_state_checks_know_every_optimizer_s_state() {
    use crate::checkpoint::{COUNTING_OPTIMIZERS, NON_NEGATIVE_STATE};
    use crate::train::{OptimizerKind, OptimizerSettings};
    // Every state an optimizer keeps is either checked as non-negative or may have either
    // sign; a new optimizer (or state) must be placed in one of them.
    let signed = [
        "first moment",
        "momentum buffer",
        "gradient average",
        "first moment or momentum buffer",
        "-",
    ];
    let kinds = OptimizerKind::ALL;
    for kind in kinds {
        for (momentum, centered) in [(0.0, false), (0.9, false), (0.0, true)] {
            let s = OptimizerSettings {
                momentum,
                centered,
                ..OptimizerSettings::default().with_kind(kind)
            };
            for slot in s.state_slots() {
                assert!(
                    NON_NEGATIVE_STATE.contains(&slot) || signed.contains(&slot),
                    "{kind:?}: {slot}"
                );
            }
        }
    }
    assert!(
        COUNTING_OPTIMIZERS
            .iter()
            .all(|k| kinds.iter().any(|o| o.name() == *k))
    );
}

#[derive(Module, Debug)]
struct Pair<B: Backend> {
    wide: Param<Tensor<B, 2>>,
    tall: Param<Tensor<B, 2>>,
}

/// Three steps of merak's Muon agree with PyTorch's `torch.optim.Muon` on a wide and a tall
/// matrix (`scripts/muon-fixture.py`): within 1e-5 of its step with the Newton-Schulz
/// iterations in float32, and within bfloat16's precision of the step as PyTorch runs it.
#[test]
fn muon_agrees_with_pytorch() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/muon/torch.json"
    );
    let f: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let floats = |v: &serde_json::Value| -> Vec<f64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    };
    let dev = Default::default();
    let tensor = |k: &str, v: &serde_json::Value| {
        let shape: Vec<usize> = floats(&f["shapes"][k])
            .iter()
            .map(|x| *x as usize)
            .collect();
        let v: Vec<f32> = floats(v).iter().map(|x| *x as f32).collect();
        Tensor::<AB, 2>::from_data(TensorData::new(v, [shape[0], shape[1]]), &dev)
    };
    let mut pair = Pair {
        wide: Param::from_tensor(tensor("wide", &f["start"]["wide"])),
        tall: Param::from_tensor(tensor("tall", &f["start"]["tall"])),
    };
    let o = OptimizerSettings::default().with_kind(OptimizerKind::Muon);
    let s = settings(o);
    let mut optim = GroupOptim::<Pair<AB>, AB>::new(&s, 0.1, matrix(&s), local());
    for (step, lr) in floats(&f["lrs"]).into_iter().enumerate() {
        let g = &f["grads"][step];
        let loss = (pair.wide.val() * tensor("wide", &g["wide"])).sum()
            + (pair.tall.val() * tensor("tall", &g["tall"])).sum();
        let grads = GradientsParams::from_grads(loss.backward(), &pair);
        pair = optim.step(lr, pair, grads);
        for (k, p) in [("wide", &pair.wide), ("tall", &pair.tall)] {
            let got: Vec<f64> = (p.val().into_data().into_vec::<f32>().unwrap())
                .into_iter()
                .map(f64::from)
                .collect();
            assert_close(
                &format!("{k} step {step}"),
                &got,
                &floats(&f["fp32"][step][k]),
            );
            let bf16 = floats(&f["bf16"][step][k]);
            for (i, (a, b)) in got.iter().zip(&bf16).enumerate() {
                assert!(
                    (a - b).abs() <= 2e-3,
                    "{k} step {step} [{i}]: {a} vs bf16 {b}"
                );
            }
        }
    }
}
