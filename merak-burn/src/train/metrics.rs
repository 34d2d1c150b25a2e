//! Metrics as JSON lines.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use serde::Serialize;

/// What one optimizer step reports.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct StepMetrics {
    /// 1-based step number.
    pub step: usize,
    /// Mean training loss of the step's global batch.
    pub loss: f64,
    /// Learning rate used by the step.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Tokens of the global batch per second of wall time.
    pub tokens_per_s: f64,
    /// Wall time of the step in seconds.
    pub step_time_s: f64,
    /// Time spent waiting for data-parallel all-reduces after the backward pass (the
    /// communication the backward pass did not hide).
    pub dp_exposed_comm_s: f64,
    /// Gradient buckets whose all-reduce started during the backward pass.
    pub dp_overlapped_buckets: usize,
    /// Gradient buckets in all.
    pub dp_buckets: usize,
    /// Minor page faults of this rank during the step (memory mapped and zeroed by the kernel:
    /// near 0 once buffers are reused).
    pub minor_faults: u64,
    /// Reads of tensors into host memory during the step on rank 0 (each waits for the
    /// device on a GPU; [`crate::host_read`]): 1 at one rank (the losses with the gradient
    /// norm's sums).
    pub host_reads: u64,
    /// On a GPU backend: the bytes rank 0's allocator holds on its device at the step's end
    /// ([`FusedOps::memory_reserved`](crate::kernels::FusedOps::memory_reserved)); the largest
    /// over the steps is the run's peak, comparable to PyTorch's
    /// `torch.cuda.max_memory_reserved`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_reserved_bytes: Option<u64>,
    /// Validation loss, on the steps where it is measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// The loss's logged parts by name (already in `loss`), for example each
    /// multi-token-prediction depth's loss, `mtp_1`, `mtp_2`, ….
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_parts: Option<std::collections::BTreeMap<String, f64>>,
    /// Under a mixture of experts: the routers' auxiliary losses (not in `loss`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub aux_loss: Option<f64>,
    /// Under a mixture of experts: the step's assignments to each expert, per MoE layer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert_tokens: Option<Vec<Vec<u64>>>,
    /// Under a mixture of experts: the most loaded expert's assignments over the mean, worst
    /// layer (1: balanced).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert_max_load: Option<f64>,
    /// Under a mixture of experts: the smallest gap between a token's `k`-th and `k + 1`-th
    /// router score (how far the routing was from a tie).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub router_margin: Option<f64>,
    /// Under expert parallelism: seconds rank 0 spent in the step's token all-to-alls
    /// (forward and backward, the rows' host copies and waiting for the other ranks included).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub moe_exchange_s: Option<f64>,
    /// Under a capacity factor: the assignments dropped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dropped_tokens: Option<u64>,
    /// Every rank's wall time of the step, by world rank (the ranks' clocks; rank 0's is
    /// `step_time_s`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rank_step_s: Option<Vec<f64>>,
    /// Every rank's time blocked in communication calls during the step (collectives,
    /// pipeline messages, waits for non-blocking calls), by world rank: a rank's step time
    /// less this is its time computing, which names stragglers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rank_comm_wait_s: Option<Vec<f64>>,
}

/// Appends one JSON object per line to `metrics.jsonl`, flushed after every record.
pub struct MetricsWriter {
    out: BufWriter<File>,
}

impl MetricsWriter {
    /// Creates (truncates) the file.
    pub fn create(path: &Path) -> std::io::Result<Self> {
        Ok(Self {
            out: BufWriter::new(File::create(path)?),
        })
    }

    /// Continues the file of a run resumed after `step` steps: keeps the records of steps
    /// `1..=step` (a run that died after its last checkpoint may have written later ones) and
    /// appends after them.
    pub fn resume(path: &Path, step: usize) -> std::io::Result<Self> {
        let kept: Vec<String> = match std::fs::read_to_string(path) {
            Ok(text) => text
                .lines()
                .filter(|line| {
                    serde_json::from_str::<serde_json::Value>(line)
                        .ok()
                        .and_then(|v| v.get("step").and_then(serde_json::Value::as_u64))
                        .is_some_and(|s| s as usize <= step)
                })
                .map(str::to_string)
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e),
        };
        // Rewritten beside the old file and renamed over it: a crash keeps one or the other.
        let mut text = String::new();
        for line in kept {
            text.push_str(&line);
            text.push('\n');
        }
        crate::checkpoint::write_file_atomically(path, text.as_bytes())
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        let file = std::fs::OpenOptions::new().append(true).open(path)?;
        Ok(Self {
            out: BufWriter::new(file),
        })
    }

    /// Writes one record.
    pub fn write<T: Serialize>(&mut self, record: &T) -> std::io::Result<()> {
        serde_json::to_writer(&mut self.out, record)?;
        self.out.write_all(b"\n")?;
        self.out.flush()
    }
}
