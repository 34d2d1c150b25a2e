//! The layout of the process grid: `world = dp * cp * tp * pp`, TP innermost, then CP, then
//! DP, then PP (the communicators of each axis are built from it by the runtime's process
//! grid, `merak_burn::grid::ProcessGrid`).
//!
//! Rank `r` has coordinates `tp = r % tp`, `cp = (r / tp) % cp`, `dp = (r / (tp cp)) % dp`,
//! `pp = r / (tp cp dp)`, so the ranks of one TP group are neighbours (on a real cluster they
//! share a node).
//!
//! **Context parallelism is folded into data parallelism** for everything that concerns the
//! parameters: the `dp × cp` ranks of a stage hold the same parameters, so their gradients are
//! summed, their optimizer state sharded (ZeRO) and their checkpoints written over one group,
//! the data-parallel group, in which a rank's index is [`Coords::dp`] `= data index × cp + cp
//! index`. Only the data differs: the `cp` ranks of one data-parallel replica read the same
//! samples and each keeps its share of every sequence.

use thiserror::Error;

use crate::planner::TransformerShape;

/// The degrees of parallelism along each axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Layout {
    /// Data-parallel degree.
    pub dp: usize,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Context-parallel degree: the ranks each sequence is cut across (1 in layouts written
    /// before it existed).
    #[serde(default = "one")]
    pub cp: usize,
    /// Pipeline-parallel degree (number of stages).
    pub pp: usize,
}

/// The degree of an axis a stored layout does not name.
fn one() -> usize {
    1
}

/// A layout that cannot run. Every message names the numbers involved.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum LayoutError {
    /// A degree of zero.
    #[error("parallel.{axis} = 0: every degree must be at least 1")]
    Zero {
        /// The axis ("dp", "tp" or "pp").
        axis: &'static str,
    },
    /// The product of the degrees differs from the number of processes.
    #[error(
        "layout dp={dp} x cp={cp} x tp={tp} x pp={pp} = {product} ranks, but the job has {world} \
         processes (launch with mpirun -np {product}, or change the degrees)"
    )]
    WorldSize {
        /// Data-parallel degree.
        dp: usize,
        /// Context-parallel degree.
        cp: usize,
        /// Tensor-parallel degree.
        tp: usize,
        /// Pipeline degree.
        pp: usize,
        /// Their product.
        product: usize,
        /// The number of processes.
        world: usize,
    },
    /// TP does not divide the attention heads.
    #[error(
        "tp={tp} does not divide the number of attention heads ({heads}); choose tp among {choices}"
    )]
    Heads {
        /// The TP degree.
        tp: usize,
        /// The head count.
        heads: usize,
        /// The divisors of the head count.
        choices: String,
    },
    /// TP does not divide the hidden size.
    #[error("tp={tp} does not divide the hidden size ({hidden})")]
    Hidden {
        /// The TP degree.
        tp: usize,
        /// The hidden size.
        hidden: usize,
    },
    /// More pipeline stages than layers.
    #[error(
        "pp={pp} pipeline stages but the model has only {layers} layers (+ embedding and head: at most {} stages)", layers + 2
    )]
    Stages {
        /// The pipeline degree.
        pp: usize,
        /// The layer count.
        layers: usize,
    },
}

