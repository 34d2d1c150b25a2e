//! `merak train`: parse, resolve the config and plan, build this rank's model, call the
//! library's trainer, print.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Result, bail};
use burn::module::AutodiffModule;
use merak_burn::checkpoint::Checkpoint;
use merak_burn::comm::{Communicator, MpiCommunicator, MpiWorld, launched_by_mpirun};
use merak_burn::entry::{InitWeights, RunError, RunOn};
use merak_burn::parallel_plan::ParallelPlan;
use merak_burn::train::attempts::ATTEMPTS_FILE;
use merak_burn::train::run_folder::{missing_folders, output_folder, remove_if_empty};
use merak_burn::train::{ExistingRun, Origin, RunFolders, RunLocks};

use crate::config::Config;
use crate::data::Source;
use crate::describe::describe;
use crate::resolve::{Resolved, read_resume, resolve_config};
use crate::train::{self, Objective, Resume, RunSpec, Summary};
pub use crate::train_args::{STOPPED, TrainArgs};
use crate::{generate, init_from, init_logging, plot, spawn};

/// What every rank has checked and built before training starts.
struct Job {
    /// The output folder.
    out: PathBuf,
    /// What to do with folders that hold another run.
    existing: ExistingRun,
    /// The resolved config.
    cfg: Config,
    /// The parallel plan.
    parallel: ParallelPlan,
    /// This rank's device and the grid's transport.
    placement: crate::transport::Placement,
    /// This process's rank.
    rank: usize,
    /// The data set, opened and checked.
    data: Source,
    /// The checkpoint to continue from, read and verified.
    resume: Option<Resume>,
    /// Pretrained weights to start from (`--init-from`), read and checked.
    init_from: Option<init_from::Pretrained>,
    /// The locks of the output and checkpoint folders (rank 0's; joined under a launcher),
    /// released when the job is dropped.
    _locks: RunLocks,
}

/// `merak train`: under mpirun every rank runs this; `--np N` outside mpirun starts the ranks.
pub fn run_train(args: TrainArgs) -> ExitCode {
    if let Some(np) = args.np {
        return spawn::launch(np, &args);
    }
    if launched_by_mpirun() && std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // One compute thread per rank: ranks share the machine's cores.
        // SAFETY: still single-threaded here; nothing else reads the environment concurrently.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", "1") };
    }
    let mpi = if launched_by_mpirun() {
        match MpiWorld::init() {
            Ok(w) => Some(w),
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
        }
    } else {
        None
    };
    let world = mpi.as_ref().map(|w| w.world());
    let (rank, size) = world.as_ref().map_or((0, 1), |w| (w.rank(), w.size()));
    init_logging(rank);
    let mut job = match prepare(&args, world, size) {
        Ok(job) => job,
        // Errors that every rank detects identically (config, layout, data): rank 0 reports,
        // all exit 2. A rank's own device error is reported by that rank.
        Err(e) => {
            if crate::transport::is_rank_specific(&e) && size > 1 {
                eprintln!("error: rank {rank}: {}", describe(&e));
            } else if rank == 0 {
                eprintln!("error: {}", describe(&e));
            }
            return ExitCode::from(2);
        }
    };
    let ran = run(&mut job, mpi.as_ref(), args.trace.as_deref());
    // The run folders' locks go before the process does (an abort skips destructors).
    drop(job);
    match (ran, mpi) {
        (Ok(false), _) => ExitCode::SUCCESS,
        (Ok(true), _) => ExitCode::from(STOPPED),
        (Err(e), Some(mpi)) if size > 1 => mpi.abort(i32::from(exit_status(&e)), &describe(&e)),
        (Err(e), _) => {
            eprintln!("error: {}", describe(&e));
            ExitCode::from(exit_status(&e))
        }
    }
}

/// The exit status of a run that failed with `e`: the library's
/// ([`RunError::exit_status`]: 2 for bad input found before training), 1 for a failure of
/// `merak train`'s own after training.
fn exit_status(e: &anyhow::Error) -> u8 {
    e.chain()
        .find_map(|e| e.downcast_ref::<RunError>())
        .map_or(1, RunError::exit_status)
}

