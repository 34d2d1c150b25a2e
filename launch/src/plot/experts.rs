//! `experts.svg`: the balance of a mixture of experts' routing per step.

use super::line::{self, Labels, Series};
use super::read::StepRecord;
use super::style::{DrawError, PALETTE};

/// The most loaded expert's assignments over the mean assignments per expert, one series per
/// MoE layer (1: balanced; `experts / top_k`: every token to one expert), from each record's
/// `expert_tokens`.
pub fn chart(run: &str, records: &[StepRecord]) -> Result<String, DrawError> {
    let layers = (records.iter())
        .filter_map(|r| r.expert_tokens.as_ref().map(Vec::len))
        .max()
        .unwrap_or(0);
    let series: Vec<Series> = (0..layers)
        .filter_map(|layer| {
            let points: Vec<(u64, f64)> = (records.iter())
                .filter_map(|r| {
                    Some((
                        r.step,
                        max_over_mean(r.expert_tokens.as_ref()?.get(layer)?)?,
                    ))
                })
                .collect();
            (!points.is_empty()).then(|| Series {
                name: format!("layer {layer}"),
                colour: PALETTE[layer % PALETTE.len()],
                points,
                markers: false,
            })
        })
        .collect();
    let title = format!("Expert balance ({run}): most loaded expert / mean");
    let labels = Labels {
        title: &title,
        y: "max / mean",
        from_zero: true,
    };
    line::line_chart(&labels, &series)
}

/// The largest of `loads` over their mean; `None` for a layer without assignments (a dense
/// block).
fn max_over_mean(loads: &[u64]) -> Option<f64> {
    let total: u64 = loads.iter().sum();
    let max = *loads.iter().max()?;
    (total > 0).then(|| max as f64 * loads.len() as f64 / total as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balance_is_the_most_loaded_expert_over_the_mean() {
        assert_eq!(max_over_mean(&[2, 2, 2, 2]), Some(1.0));
        assert_eq!(max_over_mean(&[8, 0, 0, 0]), Some(4.0));
        assert_eq!(max_over_mean(&[0, 0]), None);
        let record = |step, loads: Vec<Vec<u64>>| StepRecord {
            step,
            loss: None,
            val_loss: None,
            tokens_per_s: None,
            expert_tokens: Some(loads),
        };
        let svg = chart(
            "r",
            &[
                record(1, vec![vec![3, 1], vec![0, 0]]),
                record(2, vec![vec![2, 2], vec![1, 3]]),
            ],
        )
        .expect("drawn");
        assert!(svg.contains("layer 0") && svg.contains("layer 1"), "{svg}");
    }
}