fn divisors(n: usize) -> String {
    (1..=n)
        .filter(|d| n.is_multiple_of(*d))
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

impl Layout {
    /// A single process.
    pub const SINGLE: Layout = Layout {
        dp: 1,
        tp: 1,
        cp: 1,
        pp: 1,
    };

    /// The number of ranks this layout needs.
    pub fn world_size(&self) -> usize {
        self.replicas() * self.tp * self.pp
    }

    /// The ranks of a stage that hold the same parameters: `dp × cp`.
    pub fn replicas(&self) -> usize {
        self.dp * self.cp
    }

    /// Checks the layout against the job size and the model, before anything is built.
    pub fn validate(&self, world: usize, model: &TransformerShape) -> Result<(), LayoutError> {
        for (axis, v) in [
            ("dp", self.dp),
            ("cp", self.cp),
            ("tp", self.tp),
            ("pp", self.pp),
        ] {
            if v == 0 {
                return Err(LayoutError::Zero { axis });
            }
        }
        self.check_world(world)?;
        if !model.heads.is_multiple_of(self.tp) {
            return Err(LayoutError::Heads {
                tp: self.tp,
                heads: model.heads,
                choices: divisors(model.heads),
            });
        }
        if !model.hidden.is_multiple_of(self.tp) {
            return Err(LayoutError::Hidden {
                tp: self.tp,
                hidden: model.hidden,
            });
        }
        // The pipeline cuts the embedding, the layers and the head (layers + 2 units).
        if self.pp > model.layers + 2 {
            return Err(LayoutError::Stages {
                pp: self.pp,
                layers: model.layers,
            });
        }
        Ok(())
    }

    /// Checks that the layout's ranks are the job's `world` processes.
    pub fn check_world(&self, world: usize) -> Result<(), LayoutError> {
        if self.world_size() == world {
            return Ok(());
        }
        Err(LayoutError::WorldSize {
            dp: self.dp,
            cp: self.cp,
            tp: self.tp,
            pp: self.pp,
            product: self.world_size(),
            world,
        })
    }

    /// The coordinates of a world rank.
    pub fn coords(&self, rank: usize) -> Coords {
        let replica = (rank / self.tp) % self.replicas();
        Coords {
            tp: rank % self.tp,
            dp: replica,
            cp: replica % self.cp,
            pp: rank / (self.tp * self.replicas()),
        }
    }

    /// The world rank at the given coordinates (`c.dp` is the index among the `dp × cp`
    /// replicas; `c.cp` is not read).
    pub fn rank_of(&self, c: Coords) -> usize {
        c.pp * self.tp * self.replicas() + c.dp * self.tp + c.tp
    }
}

/// A rank's position on each axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Coords {
    /// Index in the data-parallel group, whose `dp × cp` ranks hold the same parameters:
    /// `data index × cp + cp index`.
    pub dp: usize,
    /// Index in the context-parallel group (the part of every sequence this rank holds).
    pub cp: usize,
    /// Pipeline stage.
    pub pp: usize,
    /// Index in the tensor-parallel group.
    pub tp: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: TransformerShape = TransformerShape::gpt(2, 64, 4, 32, 512);

    #[test]
    fn coordinates_put_tp_innermost_and_round_trip() {
        let l = Layout {
            dp: 2,
            tp: 2,
            cp: 1,
            pp: 2,
        };
        assert_eq!(
            l.coords(1),
            Coords {
                dp: 0,
                cp: 0,
                pp: 0,
                tp: 1
            }
        );
        assert_eq!(
            l.coords(2),
            Coords {
                dp: 1,
                cp: 0,
                pp: 0,
                tp: 0
            }
        );
        assert_eq!(
            l.coords(4),
            Coords {
                dp: 0,
                cp: 0,
                pp: 1,
                tp: 0
            }
        );
        for r in 0..8 {
            assert_eq!(l.rank_of(l.coords(r)), r);
        }
        // Context parallelism sits between TP and DP; its ranks count among the replicas.
        let l = Layout {
            dp: 2,
            tp: 2,
            cp: 2,
            pp: 2,
        };
        let c = l.coords(6);
        assert_eq!((c.tp, c.cp, c.dp, c.pp), (0, 1, 3, 0));
        assert_eq!((c.dp / l.cp, l.coords(9).pp), (1, 1));
        for r in 0..16 {
            assert_eq!(l.rank_of(l.coords(r)), r);
        }
    }

    #[test]
    fn bad_layouts_name_their_numbers() {
        let e = Layout {
            dp: 1,
            tp: 3,
            cp: 1,
            pp: 1,
        }
        .validate(3, &SHAPE)
        .unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("tp=3") && msg.contains("attention heads (4)"),
            "{msg}"
        );
        let e = Layout {
            dp: 2,
            tp: 2,
            cp: 1,
            pp: 1,
        }
        .validate(3, &SHAPE)
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("= 4 ranks, but the job has 3 processes"),
            "{e}"
        );
        let e = Layout {
            dp: 0,
            tp: 1,
            cp: 1,
            pp: 1,
        }
        .validate(1, &SHAPE)
        .unwrap_err();
        assert_eq!(e, LayoutError::Zero { axis: "dp" });
        let e = Layout {
            dp: 1,
            tp: 1,
            cp: 1,
            pp: 5,
        }
        .validate(5, &SHAPE)
        .unwrap_err();
        assert_eq!(e, LayoutError::Stages { pp: 5, layers: 2 });
        assert!(e.to_string().contains("at most 4 stages"), "{e}");
        let odd = TransformerShape::gpt(2, 6, 2, 32, 512);
        // heads divisible by 2 but hidden 6 is not divisible by... 6 % 2 == 0, use tp=4 heads=4.
        let e = Layout {
            dp: 1,
            tp: 4,
            cp: 1,
            pp: 1,
        }
        .validate(
            4,
            &TransformerShape {
                heads: 4,
                hidden: 6,
                ..odd
            },
        )
        .unwrap_err();
        assert_eq!(e, LayoutError::Hidden { tp: 4, hidden: 6 });
        assert!(
            Layout {
                dp: 1,
                tp: 4,
                cp: 1,
                pp: 2
            }
            .validate(8, &SHAPE)
            .is_ok()
        );
    }
}