/// Reads and checks everything before anything is built: the config and plan (with the
/// checkpoint's manifest when resuming), the output folders, locked by rank 0 before anything
/// in them is read or written (the checkpoint's tensors are read after), this rank's device
/// and the grid's transport, the data set. A run refused here leaves no folder it made
/// behind; the library's run builds the grid and the model.
fn prepare(args: &TrainArgs, world: Option<MpiCommunicator>, size: usize) -> Result<Job> {
    let checkpoint = args.resume.as_deref().map(Checkpoint::open).transpose()?;
    let resolved = resolve_config(args, world.as_ref(), size, checkpoint.as_ref())?;
    let out = output_folder(
        args.out.as_deref(),
        checkpoint.as_ref(),
        world.as_ref().map(|w| w as &dyn Communicator),
    )?;
    let root = train::checkpoint_root(&resolved.cfg, &out);
    let made = missing_folders(&[&out, &root]);
    let job = lock_folders(world.as_ref(), &out, &root).and_then(|locks| {
        let resume = checkpoint.map(read_resume).transpose()?;
        if let Some(max) = args.max_restarts {
            merak_burn::train::attempts::may_restart(&out, max, resume.is_some())?;
        }
        let folders = (out, root.as_path());
        check_and_open(args, world, resume, resolved, folders, locks)
    });
    if job.is_err() {
        // The locks went with the refused job: what is left of the folders it made is empty.
        remove_if_empty(&made);
    }
    job
}

/// Rank 0 locks the output and checkpoint folders (joining its launcher's locks under
/// `merak train --np`); every rank gets the outcome.
fn lock_folders(world: Option<&MpiCommunicator>, out: &Path, root: &Path) -> Result<RunLocks> {
    // A file where a folder goes is named as such before a lock is made in it.
    merak_burn::train::not_a_file(out, "output folder (--out)")?;
    merak_burn::train::not_a_file(root, "checkpoint folder (checkpoint.dir)")?;
    let folders = [out, root];
    Ok(match world {
        Some(w) => RunLocks::on_rank_zero(w, &folders)?,
        None => RunLocks::acquire(&folders)?,
    })
}

/// [`prepare`] once the config and the output folder are known.
fn check_and_open(
    args: &TrainArgs,
    world: Option<MpiCommunicator>,
    resume: Option<Resume>,
    resolved: Resolved,
    (out, root): (PathBuf, &Path),
    locks: RunLocks,
) -> Result<Job> {
    let Resolved {
        cfg,
        plan_file,
        parallel,
        pipeline,
    } = resolved;
    let rank = world.as_ref().map_or(0, |w| w.rank());
    let existing = match (args.replace, args.branch) {
        (true, _) => ExistingRun::Replace,
        (_, true) => ExistingRun::Branch,
        _ => ExistingRun::Refuse,
    };
    // Read-only here (every rank, before anything is built); `Trainer::fit` claims for real.
    let own = train::own_file_names();
    let origin = resume.as_ref().map(|r| Origin::of(&r.checkpoint));
    let folders = RunFolders {
        out: &out,
        checkpoints: Some(root),
        own_files: &own,
    };
    merak_burn::train::claim(folders, origin.as_ref(), existing)?;
    let init_from = args
        .init_from
        .as_deref()
        .map(|path| init_from::open(path, &cfg, rank == 0))
        .transpose()?;
    if let (0, Some(f)) = (rank, plan_file) {
        log_plan(&f);
    }
    let placement = crate::transport::place(&cfg, world.as_ref())?;
    let estimate = crate::admission::check(&cfg, &parallel, &pipeline, placement.device)?;
    if let Some(e) = estimate.filter(|_| rank == 0) {
        crate::admission::log_estimate(&e);
    }
    let data = crate::data::open(&cfg)?;
    // Last: besides rank 0's locks, the only check that makes folders (rank 0 removes what
    // is left empty of the folders a refused run made).
    check_outputs(args, &out, root, rank)?;
    if rank == 0 {
        tracing::info!("data: {}", data.describe());
    }
    Ok(Job {
        out,
        existing,
        cfg,
        parallel,
        placement,
        rank,
        data,
        resume,
        init_from,
        _locks: locks,
    })
}

/// Logs the plan file's layout and predicted step.
fn log_plan(f: &merak_burn::planner::PlanFile) {
    let l = &f.plan.layout;
    tracing::info!(
        "plan: dp={} tp={} pp={} v={} micro_batch={} {} stages {:?} recompute {:?} {}; predicted step {:.4} s on {}",
        l.dp,
        l.tp,
        l.pp,
        l.virtual_stages,
        l.micro_batch,
        l.schedule,
        l.partition.sizes(),
        l.recompute.iter().map(|m| m.as_str()).collect::<Vec<_>>(),
        l.zero_label(),
        f.plan.prediction.step_time_s,
        f.hardware
    );
}

/// Checks every path the run will write (the output folder, the checkpoint folder, the trace)
/// before anything is built, on every rank.
fn check_outputs(args: &TrainArgs, out: &Path, checkpoints: &Path, rank: usize) -> Result<()> {
    merak_burn::train::writable_dir(out, "output folder (--out)", rank)?;
    merak_burn::train::writable_dir(checkpoints, "checkpoint folder (checkpoint.dir)", rank)?;
    if let Some(trace) = &args.trace {
        merak_burn::train::writable_file(trace, "trace file (--trace)", rank)?;
    }
    Ok(())
}

/// Trains on the backend the config names (selective recomputation is Burn's balanced
/// checkpointing: the matrix products are kept, memory-bound results recomputed) and reports.
/// Returns whether the run stopped early on a signal.
fn run(job: &mut Job, mpi: Option<&MpiWorld>, trace: Option<&Path>) -> Result<bool> {
    let rank = job.rank;
    let pp_rank = job.parallel.layout().coords(rank).pp;
    let selective = job.parallel.selective_on_rank(pp_rank);
    let summary = match job.cfg.train.device.as_str() {
        "cpu" if selective => {
            type B = merak_burn::backend::CpuAutodiffSelective;
            train_model::<B>(job, mpi, Default::default(), trace)?
        }
        "cpu" => {
            type B = merak_burn::backend::CpuAutodiff;
            train_model::<B>(job, mpi, Default::default(), trace)?
        }
        #[cfg(feature = "cuda")]
        "cuda" => {
            type B = burn::backend::Autodiff<burn_cuda::Cuda<f32>>;
            let device = job.placement.device.map_or(0, |d| d.ordinal);
            train_model::<B>(job, mpi, cuda_device(rank, device)?, trace)?
        }
        #[cfg(feature = "wgpu")]
        "wgpu" => {
            type B = burn::backend::Autodiff<merak_burn::backend::Wgpu>;
            train_model::<B>(job, mpi, wgpu_device(rank)?, trace)?
        }
        other => bail!(
            "train.device = {other:?} is not available in this build (rebuild with --features \
             {other})"
        ),
    };
    if rank == 0 {
        print_summary(&summary, &job.out, trace)?;
    }
    Ok(summary.stopped)
}

/// The wgpu adapter this rank trains on, after the self-test of its kernels; a warning when it
/// is a software driver on the CPU.
#[cfg(feature = "wgpu")]
fn wgpu_device(rank: usize) -> Result<merak_burn::backend::WgpuDevice> {
    use merak_burn::wgpu_device::{choose_adapter, self_test};
    let adapter = choose_adapter()?;
    log_self_test(
        rank,
        &format!("wgpu adapter {adapter}"),
        &self_test(&adapter)?,
    );
    if adapter.is_cpu() {
        tracing::warn!(
            "rank {rank}: the wgpu adapter {} is a software driver on the CPU: correct but far \
             slower than train.device = \"cpu\"",
            adapter.name
        );
    }
    Ok(adapter.device)
}

/// CUDA device `ordinal`, after the self-test of its kernels (compiled by NVRTC on first use).
#[cfg(feature = "cuda")]
fn cuda_device(rank: usize, ordinal: usize) -> Result<burn_cuda::CudaDevice> {
    use merak_burn::self_test::{CUDA_SELF_TEST_TOLERANCE, self_test};
    let device = burn_cuda::CudaDevice::new(ordinal);
    let test = self_test::<burn_cuda::Cuda<f32>>(&device, CUDA_SELF_TEST_TOLERANCE)
        .map_err(|e| anyhow::anyhow!("train.device = \"cuda\" (GPU {ordinal}): {e}"))?;
    log_self_test(rank, &format!("CUDA GPU {ordinal}"), &test);
    Ok(device)
}

/// Logs a passed self-test of the GPU `device`.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn log_self_test(rank: usize, device: &str, test: &merak_burn::self_test::SelfTest) {
    tracing::info!(
        "rank {rank}: {device}; self-test passed ({} checks, largest relative difference from \
         the CPU {:.1e})",
        test.differences.len(),
        test.largest_difference()
    );
}

/// Rank 0's closing lines: the summary and where each chart of the run went (drawn into `out`
/// from its metrics, its memory report and the Chrome trace at `trace`, when there is one). A
/// chart that cannot be drawn is a warning, not a failed run: training, metrics and
/// checkpoints are complete by then.
fn print_summary(summary: &Summary, out: &Path, trace: Option<&Path>) -> Result<()> {
    let charts = plot::write_charts(out, trace).unwrap_or_else(|e| {
        tracing::warn!(
            "the run's charts were not drawn: {e}; its metrics and checkpoints are complete"
        );
        Vec::new()
    });
    tracing::info!(
        "done: {} steps, final loss {:.5}, mean {:.0} tokens/s, wall {:.1}s; metrics in {}",
        summary.steps,
        summary.final_loss,
        summary.mean_tokens_per_s,
        summary.wall_s,
        out.join("metrics.jsonl").display()
    );
    for chart in &charts {
        tracing::info!("{}: {}", chart.what, chart.path.display());
    }
    if let Some(goodput) = &summary.goodput {
        tracing::info!("{goodput}; {}", out.join(ATTEMPTS_FILE).display());
    }
    if summary.stopped {
        tracing::warn!(
            "stopped on a signal after step {}, checkpointed: continue with --resume (exit status {STOPPED})",
            summary.steps
        );
    }
    if summary.skipped > 0 {
        tracing::warn!(
            "{} steps were skipped for a non-finite loss",
            summary.skipped
        );
    }
    Ok(())
}

/// Trains the model of the job (a GPT or a BERT) on `device` through the library's front
/// door, which builds this rank's pipeline stages and TP shard; a GPT trained at pp = 1 then
/// prints a sample.
fn train_model<B>(
    job: &mut Job,
    mpi: Option<&MpiWorld>,
    device: B::Device,
    trace: Option<&Path>,
) -> Result<Summary>
where
    B: merak_burn::pipeline::TrainBackend,
{
    let init = job.init_from.take().map(|p| InitWeights {
        source: format!("--init-from {}", p.path.display()),
        params: p.params,
    });
    let (cfg, data) = (&job.cfg, &job.data);
    let spec = RunSpec {
        out: &job.out,
        parallel: &job.parallel,
        trace,
        existing: job.existing,
        init,
        signals: true,
    };
    let launch = RunOn::<B> {
        mpi,
        device: device.clone(),
        transport: job.placement.transport,
        resume: job.resume.as_ref().map(|r| (&r.checkpoint, &r.state)),
    };
    if cfg.model.kind == "bert" {
        let bert = cfg.bert();
        let objective = Objective::Masked(bert.clone());
        let trained = train::train(launch, cfg, data, &bert, &objective, spec)?;
        return Ok(trained.report.summary);
    }
    let trained = train::train(launch, cfg, data, &cfg.model.gpt, &Objective::Causal, spec)?;
    let (summary, grid) = (trained.report.summary, trained.grid);
    if cfg.train.sample_tokens == 0 || summary.stopped {
        return Ok(summary);
    }
    if grid.layout.pp > 1 {
        if grid.rank == 0 {
            tracing::info!(
                "no sample under pp > 1: use `merak generate --checkpoint` on the checkpoint"
            );
        }
    } else {
        // Samples of any length: whole sequences on every TP rank.
        let model = (trained.part.valid().with_sequence_parallel(false))
            .with_context_parallel(merak_burn::comm::Group::local(), Default::default())?;
        generate::print_sample(cfg, data, &grid, &model, &device)?;
    }
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chart that cannot be drawn (here: no metrics to draw from) does not fail a run that
    /// trained.
    #[test]
    fn a_chart_that_cannot_be_drawn_does_not_fail_the_run() {
        let dir = tempfile::tempdir().expect("a scratch folder");
        let summary = Summary {
            steps: 2,
            final_loss: 1.0,
            mean_tokens_per_s: 10.0,
            wall_s: 0.1,
            skipped: 0,
            stopped: false,
            goodput: None,
        };
        assert!(plot::write_charts(dir.path(), None).is_err());
        print_summary(&summary, dir.path(), None).expect("a finished run");
    }
}
